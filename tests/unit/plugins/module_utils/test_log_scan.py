"""The incremental cell-log scan: signatures and their decoys, progress, cursors across ticks, odd files."""

from __future__ import annotations

import base64
import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _log_scan
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    compile_progress,
    compile_signatures,
    load_cursor,
    save_cursor,
    scan_log,
)

SIGNATURES = compile_signatures([])
PROGRESS = compile_progress(None)
Scan = Tuple[Dict[str, Any], Optional[Dict[str, Any]]]


def tick(log: Path, cursor: Optional[Dict[str, Any]] = None, **more: Any) -> Scan:
    signatures = more.pop("signatures", SIGNATURES)
    progress = more.pop("progress", PROGRESS)
    scan, new = scan_log(str(log), cursor, signatures, progress, **more)
    json.dumps(scan), json.dumps(new)  # both travel as JSON (probe child, cursor file)
    return scan, new


def found(scan: Dict[str, Any]) -> Dict[str, Tuple[int, str]]:
    return {entry["signature"]: (entry["count"], entry["first_line"]) for entry in scan["signatures"]}


def names_in(tmp_path: Path, text: str) -> List[str]:
    log = tmp_path / "log"
    log.write_text(text + "\n")
    return sorted(found(tick(log)[0]))


def append(log: Path, data: bytes) -> None:
    with open(log, "ab") as handle:
        handle.write(data)


