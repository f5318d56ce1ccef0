# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Process identity and liveness over a snapshot of the process table, shared by every lifecycle step.

Pure logic: ``_procs`` reads the table, vram_zombies, launch, patrol and teardown ask the questions here
(is this still the same process, who are its ancestors, does a registered run's launcher live).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run

# A process born this long after a run's started_at cannot be that run's launcher (guards PID reuse).
LAUNCHER_BIRTH_SLACK_S = 120.0
CREATE_TIME_TOLERANCE_S = 0.01  # psutil derives create time from boot time and clock ticks: tiny jitter


@dataclass(frozen=True)
class Proc:
    """One process as seen in this PID namespace; ``devices`` are the NVIDIA device nodes it holds open.

    ``uid`` is None and ``cmdline`` empty where the reader did not need them (``_procs`` reads them for holders).
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    uid: Optional[int]
    name: str
    cmdline: Tuple[str, ...]
    create_time: float
    kernel_thread: bool = False
    defunct: bool = False
    devices: Tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else f"[{self.name}]"


def same_process(proc: Proc, create_time: float, cmdline: Sequence[str]) -> bool:
    """Whether a process seen now (its create time and command line) is ``proc``, not a reuse of its PID."""
    return abs(create_time - proc.create_time) <= CREATE_TIME_TOLERANCE_S and tuple(cmdline) == proc.cmdline


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


def belongs_to_run(proc: Proc, run: Run) -> bool:
    """run.json's membership rule: in the run's process group or session, or one of its registered pids."""
    return (
        (run.pgid is not None and proc.pgid == run.pgid)
        or (run.sid is not None and proc.sid == run.sid)
        or proc.pid in run.pids
    )


def _alive(table: Dict[int, Proc], pid: int) -> Optional[Proc]:
    proc = table.get(pid)
    return proc if proc is not None and not proc.defunct else None


def run_is_live(run: Run, table: Dict[int, Proc]) -> bool:
    """A run is live while its launcher lives: the group or session leader, or one of its registered pids."""
    launchers: List[Proc] = []
    if run.pgid is not None:
        leader = _alive(table, run.pgid)
        if leader is not None and leader.pgid == run.pgid:
            launchers.append(leader)
    if run.sid is not None:
        leader = _alive(table, run.sid)
        if leader is not None and leader.sid == run.sid:
            launchers.append(leader)
    launchers.extend(p for p in (_alive(table, pid) for pid in run.pids) if p is not None)
    if run.started_at is None:
        return bool(launchers)
    return any(p.create_time <= run.started_at + LAUNCHER_BIRTH_SLACK_S for p in launchers)
