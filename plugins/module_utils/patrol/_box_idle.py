# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The box as a whole for ``patrol_facts``: whether anything still runs on it, since when it idles, what its
autostop watcher decided, and the patrol's tick that the watcher's dead-man clock watches.

Every run on the box counts, whatever run the tick patrols: the box bills for all of them. The readers run in one
forked child under the tick's deadline (:func:`box_probe`), so a hung data_dir costs a note, never the tick; the
tick file and the box's cost ledger (``instance/_ledger``) are the only writes, skipped in check mode like the scan
cursors. :func:`whole_box` is pure.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_state import (
    read_armed,
    read_decision,
    watcher_alive,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _ledger
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import utc_iso as _iso
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MAX_REGISTERED_RUNS,
    NAME_PATTERN,
    autostop_path,
    patrol_tick_path,
    runs_root,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import finite, live_cells

SMALL_JSON_BYTES = 64 * 1024
# read_decision's state for a .autostop.json that cannot be read or trusted (its reason says why).
UNREADABLE = "unreadable"
MAX_TEXT = 300
AUTOSTOP_KEYS = (
    "armed",
    "state",
    "reason",
    "due_at",
    "next_check_at",
    "updated_at",
    "idle_s",
    "idle_needed_s",
    "silence_s",
    "silence_needed_s",
    "trigger",
    "gate",
    "stop",
    "watcher_pid",
    "watcher_alive",
    "generation",
    "generation_current",
    "armed_by",
    "idle_minutes",
    "controller_silence_hours",
)
DECISION_TEXT = ("state", "reason", "due_at", "next_check_at", "updated_at", "trigger")
DECISION_NUMBERS = ("idle_s", "idle_needed_s", "silence_s", "silence_needed_s")
UNKNOWN_BOX = {
    "since": None,
    "box_now": None,
    "ledger": None,
    "container_started_at": None,
    "live_runs": [],
    "idle": None,
    "idle_since": None,
    "runs_done": [],
}


def utc_iso(timestamp: Optional[float]) -> Optional[str]:
    return None if timestamp is None else _iso(timestamp)


def read_small_json(path: str) -> Tuple[Any, Optional[str]]:
    """(document, None); (None, None) when there is no file; (None, why) when it is unreadable or not JSON."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(SMALL_JSON_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, exc.strerror or str(exc)
    if len(raw) > SMALL_JSON_BYTES:
        return None, f"larger than {SMALL_JSON_BYTES} bytes"
    try:
        return json.loads(raw.decode("utf-8")), None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None, "not JSON"


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def write_tick(data_dir: str, now: float) -> Dict[str, Any]:
    """Count this tick in ``runs/.patrol-tick.json``: ``{"tick": n, "note": why it restarted or was not written}``.

    Only on a box that has a runs directory: a mistyped data_dir gets no directory made in it (and holds no watcher
    to keep alive)."""
    if not os.path.isdir(runs_root(data_dir)):
        return {"tick": None, "note": None}
    path = patrol_tick_path(data_dir)
    previous, why = read_small_json(path)
    count = _count(previous.get("tick")) if isinstance(previous, dict) else None
    note = None
    if count is None and (why or previous is not None):
        note = f"patrol tick {path}: {why or 'no tick counter in it'}; counting again from 1"
    tick = (count or 0) + 1
    try:
        write_json_atomic(path, {"at": utc_iso(now), "tick": tick})
    except OSError as exc:
        return {"tick": None, "note": f"patrol tick {path} not written ({exc.strerror or exc})"}
    return {"tick": tick, "note": note}


def registered_runs(data_dir: str) -> Tuple[List[str], Optional[str]]:
    """Every run directory under ``runs/`` holding a run.json (dot names are never runs), or why it cannot be
    listed."""
    root = runs_root(data_dir)
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if NAME_PATTERN.match(e.name) and e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        return [], f"{root} cannot be listed: {exc.strerror or exc}"
    return [n for n in names if os.path.exists(os.path.join(root, n, "run.json"))][:MAX_REGISTERED_RUNS], None


def last_activity(run_directory: str) -> Optional[float]:
    """The newest mtime of run.json, DONE and each cell's result.json / exit.json: when the run last did something
    a watcher of the box cares about."""
    paths = [os.path.join(run_directory, "run.json"), os.path.join(run_directory, "DONE")]
    try:
        with os.scandir(os.path.join(run_directory, "cells")) as cells:
            for cell in cells:
                if cell.is_dir(follow_symlinks=False):
                    paths += [os.path.join(cell.path, "result.json"), os.path.join(cell.path, "exit.json")]
    except OSError:
        pass  # no cell started yet
    moments = []
    for path in paths:
        try:
            moments.append(os.stat(path).st_mtime)
        except OSError:
            continue
    return max(moments, default=None)


def scan_box(data_dir: str, write: bool = False, now: Optional[float] = None) -> Dict[str, Any]:
    """Each run on the box (live: its runner, or a cell outliving it; DONE; its last activity), the container's
    start and the box's cost ledger (recorded with ``write``: never in check mode) on the box's clock ``now``."""
    # Imported in the probe's child, as the runs probe does: the module's own import stays light.
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk  # noqa: PLC0415

    names, problem = registered_runs(data_dir)
    living = live_cells(os.path.join(runs_root(data_dir), name) for name in names)
    runs = []
    for name in names:
        disk = OnDisk(data_dir, name)
        runs.append(
            {
                "run": name,
                "live": disk.live or bool(living.get(os.path.normpath(disk.run_dir))),
                "done": disk.done,
                "last_activity": last_activity(disk.run_dir),
                "problem": disk.problem,
            }
        )
    # The ledger every stage's cost counts from (training_run's and teardown_gate's too).
    basis = _ledger.cost_basis([data_dir], write, now)
    return {
        "runs": runs,
        "problem": problem,
        "container_started_at": _ledger.container_started_at(),
        "since": basis["box_started_at"],
        "box_now": basis["box_now"],
        "ledger": basis["ledger"],
    }


def read_autostop(data_dir: str) -> Dict[str, Any]:
    """armed.json as found with why it cannot be read, the watcher's decision (state ``unreadable`` when it cannot
    be read or trusted) and the watcher's liveness."""
    armed, armed_problem = read_armed(data_dir)
    decision = read_decision(data_dir)
    alive, pid = watcher_alive(data_dir)
    return {
        "armed": armed,
        "armed_problem": armed_problem,
        "decision": decision if isinstance(decision, dict) else None,
        "watcher_alive": bool(alive),
        "watcher_pid": _count(pid),
    }