# ---------------------------------------------------------------------------------------------------------------
# Signatures and decoys
# ---------------------------------------------------------------------------------------------------------------
MATCHES = [
    ("python_traceback", "Traceback (most recent call last):"),
    ("python_traceback", "[rank3]: Traceback (most recent call last):"),
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.1 GiB"),
    ("cuda_oom", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB"),
    ("cuda_oom", "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ("cuda_oom", "RuntimeError: CUDA error: out of memory"),
    ("cuda_oom", "jaxlib.xla_extension.XlaRuntimeError: INTERNAL: CUDA_ERROR_OUT_OF_MEMORY: out of memory"),
    ("killed", "Killed"),
    ("killed", "  Killed  "),
    ("killed", "/data/runs/sweep/cells/a/run.sh: line 3: 48213 Killed                  python train.py"),
    ("killed", "[ 9121.553] Out of memory: Killed process 48213 (python) total-vm:98123456kB"),
    ("killed", "[ 9121.553] Out of memory: Kill process 48213 (python) score 987 or sacrifice child"),
    ("killed", "[ 9121.550] python invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), order=0"),
    ("killed", "Job exited with code 137"),
    ("killed", "command terminated with exit code 137"),
    ("killed", "subprocess.CalledProcessError: Command '['python', 'x.py']' returned non-zero exit status 137."),
    ("killed", "    exitcode  : -9 (pid: 48213)"),
    ("killed", "Child terminated with signal 9 (SIGKILL)"),
    ("killed", "torch.distributed.elastic: worker 48213 died with <Signals.SIGKILL: 9>"),
    ("killed", "RuntimeError: DataLoader worker (pid 48213) is killed by signal: Killed."),
    ("disk_full", "OSError: [Errno 28] No space left on device: '/data/runs/sweep/cells/a/latest.pth'"),
    ("disk_full", "RuntimeError: [enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file"),
    ("disk_full", "RuntimeError: basic_ios::clear: iostream error"),
    ("disk_full", "OSError: [Errno 122] Disk quota exceeded"),
    ("disk_full", "write /data/x: no space left on device"),
    (
        "nccl_timeout",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4711, OpType=ALLREDUCE, "
        "NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600036 milliseconds before timing out.",
    ),
    ("nccl_timeout", "[E ProcessGroupNCCL.cpp:475] [Rank 3] Some NCCL operations have failed or timed out."),
    ("nccl_timeout", "node1:4821:4900 [0] NCCL WARN Timeout waiting for connection from peer 2"),
    ("nccl_error", "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275, internal error"),
    ("nccl_error", "ncclSystemError: System call (e.g. socket, malloc) or external library call failed"),
    ("nccl_error", "ncclInternalError: Internal check failed."),
    ("nccl_error", "ncclUnhandledCudaError: Call to CUDA function failed."),
    ("nccl_error", "node1:4821:4900 [0] NCCL WARN Cuda failure 'out of memory'"),
    ("cuda_illegal_memory_access", "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("cuda_illegal_memory_access", "XlaRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: operation failed"),
    ("cuda_illegal_memory_access", "cudaErrorIllegalAddress: an illegal memory access was encountered"),
    ("ecc_uncorrectable", "RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    ("ecc_uncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered"),
    ("nan_loss", "epoch 1/inf step 2/3 loss nan"),
    ("nan_loss", "step 40 loss=NaN lr=3e-4"),
    ("nan_loss", "{'loss': nan, 'grad_norm': 1.2, 'learning_rate': 0.0001, 'epoch': 0.5}"),
    ("nan_loss", "train/loss: inf"),
    ("nan_loss", "iter 12 loss -inf"),
    ("nan_loss", "WARNING: Loss is NaN, skipping batch"),
    ("nan_loss", "step 7 grad_norm: nan"),
    ("nan_loss", "val_loss: tensor(nan, device='cuda:0')"),
    ("nan_loss", '{"train_loss": Infinity, "step": 9}'),
    ("nan_loss", "loss: inf"),  # no best-so-far key: a diverged loss
    ("nan_loss", "best_val_loss: -inf"),  # only +inf is the initial best-so-far
    ("nan_loss", "best_loss: nan"),
    ("nan_loss", "step 9 best_loss: inf loss: nan"),
    ("nan_loss", "val_loss: inf best_val_loss: inf"),
    ("nan_loss", "best_val_loss: 0.52 loss: inf"),  # "best" names the earlier key, not this one
    ("segfault", "Segmentation fault (core dumped)"),
    ("segfault", "Fatal Python error: Segmentation fault"),
    ("segfault", "worker 3 died with <Signals.SIGSEGV: 11>"),
    ("segfault", "ERROR: Unexpected segmentation fault encountered in worker (signal 11)"),
    ("segfault", "Aborted (core dumped)"),
    ("segfault", "Process exited with code 139"),
]


@pytest.mark.parametrize(("signature", "line"), MATCHES, ids=[f"{s}-{i}" for i, (s, _l) in enumerate(MATCHES)])
def test_each_signature_matches_its_realistic_lines(tmp_path, signature, line):
    log = tmp_path / "log"
    log.write_text(f"epoch 1/2 step 1/3 loss 0.5\n{line}\nepoch 1/2 step 2/3 loss 0.4\n")
    counts = found(tick(log)[0])
    assert counts[signature] == (1, line.strip())


DECOYS = [
    "epoch 3/20 step 120/500 loss 0.4321 mean_abs_error=0.12",
    "eval: error_rate: 0.3 accuracy: 0.97",
    "sanity check: no errors found",
    "Traceback printing is disabled for this run",
    "RuntimeError is raised when the check fails",  # prose, no traceback above it
    "killed 3 stale workers",  # decision: prose about other processes is not the job being SIGKILLed
    "Killed 3 stale workers before the start",
    "DataLoader worker (pid 4242) is killed",  # what a user pattern may catch, not a built-in
    "oom_kill 0",  # memory.events printed by a monitor
    "exit code 0",
    "Process exited with code 1370",
    "signal 90 received",
    "sending SIGTERM to the workers",
    "torch.cuda.empty_cache(); max_memory_allocated: 71.2 GiB",
    "Out of memory errors will be retried",
    "[Errno 2] No such file or directory: 'config.yaml'",
    "disk usage 95% on /data, free space 20 GB",
    "NCCL INFO Using network IB",
    "NCCL version 2.18.1+cuda12.1",
    "export NCCL_DEBUG=WARN NCCL_TIMEOUT=1800",
    "init_process_group(backend='nccl', timeout=timedelta(seconds=1800))",
    "Volatile Uncorr. ECC: 0",
    "ecc_errors_uncorrected: 0",
    "loss 0.52 (nan-safe)",
    "loss_scale: inf",
    "INFO: loss 0.41 nano-batch 4",
    "loss: 0.3 inference time 12 ms info",
    "nan_count=0 inf_count=0",
    "Segmentation of the dataset done: 3 shards",
    "min loss -infinite? no: loss 0.2",
    # an initial best-so-far printed as +inf before the first validation is no diverged loss
    "best_val_loss: inf",
    "best_loss=inf",
    "min_val_loss inf",
    "best metric inf",
    "Epoch 0: best_val_loss: inf, lr: 0.001",
    "{'best_val_loss': inf, 'epoch': 0}",
    "Best validation loss: Infinity",
    "lowest_eval_loss = +inf",
    "val/best_loss: inf",
    "bestValLoss: inf",
    "MIN_LOSS: INF",
    "minimum loss inf",
    # the runner's own lines in a cell log are not the command's
    "[rgt 2025-05-01T12:00:00.123456+00:00] SYNC FAILED: [Errno 28] No space left on device (the scratch copy is kept)",
    "[rgt 2025-05-01T12:00:00.123456+00:00] attempt 1/2 ended by signal 9 (SIGKILL)",
    "[rgt 2025-05-01T12:00:00.123456+00:00] attempt 2/2 exit status 137",
    "[rgt 2025-05-01T12:00:00.123456+00:00] attempt 1/1 ended by signal 11 (SIGSEGV), timeout after 60 s",
]


@pytest.mark.parametrize("line", DECOYS)
def test_decoys_match_no_signature(tmp_path, line):
    assert names_in(tmp_path, line) == []


def test_a_traceback_counts_once_and_shows_its_exception_line(tmp_path):
    log = tmp_path / "log"
    log.write_text(
        "epoch 1/3 step 3/3 loss 0.4\n"
        "Traceback (most recent call last):\n"
        '  File "/data/runs/sweep/train.py", line 156, in <module>\n'
        "    main()\n"
        '  File "/data/runs/sweep/train.py", line 90, in main\n'
        '    raise RuntimeError(f"fake_train: crashed at epoch {epoch} as asked")\n'
        "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "RuntimeError: fake_train: crashed at epoch 1 as asked\n"
    )
    assert found(tick(log)[0]) == {"python_traceback": (1, "RuntimeError: fake_train: crashed at epoch 1 as asked")}


def test_chained_tracebacks_count_each_and_show_the_first_exception(tmp_path):
    log = tmp_path / "log"
    log.write_text(
        "Traceback (most recent call last):\n  File \"a.py\", line 3, in load\nKeyError: 'lr'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "a.py", line 9, in main\n'
        "ValueError: config has no lr\n"
    )
    assert found(tick(log)[0]) == {"python_traceback": (2, "KeyError: 'lr'")}


@pytest.mark.parametrize(
    ("ending", "shown"),
    [
        ("KeyboardInterrupt", "KeyboardInterrupt"),
        (
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory.",
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory.",
        ),
        ("subprocess.CalledProcessError", "subprocess.CalledProcessError"),
        ("socket.timeout: timed out", "socket.timeout: timed out"),
    ],
)
def test_the_exception_line_forms(tmp_path, ending, shown):
    frames = '[rank0]:   File "x.py", line 1, in <module>\n' if ending.startswith("[rank0]") else '  File "x.py"\n'
    log = tmp_path / "log"
    log.write_text(f"Traceback (most recent call last):\n{frames}INFO: retrying\nWARNING: noisy\n{ending}\n")
    assert found(tick(log)[0])["python_traceback"] == (1, shown)


def test_an_exception_line_beyond_60_lines_leaves_the_traceback_line(tmp_path):
    log = tmp_path / "log"
    log.write_text("Traceback (most recent call last):\n" + '  File "x.py"\n' * 60 + "ValueError: too far\n")
    assert found(tick(log)[0])["python_traceback"] == (1, "Traceback (most recent call last):")


def test_the_exception_line_is_found_across_a_chunk_boundary_of_the_same_tick(tmp_path):
    log = tmp_path / "log"
    head = b"Traceback (most recent call last):\n" + b'  File "x.py", line 1\n' * 3
    filler = b"epoch 1/2 step 1/3 loss 0.5\n" * ((_log_scan.CHUNK_BYTES - len(head)) // 28)
    log.write_bytes(filler + head + b"  " + b"x" * (_log_scan.CHUNK_BYTES - len(filler) - len(head)) + b"\n")
    append(log, b"OSError: [Errno 28] No space left on device\n")
    counts = found(tick(log)[0])
    assert counts["python_traceback"] == (1, "OSError: [Errno 28] No space left on device")
    assert counts["disk_full"][0] == 1


def test_a_traceback_finished_on_a_later_tick_keeps_its_traceback_line(tmp_path):
    log = tmp_path / "log"
    log.write_text('Traceback (most recent call last):\n  File "x.py", line 1\n')
    scan, cursor = tick(log)
    append(log, b"ValueError: late\n")
    scan, cursor = tick(log, cursor)
    assert found(scan)["python_traceback"] == (1, "Traceback (most recent call last):")


def test_counts_count_lines_and_the_first_line_is_stripped_and_short(tmp_path):
    log = tmp_path / "log"
    first = "   CUDA out of memory " + "x" * 300
    log.write_text(f"{first}\nCUDA out of memory. CUDA out of memory again\nall fine\nCUDA out of memory\n")
    count, line = found(tick(log)[0])["cuda_oom"]
    assert count == 3 and line == first.strip()[:200] and len(line) == 200


def test_user_patterns_match_per_line_with_their_own_flags(tmp_path):
    signatures = compile_signatures(
        [
            {"name": "dataloader_died", "regex": r"DataLoader worker \(pid \d+\) is killed$"},
            {"name": "hf_hub", "regex": r"(?i)^hfhubhttperror"},
            {"name": "spans", "regex": r"alpha\s+beta"},  # \s could cross a line end; matching stays per line
        ]
    )
    log = tmp_path / "log"
    log.write_text(
        "DataLoader worker (pid 4242) is killed\nDataLoader worker (pid 4243) is killed by signal: Killed.\n"
        "HfHubHTTPError: 502\nthe HfHubHTTPError: 503\nalpha\nbeta\nalpha  beta\n"
    )
    counts = found(tick(log, signatures=signatures)[0])
    assert counts["dataloader_died"] == (1, "DataLoader worker (pid 4242) is killed")
    assert counts["hf_hub"] == (1, "HfHubHTTPError: 502")
    assert counts["spans"] == (1, "alpha  beta")
    assert counts["killed"][0] == 1
    assert [entry["signature"] for entry in tick(log, signatures=signatures)[0]["signatures"]] == [
        "killed",
        "dataloader_died",
        "hf_hub",
        "spans",
    ]  # built-ins first, then the user's, in their order


@pytest.mark.parametrize(
    ("patterns", "why"),
    [
        ([{"name": "mine", "regex": "unclosed ("}], r"crash_patterns\[0\] \(mine\): regex does not compile"),
        ([{"name": "Mine", "regex": "x"}], r"crash_patterns\[0\] \('Mine'\): name must match"),
        ([{"name": "a" * 41, "regex": "x"}], "name must match"),
        ([{"name": "ok\n", "regex": "x"}], "name must match"),
        ([{"name": "killed", "regex": "x"}], r"\(killed\): the name is already used by a built-in"),
        ([{"name": "a", "regex": "x"}, {"name": "a", "regex": "y"}], r"\[1\] \(a\): .*crash_patterns\[0\]"),
        ([{"name": "a", "regex": ""}], "regex must be a non-empty string"),
        ([{"name": "a"}], "regex must be a non-empty string"),
        ([{"name": "a", "regex": "x*"}], "matches an empty line"),
        (["not a dict"], r"crash_patterns\[0\] \(None\)"),
    ],
)
def test_bad_user_patterns_are_refused_naming_the_pattern(patterns, why):
    with pytest.raises(ValueError, match=why) as caught:
        compile_signatures(patterns)
    assert "Traceback" not in str(caught.value) and "\n" not in str(caught.value)


RUNNER = "[rgt 2025-05-01T12:00:00.123456+00:00]"


def test_the_runners_own_lines_count_for_no_signature_and_no_progress(tmp_path):
    signatures = compile_signatures([{"name": "sync", "regex": "SYNC FAILED"}, {"name": "attempt", "regex": "attempt"}])
    progress = compile_progress(r"attempt (?P<step>\d+)/(?P<steps>\d+)")
    log = tmp_path / "log"
    log.write_text(
        f"{RUNNER} attempt 1/3 starting on GPUs 0,1\nattempt 7/9 of the data loader\n"
        f"{RUNNER} attempt 1/3 ended by signal 9 (SIGKILL)\n{RUNNER} attempt 2/3 exit status 137\n"
        f"{RUNNER} SYNC FAILED: [Errno 28] No space left on device (the scratch copy is kept)\n"
        "[rgt no stamp] Killed\n"
    )
    scan = tick(log, signatures=signatures, progress=progress)[0]
    assert found(scan) == {"attempt": (1, "attempt 7/9 of the data loader")}
    assert scan["progress"]["step"] == 7  # not the runner's later "attempt 2/3"


def test_a_runner_line_glued_to_an_unfinished_bar_cuts_the_line(tmp_path):
    log = tmp_path / "log"  # a SIGKILLed command leaves its bar without a line end; the runner writes after it
    log.write_text(
        f"\rEpoch 2:  30%|###  | 60/200 [00:10<00:20, 8.1it/s]{RUNNER} attempt 1/1 ended by signal 9 (SIGKILL)\n"
    )
    scan = tick(log)[0]
    assert found(scan) == {} and (scan["progress"]["epoch"], scan["progress"]["step"]) == (2, 60)
    log.write_text(f"Killed{RUNNER} attempt 1/1 exit status 0\nstep 3/9 loss nan {RUNNER} Segmentation fault\n")
    assert sorted(found(tick(log)[0])) == ["killed", "nan_loss"]


# ---------------------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("epoch 3/20 step 120/500 loss 0.4", (3, 20, 120, 500)),
        ("Epoch 3/20", (3, 20, None, None)),
        ("Epoch [3/20] train_loss=0.31", (3, 20, None, None)),
        ("epoch: 3", (3, None, None, None)),
        ("Epoch 3 of 20", (3, 20, None, None)),
        ("step 120/5000", (None, None, 120, 5000)),
        ("[Step 120/5000] loss 2.31", (None, None, 120, 5000)),
        ("Epoch 3:  45%|████▌     | 90/200 [00:10<00:12, 8.10it/s, loss=0.4]", (3, None, 90, 200)),
        (" 45%|████▌     | 900/2000 [10:00<12:00,  1.50s/it]", (None, None, 900, 2000)),
        ("epoch 1/inf step 2/3 loss nan", (1, None, 2, 3)),
        (" iteration      100/  500000 | consumed samples: 3200", (None, None, 100, 500000)),
    ],
)
def test_the_built_in_progress_markers(tmp_path, line, expected):
    log = tmp_path / "log"
    log.write_text(f"loading the data\n{line}\nsaving latest.pth\n")
    progress = tick(log)[0]["progress"]
    assert (progress["epoch"], progress["epochs_total"], progress["step"], progress["steps_total"]) == expected
    assert progress["line"] == line.strip()


@pytest.mark.parametrize(
    "line",
    [
        "num_epochs: 20 steps_per_epoch=500 max_steps=10000",
        "{'loss': 0.5, 'learning_rate': 0.0001, 'epoch': 0.5}",  # a fractional epoch is no epoch number
        "Map: 100%|██████████| 10000/10000 [00:01<00:00, 8000.00 examples/s]",
        "model.safetensors: 100%|██████████| 4.9G/4.9G [00:10<00:00, 480MB/s]",
        "lr scheduler: step size 0.1",
        "Saving checkpoint for epoch",
    ],
)
def test_progress_decoys_are_no_marker(tmp_path, line):
    log = tmp_path / "log"
    log.write_text(line + "\n")
    assert tick(log)[0]["progress"] is None


def test_the_last_marker_wins_and_a_tick_without_one_keeps_the_remembered_one(tmp_path):
    log = tmp_path / "log"
    log.write_text("".join(f"epoch {e}/5 step {s}/4 loss 0.3\n" for e in (1, 2) for s in range(1, 5)))
    scan, cursor = tick(log)
    assert (scan["progress"]["epoch"], scan["progress"]["step"]) == (2, 4)
    append(log, b"saving latest.pth\nevaluating\n")
    scan, cursor = tick(log, cursor)
    assert scan["read_bytes"] > 0 and scan["progress"]["line"] == "epoch 2/5 step 4/4 loss 0.3"
    append(log, b"epoch 3/5 step 1/4 loss 0.2\n")
    assert tick(log, cursor)[0]["progress"]["epoch"] == 3


def test_tqdm_carriage_returns_make_lines_and_the_bar_being_drawn_is_the_progress(tmp_path):
    log = tmp_path / "log"
    bars = "".join(f"\rEpoch 2:  {p}%|##   | {p * 2}/200 [00:{p:02d}<00:40, 8.1it/s]" for p in (10, 20, 30))
    log.write_bytes(f"Epoch 1: 100%|#####| 200/200 [01:00<00:00, 8.1it/s]\n{bars}".encode())
    scan, cursor = tick(log)
    assert (scan["progress"]["epoch"], scan["progress"]["step"], scan["progress"]["steps_total"]) == (2, 60, 200)
    assert cursor["progress"]["step"] == 40  # the cursor keeps the last finished line; the bar is redrawn
    append(log, b"\rKilled\n")
    scan, cursor = tick(log, cursor)
    assert found(scan) == {"killed": (1, "Killed")} and scan["progress"]["step"] == 60


def test_an_exception_line_naming_an_epoch_is_not_the_progress(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(
        b"epoch 1/2 step 3/3 loss 0.2500\nTraceback (most recent call last):\n"
        b'  File "fake_train.py", line 160, in main\nRuntimeError: fake_train: crashed at epoch 1 as asked\n'
    )
    scan, _cursor = tick(log)
    assert (scan["progress"]["epoch"], scan["progress"]["epochs_total"], scan["progress"]["step"]) == (1, 2, 3)


def test_a_user_progress_regex_maps_its_groups(tmp_path):
    progress = compile_progress(r"it=(?P<step>\d+) of (?P<steps>\d+)(?: ep=(?P<epoch>\w+))?")
    log = tmp_path / "log"
    log.write_text("it=5 of 10 ep=two\nepoch 9/9\n")
    marker = tick(log, progress=progress)[0]["progress"]
    assert marker == {"epoch": None, "epochs_total": None, "step": 5, "steps_total": 10, "line": "it=5 of 10 ep=two"}


@pytest.mark.parametrize(
    ("regex", "why"),
    [
        ("iter (", "progress_regex does not compile"),
        (r"iter (\d+)", "progress_regex needs at least one of the named groups epoch, epochs, step, steps"),
        (r"(?P<step>\d*)", "progress_regex matches an empty line"),
    ],
)
def test_bad_progress_regexes_name_the_option(regex, why):
    with pytest.raises(ValueError, match=why):
        compile_progress(regex)
    assert compile_progress("") is compile_progress(None)


# ---------------------------------------------------------------------------------------------------------------
# The cursor across ticks
# ---------------------------------------------------------------------------------------------------------------
def test_a_warm_tick_reads_only_the_new_bytes_and_keeps_what_earlier_ticks_found(tmp_path):
    log = tmp_path / "log"
    log.write_text("epoch 1/2 step 1/3 loss 0.5\nCUDA out of memory. Tried to allocate 2 GiB\n")
    first, cursor = tick(log)
    assert (first["read_bytes"], first["restarted"], first["more"]) == (log.stat().st_size, False, False)
    again, cursor = tick(log, cursor)
    assert again["read_bytes"] == 0 and found(again) == found(first)  # a crash from an earlier tick stays
    more = b"epoch 1/2 step 2/3 loss 0.4\nCUDA out of memory\n"
    append(log, more)
    warm, cursor = tick(log, cursor)
    assert warm["read_bytes"] == len(more) and not warm["restarted"]
    assert found(warm) == {"cuda_oom": (2, "CUDA out of memory. Tried to allocate 2 GiB")}
    assert cursor["offset"] == log.stat().st_size == warm["size"]


def test_a_truncated_log_is_scanned_again_and_what_it_showed_stays_seen(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed\n" * 3 + "epoch 5/5\n")
    scan, cursor = tick(log)
    assert scan["lost"] is None and cursor["lost"] is None
    log.write_text("epoch 1/5\nKilled\n")  # same inode, shorter
    scan, cursor = tick(log, cursor)
    assert scan["restarted"] and scan["progress"]["epoch"] == 1 and scan["read_bytes"] == 17
    assert scan["lost"] == "log truncated (was 31 bytes, now 17)" == cursor["lost"]
    assert found(scan) == {"killed": (4, "Killed")}  # 3 before the truncation, 1 after
    append(log, b"epoch 2/5\n")
    scan, cursor = tick(log, cursor)  # sticky: the log growing again does not clear it
    assert scan["lost"] == "log truncated (was 31 bytes, now 17)" and found(scan) == {"killed": (4, "Killed")}
    assert not scan["restarted"] and scan["read_bytes"] == 10


def test_a_rotated_log_is_a_replaced_log_and_its_crash_stays_seen(tmp_path):
    log = tmp_path / "log"
    log.write_text("CUDA out of memory\n" + "epoch 1/5 step 1/3 loss 0.5\n" * 50)
    scan, cursor = tick(log)
    os.rename(log, tmp_path / "log.1")  # logrotate: mv log log.1; touch log
    log.write_text("epoch 2/5 step 1/3 loss 0.3\n")
    scan, cursor = tick(log, cursor)
    assert scan["restarted"] and scan["progress"]["epoch"] == 2 and scan["lost"] == "log replaced by another file"
    assert found(scan) == {"cuda_oom": (1, "CUDA out of memory")} and cursor["signatures"] == []


def test_a_log_rewritten_past_the_offset_is_a_truncated_log(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed\nepoch 1/5\n")
    scan, cursor = tick(log)
    log.write_text("epoch 1/5 step 1/9 loss 0.5\nepoch 1/5 step 2/9 loss 0.4\n")  # copytruncate, then regrown
    scan, cursor = tick(log, cursor)
    assert scan["restarted"] and scan["progress"]["step"] == 2 and found(scan) == {"killed": (1, "Killed")}
    assert scan["lost"] == "log truncated (was 17 bytes, now 56)"


def test_a_log_cut_between_the_offset_and_its_size_is_a_truncated_log(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed\n" + "epoch 1/5 step 1/9 loss 0.5\n" * 20_000)
    scan, cursor = tick(log, max_bytes=1000)  # far behind: the offset lies well before the end
    os.truncate(log, 100_000)
    scan, cursor = tick(log, cursor, max_bytes=1000)
    assert scan["lost"] == f"log truncated (was {20_000 * 28 + 7} bytes, now 100000)" and not scan["restarted"]
    assert found(scan)["killed"] == (1, "Killed") and cursor["offset"] == 2000  # what it counted is intact


def test_a_deleted_log_keeps_its_cursor_signatures_and_progress(tmp_path):
    log = tmp_path / "log"
    log.write_text("epoch 2/5 step 3/9 loss nan\n")
    scan, cursor = tick(log, now=1_000.0)
    log.unlink()
    for _tick in range(2):  # the next tick still knows
        scan, cursor = tick(log, cursor, now=2_000.0)
        assert cursor is not None and cursor["lost"] == "log deleted (was 28 bytes)" == scan["lost"]
        assert (scan["exists"], scan["error"], scan["size"], scan["progress"]["step"]) == (False, None, None, 3)
        assert found(scan) == {"nan_loss": (1, "epoch 2/5 step 3/9 loss nan")}
        assert scan["last_growth"] == 1_000.0  # nothing grew since
    log.write_text("epoch 1/5\n")  # a new log where the old one was: the first reason stays
    scan, cursor = tick(log, cursor, now=3_000.0)
    assert scan["lost"] == "log deleted (was 28 bytes)" and scan["exists"] and scan["restarted"]
    assert found(scan) == {"nan_loss": (1, "epoch 2/5 step 3/9 loss nan")} and scan["progress"]["epoch"] == 1
    assert scan["last_growth"] == 3_000.0


def test_a_config_change_after_a_loss_keeps_what_the_lost_log_showed_and_counts_the_rest_once(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed\nHfHubHTTPError: 502\n")
    scan, cursor = tick(log)
    log.write_text("HfHubHTTPError: 503\n")
    scan, cursor = tick(log, cursor)
    mine = compile_signatures([{"name": "hf_hub", "regex": "HfHubHTTPError"}])
    for _tick in range(2):
        scan, cursor = tick(log, cursor, signatures=mine)
        assert found(scan) == {"killed": (1, "Killed"), "hf_hub": (1, "HfHubHTTPError: 503")}
        assert scan["lost"] == "log truncated (was 27 bytes, now 20)"


def test_other_patterns_rescan_the_log(tmp_path):
    log = tmp_path / "log"
    log.write_text("HfHubHTTPError: 502\n")
    scan, cursor = tick(log)
    mine = compile_signatures([{"name": "hf_hub", "regex": "HfHubHTTPError"}])
    scan, cursor = tick(log, cursor, signatures=mine)
    assert scan["restarted"] and found(scan) == {"hf_hub": (1, "HfHubHTTPError: 502")}


@pytest.mark.parametrize(
    "broken",
    [
        {"schema": 2},
        {"schema": 3},
        {"schema": 1},
        {"schema": 1, "dev": "x", "inode": 1, "offset": 0, "size": 0},
        "not a dict",
    ],
)
def test_an_unusable_cursor_restarts_the_scan(tmp_path, broken):
    log = tmp_path / "log"
    log.write_text("Killed\n")
    scan, cursor = tick(log, broken)
    assert scan["restarted"] and found(scan) == {"killed": (1, "Killed")} and cursor["offset"] == 7


def test_every_corrupted_field_makes_the_cursor_unusable(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed\n")
    cursor = tick(log)[1]
    bad_values = {
        "offset": -1, "size": True, "config": 3, "fingerprint": None, "carry": "!!not base64", "skipping": "no",
        "last_growth": "soon", "progress": {"epoch": "x", "line": ""}, "signatures": [{"signature": "x"}],
        "lost": 3, "before": [{"signature": "x", "count": -1, "first_line": None}],
    }  # fmt: skip
    for key, value in bad_values.items():
        assert tick(log, dict(cursor, **{key: value}))[0]["restarted"], key
    assert tick(log, dict(cursor, carry="eA==" * 2000))[0]["restarted"]  # a carry over 4 KiB
    for growth in (None, float("nan"), float("inf"), True):
        assert tick(log, dict(cursor, last_growth=growth))[0]["restarted"], growth
    assert tick(log, dict(cursor, offset=8, size=7))[0]["restarted"]  # an offset past the size it saw


def test_binary_garbage_is_harmless(tmp_path):
    log = tmp_path / "log"
    garbage = bytes(range(256)) * 64 + os.urandom(200_000).replace(b"Killed", b"K")
    log.write_bytes(garbage + b"\nRuntimeError: CUDA error: out of memory\n\xff\xfe\x00epoch 4/9\n" + garbage[:9000])
    scan = tick(log)[0]
    assert found(scan)["cuda_oom"] == (1, "RuntimeError: CUDA error: out of memory")
    assert scan["progress"]["epoch"] == 4 and scan["error"] is None


def test_a_long_line_is_matched_on_its_first_4_kib_only(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed by signal 9 " + "x" * 10_000 + " CUDA out of memory\nSegmentation fault\n")
    scan = tick(log)[0]
    assert sorted(found(scan)) == ["killed", "segfault"] and len(found(scan)["killed"][1]) == 200


def test_a_line_without_a_newline_is_cheap_and_never_held_whole(tmp_path):
    log = tmp_path / "log"
    with open(log, "wb") as handle:
        handle.write(b"epoch 2/3 step 1/3 loss 0.5\n")
        for index in range(50):
            handle.write((b"CUDA out of memory " if index == 0 else b"") + b"x" * (2**20))
    tracemalloc.start()
    try:
        scan, cursor = tick(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20  # a few 1 MiB chunks, never the 50 MB line
    assert found(scan) == {"cuda_oom": (1, "CUDA out of memory " + "x" * 181)}
    assert cursor["skipping"] and cursor["carry"] == "" and len(json.dumps(cursor)) < 2000
    append(log, b"x CUDA out of memory\nKilled\n")  # the end of the long line is not matched again
    scan, cursor = tick(log, cursor)
    assert found(scan) == {"cuda_oom": (1, "CUDA out of memory " + "x" * 181), "killed": (1, "Killed")}
    assert scan["progress"]["epoch"] == 2 and not cursor["skipping"]


def test_a_line_split_across_ticks_counts_once(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"epoch 1/2\nTraceback (most re")
    scan, cursor = tick(log)
    assert found(scan) == {} and base64_len(cursor) == 18
    append(log, b"cent call last):\nValueError: x\n")
    scan, cursor = tick(log, cursor)
    assert found(scan) == {"python_traceback": (1, "ValueError: x")} and cursor["carry"] == ""


def base64_len(cursor: Dict[str, Any]) -> int:
    return len(base64.b64decode(cursor["carry"]))


def test_an_unfinished_last_line_is_reported_but_counted_once_when_finished(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"epoch 1/2\nKilled")
    scan, cursor = tick(log)
    assert found(scan) == {"killed": (1, "Killed")} and cursor["signatures"] == []
    append(log, b"\n")
    scan, cursor = tick(log, cursor)
    assert found(scan) == {"killed": (1, "Killed")} and cursor["signatures"][0]["count"] == 1


def test_max_bytes_bounds_a_tick_and_the_progress_comes_from_the_tail(tmp_path):
    log = tmp_path / "log"
    lines = [f"epoch {1 + i // 1000}/40 step {1 + i % 1000}/1000 loss 0.5\n" for i in range(40_000)]
    lines[3] = "Traceback (most recent call last):\n"
    lines[5] = "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    log.write_text("".join(lines))
    size, ticks, cursor = log.stat().st_size, [], None
    while not ticks or ticks[-1]["more"]:
        scan, cursor = tick(log, cursor, max_bytes=300_000)
        ticks.append(scan)
    assert len(ticks) == -(-size // 300_000) and all(scan["read_bytes"] <= 300_000 for scan in ticks)
    assert sum(scan["read_bytes"] for scan in ticks) == size
    for scan in ticks:  # the first (cold) tick already shows the current progress, from the last 64 KiB
        assert scan["progress"]["line"] == "epoch 40/40 step 1000/1000 loss 0.5"
        assert found(scan)["cuda_illegal_memory_access"][0] == 1
    assert found(ticks[-1])["python_traceback"] == (1, lines[5].strip())


def test_a_cold_tick_on_a_long_log_shows_the_crash_at_its_end_and_counts_it_once(tmp_path):
    log = tmp_path / "log"
    ending = 'Traceback (most recent call last):\n  File "x.py"\ntorch.OutOfMemoryError: CUDA out of memory.\n'
    log.write_text("epoch 1/9 step 1/100 loss 0.5\n" * 20_000 + ending + "\rEpoch 9:  99%|#| 99/100 [1.2it/s]")
    expected = {
        "python_traceback": (1, "torch.OutOfMemoryError: CUDA out of memory."),
        "cuda_oom": (1, "torch.OutOfMemoryError: CUDA out of memory."),
    }
    scan, cursor = tick(log, max_bytes=100_000)
    assert scan["more"] and found(scan) == expected and cursor["signatures"] == []
    assert (scan["progress"]["epoch"], scan["progress"]["step"]) == (9, 99)
    while scan["more"]:
        scan, cursor = tick(log, cursor, max_bytes=100_000)
        assert found(scan) == expected and scan["progress"]["step"] == 99
    assert [(e["signature"], e["count"]) for e in cursor["signatures"]] == [("python_traceback", 1), ("cuda_oom", 1)]


def test_last_growth_is_the_ticks_clock_and_the_mtime_only_at_first_sight(tmp_path):
    log = tmp_path / "log"
    log.write_text("epoch 1/2\n")
    os.utime(log, (1_000_000, 1_000_000))
    scan, cursor = tick(log, now=1_500_000.0)
    assert scan["last_growth"] == 1_000_000 == scan["mtime"]
    os.utime(log, (2_000_000, 2_000_000))  # touched, not grown
    scan, cursor = tick(log, cursor, now=2_500_000.0)
    assert (scan["last_growth"], scan["mtime"]) == (1_000_000, 2_000_000)
    append(log, b"epoch 2/2\n")
    os.utime(log, (3_000_000, 3_000_000))
    assert tick(log, cursor, now=3_500_000.0)[0]["last_growth"] == 3_500_000.0  # the tick saw it grow


def test_a_log_whose_mtime_lies_in_the_future_does_not_blind_the_stall_rule(tmp_path):
    log = tmp_path / "log"
    log.write_text("epoch 1/2\n")
    os.utime(log, (9_000_000, 9_000_000))  # a clock stepped back, or a volume whose server runs ahead
    scan, cursor = tick(log, now=1_000_000.0)
    assert scan["last_growth"] == 1_000_000.0
    scan, cursor = tick(log, cursor, now=1_003_600.0)  # silent for an hour: an hour idle, whatever the mtime
    assert scan["last_growth"] == 1_000_000.0
    append(log, b"epoch 2/2\n")
    os.utime(log, (9_500_000, 9_500_000))
    scan, cursor = tick(log, cursor, now=1_007_200.0)
    assert scan["last_growth"] == 1_007_200.0
    scan, cursor = tick(log, cursor, now=1_005_000.0)  # the tick's own clock stepped back
    assert scan["last_growth"] == 1_005_000.0


def test_now_defaults_to_the_wall_clock(tmp_path):
    log = tmp_path / "log"
    log.write_text("epoch 1/2\n")
    future = time.time() + 86_400
    os.utime(log, (future, future))
    before = time.time()
    scan = tick(log)[0]
    assert before <= scan["last_growth"] <= time.time()


def test_a_schema_1_cursor_is_rescanned_once_and_its_mtime_growth_is_dropped(tmp_path):
    log = tmp_path / "log"
    log.write_text("Killed\nbest_val_loss: inf\n[rgt 2025-05-01T12:00:00.000000+00:00] SYNC FAILED: [Errno 28]\n")
    os.utime(log, (1_000, 1_000))
    cursor = tick(log, now=2_000.0)[1]
    old = {key: value for key, value in cursor.items() if key not in ("lost", "before")}
    old.update(schema=1, last_growth=9_000_000.0)  # what the previous release saved: a future mtime, and
    old["signatures"] = [  # what it counted on lines that are no longer matched
        {"signature": "killed", "count": 1, "first_line": "Killed"},
        {"signature": "disk_full", "count": 1, "first_line": "[rgt 2025-05-01T12:00:00.000000+00:00] SYNC FAILED"},
        {"signature": "nan_loss", "count": 1, "first_line": "best_val_loss: inf"},
    ]
    scan, cursor = tick(log, old, now=3_000.0)
    assert scan["restarted"] and found(scan) == {"killed": (1, "Killed")} and scan["lost"] is None
    assert scan["last_growth"] == 1_000 and cursor["schema"] == _log_scan.SCHEMA == 2


# ---------------------------------------------------------------------------------------------------------------
# Missing, unreadable and odd logs
# ---------------------------------------------------------------------------------------------------------------
def test_a_missing_log_has_no_cursor(tmp_path):
    scan, cursor = tick(tmp_path / "cells" / "a" / "log")
    assert cursor is None and (scan["exists"], scan["error"], scan["size"], scan["last_growth"]) == (
        False,
        None,
        None,
        None,
    )
    assert tick(tmp_path / "file" / "log")[1] is None  # a path through a file is missing too
    assert scan["lost"] is None  # never seen: nothing was lost


def test_an_unreadable_log_is_an_error_and_keeps_the_old_cursor(tmp_path, monkeypatch):
    log = tmp_path / "log"
    log.write_text("Killed\nepoch 2/3\n")
    cursor = tick(log)[1]

    def denied(*args: Any, **kwargs: Any) -> int:
        raise PermissionError(13, "Permission denied", str(log))

    monkeypatch.setattr(_log_scan.os, "open", denied)
    scan, again = tick(log, cursor)
    assert again == cursor and scan["exists"] and "Permission denied" in scan["error"]
    assert found(scan) == {"killed": (1, "Killed")} and scan["progress"]["epoch"] == 2


def test_a_directory_or_a_fifo_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "dir").mkdir()
    scan, cursor = tick(tmp_path / "dir")
    assert scan["error"].endswith("is a directory, not a log") and cursor is None and scan["size"] is None
    os.mkfifo(tmp_path / "fifo")
    scan, cursor = tick(tmp_path / "fifo")
    assert scan["error"].endswith("is not a regular file, not a log")


# ---------------------------------------------------------------------------------------------------------------
# Cursor files
# ---------------------------------------------------------------------------------------------------------------
def test_save_and_load_round_trip_atomically_creating_the_directory(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"Killed\nepoch 1/2 step 1/3 loss 0.5\nhalf a li")
    cursor = tick(log)[1]
    path = tmp_path / "run" / ".patrol" / "a.json"
    old = os.umask(0o022)
    try:
        save_cursor(str(path), cursor)
    finally:
        os.umask(old)
    assert (path.parent.stat().st_mode & 0o777) == 0o755
    assert load_cursor(str(path)) == cursor
    save_cursor(str(path), dict(cursor, offset=1))
    assert load_cursor(str(path))["offset"] == 1 and os.listdir(path.parent) == ["a.json"]


def test_save_raises_os_error_and_leaves_no_temporary(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        save_cursor(str(tmp_path / "file" / "a.json"), {"schema": 1})
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.json").mkdir()  # os.replace onto a directory fails
    with pytest.raises(OSError):
        save_cursor(str(tmp_path / "dir" / "a.json"), {"schema": 1})
    assert os.listdir(tmp_path / "dir") == ["a.json"]


@pytest.mark.parametrize(
    "content",
    [None, b"", b"\x00\xffnot json{", b"[1, 2]", b'{"schema": 2}', b'{"schema": 1, "offset": 3}', b"[" * 100_000],
)
def test_load_cursor_returns_none_for_a_missing_or_garbage_file(tmp_path, content):
    path = tmp_path / "a.json"
    if content is not None:
        path.write_bytes(content)
    assert load_cursor(str(path)) is None


def test_load_cursor_refuses_an_oversized_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b" " * (_log_scan.CURSOR_MAX_BYTES + 1))
    assert load_cursor(str(path)) is None
    assert load_cursor(str(tmp_path)) is None  # a directory
