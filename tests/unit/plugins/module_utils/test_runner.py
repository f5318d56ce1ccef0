"""The runner, for real, in temporary run directories with the fake training program as the workload."""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import parse_result, parse_run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner import _runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import marker_entry, members, own_ids
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._runner import RUNNER_MODULES, Runner, RunnerLog
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    make_run,
    records,
    results,
    start_runner,
    train,
    wait_for,
)

MODULE_UTILS = Path(_runner.__file__).resolve().parent.parent
SECRET = "rgt-unit-secret-7d2e"


def run(run_dir: Path, **environ: str) -> int:
    return Runner(str(run_dir), dict(os.environ, **environ)).run()


def test_a_runner_whose_session_leader_is_outside_the_pid_namespace_records_no_session(tmp_path, monkeypatch):
    # The kernel reports such a leader as 0, for this process and for every other process of an outside session.
    monkeypatch.setattr(os, "getsid", lambda pid: 0)
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    assert run(run_dir) == 0
    record = json.loads((run_dir / "run.json").read_text())
    registered = parse_run("sweep", str(run_dir / "run.json"), record)
    assert record["sid"] is None and registered.sid is None and registered.pgid == own_ids()[0]
    assert parse_result(results(run_dir)["a"]).counts_as_done() and (run_dir / "DONE").exists()


def crash_once(marker: Path, *args):
    """A cell that crashes (a traceback) while ``marker`` exists, removing it: the next attempt succeeds."""
    script = 'if rm "$0" 2>/dev/null; then set -- "$@" --crash; fi; exec "$@"'
    marker.write_text("")
    return ["bash", "-c", script, str(marker), *train(*args)]


def test_a_run_secures_every_cell_and_ends_with_done(tmp_path):
    show = ("--show-env", "CUDA_VISIBLE_DEVICES", "RGT_CELL")
    cells = [{"name": name, "command": train(*show)} for name in ("a", "b", "c")]
    run_dir = make_run(tmp_path, cells, prune=["latest.pth"], artifacts=["best.pth"], monitor_interval_s=0.1)
    assert run(run_dir, RGT_DETACH="tmux") == 0
    record = json.loads((run_dir / "run.json").read_text())
    registered = parse_run("sweep", str(run_dir / "run.json"), record)
    assert registered.pids == (os.getpid(),) and (registered.pgid, registered.sid) == own_ids()
    assert (record["schema"], record["run"], record["detach"], record["resumed"]) == (1, "sweep", "tmux", False)
    assert [(c["name"], c["gpus"]) for c in record["cells"]] == [("a", None), ("b", None), ("c", None)]
    assert record["cells"][0]["command"] == train(*show)
    assert "env CUDA_VISIBLE_DEVICES=<unset>\nenv RGT_CELL=b" in (run_dir / "cells" / "b" / "log").read_text()
    assert record["spec_sha256"] == hashlib.sha256((run_dir / "spec.json").read_bytes()).hexdigest()
    durable = tmp_path / "durable" / "runs" / "sweep"
    manifest = []
    for name, result in results(run_dir).items():
        parsed = parse_result(result)
        assert parsed.counts_as_done() and (parsed.exit_code, parsed.signal, result["attempts"]) == (0, None, 1)
        best = run_dir / "cells" / name / "best.pth"
        assert (durable / "cells" / name / "best.pth").read_bytes() == best.read_bytes()
        assert not (run_dir / "cells" / name / "latest.pth").exists()  # pruned, best.pth kept in scratch
        digest = hashlib.sha256(best.read_bytes()).hexdigest()
        assert result["artifacts"] == [{"path": "best.pth", "size": best.stat().st_size, "sha256": digest}]
        manifest.append(f"{digest}  {best.stat().st_size}  cells/{name}/best.pth")
    assert (durable / "MANIFEST.sha256").read_text().splitlines() == manifest
    assert (run_dir / "DONE").exists()
    ordered = [results(run_dir)[name] for name in ("a", "b", "c")]  # the whole box, one cell at a time, in order
    assert all(later["started_at"] > earlier["ended_at"] for earlier, later in zip(ordered, ordered[1:]))
    assert json.loads((run_dir / "monitor.jsonl").read_text().splitlines()[0])["run"]["procs"] >= 1
    log = (run_dir / "runner.log").read_text()
    assert "runner_started" in log and log.count("cell_result") == 3 and log.rstrip().endswith("run_done cells=3")


