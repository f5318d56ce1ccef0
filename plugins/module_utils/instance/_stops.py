# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The stops we issued on this box (autostop's watcher, teardown), and the copies of the instance's files that
outlive a stop.

``stops.json`` holds ``{"version": 1, "stops": [{"at": ISO 8601 UTC, "by": "autostop"|"teardown", "verb": ...}]}``,
oldest first, at most ``MAX_STOPS``. A stop ends the box's billing segment in the cost ledger (``_ledger``) and
tells a box we stopped from one that died on its own.

The API, for the watcher and teardown::

    entry, problems = record_stop("autostop", verb="stop")   # right BEFORE the stop command runs
    stops, problems = read_stops()                            # every stop recorded, oldest first

Record a stop before its command runs (after it, the box may be gone); a stop that did not take costs nothing, as
a box that still answers bills on (its segment runs to the last time it was seen). Neither call raises for a copy
that cannot be read or written: each such copy is one problem line, and a stop goes on.

RunPod wipes the container disk (home, so the instance dir) on every stop and keeps the volume: each document is
also mirrored into every known data dir, ``<data_dir>/runs/.instance/<name>``, and a reader merges the copies.
A data dir may be a hung mount: each copy there is read and written in a child under ``MIRROR_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from datetime import datetime, timezone
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import (
    STOPS,
    instance_dir,
    known_data_dirs,
    read_doc,
    state_lock,
    state_path,
    utc_iso,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import runs_root, write_json_atomic

MIRROR_DIR = ".instance"
MIRROR_TIMEOUT_S = 10.0
MAX_STOPS = 64
MAX_WORD = 32
# A time outside these bounds is garbage (a broken clock, a hand edit), never a start or a stop.
EARLIEST = 946684800.0  # 2000-01-01
FUTURE_SLACK_S = 86400.0


def plausible(seconds: Optional[float], now: Optional[float] = None) -> Optional[float]:
    """``seconds`` (since the epoch) when it can be a moment of this box: finite, not before 2000, at most a day
    ahead of ``now``."""
    if seconds is None or isinstance(seconds, bool) or not math.isfinite(seconds):
        return None
    ahead = (time.time() if now is None else now) + FUTURE_SLACK_S
    return float(seconds) if EARLIEST <= seconds <= ahead else None


def epoch_of(value: Any, now: Optional[float] = None) -> Optional[float]:
    """Epoch seconds of an ISO 8601 time that one of the instance's files holds (naive means UTC), or None."""
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        return None
    text = value.strip()
    text = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        moment = datetime.fromisoformat(text)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return plausible(moment.timestamp(), now)
    except (ValueError, OverflowError):
        return None


def mirror_path(data_dir: str, name: str) -> str:
    """Where a data dir keeps its copy of one of the instance's files: ``<data_dir>/runs/.instance/<name>``."""
    return os.path.join(runs_root(data_dir), MIRROR_DIR, name)


def _read_mirror(data_dir: str, name: str) -> Dict[str, Any]:
    doc, problem = read_doc(mirror_path(data_dir, name))
    return {"doc": doc, "problem": problem}


def _write_mirror(data_dir: str, name: str, doc: Dict[str, Any]) -> bool:
    """Write the copy where the data dir has a runs directory (a mistyped data dir gets no directory made)."""
    if not os.path.isdir(runs_root(data_dir)):
        return False
    os.makedirs(os.path.dirname(mirror_path(data_dir, name)), mode=0o700, exist_ok=True)
    write_json_atomic(mirror_path(data_dir, name), doc, private=True)
    return True


def _answers_problems(answers: Dict[str, Dict[str, Any]], what: str, timeout_s: float) -> List[str]:
    problems = []
    for data_dir, answer in answers.items():
        if answer.get("timed_out"):
            problems.append(f"{what} in {data_dir}: did not answer within {timeout_s:g} s (a hung mount?)")
        elif "error" in answer:
            problems.append(f"{what} in {data_dir}: {str(answer['error'])[:200]}")
    return problems


def read_copies(
    name: str, data_dirs: Sequence[str], directory: Optional[str] = None, timeout_s: Optional[float] = None
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Every readable copy of the instance's file ``name``: the instance dir's, then each data dir's mirror (each
    under ``timeout_s``, MIRROR_TIMEOUT_S by default); and a problem line per copy that exists but cannot be read."""
    timeout_s = MIRROR_TIMEOUT_S if timeout_s is None else timeout_s
    docs, problems = [], []
    doc, problem = read_doc(state_path(name, directory))
    docs += [doc] if doc is not None else []
    problems += [problem] if problem else []
    probes = {path: functools.partial(_read_mirror, path, name) for path in data_dirs}
    answers = run_with_deadline(probes, timeout_s) if probes else {}
    for answer in answers.values():
        found = answer.get("value") or {}
        docs += [found["doc"]] if isinstance(found.get("doc"), dict) else []
        problems += [found["problem"]] if found.get("problem") else []
    return docs, problems + _answers_problems(answers, f"reading {name}", timeout_s)


def write_copies(
    name: str,
    doc: Dict[str, Any],
    data_dirs: Sequence[str],
    directory: Optional[str] = None,
    home: bool = True,
    *,
    timeout_s: Optional[float] = None,
) -> List[str]:
    """Write ``doc`` as the instance's file ``name`` (with ``home``: the caller holds ``state_lock``) and as each
    data dir's mirror (under ``timeout_s``, MIRROR_TIMEOUT_S by default); a problem line per copy not written."""
    timeout_s = MIRROR_TIMEOUT_S if timeout_s is None else timeout_s
    problems = []
    if home:
        try:
            write_json_atomic(state_path(name, directory), doc, private=True)
        except OSError as exc:
            problems.append(f"{state_path(name, directory)} not written ({exc.strerror or exc})")
    probes = {path: functools.partial(_write_mirror, path, name, doc) for path in data_dirs}
    answers = run_with_deadline(probes, timeout_s) if probes else {}
    return problems + _answers_problems(answers, f"writing {name}", timeout_s)


@contextlib.contextmanager
def held(directory: Optional[str], problems: List[str]) -> Iterator[bool]:
    """The instance dir under its lock (True), or False with a problem line when it cannot be made or locked (a
    read-only home): the caller then writes the data dirs' copies only."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(state_lock(directory))
        except (OSError, TimeoutError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            problems.append(f"the instance dir {directory or instance_dir()} cannot be locked ({why[:200]})")
            yield False
            return
        yield True


def stops_of(docs: Sequence[Dict[str, Any]], now: Optional[float] = None) -> List[Dict[str, Any]]:
    """The stops of every copy, merged: each ``{at, by, verb}`` once, oldest first, the newest ``MAX_STOPS``; an
    entry without a plausible time or a stopper is left out."""
    seen: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for doc in docs:
        entries = doc.get("stops")
        for entry in entries if isinstance(entries, list) else []:
            moment = epoch_of(entry.get("at"), now) if isinstance(entry, dict) else None
            by = entry.get("by") if isinstance(entry, dict) else None
            if moment is None or not isinstance(by, str) or not by or len(by) > MAX_WORD:
                continue
            verb = entry.get("verb") if isinstance(entry.get("verb"), str) and len(entry["verb"]) <= MAX_WORD else None
            at = utc_iso(moment)
            seen.setdefault((at, by), {"at": at, "by": by, "verb": verb})
    return sorted(seen.values(), key=lambda stop: stop["at"])[-MAX_STOPS:]


def read_stops(
    data_dirs: Sequence[str] = (), directory: Optional[str] = None, resolved: bool = False
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Every stop recorded on the box ``{at, by, verb}``, oldest first, and a problem line per unreadable copy.
    ``data_dirs``: the caller's own (every known data dir is read too, unless ``resolved`` says they are all)."""
    problems: List[str] = []
    if not resolved:
        data_dirs, problems = known_data_dirs(data_dirs, directory)
    docs, unread = read_copies(STOPS, data_dirs, directory)
    return stops_of(docs), problems + unread


def record_stop(
    by: str,
    at: Optional[str] = None,
    verb: Optional[str] = None,
    data_dirs: Sequence[str] = (),
    directory: Optional[str] = None,
) -> Tuple[Dict[str, Any], List[str]]:
    """Record that ``by`` (``autostop``, ``teardown``) stops the box at ``at`` (ISO 8601 UTC; now when None) with
    the provider's ``verb``: in the instance dir and in every known data dir (``data_dirs`` first). Returns the
    entry and a problem line per copy not written; ValueError for a ``by``, ``at`` or ``verb`` that is no such
    thing."""
    if not isinstance(by, str) or not by or len(by) > MAX_WORD:
        raise ValueError(f"record_stop: by must be a word of at most {MAX_WORD} characters, not {by!r}")
    moment = time.time() if at is None else epoch_of(at)
    if moment is None:
        raise ValueError(f"record_stop: at must be an ISO 8601 time of this box, not {at!r}")
    if verb is not None and (not isinstance(verb, str) or len(verb) > MAX_WORD):
        raise ValueError(f"record_stop: verb must be a word of at most {MAX_WORD} characters, not {verb!r}")
    entry = {"at": utc_iso(moment), "by": by, "verb": verb}
    dirs, problems = known_data_dirs(data_dirs, directory)
    with held(directory, problems) as home:
        docs, unread = read_copies(STOPS, dirs, directory)
        stops = stops_of([*docs, {"stops": [entry]}])
        problems += unread + write_copies(STOPS, {"version": 1, "stops": stops}, dirs, directory, home)
    return entry, problems
