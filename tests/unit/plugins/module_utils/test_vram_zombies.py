"""Decision rules of vram_zombies over synthetic process tables (no real processes)."""

from __future__ import annotations

import re
from typing import Any, Dict, List

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import Gpu
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._vram_zombies import (
    Policy,
    Verdict,
    commands_needed,
    decide,
    gpus_of,
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
    assert verdicts[101].reason == (
        "orphaned (parent is init) and its process group 100 and session 100 hold no live process but candidates;"
        " age 3600s"
    )
    assert verdicts[201].protected_by is None
    assert verdicts[201].reason == "its ancestor 200 (bash run_queue.sh) is alive"


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


def test_defunct_launcher_counts_as_gone():
    # A container init that never reaps leaves the killed launcher as a zombie entry.
    defunct = proc(100, 1, 100, 100, devices=(), defunct=True)
    verdicts = judge(table_of(BASE, CRASHED, [defunct]))
    assert candidates(verdicts) == [101, 102, 103]


def test_launcher_alive_means_workers_are_not_orphans_of_a_dead_launch():
    launcher = proc(100, 1, 100, 100, devices=(), cmd="torchrun train.py")
    verdicts = judge(table_of(BASE, CRASHED, [launcher]))
    assert candidates(verdicts) == []
    leader = "its process group 100 has a live member 100 (torchrun train.py) that is not a candidate"
    assert verdicts[101].reason == verdicts[103].reason == leader


def test_detached_group_leader_is_not_a_candidate():
    # nohup/setsid job: reparented to init but leads its own group, and is not registered.
    detached = proc(400, 1, 400, 400)
    loader = proc(401, 400, 400, 400, devices=("/dev/nvidia1",))  # on a GPU of its own, idle
    verdicts = judge(table_of(BASE, [detached, loader]), gpus=[gpu(0, util=(90,)), gpu(1, util=(0,))])
    assert verdicts[400].orphaned is True
    assert not verdicts[400].candidate
    assert "detached on purpose" in verdicts[400].reason
    # The spared leader is alive, so its dataloader is no candidate either (the fixpoint drops it later).
    assert candidates(verdicts) == []
    assert verdicts[401].reason == "its ancestor 400 (python train.py) is alive"


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
    # A protected process stays alive, so the rest of its process group may still be its job.
    assert candidates(by_pid) == []
    assert by_pid[102].reason.startswith("its process group 100 has a live member 101 (")
    by_pattern = judge(table, protect_patterns=[re.compile(r"--local-rank 1$")])
    assert by_pattern[102].protected_by == "protect_patterns '--local-rank 1$'"
    assert candidates(by_pattern) == []


def test_gpus_of_maps_device_minors_through_nvml():
    # A container that exposes host GPU 3 as NVML index 0.
    gpus = [gpu(0, minor=3), gpu(1, minor=5)]
    assert gpus_of(proc(1, 0, 1, 1, devices=("/dev/nvidia3", "/dev/nvidiactl")), gpus) == [0]
    assert gpus_of(proc(1, 0, 1, 1, devices=("/dev/nvidiactl",)), gpus) == [0, 1]
    assert gpus_of(proc(1, 0, 1, 1, devices=("/dev/nvidia1",)), [gpu(0), gpu(1)]) == [1]


# Issue 7 item 1: a holder is never a candidate while a live process on its ancestor chain (other than init and
# the subreapers), or a live non-candidate in its process group or session, may still be its job.


def test_nohup_launcher_without_setsid_protects_its_workers():
    # `nohup python3 launcher.py &` from `sh -c`: the shell (690) exited, the launcher sits under init in the
    # shell's old group and session, whose leader is gone. Its workers must not look abandoned.
    job = [
        proc(700, 1, 690, 690, devices=(), cmd="python3 launcher.py"),
        proc(701, 700, 690, 690, cmd="python3 launcher.py --worker 0"),
        proc(702, 700, 690, 690, cmd="python3 launcher.py --worker 1"),
    ]
    verdicts = judge(table_of(BASE, job))
    assert candidates(verdicts) == []
    assert verdicts[701].reason == "its ancestor 700 (python3 launcher.py) is alive"
    assert verdicts[701].rules == [] and verdicts[701].protected_by is None


def test_cd_and_setsid_leftover_shell_under_init_protects_the_live_launcher_tree():
    # `cd /tmp && setsid python3 launcher.py &` under bash: the &&-list's shell (800) waits under init, the
    # launcher (801) leads a new session, its workers hold the GPU.
    job = [
        proc(800, 1, 790, 790, devices=(), cmd="bash -c cd /tmp && setsid python3 launcher.py &"),
        proc(801, 800, 801, 801, devices=(), cmd="python3 launcher.py"),
        proc(802, 801, 801, 801, cmd="python3 launcher.py --worker 0"),
        proc(803, 802, 801, 801, cmd="python3 launcher.py --dataloader 0"),
    ]
    verdicts = judge(table_of(BASE, job))
    assert candidates(verdicts) == []
    assert verdicts[802].reason == "its ancestor 801 (python3 launcher.py) is alive"
    # Named is the nearest ancestor that can never be a candidate: the launcher, not the worker holder.
    assert verdicts[803].reason == "its ancestor 801 (python3 launcher.py) is alive"


def test_orphaned_workers_and_dataloaders_are_reaped_together():
    verdicts = judge(table_of(BASE, CRASHED))
    assert candidates(verdicts) == [101, 102, 103]
    assert verdicts[103].rules == ["orphaned", "old"]
    assert verdicts[103].reason.startswith("its ancestor 101 is orphaned (parent is init)")


def test_a_live_non_candidate_in_the_session_or_group_protects_the_orphans():
    watcher = proc(105, 1, 105, 100, devices=(), cmd="tail -f train.log")
    verdicts = judge(table_of(BASE, CRASHED, [watcher]))
    assert candidates(verdicts) == []
    watched = "its session 100 has a live member 105 (tail -f train.log) that is not a candidate"
    assert verdicts[101].reason == verdicts[103].reason == watched
    # A holder too young to judge is not a candidate either, so it protects its group.
    young = proc(104, 1, 100, 100, born=NOW - 5, cmd="python train.py --local-rank 2")
    verdicts = judge(table_of(BASE, CRASHED, [young]))
    assert candidates(verdicts) == []
    assert verdicts[102].reason == (
        "its process group 100 has a live member 104 (python train.py --local-rank 2) that is not a candidate"
    )
    # A defunct member is dead: it protects nothing.
    assert candidates(judge(table_of(BASE, CRASHED, [proc(106, 1, 100, 100, devices=(), defunct=True)]))) == [
        101,
        102,
        103,
    ]


def test_init_in_the_same_session_is_a_live_member():
    # `docker run image python launcher.py`: the launcher is PID 1 and its workers' parent.
    init_launcher = proc(1, 0, 1, 1, devices=(), cmd="python launcher.py")
    workers = [proc(2, 1, 1, 1), proc(3, 1, 1, 1)]
    verdicts = judge(table_of([init_launcher], workers), self_pid=999)
    assert candidates(verdicts) == []
    assert verdicts[2].orphaned is True
    assert verdicts[2].reason == "its process group 1 has a live member 1 (python launcher.py) that is not a candidate"


def test_subreaper_parent_counts_as_init():
    # `systemd --user` adopted the workers of a crashed launcher.
    subreaper = proc(50, 1, 50, 50, devices=(), cmd="/lib/systemd/systemd --user")
    orphans = [proc(51, 50, 49, 49), proc(52, 51, 49, 49)]
    table = table_of(BASE, [subreaper], orphans)
    verdicts = judge(table)
    assert candidates(verdicts) == []
    assert verdicts[51].reason == "its ancestor 50 (/lib/systemd/systemd --user) is alive"
    verdicts = judge(table, subreaper_patterns=[re.compile(r"systemd --user$")])
    assert candidates(verdicts) == [51, 52]
    assert verdicts[51].orphaned is True and verdicts[51].rules == ["orphaned", "old"]
    assert verdicts[51].reason.startswith("orphaned (parent 50 is a subreaper)")


def test_subreaper_sharing_the_session_does_not_protect():
    # tini as init: the crashed launcher's workers are in tini's session, and tini adopted them.
    tini = proc(1, 0, 1, 1, devices=(), cmd="/sbin/tini -- python launcher.py")
    orphans = [proc(7, 1, 6, 1), proc(8, 1, 6, 1)]
    assert candidates(judge(table_of([tini], orphans), self_pid=999)) == []
    verdicts = judge(table_of([tini], orphans), self_pid=999, subreaper_patterns=[re.compile(r"^/sbin/tini ")])
    assert candidates(verdicts) == [7, 8]


def test_parent_outside_the_namespace_protects_even_a_dead_runs_member():
    exec_child = proc(500, 0, 300, 300)
    run = Run(name="old", path="x", pgid=300, sid=300)
    verdicts = judge(table_of(BASE, [exec_child]), runs=[run])
    assert candidates(verdicts) == []
    assert verdicts[500].reason == "its parent is outside this PID namespace (PPID 0)"


def test_unreadable_ancestor_protects():
    lost = proc(900, 899, 898, 898)  # 899 is missing from the table (exited or unreadable during the scan)
    verdicts = judge(table_of(BASE, [lost]), runs=[Run(name="old", path="x", pgid=898)])
    assert candidates(verdicts) == []
    assert verdicts[900].reason == "its ancestor 899 is not in the process table: it may be alive"


def _strip_commands(table: Dict[int, Proc], keep: set) -> Dict[int, Proc]:
    """The table as the cheap scan leaves it: command lines and owners only where ``keep`` says."""
    return {
        pid: p if pid in keep or p.devices else Proc(**dict(vars(p), cmdline=(), uid=None)) for pid, p in table.items()
    }


def test_the_commands_decide_reads_are_those_commands_needed_names():
    unrelated = [proc(700 + n, 1, 700 + n, 700 + n, devices=(), cmd=f"sleep {n}") for n in range(20)]
    launcher = proc(100, 1, 100, 100, devices=(), cmd="torchrun train.py")
    helper = proc(150, 1, 200, 200, devices=(), cmd="tail -f log")  # in the live run's group, not an ancestor
    cases = [
        (table_of(BASE, CRASHED, LIVE, unrelated), {}),
        (table_of(BASE, CRASHED, [launcher], unrelated), {}),
        (table_of(BASE, LIVE, [helper], unrelated), {"protect_patterns": [re.compile("run_queue")]}),
        (table_of(BASE, CRASHED, LIVE, unrelated), {"subreaper_patterns": [re.compile("^sleep 3$")]}),
    ]
    for table, overrides in cases:
        holders = [p for p in table.values() if p.devices]
        needed = commands_needed(holders, table, overrides.get("subreaper_patterns", ()))
        full = judge(table, **overrides)
        cheap = judge(_strip_commands(table, needed), **overrides)
        assert [(v.proc.pid, v.protected_by, v.rules, v.reason) for v in full.values()] == [
            (v.proc.pid, v.protected_by, v.rules, v.reason) for v in cheap.values()
        ]
        if not overrides.get("subreaper_patterns"):
            assert not needed & {p.pid for p in unrelated}
    assert commands_needed([], table_of(BASE, unrelated), [re.compile("x")]) == set(table_of(BASE, unrelated))


def test_commands_needed_names_holders_ancestors_and_their_groups_and_sessions():
    helper = proc(150, 1, 200, 210, devices=(), cmd="tail -f log")  # the live run's process group only
    peer = proc(160, 1, 220, 200, devices=(), cmd="tee out")  # the live run's session only
    stranger = proc(170, 1, 170, 170, devices=(), cmd="sleep 9")
    table = table_of(BASE, LIVE, [helper, peer, stranger])
    holders = [p for p in table.values() if p.devices]
    assert commands_needed(holders, table, ()) == {1, 10, 11, 12, 150, 160, 200, 201, 202}
