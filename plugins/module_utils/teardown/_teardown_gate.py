# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The box's part of teardown's gate (contracts/run-layout.md): may these runs' scratch go and the meter stop?

Per run, in order, stopping at the run's first failed step:

1. ``run_alive``: the run is found and nothing of it runs (its runner, or a process carrying its ``RGT_RUN_DIR``).
2. ``cells``: every cell is done (succeeded, and its artifacts verified), or named in ``accept_incomplete_cells``.
3. ``durable``: every artifact of the done cells is under ``<durable_dir>/runs/<run>/``, a plain file with the size
   and a sha256 recomputed now that match its ``result.json`` record and its ``MANIFEST.sha256`` line; the scratch
   file it was copied from, where it still exists, hashes the same (else the durable copy is stale); and neither
   the durable copy nor durable_dir overlaps what teardown removes (``<data_dir>/runs``, the extra paths).

A run teardown already removed (its tombstone ``<data_dir>/runs/.torn_down/<run>.json``, no run directory), or
whose removal did not finish (tombstone state ``removing``), is checked against its manifest alone. With
``instance`` (the meter stops) the box is judged too (``_teardown_instance``): its own id (``instance_id``), every
other run on it in every data dir of the box (``other_runs``; a finished or archived one loses nothing by a verb
that keeps both directories, ``survives``), every process that uses a GPU outside every run (``gpu_users``) and,
for an irreversible verb, whether durable_dir shares data_dir's filesystem (``same_filesystem``). Read-only.
Pure standard library.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._ledger import cost_basis
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import (
    OnDisk,
    read_json,
    read_json_quietly,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MANIFEST_NAME,
    NAME_PATTERN,
    RUN_MARKER,
    SHA256_PATTERN,
    Run,
    cell_dir,
    durable_run_dir,
    list_runs,
    parse_result,
    result_json,
    run_dir,
    runs_root,
    tombstone_path,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import RunSpec, load_spec
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _copy_verify as copies
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_box as whole
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_hold as holding
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_instance as box

MAX_MANIFEST_LINES = 100_000
MAX_EXTRA_LISTED = 1000
DATA_DIR_TIMEOUT_S = 20.0
STEPS = ("box_lease", "instance_id", "run_alive", "cells", "durable", "other_runs", "gpu_users", "same_filesystem")


def parse_manifest(text: str) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """``{path: {size, sha256}}`` from ``MANIFEST.sha256`` text, and the lines that are not a valid entry. A line
    starting with ``#`` is a comment (a known-bad mark: ``_copy_verify.known_bad``), neither."""
    entries: Dict[str, Dict[str, Any]] = {}
    bad: List[str] = []
    for line in text.splitlines()[:MAX_MANIFEST_LINES]:
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("  ", 2)
        try:
            if len(fields) != 3 or not SHA256_PATTERN.match(fields[0]) or not fields[1].isdigit():
                raise ValueError(line)
            entries[copies.checked_relative(fields[2])] = {"size": int(fields[1]), "sha256": fields[0]}
        except ValueError:
            bad.append(line[:200])
    return entries, bad


def _overlaps(path: str, other: str) -> bool:
    """One of two normalised absolute paths is the other or lies inside it."""
    return path == other or path.startswith(other.rstrip("/") + "/") or other.startswith(path.rstrip("/") + "/")


def _read_durable(durable_run: str, guarded: Sequence[str], removed: Sequence[str]) -> Dict[str, Any]:
    """The manifest's text and digest, every file path under the durable run directory (capped), and each path
    teardown removes that overlaps a ``guarded`` one (the durable copy, durable_dir), all resolved."""
    reals = [os.path.realpath(path) for path in guarded]
    overlapping = [path for path in removed if any(_overlaps(real, os.path.realpath(path)) for real in reals)]
    if overlapping:
        return {"exists": os.path.isdir(durable_run), "overlapping": overlapping}
    if not os.path.isdir(durable_run):
        return {"exists": False, "overlapping": []}
    manifest = os.path.join(durable_run, MANIFEST_NAME)
    text, digest = None, None
    if os.path.isfile(manifest):
        with open(manifest, "rb") as handle:
            raw = handle.read(64 * 1024 * 1024)
        text, digest = raw.decode("utf-8", errors="replace"), hashlib.sha256(raw).hexdigest()
    files: List[str] = []
    for top, directories, names in os.walk(durable_run):
        directories.sort()
        for name in sorted(names):
            relative = os.path.relpath(os.path.join(top, name), durable_run)
            if not name.startswith(".") and relative != MANIFEST_NAME:
                files.append(relative)
        if len(files) > MAX_EXTRA_LISTED * 10:
            break
    return {"exists": True, "manifest_text": text, "manifest_sha256": digest, "files": files, "overlapping": []}


class Gate:
    """Collects each step's evidence; ``refuse`` records the first failure."""

    def __init__(self, params: Mapping[str, Any], run: str, removed: Sequence[str]) -> None:
        self.run = run
        self.data_dir: str = params["data_dir"]
        self.durable_dir: Optional[str] = params.get("durable_dir") or None
        self.removed = list(removed)  # what teardown removes: the durable copy must not overlap any of it
        self.accepted = list(params.get("accept_incomplete_cells") or [])
        self.accept_no_artifacts = bool(params.get("accept_no_artifacts"))
        self.timeout_s = float(params.get("verify_timeout_s") or copies.DEFAULT_TIMEOUT_S)
        self.recorded: Dict[str, Tuple[Any, ...]] = {}  # cell -> its result.json's artifacts
        durable_run = durable_run_dir(self.durable_dir, self.run) if self.durable_dir else None
        self.result: Dict[str, Any] = {
            "passed": False,
            "step": None,
            "reason": "",
            "run": {"name": self.run, "state": "absent", "pgid": None, "sid": None, "started_at": None},
            "cells": [],
            "missing_cells": [],
            "durable": {
                "dir": durable_run,
                "exists": False,
                "files": 0,
                "bytes": 0,
                "mismatches": [],
                "manifest": None,
                "extra": [],
            },
            "artifacts": [],
            "scratch": {"dir": run_dir(self.data_dir, self.run), "exists": False},
            "torn_down": None,
            "notes": [],
        }

    def refuse(self, step: str, reason: str) -> Dict[str, Any]:
        self.result.update(passed=False, step=step, reason=reason)
        return self.result

    def _leftovers(self, directory: str) -> Optional[str]:
        """The refusal when processes carrying the run's marker still run (a worker that left with setsid)."""
        variants = {directory, os.path.normpath(directory), os.path.realpath(directory)}
        left = detach.run_members(Run(self.run, directory), [f"{RUN_MARKER}={path}" for path in sorted(variants)])
        if not left:
            return None
        self.result["run"]["state"] = "running"
        pids = ", ".join(str(proc.pid) for proc in left[:5])
        return f"its runner is gone but {len(left)} of its processes run (pid {pids}): stop them first"

    def check_run(self) -> Tuple[Optional[str], Optional[OnDisk]]:
        """The run step's refusal, if any, and the run's state on disk (None when only its manifest is judged:
        teardown removed its scratch, or began to)."""
        scratch = self.result["scratch"]
        probe = {"isdir": functools.partial(os.path.isdir, scratch["dir"])}
        answer = run_with_deadline(probe, DATA_DIR_TIMEOUT_S)["isdir"]
        if "value" not in answer:
            return f"data_dir {self.data_dir} did not answer within {DATA_DIR_TIMEOUT_S:g} s (a hung mount?)", None
        scratch["exists"] = bool(answer["value"])
        tombstone = read_json_quietly(tombstone_path(self.data_dir, self.run))
        removing = tombstone is not None and tombstone.get("state") == "removing"
        if not scratch["exists"] or removing:
            if tombstone is None:
                return f"not found: {scratch['dir']} does not exist and teardown never removed it", None
            # A removal stopped halfway may have taken run.json: only the manifest says what must survive.
            self.result.update(torn_down=tombstone)
            self.result["run"]["state"] = "removing" if removing else "torn_down"
            disk = OnDisk(self.data_dir, self.run) if scratch["exists"] else None
            if disk is not None and disk.live:
                return f"its runner is alive again (pgid {disk.record.get('pgid')}): stop it first", None
            return self._leftovers(scratch["dir"]), None
        disk = OnDisk(self.data_dir, self.run)
        if disk.problem:
            self.result["notes"].append(disk.problem)
        record = disk.record
        self.result["run"].update(
            state=disk.state, pgid=record.get("pgid"), sid=record.get("sid"), started_at=record.get("started_at")
        )
        if disk.live:
            return f"its runner is alive (pgid {record.get('pgid')}): stop it first (stop_running)", disk
        leftover = self._leftovers(disk.run_dir)
        if leftover:
            return leftover, disk
        if disk.registered is None:
            return f"no readable run.json in {scratch['dir']}", disk
        return None, disk

    def check_cells(self, disk: OnDisk, spec: Optional[RunSpec]) -> Optional[str]:
        # The done rule is per cell: a cell's own artifact lists replace the run's. Without a spec (or for a cell it
        # does not name) the strict reading holds: sync must be verified.
        declares = {cell.name: spec.declares_artifacts(cell) for cell in spec.cells} if spec is not None else {}
        names = [str(cell.get("name")) for cell in disk.record.get("cells") or [] if isinstance(cell, Mapping)]
        unknown = sorted(set(self.accepted) - set(names))
        if unknown:
            self.result["notes"].append(
                f"accept_incomplete_cells names no cell of run {self.run}: {', '.join(unknown)}"
            )
        problems: List[str] = []
        for name in names:
            entry: Dict[str, Any] = {"name": name, "status": None, "sync": None, "done": False, "accepted": False}
            why = "no result"
            try:
                data = read_json(result_json(self.data_dir, self.run, name))
                if data is not None:
                    parsed = parse_result(data)
                    entry.update(
                        status=parsed.status, sync=parsed.sync, done=parsed.counts_as_done(declares.get(name, True))
                    )
                    self.recorded[name] = parsed.artifacts
                    said = str(data.get("reason") or "")[:120]  # a stop on purpose says who stopped it, and when
                    why = (
                        said
                        if parsed.status != "succeeded" and said.startswith("stopped by ")
                        else f"{parsed.status}, exit {parsed.exit_code}"
                        if parsed.status != "succeeded"
                        else f"sync {parsed.sync}"
                    )
            except ValueError as exc:
                why = f"unreadable result.json ({exc})"
            if not entry["done"]:
                entry["accepted"] = name in self.accepted
                if not entry["accepted"]:
                    problems.append(f"{name} ({why})")
            self.result["cells"].append(entry)
        if not names:
            return "run.json lists no cells"
        self.result["missing_cells"] = [p.split(" (", 1)[0] for p in problems]
        if problems:
            return f"cells not done: {'; '.join(problems)} (list them in accept_incomplete_cells to tear down anyway)"
        return None

    def expected_artifacts(self) -> List[Dict[str, Any]]:
        expected = []
        for entry in self.result["cells"]:
            for artifact in self.recorded.get(entry["name"], ()) if entry["done"] else ():
                path = f"cells/{entry['name']}/{artifact.path}"
                expected.append(
                    {
                        "path": path,
                        "size": artifact.size,
                        "sha256": artifact.sha256,
                        "cell": entry["name"],
                        "relative": artifact.path,
                    }
                )
        return expected

    def check_durable(
        self, expected: List[Dict[str, Any]], spec: Optional[RunSpec], from_manifest: bool
    ) -> Optional[str]:
        durable = self.result["durable"]
        nothing_secured = not expected and not from_manifest
        gone_after_teardown = from_manifest and not (durable["dir"] and os.path.isdir(durable["dir"]))
        if nothing_secured or (gone_after_teardown and self.accept_no_artifacts):
            if self.accept_no_artifacts:
                self.result["notes"].append(f"run {self.run} secured no artifacts; accepted (accept_no_artifacts)")
                return None
            return (
                "secured no artifacts in durable_dir: its scratch would be the only copy "
                "(declare launch_artifacts, or set accept_no_artifacts)"
            )
        if durable["dir"] is None or self.durable_dir is None:
            return "it has artifacts but no durable_dir is set"
        read = functools.partial(_read_durable, durable["dir"], [durable["dir"], self.durable_dir], self.removed)
        answer = run_with_deadline({"durable": read}, self.timeout_s)["durable"]
        if answer.get("timed_out"):
            return f"durable copy {durable['dir']} did not answer within {self.timeout_s:g} s (a hung mount?)"
        if "error" in answer:
            return f"durable copy {durable['dir']}: {answer['error']}"
        listing = answer["value"]
        if listing["overlapping"]:
            overlap = listing["overlapping"][0]
            where = f"durable copy {durable['dir']} (durable_dir {self.durable_dir})"
            return f"{where} overlaps {overlap}, which teardown removes"
        if not listing["exists"]:
            return f"durable copy {durable['dir']} does not exist"
        durable["exists"] = True
        if listing["manifest_text"] is None:
            return f"durable copy {durable['dir']} has no {MANIFEST_NAME}"
        manifest, bad_lines = parse_manifest(listing["manifest_text"])
        durable["manifest"] = {
            "path": os.path.join(durable["dir"], MANIFEST_NAME),
            "sha256": listing["manifest_sha256"],
            "lines": len(manifest),
            "bad_lines": bad_lines[:5],
            "known_bad": copies.known_bad(listing["manifest_text"])[: copies.MAX_REPORTED],
        }
        if from_manifest:
            expected = [{"path": path, **entry} for path, entry in sorted(manifest.items())]
        durable["extra"] = [path for path in listing["files"] if path not in manifest][:MAX_EXTRA_LISTED]
        mismatches: List[Dict[str, Any]] = []
        for entry in expected:
            line = manifest.get(entry["path"])
            if line is None:
                mismatches.append({"path": entry["path"], "problem": f"not in {MANIFEST_NAME}"})
            elif (line["size"], line["sha256"]) != (entry["size"], entry["sha256"]):
                mismatches.append({"path": entry["path"], "problem": f"{MANIFEST_NAME} disagrees with its result.json"})
        plain = [{key: entry[key] for key in ("path", "size", "sha256")} for entry in expected]
        checked = copies.verify_copy(durable["dir"], plain, self.timeout_s)
        if checked["reason"] and not checked["mismatches"]:
            return checked["reason"]
        mismatches += checked["mismatches"]
        durable.update(files=checked["files"], bytes=checked["bytes"])
        if not from_manifest:
            mismatches += self._stale_scratch(expected, spec)
        durable["mismatches"] = mismatches[: copies.MAX_REPORTED]
        if mismatches:
            more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
            return f"durable copy does not match: {mismatches[0]['path']}: {mismatches[0]['problem']}{more}"
        self.result["artifacts"] = plain
        return None

    def _stale_scratch(self, expected: List[Dict[str, Any]], spec: Optional[RunSpec]) -> List[Dict[str, Any]]:
        """Scratch files that no longer hash like the copy made of them; a scratch file gone is fine."""
        bases = {cell.name: cell.checkpoint_dir for cell in spec.cells} if spec is not None else {}
        by_base: Dict[str, List[Dict[str, Any]]] = {}
        for entry in expected:
            base = bases.get(entry["cell"]) or cell_dir(self.data_dir, self.run, entry["cell"])
            by_base.setdefault(base, []).append(entry)
        stale: List[Dict[str, Any]] = []
        for base, entries in by_base.items():
            answer = copies.digests(base, [entry["relative"] for entry in entries], self.timeout_s)
            for entry in entries:
                found = answer.get("files", {}).get(entry["relative"], {"problem": "missing"})
                if found.get("problem") == "missing" or "problem" in answer:
                    continue
                differs = copies.mismatch(entry, found)
                if differs is not None:
                    problem = f"the scratch file {os.path.join(base, entry['relative'])} differs from its copy"
                    stale.append({**differs, "problem": f"{problem} ({differs['problem']})"})
        return stale


def judge_run(params: Mapping[str, Any], run: str, removed: Sequence[str]) -> Dict[str, Any]:
    """One run's evidence and verdict (its first failed step); ``removed``: every path teardown removes."""
    gate = Gate(params, run, removed)
    refusal, disk = gate.check_run()
    if refusal:
        return gate.refuse("run_alive", refusal)
    spec: Optional[RunSpec] = None
    expected: List[Dict[str, Any]] = []
    if disk is not None:
        try:
            spec = load_spec(disk.run_dir)
        except (OSError, ValueError):
            gate.result["notes"].append(f"run {gate.run} has no readable spec.json: scratch files not compared")
        refusal = gate.check_cells(disk, spec)
        if refusal:
            return gate.refuse("cells", refusal)
        expected = gate.expected_artifacts()
    refusal = gate.check_durable(expected, spec, from_manifest=disk is None)
    if refusal:
        return gate.refuse("durable", refusal)
    gate.result.update(passed=True, step=None, reason="")
    return gate.result


def _names(params: Mapping[str, Any], key: str) -> List[str]:
    names = params.get(key) or []
    for name in names:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(f"{key}: each entry must match {NAME_PATTERN.pattern}, not {name!r}")
    return list(dict.fromkeys(names))


def _checked(params: Mapping[str, Any]) -> Dict[str, Any]:
    """The options only the layout's rules can judge; ValueError names the bad one."""
    for key in ("data_dir", "durable_dir"):
        if params.get(key) and not os.path.isabs(params[key]):
            raise ValueError(f"{key} must be an absolute path, not {params[key]!r}")
    extra = list(params.get("scratch_extra_paths") or [])
    for path in extra:
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"scratch_extra_paths: each entry must be an absolute path, not {path!r}")
    for kept in params.get("survives") or []:
        if kept not in whole.SURVIVABLE:
            raise ValueError(f"survives: each entry must be data_dir or durable_dir, not {kept!r}")
    runs, abandon = _names(params, "runs"), _names(params, "abandon_runs")
    both = sorted(set(runs) & set(abandon))
    if both:
        raise ValueError(f"abandon_runs names {', '.join(both)}, which runs tears down: name each run in one of them")
    return {"runs": runs, "abandon": abandon, "extra": extra}


