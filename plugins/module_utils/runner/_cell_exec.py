# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run one attempt of a cell's command, the seed's ``run_one.sh`` lessons turned into guarantees.

- The command is an argv (never a shell string) in its own process group inside the runner's session, so the
  runner can signal everything it started as one unit, and patrol finds it by the run's session.
- stdout and stderr are appended to the cell's own log (never a shared, tee'd one: a crash scan of one cell must
  not see another's traceback), stdin is /dev/null.
- The exit status is the command's own, from waitpid (the seed's ``| tee`` recorded tee's status); an env hook
  or conda env goes through a fixed bash wrapper that ends in ``exec``, so the status is still the command's. A
  hook that exits the wrapper (``exit 1`` in a sourced file) is written to a status file the runner names, so it
  is never read as the command's own exit.
- When the command ends (any way), what is left of its group, any process carrying its attempt's marker in its
  environment (a worker that called setsid), and whatever the runner's tracker recorded as the attempt's (a
  helper started with ``env -i setsid``) is stopped: SIGTERM, then SIGKILL after the grace period. Only when none
  is left may its GPUs go to another cell.

Pure standard library (Python 3.8+), Linux /proc.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._env_hook import hook_failure
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import (
    ProcStat,
    members,
    still_running,
    ticks_now,
)

POLL_S = 0.05
# Waiting for processes to go scans /proc: fast at first (most go at once), then gentler on a busy box.
SLOW_POLL_S, FAST_POLL_FOR_S = 0.25, 1.0
# After SIGKILL, how long to wait for the processes to go (one in uninterruptible sleep can take a while).
KILL_WAIT_S = 10.0
EXIT_NOT_STARTED = 127  # the shell's "command not found": the command never ran
MARKER_VARIABLE = "RGT_CELL_TOKEN"


def utc_iso(timestamp: float) -> str:
    """ISO 8601 UTC with a fixed width (microseconds always), so the texts also sort as times."""
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="microseconds")


def _send(pgid: Optional[int], procs: Sequence[ProcStat], signum: int) -> None:
    """One signal to the group, and one to each marked process outside it (a second SIGTERM makes some launchers
    skip their own cleanup)."""
    targets = [p.pid for p in procs if pgid is None or p.pgid != pgid]
    if pgid is not None and any(p.pgid == pgid for p in procs):
        targets.insert(0, -pgid)
    deliver(targets, signum)


def deliver(targets: Sequence[int], signum: int) -> None:
    """``signum`` to each target: a pid, or a process group as its negated pgid; one already gone is skipped."""
    for target in targets:
        try:
            if target < 0:
                os.killpg(-target, signum)
            else:
                os.kill(target, signum)
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise


Extra = Callable[[], Sequence[ProcStat]]


def _no_extra() -> Sequence[ProcStat]:
    return ()


def _present(pgid: Optional[int], marker: Optional[bytes], since: Optional[int], extra: Extra) -> List[ProcStat]:
    """``members`` plus the live processes ``extra`` names (the tracker's, each checked against its start time)."""
    found = members(pgid, marker, since_ticks=since)
    seen = {p.pid for p in found}
    found.extend(p for p in extra() if p.pid not in seen and p.pid != os.getpid())
    return found


def _wait_gone(
    pgid: Optional[int],
    marker: Optional[bytes],
    until: float,
    reap: Callable[[], Any],
    since: Optional[int],
    *,
    known: Sequence[ProcStat],
    extra: Extra = _no_extra,
) -> List[ProcStat]:
    """What is still there: the group, the marked and ``extra``'s, and every one of ``known`` not yet dead. A
    process in its exit has dropped its environment (so its marker) before its files (so the GPU), and is gone only
    once it is a zombie or reaped."""
    fast_until = time.monotonic() + FAST_POLL_FOR_S
    while True:
        reap()
        left = _present(pgid, marker, since, extra)
        seen = {p.pid for p in left}
        left.extend(p for p in still_running(known) if p.pid not in seen)
        now = time.monotonic()
        if not left or now >= until:
            return left
        time.sleep(min(POLL_S if now < fast_until else SLOW_POLL_S, max(until - now, 0.0)))


