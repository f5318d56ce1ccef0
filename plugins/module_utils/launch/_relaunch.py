# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a launch of a run name this box already holds may do: compare the new spec with the box's ``spec.json``.

An identical spec leaves a live run alone (``already_running``) and a finished one as it is (``done``); a dead
one resumes. A different spec (a cell added or removed, a command, checkpoint directory, artifact list, limit or
run-wide setting changed) is refused, naming the differences, unless the user asks to apply it: then the runner
keeps every done result (and the argv that produced it), only copies again what a succeeded command left unsynced,
and runs the rest with the new spec. Removing a cell whose command succeeded is refused even then: its files are
in the durable copy, whose manifest would list a cell the run no longer has. A live run is never changed, and a
dead runner's cell that still trains is named, never stopped and restarted behind the user's back.

Compared over ``RunSpec.to_json()`` documents, so a key a newer spec gains is compared once listed here; a key
an older spec.json lacks counts as its default. Pure standard library.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import known_data_dirs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._launch_attempt import (
    Attempt,
    AttemptRefused,
    new_launch_id,
    plan,
    recorded_launch_id,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import (
    OnDisk,
    Progress,
    command_succeeded,
    facts,
    progress,
    read_json_quietly,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    REGISTRY_TIMEOUT_S,
    RUN_MARKER,
    Run,
    read_run_registry,
    run_json,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import RunSpec, spec_json

# Run-wide keys whose change changes what the cells do or keep (not launch_id, the GPUs nvidia-smi lists, the
# monitor's pace or the stop grace).
RUN_KEYS = (
    "durable_dir", "artifacts", "optional_artifacts", "prune", "verify_cmd", "verify_artifacts", "verify_timeout_s",
    "check_finite", "env", "env_hook", "conda_env", "gpus_per_cell", "max_parallel", "stop_on_failure",
)  # fmt: skip
CELL_KEYS = ("command", "checkpoint_dir", "retries", "timeout_s")
INHERITED_KEYS = ("artifacts", "optional_artifacts", "prune")  # a cell's own list, else the run's
DEFAULTS: Dict[str, Any] = {"retries": 0, "verify_timeout_s": 300.0, "check_finite": False, "stop_on_failure": False}
EMPTY: Tuple[Any, ...] = (None, [], {})
MAX_LISTED = 8  # differences named in a message; the result's ``changes`` has them all
WAY_OUT = "set launch_apply_changes: true (module: apply_changes) to run the changed cells, or use a new run name"
CELL_ENV = "RGT_CELL"
MAX_ENVIRON_BYTES = 1 << 20


class RelaunchRefused(Exception):
    """The launch is refused: a one-line message, the differences found and the facts the failure returns."""

    def __init__(self, message: str, changes: Tuple[str, ...] = (), facts: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.changes = changes
        self.facts = dict(facts or {}, changes=list(changes))


def _plain(document: Mapping[str, Any]) -> Dict[str, Any]:
    """The document as spec.json holds it (tuples are lists)."""
    return json.loads(json.dumps(dict(document)))


def _run_value(document: Mapping[str, Any], key: str) -> Any:
    value = document.get(key)
    return DEFAULTS.get(key) if value in EMPTY else value


def _cell_value(document: Mapping[str, Any], cell: Mapping[str, Any], key: str) -> Any:
    if key in INHERITED_KEYS:
        own = cell.get(key)
        return list(own if own is not None else document.get(key) or [])
    value = cell.get(key)
    return DEFAULTS.get(key) if value in EMPTY else value


def _cells(document: Mapping[str, Any]) -> Dict[str, Mapping[str, Any]]:
    return {str(c.get("name")): c for c in document.get("cells") or [] if isinstance(c, dict)}


def spec_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> List[str]:
    """The differences between the box's spec.json (``old``) and this launch's spec, as short phrases:
    ``cell c added``, ``cell b removed``, ``cell a: command, artifacts changed``, ``env changed``."""
    old, new = _plain(old), _plain(new)
    changes = [f"{key} changed" for key in RUN_KEYS if _run_value(old, key) != _run_value(new, key)]
    old_cells, new_cells = _cells(old), _cells(new)
    for name, cell in new_cells.items():
        before = old_cells.get(name)
        if before is None:
            changes.append(f"cell {name} added")
            continue
        keys = [k for k in CELL_KEYS if _cell_value(old, before, k) != _cell_value(new, cell, k)]
        # A list both cells inherit changed with the run's key, already named above.
        own = [k for k in INHERITED_KEYS if before.get(k) is not None or cell.get(k) is not None]
        keys += [k for k in own if _cell_value(old, before, k) != _cell_value(new, cell, k)]
        if keys:
            changes.append(f"cell {name}: {', '.join(keys)} changed")
    changes += [f"cell {name} removed" for name in old_cells if name not in new_cells]
    return changes


def _listed(changes: List[str]) -> str:
    more = len(changes) - MAX_LISTED
    return "; ".join(changes[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class Relaunch:
    """What this launch does with the run: ``outcome`` started | resumed | already_running | done, the spec's
    differences from the box's, and where each cell stands."""

    outcome: str
    changes: Tuple[str, ...]
    cells: Progress

    def as_facts(self) -> Dict[str, Any]:
        return dict(self.cells.as_facts(), outcome=self.outcome, changes=list(self.changes))


def decide(
    spec: RunSpec, on_box: Optional[Mapping[str, Any]], *, has_scratch: bool, live: bool, done: bool, apply: bool
) -> Relaunch:
    """The outcome for ``spec`` given the box's spec.json document (``on_box``; None: none readable) and the run's
    state; RelaunchRefused when the launch must not go on."""
    if not has_scratch:
        return Relaunch("started", (), Progress((), (), tuple(cell.name for cell in spec.cells)))
    changes = tuple(spec_changes(on_box, spec.to_json())) if on_box is not None else ()
    if changes and live:
        raise RelaunchRefused(
            f"run {spec.run} is running on this box with another spec: let it end or stop it (state=stopped), then "
            f"relaunch with launch_apply_changes: true, or use a new run name; changes: {_listed(list(changes))}",
            changes,
        )
    if changes and not apply:
        raise RelaunchRefused(
            f"run {spec.run} on this box has another spec: {WAY_OUT}; changes: {_listed(list(changes))}", changes
        )
    if changes and on_box is not None:
        _refuse_removals(spec, on_box, changes)
    cells = progress(spec)
    if done and not changes:  # DONE is the runner's last word, also while it exits
        return Relaunch("done", changes, cells)
    return Relaunch("already_running" if live else "resumed", changes, cells)


def _refuse_removals(spec: RunSpec, on_box: Mapping[str, Any], changes: Tuple[str, ...]) -> None:
    kept = {cell.name for cell in spec.cells}
    removed = [name for name in _cells(_plain(on_box)) if name not in kept]
    succeeded = [name for name in removed if command_succeeded(spec.data_dir, spec.run, name)]
    if succeeded:
        which = f"cell {succeeded[0]} is" if len(succeeded) == 1 else f"cells {', '.join(succeeded)} are"
        raise RelaunchRefused(
            f"run {spec.run}: {which} not in this launch but succeeded, and the durable copy holds their files: "
            "keep them in the sweep, or use a new run name",
            changes,
        )


def _cell_of(pid: int) -> str:
    """The RGT_CELL a process's environment names ('' for none, or an unreadable environment)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            entries = handle.read(MAX_ENVIRON_BYTES).split(b"\0")
    except OSError:
        return ""
    prefix = f"{CELL_ENV}=".encode()
    return next((e[len(prefix) :].decode(errors="replace") for e in entries if e.startswith(prefix)), "")


def still_training(run: str, run_directory: str) -> Dict[str, List[int]]:
    """The processes carrying the run's marker, by the cell they belong to ('' for none); call it only when the
    run's runner is not alive, else they are its cells."""
    found: Dict[str, List[int]] = {}
    for proc in detach.run_members(Run(run, run_directory), [f"{RUN_MARKER}={run_directory}"]):
        found.setdefault(_cell_of(proc.pid), []).append(proc.pid)
    return {cell: sorted(pids) for cell, pids in sorted(found.items())}


def refuse_orphans(run: str, run_directory: str) -> None:
    """RelaunchRefused naming the cells (and pids) of a dead runner that still run: a new runner would stop them
    and train them again."""
    found = still_training(run, run_directory)
    if not found:
        return
    parts = []
    for cell, pids in found.items():
        listed = ", ".join(str(pid) for pid in pids[:5]) + (", ..." if len(pids) > 5 else "")
        parts.append(f"cell {cell} still trains (pid {listed})" if cell else f"{len(pids)} process(es) (pid {listed})")
    raise RelaunchRefused(
        f"run {run}: {'; '.join(parts)} without its runner: wait for it, or stop it with training_run state=stopped"
    )


def _refuse_others(spec: RunSpec, allow_concurrent: bool, warn: Callable[[str], None]) -> None:
    """A live run of the box, in this data dir or any other the box knows, refuses the start unless allowed."""
    answer = run_with_deadline({"dirs": functools.partial(known_data_dirs, [spec.data_dir])}, REGISTRY_TIMEOUT_S)
    dirs, problems = answer["dirs"].get("value") or ([spec.data_dir], ["the box's other data dirs did not answer"])
    others: List[str] = []
    for index, data_dir in enumerate(dirs):
        runs, more = read_run_registry(data_dir)
        problems = [*problems, *more]
        where = f" in {data_dir}" if index else ""
        others += [
            f"{r.name}{where} (pgid {r.pgid})" for r in runs if (index or r.name != spec.run) and detach.is_live(r)
        ]
    for problem in problems:
        warn(f"run registry: {problem}")
    if others and not allow_concurrent:
        names = ", ".join(others)
        raise RelaunchRefused(f"run {names} is running on this box; set allow_concurrent to start {spec.run} beside it")


def archived_text(attempt: Attempt, check_mode: bool) -> str:
    if not attempt.archives:
        return ""
    moves = ", ".join(f"{item.source} -> {item.destination}" for item in attempt.archives)
    return f"; {'would archive' if check_mode else 'archived'} the earlier attempt: {moves}"


@dataclass(frozen=True)
class Decision:
    """What the start decided under the lock: a result when nothing is to start (or check mode), else the plan."""

    spec: RunSpec
    disk: OnDisk
    attempt: Attempt
    relaunch: Relaunch
    result: Optional[Dict[str, Any]] = None


def summary(relaunch: Relaunch) -> str:
    cells = relaunch.cells
    text = f"{len(cells.left)} cell(s) to run"
    if cells.recopy:
        text += f"; re-copies without training (command succeeded, copy not verified): {', '.join(cells.recopy)}"
    if cells.kept:
        text += f"; kept (already done): {', '.join(cells.kept)}"
    return text + (f"; applied changes: {'; '.join(relaunch.changes)}" if relaunch.changes else "")


def _left_alone(spec: RunSpec, disk: OnDisk, relaunch: Relaunch) -> Dict[str, Any]:
    """The result for a run that is alive or done with this very spec: nothing starts."""
    result = dict(facts(spec, spec.data_dir, spec.run, disk), launch_id=recorded_launch_id(disk.record), archived=[])
    result.update(relaunch.as_facts(), changed=False)
    if relaunch.outcome == "already_running":
        return dict(result, msg=f"run {spec.run} already running (pgid {result['pgid']})")
    return dict(result, msg=f"run {spec.run} is done: every cell succeeded and verified")


def decide_start(
    spec: RunSpec, params: Mapping[str, Any], how: str, check_mode: bool, warn: Callable[[str], None]
) -> Decision:
    disk = OnDisk(spec.data_dir, spec.run)
    if disk.problem:
        warn(disk.problem)
    # A box holding the run's run.json resumes the launch recorded there, whatever id this call brings.
    has_scratch = os.path.lexists(run_json(spec.data_dir, spec.run))
    box_id = recorded_launch_id(disk.record) if has_scratch else None
    spec = replace(spec, launch_id=box_id or spec.launch_id or new_launch_id())
    launch_id = str(spec.launch_id)
    on_box = read_json_quietly(spec_json(spec.run_dir)) if has_scratch else None
    if has_scratch and on_box is None:
        warn(f"spec.json of run {spec.run} cannot be read: this launch's spec replaces it without a comparison")
    try:
        apply = bool(params.get("apply_changes"))
        relaunch = decide(spec, on_box, has_scratch=has_scratch, live=disk.live, done=disk.done, apply=apply)
        if relaunch.outcome in ("already_running", "done"):
            return Decision(spec, disk, Attempt(launch_id), relaunch, _left_alone(spec, disk, relaunch))
        _refuse_others(spec, bool(params.get("allow_concurrent")), warn)
        refuse_orphans(spec.run, spec.run_dir)  # no live runner here: what carries its marker was left by a dead one
        attempt = plan(
            spec.run,
            spec.data_dir,
            spec.durable_dir,
            launch_id=launch_id,
            has_scratch=has_scratch,
            new_attempt=bool(params.get("new_attempt")),
            cells=[cell.name for cell in spec.cells],
        )
    except (RelaunchRefused, AttemptRefused) as exc:
        changes = tuple(getattr(exc, "changes", ()))
        raise RelaunchRefused(str(exc), changes, {"launch_id": launch_id, "archived": []}) from exc
    if not check_mode:
        return Decision(spec, disk, attempt, relaunch)
    verb = "resume" if relaunch.outcome == "resumed" else "start"
    msg = f"would {verb} run {spec.run} ({how}): {summary(relaunch)}{archived_text(attempt, True)}"
    result = dict(facts(spec, spec.data_dir, spec.run, disk), state="running", detach=how, attach=None)
    result.update(launch_id=launch_id, archived=[item.as_fact() for item in attempt.archives], **relaunch.as_facts())
    kept = list(relaunch.cells.kept)
    result.update(changed=True, resumed=bool(kept), skipped_cells=kept, msg=msg)
    return Decision(spec, disk, attempt, relaunch, result)
