"""Decision rules of vram_zombies over synthetic process tables (no real processes)."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils._vram_zombies import (
    Gpu,
    Policy,
    Proc,
    Run,
    Verdict,
    decide,
    gpus_of,
    parse_run,
    read_run_registry,
    run_is_live,
)

NOW = 1_000_000.0
OLD = NOW - 3600  # started an hour ago
ME = 0  # uid running the module
DEV0 = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")


def proc(pid: int, ppid: int, pgid: int, sid: int, *, devices=DEV0, born=OLD, uid=ME, cmd="python train.py", **kw):
    return Proc(
        pid=pid,
        ppid=ppid,
        pgid=pgid,
        sid=sid,
        uid=uid,
        name=cmd.split()[0],
        cmdline=tuple(cmd.split()),
        create_time=born,
        devices=tuple(devices),
        **kw,
    )


# The namespace's init, and an SSH session that runs the module: sshd(10) -> sh(11) -> python module(12).
BASE = [
    proc(1, 0, 1, 1, devices=(), cmd="/sbin/init"),
    proc(10, 1, 10, 10, devices=(), cmd="sshd: root@notty"),
    proc(11, 10, 11, 11, devices=(), cmd="/bin/sh -c python3 AnsiballZ_vram_zombies.py"),
    proc(12, 11, 11, 11, devices=("/dev/nvidiactl", "/dev/nvidia0"), cmd="python3 AnsiballZ_vram_zombies.py"),
]
# A crashed DDP run: launcher 100 is gone, workers 101/102 were reparented to init, 103 is 101's dataloader.
CRASHED = [
    proc(101, 1, 100, 100, cmd="python train.py --local-rank 0"),
    proc(102, 1, 100, 100, cmd="python train.py --local-rank 1"),
    proc(103, 101, 100, 100, cmd="python train.py --local-rank 0"),
]
# A live run: launcher 200 leads its session, worker 201 and dataloader 202 hold the device.
LIVE = [
    proc(200, 1, 200, 200, devices=(), cmd="bash run_queue.sh"),
    proc(201, 200, 200, 200),
    proc(202, 201, 200, 200),
]


def table_of(*groups: List[Proc]) -> Dict[int, Proc]:
    return {p.pid: p for group in groups for p in group}


def policy(**overrides: Any) -> Policy:
    values: Dict[str, Any] = {"now": NOW, "self_pid": 12, "self_uid": ME}
    values.update(overrides)
    return Policy(**values)


def judge(table: Dict[int, Proc], runs=(), gpus=(), **overrides: Any) -> Dict[int, Verdict]:
    holders = [p for p in table.values() if p.devices]
    return {v.proc.pid: v for v in decide(holders, table, list(runs), list(gpus), policy(**overrides))}


def gpu(index: int = 0, util=(), minor=None, used=30720) -> Gpu:
    return Gpu(index=index, minor=minor, memory_used_mib=used, memory_total_mib=81559, utilization_pct=tuple(util))


def candidates(verdicts: Dict[int, Verdict]) -> List[int]:
    return sorted(pid for pid, v in verdicts.items() if v.candidate)


def test_orphaned_workers_and_their_dataloader_are_candidates_the_live_run_is_not():
    verdicts = judge(table_of(BASE, CRASHED, LIVE))
    assert candidates(verdicts) == [101, 102, 103]
    assert verdicts[101].rules == ["orphaned", "old"]
    assert verdicts[101].orphaned is True
    assert verdicts[103].orphaned is False  # its parent 101 lives; the abandoned tree is what convicts it
    assert "ancestor 101" in verdicts[103].reason
    assert "group leader 100" in verdicts[101].reason
    assert verdicts[201].protected_by is None
    assert "parent 200 is alive" in verdicts[201].reason


def test_module_process_and_its_ancestors_are_protected():
    verdicts = judge(table_of(BASE, CRASHED))
    assert verdicts[12].protected_by == "this module or one of its ancestors"
    assert not verdicts[12].candidate


def test_registered_live_run_protects_even_orphaned_members():
    # Worker 203 of the live run was reparented to init (its parent crashed) but its launcher lives.
    orphan_of_live = proc(203, 1, 200, 200)
    run = Run(name="sweep", path="x", pgid=200, sid=200, pids=(200,), started_at=OLD + 10)
    verdicts = judge(table_of(BASE, LIVE, [orphan_of_live]), runs=[run])
    assert candidates(verdicts) == []
    assert verdicts[203].protected_by == "live registered run 'sweep'"
    assert verdicts[202].protected_by == "live registered run 'sweep'"


def test_dead_registered_run_convicts_its_members_even_with_a_live_parent():
    leftovers = [proc(301, 1, 300, 300), proc(302, 301, 300, 300, devices=("/dev/nvidia1",))]
    run = Run(name="old", path="x", pgid=300, sid=300, pids=(300,))
    verdicts = judge(table_of(BASE, leftovers), runs=[run])
    assert candidates(verdicts) == [301, 302]
    assert verdicts[302].rules == ["run_dead", "orphaned", "old"]
    assert "registered run 'old'" in verdicts[302].reason


def test_reused_launcher_pid_does_not_keep_a_run_alive():
    # PID 300 now belongs to an unrelated process in another group.
    stranger = proc(300, 1, 299, 299, devices=(), cmd="sleep 100")
    run = Run(name="old", path="x", pgid=300, sid=300)
    assert run_is_live(run, table_of(BASE, [stranger])) is False
    # A process born long after the run started cannot be its launcher, even with a matching group.
    late_leader = proc(300, 1, 300, 300, devices=(), born=NOW - 10)
    timed = Run(name="old", path="x", pgid=300, started_at=OLD)
    assert run_is_live(timed, table_of(BASE, [late_leader])) is False
    assert run_is_live(Run(name="old", path="x", pgid=300), table_of(BASE, [late_leader])) is True


def test_defunct_launcher_counts_as_gone():
    # A container init that never reaps leaves the killed launcher as a zombie entry.
    defunct = proc(100, 1, 100, 100, devices=(), defunct=True)
    verdicts = judge(table_of(BASE, CRASHED, [defunct]))
    assert candidates(verdicts) == [101, 102, 103]


def test_launcher_alive_means_workers_are_not_orphans_of_a_dead_launch():
    launcher = proc(100, 1, 100, 100, devices=(), cmd="torchrun train.py")
    verdicts = judge(table_of(BASE, CRASHED, [launcher]))
    assert candidates(verdicts) == []
    assert verdicts[101].reason == "orphaned but its launcher, group leader 100, is alive"
    assert verdicts[103].reason == "parent 101 is alive and not an abandoned orphan"


def test_detached_group_leader_is_not_a_candidate():
    # nohup/setsid job: reparented to init but leads its own group, and is not registered.
    detached = proc(400, 1, 400, 400)
    verdicts = judge(table_of(BASE, [detached]))
    assert verdicts[400].orphaned is True
    assert not verdicts[400].candidate
    assert "detached on purpose" in verdicts[400].reason


def test_parent_outside_the_namespace_is_not_orphaned():
    exec_child = proc(500, 0, 499, 499)  # docker exec: PPID 0
    verdicts = judge(table_of(BASE, [exec_child]))
    assert verdicts[500].orphaned is False
    assert not verdicts[500].candidate


def test_young_orphans_are_spared():
    young = [proc(101, 1, 100, 100, born=NOW - 30)]
    verdicts = judge(table_of(BASE, young))
    assert candidates(verdicts) == []
    assert "age 30s below min_age_s 120s" in verdicts[101].reason
    assert candidates(judge(table_of(BASE, young), min_age_s=10)) == [101]


def test_busy_gpu_spares_an_orphan_but_not_a_dead_run_member():
    busy = [gpu(0, util=(3, 87, 90))]
    verdicts = judge(table_of(BASE, CRASHED), gpus=busy)
    assert candidates(verdicts) == []
    assert "GPU 0 at 90% busy" in verdicts[101].reason
    run = Run(name="old", path="x", pgid=100, sid=100)
    assert candidates(judge(table_of(BASE, CRASHED), runs=[run], gpus=busy)) == [101, 102, 103]


def test_idle_gpu_is_recorded_as_evidence():
    verdicts = judge(table_of(BASE, CRASHED), gpus=[gpu(0, util=(0, 2, 1))])
    assert verdicts[101].rules == ["orphaned", "gpu_idle", "old"]
    assert verdicts[101].gpus == [0]
    # An idle threshold below the samples makes the GPU busy.
    assert candidates(judge(table_of(BASE, CRASHED), gpus=[gpu(0, util=(0, 2, 1))], idle_util_pct=1)) == []


def test_nvml_host_pids_do_not_matter():
    # NVML lists host PID 4242 (absent here) and nothing in the container: the live job stays safe.
    foreign = Gpu(index=0, minor=0, memory_used_mib=30720, memory_total_mib=81559, utilization_pct=(0, 0),
                  processes=({"pid": 4242, "used_memory_mib": 30720},))  # fmt: skip
    verdicts = judge(table_of(BASE, LIVE), gpus=[foreign])
    assert candidates(verdicts) == []


def test_protections():
    kthread = proc(2, 0, 0, 0, devices=("/dev/nvidia0",), kernel_thread=True, cmd="kthreadd")
    init_holder = proc(1, 0, 1, 1, cmd="/sbin/init")
    others = proc(600, 1, 599, 599, uid=1000)
    table = table_of(BASE, CRASHED, [kthread, init_holder, others])
    verdicts = judge(table)
    assert verdicts[1].protected_by == "PID 1 (the namespace's init)"
    assert verdicts[2].protected_by == "kernel thread"
    assert verdicts[600].protected_by.startswith("another user's process (uid 1000)")
    assert candidates(judge(table, all_users=True)) == [101, 102, 103, 600]
    by_pid = judge(table, protect_pids=[101, 999999])
    assert by_pid[101].protected_by == "protect_pids"
    assert by_pid[103].protected_by == "protect_pids (descendant of 101)"
    assert candidates(by_pid) == [102]
    by_pattern = judge(table, protect_patterns=[re.compile(r"--local-rank 1$")])
    assert by_pattern[102].protected_by == "protect_patterns '--local-rank 1$'"
    assert candidates(by_pattern) == [101, 103]


def test_gpus_of_maps_device_minors_through_nvml():
    # A container that exposes host GPU 3 as NVML index 0.
    gpus = [gpu(0, minor=3), gpu(1, minor=5)]
    assert gpus_of(proc(1, 0, 1, 1, devices=("/dev/nvidia3", "/dev/nvidiactl")), gpus) == [0]
    assert gpus_of(proc(1, 0, 1, 1, devices=("/dev/nvidiactl",)), gpus) == [0, 1]
    assert gpus_of(proc(1, 0, 1, 1, devices=("/dev/nvidia1",)), [gpu(0), gpu(1)]) == [1]


def test_parse_run_accepts_the_launch_roles_fields():
    run = parse_run(
        "d", "p", {"run": "sweep", "pgid": 321, "sid": 321, "pids": [321], "started_at": "1970-01-02T00:00:00Z"}
    )
    assert (run.name, run.pgid, run.sid, run.pids, run.started_at) == ("sweep", 321, 321, (321,), 86400.0)
    assert parse_run("dir-name", "p", {"pgid": 5, "started_at": 12.5}).name == "dir-name"
    assert parse_run("d", "p", {"sid": 5, "started_at": "1970-01-01T01:00:00+01:00"}).started_at == 0.0


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"pgid": 1}, "pgid must be an integer above 1"),
        ({"sid": "12"}, "sid must be an integer above 1"),
        ({"pgid": True}, "pgid must be an integer above 1"),
        ({"pids": [0]}, "pids must be a list of integers above 1"),
        ({"run": "x"}, "names no pgid, sid or pids"),
        ({"pgid": 5, "started_at": "yesterday"}, "Invalid isoformat"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_parse_run_rejects_bad_fields(document, message):
    with pytest.raises(ValueError, match=message):
        parse_run("d", "p", document)


def test_read_run_registry_reports_bad_files_and_keeps_good_ones(tmp_path):
    assert read_run_registry(None) == ([], [])
    assert read_run_registry(str(tmp_path / "absent")) == ([], [])
    for name, text in {"good": json.dumps({"pgid": 77}), "torn": '{"pgid": 7', "bad": '{"pgid": 1}'}.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "run.json").write_text(text)
    runs, problems = read_run_registry(str(tmp_path))
    assert [(r.name, r.pgid) for r in runs] == [("good", 77)]
    assert len(problems) == 2
    assert problems[0].startswith(str(tmp_path / "runs" / "bad" / "run.json") + ": pgid must be")
    assert problems[1].startswith(str(tmp_path / "runs" / "torn" / "run.json") + ": ")
