"""The training_run module end to end: the real runner, detached for real, running the fake workload in tmp dirs.

Every test cleans up what it started (by the run directory in the processes' command lines and environments), and
tmux runs on a private socket directory, never the machine's default server.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _relaunch, _run_detach, _training_run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import tombstone_path
from ansible_collections.remote_gpu.trainer.plugins.modules import training_run
from ansible_collections.remote_gpu.trainer.tests.collection_path import collection_root

FAKE_TRAIN = str(Path(__file__).resolve().parents[3] / "workload" / "fake_train.py")
SECRET = "s3cr3t-value-0123456789"


def cell(name: str, *args: str, **extra: Any) -> Dict[str, Any]:
    return dict(name=name, command=[sys.executable, FAKE_TRAIN, *args], **extra)


def _mentions(pid: int, text: bytes) -> bool:
    for part in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as handle:
                if text in handle.read():
                    return True
        except OSError:
            pass
    return False


def processes_of(root: Path) -> List[int]:
    """Live processes whose command line or environment names ``root`` (runners, cells, their children)."""
    own, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != own:
            stat = _run_detach.read_stat(int(name))
            if stat is not None and stat.state != "Z" and _mentions(int(name), str(root).encode()):
                found.append(int(name))
    return found


def runners_of(run_dir: Path) -> List[int]:
    """Runner processes of this run (by command line only: cheaper than reading every environment)."""
    needle, pids = f"{run_dir}/runner/run.py".encode(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _run_detach.read_stat(int(name))
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    if needle in handle.read() and stat is not None and stat.state != "Z":
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def log_of(run_dir: Path, name: str) -> str:
    path = run_dir / "cells" / name / "log"
    return path.read_text(errors="replace") if path.exists() else ""


def result_of(run_dir: Path, name: str) -> Dict[str, Any]:
    return json.loads((run_dir / "cells" / name / "result.json").read_text())


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A data dir (with the run's code dir), a durable dir, a private tmux socket dir; everything killed after."""
    socket_dir = tempfile.mkdtemp(prefix="rgt")  # short: a unix socket path has at most 107 bytes
    monkeypatch.setenv("TMUX_TMPDIR", socket_dir)
    data, durable = tmp_path / "data", tmp_path / "durable"
    for run in ("r1", "r2", "sec"):
        (data / "code" / run).mkdir(parents=True)
    durable.mkdir()
    yield {"data": data, "durable": durable, "root": tmp_path}
    for pid in processes_of(tmp_path) if (data / "runs").exists() else []:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["tmux", "kill-server"], capture_output=True, check=False)
    shutil.rmtree(socket_dir, ignore_errors=True)


def args_for(box, run: str = "r1", cells=None, **extra: Any) -> Dict[str, Any]:
    base = {
        "run": run,
        "data_dir": str(box["data"]),
        "cells": cells if cells is not None else [cell("a"), cell("b")],
        "gpus": [],
        "detach": "setsid",
        "monitor_interval_s": 1,
        "stop_grace_s": 1,
    }
    return dict(base, **extra)


def test_starts_detached_returns_within_seconds_and_finishes_alone(box, run_module):
    args = args_for(box, durable_dir=str(box["durable"]), artifacts=["best.pth"], prune=["latest.pth"])
    began = time.monotonic()
    code, result = run_module(training_run, args)
    assert code == 0, result
    assert time.monotonic() - began < 10
    run_dir = box["data"] / "runs" / "r1"
    assert (result["changed"], result["state"], result["detach"], result["resumed"]) == (
        True,
        "running",
        "setsid",
        False,
    )
    assert result["msg"].startswith("run r1 started (setsid, pgid ")
    assert result["run_dir"] == str(run_dir)
    assert result["attach"] == f"tail -f {run_dir}/runner.log"
    assert [c["name"] for c in result["cells"]] == ["a", "b"]
    assert {c["status"] for c in result["cells"]} <= {"running", "pending"}
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["pgid"], record["sid"], record["pids"]) == (result["pgid"], result["sid"], result["pids"])
    assert oct((run_dir / "spec.json").stat().st_mode & 0o777) == "0o644"
    assert not (run_dir / ".secrets.json").exists()
    for name in ("run.py", "ansible_collections/__init__.py"):
        assert (run_dir / "runner" / name).is_file()
    wait_for((run_dir / "DONE").exists, what="DONE")
    assert (box["durable"] / "runs" / "r1" / "cells" / "a" / "best.pth").is_file()
    code, result = run_module(training_run, args)
    assert (result["changed"], result["state"]) == (False, "done")
    assert [(c["status"], c["sync"], c["done"]) for c in result["cells"]] == [("succeeded", "verified", True)] * 2


def test_a_second_call_changes_nothing_and_starts_no_second_runner(box, run_module):
    args = args_for(box, cells=[cell("a", "--forever", "--step-s", "0.1")])
    code, first = run_module(training_run, args)
    assert code == 0 and first["changed"] is True
    run_dir = box["data"] / "runs" / "r1"
    assert runners_of(run_dir) == first["pids"]
    wait_for(lambda: json.loads((run_dir / "run.json").read_text())["cells"][0]["state"] == "started", what="cell a")
    code, second = run_module(training_run, args)
    assert code == 0
    assert second["changed"] is False
    assert second["msg"] == f"run r1 already running (pgid {first['pgid']})"
    assert (second["state"], second["pgid"], second["pids"]) == ("running", first["pgid"], first["pids"])
    assert second["cells"][0]["status"] == "running"
    time.sleep(0.3)
    assert runners_of(run_dir) == first["pids"]


