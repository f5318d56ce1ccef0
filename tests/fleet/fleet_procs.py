"""Finding and ending what a simulated fleet left on this machine: host processes, ssh masters, memory cgroups.

Every host process carries ``RGT_FLEET=<state dir>`` in its environment, so a fleet can be cleaned up from its
marker alone, even when an interrupted ``up`` never wrote ``fleet.json``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

MARKER = "RGT_FLEET"
# Every ControlPath directory the fleet hands to ssh contains this, so `down --all` can find stray masters.
CONTROL_DIR_TAG = "rgt-fleet-cp"
CGROUP_PREFIX = "rgt-fleet-"
SSHD_CONFIG = "rgt-fleet-sshd_config"
MEMORY_ROOT = Path("/sys/fs/cgroup/memory")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:  # the process is gone, or is a kernel thread without an environment
        return b""


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def marker_of(pid: int) -> str | None:
    """The fleet state dir a process belongs to, or None.

    unshare and host_init.sh carry it in their environment; sshd overwrites its environment with its process
    title, but its title names its config file, ``<state dir>/hosts/<name>/rgt-fleet-sshd_config``.
    """
    prefix = f"{MARKER}=".encode()
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    for word in _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").split():
        if word.endswith(f"/{SSHD_CONFIG}") and "/hosts/" in word:
            return word.rsplit("/hosts/", 1)[0]
    return None


def marked_processes(state_dir: str | None = None) -> dict[int, str]:
    """pid -> state dir of every live fleet process; only those of ``state_dir`` when given."""
    found = {}
    for pid in _pids():
        marker = marker_of(pid)
        if marker is not None and (state_dir is None or marker == state_dir):
            found[pid] = marker
    return found


def is_namespace_init(pid: int) -> bool:
    """True for PID 1 of a nested PID namespace (killing it ends every process of that namespace)."""
    for line in _read(f"/proc/{pid}/status").decode(errors="replace").splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) > 1 and ids[-1] == "1"
    return False


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found.extend(int(child) for child in _read(str(task)).split())
    return found


def ssh_clients(needle: str) -> list[int]:
    """ssh processes (clients and ControlPersist masters) whose command line mentions ``needle``."""
    found = []
    for pid in _pids():
        argv = _read(f"/proc/{pid}/cmdline").split(b"\0")
        program = os.path.basename(argv[0].decode(errors="replace").split(":")[0])
        if program == "ssh" and needle.encode() in b" ".join(argv):
            found.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose: it holds no namespace, mount or port.
    return b") Z " not in _read(f"/proc/{pid}/stat")


def kill_and_wait(pids: list[int], sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> list[int]:
    """Signal ``pids`` and wait until they are gone; return those still alive at the deadline."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if _alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if _alive(pid)]
    return left


def kill_fleet_processes(state_dir: str | None, timeout_s: float = 10.0) -> list[int]:
    """Kill every marked process of one fleet (or of all fleets); namespace inits first. Return survivors."""
    marked = marked_processes(state_dir)
    inits = [pid for pid in marked if is_namespace_init(pid)]
    survivors = kill_and_wait(inits, timeout_s=timeout_s)
    rest = [pid for pid in marked_processes(state_dir) if pid not in inits]
    return survivors + kill_and_wait(rest, timeout_s=timeout_s)


def stop_ssh_clients(needle: str, timeout_s: float = 5.0) -> list[int]:
    """End ssh masters/clients that use a fleet's control directory; return survivors."""
    pids = ssh_clients(needle)
    left = kill_and_wait(pids, signal.SIGTERM, timeout_s)
    return kill_and_wait(left, signal.SIGKILL, timeout_s)


def own_memory_cgroup() -> Path | None:
    """This process's cgroup-v1 memory cgroup directory, when the hierarchy is mounted and writable."""
    for line in _read("/proc/self/cgroup").decode().splitlines():
        _hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = MEMORY_ROOT / path.lstrip("/")
            return directory if os.access(directory, os.W_OK) else None
    return None


def remove_cgroup_tree(directory: Path, timeout_s: float = 5.0) -> bool:
    """rmdir a cgroup and its children, deepest first (the kernel frees a cgroup shortly after its last task)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for child in sorted(directory.glob("**/"), key=lambda path: len(path.parts), reverse=True):
                child.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def fleet_cgroups(fleet_id: str = "*") -> list[Path]:
    """Cgroups of one fleet (or of all) anywhere in the memory hierarchy (they are at most a few levels deep)."""
    if not MEMORY_ROOT.is_dir():
        return []
    found = []
    for depth in range(1, 5):
        pattern = "/".join(["*"] * (depth - 1) + [f"{CGROUP_PREFIX}{fleet_id}"])
        found.extend(path for path in MEMORY_ROOT.glob(pattern) if path.is_dir())
    return found
