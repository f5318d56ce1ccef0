# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Directory probes: a read-only usage probe (exists, bytes and inodes) and a write probe, each under a deadline.

The usage probe never opens anything for writing: patrol runs it every tick and must leave the box as it was.
Only preflight's ``box_health`` adds the write probe (create, fsync, delete a file). Every probe runs in a forked
child (``run_with_deadline``): a dead network mount blocks ``statvfs`` or ``open`` in the kernel, and the caller
must report that instead of hanging with it. Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline

PROBE_FILE_PREFIX = ".rgt-preflight-probe-"


def read_usage(path: str) -> Dict[str, Any]:
    """Existence, bytes and inodes of one directory, read-only. Runs in the probe child."""
    usage: Dict[str, Any] = {"path": path, "exists": os.path.isdir(path), "error": None}
    if not usage["exists"]:
        usage["error"] = "not a directory" if os.path.exists(path) else "does not exist"
        return usage
    usage.update(usage_from_statvfs(os.statvfs(path)))
    return usage


def usage_from_statvfs(stats: os.statvfs_result) -> Dict[str, Any]:
    """Bytes and inodes as an unprivileged user sees them (``df`` semantics: used / (used + available))."""
    bytes_total = stats.f_blocks * stats.f_frsize
    bytes_free = stats.f_bavail * stats.f_frsize
    bytes_used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
    inodes_total = stats.f_files
    inodes_free = stats.f_favail
    inodes_used = stats.f_files - stats.f_ffree
    return {
        "bytes_total": bytes_total,
        "bytes_free": bytes_free,
        "bytes_used_pct": _pct(bytes_used, bytes_used + bytes_free),
        "inodes_total": inodes_total,
        "inodes_free": inodes_free,
        # Filesystems without an inode table (btrfs, some FUSE mounts) report zero files: nothing to run out of.
        "inodes_used_pct": _pct(inodes_used, inodes_used + inodes_free) if inodes_total else None,
    }


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 1) if whole > 0 else 0.0


def write_probe(path: str) -> Optional[str]:
    """Create, fsync and delete a probe file in ``path``: None when that worked, else why not."""
    probe_name = os.path.join(path, f"{PROBE_FILE_PREFIX}{os.getpid()}")
    try:
        fd = os.open(probe_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"preflight\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe_name)
    except OSError as exc:
        return f"write probe failed: {exc.strerror or exc}"
    return None


def probe_path(path: str) -> Dict[str, Any]:
    """Usage plus a real write, for preflight: ``writable`` and, when the write failed, ``error``. Runs in the child."""
    probe = read_usage(path)
    probe["writable"] = False
    if probe["exists"]:
        probe["error"] = write_probe(path)
        probe["writable"] = probe["error"] is None
    return probe


def probe_paths(paths: List[str], timeout_s: float) -> Dict[str, Dict[str, Any]]:
    """``probe_path`` (usage and write) of every path, each in its own child, all under one deadline."""
    return _under_deadline(probe_path, paths, timeout_s)


def probe_usage(paths: List[str], timeout_s: float) -> Dict[str, Dict[str, Any]]:
    """``read_usage`` (read-only) of every path, each in its own child, all under one deadline."""
    return _under_deadline(read_usage, paths, timeout_s)


def _under_deadline(
    probe: Callable[[str], Dict[str, Any]], paths: List[str], timeout_s: float
) -> Dict[str, Dict[str, Any]]:
    """Per path the probe's result, ``{path, timed_out: True}`` (its child was killed) or ``{path, probe_error}``."""
    answers = run_with_deadline({path: functools.partial(probe, path) for path in paths}, timeout_s)
    results: Dict[str, Dict[str, Any]] = {}
    for path, answer in answers.items():
        if answer.get("timed_out"):
            results[path] = {"path": path, "timed_out": True}
        elif "error" in answer:
            results[path] = {"path": path, "probe_error": answer["error"]}
        else:
            results[path] = answer["value"]
    return results