def test_a_different_live_run_is_refused_unless_allow_concurrent(box, run_module):
    code, first = run_module(training_run, args_for(box, cells=[cell("a", "--forever", "--step-s", "0.1")]))
    assert code == 0
    code, refused = run_module(training_run, args_for(box, run="r2"))
    assert code == 1
    assert refused["msg"] == (
        f"run r1 (pgid {first['pgid']}) is running on this box; set allow_concurrent to start r2 beside it"
    )
    assert not (box["data"] / "runs" / "r2").exists()
    code, allowed = run_module(training_run, args_for(box, run="r2", allow_concurrent=True))
    assert code == 0 and allowed["changed"] is True and allowed["state"] in ("running", "done")


def killed_with_b_training(box, run_module, cells, **extra: Any) -> Dict[str, Any]:
    """r1 started; once a is done and b trains, its runner is killed: b trains on without it."""
    code, first = run_module(training_run, args_for(box, cells=cells, **extra))
    assert code == 0, first
    run_dir = box["data"] / "runs" / "r1"
    wait_for((run_dir / "cells" / "a" / "result.json").exists, what="cell a's result")
    wait_for(lambda: "epoch 1/inf" in log_of(run_dir, "b"), what="cell b's first epoch")
    os.kill(first["pids"][0], signal.SIGKILL)
    wait_for(lambda: not runners_of(run_dir), what="the runner's death")
    return first


def test_a_dead_runners_cell_still_training_is_refused_by_name_then_resumed_once_stopped(box, run_module):
    stop = box["root"] / "stop-b"
    cells = [cell("a"), cell("b", "--forever", "--step-s", "0.1", "--stop-file", str(stop))]
    first = killed_with_b_training(box, run_module, cells)
    run_dir = box["data"] / "runs" / "r1"
    orphans = _relaunch.still_training("r1", str(run_dir))
    assert list(orphans) == ["b"]
    pids = ", ".join(str(pid) for pid in orphans["b"])
    for check_mode in (True, False):
        code, refused = run_module(training_run, args_for(box, cells=cells), check_mode=check_mode)
        assert code == 1
        assert refused["msg"] == (
            f"run r1: cell b still trains (pid {pids}) without its runner: wait for it, or stop it with "
            "training_run state=stopped"
        )
    assert _relaunch.still_training("r1", str(run_dir)) == orphans  # not stopped, not restarted
    code, dead = run_module(training_run, dict(args_for(box, cells=cells), state="stopped"), check_mode=True)
    assert (dead["changed"], dead["state"]) == (True, "stopped")
    assert dead["msg"] == "would stop 1 process(es) left by run r1, SIGKILL after 1 s"
    code, stopped = run_module(training_run, dict(args_for(box, cells=cells), state="stopped"))
    assert code == 0, stopped
    code, resumed = run_module(training_run, args_for(box, cells=cells))
    assert code == 0, resumed
    assert (resumed["changed"], resumed["resumed"], resumed["skipped_cells"]) == (True, True, ["a"])
    facts = {key: resumed[key] for key in ("outcome", "cells_left", "recopy_cells", "kept_cells", "changes")}
    assert facts == {"outcome": "resumed", "cells_left": 1, "recopy_cells": [], "kept_cells": ["a"], "changes": []}
    assert resumed["msg"].startswith("run r1 resumed (setsid, pgid ")
    assert resumed["msg"].endswith(": 1 cell(s) to run; kept (already done): a")
    assert resumed["pids"] != first["pids"]
    stop.touch()
    wait_for((run_dir / "DONE").exists, what="DONE")
    assert log_of(run_dir, "a").count("attempt 1/1 starting") == 1
    assert result_of(run_dir, "b")["status"] == "succeeded"


def finished(box, run_module, cells, **extra: Any) -> Dict[str, Any]:
    args = args_for(box, cells=cells, durable_dir=str(box["durable"]), artifacts=["best.pth"], **extra)
    code, first = run_module(training_run, args)
    assert code == 0, first
    run_dir = box["data"] / "runs" / "r1"
    wait_for((run_dir / "DONE").exists, what="DONE")
    wait_for(lambda: not runners_of(run_dir), what="the runner's exit")
    return args


def run_cells(run_dir: Path) -> Dict[str, Dict[str, Any]]:
    return {view["name"]: view for view in json.loads((run_dir / "run.json").read_text())["cells"]}


