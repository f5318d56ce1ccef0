# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which processes a cell started, also those that left its group and dropped its marker.

A helper started as ``env -i setsid helper &`` has neither the cell's process group nor its marker, and once its
parent exits nothing in /proc links it to the cell. So the runner records each attempt's process tree while it
runs: one /proc scan every ``SAMPLE_S`` for all cells together (faster for the first seconds of an attempt, when
launchers fork their helpers), each process kept with its start time so a reused pid is never taken for it.

Where the kernel allows, the runner is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan of a cell
is reparented to the runner instead of init. Its descendants stay traceable, and an orphan the scans missed (its
parent exited at once) is still found as the runner's child: it is the ending cell's when that cell is the only
one busy and the orphan started during its attempt. The runner reaps such children with ``waitpid`` on their own
pid only, never ``waitpid(-1)``, which would take a ``Popen``'s status from it.

Pure standard library (Python 3.8+), Linux /proc.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import (
    ProcStat,
    list_procs,
    read_stat,
    still_running,
    ticks_now,
)

PR_SET_CHILD_SUBREAPER = 36
SAMPLE_S = 0.5
BURST_SAMPLE_S, BURST_FOR_S = 0.1, 3.0


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans; False where the kernel or libc refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError, TypeError):
        return False


def reap(pid: int) -> bool:
    """``waitpid(pid, WNOHANG)``: True when ``pid`` was this process's ended child and is now collected."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    except OSError as exc:
        if exc.errno == errno.EINTR:
            return False
        raise
    return done == pid


class _Attempt:
    """One attempt of a cell: its command's process and every descendant seen, by pid with its start time."""

    def __init__(self, tree: CellTree, cell: str) -> None:
        self.tree = tree
        self.cell = cell
        self.since = ticks_now() or 0
        self.root: Optional[ProcStat] = None
        self.recorded: Dict[int, ProcStat] = {}

    # The Tracker protocol of _cell_exec.run_attempt.
    def spawning(self) -> ContextManager[Any]:
        return self.tree.lock

    def began(self, pid: int) -> None:  # called with the tree's lock held
        self.root = read_stat(pid)
        self.tree.attempts[self.cell] = self
        self.tree.groups.add(pid)
        self.tree.burst_until = time.monotonic() + BURST_FOR_S

    def ended(self) -> None:
        self.tree.sample(adopt_for=self)

    def extra(self) -> Sequence[ProcStat]:
        with self.tree.lock:
            return still_running(list(self.recorded.values()))

    def reap(self) -> None:
        self.tree.reap()

    def close(self) -> None:
        """The attempt is over: its records go (orphans it left stay known to be reaped)."""
        with self.tree.lock:
            if self.tree.attempts.get(self.cell) is self:
                del self.tree.attempts[self.cell]


class CellTree:
    """The runner's record of every running attempt's processes, sampled by one thread (:meth:`start`)."""

    def __init__(self, others_busy: Callable[[str], bool], subreaper: bool = False) -> None:
        self.others_busy = others_busy  # whether a cell other than this one is running or syncing
        self.subreaper = subreaper
        self.lock = threading.Lock()  # the records; also held while a command is spawned (see _orphans)
        self.attempts: Dict[str, _Attempt] = {}
        self.adopted: Dict[int, ProcStat] = {}  # recorded processes that may end as this process's children
        self.groups: Set[int] = set()  # the commands' process groups (each led by its command, a Popen child)
        self.burst_until = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def attempt(self, cell: str) -> _Attempt:
        return _Attempt(self, cell)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rgt-cell-tree", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()  # the last orphans that ended as the runner's zombies are collected

    def reap(self) -> None:
        """Collect the recorded processes that ended as the runner's children."""
        with self.lock:
            self.reap_adopted()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a failed scan must not end the sampling of the next ones
                if self.attempts:
                    self.sample()
            self._stop.wait(BURST_SAMPLE_S if time.monotonic() < self.burst_until else SAMPLE_S)

    def sample(self, adopt_for: Optional[_Attempt] = None) -> None:
        """One /proc scan: every running attempt's descendants are recorded; with ``adopt_for``, the orphans the
        runner adopted that can only be that attempt's are recorded as its own too."""
        procs = list_procs()
        table = {stat.pid: stat for stat in procs}
        with self.lock:
            children: Dict[int, List[ProcStat]] = {}
            for stat in procs:
                children.setdefault(stat.ppid, []).append(stat)
            if adopt_for is not None and adopt_for.root is not None:
                for orphan in self._orphans(procs, adopt_for):
                    adopt_for.recorded[orphan.pid] = orphan
                    self.adopted[orphan.pid] = orphan
            walked = list(self.attempts.values())
            if adopt_for is not None and adopt_for not in walked:
                walked.append(adopt_for)
            for attempt in walked:
                self._walk(attempt, table, children)
            self.reap_adopted(table)
            for stat in children.get(os.getpid(), ()):
                # A member of a command's group that outlived it (the group's leader is the Popen's to wait for).
                if stat.state == "Z" and stat.pgid in self.groups and stat.pid != stat.pgid:
                    reap(stat.pid)

    def _walk(self, attempt: _Attempt, table: Dict[int, ProcStat], children: Dict[int, List[ProcStat]]) -> None:
        for pid, known in list(attempt.recorded.items()):  # a process gone for good: its pid may come back
            if not _same(table.get(pid), known):
                del attempt.recorded[pid]
        frontier = [p.pid for p in attempt.recorded.values()]
        if attempt.root is not None and _same(table.get(attempt.root.pid), attempt.root):
            frontier.append(attempt.root.pid)
        own = os.getpid()
        while frontier:
            for child in children.get(frontier.pop(), ()):
                if child.pid in attempt.recorded or child.pid == own or child.start_ticks < attempt.since:
                    continue
                if child.state != "Z":
                    attempt.recorded[child.pid] = child
                    self.adopted[child.pid] = child
                frontier.append(child.pid)

    def _orphans(self, procs: Sequence[ProcStat], attempt: _Attempt) -> List[ProcStat]:
        """The runner's children no scan saw being born: orphans reparented to it as subreaper. The runner's own
        children (probes, samplers) share its process group; a command being spawned holds the lock."""
        if not self.subreaper or self.others_busy(attempt.cell):
            return []
        own, group = os.getpid(), os.getpgrp()
        roots = {a.root.pid for a in self.attempts.values() if a.root is not None}
        if attempt.root is not None:
            roots.add(attempt.root.pid)
        recorded = {pid for a in self.attempts.values() for pid in a.recorded}
        return [
            stat
            for stat in procs
            if stat.ppid == own
            and stat.state != "Z"
            and stat.pgid != group
            and stat.pid not in roots
            and stat.pid not in recorded
            and stat.start_ticks >= attempt.since
        ]

    def reap_adopted(self, table: Optional[Dict[int, ProcStat]] = None) -> None:
        """Collect recorded processes that ended as the runner's children (caller holds the lock); ``table`` is a
        scan just made, else each is read again."""
        own = os.getpid()
        for pid, known in list(self.adopted.items()):
            now = table.get(pid) if table is not None else read_stat(pid)
            if (
                now is None
                or now.start_ticks != known.start_ticks
                or (now.state == "Z" and now.ppid == own and reap(pid))
            ):
                del self.adopted[pid]


def _same(now: Optional[ProcStat], known: ProcStat) -> bool:
    """Whether the process seen now is ``known`` (a zombie too), not another one with its pid."""
    return now is not None and now.start_ticks == known.start_ticks