def _listing(data_dir: str) -> List[str]:
    if not os.path.isdir(data_dir):
        raise ValueError("not found" if not os.path.lexists(data_dir) else "not a directory")
    return list_runs(data_dir)


def teardown_gate(
    params: Mapping[str, Any], environ_path: str = "", proc: str = "/proc", check_mode: bool = False
) -> Dict[str, Any]:
    """The gate's evidence and verdict over ``runs`` (every run on the box when empty) and, with ``instance``,
    the box; ValueError for an option only the layout's rules can judge. ``environ_path``: PID 1's environment.
    Whatever the verdict, ``instance`` carries the box's cost basis (``box_now``, ``box_started_at``, ``ledger``:
    ``_ledger.cost_basis``, PID 1 read from ``proc``), read only: the gate records no ledger.

    With ``hold_box`` (``{token, ttl_s}``; never in ``check_mode``) the box is taken for this teardown before it is
    judged (another stage holding it refuses at ``box_lease``) and held for ``ttl_s`` more once judged: ``lease``."""
    _checked(params)
    hold = None if check_mode else params.get("hold_box")
    lease: Optional[Dict[str, Any]] = None
    other: Optional[Dict[str, Any]] = None
    note: Optional[str] = None
    if hold:
        token, ttl_s = holding.checked(hold.get("token"), hold.get("ttl_s"), "hold_box")
        lease, other, note = holding.hold(token, ttl_s)
    result = _judge(params, environ_path, holding.held_by(other) if other else None)
    if lease is not None:
        lease, other, _note = holding.hold(token, ttl_s)  # its ttl counts from now, the judgement done
        if other is not None:
            result.update(passed=False, step="box_lease", reason=holding.held_by(other))
    result.update(lease=lease, held_by=other)
    result["notes"] += [note] if note else []
    result["instance"].update(cost_basis([params["data_dir"]], write=False, proc=proc))
    return result