def test_a_finished_run_relaunched_with_one_more_cell_is_refused_unless_applied(box, run_module):
    args = finished(box, run_module, [cell("a"), cell("b")])
    run_dir = box["data"] / "runs" / "r1"
    code, same = run_module(training_run, args)
    assert (code, same["changed"], same["state"], same["outcome"]) == (0, False, "done", "done")
    assert (same["cells_left"], same["recopy_cells"], same["kept_cells"], same["changes"]) == (0, [], ["a", "b"], [])
    kept = tree_digest(run_dir / "cells")
    grown = dict(args, cells=[cell("a"), cell("b"), cell("c")])
    for check_mode in (True, False):
        code, refused = run_module(training_run, grown, check_mode=check_mode)
        assert code == 1
        assert refused["msg"] == (
            "run r1 on this box has another spec: set launch_apply_changes: true (module: apply_changes) to run the "
            "changed cells, or use a new run name; changes: cell c added"
        )
        assert refused["changes"] == ["cell c added"]
    assert not (run_dir / "cells" / "c").exists() and (run_dir / "DONE").exists()
    code, would = run_module(training_run, dict(grown, apply_changes=True), check_mode=True)
    assert (code, would["outcome"], would["cells_left"], would["kept_cells"]) == (0, "resumed", 1, ["a", "b"])
    code, applied = run_module(training_run, dict(grown, apply_changes=True))
    assert code == 0, applied
    assert (applied["outcome"], applied["changes"], applied["cells_left"]) == ("resumed", ["cell c added"], 1)
    wait_for((run_dir / "DONE").exists, what="DONE with c")
    wait_for(lambda: not runners_of(run_dir), what="the runner's exit")
    assert result_of(run_dir, "c")["status"] == "succeeded"
    assert {k: v for k, v in tree_digest(run_dir / "cells").items() if not k.startswith("c/")} == kept
    views = run_cells(run_dir)
    assert [views[name]["command"] for name in ("a", "b")] == [cell("a")["command"], cell("b")["command"]]
    code, again = run_module(training_run, grown)
    assert (code, again["outcome"], again["changed"], again["kept_cells"]) == (0, "done", False, ["a", "b", "c"])


def test_a_resumed_run_keeps_the_argv_that_produced_a_kept_result(box, run_module):
    stop = box["root"] / "stop-b"
    cells = [cell("a"), cell("b", "--forever", "--step-s", "0.1", "--stop-file", str(stop))]
    killed_with_b_training(box, run_module, cells)
    code, stopped = run_module(training_run, dict(args_for(box, cells=cells), state="stopped"))
    assert code == 0, stopped
    run_dir = box["data"] / "runs" / "r1"
    changed = [cell("a", "--epochs", "3"), cells[1]]
    code, refused = run_module(training_run, args_for(box, cells=changed))
    assert (code, refused["changes"]) == (1, ["cell a: command changed"])
    code, applied = run_module(training_run, args_for(box, cells=changed, apply_changes=True))
    assert code == 0, applied
    assert (applied["outcome"], applied["kept_cells"], applied["cells_left"]) == ("resumed", ["a"], 1)
    stop.touch()
    wait_for((run_dir / "DONE").exists, what="DONE")
    view = run_cells(run_dir)["a"]
    assert (view["command"], view["command_now"]) == (cells[0]["command"], changed[0]["command"])
    assert log_of(run_dir, "a").count("attempt 1/1 starting") == 1


def test_a_run_whose_scratch_was_removed_by_hand_is_refused_over_its_durable_copy(box, run_module):
    args = finished(box, run_module, [cell("a"), cell("b")])
    shutil.rmtree(box["data"] / "runs" / "r1")  # no tombstone: the durable copy's launch record still says whose
    durable = box["durable"] / "runs" / "r1"
    before = tree_digest(durable)
    code, refused = run_module(training_run, dict(args, cells=[cell("a"), cell("c")]))
    assert code == 1 and refused["msg"].startswith(f"run r1: {durable} holds launch ")
    assert "set launch_new_attempt: true" in refused["msg"]
    assert tree_digest(durable) == before and not (box["data"] / "runs" / "r1").exists()
    code, fresh = run_module(training_run, dict(args, cells=[cell("a"), cell("c")], new_attempt=True))
    assert (code, fresh["outcome"], [m["to"] for m in fresh["archived"]]) == (0, "started", [f"{durable}@attempt-1"])
    wait_for((box["data"] / "runs" / "r1" / "DONE").exists, what="the new attempt's DONE")
    lines = (durable / "MANIFEST.sha256").read_text().splitlines()
    assert [line.split("  ")[2] for line in lines] == ["cells/a/best.pth", "cells/c/best.pth"]


def test_a_live_run_with_another_spec_is_refused_and_with_the_same_left_alone(box, run_module):
    cells = [cell("a", "--forever", "--step-s", "0.1")]
    code, first = run_module(training_run, args_for(box, cells=cells))
    assert code == 0, first
    for apply in (False, True):
        code, refused = run_module(training_run, args_for(box, cells=[*cells, cell("c")], apply_changes=apply))
        assert code == 1 and refused["changes"] == ["cell c added"]
        assert refused["msg"].startswith("run r1 is running on this box with another spec: let it end or stop it")
    code, same = run_module(training_run, args_for(box, cells=cells))
    assert (code, same["changed"], same["outcome"], same["changes"], same["cells_left"]) == (
        0,
        False,
        "already_running",
        [],
        1,
    )


