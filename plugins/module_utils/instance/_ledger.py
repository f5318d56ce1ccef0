# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The box's cost ledger: since when the rental bills and how long it ran, kept where archive, cleanup and resume
cannot erase it. Every stage's cost is counted from it (training_run, patrol_facts, teardown_gate).

``ledger.json`` in the instance dir, mirrored into every known data dir like the stops (``_stops``)::

    {"version": 1, "first_seen": ISO, "folded_s": seconds, "updated_at": ISO,
     "segments": [{"start": ISO, "last_seen": ISO, "end": ISO or null, "ended_by": "autostop" | "teardown" | null}]}

``first_seen`` is the earliest of the previous ledger's, the container's start (PID 1's) and, only when the ledger
is first made, the ``started_at`` of the runs already on the box: archiving the oldest run or resuming one (which
rewrites its ``started_at``) never moves it. A segment is one container boot, from that boot's PID 1 start: the
current one runs to the box's now; an earlier one ends at the last stop recorded in it (the watcher's or
teardown's), else at the last time the box was seen (``ended_by`` null: it stopped or died without a stop of
ours). A stopped interval is not billed at the GPU rate. ``running_s`` (the folded segments beyond
``MAX_SEGMENTS`` plus every segment's running time) only grows, so the cost so far never decreases.

Copies merge on read (earliest ``first_seen``, union of segments), so a wiped home (RunPod's container disk) or a
lost mirror costs nothing. Writing is the caller's choice (never in check mode); a call that does not write
computes the same figures. Pure standard library, Linux ``/proc``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import (
    LEDGER,
    known_data_dirs,
    utc_iso,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._stops import (
    epoch_of,
    held,
    plausible,
    read_copies,
    read_stops,
    write_copies,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import read_run_registry
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import CLOCK_TICKS, read_stat

RUNS_TIMEOUT_S = 10.0  # for a data dir's run registry, read only when the ledger is first made
MAX_SEGMENTS = 256
SHOWN_SEGMENTS = 8
MAX_NOTES = 8
# Two PID 1 starts this close are one boot (btime, computed from the uptime, drifts by a second or so).
SAME_BOOT_S = 120.0
MAX_STAT_BYTES = 1024 * 1024

Segment = Dict[str, Any]  # start, last_seen, end (epoch seconds; end None while open), ended_by


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
    return plausible(boot + stat.start_ticks / CLOCK_TICKS)


def _finite(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _segments(docs: Sequence[Dict[str, Any]], now: float) -> List[Segment]:
    """Every copy's segments, one per boot (starts within SAME_BOOT_S), oldest first: the latest last_seen and end
    of the copies win."""
    found: List[Segment] = []
    for doc in docs:
        entries = doc.get("segments")
        for entry in entries[: MAX_SEGMENTS * 2] if isinstance(entries, list) else []:
            start = epoch_of(entry.get("start"), now) if isinstance(entry, dict) else None
            if start is None:
                continue
            end = epoch_of(entry.get("end"), now)
            by = entry.get("ended_by")
            found.append(
                {
                    "start": start,
                    "last_seen": max(epoch_of(entry.get("last_seen"), now) or start, start),
                    "end": max(end, start) if end is not None else None,
                    "ended_by": by if isinstance(by, str) and by.isidentifier() and len(by) <= 32 else None,
                }
            )
    merged: List[Segment] = []
    for segment in sorted(found, key=lambda one: one["start"]):
        if merged and segment["start"] - merged[-1]["start"] <= SAME_BOOT_S:
            same = merged[-1]
            same["last_seen"] = max(same["last_seen"], segment["last_seen"])
            if segment["end"] is not None and (same["end"] is None or segment["end"] > same["end"]):
                same["end"], same["ended_by"] = segment["end"], segment["ended_by"] or same["ended_by"]
        else:
            merged.append(dict(segment))
    return merged


def _close(segment: Segment, until: float, stops: Sequence[Dict[str, Any]], now: float) -> None:
    """End a past boot's segment: at its last stop of ours (or when it was seen after that), else when it was last
    seen; never past the next boot's start."""
    inside = [stop for stop in stops if segment["start"] <= (epoch_of(stop["at"], now) or 0.0) < until]
    moments = [segment["last_seen"], *([segment["end"]] if segment["end"] is not None else [])]
    if inside:
        moments.append(epoch_of(inside[-1]["at"], now) or segment["start"])
        segment["ended_by"] = inside[-1]["by"]
    segment["end"] = min(max(moments), until)


def build(
    docs: Sequence[Dict[str, Any]],
    stops: Sequence[Dict[str, Any]],
    boot: Optional[float],
    run_starts: Sequence[float],
    now: float,
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The ledger after this look at the box, and its figures ``{first_seen, running_s, segments_total, segments,
    stopped_at}``: ``docs`` the copies found, ``stops`` every stop recorded (oldest first), ``boot`` this boot's
    PID 1 start, ``run_starts`` the runs' starts (used only when no copy exists), ``now`` the box's clock."""
    segments = _segments(docs, now)
    folded = max([f for f in (_finite(doc.get("folded_s")) for doc in docs) if f is not None and f >= 0] or [0.0])
    firsts = [epoch_of(doc.get("first_seen"), now) for doc in docs]
    starts = [plausible(start, now) for start in ([] if docs else run_starts)]
    known = [m for m in (*firsts, *starts, boot, *(s["start"] for s in segments)) if m is not None]
    first_seen = min(known, default=now)
    current = boot if boot is not None else (segments[-1]["start"] if segments else first_seen)
    if not segments or current - segments[-1]["start"] > SAME_BOOT_S:
        segments.append({"start": min(current, now), "last_seen": now, "end": None, "ended_by": None})
    live = segments[-1]
    live.update(last_seen=max(live["last_seen"], now), end=None, ended_by=None)
    for segment, following in zip(segments, segments[1:]):
        _close(segment, following["start"], stops, now)
    while len(segments) > MAX_SEGMENTS:
        gone = segments.pop(0)
        folded += max(gone["end"] - gone["start"], 0.0)
    mine = [stop for stop in stops if (epoch_of(stop["at"], now) or 0.0) >= live["start"]]
    ran = [max((segment["end"] or now) - segment["start"], 0.0) for segment in segments]
    doc = {
        "version": 1,
        "first_seen": utc_iso(first_seen),
        "folded_s": round(folded, 1),
        "updated_at": utc_iso(now),
        "segments": [
            {
                "start": utc_iso(s["start"]),
                "last_seen": utc_iso(s["last_seen"]),
                "end": None if s["end"] is None else utc_iso(s["end"]),
                "ended_by": s["ended_by"],
            }
            for s in segments
        ],
    }
    shown = [{key: entry[key] for key in ("start", "end", "ended_by")} for entry in doc["segments"][-SHOWN_SEGMENTS:]]
    for entry, seconds in zip(shown, ran[-SHOWN_SEGMENTS:]):
        entry["running_s"] = round(seconds, 1)
    figures = {
        "first_seen": doc["first_seen"],
        "running_s": round(folded + sum(ran), 1),
        "segments_total": len(segments),
        "segments": shown,
        # A stop of ours during this boot: issued, yet the box still answers (going down, or the stop did not take).
        "stopped_at": mine[-1]["at"] if mine else None,
    }
    return doc, figures


def _run_starts(data_dirs: Sequence[str]) -> List[float]:
    starts: List[float] = []
    for data_dir in data_dirs:
        runs, _problems = read_run_registry(data_dir, RUNS_TIMEOUT_S)  # a run left out only moves first_seen later
        starts += [run.started_at for run in runs if run.started_at is not None]
    return starts


def cost_basis(
    data_dirs: Sequence[Optional[str]],
    write: bool,
    now: Optional[float] = None,
    proc: str = "/proc",
    directory: Optional[str] = None,
) -> Dict[str, Any]:
    """What a stage returns for the controller's cost: ``box_now`` (this box's clock, ISO 8601 UTC: every duration
    is counted on it), ``box_started_at`` (the ledger's ``first_seen``: since when the box bills) and ``ledger``
    (its figures, see :func:`build`, with ``notes``: the copies that could not be read or written).

    ``data_dirs``: the stage's own; every known data dir of the box is read (and, with ``write``, written) too.
    ``write`` false (check mode, a read-only gate) computes the same figures and writes nothing."""
    moment = time.time() if now is None else now
    dirs, notes = known_data_dirs([path for path in data_dirs if path], directory)
    boot = container_started_at(proc)
    with contextlib.ExitStack() as stack:
        home = stack.enter_context(held(directory, notes)) if write else False
        docs, unread = read_copies(LEDGER, dirs, directory)
        stops, stop_notes = read_stops(dirs, directory, resolved=True)
        doc, figures = build(docs, stops, boot, [] if docs else _run_starts(dirs), moment)
        if write:
            notes += write_copies(LEDGER, doc, dirs, directory, home)
    notes = [f"cost ledger: {note}"[:300] for note in [*unread, *stop_notes, *notes]][:MAX_NOTES]
    return {"box_now": utc_iso(moment), "box_started_at": figures["first_seen"], "ledger": dict(figures, notes=notes)}