@dataclass(frozen=True)
class StopReport:
    found: int  # processes that were there when the stop began
    killed: bool  # SIGKILL was needed
    left: int  # processes still there at the end (0: the group is gone)
    procs: Tuple[ProcStat, ...] = ()  # those found
    survivors: Tuple[ProcStat, ...] = ()  # those still there at the end

    def leftovers(self) -> Tuple[Dict[str, Any], ...]:
        """``{pid, name, stopped}`` per process found, for result.json."""
        alive = {p.pid for p in self.survivors}
        return tuple({"pid": p.pid, "name": p.comm, "stopped": p.pid not in alive} for p in self.procs)


def stop_processes(
    pgid: Optional[int],
    marker: Optional[bytes],
    grace_s: float,
    reap: Callable[[], Any] = lambda: None,
    *,
    kill_wait_s: float = KILL_WAIT_S,
    since_ticks: Optional[int] = None,
    extra: Extra = _no_extra,
) -> StopReport:
    """SIGTERM the group, the marked processes and those ``extra`` names, SIGKILL after ``grace_s``, then wait up
    to ``kill_wait_s``."""
    reap()
    found = _present(pgid, marker, since_ticks, extra)
    if not found:
        return StopReport(0, False, 0)
    _send(pgid, found, signal.SIGTERM)
    left = _wait_gone(pgid, marker, time.monotonic() + grace_s, reap, since_ticks, known=found, extra=extra)
    if not left:
        return StopReport(len(found), False, 0, tuple(found))
    _send(pgid, left, signal.SIGKILL)
    left = _wait_gone(pgid, marker, time.monotonic() + kill_wait_s, reap, since_ticks, known=found, extra=extra)
    return StopReport(len(found), True, len(left), tuple(found), tuple(left))


def build_env(
    base: Mapping[str, str],
    defaults: Mapping[str, str],
    spec_env: Mapping[str, str],
    secrets: Mapping[str, str],
    runner_env: Mapping[str, str],
) -> Dict[str, str]:
    """The job's environment, later layers winning: the runner's own, the seed's defaults, the run's, its
    secrets, then what the runner must decide (CUDA_VISIBLE_DEVICES, RGT_*)."""
    env = dict(base)
    for layer in (defaults, spec_env, secrets, runner_env):
        env.update(layer)
    return env


def append_line(path: str, text: str) -> None:
    """One line appended to a log (O_APPEND: whole lines even while the command writes to it)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, (text.rstrip("\n") + "\n").encode("utf-8", errors="replace"))
    finally:
        os.close(fd)


def spawn(argv: Sequence[str], cwd: str, env: Mapping[str, str], log_path: str) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group within this session, output appended to ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    options: Dict[str, Any] = {}
    if sys.version_info >= (3, 11):
        options["process_group"] = 0
    else:  # setpgid(0, 0) in the child before exec; a C function, so no Python lock is taken after fork
        options["preexec_fn"] = os.setpgrp
    try:
        # Not run_command: the runner is detached from any AnsibleModule, and the cell needs its own group.
        return subprocess.Popen(  # pylint: disable=ansible-bad-function
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            close_fds=True,
            start_new_session=False,
            **options,
        )
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Attempt:
    """What to run for one attempt of a cell."""

    argv: Sequence[str]
    cwd: str
    env: Mapping[str, str]
    log_path: str
    timeout_s: Optional[float]
    grace_s: float
    marker: bytes  # MARKER_VARIABLE=<token>, in env
    env_hook: Optional[str] = None  # the hook the wrapper sources, named in the reason when it fails
    hook_status: Optional[str] = None  # the wrapper's status file (command_argv's hook_status)


class Tracker(Protocol):
    """What the runner knows of an attempt's processes beyond its group and marker (``_cell_tree``)."""

    def spawning(self) -> ContextManager[Any]:
        """Held while the command is spawned and :meth:`began` is called."""

    def began(self, pid: int) -> None:
        """The command runs as ``pid``."""

    def ended(self) -> None:
        """The command has ended: record what it left, before anything is stopped."""

    def extra(self) -> Sequence[ProcStat]:
        """The attempt's live processes outside its group and marker."""

    def reap(self) -> None:
        """Collect the exit status of those of them that ended as the runner's (adopted) children."""


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended; ``left`` > 0 means processes survived SIGKILL and still hold the cell's GPUs."""

    exit_code: Optional[int]
    signal: Optional[int]
    started_at: float
    ended_at: float
    reason: Optional[str]  # None for a command that ended on its own
    leftovers: Tuple[Dict[str, Any], ...]  # {pid, name, stopped} per process still there when the command ended
    left: int
    pgid: Optional[int] = None  # the command's process group (its pid); None when it never started
    since_ticks: Optional[int] = None  # when the attempt began, in /proc start-time ticks
    hook_failed: bool = False  # the env hook ended the wrapper: the command never started
    survivors: Tuple[ProcStat, ...] = ()  # what outlived SIGKILL (checked again by start time while quarantined)

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and self.signal is None

    def describe(self) -> str:
        """``exit status 1`` / ``ended by signal 9 (SIGKILL)``, and the reason when the runner stopped it."""
        if self.hook_failed and self.reason:
            return self.reason
        if self.signal is not None and self.exit_code is None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "?"
            ended = f"ended by signal {self.signal} ({name})"
        else:
            ended = f"exit status {self.exit_code}"
        return f"{ended}, {self.reason}" if self.reason else ended