def test_a_cell_whose_command_succeeded_but_copy_failed_is_recopied_not_retrained(box, run_module):
    starts = box["root"] / "starts"
    cells = [cell("a", "--starts-file", str(starts)), cell("b", "--starts-file", str(starts))]
    synced = {"durable_dir": str(box["durable"])}
    code, first = run_module(training_run, args_for(box, cells=cells, artifacts=["best.pt"], **synced))
    assert code == 0, first
    run_dir = box["data"] / "runs" / "r1"
    wait_for(lambda: (run_dir / "cells" / "b" / "result.json").exists() and not runners_of(run_dir), what="the end")
    assert result_of(run_dir, "a")["sync"] == "failed" and not (run_dir / "DONE").exists()  # best.pt: a typo
    fixed = args_for(box, cells=cells, artifacts=["best.pth"], **synced)
    code, refused = run_module(training_run, fixed)
    assert (code, refused["changes"]) == (1, ["artifacts changed"])
    code, would = run_module(training_run, dict(fixed, apply_changes=True), check_mode=True)
    facts = {key: would[key] for key in ("outcome", "cells_left", "recopy_cells", "kept_cells")}
    assert facts == {"outcome": "resumed", "cells_left": 0, "recopy_cells": ["a", "b"], "kept_cells": []}
    assert "re-copies without training (command succeeded, copy not verified): a, b" in would["msg"]
    code, applied = run_module(training_run, dict(fixed, apply_changes=True))
    assert (code, applied["recopy_cells"], applied["cells_left"]) == (0, ["a", "b"], 0), applied
    wait_for((run_dir / "DONE").exists, what="DONE after the re-copy")
    assert [line.split()[1] for line in starts.read_text().splitlines()] == ["a", "b"]  # trained once each
    assert (result_of(run_dir, "a")["sync"], result_of(run_dir, "a")["recopied"]) == ("verified", True)


def test_a_relaunch_that_drops_a_synced_cell_is_refused_so_the_manifest_never_lists_it(box, run_module):
    # Before: the resume ran [a, c] and MANIFEST.sha256 listed a, b and c, b from the earlier spec.
    stop = box["root"] / "stop-c"
    synced = {"durable_dir": str(box["durable"]), "artifacts": ["best.pth"]}
    cells = [cell("a"), cell("b"), cell("c", "--forever", "--step-s", "0.1", "--stop-file", str(stop))]
    code, first = run_module(training_run, args_for(box, cells=cells, **synced))
    assert code == 0, first
    run_dir = box["data"] / "runs" / "r1"
    wait_for((run_dir / "cells" / "b" / "result.json").exists, what="cell b's result")
    os.kill(first["pids"][0], signal.SIGKILL)
    wait_for(lambda: not runners_of(run_dir), what="the runner's death")
    code, stopped = run_module(training_run, dict(args_for(box, cells=cells, **synced), state="stopped"))
    assert code == 0, stopped
    manifest = box["durable"] / "runs" / "r1" / "MANIFEST.sha256"
    before = manifest.read_text()
    for apply in (False, True):
        args = args_for(box, cells=[cell("a"), cells[2]], apply_changes=apply, **synced)
        code, refused = run_module(training_run, args)
        assert code == 1 and refused["changes"] == ["cell b removed"]
    assert refused["msg"] == (
        "run r1: cell b is not in this launch but succeeded, and the durable copy holds their files: keep them in "
        "the sweep, or use a new run name"
    )
    time.sleep(0.3)
    assert manifest.read_text() == before and not runners_of(run_dir)


def test_stopped_kills_the_group_including_a_child_ignoring_sigterm(box, run_module):
    cells = [cell("a", "--forever", "--ignore-sigterm", "--step-s", "0.1")]
    code, first = run_module(training_run, args_for(box, cells=cells))
    assert code == 0
    run_dir = box["data"] / "runs" / "r1"
    wait_for(lambda: "epoch 1/inf" in log_of(run_dir, "a"), what="cell a's first epoch")
    code, check = run_module(training_run, dict(args_for(box, cells=cells), state="stopped"), check_mode=True)
    assert (check["changed"], check["state"]) == (True, "running")
    assert runners_of(run_dir) == first["pids"]
    began = time.monotonic()
    code, stopped = run_module(training_run, dict(args_for(box, cells=cells), state="stopped"))
    assert code == 0, stopped
    assert (stopped["changed"], stopped["state"]) == (True, "stopped")
    assert time.monotonic() - began < 15
    assert processes_of(run_dir) == []
    for name in ("run.json", "spec.json", "runner.log", "cells/a/log"):
        assert (run_dir / name).exists()
    result = result_of(run_dir, "a")
    assert (result["status"], result["reason"]) == ("failed", "run stopped")
    assert result["signal"] in (signal.SIGTERM, signal.SIGKILL)
    code, again = run_module(training_run, dict(args_for(box, cells=cells), state="stopped"))
    assert (again["changed"], again["state"]) == (False, "stopped")


def test_stopped_also_ends_the_cells_a_dead_runner_left(box, run_module):
    args = args_for(box, cells=[cell("a", "--forever", "--step-s", "0.1")])
    code, first = run_module(training_run, args)
    run_dir = box["data"] / "runs" / "r1"
    wait_for(lambda: "epoch 1/inf" in log_of(run_dir, "a"), what="cell a's first epoch")
    os.kill(first["pids"][0], signal.SIGKILL)
    wait_for(lambda: not runners_of(run_dir), what="the runner's death")
    assert processes_of(run_dir) != []
    code, stopped = run_module(training_run, dict(args, state="stopped"))
    assert code == 0, stopped
    assert stopped["changed"] is True and stopped["msg"].startswith("stopped 1 process(es) left by run r1: ")
    assert processes_of(run_dir) == []
    code, again = run_module(training_run, dict(args, state="stopped"))
    assert (again["changed"], again["msg"]) == (False, "run r1 is not running (stopped)")


