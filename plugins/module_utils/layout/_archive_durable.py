# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The durable side of an archived run (issue 29): its copy moves with it, and its readers find it there.

``<durable_dir>/runs/<run>`` is where any new run of that name writes. Left there when the run was archived, a
relaunch of the name overwrote the archived run's cells and its ``MANIFEST.sha256``. So ``run_archive`` renames the
copy to ``<durable_dir>/runs/.archive/<entry>`` (``entry`` = ``<run>-<stamp>``, the archived scratch's own name; a
rename on the copy's filesystem, never a copy and a delete) and records it beside the archived scratch. Teardown's
instance survey locates it through that record (or, for an archive made before, the same name, then the old place)
and checks it against its manifest. Every touch of durable_dir runs in a forked child under a deadline.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._files import fsync_directory
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import read_json_quietly
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    ARCHIVE_DIR,
    LAUNCH_RECORD,
    MANIFEST_NAME,
    SHA256_PATTERN,
    archive_record,
    durable_run_dir,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import durable_owner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._copy_verify import (
    checked_relative,
    verify_copy,
)

DURABLE_TIMEOUT_S = 10.0  # durable_dir is often a network mount
MAX_MANIFEST_LINES = 100_000
REHASH_TIMEOUT_S = 1800.0


def durable_archive_path(durable_dir: str, entry: str) -> str:
    """``<durable_dir>/runs/.archive/<entry>``: where an archived run's durable copy lies."""
    return os.path.join(durable_dir, "runs", ARCHIVE_DIR, entry)


def _run_record(run_directory: str, key: str) -> Optional[str]:
    """A text value of the run's run.json, else of its spec.json."""
    for name in ("run.json", "spec.json"):
        value = (read_json_quietly(os.path.join(run_directory, name)) or {}).get(key)
        if isinstance(value, str) and value:
            return value
    return None


def named_durable_dir(run_directory: str) -> Optional[str]:
    """The durable_dir the run's own files name (absolute), or None."""
    value = _run_record(run_directory, "durable_dir")
    return os.path.normpath(value) if value and os.path.isabs(value) else None


def _run_cells(run_directory: str) -> List[str]:
    """The cell names the run's run.json, else its spec.json, lists (empty when neither does)."""
    for name in ("run.json", "spec.json"):
        cells = (read_json_quietly(os.path.join(run_directory, name)) or {}).get("cells")
        if isinstance(cells, list) and cells:
            return [str(cell.get("name")) for cell in cells if isinstance(cell, dict)]
    return []


def _look(source: str, target: str, launch_id: Optional[str], cells: List[str]) -> Dict[str, Any]:
    """What a rename of ``source`` to ``target`` would meet (in a child: durable_dir may hang)."""
    if not os.path.lexists(source):
        return {"state": "none"}
    owner = durable_owner(source)
    if owner["problem"]:
        why = f"{source} has an unreadable {LAUNCH_RECORD} ({owner['problem']}): cannot tell whose copy it is"
        return {"refused": why}
    if owner["launch_id"] and launch_id and owner["launch_id"] != launch_id:
        return {"state": "other_launch"}
    held = os.path.join(source, "cells")
    # A sharded launch's copy holds its peers' cells too: moving it would take their results from under them. Left,
    # it stays out of a new run's reach: a launch that would write one of its cells is refused (_launch_attempt).
    if cells and os.path.isdir(held) and sorted(set(os.listdir(held)) - set(cells)):
        return {"state": "shared"}
    root = os.path.dirname(target)
    if os.path.lexists(root) and (os.path.islink(root) or not os.path.isdir(root)):
        return {"refused": f"{root} is not a directory (a link or a file)"}
    if os.path.lexists(target):
        return {"refused": f"{target} exists already (the name is taken)"}
    parent = os.path.dirname(source)
    others = [
        path for path in (source, root) if os.path.lexists(path) and os.lstat(path).st_dev != os.stat(parent).st_dev
    ]
    if others:
        return {"refused": f"{others[0]} is on another filesystem than {parent}: a rename cannot move it"}
    return {"state": "to_move"}


def plan_durable(run_directory: str, run: str, entry: str) -> Dict[str, Any]:
    """Where the run's durable copy goes when it is archived as ``entry``: ``state`` to_move, none (no copy),
    other_launch (the copy there is another launch's, not this run's), shared (it holds cells the run has not: a
    sharded launch's, left) or no_durable_dir; ``refused`` when it cannot be moved (a hung mount, another filesystem,
    the name taken, an unreadable launch record)."""
    durable_dir = named_durable_dir(run_directory)
    plan: Dict[str, Any] = {"state": "no_durable_dir", "dir": durable_dir, "from": None, "to": None, "refused": None}
    if durable_dir is None:
        return plan
    source, target = durable_run_dir(durable_dir, run), durable_archive_path(durable_dir, entry)
    plan.update({"from": source, "to": target})
    launch_id, cells = _run_record(run_directory, "launch_id"), _run_cells(run_directory)
    look = functools.partial(_look, source, target, launch_id, cells)
    answer = run_with_deadline({"look": look}, DURABLE_TIMEOUT_S)["look"]
    if answer.get("timed_out"):
        plan["refused"] = f"durable_dir {durable_dir} did not answer within {DURABLE_TIMEOUT_S:g} s (a hung mount?)"
    elif "error" in answer:
        plan["refused"] = f"durable copy {source}: {answer['error']}"
    else:
        plan.update(state=answer["value"].get("state"), refused=answer["value"].get("refused"))
    if plan["state"] in ("none", "other_launch", "shared"):
        plan["to"] = None
    return plan


def _rename(source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.lexists(target):  # os.rename would replace an empty directory there
        raise FileExistsError(f"{target} exists already")
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise OSError(f"{target} is on another filesystem than {source}: nothing copied") from exc
        raise OSError(f"{source}: {exc.strerror or exc}") from exc
    fsync_directory(os.path.dirname(source))
    fsync_directory(os.path.dirname(target))


def rename_bounded(source: str, target: str) -> Optional[str]:
    """Rename under the deadline; None when done, else why not (one line)."""
    answer = run_with_deadline({"rename": functools.partial(_rename, source, target)}, DURABLE_TIMEOUT_S)["rename"]
    if "value" in answer:
        return None
    if answer.get("timed_out"):
        return f"renaming {source} did not answer within {DURABLE_TIMEOUT_S:g} s (a hung mount?): look whether it moved"
    return str(answer.get("error"))


def _manifest(path: str) -> Tuple[List[Dict[str, Any]], int]:
    """The manifest's entries and how many of its lines are not an entry."""
    entries, bad = [], 0
    with open(path, "rb") as handle:
        text = handle.read(64 * 1024 * 1024).decode("utf-8", errors="replace")
    for line in [line for line in text.splitlines() if line.strip()][:MAX_MANIFEST_LINES]:
        fields = line.split("  ", 2)
        try:
            if len(fields) != 3 or not SHA256_PATTERN.match(fields[0]) or not fields[1].isdigit():
                raise ValueError(line)
            entries.append({"path": checked_relative(fields[2]), "size": int(fields[1]), "sha256": fields[0]})
        except ValueError:
            bad += 1
    return entries, bad


def _size_problem(root: str, real_root: str, entry: Mapping[str, Any]) -> Optional[str]:
    path = os.path.join(root, entry["path"])
    try:
        info = os.lstat(path)
    except OSError as exc:
        return "missing" if exc.errno == errno.ENOENT else f"cannot be read: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode) or not os.path.realpath(path).startswith(real_root.rstrip("/") + "/"):
        return "not a regular file inside the copy"
    return None if info.st_size == entry["size"] else f"{info.st_size} bytes, expected {entry['size']}"


def check_copy(path: str, rehash: bool) -> Dict[str, Any]:
    """``files`` (manifest entries), ``verified`` and ``problem`` of the copy at ``path``: every listed file there, a
    regular file of its listed size (``rehash``: and its sha256 recomputed now)."""
    found: Dict[str, Any] = {"files": 0, "verified": False, "check": "sha256" if rehash else "size", "problem": None}
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        return dict(found, problem=f"{path} has no {MANIFEST_NAME}")
    entries, bad = _manifest(manifest)
    found["files"] = len(entries) + bad
    if bad:
        return dict(found, problem=f"{bad} line(s) of {manifest} are not a manifest entry")
    if rehash:
        result = verify_copy(path, entries, REHASH_TIMEOUT_S)
        return dict(found, verified=result["passed"], problem=result["reason"] or None)
    real_root = os.path.realpath(path)
    for entry in entries:
        problem = _size_problem(path, real_root, entry)
        if problem:
            return dict(found, problem=f"{entry['path']} under {path}: {problem}")
    return dict(found, verified=True)


def locate(archived_path: str, entry: str, run: str, durable_dir: Optional[str]) -> Dict[str, Any]:
    """Where an archived run's durable copy lies: ``path`` (None: it has none), ``moved`` (out of reach of a new run
    of its name) and ``problem``. From its archive record; for an archive made before copies moved, the same entry
    name under the run's durable_dir (``durable_dir`` when its files name none), then the old place, if the copy
    there still is this run's launch."""
    record = read_json_quietly(archive_record(archived_path)) or {}
    durable = record.get("durable")
    # A copy left in place ("shared") is found at its old place, as is one of an archive from before copies moved.
    if isinstance(durable, dict) and durable.get("state") in ("moved", "none", "other_launch", "no_durable_dir"):
        moved = durable["state"] == "moved" and isinstance(durable.get("to"), str)
        return {"path": durable["to"] if moved else None, "moved": moved, "problem": None}
    root = named_durable_dir(archived_path) or durable_dir
    if not root:
        return {"path": None, "moved": False, "problem": None}
    if os.path.isdir(durable_archive_path(root, entry)):
        return {"path": durable_archive_path(root, entry), "moved": True, "problem": None}
    old = durable_run_dir(root, run)
    owner = durable_owner(old)
    if not owner["exists"]:
        return {"path": None, "moved": False, "problem": None}
    launch = _run_record(archived_path, "launch_id")
    if owner["launch_id"] and launch and owner["launch_id"] != launch:
        return {"path": None, "moved": False, "problem": f"{old} holds launch {owner['launch_id']}, not this run's"}
    if isinstance(durable, dict) and durable.get("state") == "shared":
        return {"path": old, "moved": False, "problem": f"{old} stays shared with the other boxes of its launch"}
    return {
        "path": old,
        "moved": False,
        "problem": f"{old} was not moved with the run: a new run of its name writes there",
    }


def archived_copy(archived_path: str, entry: str, run: str, durable_dir: Optional[str], rehash: bool) -> Dict[str, Any]:
    """``locate`` then ``check_copy``, as survey facts: ``durable_dir`` (the copy's directory), ``durable_moved``,
    ``durable_files``, ``durable_verified`` (None without a copy), ``durable_check``, ``durable_problem``."""
    where = locate(archived_path, entry, run, durable_dir)
    facts = {"durable_dir": where["path"], "durable_moved": where["moved"], "durable_files": 0}
    facts.update(durable_verified=None, durable_check=None, durable_problem=where["problem"])
    if where["path"] is None:
        return facts
    found = check_copy(where["path"], rehash)
    facts.update(durable_files=found["files"], durable_verified=found["verified"], durable_check=found["check"])
    facts["durable_problem"] = "; ".join(part for part in (where["problem"], found["problem"]) if part) or None
    return facts