def test_statuses_and_signals_are_the_commands_own_and_no_done_after_a_failure(tmp_path):
    hook = tmp_path / "hook"
    hook.write_text("export FROM_HOOK=1\n")
    cells = [
        {"name": "exit137", "command": train("--exit", 137)},
        {"name": "killed", "command": train("--signal-self", 9)},
        {"name": "crash", "command": train("--crash")},
        {"name": "full", "command": train("--fill-disk", "--fill-limit-mib", 1)},
        {"name": "nan", "command": train("--nan")},
        {"name": "fine", "command": train("--show-env", "FROM_HOOK", "PYTHONUNBUFFERED", "WANDB_START_METHOD")},
    ]
    run_dir = make_run(tmp_path, cells, env_hook=str(hook))  # through the wrapper: still the command's status
    assert run(run_dir) == 1
    found = {name: (r["status"], r["exit_code"], r["signal"], r["sync"]) for name, r in results(run_dir).items()}
    assert found == {
        "exit137": ("failed", 137, None, "skipped"),
        "killed": ("failed", None, 9, "skipped"),
        "crash": ("failed", 1, None, "skipped"),
        "full": ("failed", 1, None, "skipped"),
        "nan": ("succeeded", 0, None, "skipped"),
        "fine": ("succeeded", 0, None, "skipped"),
    }
    assert "No space left on device" in (run_dir / "cells" / "full" / "log").read_text()
    assert "loss nan" in (run_dir / "cells" / "nan" / "log").read_text()
    assert results(run_dir)["killed"]["reason"] == "ended by signal 9 (SIGKILL)"
    assert "Traceback (most recent call last)" in (run_dir / "cells" / "crash" / "log").read_text()
    fine_log = (run_dir / "cells" / "fine" / "log").read_text()
    assert "env FROM_HOOK=1\nenv PYTHONUNBUFFERED=1\nenv WANDB_START_METHOD=thread" in fine_log
    assert not (run_dir / "DONE").exists()


def test_a_timeout_stops_the_cell_and_retries_rerun_a_failed_one(tmp_path):
    cells = [
        {"name": "slow", "command": train("--hang"), "timeout_s": 1},
        {"name": "flaky", "command": crash_once(tmp_path / "crash-flaky"), "retries": 2},
        {"name": "broken", "command": train("--crash"), "retries": 1},
    ]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1, 2], gpus_per_cell=1, stop_grace_s=0.5)
    assert run(run_dir) == 1
    slow, flaky, broken = (results(run_dir)[name] for name in ("slow", "flaky", "broken"))
    assert (slow["status"], slow["signal"], slow["reason"], slow["attempts"]) == ("failed", 15, "timeout after 1 s", 1)
    assert (flaky["status"], flaky["attempts"], flaky["exit_code"]) == ("succeeded", 2, 0)
    assert (broken["status"], broken["attempts"], broken["exit_code"]) == ("failed", 2, 1)
    assert (run_dir / "cells" / "broken" / "log").read_text().count("Traceback") == 2  # one log, both attempts
    assert "attempt 2/2 starting" in (run_dir / "cells" / "broken" / "log").read_text()


def test_stop_on_failure_starts_nothing_after_a_failure(tmp_path):
    cells = [{"name": "a", "command": train("--crash")}, {"name": "b", "command": train()}]
    run_dir = make_run(tmp_path, cells, stop_on_failure=True)
    assert run(run_dir) == 1
    assert list(results(run_dir)) == ["a"]  # the pending cell has no result.json
    assert "stop_on_failure not_started=b" in (run_dir / "runner.log").read_text()


def test_eight_cells_on_eight_gpus_run_at_once_each_on_its_own(tmp_path):
    log = tmp_path / "events.jsonl"
    cells = [{"name": f"c{i}", "command": train("--epochs", 1, "--step-s", 0.3, "--record", log)} for i in range(8)]
    run_dir = make_run(tmp_path, cells, gpus=list(range(8)), gpus_per_cell=1)
    assert run(run_dir) == 0
    events = records(log)
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["gpus"] for e in starts) == [str(i) for i in range(8)]  # CUDA_VISIBLE_DEVICES, one each
    assert max(e["ts"] for e in starts) < min(e["ts"] for e in events if e["event"] == "end")  # all at once
    record = json.loads((run_dir / "run.json").read_text())
    assert sorted(gpu for cell in record["cells"] for gpu in cell["gpus"]) == list(range(8))


