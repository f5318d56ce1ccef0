"""What a cell started is found and stopped when the cell ends: also a helper in its own session, with an empty
environment (no marker), whose parent is long gone; its GPU goes to the next cell only once it is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner import _cell_tree
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_tree import CellTree
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import read_stat
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._runner import Runner
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    alive,
    make_run,
    records,
    results,
    start_runner,
    train,
)

# A helper that takes a while to die on SIGTERM and writes when it did: "<pid> <time>".
HELPER = """import os, signal, sys, time
def term(*_):
    time.sleep(0.3)
    with open(sys.argv[1], "a") as out:
        out.write(f"{os.getpid()} {time.time()}\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(1000)
"""


def detached(pidfile: Path, then: str = "exit 0", *helper: str) -> list:
    """A cell that starts ``env -i setsid <helper> &`` (no marker, its own session), notes its pid, then ``then``."""
    command = f'env -i setsid "$@" & echo $! > {pidfile}; {then}'
    return ["bash", "-c", command, "cell", *(helper or ("sleep", "1000"))]


def run_in_process(run_dir: Path) -> int:
    return Runner(str(run_dir), dict(os.environ)).run()


def run_detached(run_dir: Path) -> int:
    """The real runner process (main(): a child subreaper where the kernel allows)."""
    runner = start_runner(run_dir)
    return runner.wait(timeout=60)


def pid_in(path: Path) -> int:
    return int(path.read_text().split()[0])


def leftovers_of(run_dir: Path, cell: str) -> dict:
    return {item["pid"]: item for item in results(run_dir)[cell]["leftovers"]}


def test_an_env_i_setsid_helper_is_stopped_when_its_cell_ends_and_listed(tmp_path):
    # The command lives on a while: the runner's samples see the helper as its child before it is orphaned.
    pidfile = tmp_path / "helper.pid"
    run_dir = make_run(tmp_path, [{"name": "a", "command": detached(pidfile, "sleep 1.5")}], stop_grace_s=2)
    assert run_in_process(run_dir) == 0
    helper = pid_in(pidfile)
    assert not alive(helper)
    assert leftovers_of(run_dir, "a")[helper] == {"pid": helper, "name": "sleep", "stopped": True}
    assert f"cell_leftovers cell=a attempt=1/1 pids={helper}" in (run_dir / "runner.log").read_text()


def test_a_helper_whose_parent_exited_at_once_is_found_by_the_subreaper_runner(tmp_path):
    # No sample can see it as the cell's: its parent exits at once. The runner adopts it as subreaper.
    pidfile = tmp_path / "helper.pid"
    run_dir = make_run(tmp_path, [{"name": "a", "command": detached(pidfile)}], stop_grace_s=2)
    assert run_detached(run_dir) == 0
    helper = pid_in(pidfile)
    assert not os.path.exists(f"/proc/{helper}")  # stopped and reaped (waitpid on its pid), not a zombie
    assert leftovers_of(run_dir, "a")[helper]["stopped"] is True
    assert "cell_tracking subreaper=True" in (run_dir / "runner.log").read_text()


def test_a_nohup_grandchild_is_stopped_and_listed(tmp_path):
    pidfile = tmp_path / "nohup.pid"
    command = ["bash", "-c", f"nohup sleep 1000 >/dev/null 2>&1 & echo $! > {pidfile}"]
    run_dir = make_run(tmp_path, [{"name": "a", "command": command}])
    assert run_detached(run_dir) == 0
    helper = pid_in(pidfile)
    assert not alive(helper) and leftovers_of(run_dir, "a")[helper]["stopped"] is True


def test_the_next_cell_gets_the_gpu_only_after_the_last_cells_helper_is_gone(tmp_path):
    script = tmp_path / "helper.py"
    script.write_text(HELPER)
    ended, log = tmp_path / "helper.ended", tmp_path / "events.jsonl"
    ready = f"until [ -e {ended}.ready ]; do sleep 0.02; done"  # its SIGTERM handler is set: it dies slowly
    cells = [
        {"name": "first", "command": detached(tmp_path / "helper.pid", ready, sys.executable, str(script), str(ended))},
        {"name": "second", "command": train("--epochs", 1, "--record", log)},
    ]
    run_dir = make_run(tmp_path, cells, gpus=[0], gpus_per_cell=1, stop_grace_s=5)
    assert run_detached(run_dir) == 0
    helper, helper_ended = ended.read_text().split()
    second_started = min(e["ts"] for e in records(log) if e["cell"] == "second")
    assert second_started > float(helper_ended)
    assert leftovers_of(run_dir, "first")[int(helper)]["stopped"] is True
    record = json.loads((run_dir / "run.json").read_text())
    assert [(c["gpus"], c["gpus_held"]) for c in record["cells"]] == [([0], False), ([0], False)]


def test_a_pid_reused_by_another_process_is_never_taken_for_a_recorded_one(tmp_path, monkeypatch):
    tree = CellTree(lambda cell: False)
    attempt = tree.attempt("a")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        stat = read_stat(sleeper.pid)
        assert stat is not None
        attempt.recorded[sleeper.pid] = stat
        assert [p.pid for p in attempt.extra()] == [sleeper.pid]
        reused = stat.__class__(**{**stat.__dict__, "start_ticks": stat.start_ticks - 1})
        attempt.recorded[sleeper.pid] = reused  # the record is of an earlier process with the same pid
        assert attempt.extra() == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_tree_samples_while_cells_run_and_never_reaps_a_popen_child():
    tree = CellTree(lambda cell: False)
    attempt = tree.attempt("a")
    with attempt.spawning():
        parent = subprocess.Popen(["bash", "-c", "sleep 30 & echo $!; wait $!"], stdout=subprocess.PIPE)
        attempt.began(parent.pid)
    child = int(parent.stdout.readline())
    tree.start()
    try:
        deadline = time.monotonic() + 5
        while child not in attempt.recorded and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child in attempt.recorded and parent.pid not in attempt.recorded
        os.kill(child, signal.SIGKILL)
        while read_stat(parent.pid).state != "Z" and time.monotonic() < deadline + 5:
            time.sleep(0.02)
        tree.reap()  # the Popen child is the Popen's to wait for: its status is not taken
    finally:
        tree.stop()
        attempt.close()
    assert parent.wait(timeout=5) == 128 + signal.SIGKILL and tree.attempts == {}


def test_become_subreaper_is_guarded(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise OSError("no libc")

    monkeypatch.setattr(_cell_tree.ctypes, "CDLL", refuse)
    assert _cell_tree.become_subreaper() is False


def test_an_adopted_orphan_is_the_ending_cells_only_while_no_other_cell_is_busy():
    busy = threading.Event()
    tree = CellTree(lambda cell: busy.is_set(), subreaper=True)
    attempt = tree.attempt("a")
    attempt.root = read_stat(os.getpid())
    me = read_stat(os.getpid())
    orphan = me.__class__(**{**me.__dict__, "pid": 4242, "ppid": os.getpid(), "pgid": 4242, "sid": 4242})
    probe = me.__class__(**{**me.__dict__, "pid": 4243, "ppid": os.getpid()})  # the runner's group: its own
    orphan = orphan.__class__(**{**orphan.__dict__, "start_ticks": attempt.since + 5})
    probe = probe.__class__(**{**probe.__dict__, "start_ticks": attempt.since + 5})
    assert tree._orphans([orphan, probe], attempt) == [orphan]
    busy.set()
    assert tree._orphans([orphan, probe], attempt) == []  # another cell may have started it
