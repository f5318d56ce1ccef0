"""The timeline clock shared by the fake NVML library and the fake nvidia-smi.

A scenario's ``after_s`` counts from the first NVML or nvidia-smi call of the *calling* process. The C
library keys its clock file on its own process; nvidia-smi runs as a child, so it keys on its parent.
Both write ``$FAKEGPU_STATE_DIR/clock-<pid>-<start ticks>`` (start ticks: field 22 of /proc/<pid>/stat,
so a recycled pid gets a fresh clock) holding the wall-clock time of that first call.
"""

from __future__ import annotations

import os
import time


def state_dir() -> str:
    return os.environ.get("FAKEGPU_STATE_DIR") or f"/tmp/fakegpu-{os.getuid()}"


def start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot, 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return 0
    fields_after_name = text[text.rfind(")") + 2 :].split()
    # fields_after_name[0] is field 3 (state); the start time is field 22
    return int(fields_after_name[19]) if len(fields_after_name) > 19 else 0


def _read(path: str) -> float:
    try:
        with open(path, encoding="utf-8") as handle:
            return float(handle.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0


def clock_zero(pid: int) -> float:
    """Wall-clock time of process ``pid``'s first simulated-GPU call, recorded now if this is that call."""
    directory = state_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"clock-{pid}-{start_ticks(pid)}")
    existing = _read(path)
    if existing > 0:
        return existing
    now = time.time()
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(f"{now:.6f}\n")
    try:
        os.link(temp, path)  # exclusive: the first caller's zero wins
    except FileExistsError:
        now = _read(path) or now
    finally:
        os.unlink(temp)
    return now


def elapsed_for(pid: int) -> float:
    """Seconds since process ``pid``'s first simulated-GPU call (0 on that call)."""
    return max(0.0, time.time() - clock_zero(pid))
