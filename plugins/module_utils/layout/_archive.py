# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Retire finished or crashed runs on a box without deleting a byte (issue 20).

A run directory ``<data_dir>/runs/<run>`` is renamed to ``<data_dir>/runs/.archive/<run>-<UTC stamp>``: one
``rename`` on the runs' own filesystem, never a copy and a delete, so every file keeps its inode and bytes. Its
durable copy ``<durable_dir>/runs/<run>`` (the durable_dir its run.json names) moves with it, to
``<durable_dir>/runs/.archive/<run>-<UTC stamp>`` (``_archive_durable``): left there, a new run of the name would
write over it. Patrol then no longer lists the run (no escalation each tick) and counts it; teardown's instance gate
still sees it (its scratch may hold the only results). A live run (its runner, or any process carrying its
``RGT_RUN_DIR``) is refused, as is a run whose teardown did not finish or whose durable copy cannot be moved. Every
check and the move run in a forked child under a deadline (a hung data dir fails the call instead of hanging it),
all under the box's launch lock. Pure standard library.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import os
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._files import fsync_directory
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _archive_durable as durable_side
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, read_json_quietly
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    ARCHIVE_STAMP,
    NAME_PATTERN,
    RUN_MARKER,
    Run,
    archive_path,
    archive_record,
    archive_root,
    launch_lock,
    list_archived,
    list_runs,
    run_dir,
    runs_root,
    tombstone_path,
    write_json_atomic,
)

DEFAULT_TIMEOUT_S = 60.0
LOCK_WAIT_S = 30.0
MAX_NAMES_LISTED = 10
MAX_PIDS_LISTED = 5


class ArchiveRefused(Exception):
    """Nothing was moved; ``facts`` are the module's return values."""

    def __init__(self, message: str, facts: Dict[str, Any]) -> None:
        super().__init__(message)
        self.facts = facts


def checked_runs(data_dir: Any, runs: Any) -> List[str]:
    """The run names, deduplicated in order; ValueError naming the option when one is bad."""
    if not isinstance(data_dir, str) or not os.path.isabs(data_dir):
        raise ValueError(f"data_dir must be an absolute path, not {data_dir!r}")
    names = [runs] if isinstance(runs, str) else list(runs or [])
    if not names:
        raise ValueError("run must name at least one run")
    for name in names:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(f"run: {name!r} is no run name (a name matches {NAME_PATTERN.pattern})")
    return list(dict.fromkeys(names))


def live_reason(data_dir: str, run: str) -> Optional[str]:
    """Why the run counts as live, as teardown's gate judges it: its runner lives (PID reuse guarded), or a process
    carries its marker ``RGT_RUN_DIR`` (a worker that left the runner's session); None when nothing of it runs."""
    disk = OnDisk(data_dir, run)
    if disk.live:
        return f"its runner is alive (pgid {disk.record.get('pgid')})"
    directory = run_dir(data_dir, run)
    variants = sorted({directory, os.path.normpath(directory), os.path.realpath(directory)})
    left = detach.run_members(Run(run, directory), [f"{RUN_MARKER}={path}" for path in variants])
    if not left:
        return None
    pids = ", ".join(str(proc.pid) for proc in left[:MAX_PIDS_LISTED])
    return f"{len(left)} of its processes run (pid {pids}, carrying {RUN_MARKER})"


