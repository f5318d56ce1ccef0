# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Decide which NVIDIA device holders are VRAM zombies: pure logic over a process table.

Inside a container NVML reports host PIDs, so "invisible to nvidia-smi" says nothing about a process.
The evidence used here holds in any PID namespace: the ancestor chain, the live members of a holder's
process group and session, the launch role's run registry, process age and whole-GPU utilization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Pattern, Sequence, Set, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import Gpu
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import (
    Proc,
    ancestors,
    belongs_to_run,
    run_is_live,
)


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
            if belongs_to_run(member, run):
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


def commands_needed(
    holders: Sequence[Proc], table: Dict[int, Proc], subreaper_patterns: Sequence[Pattern[str]]
) -> Set[int]:
    """The processes whose command lines ``decide`` may read (to match a pattern or name a live process).

    Every process when subreaper patterns are set (any process may match one); else the holders, their
    ancestors and the members of their process groups and sessions. The rest of the table is read for its
    tree and liveness only, which keeps the scan cheap on a box with thousands of unrelated processes.
    """
    if subreaper_patterns:
        return set(table)
    groups, sessions = {proc.pgid for proc in holders}, {proc.sid for proc in holders}
    needed = {pid for pid, proc in table.items() if proc.pgid in groups or proc.sid in sessions}
    for proc in holders:
        needed.add(proc.pid)
        needed.update(ancestors(table, proc.pid))
    return needed


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
        dead_run = next((run for run in dead_runs if belongs_to_run(proc, run)), None)
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
