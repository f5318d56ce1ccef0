# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read the box for vram_zombies: the process table with NVIDIA device holders, and reaping.

The scan is cheap because most processes hold no device. Every process costs one listing of ``/proc/<pid>/fd``
(a ``readlink`` per descriptor) and one read of ``/proc/<pid>/stat``: its place in the tree (parent, process
group, session), liveness and start time. Only holders get their full identity (command line, owner, long
name); other processes' command lines are read only where a decision can name them (``with_commands``). Every
field is read the way psutil reads it (start time, command line splitting, name), so the identity seen here
matches the one psutil checks before signalling. Device holders come from ``/proc/<pid>/fd`` because
psutil's ``open_files()`` lists regular files only, and real ``/dev/nvidia*`` nodes are character devices.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
import traceback
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Pattern, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc, same_process

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
_GONE = (FileNotFoundError, ProcessLookupError)  # the process exited while we looked


class _Stat(NamedTuple):
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    flags: int
    start_ticks: int  # clock ticks after boot


def _stat_fields(pid: int) -> _Stat:
    """``/proc/<pid>/stat``, one read; the command name may hold spaces and ')', so split after the last ')'."""
    handle = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    try:
        data = os.read(handle, 4096)
    finally:
        os.close(handle)
    close = data.rindex(b")")
    rest = data[close + 2 :].split(b" ", 20)  # up to starttime, the 22nd field
    comm = data[data.index(b"(") + 1 : close].decode("utf-8", errors="replace")
    return _Stat(comm, rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[6]), int(rest[19]))


def _held_devices(pid: int, pattern: Pattern[str]) -> Tuple[str, ...]:
    """The device nodes ``pid`` holds open. Raises FileNotFoundError / ProcessLookupError when it is gone and
    PermissionError when its descriptors cannot be read."""
    fd_dir = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        held = set()
        with os.scandir(fd_dir) as entries:
            for entry in entries:
                try:  # relative to the open directory: no path walk per descriptor
                    target = os.readlink(entry.name, dir_fd=fd_dir)
                except OSError:  # the descriptor closed while we looked
                    continue
                if pattern.match(target):
                    held.add(target)
        return tuple(sorted(held))
    finally:
        os.close(fd_dir)


def _real_uid(pid: int) -> int:
    """The real uid, as psutil's ``uids().real``."""
    with open(f"/proc/{pid}/status", "rb") as handle:
        for line in handle:
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    raise PermissionError(f"/proc/{pid}/status has no Uid line")  # counted as unreadable, like a hidden process


def _long_name(comm: str, cmdline: Tuple[str, ...]) -> str:
    """psutil's name(): the kernel truncates comm to 15 characters, so extend it from argv[0] when that fits."""
    if len(comm) >= 15 and cmdline:
        extended = os.path.basename(cmdline[0])
        if extended.startswith(comm):
            return extended
    return comm


def _proc_of(pid: int, devices: Tuple[str, ...], boot_time: float, ticks: int) -> Proc:
    """One stat read for every process; the full identity (command line, owner, long name) for holders only.

    Others keep an empty command line (``with_commands`` reads it where a decision can name them) and no owner
    (None): only holders are judged. The start time is psutil's formula, so both agree to the last bit.
    """
    stat = _stat_fields(pid)
    cmdline: Tuple[str, ...] = ()
    uid: Optional[int] = None
    if devices:
        cmdline, uid = read_cmdline(pid), _real_uid(pid)
    return Proc(
        pid=pid,
        ppid=stat.ppid,
        pgid=stat.pgid,
        sid=stat.sid,
        uid=uid,
        name=_long_name(stat.comm, cmdline),
        cmdline=cmdline,
        create_time=stat.start_ticks / ticks + boot_time,
        kernel_thread=bool(stat.flags & PF_KTHREAD),
        defunct=stat.state == "Z",
        devices=devices,
    )


def _pids() -> List[int]:
    with os.scandir("/proc") as entries:
        return [int(entry.name) for entry in entries if entry.name.isdigit()]


def read_process_table(device_pattern: Optional[Pattern[str]] = None) -> Tuple[Dict[int, Proc], Dict[str, int]]:
    """Every process of this PID namespace with the NVIDIA device nodes it holds, and scan statistics.

    Processes that exit during the scan are skipped (``vanished``); processes whose descriptors cannot be read
    are kept (without devices) and counted in ``fd_unreadable``, as are processes whose stat cannot be read
    (skipped). Holders carry their full identity; the others an empty command line (see ``with_commands``).
    No file of a process is read twice.
    """
    pattern = device_pattern or DEVICE_PATTERN
    boot_time, ticks = psutil.boot_time(), os.sysconf("SC_CLK_TCK")
    table: Dict[int, Proc] = {}
    stats = {"processes": 0, "vanished": 0, "fd_unreadable": 0}
    for pid in _pids():
        unreadable = False
        try:
            devices = _held_devices(pid, pattern)
        except PermissionError:
            devices, unreadable = (), True
        except _GONE:
            stats["vanished"] += 1
            continue
        try:
            table[pid] = _proc_of(pid, devices, boot_time, ticks)
            stats["processes"] += 1
        except _GONE:
            stats["vanished"] += 1
        except PermissionError:
            unreadable = True
        stats["fd_unreadable"] += unreadable
    return table, stats


def read_cmdline(pid: int) -> Tuple[str, ...]:
    """``/proc/<pid>/cmdline`` split as psutil splits it (a process that rewrote its title may use spaces)."""
    with open(f"/proc/{pid}/cmdline", encoding="utf-8", errors="surrogateescape") as handle:
        data = handle.read()
    if not data:
        return ()
    sep = "\x00" if data.endswith("\x00") else " "
    data = data[:-1] if data.endswith(sep) else data
    parts = data.split(sep)
    if sep == "\x00" and len(parts) == 1 and " " in data:
        parts = data.split(" ")
    return tuple(parts)


def with_commands(table: Dict[int, Proc], pids: Iterable[int]) -> Dict[int, Proc]:
    """``table`` with the command lines of ``pids`` read (those without one yet); a vanished process keeps ()."""
    for pid in pids:
        proc = table.get(pid)
        if proc is None or proc.cmdline or proc.kernel_thread:
            continue
        try:
            cmdline = read_cmdline(pid)
            table[pid] = dataclasses.replace(proc, cmdline=cmdline, name=_long_name(proc.name, cmdline))
        except OSError:  # gone or unreadable: its command stays unknown
            continue
    return table


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
