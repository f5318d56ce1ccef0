# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown's load check: run the user's command on each artifact and pass only when every one exits 0 in time.

Each argv runs with no shell, stdin from /dev/null, stdout and stderr in one pipe of which only the last
``output_bytes`` are kept, in a session of its own. On timeout the whole session (its process group, and any member
that moved to another group) gets SIGTERM, then SIGKILL after ``TERM_GRACE_S``; processes a check leaves behind
when it exits are stopped the same way. Read-only; pure standard library.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence, cast

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import RC_NOT_EXECUTABLE, RC_NOT_FOUND
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import deliver
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import list_procs

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_OUTPUT_BYTES = 4000
TERM_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this
KILL_WAIT_S = 5.0  # how long SIGKILLed processes get to disappear
DRAIN_S = 0.5  # output still read after the check exited (a process it left may hold the pipe)
POLL_S = 0.05
READ_BYTES = 65536


class _Tail:
    """The last ``limit`` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.data = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[: len(self.data) - self.limit]

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")


def session_members(sid: int) -> List[int]:
    """Live (not zombie) processes of session ``sid``, never this process."""
    own = os.getpid()
    return [p.pid for p in list_procs() if p.sid == sid and p.pid != own and p.state != "Z"]


def _signal_session(sid: int, signum: int) -> None:
    """``signum`` to the session's process group, and to each member that left that group: once per process, since
    a second SIGTERM can end a check's own handler halfway (it then dies of the signal instead of exiting)."""
    own = os.getpid()
    outside = [p.pid for p in list_procs() if p.sid == sid and p.pgid != sid and p.pid != own and p.state != "Z"]
    deliver([-sid, *outside], signum)


def _wait_empty(sid: int, proc: subprocess.Popen[bytes], seconds: float) -> bool:
    until = time.monotonic() + seconds
    while True:
        proc.poll()  # reap the leader, so it does not count as alive
        if not session_members(sid):
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(POLL_S)