def test_eight_cells_on_four_gpus_never_share_a_gpu(tmp_path):
    log = tmp_path / "events.jsonl"
    cells = [{"name": f"c{i}", "command": train("--epochs", 1, "--step-s", 0.1, "--record", log)} for i in range(8)]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1, 2, 3], gpus_per_cell=1)
    assert run(run_dir) == 0
    spans = {}
    for event in records(log):
        start, end, _gpu = spans.get(event["cell"], (event["ts"], event["ts"], event["gpus"]))
        spans[event["cell"]] = (min(start, event["ts"]), max(end, event["ts"]), event["gpus"])
    by_gpu = {}
    for start, end, gpu in spans.values():
        by_gpu.setdefault(gpu, []).append((start, end))
    assert sorted(by_gpu) == ["0", "1", "2", "3"] and sum(len(v) for v in by_gpu.values()) == 8
    for gpu, on_it in by_gpu.items():
        on_it.sort()
        assert all(later[0] > earlier[1] for earlier, later in zip(on_it, on_it[1:])), (gpu, on_it)


def test_a_gpu_goes_to_the_next_cell_only_after_every_process_of_the_last_is_gone(tmp_path):
    log = tmp_path / "events.jsonl"
    leave = ("--fork-children", 2, "--child-term-delay", 0.3, "--record", log, "--epochs", 1)
    cells = [{"name": f"c{i}", "command": train(*leave)} for i in range(6)]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1], gpus_per_cell=1, stop_grace_s=5)
    assert run(run_dir) == 0
    by_cell = {}
    for event in records(log):
        by_cell.setdefault(event["cell"], []).append(event)
    for gpu in ("0", "1"):
        spans = sorted(
            (min(e["ts"] for e in events), max(e["ts"] for e in events))
            for events in by_cell.values()
            if events[0]["gpus"] == gpu
        )
        assert len(spans) >= 2
        # the next cell's first event comes after the previous cell's last process (a setsid'd child) ended
        assert all(later[0] > earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    assert all(len([e for e in events if e["event"] == "child_exit"]) == 2 for events in by_cell.values())


def test_max_parallel_caps_the_cells_at_once(tmp_path):
    log = tmp_path / "events.jsonl"
    cells = [{"name": f"c{i}", "command": train("--epochs", 1, "--step-s", 0.05, "--record", log)} for i in range(3)]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1, 2, 3], gpus_per_cell=1, max_parallel=1)
    assert run(run_dir) == 0
    spans = sorted((r["started_at"], r["ended_at"]) for r in results(run_dir).values())
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_a_relaunch_skips_done_cells_and_reruns_the_rest(tmp_path):
    cells = [
        {"name": "a", "command": train()},
        {"name": "b", "command": crash_once(tmp_path / "crash-b")},
        {"name": "c", "command": train()},
    ]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"])
    assert run(run_dir) == 1 and not (run_dir / "DONE").exists()
    before = {name: (run_dir / "cells" / name / "result.json").read_bytes() for name in ("a", "b", "c")}
    assert run(run_dir) == 0 and (run_dir / "DONE").exists()
    after = {name: (run_dir / "cells" / name / "result.json").read_bytes() for name in ("a", "b", "c")}
    assert after["a"] == before["a"] and after["c"] == before["c"] and after["b"] != before["b"]
    assert json.loads(before["b"])["status"] == "failed" and json.loads(after["b"])["status"] == "succeeded"
    assert (run_dir / "cells" / "b" / "result.prev.json").read_bytes() == before["b"]
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["resumed"], record["skipped_cells"]) == (True, ["a", "c"])
    assert [c["state"] for c in record["cells"]] == ["skipped", "started", "skipped"]
    log = (run_dir / "runner.log").read_text()
    assert log.count("cell_skipped") == 2 and "cell_skipped cell=a" in log
    assert run(run_dir) == 0  # everything done: nothing runs, DONE stays


