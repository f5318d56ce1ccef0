# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Remove torn-down runs' scratch: ``<data_dir>/runs/<run>`` and the profile's extra paths, nothing else.

The only code of the collection that deletes a user's files. Every target of every run is resolved and checked
against every refusal (``_scratch_checks``) before anything is removed, and no run may be alive. Then, run by run:
the tombstone ``<data_dir>/runs/.torn_down/<run>.json`` says ``removing`` (and what) before the first file goes,
each cell's durable files are re-hashed immediately before that cell's scratch goes (any difference stops
everything), the rest of the run directory goes, and the tombstone says ``removed``; the extra paths go last. A
re-run finishes a removal whose tombstone still says ``removing``. Removal never follows a symbolic link. Checks
and removal run in forked children under one deadline (a hung mount fails, not hangs). Pure standard library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, read_json_quietly
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MANIFEST_NAME,
    NAME_PATTERN,
    RUN_MARKER,
    Run,
    durable_run_dir,
    launch_lock,
    run_dir,
    runs_root,
    tombstone_path,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _copy_verify as copies
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _scratch_checks as checks
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import parse_manifest

DEFAULT_TIMEOUT_S = 600.0
RERUN = "its tombstone says removing: run again to finish once the durable copy verifies"


class ScratchFailure(Exception):
    """The module's failure: a one-line message and the result keys that go with it."""

    def __init__(self, message: str, facts: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.facts = dict(facts)


def _removing(tombstone: Optional[Mapping[str, Any]]) -> bool:
    return tombstone is not None and tombstone.get("state") == "removing"


def _liveness_problems(data_dir: str, run: str, removing: bool) -> Tuple[List[str], List[str]]:
    """Why the run may not lose its files now (it is alive, or its run.json cannot say), and the durable_dir
    paths its run.json records. A removal that stopped halfway may have taken run.json: its markers still count."""
    disk = OnDisk(data_dir, run)
    recorded = [disk.record.get("durable_dir")] if isinstance(disk.record.get("durable_dir"), str) else []
    if disk.problem and not removing:
        why = f"its run.json cannot be read, so whether it is alive is unknown (fix or remove {disk.run_dir}/run.json)"
        return [f"run {run}: {why}"], recorded
    if disk.live and disk.registered is not None:
        pgid = disk.registered.pgid
        return [f"run {run} is alive (pgid {pgid}): stop it first (training_run state=stopped)"], recorded
    directories = {disk.run_dir, os.path.normpath(disk.run_dir), os.path.realpath(disk.run_dir)}
    markers = [f"{RUN_MARKER}={directory}" for directory in sorted(directories)]
    left = detach.run_members(Run(run, disk.run_dir), markers)
    if left:
        pids = ", ".join(str(proc.pid) for proc in left[:10])
        return [f"run {run}: {len(left)} process(es) it started still run (pids {pids}): stop them first"], recorded
    return [], recorded


def plan(request: Mapping[str, Any]) -> Dict[str, Any]:
    """Every existing target with its size, every refusal, and each run's tombstone (run in a child under the
    deadline)."""
    data_dir = request["data_dir"]
    if os.path.realpath(data_dir) == "/":
        return {"targets": [], "problems": [f"data_dir {data_dir} resolves to /"], "tombstones": {}}
    extras, problems = checks.extra_targets(request)
    tombstones = {run: read_json_quietly(tombstone_path(data_dir, run)) for run in request["runs"]}
    recorded: List[str] = []
    for run in request["runs"]:
        alive, durables = _liveness_problems(data_dir, run, _removing(tombstones[run]))
        problems += alive
        recorded += durables
    context = checks.Context(request, recorded)
    named = [(os.path.normpath(run_dir(data_dir, run)), run) for run in request["runs"]]
    targets = []
    for path, run in named + [(path, None) for path in extras]:
        target, refused = checks.plan_target(path, context, run)
        problems += refused
        if target is not None:
            targets.append(target)
    # A target named twice is removed once; one inside another (non-link) directory target goes with it.
    targets = list({t["location"]: t for t in reversed(targets)}.values())[::-1]
    outer = [t["location"] for t in targets if t["dir"] and not t["link"]]
    targets = [t for t in targets if not any(checks.inside(t["location"], other) for other in outer)]
    return {"targets": targets, "problems": problems, "tombstones": tombstones}


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _entry(target: Mapping[str, Any]) -> Dict[str, Any]:
    return {"path": target["path"], "files": target["files"], "bytes": target["bytes"], "run": target["run"]}


def _checked_again(target: Mapping[str, Any]) -> os.stat_result:
    info = os.lstat(target["location"])
    if (info.st_dev, info.st_ino) != (target["device"], target["inode"]):
        raise OSError(f"{target['path']} changed since it was checked; not removed")
    return info


def _remove_one(target: Mapping[str, Any]) -> None:
    info = _checked_again(target)
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(target["location"])  # never a link (lstat): rmtree unlinks the links inside, never follows
    else:
        os.unlink(target["location"])


def _cell_of(path: str) -> Optional[str]:
    parts = path.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "cells" else None


def _read_manifest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as handle:
            return handle.read(64 * 1024 * 1024).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


class _Remover:
    """Removes the planned targets run by run and cell by cell, re-checking the durable copy before each cell."""

    def __init__(self, request: Mapping[str, Any], deadline: float, runs: Sequence[Dict[str, Any]]) -> None:
        self.request = request
        self.deadline = deadline
        self.removed: List[Dict[str, Any]] = []
        self.runs = {entry["run"]: entry for entry in runs}
        self.mismatch: Optional[Dict[str, Any]] = None

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise OSError("no time left of timeout_s")
        return remaining

    def expected(self, run: str) -> List[Dict[str, Any]]:
        """What the durable copy must hold: the ``expected`` option's entries, else its manifest's, else nothing."""
        given = (self.request.get("expected") or {}).get(run)
        durable_dir = self.request.get("durable_dir")
        if given is not None or not durable_dir:
            return list(given or [])
        path = os.path.join(durable_run_dir(durable_dir, run), MANIFEST_NAME)
        answer = run_with_deadline({"manifest": functools.partial(_read_manifest, path)}, self._remaining())
        if "value" not in answer["manifest"]:
            raise OSError(f"{path}: {answer['manifest'].get('error') or 'did not answer (a hung mount?)'}")
        entries, _bad = parse_manifest(answer["manifest"]["value"] or "")
        return [{"path": path, **entry} for path, entry in sorted(entries.items())]

    def durable_differs(self, run: str, entries: Sequence[Mapping[str, Any]]) -> bool:
        """Re-hash ``entries`` under the durable copy now; record the first difference."""
        if not entries:
            return False
        root = durable_run_dir(self.request["durable_dir"], run)
        answer = copies.digests(root, [entry["path"] for entry in entries], self._remaining())
        differs = None
        if "problem" in answer:
            differs = {"path": root, "problem": answer["problem"]}
        else:
            found = (copies.mismatch(entry, answer["files"][entry["path"]]) for entry in entries)
            differs = next((difference for difference in found if difference is not None), None)
        if differs is not None:
            self.mismatch = dict(differs, run=run, cell=_cell_of(str(differs["path"])))
            return True
        self.runs[run]["verified"] += len(entries)
        return False

    def remove_run(self, run: str, target: Optional[Mapping[str, Any]]) -> bool:
        """Cell by cell, then the rest of the run directory; False when the durable copy changed (stops all)."""
        pending = self.expected(run)
        removed_cells: List[Dict[str, Any]] = []
        if target is not None and target["dir"] and not target["link"]:
            _checked_again(target)
            cells = os.path.join(target["location"], "cells")
            names = sorted(os.listdir(cells)) if os.path.isdir(cells) and not os.path.islink(cells) else []
            for name in names:
                path = os.path.join(cells, name)
                if not os.path.isdir(path) or os.path.islink(path):
                    continue
                mine = [entry for entry in pending if _cell_of(entry["path"]) == name]
                if self.durable_differs(run, mine):
                    self.removed += removed_cells
                    return False
                pending = [entry for entry in pending if _cell_of(entry["path"]) != name]
                files, size, _problem = checks.walk(path)
                shutil.rmtree(path)  # a real directory inside the checked run directory; links inside are unlinked
                removed_cells.append({"path": path, "files": files, "bytes": size, "run": run})
        if self.durable_differs(run, pending):
            self.removed += removed_cells
            return False
        if target is not None:
            try:
                _remove_one(target)
            except OSError:
                self.removed += removed_cells
                raise
            self.removed.append(_entry(target))
        return True

    def facts(self, error: Optional[str]) -> Dict[str, Any]:
        return {"removed": self.removed, "runs": list(self.runs.values()), "mismatch": self.mismatch, "error": error}

    def record(self, run: str, state: str, removed: Sequence[Mapping[str, Any]], **more: Any) -> None:
        tombstone = tombstone_path(self.request["data_dir"], run)
        earlier = read_json_quietly(tombstone) or {}
        kept = [entry for entry in earlier.get("removed") or [] if isinstance(entry, dict)]
        os.makedirs(os.path.dirname(tombstone), exist_ok=True)
        write_json_atomic(tombstone, {"run": run, "state": state, "removed": kept + list(removed), **more})
        self.runs[run]["tombstone"] = tombstone


def remove(request: Mapping[str, Any], planned: Mapping[str, Any], deadline: float) -> Dict[str, Any]:
    """Under the launch lock: re-check that no run is alive, then per run write the tombstone ``removing``, remove
    it cell by cell (each cell's durable files re-hashed first), write the tombstone ``removed``; then the extra
    paths. Stops at the first difference or error, with what went before it."""
    data_dir = request["data_dir"]
    remover = _Remover(request, deadline, _planned_runs(request, planned, check_mode=False))
    by_run = {target["run"]: target for target in planned["targets"] if target["run"] is not None}
    extras = [target for target in planned["targets"] if target["run"] is None]
    todo = [run for run, entry in remover.runs.items() if entry["state"] == "pending"]
    lock_s = max(0.1, (deadline - time.monotonic()) / 2)  # a held lock fails before the deadline
    try:
        with launch_lock(data_dir, lock_s) if os.path.isdir(runs_root(data_dir)) else contextlib.nullcontext():
            for run in todo:
                alive, _recorded = _liveness_problems(data_dir, run, _removing(planned["tombstones"].get(run)))
                if alive:
                    return remover.facts(f"{alive[0]}; nothing removed")
            for run in todo:
                target = by_run.get(run)
                remover.record(run, "removing", [], started_at=_utc_now(), removing=[_entry(target)] if target else [])
                remover.runs[run]["state"] = "stopped"
                before = len(remover.removed)
                if not remover.remove_run(run, target):
                    return remover.facts(None)
                remover.record(run, "removed", remover.removed[before:], removed_at=_utc_now())
                remover.runs[run]["state"] = "removed"
            for target in extras:
                _remove_one(target)
                remover.removed.append(_entry(target))
            for run in request["runs"] if extras else ():
                remover.record(run, "removed", [_entry(target) for target in extras], removed_at=_utc_now())
    except OSError as exc:  # LaunchLockBusy is a TimeoutError, an OSError
        return remover.facts(str(exc))
    return remover.facts(None)


def _check_request(params: Mapping[str, Any]) -> Dict[str, Any]:
    runs = params.get("runs") or []
    if isinstance(runs, str):
        runs = [runs]
    if not runs:
        raise ValueError("runs must name at least one run")
    for run in runs:
        if not isinstance(run, str) or not NAME_PATTERN.match(run):
            raise ValueError(f"run must match {NAME_PATTERN.pattern}, not {run!r}")
    data_dir = params.get("data_dir") or ""
    if not os.path.isabs(data_dir):
        raise ValueError(f"data_dir must be an absolute path, not {data_dir!r}")
    durable = params.get("durable_dir") or None
    if durable is not None and not os.path.isabs(durable):
        raise ValueError(f"durable_dir must be an absolute path, not {durable!r}")
    if params.get("state", "absent") != "absent":
        raise ValueError(f"state must be absent, not {params.get('state')!r}")
    expected = params.get("expected") or {}
    if not isinstance(expected, Mapping):
        raise ValueError("expected must be a dict of run name to a list of {path, size, sha256}")
    checked: Dict[str, List[Dict[str, Any]]] = {}
    for run, entries in expected.items():
        if run not in runs:
            raise ValueError(f"expected names run {run!r}, which runs does not")
        if entries and durable is None:
            raise ValueError(f"expected lists files of run {run} but durable_dir is not set")
        try:
            checked[run] = copies.checked_expected(entries)
        except ValueError as exc:
            raise ValueError(f"expected.{run}: {exc}") from None
    request = {"runs": list(dict.fromkeys(runs)), "data_dir": data_dir, "durable_dir": durable}
    return dict(request, extra_paths=list(params.get("extra_paths") or []), expected=checked)


def _summary(entries: Sequence[Mapping[str, Any]]) -> str:
    files, size = sum(e["files"] for e in entries), sum(e["bytes"] for e in entries)
    return f"{len(entries)} path(s), {files} file(s), {size} bytes"


def _which(runs: Sequence[str]) -> str:
    return f"run {runs[0]}" if len(runs) == 1 else f"runs {', '.join(runs)}"


def _planned_runs(request: Mapping[str, Any], planned: Mapping[str, Any], check_mode: bool) -> List[Dict[str, Any]]:
    """Each run's entry before removal: what an unchanged box would see (and check mode reports)."""
    entries = []
    data_dir = request["data_dir"]
    with_target = {target["run"] for target in planned["targets"]}
    for run in request["runs"]:
        tombstone = planned["tombstones"].get(run)
        state = "nothing"
        if run in with_target or _removing(tombstone):
            state = "would_remove" if check_mode else "pending"
        elif tombstone is not None:
            state = "already_removed"
        path = tombstone_path(data_dir, run) if tombstone is not None or state == "would_remove" else None
        entries.append({"run": run, "state": state, "tombstone": path, "verified": 0})
    return entries


def run_scratch(params: Mapping[str, Any], check_mode: bool) -> Dict[str, Any]:
    """The module's work: ValueError for a bad option, ScratchFailure for a refusal, a durable file that changed,
    or a failed removal."""
    request = _check_request(params)
    timeout_s = float(params.get("timeout_s") or DEFAULT_TIMEOUT_S)
    which = _which(request["runs"])
    deadline = time.monotonic() + timeout_s
    facts: Dict[str, Any] = {"refused": False, "problems": [], "removed": [], "would_remove": [], "runs": []}
    facts["durable_mismatch"] = None
    answer = run_with_deadline({"plan": functools.partial(plan, request)}, timeout_s)["plan"]
    if "value" not in answer:
        why = answer.get("error") or f"did not answer within {timeout_s:g} s (a hung mount?)"
        raise ScratchFailure(f"run_scratch {which}: checking the targets failed: {why}; nothing removed", facts)
    planned = answer["value"]
    facts["runs"] = _planned_runs(request, planned, check_mode)
    if planned["problems"]:
        problems = planned["problems"]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        facts.update(refused=True, problems=problems)
        raise ScratchFailure(f"run_scratch refused: {problems[0]}{more}; nothing removed", facts)
    entries = [_entry(target) for target in planned["targets"]]
    to_finish = [entry["run"] for entry in facts["runs"] if entry["state"] in ("pending", "would_remove")]
    if not entries and not to_finish:
        removed_at = [str((planned["tombstones"].get(r) or {}).get("removed_at")) for r in request["runs"]]
        when = f" (torn down at {', '.join(removed_at)})" if any(planned["tombstones"].values()) else ""
        return dict(facts, changed=False, msg=f"nothing to remove for {which}{when}")
    if check_mode:
        return dict(facts, changed=True, would_remove=entries, msg=f"would remove {_summary(entries)} of {which}")
    done = run_with_deadline({"remove": functools.partial(remove, request, planned, deadline)}, timeout_s)["remove"]
    if "value" not in done:
        why = done.get("error") or f"did not finish within {timeout_s:g} s (a hung mount?); part of it may be gone"
        raise ScratchFailure(f"run_scratch {which}: removal failed: {why}; where {RERUN}", facts)
    outcome = done["value"]
    facts.update(removed=outcome["removed"], runs=outcome["runs"], durable_mismatch=outcome["mismatch"])
    gone = f" after removing {_summary(facts['removed'])}" if facts["removed"] else ""
    mismatch = outcome["mismatch"]
    if mismatch is not None:
        where = f"run {mismatch['run']}, cell {mismatch['cell']}" if mismatch["cell"] else f"run {mismatch['run']}"
        message = f"the durable copy changed since the gate ({where}: {mismatch['path']}: {mismatch['problem']})"
        raise ScratchFailure(f"run_scratch stopped: {message}; nothing more removed{gone}", facts)
    if outcome["error"]:
        halfway = any(entry["state"] == "stopped" for entry in outcome["runs"])
        raise ScratchFailure(f"run_scratch {which}: {outcome['error']}{gone}{'; ' + RERUN if halfway else ''}", facts)
    return dict(facts, changed=True, msg=f"removed {_summary(facts['removed'])} of {which}")
