# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A run's state as ``training_run`` reports it, read back from the run directory (contracts/run-layout.md).

``run.json`` says which runner registered and whether it lives (``_proctree.run_is_live``, PID-reuse guard
included), ``DONE`` whether the run finished, each ``result.json`` how its cell ended (``exit.json`` how its
command did, before any copy). Read-only; pure standard library.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MAX_RUN_JSON_BYTES,
    Run,
    done_marker,
    exit_json,
    parse_result,
    parse_run,
    read_exit,
    result_json,
    run_dir,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import RunSpec, runner_log


def read_json(path: str) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``; None when there is none. ValueError when it is not a readable JSON object."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_RUN_JSON_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from exc
    data = json.loads(raw.decode("utf-8", errors="replace"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


class OnDisk:
    """What a run directory says now: its run.json (parsed), whether its runner lives, whether it is DONE."""

    def __init__(self, data_dir: str, run: str) -> None:
        self.run_dir = run_dir(data_dir, run)
        self.problem: Optional[str] = None
        self.record: Dict[str, Any] = {}
        self.registered: Optional[Run] = None
        try:
            self.record = read_json(os.path.join(self.run_dir, "run.json")) or {}
            if self.record:
                self.registered = parse_run(run, os.path.join(self.run_dir, "run.json"), self.record)
        except ValueError as exc:
            self.problem = f"run.json of {run} cannot be read ({exc}); treating its runner as gone"
            self.record = {}
        self.live = self.registered is not None and detach.is_live(self.registered)
        self.done = os.path.exists(done_marker(data_dir, run))

    @property
    def state(self) -> str:
        # DONE is the runner's last word: a runner that wrote it is only exiting.
        if self.done:
            return "done"
        if self.live:
            return "running"
        return "stopped" if self.registered is not None else "absent"


def _result(data_dir: str, run: str, cell: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    try:
        raw = read_json(result_json(data_dir, run, cell))
        if raw is not None:
            parse_result(raw)
        return raw, None
    except ValueError as exc:
        return None, f"result.json cannot be read: {exc}"


def cell_facts(spec: Optional[RunSpec], data_dir: str, run: str, disk: OnDisk) -> List[Dict[str, Any]]:
    """Each cell's state for the report: ``succeeded``/``failed`` from its result.json, else ``running``/``pending``.

    While a runner lives, a result older than its start is one it will replace (the cell runs again): pending.
    """
    views = {v.get("name"): v for v in disk.record.get("cells") or [] if isinstance(v, dict)}
    names = [cell.name for cell in spec.cells] if spec is not None else [str(n) for n in views if n]
    declares = {cell.name: spec.declares_artifacts(cell) for cell in spec.cells} if spec is not None else {}
    started = disk.registered.started_at if disk.registered is not None and disk.live else None
    facts = []
    for name in names:
        raw, problem = _result(data_dir, run, name)
        entry: Dict[str, Any] = {"name": name, "status": None, "done": False}
        entry.update(dict.fromkeys(("sync", "exit_code", "signal", "attempts", "reason")))
        if raw is not None:
            parsed = parse_result(raw)
            entry.update(done=parsed.counts_as_done(declares.get(name, True)), status=parsed.status, sync=parsed.sync)
            entry.update(exit_code=parsed.exit_code, signal=parsed.signal, attempts=raw.get("attempts"))
            entry["reason"] = raw.get("sync_error") or raw.get("reason")
            if started is not None and not entry["done"] and parsed.ended_at < started:
                entry.update(status="pending", reason=f"runs again (earlier attempt: {entry['reason']})")
        else:
            running = disk.live and (views.get(name) or {}).get("state") == "started"
            entry.update(status="running" if running else "pending", reason=problem)
        facts.append(entry)
    return facts


def facts(spec: Optional[RunSpec], data_dir: str, run: str, disk: OnDisk) -> Dict[str, Any]:
    record = disk.record
    detach_kind = record.get("detach") if disk.registered is not None else None
    cells = cell_facts(spec, data_dir, run, disk)
    return {
        "run": run,
        "run_dir": disk.run_dir,
        "state": disk.state,
        "pgid": record.get("pgid"),
        "sid": record.get("sid"),
        "pids": list(record.get("pids") or []),
        "started_at": record.get("started_at"),
        "detach": detach_kind,
        "attach": detach.attach_command(detach_kind, run, runner_log(disk.run_dir)) if disk.live else None,
        "resumed": bool(record.get("skipped_cells")),
        "skipped_cells": list(record.get("skipped_cells") or []),
        "cells": cells,
    }


def read_json_quietly(path: str) -> Optional[Dict[str, Any]]:
    try:
        return read_json(path)
    except ValueError:
        return None


@dataclass(frozen=True)
class Progress:
    """Where each cell of a spec stands, from its files: ``kept`` (result done: the runner skips it), ``recopy``
    (its command succeeded, exit.json says so, but its result is not done: the runner only copies again) and
    ``left`` (the runner runs its command)."""

    kept: Tuple[str, ...]
    recopy: Tuple[str, ...]
    left: Tuple[str, ...]

    def as_facts(self) -> Dict[str, Any]:
        return {"kept_cells": list(self.kept), "recopy_cells": list(self.recopy), "cells_left": len(self.left)}


def _exit_status(data_dir: str, run: str, cell: str) -> Optional[str]:
    """How the cell's command ended as the runner reads it before a re-copy: exit.json (written when the command
    ended, before any sync), else a result.json that names its command; None without either."""
    ended = read_exit(exit_json(run_dir(data_dir, run), cell)) or read_exit(result_json(data_dir, run, cell))
    return ended.get("status") if ended is not None else None


def command_succeeded(data_dir: str, run: str, cell: str) -> bool:
    """The cell's command ended with success, as exit.json or result.json says: its files may be in the durable
    copy."""
    raw, _problem = _result(data_dir, run, cell)
    return _exit_status(data_dir, run, cell) == "succeeded" or (raw or {}).get("status") == "succeeded"


def progress(spec: RunSpec) -> Progress:
    kept, recopy, left = [], [], []
    for cell in spec.cells:
        raw, _problem = _result(spec.data_dir, spec.run, cell.name)
        if raw is not None and parse_result(raw).counts_as_done(spec.declares_artifacts(cell)):
            kept.append(cell.name)
        elif _exit_status(spec.data_dir, spec.run, cell.name) == "succeeded":
            recopy.append(cell.name)
        else:
            left.append(cell.name)
    return Progress(tuple(kept), tuple(recopy), tuple(left))