def test_a_failed_sync_is_no_success_and_leaves_no_done(tmp_path):
    cells = [{"name": "a", "command": train()}]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"], durable_dir=str(tmp_path / "not-mounted"))
    assert run(run_dir) == 1
    result = results(run_dir)["a"]
    assert (result["status"], result["sync"], result["artifacts"]) == ("succeeded", "failed", [])
    assert "does not exist" in result["sync_error"] and result["sync_reason"] == result["sync_error"]
    assert "SYNC FAILED" in (run_dir / "cells" / "a" / "log").read_text()
    assert not (run_dir / "DONE").exists() and not (tmp_path / "not-mounted").exists()
    assert (run_dir / "cells" / "a" / "best.pth").exists()  # the scratch copy is the source of truth


def test_sigterm_stops_every_cell_records_it_and_leaves_nothing_running(tmp_path):
    cells = [
        {"name": "polite", "command": train("--forever", "--step-s", 0.05)},
        {"name": "stubborn", "command": train("--forever", "--step-s", 0.05, "--ignore-sigterm")},
        {"name": "pending", "command": train()},
    ]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1], gpus_per_cell=1, stop_grace_s=0.5)
    runner = start_runner(run_dir)
    cell_logs = [run_dir / "cells" / name / "log" for name in ("polite", "stubborn")]
    wait_for(lambda: all(p.exists() and "epoch 1/" in p.read_text() for p in cell_logs), what="both cells train")
    runner.send_signal(signal.SIGHUP)  # the SSH session went away: ignored
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=20) == 143
    found = {name: (r["status"], r["signal"], r["reason"]) for name, r in results(run_dir).items()}
    assert found == {"polite": ("failed", 15, "run stopped"), "stubborn": ("failed", 9, "run stopped")}
    assert members(None, marker_entry("RGT_RUN_DIR", str(run_dir))) == []
    assert not (run_dir / "DONE").exists()
    assert "stop_requested signal=15" in (run_dir / "runner.log").read_text()


def test_a_dead_runners_cells_are_stopped_before_the_run_goes_on(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}])
    env = dict(os.environ, RGT_RUN_DIR=str(run_dir))
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    wait_for(lambda: members(None, marker_entry("RGT_RUN_DIR", str(run_dir))), what="the orphan starts")
    assert run(run_dir) == 0
    assert orphan.wait(timeout=5) == -signal.SIGTERM
    assert "earlier_processes_stopped count=1 left=0" in (run_dir / "runner.log").read_text()


