# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Decide which NVIDIA device holders are VRAM zombies: pure logic over a process table.

Inside a container NVML reports host PIDs, so "invisible to nvidia-smi" says nothing about a process.
The evidence used here holds in any PID namespace: the ancestor chain, the live members of a holder's
process group and session, the launch role's run registry, process age and whole-GPU utilization.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional, Pattern, Sequence, Set, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils._deadline import run_with_deadline

# A process born this long after a run's started_at cannot be that run's launcher (guards PID reuse).
LAUNCHER_BIRTH_SLACK_S = 120.0
MAX_REGISTERED_RUNS = 1000
MAX_RUN_JSON_BYTES = 1024 * 1024
# Reading the registry touches data_dir, which may be a dead network mount.
REGISTRY_TIMEOUT_S = 10.0


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
    subreaper_patterns: Sequence[Pattern[str]] = ()


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
        # A time without an offset is the box's local wall clock (TZ honoured), as a shell's `date` writes it.
        return datetime.fromisoformat(value.strip().replace("Z", "+00:00")).astimezone().timestamp()
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


def _registry_files(data_dir: str) -> Dict[str, Any]:
    """The raw run.json texts under ``data_dir``, or why there are none; runs in a child under a deadline."""
    unreadable = "so the run registry could not be read"
    if not os.path.isdir(data_dir):
        why = "not a directory" if os.path.lexists(data_dir) else "not found"
        return {"problems": [f"data_dir {data_dir}: {why}, {unreadable}"], "files": []}
    registry = os.path.join(data_dir, "runs")
    if not os.path.lexists(registry):
        return {"problems": [], "files": []}
    if not os.path.isdir(registry):
        return {"problems": [f"{registry}: not a directory, {unreadable}"], "files": []}
    problems: List[str] = []
    paths = [
        os.path.join(registry, name, "run.json") for name in sorted(os.listdir(registry)) if not name.startswith(".")
    ]
    paths = [path for path in paths if os.path.isfile(path)]
    if len(paths) > MAX_REGISTERED_RUNS:
        problems.append(f"{len(paths)} run.json files under {registry}; read only the first {MAX_REGISTERED_RUNS}")
    files = []
    for path in paths[:MAX_REGISTERED_RUNS]:
        try:
            with open(path, "rb") as handle:
                files.append([path, handle.read(MAX_RUN_JSON_BYTES + 1).decode("utf-8", errors="replace")])
        except OSError as exc:
            problems.append(f"{path}: {exc}")
    return {"problems": problems, "files": files}


def read_run_registry(data_dir: Optional[str], timeout_s: float = REGISTRY_TIMEOUT_S) -> Tuple[List[Run], List[str]]:
    """Registered runs under ``<data_dir>/runs/*/run.json`` and one problem line per unreadable file.

    A data_dir that is missing, not a directory or does not answer within ``timeout_s`` (a hung mount) is
    not an empty registry: live runs cannot be told from zombies, so it is a problem.
    """
    if not data_dir:
        return [], []
    answer = run_with_deadline({"registry": functools.partial(_registry_files, data_dir)}, timeout_s)["registry"]
    if answer.get("timed_out"):
        why = f"did not answer within {timeout_s:g} s (a hung mount?)"
        return [], [f"data_dir {data_dir}: {why}, so the run registry could not be read"]
    if "error" in answer:
        return [], [f"data_dir {data_dir}: {answer['error']}, so the run registry could not be read"]
    runs: List[Run] = []
    problems: List[str] = list(answer["value"]["problems"])
    for path, text in answer["value"]["files"]:
        try:
            if len(text) > MAX_RUN_JSON_BYTES:
                raise ValueError(f"larger than {MAX_RUN_JSON_BYTES} bytes")
            runs.append(parse_run(os.path.basename(os.path.dirname(path)), path, json.loads(text)))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
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


def _chain(proc: Proc, table: Dict[int, Proc], adopters: Set[int]) -> Tuple[List[Proc], Optional[str]]:
    """``proc``'s ancestors below the first adopter (PID 1 or a subreaper), or why the chain reaches none.

    PPID 0 means a parent outside this PID namespace (docker exec): it is alive, or the kernel would have
    reparented the process to this namespace's init. An ancestor missing from the table may be alive too.
    """
    chain: List[Proc] = []
    seen = {proc.pid}
    ppid = proc.ppid
    while ppid not in adopters:
        whose = f"its ancestor {chain[-1].pid}'s" if chain else "its"
        if ppid == 0:
            return chain, f"{whose} parent is outside this PID namespace (PPID 0)"
        parent = table.get(ppid)
        if parent is None or ppid in seen:  # a loop means PIDs were reused during the scan
            return chain, f"its ancestor {ppid} is not in the process table: it may be alive"
        chain.append(parent)
        seen.add(ppid)
        ppid = parent.ppid
    return chain, None


def _live_members(table: Dict[int, Proc], subreapers: Set[int]) -> Tuple[Dict[int, List[Proc]], Dict[int, List[Proc]]]:
    """Live processes by process group and by session; subreapers adopt orphans, they are no job's member."""
    groups: Dict[int, List[Proc]] = {}
    sessions: Dict[int, List[Proc]] = {}
    for proc in sorted(table.values(), key=lambda p: p.pid):
        if proc.defunct or proc.kernel_thread or proc.pid in subreapers:
            continue
        groups.setdefault(proc.pgid, []).append(proc)
        sessions.setdefault(proc.sid, []).append(proc)
    return groups, sessions