def _suggestion(data_dir: str, run: str) -> str:
    names = list_runs(data_dir)
    close = difflib.get_close_matches(run, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    if not names:
        return "there is no run on this box"
    more = f" and {len(names) - MAX_NAMES_LISTED} more" if len(names) > MAX_NAMES_LISTED else ""
    return f"runs on this box: {', '.join(names[:MAX_NAMES_LISTED])}{more}"


def _plan(data_dir: str, run: str, stamp: str) -> Dict[str, Any]:
    """One run's entry: already archived or torn down (nothing to do), to be archived, or ``refused`` (why)."""
    source = run_dir(data_dir, run)
    entry: Dict[str, Any] = {"run": run, "state": "refused", "from": source, "path": None, "refused": None}
    entry.update(record=None, archived_at=None, reason=None, durable=None)
    if not os.path.lexists(source):
        earlier = [archived for archived in list_archived(data_dir) if archived.run == run]
        if earlier:
            record = read_json_quietly(archive_record(earlier[-1].path)) or {}
            entry.update(state="already_archived", path=earlier[-1].path, record=archive_record(earlier[-1].path))
            durable = record.get("durable")
            entry.update(archived_at=record.get("archived_at"), reason=record.get("reason"))
            entry["durable"] = durable if isinstance(durable, dict) else None
        elif read_json_quietly(tombstone_path(data_dir, run)) is not None:
            entry.update(state="torn_down", path=None)
        else:
            entry["refused"] = f"run {run}: {source} does not exist; {_suggestion(data_dir, run)}"
        return entry
    if not os.path.isdir(source):
        entry["refused"] = f"run {run}: {source} is not a run directory"
        return entry
    tombstone = read_json_quietly(tombstone_path(data_dir, run))
    if tombstone is not None and tombstone.get("state") == "removing":
        entry["refused"] = f"run {run}: its teardown did not finish (tombstone state removing): run teardown again"
        return entry
    live = live_reason(data_dir, run)
    if live:
        entry["refused"] = f"run {run} is live: {live}; stop it first"
        return entry
    target = archive_path(data_dir, run, stamp)
    if os.path.lexists(target):
        entry["refused"] = f"run {run}: {target} exists already; archive again in a second"
        return entry
    durable = durable_side.plan_durable(source, run, os.path.basename(target))
    entry["durable"] = {key: durable[key] for key in ("state", "dir", "from", "to")}
    if durable["refused"]:
        entry["refused"] = f"run {run}: {durable['refused']}"
        return entry
    entry.update(state="would_archive", path=target)
    return entry


def _move(entry: Dict[str, Any], reason: Optional[str], archived_at: str) -> None:
    """Rename the run's durable copy aside, then its scratch (moving the copy back when the scratch cannot move),
    then write the record beside it; EXDEV is refused, never copied. The durable rename goes first as the one that
    may meet a network mount: when it fails, nothing of the run moved."""
    durable = entry["durable"]
    if durable["state"] == "to_move":
        failed = durable_side.rename_bounded(durable["from"], durable["to"])
        if failed:
            raise OSError(f"its durable copy did not move ({failed})")
        durable["state"] = "moved"
    try:
        os.rename(entry["from"], entry["path"])
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EXDEV:
            why = f"{entry['path']} is on another filesystem than {entry['from']}: nothing copied"
        if durable["state"] == "moved":
            undone = durable_side.rename_bounded(durable["to"], durable["from"])
            durable["state"] = "to_move" if undone is None else "moved"
            why += "; its durable copy moved back" if undone is None else f"; its durable copy stays at {durable['to']}"
        raise OSError(why) from exc
    fsync_directory(os.path.dirname(entry["from"]))
    fsync_directory(os.path.dirname(entry["path"]))
    record = {"run": entry["run"], "from": entry["from"], "to": entry["path"], "archived_at": archived_at}
    write_json_atomic(archive_record(entry["path"]), dict(record, reason=reason, durable=durable))
    entry.update(state="archived", record=archive_record(entry["path"]), archived_at=archived_at, reason=reason)


def _archive(data_dir: str, runs: Sequence[str], reason: Optional[str], check_mode: bool, now: float) -> Dict[str, Any]:
    """The child's work: every run checked, then (unless one is refused, or check mode) each moved."""
    if not os.path.isdir(data_dir):
        return {"problem": f"data_dir {data_dir}: {'not a directory' if os.path.lexists(data_dir) else 'not found'}"}
    root = archive_root(data_dir)
    if os.path.lexists(root) and (os.path.islink(root) or not os.path.isdir(root)):
        return {"problem": f"{root} is not a directory (a link or a file): nothing moved"}
    stamp = time.strftime(ARCHIVE_STAMP, time.gmtime(now))
    archived_at = datetime.fromtimestamp(now, timezone.utc).isoformat().replace("+00:00", "Z")
    # The launch lock keeps a launch of the same name, and a teardown's removal, out between the checks and the move.
    writes = not check_mode and os.path.isdir(runs_root(data_dir))
    with launch_lock(data_dir, LOCK_WAIT_S) if writes else contextlib.nullcontext():
        entries = [_plan(data_dir, run, stamp) for run in runs]
        if check_mode:
            for entry in entries:
                entry.update(reason=reason if entry["state"] == "would_archive" else entry["reason"])
            return {"entries": _durable_states(entries, "would_move")}
        to_move = [entry for entry in entries if entry["state"] == "would_archive"]
        if any(entry["refused"] for entry in entries):
            to_move = []
        if to_move:
            os.makedirs(root, exist_ok=True)
        for entry in to_move:
            try:
                _move(entry, reason, archived_at)
            except OSError as exc:
                entry.update(state="refused", refused=f"run {entry['run']}: {exc.strerror or exc}")
                break  # what moved before stays moved: each entry says where it is
        for entry in entries:
            entry.update(state="not_moved" if entry["state"] == "would_archive" else entry["state"])
    return {"entries": _durable_states(entries, "not_moved")}


def _durable_states(entries: List[Dict[str, Any]], unmoved: str) -> List[Dict[str, Any]]:
    """A durable copy planned to move but left where it was says so (would_move in check mode, else not_moved)."""
    for entry in entries:
        if entry["durable"] and entry["durable"]["state"] == "to_move":
            entry["durable"]["state"] = unmoved
    return entries


def _durable_part(entry: Mapping[str, Any]) -> str:
    durable = entry.get("durable") or {}
    return {
        "moved": f" (durable copy -> {durable.get('to')})",
        "would_move": f" (durable copy to {durable.get('to')})",
        "other_launch": f" (durable copy {durable.get('from')} left: another launch's)",
        "shared": f" (durable copy {durable.get('from')} left: it holds other boxes' cells of the launch)",
    }.get(durable.get("state"), "")


def _line(entry: Mapping[str, Any]) -> str:
    run, where = entry["run"], os.path.relpath(entry["path"], os.path.dirname(entry["from"])) if entry["path"] else ""
    return {
        "archived": f"{run} -> {where}{_durable_part(entry)}",
        "would_archive": f"{run} would move to {where}{_durable_part(entry)}",
        "not_moved": f"{run} not moved",
        "already_archived": f"{run} already archived as {where}",
        "torn_down": f"{run} torn down already (no scratch left)",
    }.get(entry["state"], entry.get("refused") or run)


def archive_runs(
    params: Mapping[str, Any], check_mode: bool, now: Optional[float] = None, timeout_s: Optional[float] = None
) -> Dict[str, Any]:
    """Archive each run of ``params['run']`` (a name or a list) under ``params['data_dir']``.

    Returns the module's facts (``changed``, ``msg``, ``runs``, ``refused``, ``problems``); raises ValueError for a bad
    option and ArchiveRefused when any run is refused (then nothing moved) or the data dir does not answer.
    """
    data_dir = params.get("data_dir")
    runs = checked_runs(data_dir, params.get("run"))
    reason = params.get("reason") or None
    limit = float(timeout_s or params.get("timeout_s") or DEFAULT_TIMEOUT_S)
    work = functools.partial(_archive, os.path.normpath(data_dir), runs, reason, check_mode, now or time.time())
    answer = run_with_deadline({"archive": work}, limit)["archive"]
    empty: Dict[str, Any] = {"changed": False, "runs": [], "refused": True}
    if answer.get("timed_out"):
        why = f"data_dir {data_dir} did not answer within {limit:g} s (a hung mount?): check whether anything moved"
        raise ArchiveRefused(why, dict(empty, problems=[why]))
    if "error" in answer or "problem" in answer["value"]:
        why = answer.get("error") or answer["value"]["problem"]
        raise ArchiveRefused(why, dict(empty, problems=[why]))
    entries = answer["value"]["entries"]
    problems = [entry["refused"] for entry in entries if entry["refused"]]
    facts = {"changed": any(entry["state"] in ("archived", "would_archive") for entry in entries), "runs": entries}
    facts.update(refused=bool(problems), problems=problems)
    moved = any(entry["state"] == "archived" for entry in entries)
    tail = "; nothing deleted" if moved else "; nothing moved" if problems else ""
    facts["msg"] = "archive: " + "; ".join(_line(entry) for entry in entries) + tail
    if problems:
        raise ArchiveRefused(facts.pop("msg"), facts)
    return facts
