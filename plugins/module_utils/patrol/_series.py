# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run's curves that patrol carries back for the fleet page, each bounded whatever the files' sizes.

``monitor_series``: at most 120 samples of ``monitor.jsonl.1`` then ``monitor.jsonl``, spread evenly over their
bytes. Each point seeks to its offset and reads forward in small growing windows to the next complete line, so a
tick reads a few hundred KiB of a 1 GB monitor file as of a 1 MB one; a region with no line end (NUL bytes after a
crash) costs at most ``POINT_BYTES`` a point. Lines that are not a sample with a time are passed over (a few per
point); the points are sorted by time, as a stepped clock writes them out of order.

``LossSeries``: the training loss from the cell log, fed each tick's new bytes by the log scan and kept in its
cursor: every ``stride``-th loss line, the stride doubled (every other point dropped) when 200 are kept, so the
curve always spans the whole log in at most 200 points. Loss lines are found at C speed by one bytes regex; only
the kept ones (and each block's last) are parsed for their step. Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from datetime import datetime
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import finite

MONITOR_POINTS = 120
FIRST_READ = 4096
LINE_MAX = 64 * 1024
POINT_BYTES = 128 * 1024
TRIES = 4  # lines looked at past a point's offset before it is given up
MAX_GPUS = 32
LOSS_POINTS = 200
LOSS_STATE = 1
MAX_STEP = 2**53

# A train-loss key and its value: ``'loss': 0.51``, ``loss=0.123``, ``train_loss_step=0.1``, ``Loss: 1.2e-01``,
# ``lm loss: 7.28E+00``, ``"train/loss": nan``; not eval_loss, val/loss, "val loss", best_loss, loss_scale. Led by
# the literal ``oss`` so the engine skips to candidates at memory speed (a leading class or lookbehind makes it try
# every position: 30x slower); the ``L`` and the key's prefix are lookbehinds checked only there.
_KEY = "[Ll]oss"
_PREFIX_OK = "|".join(
    [rf"(?<![\w./-]{_KEY})", f"(?<=lm {_KEY})", f"(?<=LM {_KEY})", f"(?<=lm_{_KEY})"]
    + [f"(?<={word}{sep}{_KEY})" for word in ("train", "Train", "TRAIN", "training", "Training", "running", "avg",
       "mean", "total") for sep in ("_", "/", " ")]
)  # fmt: skip
_EVAL_WORDS = ("val", "Val", "VAL", "dev", "min", "eval", "Eval", "test", "Test", "best", "Best", "valid", "Valid",
               "lowest", "validation", "Validation")  # fmt: skip
# One negative lookbehind per word length (a lookbehind's alternatives must share a width): fewer checks a hit.
_NOT_EVAL = "".join(
    "(?<!(?:" + "|".join(w for w in _EVAL_WORDS if len(w) == size) + f") {_KEY})"
    for size in sorted({len(w) for w in _EVAL_WORDS})
)
LOSS_RE = re.compile(
    (
        rf"oss(?<={_KEY})(?:{_PREFIX_OK}){_NOT_EVAL}(?:_step)?(?![\w])"
        r"['\"]?[ \t]*[:=]?[ \t]*['\"]?(?:tensor\()?"
        r"(?P<value>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
        r"|[Nn][Aa][Nn]|[Ii][Nn][Ff](?:[Ii][Nn][Ii][Tt][Yy])?))(?![\w.])"
    ).encode()
)
# A step on the same line: ``step 120``, ``"step": 5``, ``global_step=100``, ``Step [120/1000]``, ``iter 30``,
# ``iteration 100/500000``, ``it=7``; else a tqdm bar's ``| 450/1000 [00:10<00:12, 45.00it/s``.
STEP_RE = re.compile(
    rb"(?i)(?<![\w.-])(?:global_step|step|iteration|iter|it(?=['\"]?[ \t]*[:=]))['\"]?[ \t]*[:=]?[ \t]*['\"]?"
    rb"\[?[ \t]*(?P<step>\d{1,15})(?![\d.])"
)
TQDM_STEP_RE = re.compile(rb"\|[ \t]*(?P<step>\d{1,15})/\d+[ \t]*\[[^\]\n]*(?:it/s|s/it)")

Point = List[Any]  # [n (loss lines before it), step or None, loss or None]


def finite_number(value: Any, low: float = 0.0, high: float = math.inf) -> Optional[float]:
    """A finite number within [low, high], or None: NaN, inf, strings and booleans from the box read as unknown."""
    number = finite(value)
    return number if number is not None and low <= number <= high else None


def _complete_lines(fd: int, offset: int, size: int, budget: int) -> Iterator[Tuple[int, bytes]]:
    """(start, line) of each complete line starting at or after ``offset``, read forward in growing windows of
    at most ``budget`` bytes in all; a line over LINE_MAX is skipped and the unfinished last one never yielded."""
    base = max(0, offset - 1)  # the byte before: a line end there means ``offset`` starts a line
    buf, started, want = b"", offset == 0, FIRST_READ
    spent = base - offset  # that byte is not counted against the budget
    while True:
        end = buf.find(b"\n")
        if end >= 0:
            if started:
                yield base, buf[:end]
            buf, base, started = buf[end + 1 :], base + end + 1, True
            continue
        if started and len(buf) > LINE_MAX:
            started = False  # too long to be a sample: skipped to its end
        if not started:
            base, buf = base + len(buf), b""
        if spent >= budget or base + len(buf) >= size:
            return
        data = os.pread(fd, min(want, budget - spent, size - base - len(buf)), base + len(buf))
        if not data:
            return
        buf, spent, want = buf + data, spent + len(data), min(want * 2, LINE_MAX)


def _sample_time(sample: Mapping[str, Any]) -> Optional[float]:
    """Epoch seconds from ``t``, else from an ISO ``ts`` that names its zone (a naive time could be any zone)."""
    t = finite_number(sample.get("t"), low=1.0)
    if t is not None:
        return t
    stamp = sample.get("ts")
    if not isinstance(stamp, str) or len(stamp) > 64:
        return None
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None and when.timestamp() > 0 else None


def _parse_sample(raw: bytes) -> Optional[Dict[str, Any]]:
    """One point from a monitor line: time, per-GPU readings and the cgroup's memory; None when it is no sample."""
    try:
        sample = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(sample, dict):
        return None
    t = _sample_time(sample)
    if t is None:
        return None
    cgroup = sample.get("cgroup") if isinstance(sample.get("cgroup"), dict) else {}
    gpus: Dict[int, Tuple[Optional[float], Optional[float], Optional[float]]] = {}
    for position, gpu in enumerate(sample.get("gpus") if isinstance(sample.get("gpus"), list) else []):
        if not isinstance(gpu, dict):
            continue
        index = gpu.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < 4096 else position
        gpus[index] = (
            finite_number(gpu.get("util_pct"), high=100.0),
            finite_number(gpu.get("memory_used_mib")),
            finite_number(gpu.get("memory_total_mib")),
        )
    return {
        "t": t,
        "gpus": gpus,
        "mem": finite_number(cgroup.get("memory_current")),
        "max": finite_number(cgroup.get("memory_max")),
    }


def _open_files(paths: Sequence[str]) -> List[Tuple[int, int]]:
    """(fd, size) of each file that exists, the same file opened twice (a rotation in between) kept once."""
    opened: List[Tuple[int, int]] = []
    seen = set()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            info = os.fstat(fd)
        except OSError:
            info = None
        if info is None or (info.st_dev, info.st_ino) in seen or not info.st_size or not stat.S_ISREG(info.st_mode):
            os.close(fd)
            continue
        seen.add((info.st_dev, info.st_ino))
        opened.append((fd, info.st_size))
    return opened


def _first_sample(fd: int, offset: int, size: int, budget: int) -> Optional[Tuple[int, Dict[str, Any]]]:
    for tried, (start, raw) in enumerate(_complete_lines(fd, offset, size, budget)):
        sample = _parse_sample(raw)
        if sample is not None:
            return start, sample
        if tried + 1 >= TRIES:
            break
    return None


def _last_sample(fd: int, size: int) -> Optional[Tuple[int, Dict[str, Any]]]:
    """The newest sample: the last parseable complete line of the file's end (8 KiB, else its last 64 KiB)."""
    for window in (2 * FIRST_READ, LINE_MAX):
        found = None
        for start, raw in _complete_lines(fd, max(0, size - window), size, window):
            sample = _parse_sample(raw)
            found = (start, sample) if sample is not None else found
        if found is not None or window >= size:
            return found
    return None


def monitor_series(paths: Sequence[str], max_points: int = MONITOR_POINTS) -> Optional[Dict[str, Any]]:
    """The run's monitor samples over ``paths`` (oldest file first) as aligned lists (see patrol_facts' RETURN),
    at most ``max_points``; None without a sample. Raises OSError only if a read fails midway."""
    files = _open_files(paths)
    try:
        total = sum(size for _fd, size in files)
        taken: Dict[Tuple[int, int], Dict[str, Any]] = {}
        for point in range(max_points - 1 if total else 0):
            offset = point * total // (max_points - 1)
            for number, (fd, size) in enumerate(files):
                if offset < size:
                    found = _first_sample(fd, offset, size, POINT_BYTES)
                    if found is not None:
                        taken.setdefault((number, found[0]), found[1])
                    break
                offset -= size
        if files:
            found = _last_sample(*files[-1])
            if found is not None:
                taken.setdefault((len(files) - 1, found[0]), found[1])
    finally:
        for fd, _size in files:
            os.close(fd)
    return _as_series(sorted(taken.values(), key=lambda s: s["t"])[-max_points:])


def _as_series(samples: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    kept: List[Dict[str, Any]] = []
    for sample in samples:  # one point per time: the same second read from both files is one sample
        if not kept or sample["t"] > kept[-1]["t"]:
            kept.append(sample)
    if not kept:
        return None
    indices = sorted({index for sample in kept for index in sample["gpus"]})[:MAX_GPUS]
    gpus = []
    for index in indices:
        readings = [sample["gpus"].get(index, (None, None, None)) for sample in kept]
        totals = [r[2] for r in readings if r[2] is not None]
        gpus.append({
            "index": index,
            "util_pct": [_rounded(r[0]) for r in readings],
            "mem_used_mib": [_rounded(r[1]) for r in readings],
            "mem_total_mib": _rounded(totals[-1]) if totals else None,
        })  # fmt: skip
    limits = [s["max"] for s in kept if s["max"] is not None]
    return {
        "t": [round(s["t"], 3) for s in kept],
        "gpus": gpus,
        "container_mem_bytes": [int(s["mem"]) if s["mem"] is not None else None for s in kept],
        "container_max_bytes": int(limits[-1]) if limits else None,
        "points": len(kept),
    }


def _rounded(value: Optional[float]) -> Optional[float]:
    return round(value, 1) if value is not None else None


def _loss_value(raw: bytes) -> Optional[float]:
    value = float(raw)
    return float(f"{value:.6g}") if math.isfinite(value) else None


def _step(line: bytes) -> Optional[int]:
    hit = STEP_RE.search(line) or TQDM_STEP_RE.search(line)
    return int(hit.group("step")) if hit else None


class LossSeries:
    """The loss curve kept in a log cursor: ``feed`` whole lines (``\\n``-ended), ``state`` to save, ``view``."""

    def __init__(self, state: Any = None) -> None:
        self.n, self.stride, self.steps_ok, self.prev_step = 0, 1, True, None
        self.points: List[Point] = []
        self.last: Optional[Point] = None
        if _valid_state(state):
            self.n, self.stride, self.steps_ok = state["n"], state["stride"], state["steps_ok"]
            self.prev_step = state["prev_step"]
            self.points = [list(p) for p in state["points"]]
            self.last = list(state["last"]) if state["last"] is not None else None

    def feed(self, raw: bytes) -> None:
        """Count every loss line of ``raw``; parse the kept ones and the block's last."""
        hit, n, stride = None, self.n, self.stride  # locals: this loop runs once per loss line
        for hit in LOSS_RE.finditer(raw):
            if n % stride == 0:
                self.points.append(self._point(raw, hit, n))
                if len(self.points) >= LOSS_POINTS:
                    stride = self.stride = stride * 2
                    self.points = [p for p in self.points if p[0] % stride == 0]
            n += 1
        self.n = n
        if hit is not None:
            kept = self.points[-1] if self.points and self.points[-1][0] == n - 1 else None
            self.last = kept or self._point(raw, hit, n - 1)

    def _point(self, raw: bytes, hit: Any, n: int) -> Point:
        start = raw.rfind(b"\n", 0, hit.start()) + 1
        end = raw.find(b"\n", hit.end())
        step = _step(raw[start : end if end >= 0 else len(raw)][:LINE_MAX])
        if step is None or (self.prev_step is not None and step < self.prev_step):
            self.steps_ok = False  # a line without its step, or a counter that restarts: plotted by line then
        self.prev_step = step if step is not None else self.prev_step
        return [n, step, _loss_value(hit.group("value"))]

    def state(self) -> Dict[str, Any]:
        return {
            "v": LOSS_STATE, "n": self.n, "stride": self.stride, "steps_ok": self.steps_ok,
            "prev_step": self.prev_step, "points": self.points, "last": self.last,
        }  # fmt: skip

    def view(self) -> Optional[Dict[str, Any]]:
        """``{x, loss, x_label, last, points}`` (at most LOSS_POINTS, the newest loss line last), or None."""
        points = list(self.points)
        if self.last is not None and (not points or points[-1][0] != self.last[0]):
            points.append(self.last)
        if not points:
            return None
        by_step = self.steps_ok and all(p[1] is not None for p in points)
        return {
            "x": [p[1] for p in points] if by_step else [p[0] + 1 for p in points],
            "loss": [p[2] for p in points],
            "x_label": "step" if by_step else "line",
            "last": points[-1][2],
            "points": len(points),
        }


def _count(value: Any, high: int = MAX_STEP) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


def _valid_point(point: Any, below: int) -> bool:
    return (
        isinstance(point, list)
        and len(point) == 3
        and _count(point[0], below - 1)
        and (point[1] is None or _count(point[1]))
        and (point[2] is None or finite_number(point[2], low=-math.inf) is not None)
    )


def _valid_state(state: Any) -> bool:
    """A state this version wrote; anything else (an older cursor has none, a garbled one) starts the series over."""
    try:
        n, stride, points = state["n"], state["stride"], state["points"]
        return (
            state["v"] == LOSS_STATE
            and _count(n) and _count(stride) and stride >= 1 and stride & (stride - 1) == 0
            and isinstance(state["steps_ok"], bool)
            and (state["prev_step"] is None or _count(state["prev_step"]))
            and isinstance(points, list) and len(points) < LOSS_POINTS
            and all(_valid_point(p, n) and p[0] % stride == 0 for p in points)
            and all(a[0] < b[0] for a, b in zip(points, points[1:]))
            and (state["last"] is None or _valid_point(state["last"], n))
        )  # fmt: skip
    except (KeyError, TypeError):
        return False