def _judge(params: Mapping[str, Any], environ_path: str, held: Optional[str] = None) -> Dict[str, Any]:
    checked = _checked(params)
    runs, abandon, data_dir = checked["runs"], checked["abandon"], params["data_dir"]
    instance: Dict[str, Any] = {"runs_on_box": [], "other_runs": [], "live_marker_pids": [], "id_checked": False}
    instance.update(data_dirs=[], gpu_users=[], gpu_users_unreadable=0)
    instance.update(dict.fromkeys(("id_expected", "id_found", "id_source", "same_device", "data_dev", "durable_dev")))
    result: Dict[str, Any] = {"passed": False, "step": None, "reason": "", "runs": [], "instance": instance}
    result["notes"] = notes = []

    def refuse(step: str, reason: str) -> Dict[str, Any]:
        result.update(passed=False, step=step, reason=reason)
        return result

    if held:
        return refuse("box_lease", held)
    if params.get("instance_id"):
        facts, refusal, note = box.check_instance_id(
            params["instance_id"], params.get("instance_id_env") or [], environ_path
        )
        instance.update(facts)
        notes += [note] if note else []
        if refusal:
            return refuse("instance_id", refusal)
    on_box: List[str] = []
    if not runs or params.get("instance"):
        answer = run_with_deadline({"runs": functools.partial(_listing, data_dir)}, DATA_DIR_TIMEOUT_S)["runs"]
        if "value" not in answer:
            why = answer.get("error") or f"did not answer within {DATA_DIR_TIMEOUT_S:g} s (a hung mount?)"
            return refuse("run_alive", f"data_dir {data_dir}: {why}, so the runs on the box are unknown")
        instance["runs_on_box"] = on_box = answer["value"]
        runs = runs or on_box
        notes += [] if runs else [f"no run under {runs_root(data_dir)}"]
    removed = [runs_root(data_dir), *checked["extra"]]
    failures: List[Tuple[str, str]] = []
    for run in runs:
        entry = judge_run(params, run, removed)
        result["runs"].append(entry)
        if not entry["passed"]:
            failures.append((entry["step"], f"run {run}: {entry['reason']}"))
    if params.get("instance"):
        facts, more, more_notes = box.judge_instance(params, runs, on_box, abandon)
        instance.update(facts)
        failures += more
        notes += more_notes
    else:
        idle = [key for key in ("abandon_runs", "abandon_gpu_users") if params.get(key)]
        notes += [f"{key} has no effect without instance (no meter-stop)" for key in idle]
    if failures:
        return refuse(*min(failures, key=lambda failure: STEPS.index(failure[0])))
    result.update(passed=True, step=None, reason="")
    return result