def _status(returncode: Optional[int], sent: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(exit_code, signal) from waitpid; a command the runner stopped records the signal that stopped it, also
    when it caught it and exited on its own (so it never reads as a success)."""
    if returncode is None:
        return None, sent
    if returncode < 0:
        return None, -returncode
    return returncode, sent


def run_attempt(
    attempt: Attempt, stop: threading.Event, on_start: Callable[[int], None], tracker: Optional[Tracker] = None
) -> Outcome:
    """Run one attempt to its end, stopping it on ``stop`` or its timeout, then clear what it left behind."""
    started, clock, since = time.time(), time.monotonic(), ticks_now()
    with tracker.spawning() if tracker is not None else contextlib.nullcontext():
        try:
            proc = spawn(attempt.argv, attempt.cwd, attempt.env, attempt.log_path)
        except OSError as exc:
            why = f"could not start: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            append_line(attempt.log_path, f"rgt: {why}")
            return Outcome(EXIT_NOT_STARTED, None, started, time.time(), why, (), 0)
        if tracker is not None:
            tracker.began(proc.pid)
    on_start(proc.pid)
    deadline = clock + attempt.timeout_s if attempt.timeout_s else None  # monotonic: a clock step cannot fire it
    reason: Optional[str] = None
    returncode: Optional[int] = None
    while returncode is None:
        try:
            returncode = proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if stop.is_set():
                reason = "run stopped"
            elif deadline is not None and time.monotonic() >= deadline:
                reason = f"timeout after {attempt.timeout_s:g} s"
            if reason:
                break
    extra, reap = (tracker.extra, tracker.reap) if tracker is not None else (_no_extra, _no_reap)
    if tracker is not None:
        tracker.ended()

    def poll() -> None:
        proc.poll()
        reap()

    sent: Optional[int] = None
    if reason is not None:
        sent = signal.SIGTERM
        stop_processes(proc.pid, attempt.marker, attempt.grace_s, poll, since_ticks=since, extra=extra)
        try:
            returncode = proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            returncode = None
    ended = time.time()
    exit_code, signum = _status(returncode, sent)
    hook = hook_failure(attempt.hook_status, attempt.env_hook)
    if hook is not None and reason is None:  # a stop while the hook ran is the stop's, not the hook's
        append_line(attempt.log_path, f"rgt: {hook}")
        exit_code, signum, reason = None, None, hook
    # Whatever the command left (workers in its group, daemons that left it): gone before the GPUs are handed on.
    cleanup = stop_processes(proc.pid, attempt.marker, attempt.grace_s, poll, since_ticks=since, extra=extra)
    reap()
    return Outcome(
        exit_code, signum, started, ended, reason, cleanup.leftovers(), cleanup.left, proc.pid, since,
        hook_failed=hook is not None and reason == hook, survivors=cleanup.survivors,
    )  # fmt: skip


def _no_reap() -> None:
    return None