def stop_session(sid: int, proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the session, SIGKILL what is left after ``grace_s``; how many processes were there at first."""
    proc.poll()
    found = len(session_members(sid))
    if not found:
        return 0
    _signal_session(sid, signal.SIGTERM)
    if not _wait_empty(sid, proc, grace_s):
        _signal_session(sid, signal.SIGKILL)
        _wait_empty(sid, proc, KILL_WAIT_S)
    return found


def _read_until_done(proc: subprocess.Popen[bytes], fd: int, deadline: float, tail: _Tail) -> bool:
    """Read the output until the check has exited and the pipe ended (or ``DRAIN_S`` after its exit); False when the
    deadline came first."""
    exited_at: Optional[float] = None
    ended = False
    while True:
        now = time.monotonic()
        if proc.poll() is not None:
            exited_at = now if exited_at is None else exited_at
            if ended or now - exited_at >= DRAIN_S:
                return True
        if now >= deadline:
            return False
        if ended:  # the pipe ended, the process has not exited yet
            time.sleep(min(POLL_S, deadline - now))
            continue
        ready, _writable, _errored = select.select([fd], [], [], min(POLL_S, deadline - now))
        if ready:
            chunk = os.read(fd, READ_BYTES)
            if chunk:
                tail.feed(chunk)
            else:
                ended = True


def _drain(fd: int, tail: _Tail) -> None:
    """What is still in the pipe once the session is stopped (a member that ignores signals may hold it: bounded)."""
    os.set_blocking(fd, False)
    until = time.monotonic() + DRAIN_S
    while time.monotonic() < until:
        try:
            chunk = os.read(fd, READ_BYTES)
        except BlockingIOError:
            ready, _writable, _errored = select.select([fd], [], [], POLL_S)
            if not ready:
                return
            continue
        if not chunk:
            return
        tail.feed(chunk)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Reap the check; SIGKILL it first if it still runs, and give up after ``KILL_WAIT_S`` (stuck in the kernel)."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(KILL_WAIT_S)


def run_check(artifact: str, argv: Sequence[str], timeout_s: float, output_bytes: int) -> Dict[str, Any]:
    """One check: ``{artifact, argv, rc, signal, timed_out, duration_s, output_tail, leftovers}``, and ``problem``
    (why it could not start, or None)."""
    result: Dict[str, Any] = {"artifact": artifact, "argv": list(argv), "rc": None, "signal": None}
    result.update(timed_out=False, duration_s=0.0, output_tail="", leftovers=0, problem=None)
    started = time.monotonic()
    try:
        # Not run_command: the check runs in a session of its own, killed as a whole at its timeout.
        proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except FileNotFoundError:
        result.update(rc=RC_NOT_FOUND, problem=f"program not found: {argv[0]}")
    except PermissionError as exc:
        result.update(rc=RC_NOT_EXECUTABLE, problem=f"program not executable: {argv[0]} ({exc.strerror})")
    except OSError as exc:
        result.update(rc=RC_NOT_EXECUTABLE, problem=f"program cannot be run: {argv[0]} ({exc.strerror or exc})")
    if result["problem"] is not None:
        result.update(output_tail=result["problem"], duration_s=round(time.monotonic() - started, 3))
        return result
    tail = _Tail(output_bytes)
    pipe = cast(IO[bytes], proc.stdout)
    try:
        finished = _read_until_done(proc, pipe.fileno(), started + timeout_s, tail)
        if finished:
            result["leftovers"] = stop_session(proc.pid, proc, TERM_GRACE_S)
        else:
            result["timed_out"] = True
            stop_session(proc.pid, proc, TERM_GRACE_S)
        _end(proc)
        _drain(pipe.fileno(), tail)
    finally:
        pipe.close()
        _end(proc)  # also when stopping raised: never leave the check behind
    code = proc.returncode
    result.update(duration_s=round(time.monotonic() - started, 3), output_tail=tail.text())
    if code is not None and code < 0:
        result["signal"] = -code
    elif not result["timed_out"]:
        result["rc"] = code
    return result


def why_failed(check: Mapping[str, Any], timeout_s: float) -> Optional[str]:
    """One phrase for a failed check, None when it passed."""
    if check["timed_out"]:
        return f"timed out after {timeout_s:g} s (its process group was killed)"
    if check["problem"]:
        return f"could not start: {check['problem']} (rc {check['rc']})"
    if check["signal"] is not None:
        return f"killed by signal {check['signal']}"
    if check["rc"] != 0:
        return f"exited with {check['rc']}"
    return None


def parse_checks(checks: Any) -> List[Dict[str, Any]]:
    """The checks option, validated: each ``{artifact: non-empty str, argv: non-empty list of str}``."""
    if not isinstance(checks, list):
        raise ValueError("checks must be a list of {artifact, argv}")
    parsed = []
    for index, check in enumerate(checks):
        where = f"checks[{index}]"
        if not isinstance(check, dict):
            raise ValueError(f"{where} must be a dict with artifact (str) and argv (list of str)")
        artifact, argv = check.get("artifact"), check.get("argv")
        if not isinstance(artifact, str) or not artifact.strip():
            raise ValueError(f"{where}.artifact must be a non-empty string, got {artifact!r}")
        if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
            raise ValueError(f"{where}.argv must be a non-empty list of strings, got {argv!r}")
        if not argv[0]:
            raise ValueError(f"{where}.argv[0] (the program) must not be empty")
        if any("\0" in arg for arg in argv):
            raise ValueError(f"{where}.argv must not contain a NUL character")
        parsed.append({"artifact": artifact, "argv": list(argv)})
    return parsed


def load_verify(params: Mapping[str, Any]) -> Dict[str, Any]:
    """The module's work: run every check in order; ValueError (naming the option) for bad checks."""
    checks = parse_checks(params.get("checks"))
    timeout_s = float(params.get("timeout_s") or DEFAULT_TIMEOUT_S)
    output_bytes = params.get("output_bytes")
    output_bytes = DEFAULT_OUTPUT_BYTES if output_bytes is None else int(output_bytes)
    results = [run_check(c["artifact"], c["argv"], timeout_s, output_bytes) for c in checks]
    failures = [(check, why_failed(check, timeout_s)) for check in results]
    failed = [(check, why) for check, why in failures if why is not None]
    for check in results:
        del check["problem"]
    if failed:
        first, why = failed[0]
        reason = f"load check of {first['artifact']} {why} ({len(failed)} of {len(results)} check(s) failed)"
    else:
        reason = f"{len(results)} load check(s) passed" if results else "no load checks given: nothing to verify"
    return {
        "changed": False,
        "passed": not failed,
        "checks": results,
        "failed_artifacts": [check["artifact"] for check, _why in failed],
        "reason": reason,
    }