def test_check_mode_writes_and_starts_nothing(box, run_module):
    code, result = run_module(training_run, args_for(box, secrets={"WANDB_API_KEY": SECRET}), check_mode=True)
    assert code == 0
    assert (result["changed"], result["state"], result["resumed"]) == (True, "running", False)
    assert result["msg"] == "would start run r1 (setsid): 2 cell(s) to run"
    assert sorted(os.listdir(box["data"])) == ["code"]
    assert processes_of(box["root"]) == []


def test_secrets_reach_only_the_job_and_the_0600_file(box, run_module):
    args = args_for(
        box,
        run="sec",
        cells=[cell("a", "--print-env", "WANDB_API_KEY")],
        secrets={"WANDB_API_KEY": SECRET},
        env={"WANDB_MODE": "online", "OMP_NUM_THREADS": 2},
    )
    code, result = run_module(training_run, args)
    assert code == 0, result["msg"]
    run_dir = box["data"] / "runs" / "sec"
    wait_for((run_dir / "DONE").exists, what="DONE")
    secrets_file = run_dir / ".secrets.json"
    assert oct(secrets_file.stat().st_mode & 0o777) == "0o600"
    assert json.loads(secrets_file.read_text()) == {"WANDB_API_KEY": SECRET}
    proof = hashlib.sha256(SECRET.encode()).hexdigest()[:16]
    assert f"env WANDB_API_KEY sha256={proof}" in (run_dir / "cells" / "a" / "log").read_text()
    assert SECRET not in json.dumps(result)
    code, again = run_module(training_run, args)
    assert SECRET not in json.dumps(again)
    for path in box["root"].rglob("*"):
        if path.is_file() and path != secrets_file:
            assert SECRET.encode() not in path.read_bytes(), path