def box_probe(data_dir: str, write: bool, now: float) -> Dict[str, Any]:
    """The probe's child: the tick first (a box whose readers fail still hears from its controller), then reads."""
    tick = write_tick(data_dir, now) if write else {"tick": None, "note": None}
    return {"tick": tick, "box": scan_box(data_dir, write, now), "autostop": read_autostop(data_dir)}


def _text(value: Any) -> Optional[str]:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _gate(value: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(value, dict):
        return None
    passed = value.get("passed")
    return {
        "passed": passed if isinstance(passed, bool) else None,
        **{key: _text(value.get(key)) for key in ("step", "reason", "checked_at")},
    }


def _stop(value: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(value, dict):
        return None
    command = value.get("command")
    return {
        **{key: _text(value.get(key)) for key in ("issued_at", "outcome", "final_state", "msg")},
        "command": command if isinstance(command, list) and all(isinstance(p, str) for p in command) else None,
        "attempts": _count(value.get("attempts")),
        "result": value.get("result") if isinstance(value.get("result"), dict) else None,
    }


def _armed_by(value: Any) -> Optional[Dict[str, Any]]:
    return (
        {"run": _text(value.get("run")), "launch_id": _text(value.get("launch_id"))}
        if isinstance(value, dict)
        else None
    )


def autostop_facts(read: Mapping[str, Any], data_dir: str) -> Tuple[Dict[str, Any], List[str]]:
    """The ``autostop`` fact from what :func:`read_autostop` found: armed false and the rest null without an
    armed.json (or with one that cannot be read: a watcher cannot act on it either)."""
    facts: Dict[str, Any] = dict.fromkeys(AUTOSTOP_KEYS, None)
    notes = []
    decision = read["decision"] or {}
    if decision.get("state") == UNREADABLE:
        notes.append(f"autostop: {_text(decision.get('reason')) or autostop_path(data_dir)}")
    armed = read["armed"]
    if read["armed_problem"]:
        notes.append(f"autostop: {read['armed_problem']}; taken as not armed")
    if not isinstance(armed, dict):
        return dict(facts, armed=False), notes
    generation = _text(armed.get("generation"))
    facts.update({key: _text(decision.get(key)) for key in DECISION_TEXT})
    facts.update({key: finite(decision.get(key)) for key in DECISION_NUMBERS})
    facts.update(
        armed=armed.get("disarmed") is not True,
        gate=_gate(decision.get("gate")),
        stop=_stop(decision.get("stop")),
        watcher_pid=read["watcher_pid"] if read["watcher_pid"] is not None else _count(decision.get("watcher_pid")),
        watcher_alive=read["watcher_alive"],
        generation=generation,
        generation_current=generation is not None and decision.get("generation") == generation,
        armed_by=_armed_by(armed.get("armed_by")),
        idle_minutes=finite(armed.get("idle_minutes")),
        controller_silence_hours=finite(armed.get("controller_silence_hours")),
    )
    return facts, notes


def box_idle_facts(scan: Mapping[str, Any], now: float, examined: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    """The ``box`` fact: live and DONE runs, since when the box bills and its cost ledger (``since``, ``box_now``,
    ``ledger``: see ``_ledger``) and, with no live run, since when it idles (the newest of the container's start and
    each run's last activity, never past ``now``). ``idle`` is null when the runs could not be listed."""
    runs = scan["runs"]
    # A run the runs probe examined has its unreadable run.json noted there already.
    notes = [f"box: {run['problem']}" for run in runs if run.get("problem") and run["run"] not in examined]
    container = finite(scan.get("container_started_at"))
    live = [run["run"] for run in runs if run.get("live")]
    facts = dict(
        UNKNOWN_BOX,
        since=scan.get("since") if isinstance(scan.get("since"), str) else None,
        box_now=scan.get("box_now") if isinstance(scan.get("box_now"), str) else utc_iso(now),
        ledger=scan.get("ledger") if isinstance(scan.get("ledger"), dict) else None,
        container_started_at=utc_iso(container),
        live_runs=live,
        runs_done=[run["run"] for run in runs if run.get("done")],
    )
    notes += [f"box: {note}" for note in (facts["ledger"] or {}).get("notes") or []]
    if scan.get("problem"):
        return facts, [*notes, f"box: {scan['problem']}; whether it idles is unknown"]
    moments = [m for m in (container, *(finite(run.get("last_activity")) for run in runs)) if m is not None]
    idle_since = min(max(moments), now) if moments and not live else None
    facts.update(idle=not live, idle_since=utc_iso(idle_since))
    return facts, notes


def whole_box(
    answer: Mapping[str, Any], data_dir: str, timeout_s: float, now: float, examined: Sequence[str]
) -> Tuple[Dict[str, Any], Dict[str, Any], List[str]]:
    """(box, autostop, notes) from the box probe's answer; a probe that hung or failed leaves both unknown (null)
    with one note."""
    if "value" not in answer:
        why = f"did not finish within {timeout_s:g} s (a hung mount?)" if answer.get("timed_out") else answer["error"]
        note = f"box: reading {data_dir}/runs for the box's idle time and autostop {why}"
        return dict(UNKNOWN_BOX), dict.fromkeys(AUTOSTOP_KEYS, None), [note]
    value = answer["value"]
    notes = [value["tick"]["note"]] if value["tick"]["note"] else []
    box, found = box_idle_facts(value["box"], now, examined)
    autostop, read = autostop_facts(value["autostop"], data_dir)
    return box, autostop, notes + found + read