def test_a_second_runner_of_the_same_run_is_refused(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}])
    with open(run_dir / ".runner.lock", "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert run(run_dir) == _runner.EXIT_LOCKED
    assert (
        not (run_dir / "run.json").exists() and "another runner holds this run" in (run_dir / "runner.log").read_text()
    )


def test_secrets_reach_the_job_only(tmp_path):
    cells = [{"name": "a", "command": train("--print-env", "WANDB_API_KEY")}]
    run_dir = make_run(tmp_path, cells, secrets={"WANDB_API_KEY": SECRET}, artifacts=["best.pth"])
    assert run(run_dir) == 0
    proof = hashlib.sha256(SECRET.encode()).hexdigest()[:16]
    assert f"env WANDB_API_KEY sha256={proof}" in (run_dir / "cells" / "a" / "log").read_text()
    assert (run_dir / ".secrets.json").stat().st_mode & 0o777 == 0o600
    for path in [*run_dir.rglob("*"), *(tmp_path / "durable").rglob("*")]:
        if path.is_file() and path.name != ".secrets.json":
            assert SECRET.encode() not in path.read_bytes(), path
    log = RunnerLog(str(tmp_path / "r.log"), {"K": SECRET})
    log.event("cell_ended", reason=f"could not start: {SECRET}")
    assert SECRET not in (tmp_path / "r.log").read_text() and "<redacted>" in (tmp_path / "r.log").read_text()


def test_an_invalid_spec_is_refused_in_the_log(tmp_path):
    run_dir = tmp_path / "data" / "runs" / "sweep"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text('{"run": "sweep"}')
    assert run(run_dir) == _runner.EXIT_USAGE
    assert "runner_refused why=" in (run_dir / "runner.log").read_text()
    assert _runner.main([]) == _runner.EXIT_USAGE


def _imports(name: str, seen: set) -> set:
    if name in seen:
        return seen
    seen.add(name)
    for node in ast.walk(ast.parse((MODULE_UTILS / name).read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_runner.PACKAGE):
            _imports(node.module[len(_runner.PACKAGE) + 1 :].replace(".", "/") + ".py", seen)
    return seen


def test_runner_modules_are_exactly_what_it_imports_and_enough_to_run_alone(tmp_path):
    assert set(RUNNER_MODULES) == _imports("runner/_runner.py", set()) and len(set(RUNNER_MODULES)) == len(
        RUNNER_MODULES
    )
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    # As training_run installs it: the sources from the collection, run.py beside them.
    assert _run_detach.install_runner(str(run_dir), RUNNER_MODULES, _runner.RUN_PY) == str(
        run_dir / "runner" / "run.py"
    )
    package = run_dir / "runner" / _runner.PACKAGE.replace(".", "/")
    assert {str(path.relative_to(package)) for path in package.rglob("*.py") if path.name != "__init__.py"} == set(
        RUNNER_MODULES
    )
    # -I -S: no PYTHONPATH, no site-packages, not the collection: only the copied tree and the standard library.
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(run_dir / "runner" / "run.py"), str(run_dir)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (run_dir / "DONE").exists()


def test_run_json_and_the_durable_copy_name_the_launch(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"], launch_id="L1")
    assert run(run_dir) == 0
    assert json.loads((run_dir / "run.json").read_text())["launch_id"] == "L1"
    assert json.loads((tmp_path / "durable" / "runs" / "sweep" / ".launch.json").read_text())["launch_id"] == "L1"


def durable_tree(root: Path):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_runner_refuses_a_durable_copy_of_another_launch_or_a_torn_down_run_before_writing(tmp_path):
    earlier = tmp_path / "durable" / "runs" / "sweep"
    (earlier / "cells" / "a").mkdir(parents=True)
    (earlier / "cells" / "a" / "best.pth").write_bytes(b"the only copy left")
    (earlier / ".launch.json").write_text(json.dumps({"run": "sweep", "launch_id": "L0"}))
    before = durable_tree(tmp_path / "durable")
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"], launch_id="L1")
    assert run(run_dir) == _runner.EXIT_REFUSED
    assert (
        f'runner_refused why="{earlier} holds launch L0, this run is launch L1"' in (run_dir / "runner.log").read_text()
    )
    assert not (run_dir / "run.json").exists() and not (run_dir / "cells").exists()
    assert durable_tree(tmp_path / "durable") == before
    (earlier / ".launch.json").write_text(json.dumps({"run": "sweep", "launch_id": "L1"}))
    (tmp_path / "data" / "runs" / ".torn_down").mkdir()
    (tmp_path / "data" / "runs" / ".torn_down" / "sweep.json").write_text("{}")
    assert run(run_dir) == _runner.EXIT_REFUSED
    assert 'runner_refused why="run sweep was torn down' in (run_dir / "runner.log").read_text()


def test_a_failing_env_hook_is_recorded_as_the_hook_and_retried_as_a_failure(tmp_path):
    hook = tmp_path / "network_turbo"
    hook.write_text('[ -e "$(dirname "${BASH_SOURCE[0]}")/proxy-up" ] || exit 1\nexport TURBO=1\n')
    ran = tmp_path / "ran"
    cells = [{"name": "a", "command": ["touch", str(ran)], "retries": 1}]
    run_dir = make_run(tmp_path, cells, env_hook=str(hook))
    assert run(run_dir) == 1
    result = results(run_dir)["a"]
    reason = f"env hook {hook} failed (exit 1): the command never started"
    assert (result["status"], result["exit_code"], result["signal"]) == ("failed", None, None)
    assert (result["reason"], result["hook_failed"], result["attempts"]) == (reason, True, 2)
    assert not ran.exists()
    assert f'cell_ended cell=a attempt=2/2 exit=- signal=- reason="{reason}"' in (run_dir / "runner.log").read_text()
    (tmp_path / "proxy-up").write_text("")  # the proxy came back: the same cell runs, its status its own
    assert run(run_dir) == 0
    assert (results(run_dir)["a"]["hook_failed"], results(run_dir)["a"]["exit_code"]) == (False, 0) and ran.exists()
