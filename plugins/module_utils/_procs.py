# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read the box for vram_zombies: the process table with NVIDIA device holders, and reaping.

psutil gives identity (create time, command line, owner) and PID-reuse-safe signalling; the device
holders come from ``/proc/<pid>/fd`` directly because psutil's ``open_files()`` lists regular files
only, and real ``/dev/nvidia*`` nodes are character devices.
"""

from __future__ import annotations

import os
import re
import signal
import time
import traceback
from typing import Any, Dict, List, Optional, Pattern, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils._proctree import Proc, same_process

try:
    import psutil
except ImportError:  # the module reports missing_required_lib('psutil')
    psutil = None
    PSUTIL_IMPORT_ERROR: Optional[str] = traceback.format_exc()
else:
    PSUTIL_IMPORT_ERROR = None

# /dev/nvidia0..N, /dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidia-uvm-tools. Tests swap in their own pattern.
DEVICE_PATTERN = re.compile(r"^/dev/nvidia(?:[0-9]+|ctl|-uvm.*)$")
PF_KTHREAD = 0x00200000
KILL_WAIT_S = 5.0
POLL_S = 0.1


def _stat_fields(pid: int) -> Tuple[int, int, int]:
    """(pgid, sid, flags) from /proc/<pid>/stat; the command name may hold spaces, so split after its ')'."""
    with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
        rest = handle.read().rsplit(")", 1)[1].split()
    return int(rest[2]), int(rest[3]), int(rest[6])


def _held_devices(pid: int, pattern: Pattern[str]) -> Tuple[str, ...]:
    held = set()
    fd_dir = f"/proc/{pid}/fd"
    for entry in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, entry))
        except OSError:  # the descriptor closed while we looked
            continue
        if pattern.match(target):
            held.add(target)
    return tuple(sorted(held))


def read_process_table(device_pattern: Optional[Pattern[str]] = None) -> Tuple[Dict[int, Proc], Dict[str, int]]:
    """Every process of this PID namespace with the NVIDIA device nodes it holds, and scan statistics.

    Processes that exit during the scan are skipped; processes whose descriptors cannot be read are
    kept (without devices) and counted in ``fd_unreadable``.
    """
    pattern = device_pattern or DEVICE_PATTERN
    table: Dict[int, Proc] = {}
    stats = {"processes": 0, "vanished": 0, "fd_unreadable": 0}
    for handle in psutil.process_iter():
        try:
            with handle.oneshot():
                pid = handle.pid
                pgid, sid, flags = _stat_fields(pid)
                info = {
                    "ppid": handle.ppid(),
                    "name": handle.name(),
                    "cmdline": tuple(handle.cmdline()),
                    "create_time": handle.create_time(),
                    "uid": handle.uids().real,
                    "defunct": handle.status() == psutil.STATUS_ZOMBIE,
                }
            try:
                devices = _held_devices(pid, pattern)
            except PermissionError:
                devices = ()
                stats["fd_unreadable"] += 1
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            stats["vanished"] += 1
            continue
        except (psutil.AccessDenied, PermissionError):
            stats["fd_unreadable"] += 1
            continue
        table[pid] = Proc(pid=pid, pgid=pgid, sid=sid, kernel_thread=bool(flags & PF_KTHREAD), devices=devices, **info)
        stats["processes"] += 1
    return table, stats


def _same_process(proc: Proc) -> Any:
    """A psutil handle on ``proc`` if that PID still is the same process, else None."""
    handle = psutil.Process(proc.pid)
    return handle if same_process(proc, handle.create_time(), handle.cmdline()) else None


def _gone(handle: Any) -> bool:
    try:
        return handle.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pending: List[Tuple[Proc, Any]], timeout_s: float) -> List[Tuple[Proc, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [(proc, handle) for proc, handle in pending if not _gone(handle)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(POLL_S)


def reap(victims: Sequence[Proc], grace_s: float) -> Dict[str, List[Dict[str, Any]]]:
    """SIGTERM each victim whose identity still matches, wait ``grace_s``, SIGKILL the survivors.

    Returns ``killed`` (gone, with the last signal sent), ``failed`` (could not be signalled or
    survived SIGKILL) and ``skipped`` (already gone, or the PID now belongs to another process).
    """
    result: Dict[str, List[Dict[str, Any]]] = {"killed": [], "failed": [], "skipped": []}
    signalled: List[Tuple[Proc, Any]] = []
    for proc in victims:
        entry = {"pid": proc.pid, "name": proc.name}
        try:
            handle = _same_process(proc)
            if handle is None:
                result["skipped"].append(dict(entry, why="PID now belongs to another process: not signalled"))
                continue
            handle.send_signal(signal.SIGTERM)
            signalled.append((proc, handle))
        except psutil.NoSuchProcess:
            result["skipped"].append(dict(entry, why="already gone"))
        except psutil.AccessDenied as exc:
            result["failed"].append(dict(entry, error=f"SIGTERM refused: {exc}"))
    survivors = _wait_gone(signalled, grace_s)
    for proc, handle in signalled:
        if (proc, handle) not in survivors:
            result["killed"].append({"pid": proc.pid, "name": proc.name, "signal": "SIGTERM"})
    killed_hard = []
    for proc, handle in survivors:
        try:
            handle.send_signal(signal.SIGKILL)  # psutil refuses if the PID was reused meanwhile
            killed_hard.append((proc, handle))
        except psutil.NoSuchProcess:
            result["killed"].append({"pid": proc.pid, "name": proc.name, "signal": "SIGTERM"})
        except psutil.AccessDenied as exc:
            result["failed"].append({"pid": proc.pid, "name": proc.name, "error": f"SIGKILL refused: {exc}"})
    stubborn = _wait_gone(killed_hard, KILL_WAIT_S)
    for proc, handle in killed_hard:
        if (proc, handle) in stubborn:
            result["failed"].append({"pid": proc.pid, "name": proc.name, "error": "alive after SIGKILL"})
        else:
            result["killed"].append({"pid": proc.pid, "name": proc.name, "signal": "SIGKILL"})
    return result
