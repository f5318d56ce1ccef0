"""Issue 11, benchmark "Log size": one patrol tick on a run whose cell logs total 1 MB and 2 GB, cold and warm.

The run: one run directory per size, laid out by the launch code (``tests/workload/harness.make_run`` writes the
validated spec.json; the real on-box runner, started detached as ``training_run`` starts it, writes run.json,
each cell's result.json and monitor.jsonl). Four cells run one after another: three finished (``/bin/true``,
succeeded) and the fourth still running (``sleep 86400``, alive for the whole row). Before the runner starts, each
cell's log is written with fake_train-style lines (``epoch i/N step j/M loss x``, one epoch of 24,000 steps a
block of about 1 MiB, progress throughout) plus an eval line per epoch with decoys (``mean_abs_error=0.118
error_rate: 0.03``); the first cell's log has a Python traceback (a dataloader worker's ``RuntimeError``) near its
start. Then the runner appends its own ``[rgt ...]`` lines. The logs total 1 MiB (4 x 256 KiB) and 2 GiB
(4 x 512 MiB), written fast by repeating the epoch block with the epoch number replaced, in the bench scratch
directory, removed at the end of the row. Every tick below finds the logs in the page cache (they were just
written): the figures are CPU and memory, not disk reads.

Sides (all seven alternate, ``bench.reps`` repetitions):
- ``module cold <size>``: ``patrol_facts`` as Ansible runs it on the box, a fresh Python (this checkout's .venv
  stands in for the box's runtime venv) with the JSON ``ANSIBLE_MODULE_ARGS`` payload and
  ``PYTHONPATH=.build/collections``: ``data_dir`` and ``run`` set, every other option at its default. Cold: no
  cursor (``<run>/.patrol/`` removed before). The module reads at most ``max_scan_bytes`` (64 MiB) of new bytes
  per log per tick, so on 2 GiB it reads 64 MiB of each of the 4 logs, reports them behind (``more``) and takes
  the progress from each log's last 64 KiB, all within its default ``timeout_s`` (10 s): a scan that takes longer
  is cut off by the module's own deadline and the tick answers ``unknown`` (printed in its verdict).
- ``module warm <size>``: the same tick with the cursors of the previous warm tick in place (caught up to the end
  of every log) and 4 KiB of progress lines appended to the running cell's log since then.
- ``module import floor``: the same Python importing ``ansible.module_utils.basic`` and the module, then exiting:
  what every tick pays before it reads anything, whatever the log's size.
- ``seed <size>``: the seed's per-tick greps on the same logs: the REMOTE part of ``health_patrol.sh.template``
  (the heredoc body the seed sends over ssh to ``bash -s``), extracted unchanged, run here by ``bash -s`` with its
  arguments set (``RUN_GLOB`` the running cell's ``sleep 86400``, ``RESULT_DIR`` the cell's directory, which holds
  its ``result.json``, ``RUN_LOG`` the cell's log, ``DATA_MOUNT`` the data dir). The seed watches one log per run;
  the run has one per cell, so a seed tick runs the body once per cell log, one after another. Its ``pgrep``,
  ``ls`` and ``df`` are paid four times; they are a few ms each against the greps on 2 GiB.

Figures per side: wall of the whole process (start, imports, every probe, ``exit_json``), peak RSS (``ru_maxrss`` of
the child from ``os.wait4``: the largest of the module's process and the probe children it forks and reaps; for the
seed the largest of bash and its greps), and the bytes each module tick read (the cursors' offsets after the tick
minus before it; cold: from 0; a tick whose run probe hit its deadline keeps only the cursors of the logs it had
finished). Each module side's verdict (state, signatures, progress, first reason) is printed from its last tick.

Catch-up, before the repetitions: the warm ticks need cursors at the logs' ends. On 1 MB a real one (module ticks
with ``max_scan_bytes`` 1 GiB and ``timeout_s=600``). On 2 GB the same when the scanner's rate (measured first, in
process, on 2 MiB of these lines, and printed) makes it cost at most ``CATCH_UP_MAX_S``; otherwise the cursors are
fast-forwarded: a module tick that reads each log's first 64 KiB (the traceback is there, and the tail read gives
each log's last progress line), then each cursor's offset, size and fingerprint (the module's own ``_fingerprint``)
moved to its log's end. That is exactly the cursor a full scan leaves when the skipped bytes hold no signature:
checked on one epoch block and every log's last 64 KiB, and the same fast-forward on the 1 MB case must give the
cursors its real catch-up gave (printed). ``RGT_BENCH_PATROL_LOG_CATCH_UP=real|fast`` forces either;
``RGT_BENCH_PATROL_LOG_BIG_MIB`` makes the big case smaller for a trial.

Left out: Ansible's side of a tick (the controller, AnsiballZ's unzip, SSH; row ``patrol_fanout`` has it). This
machine has no GPU and no simulator is set up for this row: the module's GPU probe finds no NVML library and no
nvidia-smi and reports that (a few ms); a real box pays its NVML read instead. The kernel-log probe reads this
machine's dmesg. Disk reads: the logs are cached, as a log still being written mostly is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _harness import Bench, Sample, Stats, seed_script
from collection_path import collection_root

sys.path.insert(0, str(collection_root()))
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _log_scan
from ansible_collections.remote_gpu.trainer.tests.workload.harness import make_run, start_runner, wait_for

ROW = "patrol_facts on 1 MB and 2 GB of cell logs, cold and warm tick, vs the seed's greps"
MODULE = "ansible_collections.remote_gpu.trainer.plugins.modules.patrol_facts"
MIB = 2**20
CELLS = 4
# Total bytes of the cell logs per case; RGT_BENCH_PATROL_LOG_BIG_MIB makes the big case smaller for a trial.
BIG_MIB = int(os.environ.get("RGT_BENCH_PATROL_LOG_BIG_MIB", "2048"))
SIZES = {"1 MB": MIB, "2 GB": BIG_MIB * MIB} if BIG_MIB == 2048 else {"1 MB": MIB, f"{BIG_MIB} MiB": BIG_MIB * MIB}
STEPS = 24_000  # steps per epoch: one epoch's lines are one block of about 1 MiB
APPEND_BYTES = 4096
RUN = "sweep"
SLEEPER = ["sleep", "86400"]  # the running cell's command; the seed's RUN_GLOB matches it
RATE_PROBE_BYTES = 2 * MIB
DEFAULT_MAX_SCAN_MIB = 64
# The catch-up before the warm ticks: a real one (module ticks) when the scanner's measured rate makes it cost at
# most this, else the cursors are fast-forwarded; RGT_BENCH_PATROL_LOG_CATCH_UP=real or fast forces either.
CATCH_UP_MAX_S = 30.0
CATCH_UP = os.environ.get("RGT_BENCH_PATROL_LOG_CATCH_UP", "")
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/workspace/train.py", line 212, in <module>\n'
    "    main()\n"
    '  File "/workspace/train.py", line 180, in main\n'
    "    batch = next(loader_iter)\n"
    '  File "/opt/conda/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 631, in __next__\n'
    "    data = self._next_data()\n"
    "RuntimeError: DataLoader worker (pid 4242) exited unexpectedly with exit code 1\n"
    "retrying the epoch with a fresh loader\n"
)


def epoch_block(epochs_total: int) -> bytes:
    """One epoch of progress lines with ``@E@`` where the epoch number goes."""
    lines = [
        f"epoch @E@/{epochs_total} step {step}/{STEPS} loss {1.0 / (step + 10) + (step * 7919 % 1000) / 1e5:.4f}"
        for step in range(1, STEPS + 1)
    ]
    lines.append("eval epoch @E@: mean_abs_error=0.1180 error_rate: 0.0300 no errors found")
    return ("\n".join(lines) + "\n").encode()


def write_log(path: Path, size: int, epochs_total: int, crash: bool) -> int:
    """A cell log of about ``size`` bytes, cut at a line end; returns the epochs written."""
    block = epoch_block(epochs_total)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = epoch = 0
    with open(path, "wb", buffering=0) as log:
        while written < size:
            epoch += 1
            chunk = block.replace(b"@E@", str(epoch).encode())
            if written + len(chunk) > size:
                chunk = chunk[: chunk.rfind(b"\n", 0, size - written) + 1]
            if crash and epoch == 1:  # near the start: after the first 100 lines
                cut = _nth_newline(chunk, 100) + 1
                chunk = chunk[:cut] + TRACEBACK.encode() + chunk[cut:]
            if not chunk:
                break
            log.write(chunk)
            written += len(chunk)
    return epoch


def _nth_newline(data: bytes, count: int) -> int:
    index = -1
    for _line in range(count):
        index = data.find(b"\n", index + 1)
    return index


class Case:
    """One size: the run directory, its live runner, the cursors of the warm ticks and the lines appended to them."""

    def __init__(self, bench: Bench, label: str, total: int) -> None:
        self.label = label
        self.root = bench.scratch("patrol_log") / label.replace(" ", "")
        cells: List[Dict[str, Any]] = [{"name": f"cell{i}", "command": ["/bin/true"]} for i in range(CELLS - 1)]
        cells.append({"name": f"cell{CELLS - 1}", "command": SLEEPER})
        self.run_dir = make_run(self.root, cells, name=RUN, max_parallel=1)
        self.data_dir = self.root / "data"
        self.logs = [self.run_dir / "cells" / cell["name"] / "log" for cell in cells]
        self.epochs_total = max(1, total // CELLS // len(epoch_block(1))) + 1000
        started = time.perf_counter()
        for index, log in enumerate(self.logs):
            self.epoch = write_log(log, total // CELLS, self.epochs_total, crash=index == 0)
        self.write_s = time.perf_counter() - started
        self.step = 0
        self.runner: Optional[subprocess.Popen[bytes]] = None
        self.cursors = self.run_dir / ".patrol"
        self.stash = self.root / "warm-cursors"
        self.payload = {"data_dir": str(self.data_dir), "run": RUN}
        self.last: Dict[str, Any] = {}
        self.facts: Dict[str, Dict[str, Any]] = {}  # the last tick's facts, per kind (cold, warm)
        self.seed_out: List[str] = []

    def start(self) -> None:
        """The runner, detached in a session of its own; returns once the three short cells are done."""
        self.runner = start_runner(self.run_dir)
        wait_for(self._started, timeout_s=60, what=f"{self.label}: the runner starting the last cell")

    def _started(self) -> bool:
        done = all((log.parent / "result.json").exists() for log in self.logs[:-1])
        runner_log = self.run_dir / "runner.log"
        return done and runner_log.exists() and f"cell={self.logs[-1].parent.name}" in runner_log.read_text()

    def size(self) -> int:
        return sum(log.stat().st_size for log in self.logs)

    def offsets(self) -> List[int]:
        """Each log's cursor offset (0 without a cursor)."""
        found = []
        for log in self.logs:
            try:
                cursor = json.loads((self.cursors / f"{log.parent.name}.json").read_text())
                found.append(int(cursor.get("offset") or 0))
            except (OSError, ValueError):
                found.append(0)
        return found

    def append(self) -> None:
        """APPEND_BYTES of progress lines at the end of the running cell's log (what the job printed since)."""
        lines: List[str] = []
        length = 0
        while length < APPEND_BYTES:
            self.step += 1
            if self.step > STEPS:
                self.epoch, self.step = self.epoch + 1, 1
            line = f"epoch {self.epoch}/{self.epochs_total} step {self.step}/{STEPS} loss 0.{self.step % 9000:04d}\n"
            lines.append(line)
            length += len(line)
        with open(self.logs[-1], "a", encoding="utf-8") as log:
            log.write("".join(lines))

    def tick(self, **options: Any) -> Sample:
        """One module run; Sample with wall, peak RSS, bytes read (cursor offsets) and the facts it returned."""
        before = self.offsets()
        sizes = [log.stat().st_size for log in self.logs]
        payload = json.dumps({"ANSIBLE_MODULE_ARGS": dict(self.payload, **options)})
        env = dict(os.environ, PYTHONPATH=str(collection_root()))
        seconds, rss, out = child([sys.executable, "-m", MODULE, payload], env)
        facts = json.loads(out)
        if facts.get("failed"):
            raise SystemExit(f"{self.label}: patrol_facts failed: {facts.get('msg')}")
        after = self.offsets()
        behind = sum(1 for offset, size in zip(after, sizes) if offset < size)
        sample = Sample(seconds, extra={"peak_rss_mib": rss, "read_bytes": sum(after) - sum(before), "behind": behind})
        self.last = facts
        return sample

    def cold(self) -> Sample:
        shutil.rmtree(self.cursors, ignore_errors=True)
        sample = self.tick()
        self.facts["cold"] = self.last
        return sample

    def warm(self) -> Sample:
        shutil.rmtree(self.cursors, ignore_errors=True)
        shutil.copytree(self.stash, self.cursors)
        self.append()
        sample = self.tick()
        self.facts["warm"] = self.last
        self.keep_cursors()
        return sample

    def keep_cursors(self) -> None:
        shutil.rmtree(self.stash, ignore_errors=True)
        shutil.copytree(self.cursors, self.stash)

    def catch_up(self) -> Tuple[float, int]:
        """Ticks with the largest max_scan_bytes until every cursor is at its log's end: (seconds, bytes read)."""
        shutil.rmtree(self.cursors, ignore_errors=True)
        seconds = 0.0
        read = 0
        for _tick in range(8):
            sample = self.tick(max_scan_bytes=2**30, timeout_s=600)
            seconds += sample.seconds
            read += int(sample.extra["read_bytes"])
            if not sample.extra["behind"]:
                break
        else:
            raise SystemExit(f"{self.label}: the catch-up ticks did not reach the end of the logs")
        self.keep_cursors()
        return seconds, read

    def fast_forward(self) -> None:
        """The cursors a full catch-up leaves, without its cost: a module tick that reads each log's first 64 KiB
        (the traceback is there; its cursor keeps the progress of the log's last line, read from its tail), then
        each cursor moved to its log's end (offset, size and the module's fingerprint of the bytes before it).
        Exact only because the bytes skipped hold no signature (checked: ``assert_clean``)."""
        shutil.rmtree(self.cursors, ignore_errors=True)
        self.tick(max_scan_bytes=65536, timeout_s=600)
        for log in self.logs:
            path = self.cursors / f"{log.parent.name}.json"
            cursor = json.loads(path.read_text())
            fd = os.open(log, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if os.pread(fd, 1, size - 1) != b"\n":
                    raise SystemExit(f"{log} does not end with a line end: its cursor cannot be moved to its end")
                cursor.update(offset=size, size=size, fingerprint=_log_scan._fingerprint(fd, size), carry="",
                              skipping=False)  # fmt: skip
            finally:
                os.close(fd)
            _log_scan.save_cursor(str(path), cursor)
        self.keep_cursors()

    def cursor_files(self) -> Dict[str, Dict[str, Any]]:
        return {path.name: json.loads(path.read_text()) for path in sorted(self.cursors.glob("*.json"))}

    def assert_clean(self) -> None:
        """No signature in one epoch block (every block but the first is one with another epoch number) nor in each
        log's last 64 KiB (the runner's own lines): the bytes fast_forward skips."""
        signatures = _log_scan.compile_signatures([])
        texts = [epoch_block(self.epochs_total).decode()]
        for log in self.logs:
            with open(log, "rb") as handle:
                handle.seek(max(0, log.stat().st_size - 65536))
                texts.append(handle.read().decode(errors="replace"))
        for text in texts:
            for signature in signatures:
                hit = signature.regex.search(text)
                if hit:
                    raise SystemExit(f"{self.label}: {signature.name} matches {hit.group(0)!r}: cannot fast-forward")

    def scan_rate(self) -> float:
        """Bytes per second of the module's scanner on this content (2 MiB of the first log, in this process)."""
        signatures, progress = _log_scan.compile_signatures([]), _log_scan.compile_progress(None)
        started = time.perf_counter()
        scan, _cursor = _log_scan.scan_log(str(self.logs[0]), None, signatures, progress, max_bytes=RATE_PROBE_BYTES)
        return scan["read_bytes"] / (time.perf_counter() - started)

    def seed(self, body: str) -> Sample:
        """The seed's REMOTE body once per cell log, one after another, as ``bash -s ARGS`` runs it on the box."""
        seconds = rss = 0.0
        outputs = []
        for log in self.logs:
            argv = ["bash", "-s", " ".join(SLEEPER), str(log.parent), str(log), str(self.data_dir)]
            spent, peak, out = child(argv, dict(os.environ), stdin=body.encode())
            seconds += spent
            rss = max(rss, peak)
            outputs.append(out.decode(errors="replace"))
        self.seed_out = outputs
        return Sample(seconds, extra={"peak_rss_mib": rss})

    def stop(self) -> None:
        """The runner stops its cell (SIGTERM, SIGKILL after the spec's stop_grace_s); then anything left that carries
        the run's RGT_RUN_DIR (the cell has a process group of its own) is killed; then the logs go."""
        if self.runner is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.runner.pid, signal.SIGTERM)
            try:
                self.runner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.runner.pid, signal.SIGKILL)
                self.runner.wait(timeout=30)
            self.runner = None
        marker = f"RGT_RUN_DIR={self.run_dir}".encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        os.kill(int(entry.name), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def child(argv: List[str], env: Dict[str, str], stdin: Optional[bytes] = None) -> Tuple[float, float, bytes]:
    """(wall seconds, peak RSS MiB, stdout) of one child process, which must exit 0."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    if stdin:
        proc.stdin.write(stdin)
    proc.stdin.close()
    out = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} {argv[1]} exited {proc.returncode}: {out[-400:]!r}")
    return seconds, usage.ru_maxrss / 1024, out


def import_floor() -> Sample:
    code = f"import ansible.module_utils.basic, {MODULE}"
    seconds, rss, _out = child([sys.executable, "-c", code], dict(os.environ, PYTHONPATH=str(collection_root())))
    return Sample(seconds, extra={"peak_rss_mib": rss})


def remote_body() -> str:
    """The REMOTE heredoc of health_patrol.sh.template, unchanged: what the seed sends to ``bash -s`` on the box."""
    lines = seed_script("health_patrol.sh.template").splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("<<'REMOTE'"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "REMOTE")
    return "\n".join(lines[start + 1 : end]) + "\n"


def _verdict(facts: Dict[str, Any]) -> str:
    found = ", ".join(f"{s['signature']} x{s['count']}" for s in facts.get("crash_signatures") or []) or "none"
    progress = facts.get("progress") or {}
    epoch = f"epoch {progress.get('epoch')}/{progress.get('epochs_total')}" if progress else "no progress"
    return (
        f"state {facts.get('state')}, {facts.get('cells_done')}/{facts.get('cells_total')} cells done, alive "
        f"{facts.get('alive')}, signatures: {found}, {epoch}"
        + (f"; {facts['reasons'][0]}" if facts.get("reasons") else "")
    )


def _seed_verdict(outputs: List[str]) -> str:
    values: Dict[str, List[str]] = {}
    for out in outputs:
        for line in out.splitlines():
            key, _sep, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return "; ".join(f"{key} {' + '.join(found)}" for key, found in values.items() if key in ("ALIVE", "DONE", "CRASH"))


def _mib(value: float) -> str:
    return f"{value / MIB:,.3f} MiB" if value >= 1024 else f"{value:,.0f} bytes"


def run(bench: Bench) -> None:
    body = remote_body()
    bench.figure("seed side", f"the REMOTE body of health_patrol.sh.template ({len(body.splitlines())} lines), "
                 f"unchanged, by bash -s, once per cell log")  # fmt: skip
    cases: Dict[str, Case] = {}
    try:
        for label, total in SIZES.items():
            cases[label] = case = Case(bench, label, total)
            case.start()
            bench.figure(f"logs {label}", f"{CELLS} cells (3 done, 1 running), {case.size():,} bytes in all, written "
                         f"in {case.write_s:.1f} s; a traceback near the start of cell0's log")  # fmt: skip
        catch_up(bench, cases)
        sides = {}
        for label, case in cases.items():
            sides[f"module cold {label}"] = case.cold
            sides[f"module warm {label}"] = case.warm
            sides[f"seed {label}"] = lambda case=case: case.seed(body)
        sides["module import floor"] = import_floor
        stats = bench.compare(sides, unit_keys=[("peak_rss_mib", "MiB")])
        for label, case in cases.items():
            report_case(bench, label, case, stats)
    finally:
        for case in cases.values():
            case.stop()
    targets(bench, stats)


def catch_up(bench: Bench, cases: Dict[str, Case]) -> None:
    """Every warm tick starts from cursors at the logs' ends: a real catch-up when affordable, else fast-forward."""
    small, big = cases.values()
    rate = big.scan_rate()
    estimate = big.size() / rate
    budget_s = DEFAULT_MAX_SCAN_MIB * MIB / rate
    bench.figure("scanner rate", f"{rate / 1e6:.1f} MB/s (the module's scan_log over {RATE_PROBE_BYTES // MIB} MiB "
                 f"of these lines, in process): {DEFAULT_MAX_SCAN_MIB} MiB, one log's budget per tick, costs "
                 f"{budget_s:.1f} s; a catch-up of {big.label} about {estimate:.0f} s")  # fmt: skip
    seconds, read = small.catch_up()
    bench.figure(f"catch-up {small.label}", f"{seconds:.2f} s, {read:,} bytes read (module ticks, max_scan_bytes "
                 "1 GiB, timeout_s 600)")  # fmt: skip
    reference = small.cursor_files()
    small.fast_forward()
    same = (
        all(
            {k: v for k, v in cursor.items() if k != "last_growth"}
            == {k: v for k, v in reference[name].items() if k != "last_growth"}
            for name, cursor in small.cursor_files().items()
        )
        and len(reference) == CELLS
    )
    small.catch_up()  # the real cursors back
    bench.figure(f"fast-forward check on {small.label}", f"cursors {'identical to' if same else 'DIFFERENT from'} "
                 "the real catch-up's (last_growth aside)")  # fmt: skip
    real = CATCH_UP == "real" or (CATCH_UP != "fast" and estimate <= CATCH_UP_MAX_S)
    if real:
        seconds, read = big.catch_up()
        bench.figure(f"catch-up {big.label}", f"{seconds:.2f} s, {read:,} bytes read (module ticks, max_scan_bytes "
                     "1 GiB, timeout_s 600)")  # fmt: skip
        return
    big.assert_clean()
    big.fast_forward()
    bench.figure(f"catch-up {big.label}", f"fast-forwarded, not scanned (about {estimate:.0f} s at the rate above, "
                 f"over the row's {CATCH_UP_MAX_S:.0f} s allowance): a tick reading each log's first 64 KiB, then "
                 f"its cursor moved to the log's end; the skipped bytes hold no signature (checked); "
                 f"{'the same method gave the real cursors on ' + small.label if same else 'NOT CHECKED'}")  # fmt: skip


def report_case(bench: Bench, label: str, case: Case, stats: Dict[str, Stats]) -> None:
    for kind in ("cold", "warm"):
        side = stats[f"module {kind} {label}"]
        read = side.values("read_bytes")
        behind = max(side.values("behind"))
        bench.figure(f"module {kind} {label} read per tick",
                     f"{_mib(min(read))} - {_mib(max(read))} of {case.size():,} bytes; logs left behind (more): "
                     f"{behind:.0f} of {CELLS}")  # fmt: skip
        bench.figure(f"module {kind} {label} verdict", _verdict(case.facts[kind]))
    bench.figure(f"seed {label} output", _seed_verdict(case.seed_out))


def targets(bench: Bench, stats: Dict[str, Stats]) -> None:
    small, big = list(SIZES)
    warm_big, warm_small, seed_big = stats[f"module warm {big}"], stats[f"module warm {small}"], stats[f"seed {big}"]
    scaling = bench.ratio(f"warm tick {big} vs {small}", warm_big, warm_small)
    bench.target(f"warm tick {big} vs {small}", f"{scaling:.2f}x", "<= 2x", scaling <= 2)
    versus = bench.ratio(f"warm tick {big} vs the seed's greps on {big}", warm_big, seed_big)
    bench.target(f"warm tick {big} vs seed {big}", f"{versus:.3f}x", "<= 0.06x", versus <= 0.06)
    bench.ratio(f"cold tick {big} vs the seed's greps on {big}", stats[f"module cold {big}"], seed_big)
    bench.ratio(f"module import floor vs the seed's greps on {big}", stats["module import floor"], seed_big)
    peaks = {name: max(s.values("peak_rss_mib")) for name, s in stats.items() if name.startswith("module ")
             and "floor" not in name}  # fmt: skip
    worst = max(peaks, key=lambda name: peaks[name])
    megabytes = peaks[worst] * MIB / 1e6
    bench.target("module peak RSS, every case", f"{megabytes:.1f} MB ({worst.replace('module ', '')})", "< 100 MB",
                 megabytes < 100)  # fmt: skip
