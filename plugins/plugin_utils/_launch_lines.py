# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A box's launch record as one line (plus indented warnings), and the fleet's summary line.

Written for any record: a field missing or of the wrong type reads as nothing, never an error, so the report step
never crashes on a box that stopped early (a cell without a name, a box that never answered).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import cost_text
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import status_summary

# The steps, in order. Validation, the preflight gate and the box's own refusals (a changed spec, a reused name, an
# orphan cell) refuse the box; a step that breaks fails it.
STEPS = ("validate", "preflight", "probe", "code", "relaunch", "autostop", "training_run")
REFUSING_STEPS = ("validate", "preflight", "relaunch", "autostop")
# What a report keeps of a record: never the module's invocation, its environment or a secret.
RECORD_KEYS = (
    "host", "status", "step", "reason", "line", "run", "launch_id", "cells", "shard", "outcome", "cells_left",
    "recopy_cells", "kept_cells", "changes", "code", "gate", "python", "attach", "pgid", "detach", "warnings",
    "autostop", "cost", "check_mode", "changed",
)  # fmt: skip
LAUNCHED = ("STARTED", "RESUMED", "ALREADY_RUNNING", "DONE")
STATUSES = (*LAUNCHED, "REFUSED", "FAILED", "UNREACHABLE")
# The statuses the verdict step fails (exit code 2); UNREACHABLE is marked unreachable (4).
FAILING = ("REFUSED", "FAILED")
OUTCOMES = {"started": "STARTED", "resumed": "RESUMED", "already_running": "ALREADY_RUNNING", "done": "DONE"}
WOULD = {"STARTED": "would start", "RESUMED": "would resume", "ALREADY_RUNNING": "would leave it", "DONE": "nothing"}
CELL_STATES = ("succeeded", "failed", "running", "pending")
# The watcher's decisions worth a word on the launch line: what went wrong since it was armed.
AUTOSTOP_TROUBLE = ("gate_failed", "failed", "unconfirmed")
LINE_CHARS = 700
SHOWN_NAMES = 8


def status_of_step(step: str) -> str:
    return "REFUSED" if step in REFUSING_STEPS else "FAILED"


def _list(value: Any) -> List[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _names(names: Iterable[Any]) -> str:
    names = [str(name) for name in names]
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f" (+{len(names) - SHOWN_NAMES} more)" if len(names) > SHOWN_NAMES else "")


def _head_counts(record: Mapping[str, Any]) -> str:
    """``(2 cells left; 1 re-copied)`` of a resume; ``(check mode: would start; 4 cells left)`` in check mode."""
    status = record.get("status")
    parts = []
    if record.get("check_mode") and status in LAUNCHED:
        parts.append(f"check mode: {WOULD[str(status)]}")
    if status in ("STARTED", "RESUMED"):
        left = _count(record.get("cells_left"))
        parts.append(f"{left} {'cell' if left == 1 else 'cells'} left")
    if status == "RESUMED":
        parts.append(f"{len(_list(record.get('recopy_cells')))} re-copied")
    return f" ({'; '.join(parts)})" if parts else ""


def _cells_part(cells: List[Any]) -> str:
    cells = [cell for cell in cells if isinstance(cell, Mapping)]
    if not cells:
        return ""
    counts = {state: sum(1 for cell in cells if cell.get("status") == state) for state in CELL_STATES}
    shown = [f"{count} {state}" for state, count in counts.items() if count]
    sync_failed = sum(1 for cell in cells if cell.get("sync") == "failed")
    shown += [f"{sync_failed} sync failed"] if sync_failed else []
    return f"{len(cells)} cells" + (f" ({', '.join(shown)})" if shown else "")


def _shard_part(shard: Any) -> str:
    if not isinstance(shard, Mapping) or not isinstance(shard.get("index"), int):
        return ""
    return f"shard {shard['index'] + 1}/{shard.get('count')}"


