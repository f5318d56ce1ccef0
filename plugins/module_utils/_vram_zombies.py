# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Decide which NVIDIA device holders are VRAM zombies: pure logic over a process table.

Inside a container NVML reports host PIDs, so "invisible to nvidia-smi" says nothing about a process.
The evidence used here holds in any PID namespace: who the parent is, whether the process group's
leader still exists, the launch role's run registry, process age and whole-GPU utilization.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Pattern, Sequence, Set, Tuple

# A process born this long after a run's started_at cannot be that run's launcher (guards PID reuse).
LAUNCHER_BIRTH_SLACK_S = 120.0
MAX_REGISTERED_RUNS = 1000


@dataclass(frozen=True)
class Proc:
    """One process as seen in this PID namespace; ``devices`` are the NVIDIA device nodes it holds open."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    uid: int
    name: str
    cmdline: Tuple[str, ...]
    create_time: float
    kernel_thread: bool = False
    defunct: bool = False
    devices: Tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else f"[{self.name}]"


@dataclass(frozen=True)
class Run:
    """A run registered by the launch role in ``<data_dir>/runs/<run>/run.json``."""

    name: str
    path: str
    pgid: Optional[int] = None
    sid: Optional[int] = None
    pids: Tuple[int, ...] = ()
    started_at: Optional[float] = None


@dataclass(frozen=True)
class Gpu:
    """NVML's view of one GPU; ``utilization_pct`` holds the samples taken over the observation window."""

    index: int
    minor: Optional[int]
    memory_used_mib: Optional[int]
    memory_total_mib: Optional[int]
    utilization_pct: Tuple[int, ...] = ()
    processes: Tuple[Dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Policy:
    now: float
    self_pid: int
    self_uid: int
    min_age_s: float = 120.0
    idle_util_pct: int = 5
    protect_pids: Sequence[int] = ()
    protect_patterns: Sequence[Pattern[str]] = ()
    all_users: bool = False


@dataclass
class Verdict:
    proc: Proc
    orphaned: bool
    gpus: List[int]
    protected_by: Optional[str] = None
    rules: List[str] = field(default_factory=list)
    reason: str = ""

    @property
    def candidate(self) -> bool:
        return self.protected_by is None and bool(self.rules)


def _parse_started_at(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        raise ValueError("started_at must be an ISO 8601 time or epoch seconds")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        stamp = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=timezone.utc)
        return stamp.timestamp()
    raise ValueError("started_at must be an ISO 8601 time or epoch seconds")


def _leader_id(data: Dict[str, Any], key: str) -> Optional[int]:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
        raise ValueError(f"{key} must be an integer above 1, not {value!r}")
    return value


def parse_run(name: str, path: str, data: Any) -> Run:
    """Validate one run.json document; raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError("run.json must hold a JSON object")
    pids = data.get("pids") or []
    if not isinstance(pids, list) or any(isinstance(p, bool) or not isinstance(p, int) or p <= 1 for p in pids):
        raise ValueError("pids must be a list of integers above 1")
    run = Run(
        name=str(data.get("run") or name),
        path=path,
        pgid=_leader_id(data, "pgid"),
        sid=_leader_id(data, "sid"),
        pids=tuple(pids),
        started_at=_parse_started_at(data["started_at"]) if data.get("started_at") is not None else None,
    )
    if run.pgid is None and run.sid is None and not run.pids:
        raise ValueError("run.json names no pgid, sid or pids")
    return run


def read_run_registry(data_dir: Optional[str]) -> Tuple[List[Run], List[str]]:
    """Registered runs under ``<data_dir>/runs/*/run.json`` and one problem line per unreadable file."""
    if not data_dir:
        return [], []
    runs: List[Run] = []
    problems: List[str] = []
    paths = sorted(glob.glob(os.path.join(glob.escape(data_dir), "runs", "*", "run.json")))
    if len(paths) > MAX_REGISTERED_RUNS:
        problems.append(f"{len(paths)} run.json files under {data_dir}/runs; read only the first {MAX_REGISTERED_RUNS}")
    for path in paths[:MAX_REGISTERED_RUNS]:
        name = os.path.basename(os.path.dirname(path))
        try:
            with open(path, encoding="utf-8") as handle:
                runs.append(parse_run(name, path, json.load(handle)))
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            problems.append(f"{path}: {exc}")
    return runs, problems


def ancestors(table: Dict[int, Proc], pid: int) -> List[int]:
    """PIDs from ``pid``'s parent up to the namespace's init, following the table."""
    chain: List[int] = []
    seen = {pid}
    current = table.get(pid)
    while current is not None and current.ppid not in seen and current.ppid > 0:
        chain.append(current.ppid)
        seen.add(current.ppid)
        current = table.get(current.ppid)
    return chain


def _alive(table: Dict[int, Proc], pid: int) -> Optional[Proc]:
    proc = table.get(pid)
    return proc if proc is not None and not proc.defunct else None


def _group_leader_alive(table: Dict[int, Proc], pgid: int) -> bool:
    leader = _alive(table, pgid)
    return leader is not None and leader.pgid == pgid


def run_is_live(run: Run, table: Dict[int, Proc]) -> bool:
    """A run is live while its launcher lives: the group or session leader, or one of its registered pids."""
    launchers: List[Proc] = []
    if run.pgid is not None and _group_leader_alive(table, run.pgid):
        launchers.append(table[run.pgid])
    if run.sid is not None:
        leader = _alive(table, run.sid)
        if leader is not None and leader.sid == run.sid:
            launchers.append(leader)
    launchers.extend(p for p in (_alive(table, pid) for pid in run.pids) if p is not None)
    if run.started_at is None:
        return bool(launchers)
    return any(p.create_time <= run.started_at + LAUNCHER_BIRTH_SLACK_S for p in launchers)


def _member_of(proc: Proc, run: Run) -> bool:
    return (
        (run.pgid is not None and proc.pgid == run.pgid)
        or (run.sid is not None and proc.sid == run.sid)
        or proc.pid in run.pids
    )


def is_orphaned(proc: Proc) -> bool:
    """Reparented to the namespace's init. PPID 0 means a parent outside the namespace (docker exec), not gone."""
    return proc.ppid == 1


def orphan_root(proc: Proc, table: Dict[int, Proc]) -> Optional[Proc]:
    """The topmost ancestor below init (or ``proc`` itself) when it is an abandoned orphan, else None.

    Abandoned: reparented to init, not the leader of its own process group (a process detached on purpose
    with nohup/setsid/tmux leads one), and its group's leader, the launcher, no longer exists. Walking up
    catches the dataloader children of an orphaned worker as well as the worker.
    """
    chain = [proc.pid, *ancestors(table, proc.pid)]
    if len(chain) < 2 or chain[-1] != 1:
        return None
    root = table.get(chain[-2])
    if root is None or root.pgid == root.pid or _group_leader_alive(table, root.pgid):
        return None
    return root


def gpus_of(proc: Proc, gpus: Sequence[Gpu]) -> List[int]:
    """NVML indexes of the GPUs a process holds; a process holding only nvidiactl / nvidia-uvm may use any."""
    minors = set()
    for device in proc.devices:
        suffix = device.rsplit("/nvidia", 1)[-1]
        if suffix.isdigit():
            minors.add(int(suffix))
    if not minors:
        return [gpu.index for gpu in gpus]
    by_minor = {(gpu.minor if gpu.minor is not None else gpu.index): gpu.index for gpu in gpus}
    return sorted(by_minor[minor] for minor in minors if minor in by_minor)


def _protection(
    proc: Proc, table: Dict[int, Proc], policy: Policy, shielded: Set[int], live_runs: List[Run]
) -> Optional[str]:
    if proc.pid == 1:
        return "PID 1 (the namespace's init)"
    if proc.kernel_thread:
        return "kernel thread"
    if proc.pid in shielded:
        return "this module or one of its ancestors"
    if not policy.all_users and proc.uid != policy.self_uid:
        return f"another user's process (uid {proc.uid}); set all_users to include it"
    for pid in [proc.pid, *ancestors(table, proc.pid)]:
        if pid <= 1:
            continue
        relation = "" if pid == proc.pid else f" (descendant of {pid})"
        if pid in policy.protect_pids:
            return "protect_pids" + relation
        member = table.get(pid)
        if member is None:
            continue
        for pattern in policy.protect_patterns:
            if pattern.search(member.command):
                return f"protect_patterns {pattern.pattern!r}" + relation
        for run in live_runs:
            if _member_of(member, run):
                return f"live registered run {run.name!r}" + relation
    return None


def _busy_gpus(held: List[int], gpus: Sequence[Gpu], policy: Policy) -> List[str]:
    by_index = {gpu.index: gpu for gpu in gpus}
    busy = []
    for index in held:
        samples = by_index[index].utilization_pct
        if samples and max(samples) > policy.idle_util_pct:
            busy.append(f"GPU {index} at {max(samples)}%")
    return busy


def _observed(held: List[int], gpus: Sequence[Gpu]) -> bool:
    by_index = {gpu.index: gpu for gpu in gpus}
    return bool(held) and all(by_index[index].utilization_pct for index in held)


def decide(
    holders: Sequence[Proc], table: Dict[int, Proc], runs: Sequence[Run], gpus: Sequence[Gpu], policy: Policy
) -> List[Verdict]:
    """One Verdict per holder: protected, or a candidate with the rules that convicted it, or spared and why."""
    shielded = {policy.self_pid, *ancestors(table, policy.self_pid)}
    live_runs = [run for run in runs if run_is_live(run, table)]
    dead_runs = [run for run in runs if run not in live_runs]
    verdicts = []
    for proc in holders:
        verdict = Verdict(proc=proc, orphaned=is_orphaned(proc), gpus=gpus_of(proc, gpus))
        verdicts.append(verdict)
        verdict.protected_by = _protection(proc, table, policy, shielded, live_runs)
        if verdict.protected_by is not None:
            verdict.reason = "protected: " + verdict.protected_by
            continue
        age = policy.now - proc.create_time
        if age < policy.min_age_s:
            verdict.reason = f"age {age:.0f}s below min_age_s {policy.min_age_s:.0f}s: may still be starting"
            continue
        evidence = []
        dead_run = next((run for run in dead_runs if _member_of(proc, run)), None)
        if dead_run is not None:
            verdict.rules.append("run_dead")
            evidence.append(f"belongs to registered run {dead_run.name!r} whose launcher is gone")
        root = orphan_root(proc, table)
        if root is not None:
            busy = _busy_gpus(verdict.gpus, gpus, policy)
            if busy and dead_run is None:
                verdict.reason = (
                    f"orphaned and its launcher (group {root.pgid}) is gone, but {', '.join(busy)} busy: "
                    "may be a live job; protect it or reap by hand"
                )
                continue
            verdict.rules.append("orphaned")
            below = "" if root.pid == proc.pid else f"its ancestor {root.pid} is "
            evidence.append(f"{below}orphaned (parent is init) and its launcher, group leader {root.pgid}, is gone")
        if not verdict.rules:
            if verdict.orphaned and proc.pgid == proc.pid:
                verdict.reason = "orphaned but leads its own process group: detached on purpose, not registered"
            elif verdict.orphaned:
                verdict.reason = f"orphaned but its launcher, group leader {proc.pgid}, is alive"
            else:
                verdict.reason = f"parent {proc.ppid} is alive and not an abandoned orphan"
            continue
        if _observed(verdict.gpus, gpus) and not _busy_gpus(verdict.gpus, gpus, policy):
            verdict.rules.append("gpu_idle")
            evidence.append(f"GPU {', '.join(map(str, verdict.gpus))} idle (<= {policy.idle_util_pct}%)")
        verdict.rules.append("old")
        evidence.append(f"age {age:.0f}s")
        verdict.reason = "; ".join(evidence)
    return verdicts
