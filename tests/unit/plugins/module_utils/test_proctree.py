"""Process identity and liveness over synthetic process tables (no real processes)."""

from __future__ import annotations

from typing import Dict

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import (
    Proc,
    ancestors,
    belongs_to_run,
    run_is_live,
    same_process,
)

NOW = 1_000_000.0
OLD = NOW - 3600


def proc(pid: int, ppid: int, pgid: int, sid: int, *, born: float = OLD, cmd: str = "python train.py", **kw) -> Proc:
    argv = tuple(cmd.split())
    return Proc(pid=pid, ppid=ppid, pgid=pgid, sid=sid, uid=0, name=argv[0], cmdline=argv, create_time=born, **kw)


def table_of(*procs: Proc) -> Dict[int, Proc]:
    return {p.pid: p for p in procs}


INIT = proc(1, 0, 1, 1, cmd="/sbin/init")


def test_same_process_allows_psutils_jitter_but_not_a_reused_pid():
    victim = proc(4242, 1, 4240, 4240, born=1000.0, cmd="python w.py")
    assert same_process(victim, 1000.004, ["python", "w.py"])
    assert not same_process(victim, 1000.02, ["python", "w.py"])
    assert not same_process(victim, 1000.0, ["python", "other.py"])


def test_ancestors_stop_at_init_a_missing_parent_or_a_loop():
    table = table_of(INIT, proc(10, 1, 10, 10), proc(11, 10, 10, 10), proc(12, 11, 10, 10))
    assert ancestors(table, 12) == [11, 10, 1]
    assert ancestors(table_of(proc(20, 19, 20, 20)), 20) == [19]  # 19 is not in the table
    assert ancestors(table_of(proc(30, 31, 30, 30), proc(31, 30, 30, 30)), 30) == [31]  # PIDs reused mid-scan


def test_belongs_to_run_by_group_session_or_registered_pid():
    assert belongs_to_run(proc(101, 1, 100, 99), Run(name="r", path="x", pgid=100))
    assert belongs_to_run(proc(101, 1, 98, 99), Run(name="r", path="x", sid=99))
    assert belongs_to_run(proc(101, 1, 98, 97), Run(name="r", path="x", pids=(101,)))
    assert not belongs_to_run(proc(101, 1, 98, 97), Run(name="r", path="x", pgid=100, sid=99, pids=(100,)))


def test_a_run_lives_while_its_session_leader_or_a_registered_pid_lives():
    leader = proc(200, 1, 200, 200, cmd="bash run_queue.sh")
    assert run_is_live(Run(name="r", path="x", sid=200), table_of(INIT, leader))
    assert run_is_live(Run(name="r", path="x", pids=(200,)), table_of(INIT, leader))
    defunct = proc(200, 1, 200, 200, defunct=True)
    assert not run_is_live(Run(name="r", path="x", pgid=200, sid=200, pids=(200,)), table_of(INIT, defunct))


def test_reused_launcher_pid_does_not_keep_a_run_alive():
    # PID 300 now belongs to an unrelated process in another group.
    stranger = proc(300, 1, 299, 299, cmd="sleep 100")
    run = Run(name="old", path="x", pgid=300, sid=300)
    assert run_is_live(run, table_of(INIT, stranger)) is False
    # A process born long after the run started cannot be its launcher, even with a matching group.
    late_leader = proc(300, 1, 300, 300, born=NOW - 10)
    timed = Run(name="old", path="x", pgid=300, started_at=OLD)
    assert run_is_live(timed, table_of(INIT, late_leader)) is False
    assert run_is_live(Run(name="old", path="x", pgid=300), table_of(INIT, late_leader)) is True
