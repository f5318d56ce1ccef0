# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the runner reads of processes from Linux /proc: their stat line, their start environment's markers, and the
members of a cell (its process group in the runner's session, or its marker), a reused pid told apart by its start
time. Read-only; pure standard library (Python 3.8+).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

MAX_ENVIRON_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ProcStat:
    """One process from /proc/<pid>/stat."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    comm: str
    cpu_ticks: int
    threads: int
    rss_bytes: int
    start_ticks: int  # clock ticks after boot


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_stat(pid: int, proc: str = "/proc") -> Optional[ProcStat]:
    """The process's stat line, or None when it is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as handle:
            raw = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    # comm may hold spaces and parentheses: it ends at the last ')'.
    head, _sep, tail = raw.rpartition(")")
    fields = tail.split()
    if len(fields) < 22:
        return None
    try:
        return ProcStat(
            pid=pid,
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            state=fields[0],
            comm=head.partition("(")[2],
            cpu_ticks=int(fields[11]) + int(fields[12]),
            threads=int(fields[17]),
            rss_bytes=int(fields[21]) * PAGE_SIZE,
            start_ticks=int(fields[19]),
        )
    except ValueError:
        return None


def list_procs(proc: str = "/proc") -> List[ProcStat]:
    """Every process this namespace shows, zombies included (``state == "Z"``)."""
    found = []
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    for name in names:
        if name.isdigit():
            stat = read_stat(int(name), proc)
            if stat is not None:
                found.append(stat)
    return found


def environ_has(pid: int, entry: bytes, proc: str = "/proc") -> bool:
    """Whether ``NAME=value`` (``entry``) is in the environment the process was started with."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as handle:
            data = handle.read(MAX_ENVIRON_BYTES)
    except OSError:
        return False
    return b"\0" + entry + b"\0" in b"\0" + data + b"\0"


def marker_entry(name: str, value: str) -> bytes:
    return f"{name}={value}".encode()


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def ticks_now(margin_s: float = 1.0) -> Optional[int]:
    """Clock ticks since boot, ``margin_s`` ago, in the unit of /proc/<pid>/stat's start time."""
    try:
        with open("/proc/uptime") as handle:
            return max(0, int((float(handle.read().split()[0]) - margin_s) * CLOCK_TICKS))
    except (OSError, ValueError, IndexError):
        return None


def own_ids() -> Tuple[Optional[int], Optional[int]]:
    """This process's (process group, session), each None when its leader lives outside this PID namespace.

    The kernel reports such a leader as 0 (a container started with its session outside, some CI sandboxes); a
    0 must never be compared with other processes' ids: every process of an outside session shows 0 too.
    """
    return tuple(value if value > 1 else None for value in (os.getpgrp(), os.getsid(0)))  # type: ignore[return-value]


def still_running(procs: Sequence[ProcStat], proc: str = "/proc") -> List[ProcStat]:
    """Those of ``procs`` still alive as the same process (same start time: a reused pid is another process)."""
    found = []
    for known in procs:
        now = read_stat(known.pid, proc)
        if now is not None and now.state != "Z" and now.start_ticks == known.start_ticks:
            found.append(now)
    return found


def members(
    pgid: Optional[int], marker: Optional[bytes], proc: str = "/proc", since_ticks: Optional[int] = None
) -> List[ProcStat]:
    """Live processes in this session's process group ``pgid``, or whose environment holds ``marker``; never this
    process.

    The session check keeps a reused PID out: once a group is empty its number may lead a new group elsewhere, but
    only processes the runner started live in the runner's session. Zombies do not count: they hold no memory or
    GPU, and one whose parent never reaps it would never go. With ``since_ticks`` only processes started since then
    are searched for the marker (a cell's processes cannot be older than the cell; reading every process's
    environment takes a while on a busy box).
    """
    own_pid, own_sid = os.getpid(), own_ids()[1]
    found = []
    for stat in list_procs(proc):
        if stat.pid == own_pid or stat.state == "Z":
            continue
        in_group = pgid is not None and stat.pgid == pgid and (own_sid is None or stat.sid == own_sid)
        recent = since_ticks is None or stat.start_ticks >= since_ticks
        if in_group or (marker is not None and recent and environ_has(stat.pid, marker, proc)):
            found.append(stat)
    return found
