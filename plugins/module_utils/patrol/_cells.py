# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Per-cell truth for ``patrol_facts``: which cells live, each cell's state, progress and ETA, a run's ETA.

Cells fail and hang one at a time, so each is judged on its own evidence: its own log's growth (timed by the
tick's clock), its own GPUs in ``monitor.jsonl`` (``run.json``'s ``cells[].gpus``), whether a process of it lives
(its environment carries the runner's ``RGT_RUN_DIR`` and ``RGT_CELL``). The run's ETA schedules what is left on
the run's slots. The readers run in the runs probe's child; :func:`judge_cell` and :func:`run_eta` are pure.
"""

from __future__ import annotations

import heapq
import math
import os
import re
from datetime import datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

CELL_STATES = ("pending", "running", "stalled", "failed", "crashed", "done", "sync_failed")
MAX_ENVIRON_BYTES = 256 * 1024
HEAD_BYTES = 512
# The runner's first line in a cell log: "[rgt 2026-12-03T10:00:00Z] attempt 1/3 starting on GPUs 0,1".
ATTEMPT_LINE = re.compile(rb"^\[rgt (\S+)\] attempt \d+/\d+ starting")
NO_SPACE = re.compile(r"No space left on device|ENOSPC|Errno 28|Disk quota exceeded", re.I)
_ENV_KEYS = (b"RGT_RUN_DIR", b"RGT_CELL", b"RGT_ATTEMPT")


def finite(value: Any) -> Optional[float]:
    """A finite number, or None: the box's files are untrusted (NaN, inf, strings, booleans)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)  # an int of 400 digits is valid JSON, and too large for a float
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def live_cells(run_dirs: Iterable[str], proc: str = "/proc") -> Dict[str, Dict[str, int]]:
    """``run_dir -> {cell: attempt}`` for every live process started by a runner for one of ``run_dirs``.

    One pass over the process table for the whole tick. A cell's processes carry ``RGT_RUN_DIR`` and ``RGT_CELL``
    (and ``RGT_ATTEMPT``) whoever their parent is now, so a cell outliving its runner is still found; a zombie's
    environment reads empty, so it is not.
    """
    wanted = {os.path.normpath(path) for path in run_dirs}
    found: Dict[str, Dict[str, int]] = {}
    own = os.getpid()
    try:
        names = os.listdir(proc)
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(f"{proc}/{name}/environ", "rb") as handle:
                raw = handle.read(MAX_ENVIRON_BYTES)
        except OSError:
            continue  # gone, or another user's
        if b"RGT_CELL=" not in raw:
            continue
        env = dict(entry.partition(b"=")[::2] for entry in raw.split(b"\0") if entry.partition(b"=")[0] in _ENV_KEYS)
        run_dir, cell = env.get(b"RGT_RUN_DIR"), env.get(b"RGT_CELL")
        if run_dir and os.path.normpath(os.fsdecode(run_dir)) in wanted and cell:
            attempt = int(env[b"RGT_ATTEMPT"]) if env.get(b"RGT_ATTEMPT", b"").isdigit() else 1
            cells = found.setdefault(os.path.normpath(os.fsdecode(run_dir)), {})
            cells[os.fsdecode(cell)] = max(attempt, cells.get(os.fsdecode(cell), 0))
    return found


def parse_utc(value: Any) -> Optional[float]:
    """An ISO 8601 time as epoch seconds, or None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def log_started(path: str) -> Optional[float]:
    """When the runner started the cell's first attempt, from the log's first line (a bounded read), or None."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(HEAD_BYTES)
    except OSError:
        return None
    match = ATTEMPT_LINE.match(head)
    return parse_utc(match.group(1).decode("ascii", errors="replace")) if match else None


def fraction(progress: Optional[Mapping[str, Any]]) -> Optional[float]:
    """How far a cell is, 0..1, from its last epoch / step marker; None without totals."""
    if not progress:
        return None
    epoch, epochs = progress.get("epoch"), progress.get("epochs_total")
    step, steps = progress.get("step"), progress.get("steps_total")
    if epochs and epoch is not None:
        within = step / steps if steps and step is not None else 0.0
        done = (max(epoch - 1, 0) + min(within, 1.0)) / epochs
    elif epoch is None and steps and step is not None:  # a step within an epoch of unknown count says nothing
        done = step / steps
    else:
        return None
    return round(min(max(done, 0.0), 1.0), 4)


def _readings(sample: Mapping[str, Any], gpus: Optional[Sequence[int]]) -> List[float]:
    """The sample's utilization readings of ``gpus`` (every GPU when None); unread GPUs give none."""
    found = []
    gpus_read = sample.get("gpus") if isinstance(sample.get("gpus"), list) else []
    for position, gpu in enumerate(gpus_read):
        index = gpu.get("index") if isinstance(gpu, dict) and gpu.get("index") is not None else position
        util = finite(gpu.get("util_pct")) if isinstance(gpu, dict) else None
        if (gpus is None or index in gpus) and util is not None:
            found.append(util)
    return found


def gpus_busy(samples: Sequence[Mapping[str, Any]], gpus: Optional[Sequence[int]], idle_pct: float) -> bool:
    """Whether the newest sample that read ``gpus`` saw one of them above ``idle_pct`` utilization."""
    for sample in reversed(samples):
        readings = _readings(sample, gpus)
        if readings:
            return max(readings) > idle_pct
    return False


def gpus_idle(
    samples: Sequence[Mapping[str, Any]], gpus: Optional[Sequence[int]], idle_pct: float, needed: int
) -> bool:
    """Whether the newest ``needed`` samples all saw every one of ``gpus`` at or below ``idle_pct``.

    A sample without a reading of them does not count either way; fewer than ``needed`` readings is no evidence.
    """
    if needed <= 0:
        return False
    readings = [r for r in (_readings(s, gpus) for s in samples) if r][-needed:]
    return len(readings) == needed and all(max(r) <= idle_pct for r in readings)


def exception_line(cell: Mapping[str, Any], crash_names: Sequence[str]) -> Optional[str]:
    """The line that says why the cell failed: its traceback's exception line, else its first crash signature's."""
    found = {s.get("signature"): s for s in cell.get("crash_signatures") or []}
    for name in ("python_traceback", *crash_names):
        if name in found and found[name].get("first_line"):
            return str(found[name]["first_line"])
    return None


def judge_cell(
    cell: Dict[str, Any], run: Mapping[str, Any], options: Mapping[str, Any], crash_names: Sequence[str]
) -> None:
    """Set the cell's ``state``, ``silent_gpus_busy``, ``stall_reason``, ``progress_fraction``, ``eta_s``,
    ``exception``, ``nan_seen`` and ``retries_left`` from what the runs probe read (see the module's RETURN)."""
    name, status = cell["name"], cell.get("status")
    gpus = cell.get("gpus") if cell.get("gpus") is not None else run.get("gpus") or None
    samples = run.get("monitor_samples") or []
    cell.update(silent_gpus_busy=False, stall_reason=None, eta_s=None)
    cell["nan_seen"] = any(s.get("signature") == "nan_loss" for s in cell.get("crash_signatures") or [])
    cell["exception"] = exception_line(cell, crash_names) if status != "succeeded" else None
    if status == "failed" and str(cell.get("reason") or "").startswith("stopped by "):
        cell["exception"] = str(cell["reason"])[:200]  # stopped on purpose (teardown): the runner's reason says so
    allowed, used = 1 + (cell.get("retries") or 0), cell.get("attempts") or 0
    cell["retries_left"] = max(0, allowed - used) if status == "failed" else max(0, allowed - max(used, 1))
    if status == "succeeded":
        cell["state"] = "done" if cell.get("done") else "sync_failed"
    elif status == "failed":
        cell["state"] = "failed"
    elif cell.get("alive") or (run.get("runner_alive") and status == "running"):
        cell["state"] = "running"
        idle_s, stall_after = finite(cell.get("log_idle_s")), options["stall_after_s"]
        one = gpus is not None and len(gpus) == 1
        where = f"GPU{'' if one else 's'} {_gpu_list(gpus)}"
        are = "is" if one else "are"
        log_gone = cell.get("lost") is not None and not cell.get("log_exists")
        if idle_s is not None and idle_s >= stall_after and not log_gone:
            if gpus_busy(samples, gpus, options["gpu_idle_pct"]):
                cell["silent_gpus_busy"] = True  # a framework that logs only at epoch ends: not a hang
            else:
                cell["state"] = "stalled"
                cell["stall_reason"] = (
                    f"{name}: its log has not grown for {idle_s:.0f} s (stall_after_s {stall_after:g}) and its "
                    f"{where} {are} not busy"
                )
        elif gpus_idle(samples, gpus, options["gpu_idle_pct"], options["gpu_idle_samples"]):
            cell["state"] = "stalled"
            cell["stall_reason"] = (
                f"{name}: its {where} at or below {options['gpu_idle_pct']:g}% utilization over the last "
                f"{options['gpu_idle_samples']} monitor samples"
            )
    elif not run.get("runner_alive") and cell.get("started"):
        cell["state"] = "crashed"  # started, no result, nothing of it alive: it died with its runner
    else:
        cell["state"] = "pending"
    live = cell["state"] in ("running", "stalled")
    cell["progress_fraction"] = fraction(cell.get("progress")) if cell["state"] != "failed" else None
    done, elapsed = cell["progress_fraction"], cell.get("elapsed_s")
    if cell["state"] == "running" and done and elapsed:
        cell["eta_s"] = int(elapsed * (1.0 - done) / done)
    if not live and cell["state"] != "done":
        cell["progress_fraction"] = None  # never the last line of a cell that is not running now


def _gpu_list(gpus: Optional[Sequence[int]]) -> str:
    return ",".join(str(g) for g in gpus) if gpus else "(all)"


def run_eta(cells: Sequence[Mapping[str, Any]], slots: int, runner_alive: bool) -> Optional[int]:
    """Seconds until the run's cells are all through: the running ones finish at their own ETAs and the pending
    ones start on the slots as they free, each taking an average cell's time. None when a cell is stalled, a
    running cell has no ETA, or nothing tells how long a pending cell takes."""
    if any(c.get("state") == "stalled" for c in cells):
        return None
    running = [c for c in cells if c.get("state") == "running"]
    pending = [c for c in cells if c.get("state") == "pending"] if runner_alive else []
    if (not running and not pending) or any(c.get("eta_s") is None for c in running):
        return None
    durations = [c["duration_s"] for c in cells if c.get("state") == "done" and c.get("duration_s")]
    durations += [c["elapsed_s"] / c["progress_fraction"] for c in running if c.get("progress_fraction")]
    if pending and not durations:
        return None
    each = sum(durations) / len(durations) if durations else 0.0
    free: List[float] = [float(c["eta_s"]) for c in running] + [0.0] * max(0, max(slots, 1) - len(running))
    heapq.heapify(free)
    for _cell in pending:
        heapq.heappush(free, heapq.heappop(free) + each)
    return int(max(free)) if free else None


def short_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def run_summary(run: Mapping[str, Any]) -> str:
    """One compact line: 'alpha: 2/4 done, 1 running 37%, 1 stalled (c), ETA 12m'."""
    cells = run.get("cells") or []
    parts = [f"{run['run']}: {run.get('state')}, {run.get('cells_done', 0)}/{len(cells)} done"]
    running = [c for c in cells if c.get("state") == "running"]
    if running:
        shown = [f"{c['progress_fraction'] * 100:.0f}%" for c in running if c.get("progress_fraction") is not None]
        parts.append(f"{len(running)} running" + (f" {'/'.join(shown[:4])}" if shown else ""))
    for state in ("stalled", "failed", "crashed", "sync_failed", "pending"):
        named = [c["name"] for c in cells if c.get("state") == state]
        if named:
            listed = f" ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''})" if state != "pending" else ""
            parts.append(f"{len(named)} {state.replace('_', ' ')}{listed}")
    flagged: List[Tuple[str, str]] = [("NaN", c["name"]) for c in cells if c.get("nan_seen")]
    flagged += [("log lost", c["name"]) for c in cells if c.get("lost")]
    parts += [f"{what} ({cell})" for what, cell in flagged[:3]]
    if run.get("eta_s") is not None:
        parts.append(f"ETA {short_duration(run['eta_s'])}")
    return ", ".join(parts)


def no_space(text: Optional[str]) -> bool:
    return bool(text and NO_SPACE.search(text))
