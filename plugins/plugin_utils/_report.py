# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's files of a stage: its JSON report and the lock that keeps two runs of a stage off one box.

Reports are private (0600: they name boxes, paths and provider states) and never overwrite each other: two stages
finishing in the same second get two files. The lock is an flock on a file per box, released by the kernel when
the holder dies, so a crashed teardown never leaves a box locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from datetime import datetime, timezone
from typing import Any, Iterator, Mapping

LOCK_DIR = "~/.ansible/remote_gpu_trainer/locks"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class Busy(Exception):
    """Another run of the stage holds the box's lock."""


def write_report(directory: str, stage: str, document: Mapping[str, Any]) -> str:
    """Write ``document`` as ``<directory>/<stage>-<UTC>-<n>.json`` (mode 0600, a name no other report has) and
    ``<stage>-latest.json`` beside it; return the report's path. Raises OSError."""
    directory = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(directory, mode=0o755, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(document, indent=2, sort_keys=False, default=str) + "\n"
    for attempt in range(1000):
        path = os.path.join(directory, f"{stage}-{stamp}{f'-{attempt}' if attempt else ''}.json")
        try:
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        latest = os.path.join(directory, f".{stage}-latest.{os.getpid()}.tmp")
        with os.fdopen(os.open(latest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as stream:
            stream.write(text)
        os.replace(latest, os.path.join(directory, f"{stage}-latest.json"))
        return path
    raise OSError(f"no free report name for {stage}-{stamp} in {directory}")


def flock_within(handle: int, wait_s: float) -> bool:
    """Take an exclusive flock on ``handle``, waiting at most ``wait_s`` seconds; whether it was taken."""
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


@contextlib.contextmanager
def box_lock(stage: str, key: str, wait_s: float, directory: str = LOCK_DIR) -> Iterator[str]:
    """Hold ``<directory>/<stage>-<key>.lock`` for the block; Busy after ``wait_s`` seconds of waiting."""
    directory = os.path.expanduser(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"{stage}-{_UNSAFE.sub('_', key)[:120]}.lock")
    handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not flock_within(handle, wait_s):
            holder = os.pread(handle, 64, 0).decode("ascii", "replace").strip() or "?"
            raise Busy(f"another {stage} of this box is running (pid {holder}; lock {path})")
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)
        yield path
    finally:
        os.close(handle)
