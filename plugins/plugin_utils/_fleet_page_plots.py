# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet page's plots: a run's monitor series and a cell's loss series as SVG geometry (plain numbers and
short labels) for the page's template.

The series come from the box, so nothing about them is trusted: a list that is not one, a value that is no finite
number (a bool is none either) or a list longer than promised is cut down or dropped, never an error. A null or
dropped value breaks the line: each unbroken stretch is its own polyline, a lone sample a dot.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# The SVG's user space: the plot area sits inside the margins, the labels in them.
WIDTH, HEIGHT = 320, 140
LEFT, RIGHT, TOP, BOTTOM = 48, 8, 8, 20
MAX_POINTS = 300
MAX_GPUS = 16
# Before downsampling, a box's list is read at most this far: a hostile box cannot make the page slow.
MAX_READ = 4000
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
MIB = 1024 * 1024
# Epoch seconds a monitor sample can carry (1970..5138): beyond them there is no HH:MM to show.
MAX_EPOCH = 1e11


def num(value: Any) -> Optional[float]:
    """A finite float, or None (bools, strings, NaN, inf and ints too large for a float are none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        found = float(value)
    except OverflowError:
        return None
    return found if math.isfinite(found) else None


def values(items: Any) -> List[Optional[float]]:
    """A box's list as finite numbers or None, bounded; anything but a list is empty."""
    return [num(item) for item in items[:MAX_READ]] if isinstance(items, list) else []


def _spread(count: int, limit: int) -> List[int]:
    """At most ``limit`` indices spread evenly over ``range(count)``, the first and the last kept."""
    if count <= limit:
        return list(range(count))
    return sorted({round(step * (count - 1) / (limit - 1)) for step in range(limit)})


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%H:%M")


def _short(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"


def _mib(value: float) -> str:
    if value <= 0:
        return "0"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def _bytes(value: float) -> str:
    return _mib(value / MIB)


def _scale(low: float, high: float) -> Tuple[float, float]:
    """A non-empty span: a flat series is drawn in the middle."""
    return (low - 1, high + 1) if high <= low else (low, high)


def plot(
    kind: str,
    xs: Sequence[Optional[float]],
    lines: Sequence[Tuple[Optional[int], Sequence[Optional[float]]]],
    y_span: Tuple[float, float],
    labels: Tuple[Any, Any],
) -> Dict[str, Any]:
    """The plot of ``lines`` (``(gpu index or None, values aligned with xs)``) over ``xs``: ``points`` (the
    samples drawn), ``series`` (one per unbroken stretch: gpu, color, points), ``dots`` (lone samples) and the
    axes' labels. ``labels`` turn an x and a y value into text."""
    keep = _spread(len(xs), MAX_POINTS)
    found = [x for x in xs if x is not None]
    x_low, x_high = _scale(min(found), max(found)) if found else (0.0, 1.0)
    y_low, y_high = _scale(*y_span)
    x_text, y_text = labels
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    series: List[Dict[str, Any]] = []
    dots: List[Dict[str, Any]] = []
    drawn = 0
    for position, (gpu, ys) in enumerate(lines):
        color = PALETTE[position % len(PALETTE)]
        stretch: List[str] = []
        for index in [*keep, None]:  # the None closes the last stretch
            x = xs[index] if index is not None else None
            y = ys[index] if index is not None and index < len(ys) else None
            if x is not None and y is not None:
                px = LEFT + (x - x_low) / (x_high - x_low) * inner_w
                py = TOP + (1 - (min(max(y, y_low), y_high) - y_low) / (y_high - y_low)) * inner_h
                stretch.append(f"{px:.1f},{py:.1f}")
                continue
            if len(stretch) == 1:
                left, top = stretch[0].split(",")
                dots.append({"gpu": gpu, "color": color, "cx": left, "cy": top})
            elif stretch:
                series.append({"gpu": gpu, "color": color, "points": " ".join(stretch)})
            drawn += len(stretch)
            stretch = []
    return {
        "kind": kind,
        "points": drawn,
        "series": series,
        "dots": dots,
        "legend": [(gpu, PALETTE[n % len(PALETTE)]) for n, (gpu, _ys) in enumerate(lines) if gpu is not None],
        "view": f"0 0 {WIDTH} {HEIGHT}",
        "box": {"x": LEFT, "y": TOP, "w": inner_w, "h": inner_h, "bottom": HEIGHT - 4, "right": WIDTH - RIGHT},
        "x_min": x_text(x_low) if found else "",
        "x_max": x_text(x_high) if found else "",
        "y_min": y_text(y_low),
        "y_max": y_text(y_high),
    }


def _epochs(series: Mapping[str, Any]) -> List[Optional[float]]:
    return [t if t is not None and 0 <= t <= MAX_EPOCH else None for t in values(series.get("t"))]


def _gpus(series: Mapping[str, Any]) -> List[Tuple[int, Mapping[str, Any]]]:
    gpus = series.get("gpus") if isinstance(series.get("gpus"), list) else []
    found = []
    for position, gpu in enumerate(gpus[:MAX_GPUS]):
        if isinstance(gpu, Mapping):
            index = num(gpu.get("index"))
            found.append((int(index) if index is not None and 0 <= index < 1e6 else position, gpu))
    return found


def _peak(lines: Sequence[Tuple[Any, Sequence[Optional[float]]]], floor: float) -> float:
    return max([floor, *(y for _gpu, ys in lines for y in ys if y is not None)])


def monitor_plots(series: Any) -> List[Dict[str, Any]]:
    """The run's GPU utilization, GPU memory and container memory plots (empty ones when it has no series)."""
    series = series if isinstance(series, Mapping) else {}
    xs = _epochs(series)
    gpus = _gpus(series)
    util = [(index, [y if y is None or y >= 0 else None for y in values(gpu.get("util_pct"))]) for index, gpu in gpus]
    used = [
        (index, [y if y is None or y >= 0 else None for y in values(gpu.get("mem_used_mib"))]) for index, gpu in gpus
    ]
    totals = [num(gpu.get("mem_total_mib")) for _index, gpu in gpus]
    container = [y if y is None or y >= 0 else None for y in values(series.get("container_mem_bytes"))]
    limit = num(series.get("container_max_bytes"))
    pct = (_utc, lambda value: f"{value:.0f}%")
    return [
        plot("gpu-util", xs, util, (0.0, _peak(util, 100.0)), pct),
        plot("gpu-mem", xs, used, (0.0, _peak(used, max([1.0, *(t for t in totals if t and t > 0)]))), (_utc, _mib)),
        plot("container-mem", xs, [(None, container)], (0.0, _peak([(None, container)], limit or 1.0)), (_utc, _bytes)),
    ]


def loss_plot(series: Any) -> Dict[str, Any]:
    """A cell's loss curve over its steps (or log lines)."""
    series = series if isinstance(series, Mapping) else {}
    xs = values(series.get("x"))
    losses = values(series.get("loss"))
    pairs = [y for x, y in zip(xs, losses) if x is not None and y is not None]
    span = (min(pairs), max(pairs)) if pairs else (0.0, 1.0)
    return plot("loss", xs, [(None, losses)], span, (_short, _short))
