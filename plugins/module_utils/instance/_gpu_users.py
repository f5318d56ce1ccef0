# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every process of the box that uses a GPU, and whether it belongs to one of our runs.

A GPU user is a process holding a per-GPU device node (``/dev/nvidia<N>``) open: CUDA opens it for as long as a
context lives, in any PID namespace, where NVML's process list shows host PIDs a container cannot map. A user
belongs to a run when it, or one of its ancestors, carries the run marker (``RGT_RUN_DIR``); every other one
(a job the renter started by hand with ``setsid nohup``, in tmux, from a notebook) is the renter's own, and a
self-stop or a meter-stop would kill it. The driver's own daemons (``nvidia-persistenced``, ``nv-hostengine``)
and ``nvidia-smi`` are not users. Pure standard library (Python 3.8+), Linux ``/proc``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Pattern, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import RUN_MARKER
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import read_stat

GPU_DEVICE = re.compile(r"^/dev/nvidia(?P<index>[0-9]+)$")
NOT_USERS = frozenset({"nvidia-persistenced", "nv-hostengine", "nvidia-smi", "dcgm-exporter"})
MAX_ENVIRON_BYTES = 1024 * 1024
MAX_CMDLINE_CHARS = 200
MAX_ANCESTORS = 64


def _devices(proc: str, pid: str, pattern: Pattern[str]) -> List[int]:
    """The GPU indexes ``pid`` holds open; PermissionError when its descriptors cannot be read."""
    fd_dir = os.path.join(proc, pid, "fd")
    held = set()
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # closed while we looked
            continue
        match = pattern.match(target)
        if match:
            held.add(int(match["index"]))
    return sorted(held)


def _marker(proc: str, pid: int) -> Optional[str]:
    """The run directory named by ``pid``'s ``RGT_RUN_DIR``, or None (none, or unreadable)."""
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as handle:
            data = b"\0" + handle.read(MAX_ENVIRON_BYTES) + b"\0"
    except OSError:
        return None
    prefix = f"\0{RUN_MARKER}=".encode()
    start = data.find(prefix)
    if start < 0:
        return None
    return data[start + len(prefix) : data.index(b"\0", start + len(prefix))].decode("utf-8", "replace") or None


def _run_of(proc: str, pid: int) -> Optional[str]:
    """The run directory of ``pid`` or of its nearest ancestor carrying the marker (a worker started with
    ``env -i`` lost it, its runner did not)."""
    seen = 0
    while pid > 1 and seen < MAX_ANCESTORS:
        marker = _marker(proc, pid)
        if marker:
            return os.path.normpath(marker)
        stat = read_stat(pid, proc)
        if stat is None:
            return None
        pid, seen = stat.ppid, seen + 1
    return None


def _cmdline(proc: str, pid: str) -> str:
    try:
        with open(os.path.join(proc, pid, "cmdline"), "rb") as handle:
            raw = handle.read(4096)
    except OSError:
        return ""
    text = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
    return "".join(ch if ch.isprintable() else "?" for ch in text)[:MAX_CMDLINE_CHARS]


def gpu_users(proc: str = "/proc", pattern: Pattern[str] = GPU_DEVICE) -> Tuple[List[Dict[str, Any]], int]:
    """Each GPU user ``{pid, name, command, gpus, run_dir}`` (``run_dir`` None: no run's), sorted by pid, and how
    many processes' descriptors could not be read (another user's: they may use a GPU unseen)."""
    own = {os.getpid(), os.getppid()}
    users: List[Dict[str, Any]] = []
    unreadable = 0
    try:
        names = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return [], 0
    for name in names:
        pid = int(name)
        if pid in own:
            continue
        try:
            gpus = _devices(proc, name, pattern)
        except PermissionError:
            unreadable += 1
            continue
        except OSError:  # gone
            continue
        if not gpus:
            continue
        stat = read_stat(pid, proc)
        if stat is None or stat.state == "Z" or stat.comm in NOT_USERS:
            continue
        users.append(
            {
                "pid": pid,
                "name": stat.comm,
                "command": _cmdline(proc, name),
                "gpus": gpus,
                "run_dir": _run_of(proc, pid),
            }
        )
    return sorted(users, key=lambda user: user["pid"]), unreadable


def outside_runs(users: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The users that belong to no run: the renter's own GPU jobs."""
    return [user for user in users if user["run_dir"] is None]


def named(users: List[Dict[str, Any]], limit: int = 3) -> str:
    """``pid 4242 python3 (GPU 0), pid 4300 ...`` for a refusal or a line; bounded."""
    parts = [f"pid {u['pid']} {u['name']} (GPU {', '.join(str(g) for g in u['gpus'])})" for u in users[:limit]]
    more = f" and {len(users) - limit} more" if len(users) > limit else ""
    return ", ".join(parts) + more
