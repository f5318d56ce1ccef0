# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run filesystem probes in forked children under one deadline.

A dead network mount (an sshfs whose daemon is gone, a stale NFS server) blocks ``stat``, ``open`` and
``listdir`` in the kernel, uninterruptibly: no timeout inside the calling process can fire. The only
bounded way to touch such a path is from a child that the caller can abandon. Pure standard library.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import time
from typing import Any, Callable, Dict, Mapping, Tuple


def run_with_deadline(probes: Mapping[str, Callable[[], Any]], timeout_s: float) -> Dict[str, Dict[str, Any]]:
    """Call each probe in its own forked child, all under one deadline of ``timeout_s`` seconds.

    Each probe returns a JSON-serialisable value. Per key, the answer is ``{"value": ...}``,
    ``{"error": "..."}`` when the probe raised, or ``{"timed_out": True}`` when it missed the deadline
    (its child is then sent SIGKILL and never waited for, since a child stuck in the kernel may not die).
    """
    children: Dict[int, Tuple[str, int]] = {}
    for key, probe in probes.items():
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: one JSON document on the pipe, then exit without the parent's cleanup
            os.close(read_fd)
            try:
                payload = json.dumps({"value": probe()})
            except Exception as exc:  # the parent must get an answer whatever went wrong
                payload = json.dumps({"error": str(exc) or type(exc).__name__})
            try:
                os.write(write_fd, payload.encode())
            finally:
                os._exit(0)
        os.close(write_fd)
        children[read_fd] = (key, pid)
    buffers: Dict[int, bytes] = dict.fromkeys(children, b"")
    deadline = time.monotonic() + timeout_s
    open_fds = set(children)
    while open_fds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _writable, _errored = select.select(list(open_fds), [], [], remaining)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                buffers[fd] += chunk
            else:
                open_fds.discard(fd)
    answers: Dict[str, Dict[str, Any]] = {}
    for fd, (key, pid) in children.items():
        if fd in open_fds:
            answers[key] = {"timed_out": True}
            _kill_quietly(pid)
        else:
            answers[key] = _decode(buffers[fd])
            _reap(pid, block=True)
        os.close(fd)
    return answers


def _decode(raw: bytes) -> Dict[str, Any]:
    try:
        answer = json.loads(raw.decode())
    except ValueError:
        answer = None
    return answer if isinstance(answer, dict) else {"error": "probe child exited without an answer"}


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as exc:
        if exc.errno != errno.ESRCH:
            raise
    _reap(pid, block=False)


def _reap(pid: int, block: bool) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0 if block else os.WNOHANG)
