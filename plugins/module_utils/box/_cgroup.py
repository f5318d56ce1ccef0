# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Memory a job may use: the host's MemTotal and the container's cgroup v1 or v2 memory limit.

Pure standard library (Python 3.8+); reads /proc and /sys/fs/cgroup only.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

# cgroup v1 reports "no limit" as a page-aligned LONG_MAX; anything this large is no limit.
CGROUP_V1_UNLIMITED = 1 << 62


def host_memory_total(meminfo_path: str = "/proc/meminfo") -> Optional[int]:
    """MemTotal in bytes, or None when /proc/meminfo cannot be read."""
    try:
        with open(meminfo_path) as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def parse_proc_cgroup(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 memory controller path) from /proc/self/cgroup; either may be None."""
    unified = memory_v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "memory" in controllers.split(","):
            memory_v1 = path
    return unified, memory_v1


def _read_limit(path: str) -> Tuple[bool, Optional[int]]:
    """(file was readable, limit in bytes or None for no limit)."""
    try:
        with open(path) as handle:
            raw = handle.read().strip()
    except OSError:
        return False, None
    if raw in ("max", ""):
        return True, None
    try:
        value = int(raw)
    except ValueError:
        return False, None
    return True, (None if value >= CGROUP_V1_UNLIMITED else value)


def _ancestors(root: str, cgroup_path: str) -> List[str]:
    """Directories from the process's own cgroup up to the mount root; the tightest limit among them applies."""
    parts = [p for p in cgroup_path.strip("/").split("/") if p and p != ".."]
    dirs = [os.path.join(root, *parts[:depth]) for depth in range(len(parts), 0, -1)]
    dirs.append(root)
    return dirs


def cgroup_memory_limit(
    proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> Tuple[Optional[int], Optional[int]]:
    """(cgroup version, effective memory limit in bytes or None when unlimited or unknown).

    A container usually sees its own cgroup as ``/`` (cgroup namespace) with the limit at the mount root;
    without a namespace the path names the container's cgroup below the host's root. Both are walked.
    """
    try:
        with open(proc_cgroup) as handle:
            unified, memory_v1 = parse_proc_cgroup(handle.read())
    except OSError:
        return None, None
    candidates = []
    if memory_v1 is not None:
        candidates.append((1, os.path.join(cgroup_root, "memory"), memory_v1, "memory.limit_in_bytes"))
    if unified is not None:
        candidates.append((2, cgroup_root, unified, "memory.max"))
    for version, root, path, filename in candidates:
        found_any = False
        limits = []
        for directory in _ancestors(root, path):
            readable, limit = _read_limit(os.path.join(directory, filename))
            found_any = found_any or readable
            if limit is not None:
                limits.append(limit)
        if found_any:
            return version, (min(limits) if limits else None)
    return None, None
