# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The box's part of teardown's gate (contracts/run-layout.md): may this run's scratch go and its meter stop?

In order, stopping at the first step that fails:

1. ``run_alive``: the run is found and nothing of it runs (its runner, or a process carrying its ``RGT_RUN_DIR``).
2. ``cells``: every cell is done (succeeded, and its artifacts verified), or named in ``accept_incomplete_cells``.
3. ``durable``: every artifact of the done cells is under ``<durable_dir>/runs/<run>/``, a plain file with the size
   and a sha256 recomputed now that match its ``result.json`` record and its ``MANIFEST.sha256`` line; the scratch
   file it was copied from, where it still exists, hashes the same (else the durable copy is stale).

Read-only. A run teardown already removed (its tombstone ``<data_dir>/runs/.torn_down/<run>.json``, no run
directory) is checked against its manifest alone. Pure standard library.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _copy_verify as copies
from ansible_collections.remote_gpu.trainer.plugins.module_utils import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils._cell_sync import MANIFEST_NAME
from ansible_collections.remote_gpu.trainer.plugins.module_utils._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils._run_scratch import tombstone_path
from ansible_collections.remote_gpu.trainer.plugins.module_utils._run_state import OnDisk, read_json
from ansible_collections.remote_gpu.trainer.plugins.module_utils._runs import (
    SHA256_PATTERN,
    Run,
    cell_dir,
    parse_result,
    result_json,
    run_dir,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils._runspec import RunSpec, load_spec
from ansible_collections.remote_gpu.trainer.plugins.module_utils._training_run import RUN_MARKER

MAX_MANIFEST_LINES = 100_000
MAX_EXTRA_LISTED = 1000
DATA_DIR_TIMEOUT_S = 20.0


def parse_manifest(text: str) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """``{path: {size, sha256}}`` from ``MANIFEST.sha256`` text, and the lines that are not a valid entry."""
    entries: Dict[str, Dict[str, Any]] = {}
    bad: List[str] = []
    for line in text.splitlines()[:MAX_MANIFEST_LINES]:
        if not line.strip():
            continue
        fields = line.split("  ", 2)
        try:
            if len(fields) != 3 or not SHA256_PATTERN.match(fields[0]) or not fields[1].isdigit():
                raise ValueError(line)
            entries[copies.checked_relative(fields[2])] = {"size": int(fields[1]), "sha256": fields[0]}
        except ValueError:
            bad.append(line[:200])
    return entries, bad


def _read_durable(durable_run: str) -> Dict[str, Any]:
    """The manifest's text and digest, and every file path under the durable run directory (capped)."""
    if not os.path.isdir(durable_run):
        return {"exists": False}
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
    return {"exists": True, "manifest_text": text, "manifest_sha256": digest, "files": files}


class Gate:
    """Collects each step's evidence; ``refuse`` records the first failure."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.run: str = params["run"]
        self.data_dir: str = params["data_dir"]
        self.durable_dir: Optional[str] = params.get("durable_dir") or None
        self.accepted = list(params.get("accept_incomplete_cells") or [])
        self.accept_no_artifacts = bool(params.get("accept_no_artifacts"))
        self.timeout_s = float(params.get("verify_timeout_s") or copies.DEFAULT_TIMEOUT_S)
        self.recorded: Dict[str, Tuple[Any, ...]] = {}  # cell -> its result.json's artifacts
        durable_run = os.path.join(self.durable_dir, "runs", self.run) if self.durable_dir else None
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

    def check_run(self) -> Tuple[Optional[str], Optional[OnDisk]]:
        """The run step's refusal, if any, and the run's state on disk (None when teardown already removed it)."""
        scratch = self.result["scratch"]
        probe = {"isdir": functools.partial(os.path.isdir, scratch["dir"])}
        answer = run_with_deadline(probe, DATA_DIR_TIMEOUT_S)["isdir"]
        if "value" not in answer:
            return f"data_dir {self.data_dir} did not answer within {DATA_DIR_TIMEOUT_S:g} s (a hung mount?)", None
        scratch["exists"] = bool(answer["value"])
        tombstone = read_json(tombstone_path(self.data_dir, self.run))
        if not scratch["exists"]:
            if tombstone is None:
                return f"run {self.run} not found: {scratch['dir']} does not exist and teardown never removed it", None
            self.result["torn_down"] = tombstone
            self.result["run"]["state"] = "torn_down"
            return None, None
        disk = OnDisk(self.data_dir, self.run)
        if disk.problem:
            self.result["notes"].append(disk.problem)
        record = disk.record
        self.result["run"].update(
            state=disk.state, pgid=record.get("pgid"), sid=record.get("sid"), started_at=record.get("started_at")
        )
        if disk.live:
            return f"run {self.run} is alive (runner pgid {record.get('pgid')}): stop it first (stop_running)", disk
        target = Run(self.run, disk.run_dir)
        leftovers = detach.run_members(target, [f"{RUN_MARKER}={disk.run_dir}"])
        if leftovers:
            pids = ", ".join(str(proc.pid) for proc in leftovers[:5])
            self.result["run"]["state"] = "running"
            return f"run {self.run}: its runner is gone but {len(leftovers)} of its processes run (pid {pids})", disk
        if disk.registered is None:
            return f"run {self.run} has no readable run.json in {scratch['dir']}", disk
        return None, disk

    def check_cells(self, disk: OnDisk, spec: Optional[RunSpec]) -> Optional[str]:
        declares_artifacts = bool(spec.artifacts) if spec is not None else True
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
                    entry.update(status=parsed.status, sync=parsed.sync, done=parsed.counts_as_done(declares_artifacts))
                    self.recorded[name] = parsed.artifacts
                    why = (
                        f"{parsed.status}, exit {parsed.exit_code}"
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
            return f"run {self.run}: run.json lists no cells"
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
                f"run {self.run} secured no artifacts in durable_dir: its scratch would be the only copy "
                "(declare launch_artifacts, or set accept_no_artifacts)"
            )
        if durable["dir"] is None:
            return f"run {self.run} has artifacts but no durable_dir is set"
        if os.path.realpath(durable["dir"]).startswith(os.path.realpath(self.data_dir).rstrip("/") + "/"):
            return f"durable copy {durable['dir']} lies inside data_dir {self.data_dir}: teardown would remove it"
        answer = run_with_deadline({"durable": lambda: _read_durable(durable["dir"])}, self.timeout_s)["durable"]
        if answer.get("timed_out"):
            return f"durable copy {durable['dir']} did not answer within {self.timeout_s:g} s (a hung mount?)"
        if "error" in answer:
            return f"durable copy {durable['dir']}: {answer['error']}"
        listing = answer["value"]
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


def teardown_gate(params: Mapping[str, Any]) -> Dict[str, Any]:
    """The gate's evidence and verdict; ValueError for an option only the layout's rules can judge."""
    for key in ("data_dir", "durable_dir"):
        if params.get(key) and not os.path.isabs(params[key]):
            raise ValueError(f"{key} must be an absolute path, not {params[key]!r}")
    run_dir(params["data_dir"], params["run"])  # ValueError for a bad run name
    gate = Gate(params)
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