def test_setsid_detach_survives_the_session_that_started_it(box, tmp_path):
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args_for(box, cells=[cell("a", "--step-s", "0.3")])}))
    env = dict(os.environ, PYTHONPATH=str(collection_root()))
    # Its own session, like an SSH login; killed as a whole once the module returned, as sshd's teardown does.
    session = subprocess.Popen(
        [sys.executable, training_run.__file__, str(args_file)],
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    out, _err = session.communicate(timeout=30)
    with pytest.raises(ProcessLookupError):
        os.killpg(session.pid, signal.SIGKILL)  # nothing of the run is left in the caller's session
    result = json.loads(out)
    assert result["changed"] is True, result
    runner = result["pids"][0]
    stat = _run_detach.read_stat(runner)
    assert stat is not None and stat.sid not in (os.getsid(0), session.pid) and stat.sid == result["sid"]
    assert stat.pgid != os.getpgrp()
    with open(f"/proc/{runner}/stat", "rb") as handle:
        assert int(handle.read().rpartition(b")")[2].split()[2]) != session.pid  # the parent is gone
    for fd in (0, 1, 2):
        target = os.readlink(f"/proc/{runner}/fd/{fd}")
        assert (target == "/dev/null") if fd == 0 else target.endswith("/runner.log")
    run_dir = box["data"] / "runs" / "r1"
    wait_for((run_dir / "DONE").exists, what="DONE after the session ended")


def test_tmux_detach_names_its_session_and_attach_command(box, run_module):
    args = args_for(box, run="r1", cells=[cell("a", "--forever", "--step-s", "0.1")], detach="auto")
    code, result = run_module(training_run, args)
    assert code == 0, result
    assert (result["detach"], result["attach"]) == ("tmux", "tmux attach -t rgt-r1")
    panes = _run_detach.tmux_panes(shutil.which("tmux"), "rgt-r1", os.environ)
    assert panes == [(False, result["pids"][0])]
    assert result["pgid"] == result["sid"] == result["pids"][0]
    code, again = run_module(training_run, args)
    assert again["changed"] is False
    code, stopped = run_module(training_run, dict(args, state="stopped"))
    assert stopped["changed"] is True
    wait_for(lambda: _run_detach.tmux_panes(shutil.which("tmux"), "rgt-r1", os.environ) is None, what="tmux")


BAD_OPTIONS = [
    ({"run": "bad/name"}, "run 'bad/name' does not match"),
    ({"data_dir": "relative"}, "data_dir must be an absolute path"),
    ({"cells": []}, "cells must be a non-empty list"),
    ({"cells": [{"name": "a", "command": []}]}, "cell a: command must be a non-empty list of strings"),
    ({"cells": [cell("a"), cell("a")]}, "cell names must be unique: a"),
    ({"cells": [cell("a", timeout_s=0)]}, "cell a: timeout_s must be a number of at least 1"),
    ({"gpus": [0, 1], "gpus_per_cell": 3}, "gpus_per_cell 3 is more than the box's 2 GPUs"),
    ({"gpus_per_cell": 0}, "gpus_per_cell must be an integer between 1 and 1024, got 0"),
    ({"stop_grace_s": float("nan")}, "stop_grace_s must be a finite number between 0 and 3600, got nan"),
    ({"start_timeout_s": 0}, "start_timeout_s must be a finite number above 0 and at most 600, got 0"),
    ({"monitor_interval_s": 0.01}, "monitor_interval_s must be a finite number between 0.1 and 86400"),
    ({"artifacts": ["best.pth"]}, "artifacts are declared but durable_dir is not set"),
    ({"prune": ["../x"]}, "prune: '../x' must stay inside the cell's directory"),
    ({"env": {"BAD-NAME": "1"}}, "env: 'BAD-NAME' is not an environment variable name"),
    ({"env": {"WANDB_MODE": "online"}}, "env WANDB_MODE=online needs a WANDB_API_KEY secret"),
    ({"secrets": {"1X": SECRET}}, "secrets: '1X' is not an environment variable name"),
    ({"shard": {"index": 2, "count": 2}}, "shard needs 1 <= count and 0 <= index < count"),
    ({"detach": "nohup"}, "value of detach must be one of: auto, tmux, setsid"),
    ({"env_hook": "/nonexistent/hook"}, "env_hook /nonexistent/hook is not a readable file"),
    ({"launch_id": "a b"}, "launch_id 'a b' does not match"),
    ({"verify_artifacts": ["*.pt"]}, "verify_artifacts chooses the artifacts verify_cmd runs on, but verify_cmd is"),
]


@pytest.mark.parametrize(("change", "message"), BAD_OPTIONS)
def test_a_bad_option_fails_in_one_line_naming_it(box, run_module, change, message):
    code, result = run_module(training_run, {**args_for(box), "secrets": {"OTHER": SECRET}, **change})
    assert code == 1
    assert message in result["msg"]
    assert "\n" not in result["msg"] and SECRET not in json.dumps(result)
    assert not (box["data"] / "runs").exists()


def test_verify_artifacts_reach_the_spec_and_choose_what_the_loader_opens(box, run_module):
    loader = [sys.executable, "-c", "import sys; sys.exit(0 if sys.argv[1].endswith('best.pth') else 3)"]
    args = args_for(box, cells=[cell("a")], durable_dir=str(box["durable"]), artifacts=["best.pth", "latest.pth"])
    code, result = run_module(training_run, dict(args, verify_cmd=loader, verify_artifacts=["best.*"]))
    assert code == 0, result
    run_dir = box["data"] / "runs" / "r1"
    assert json.loads((run_dir / "spec.json").read_text())["verify_artifacts"] == ["best.*"]
    wait_for((run_dir / "DONE").exists, what="DONE")
    assert [(c["path"], c["ok"]) for c in result_of(run_dir, "a")["verify"]] == [("best.pth", True)]


def test_started_needs_cells(box, run_module):
    args = args_for(box)
    del args["cells"]
    code, result = run_module(training_run, args)
    assert code == 1 and "cells" in result["msg"]


def test_a_missing_workdir_fails_before_anything_is_written(box, run_module):
    code, result = run_module(training_run, args_for(box, run="r9"))
    assert code == 1
    assert result["msg"] == f"workdir {box['data']}/code/r9 is not a directory (bring the code first)"
    assert not (box["data"] / "runs" / "r9").exists()


def test_a_missing_durable_dir_fails_before_anything_trains(box, run_module):
    # The shipped RunPod and Vast.ai profiles name /workspace/durable, which a fresh box does not have.
    missing = box["root"] / "workspace" / "durable"
    code, result = run_module(training_run, args_for(box, durable_dir=str(missing), artifacts=["best.pth"]))
    assert code == 1 and result["msg"].startswith(f"durable_dir {missing} is not a directory on the box")
    assert not (box["data"] / "runs" / "r1").exists() and not missing.exists()


def test_a_runner_that_dies_before_registering_fails_with_its_log(box, run_module, monkeypatch):
    monkeypatch.setattr(_training_run, "RUN_PY", "import sys\nprint('rgt: broken runner')\nsys.exit(3)\n")
    code, result = run_module(training_run, args_for(box))
    assert code == 1
    assert result["msg"].startswith("the runner of r1 ended before it registered in run.json; runner.log: ")
    assert "broken runner" in result["msg"]


def test_gpus_come_from_nvidia_smi_or_none():
    assert _training_run.detect_gpus(lambda argv, timeout: (0, "0\n1\n", "")) == [0, 1]
    assert _training_run.detect_gpus(lambda argv, timeout: (127, "", "not found")) == []
    assert _training_run.detect_gpus(lambda argv, timeout: (0, "No devices were found\n", "")) == []


def test_a_launch_lock_held_too_long_fails_the_start(box, run_module, monkeypatch):
    monkeypatch.setattr(_training_run, "LOCK_MARGIN_S", 0.0)
    monkeypatch.setattr(_training_run, "STOP_SETTLE_S", 0.0)
    (box["data"] / "runs").mkdir()
    lock = box["data"] / "runs" / ".launch.lock"
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        code, result = run_module(training_run, args_for(box, stop_grace_s=0, start_timeout_s=0.3))
    assert code == 1
    assert result["msg"] == f"another launch on this box held {lock} for more than 0.3 s"
    assert not (box["data"] / "runs" / "r1").exists()


def tree_digest(root: Path) -> Dict[str, str]:
    """sha256 of every file under ``root`` (hidden ones included), by relative path."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def finished_and_torn_down(box, run_module) -> Dict[str, Any]:
    """r1 (cells a, b) done with its artifacts in durable_dir, then its scratch removed and its tombstone written,
    as teardown leaves it; the durable copy is the only one left."""
    args = args_for(box, durable_dir=str(box["durable"]), artifacts=["best.pth"])
    code, first = run_module(training_run, args)
    assert code == 0, first
    run_dir = box["data"] / "runs" / "r1"
    wait_for((run_dir / "DONE").exists, what="DONE")
    wait_for(lambda: not runners_of(run_dir), what="the runner's exit")
    shutil.rmtree(run_dir)
    tombstone = Path(tombstone_path(str(box["data"]), "r1"))
    tombstone.parent.mkdir(parents=True, exist_ok=True)
    tombstone.write_text(json.dumps({"run": "r1", "removed_at": "2026-12-04T00:00:00Z", "removed": []}))
    return first


def test_a_torn_down_run_name_is_refused_and_its_durable_copy_left_as_it_was(box, run_module):
    first = finished_and_torn_down(box, run_module)
    durable = box["durable"] / "runs" / "r1"
    assert json.loads((durable / ".launch.json").read_text())["launch_id"] == first["launch_id"]
    before = tree_digest(box["durable"])
    args = args_for(box, durable_dir=str(box["durable"]), artifacts=["best.pth"])
    for check_mode in (True, False):
        code, refused = run_module(training_run, args, check_mode=check_mode)
        assert code == 1
        assert refused["msg"].startswith(f"run r1 was torn down on this box ({box['data']}/runs/.torn_down/r1.json)")
        assert "set launch_new_attempt: true" in refused["msg"] and "\n" not in refused["msg"]
        assert len(refused["msg"]) < 300  # the launch line keeps 300 characters: the way out must be in them
    time.sleep(0.5)  # a runner started by mistake would have begun to overwrite by now
    assert tree_digest(box["durable"]) == before
    assert not (box["data"] / "runs" / "r1").exists() and processes_of(box["root"]) == []


def test_new_attempt_archives_the_earlier_copy_and_tombstone_then_starts_afresh(box, run_module):
    first = finished_and_torn_down(box, run_module)
    durable, torn = box["durable"] / "runs", box["data"] / "runs" / ".torn_down"
    before = tree_digest(durable / "r1")
    args = args_for(
        box, cells=[cell("a"), cell("c")], durable_dir=str(box["durable"]), artifacts=["best.pth"], new_attempt=True
    )
    moved = [
        {"from": str(durable / "r1"), "to": str(durable / "r1@attempt-1")},
        {"from": str(torn / "r1.json"), "to": str(torn / "r1@attempt-1.json")},
    ]
    code, check = run_module(training_run, args, check_mode=True)
    assert (code, check["changed"], check["archived"]) == (0, True, moved)
    assert check["msg"].endswith(
        f"; would archive the earlier attempt: {durable}/r1 -> {durable}/r1@attempt-1, "
        f"{torn}/r1.json -> {torn}/r1@attempt-1.json"
    )
    assert sorted(os.listdir(durable)) == ["r1"] and sorted(os.listdir(torn)) == ["r1.json"]
    code, result = run_module(training_run, args)
    assert code == 0, result
    assert (result["changed"], result["resumed"], result["archived"]) == (True, False, moved)
    assert "archived the earlier attempt" in result["msg"] and result["launch_id"] != first["launch_id"]
    assert tree_digest(durable / "r1@attempt-1") == before  # renamed, not a byte changed
    assert sorted(os.listdir(torn)) == ["r1@attempt-1.json"]
    wait_for((box["data"] / "runs" / "r1" / "DONE").exists, what="the new attempt's DONE")
    assert json.loads((durable / "r1" / ".launch.json").read_text())["launch_id"] == result["launch_id"]
    assert json.loads((box["data"] / "runs" / "r1" / "run.json").read_text())["launch_id"] == result["launch_id"]
    lines = (durable / "r1" / "MANIFEST.sha256").read_text().splitlines()
    assert [line.split("  ")[2] for line in lines] == ["cells/a/best.pth", "cells/c/best.pth"]  # no b: one launch


def test_a_durable_copy_of_another_launch_is_refused_and_a_box_of_the_same_launch_joins_it(box, run_module):
    durable = box["durable"] / "runs" / "r1"
    synced = {"durable_dir": str(box["durable"]), "artifacts": ["best.pth"]}
    code, first = run_module(
        training_run, args_for(box, cells=[cell("a")], launch_id="20261204T000000Z-aaaaaa", **synced)
    )
    assert (code, first["launch_id"]) == (0, "20261204T000000Z-aaaaaa"), first
    wait_for((box["data"] / "runs" / "r1" / "DONE").exists, what="DONE on the first box")
    before = tree_digest(box["durable"])
    # A second box sharing durable_dir (AutoDL's /root/autodl-fs): its own data dir, no scratch of r1 there.
    second = box["root"] / "data2"
    (second / "code" / "r1").mkdir(parents=True)
    other = dict(args_for(box, cells=[cell("b")], **synced), data_dir=str(second))
    code, refused = run_module(training_run, dict(other, launch_id="20261205T000000Z-bbbbbb"))
    assert code == 1
    assert refused["msg"].startswith(f"run r1: {durable} holds launch 20261204T000000Z-aaaaaa, not 20261205T")
    assert "set launch_new_attempt: true" in refused["msg"]
    assert "set launch_id: 20261204T000000Z-aaaaaa to add this box to that launch" in refused["msg"]
    assert tree_digest(box["durable"]) == before and not (second / "runs" / "r1").exists()
    code, joined = run_module(training_run, dict(other, launch_id="20261204T000000Z-aaaaaa"))
    assert (code, joined["changed"], joined["archived"]) == (0, True, []), joined
    wait_for((second / "runs" / "r1" / "DONE").exists, what="DONE on the second box")
    lines = (durable / "MANIFEST.sha256").read_text().splitlines()
    assert [line.split("  ")[2] for line in lines] == ["cells/a/best.pth", "cells/b/best.pth"]


def test_a_dead_run_resumes_under_its_own_launch_and_skips_its_done_cells(box, run_module):
    stop = box["root"] / "stop-b"
    cells = [cell("a"), cell("b", "--forever", "--step-s", "0.1", "--stop-file", str(stop))]
    synced = {"durable_dir": str(box["durable"]), "artifacts": ["best.pth"], "launch_id": "first-1"}
    args = args_for(box, cells=cells, **synced)
    killed_with_b_training(box, run_module, cells, **synced)
    run_dir = box["data"] / "runs" / "r1"
    synced_a = tree_digest(box["durable"] / "runs" / "r1" / "cells" / "a")
    code, stopped = run_module(training_run, dict(args, state="stopped"))
    assert code == 0, stopped
    # The next playbook run brings a new id: the box's run.json says which launch this is.
    code, resumed = run_module(training_run, dict(args, launch_id="second-2"))
    assert code == 0, resumed
    assert (resumed["resumed"], resumed["skipped_cells"], resumed["launch_id"]) == (True, ["a"], "first-1")
    stop.touch()
    wait_for((run_dir / "DONE").exists, what="DONE")
    assert tree_digest(box["durable"] / "runs" / "r1" / "cells" / "a") == synced_a
    assert json.loads((box["durable"] / "runs" / "r1" / ".launch.json").read_text())["launch_id"] == "first-1"
    code, again = run_module(training_run, dict(args, new_attempt=True))
    assert (code, again["changed"], again["state"], again["launch_id"]) == (
        0,
        False,
        "done",
        "first-1",
    )  # nothing starts over a done run


# --- issue 29, item 1 (and 2): the box's other data dirs and GPU users --------------------------------------------


def test_a_started_run_registers_its_data_dir_on_the_box_check_mode_does_not(box, run_module, instance_dir):
    args = args_for(box, durable_dir=str(box["durable"]), cells=[cell("a")])
    assert run_module(training_run, args, check_mode=True)[0] == 0
    assert _box_state.registered_data_dirs()[0] == []
    code, result = run_module(training_run, args)
    assert code == 0, result
    (entry,) = _box_state.registered_data_dirs()[0]
    assert (entry["path"], entry["durable_dir"]) == (str(box["data"]), str(box["durable"]))


def test_a_live_run_of_another_data_dir_is_refused_unless_allow_concurrent(box, run_module):
    scratch = box["root"] / "scratch"
    (scratch / "code" / "r2").mkdir(parents=True)
    forever = [cell("a", "--forever", "--step-s", "0.1")]
    code, other = run_module(training_run, args_for(box, run="r2", data_dir=str(scratch), cells=forever))
    assert code == 0, other
    code, refused = run_module(training_run, args_for(box))
    assert code == 1
    assert refused["msg"] == (
        f"run r2 in {scratch} (pgid {other['pgid']}) is running on this box; set allow_concurrent to start r1 beside it"
    )
    assert not (box["data"] / "runs" / "r1").exists()
    code, allowed = run_module(training_run, args_for(box, allow_concurrent=True))
    assert code == 0 and allowed["changed"] is True


def test_a_gpu_a_hand_started_job_holds_is_warned_about(box, run_module, monkeypatch, tmp_path):
    devices = [tmp_path / f"nvidia{index}" for index in range(2)]
    for device in devices:
        device.write_text("")
    monkeypatch.setattr(
        _training_run, "GPU_DEVICE", re.compile(rf"^{re.escape(str(tmp_path))}/nvidia(?P<index>[0-9]+)$")
    )
    warned: List[str] = []  # the module's own warn() calls (where ansible-core delivers them varies)
    monkeypatch.setattr(training_run.AnsibleModule, "warn", lambda _module, text: warned.append(text))
    hold = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(60)"
    job = subprocess.Popen([sys.executable, "-c", hold, str(devices[1])], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        assert run_module(training_run, args_for(box, gpus=[0, 1]), check_mode=True)[0] == 0
        (warning,) = [text for text in warned if "belongs to no run" in text]
        assert warning.startswith(f"GPU 1 is in use by pid {job.pid} python")
        warned.clear()
        assert run_module(training_run, args_for(box, gpus=[0]), check_mode=True)[0] == 0
        assert not [text for text in warned if "belongs to no run" in text]  # not a GPU this run is given
    finally:
        job.kill()
        job.wait()
