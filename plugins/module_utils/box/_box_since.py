# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Since when a box has been billing, as the box itself can tell: what every stage's cost is counted from.

The earliest ``started_at`` among the runs on the box (their ``run.json``), but never before the container's own
start (PID 1's): a box stopped (by autostop, say) and started again keeps its runs' files, and was not billed for
the hours it was stopped. Without runs, the container's start. data_dir is read in a child under a deadline (a hung
mount leaves no runs, so the container's start), and a start before 2000 or more than a day ahead (a broken clock,
a hand-edited run.json) is no start at all. Pure standard library, Linux ``/proc``.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from typing import Optional, Sequence

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run, read_run_registry
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import CLOCK_TICKS, read_stat

START_TIMEOUT_S = 10.0  # for the run registry on data_dir
# A start outside these bounds is garbage, never a cost basis.
EARLIEST_START = 946684800.0  # 2000-01-01
FUTURE_SLACK_S = 86400.0
MAX_STAT_BYTES = 1024 * 1024


def iso_utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def plausible_start(seconds: Optional[float]) -> Optional[float]:
    """``seconds`` (since the epoch) when it can be a start: finite, not before 2000, at most a day ahead."""
    if seconds is None or not math.isfinite(seconds):
        return None
    return seconds if EARLIEST_START <= seconds <= time.time() + FUTURE_SLACK_S else None


def _boot_time(proc: str) -> Optional[int]:
    try:
        with open(f"{proc}/stat", "rb") as handle:
            lines = handle.read(MAX_STAT_BYTES).splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields[:1] == [b"btime"]:
            return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else None
    return None


def container_started_at(proc: str = "/proc") -> Optional[float]:
    """PID 1's start (epoch seconds): the container's in a container, the machine's boot otherwise; None unreadable.

    In a PID namespace, PID 1's start ticks still count from the host's boot, which /proc/stat's btime gives."""
    stat, boot = read_stat(1, proc), _boot_time(proc)
    if stat is None or boot is None or stat.start_ticks < 0:
        return None
    return plausible_start(boot + stat.start_ticks / CLOCK_TICKS)


def box_started_at(data_dir: str, runs: Optional[Sequence[Run]] = None, proc: str = "/proc") -> Optional[str]:
    """ISO 8601 UTC (``...Z``): the runs' earliest start, not before the container's; None when neither is known.

    ``runs``: the registered runs when the caller has read them already; else they are read from ``data_dir``."""
    if runs is None:  # an unreadable run.json only leaves that run out; a hung data_dir, every run
        runs, _problems = read_run_registry(data_dir, START_TIMEOUT_S)
    starts = [start for start in (plausible_start(run.started_at) for run in runs) if start is not None]
    container = container_started_at(proc)
    candidates = [value for value in (min(starts) if starts else None, container) if value is not None]
    return iso_utc(max(candidates)) if candidates else None