def _blocker(
    proc: Proc, chain: List[Proc], groups: Dict[int, List[Proc]], sessions: Dict[int, List[Proc]], chosen: Set[int]
) -> Optional[str]:
    """The live process, outside the ``chosen`` candidates, that may still be ``proc``'s job; None if there is none."""
    for ancestor in chain:
        if not ancestor.defunct and ancestor.pid not in chosen:
            return f"its ancestor {ancestor.pid} ({ancestor.command}) is alive"
    for kind, key, index in (("process group", proc.pgid, groups), ("session", proc.sid, sessions)):
        for member in index.get(key, ()):
            if member.pid != proc.pid and member.pid not in chosen:
                return f"its {kind} {key} has a live member {member.pid} ({member.command}) that is not a candidate"
    return None


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


def _spared(proc: Proc, held: List[int], gpus: Sequence[Gpu], policy: Policy) -> Optional[str]:
    """Why an orphan that belongs to no dead registered run is left alone although nothing live claims it."""
    if proc.pid in (proc.pgid, proc.sid):
        return "orphaned but leads its own process group or session: detached on purpose, not registered"
    busy = _busy_gpus(held, gpus, policy)
    if busy:
        return f"orphaned, but {', '.join(busy)} busy: may be a live job; protect it or reap by hand"
    return None


def decide(
    holders: Sequence[Proc], table: Dict[int, Proc], runs: Sequence[Run], gpus: Sequence[Gpu], policy: Policy
) -> List[Verdict]:
    """One Verdict per holder: protected, or a candidate with the rules that convicted it, or spared and why.

    Candidates are the greatest set of old, unprotected holders in which no member has a live ancestor
    (other than PID 1 and subreapers) or a live process group / session member outside the set: a live
    launcher protects its whole tree, while an orphaned worker and its dataloader children go together.
    """
    shielded = {policy.self_pid, *ancestors(table, policy.self_pid)}
    live_runs = [run for run in runs if run_is_live(run, table)]
    dead_runs = [run for run in runs if run not in live_runs]
    subreapers = {
        pid for pid, proc in table.items() if any(pattern.search(proc.command) for pattern in policy.subreaper_patterns)
    }
    adopters = {1} | subreapers
    groups, sessions = _live_members(table, subreapers)
    verdicts: Dict[int, Verdict] = {}
    chains: Dict[int, List[Proc]] = {}
    dead_run_of: Dict[int, Run] = {}
    for proc in holders:
        verdict = Verdict(proc=proc, orphaned=proc.ppid in adopters, gpus=gpus_of(proc, gpus))
        verdicts[proc.pid] = verdict
        verdict.protected_by = _protection(proc, table, policy, shielded, live_runs)
        if verdict.protected_by is not None:
            verdict.reason = "protected: " + verdict.protected_by
            continue
        age = policy.now - proc.create_time
        if age < policy.min_age_s:
            verdict.reason = f"age {age:.0f}s below min_age_s {policy.min_age_s:.0f}s: may still be starting"
            continue
        chain, unreached = _chain(proc, table, adopters)
        if unreached is not None:
            verdict.reason = unreached
            continue
        chains[proc.pid] = chain
        dead_run = next((run for run in dead_runs if _member_of(proc, run)), None)
        if dead_run is not None:
            dead_run_of[proc.pid] = dead_run
    # A blocker against this first pool blocks against every subset, so it names the live process that
    # protects the holder before the weaker guards (detached, GPU busy) get a say.
    pool = set(chains)
    chosen = set(pool)
    for pid in sorted(pool):
        verdict = verdicts[pid]
        why = _blocker(verdict.proc, chains[pid], groups, sessions, pool)
        if why is None and pid not in dead_run_of:
            why = _spared(verdict.proc, verdict.gpus, gpus, policy)
        if why is not None:
            verdict.reason = why
            chosen.discard(pid)
    dropped = True
    while dropped:  # greatest fixpoint: each pass can only drop, so at most len(pool) passes
        dropped = False
        for pid in sorted(chosen):
            why = _blocker(verdicts[pid].proc, chains[pid], groups, sessions, chosen)
            if why is not None:
                verdicts[pid].reason = why
                chosen.discard(pid)
                dropped = True
    for pid in sorted(chosen):
        _convict(verdicts[pid], chains[pid], dead_run_of.get(pid), gpus, policy)
    return [verdicts[proc.pid] for proc in holders]


def _convict(verdict: Verdict, chain: List[Proc], dead_run: Optional[Run], gpus: Sequence[Gpu], policy: Policy) -> None:
    proc = verdict.proc
    evidence = []
    if dead_run is not None:
        verdict.rules.append("run_dead")
        evidence.append(f"belongs to registered run {dead_run.name!r} whose launcher is gone")
    top = chain[-1] if chain else proc
    parent = "parent is init" if top.ppid == 1 else f"parent {top.ppid} is a subreaper"
    below = f"its ancestor {top.pid} is " if chain else ""
    verdict.rules.append("orphaned")
    evidence.append(
        f"{below}orphaned ({parent}) and its process group {proc.pgid} and session {proc.sid} hold no live"
        " process but candidates"
    )
    if _observed(verdict.gpus, gpus) and not _busy_gpus(verdict.gpus, gpus, policy):
        verdict.rules.append("gpu_idle")
        evidence.append(f"GPU {', '.join(map(str, verdict.gpus))} idle (<= {policy.idle_util_pct}%)")
    verdict.rules.append("old")
    evidence.append(f"age {policy.now - proc.create_time:.0f}s")
    verdict.reason = "; ".join(evidence)