def _code_part(code: Any, check_mode: bool) -> str:
    if not isinstance(code, Mapping) or code.get("kind") in (None, "none"):
        return ""
    if code.get("note"):
        return f"code ({code['kind']}): {code['note']}"
    if code["kind"] == "git":
        verb = "would check out" if check_mode else ("checked out" if code.get("changed") else "at")
        return f"code (git): {verb} {str(code.get('version') or code.get('ref') or '?')[:12]}"
    sent, deleted = _count(code.get("files_count")), len(_list(code.get("deleted")))
    if not sent and not deleted and not code.get("changed"):
        return "code (rsync): up to date"
    if check_mode:
        return f"code (rsync): would send {sent} files" + (f", delete {deleted}" if deleted else "")
    return f"code (rsync): {sent} files sent" + (f", {deleted} deleted" if deleted else "")


def _gate_part(gate: Any) -> str:
    if not isinstance(gate, Mapping) or not gate.get("reason"):
        return ""
    return str(gate["reason"])


def _number(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _autostop_terms(autostop: Mapping[str, Any]) -> str:
    idle, silence = _number(autostop.get("idle_minutes")), _number(autostop.get("controller_silence_hours"))
    if idle is not None and silence is not None:
        return f"stops the box {idle:g} min after every run is secured (dead-man: {silence:g} h without a patrol tick)"
    if idle is not None:
        return f"stops the box {idle:g} min after every run is secured"
    if silence is not None:
        return f"stops the box after {silence:g} h without a patrol tick, once every run is secured (dead-man only)"
    return "stops the box once every run is secured"


def _autostop_blocked(autostop: Mapping[str, Any]) -> str:
    """``, but archived run r0 ... blocks it: ...;`` when an archived run blocks every stop of the armed verb."""
    blocked = [str(line) for line in _list(autostop.get("blocked_by"))]
    if not blocked:
        return ":"
    more = f"; and {len(blocked) - 1} more archived run{'s' if len(blocked) > 2 else ''}" if len(blocked) > 1 else ""
    return f", but {blocked[0]}{more};"


def _autostop_part(autostop: Any, check_mode: bool) -> str:
    """What launch did to the box's autostop: armed, stays armed, would arm, disarmed; an archived run that blocks
    it, what a failed cell does to its dead-man, and a watcher in trouble."""
    if not isinstance(autostop, Mapping):
        return ""
    changed, armed, terms = bool(autostop.get("changed")), bool(autostop.get("armed")), _autostop_terms(autostop)
    asked, but = autostop.get("asked"), _autostop_blocked(autostop)
    caveats = "".join(f"; {caveat}" for caveat in _list(autostop.get("caveats")))
    if asked == "disarm":
        said = "autostop not armed" if not changed else ("would disarm autostop" if check_mode else "autostop disarmed")
    elif asked == "arm" and changed:
        said = f"would arm autostop{but} {terms}{caveats}" if check_mode else f"autostop armed{but} {terms}{caveats}"
    elif armed:
        said = f"autostop stays armed{but} {terms}{caveats}"
    elif asked == "arm":
        said = f"autostop not armed: {autostop.get('reason') or 'training_run gave no reason'}"
    else:
        return ""
    said = f"check mode: {said}" if check_mode and said.startswith("would") else said
    decision = autostop.get("decision")
    if isinstance(decision, Mapping) and decision.get("state") in AUTOSTOP_TROUBLE:
        said += f" (its last decision: {decision['state']}: {decision.get('reason') or 'no reason given'})"
    return said


def _cost_part(record: Mapping[str, Any]) -> str:
    cost = record.get("cost")
    return cost_text(cost) if isinstance(cost, Mapping) else ""


def _run_part(record: Mapping[str, Any]) -> str:
    status = record.get("status")
    parts = [_cells_part(_list(record.get("cells")))]
    if status == "DONE" and record.get("outcome") is None:  # a shard without a cell: the box was not asked
        parts.append(str(record.get("reason") or "nothing to launch"))
    elif status == "DONE":
        parts.append(f"every cell done ({len(_list(record.get('kept_cells')))} kept), nothing started")
    if status == "ALREADY_RUNNING":
        parts.append("its runner is live: left alone")
    if status == "RESUMED" and _list(record.get("kept_cells")):
        parts.append(f"{len(_list(record['kept_cells']))} kept")
    if _list(record.get("recopy_cells")):
        verb = "would re-copy" if record.get("check_mode") else "re-copies"
        parts.append(f"{verb} without retraining: {_names(record['recopy_cells'])}")
    if _list(record.get("changes")):
        parts.append(f"changes applied: {'; '.join(str(change) for change in record['changes'])}")
    if record.get("detach"):
        pgid = record.get("pgid")
        parts.append(f"{record['detach']} pgid {pgid}" if pgid else str(record["detach"]))
    if record.get("attach"):
        parts.append(f"attach: {record['attach']}")
    return "; ".join(part for part in parts if part)


def line(record: Mapping[str, Any]) -> str:
    """Host, status, run name (with the counts of a start or resume), then what happened, or why nothing started:
    ``b1  RESUMED  abl (2 cells left; 1 re-copied): 5 cells (3 succeeded, 2 pending); ...``."""
    host, status = record.get("host", "?"), record.get("status", "?")
    if status == "UNREACHABLE":
        cost = _cost_part(record)  # an unreachable box bills all the same
        head = f"{host}  UNREACHABLE  {record.get('reason') or 'host unreachable'}"
        return (f"{head}; {cost}" if cost else head)[:LINE_CHARS]
    head = f"{host}  {status}  {record.get('run') or '?'}{_head_counts(record)}"
    shard = _shard_part(record.get("shard"))
    if status in FAILING:
        head += f" at {record.get('step')}: {record.get('reason') or 'no reason given'}"
        started = "nothing started" if record.get("step") != "training_run" else ""
        parts = [shard, started, _code_part(record.get("code"), bool(record.get("check_mode")))]
        parts += [_autostop_part(record.get("autostop"), bool(record.get("check_mode"))), _cost_part(record)]
        shown = [part for part in parts if part]
        return (f"{head}; {'; '.join(shown)}" if shown else head).replace("\n", " ")[:LINE_CHARS]
    parts = [_run_part(record), shard, _code_part(record.get("code"), bool(record.get("check_mode")))]
    parts.append(_gate_part(record.get("gate")))
    parts += [_autostop_part(record.get("autostop"), bool(record.get("check_mode"))), _cost_part(record)]
    shown = [part for part in parts if part]
    return (f"{head}: {'; '.join(shown)}" if shown else head).replace("\n", " ")[:LINE_CHARS]


def lines(record: Mapping[str, Any]) -> List[str]:
    """The line, then one indented line per warning."""
    shown = [str(record.get("line") or line(record))]
    return shown + [f"  WARNING: {warning}" for warning in _list(record.get("warnings"))]


def no_record(host: str) -> Dict[str, Any]:
    """A host of the play without a launch record: it failed before its launch step ran."""
    reason = "no launch record: the host failed before its launch step ran (see its task error above)"
    record = {"host": host, "status": "REFUSED", "step": "validate", "reason": reason, "run": None}
    return dict(record, line=line(record))


def summary(records: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
    """Counts per status, the hosts per outcome, the cells a sharded sweep did not launch, and one line."""
    records = list(records)
    result = status_summary(records, STATUSES, ("UNREACHABLE",), FAILING)
    # A box of a sharded sweep that launched nothing leaves its share of the cells unlaunched: name them.
    unlaunched = [
        str(cell.get("name"))
        for record in records
        if record.get("status") not in LAUNCHED and isinstance(record.get("shard"), Mapping)
        for cell in _list(record.get("cells"))
        if isinstance(cell, Mapping) and cell.get("name")
    ]
    if unlaunched:
        result["line"] += f"; cells not launched: {_names(unlaunched)}"
    return dict(result, cells_not_launched=unlaunched)
