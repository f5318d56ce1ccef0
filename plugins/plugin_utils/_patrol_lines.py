# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Patrol's words: one line per box (its state, the run it comes from, a compact summary per run, disk and GPUs),
its reasons indented below it, and the fleet's summary line. Written for any record: a field of the wrong type is
shown as unknown, never an error."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_states as states
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import cost_text, fleet_hourly
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_billing import autostop_piece, clock
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_record import (
    BOX_STATE_KEYS,
    DOWN_STATES,
    STATES,
    UNREACHABLE,
    count,
    dicts,
    line_of,
    number,
    strings,
    unreachable,
)

# stage_report reads a record whose status is one of these.
STATUSES = tuple(state.upper() for state in (*STATES, *DOWN_STATES, UNREACHABLE))
# What a report keeps of a record: never the module's invocation.
RECORD_KEYS = (
    "host", "status", "line", "reachable", "python", "error", "state", "escalate", "reasons", "problems", "actions",
    "run", "headline", "alive", "cells_done", "cells_total", "progress", "eta_s", "log_idle_s", "crash_signatures",
    "disk", "disks", "gpu", "gpu_backend", "gpu_error", "memory", "xids", "runs", "examined_runs", "runs_skipped",
    "runs_archived", "run_filter", "msg", "check_mode", "box", "autostop", "cost", "cost_warning", "idle_billing",
    *BOX_STATE_KEYS,
)  # fmt: skip
BOX_LINE_CHARS = 600
RUN_STATE_WORD = re.compile(r"\A[A-Z][A-Z_]*:? (?=run )")
SHOWN_REASONS = 8
SHOWN_RUNS = 6
SHOWN_GPUS = 8


def fmt_duration(seconds: Any) -> str:
    """``1d2h``, ``3h05m``, ``12m``, ``40s``: an ETA or an idle time, to the minute past an hour."""
    found = number(seconds)
    if found is None or found < 0:
        return "?"
    days, rest = divmod(int(found), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m" if minutes else f"{secs}s"


def _pct(value: Any) -> str:
    found = number(value)
    return "?" if found is None else f"{found:.0f}%"


def _headline(record: Mapping[str, Any]) -> str:
    if isinstance(record.get("headline"), str) and record["headline"]:
        return line_of(record["headline"], 160)
    done, total = count(record.get("cells_done")), count(record.get("cells_total"))
    if isinstance(record.get("run"), str):
        return f"run {line_of(record['run'], 80)}" + (f", {done or 0}/{total} cells done" if total else "")
    return "no run" if record.get("state") in ("idle", None) else line_of(record.get("msg") or "", 160)


def _runs_part(record: Mapping[str, Any]) -> str:
    runs = dicts(record.get("runs"))
    shown = [line_of(run.get("summary") or run.get("run") or "?", 160) for run in runs[:SHOWN_RUNS]]
    if len(runs) > SHOWN_RUNS:
        shown.append(f"+{len(runs) - SHOWN_RUNS} more runs")
    skipped, archived = count(record.get("runs_skipped")), count(record.get("runs_archived"))
    if skipped:
        shown.append(f"{skipped} finished runs not patrolled (over the cap)")
    if archived:
        shown.append(f"{archived} archived")
    return "; ".join(shown)


def _disk_part(record: Mapping[str, Any]) -> str:
    shown = []
    for disk in dicts(record.get("disks")) or ([record["disk"]] if isinstance(record.get("disk"), Mapping) else []):
        name = line_of(disk.get("name") or disk.get("path") or "?", 40)
        if disk.get("error"):
            shown.append(f"{name} ?")
        else:
            shown.append(f"{name} {_pct(disk.get('bytes_used_pct'))}/{_pct(disk.get('inodes_used_pct'))} inodes")
    return "disk " + (", ".join(shown) if shown else "?")


def _gpu_part(record: Mapping[str, Any]) -> str:
    gpus = dicts(record.get("gpu"))
    if not gpus:
        return "gpu " + ("?" if record.get("gpu_error") else "none")
    shown = [_pct(gpu.get("utilization_pct")) for gpu in gpus[:SHOWN_GPUS]]
    more = f" +{len(gpus) - SHOWN_GPUS}" if len(gpus) > SHOWN_GPUS else ""
    return f"gpu {' '.join(shown)}{more}"


def _cost_part(record: Mapping[str, Any]) -> str:
    """What the box costs ("$4.20 so far at $2.00/h"), or why that is unknown (a bad hourly_usd)."""
    if isinstance(record.get("cost_warning"), str) and not isinstance(record.get("cost"), Mapping):
        return f"cost unknown: {line_of(record['cost_warning'], 120)}"
    said = cost_text(record["cost"]) if isinstance(record.get("cost"), Mapping) else ""
    warning = f"; {line_of(record['cost_warning'], 120)}" if isinstance(record.get("cost_warning"), str) else ""
    return f"{said}{warning}" if said else ""


def _stopped_part(record: Mapping[str, Any]) -> str:
    """What a stopped box still bills instead of its GPU rate: "bills storage ($0.01/h: the pod volume), $4.21 so
    far" (the cost so far counts the GPU rate up to the stop); a GONE one bills nothing more."""
    cost = record.get("cost") if isinstance(record.get("cost"), Mapping) else {}
    usd = number(cost.get("usd"))
    so_far = f", ${usd:,.2f} so far" if usd is not None else ""
    if isinstance(record.get("cost_warning"), str):
        so_far += f"; cost unknown: {line_of(record['cost_warning'], 120)}"
    if record.get("box_state") == states.GONE:
        return f"bills nothing more{so_far}"
    storage = number(cost.get("hourly_usd_stopped"))
    rate = f"${storage:,.2f}/h" if storage is not None else "rate unknown: set hourly_usd_stopped"
    bills = record.get("stopped_bills") if isinstance(record.get("stopped_bills"), str) else ""
    return f"bills storage ({rate}{': ' + line_of(bills, 160) if bills else ''}){so_far}"


def _down_line(record: Mapping[str, Any]) -> str:
    """The line of a box that did not answer: its box_state, why (the provider's answer, our stop), what it still
    bills, the connection's error."""
    host = line_of(record.get("host") or "?", 80)
    error = line_of(record.get("error") or "unreachable", 200)
    box_state = record.get("box_state") if record.get("box_state") in states.BOX_STATES else states.UNREACHABLE
    why = line_of(record.get("msg") or "", 300) if record.get("box_state") else ""
    if box_state == states.UNREACHABLE:
        cost = _cost_part(record)
        text = f"{host}  UNREACHABLE  {error}" + (f"; {why}" if why else "")
        return f"{text} | {cost}" if cost else text
    parts = [why, _stopped_part(record)] + ([] if box_state == states.STOPPED else [error])
    return f"{host}  {box_state}  " + " | ".join(part for part in parts if part)


def line(record: Mapping[str, Any], now: Optional[datetime] = None) -> str:
    """The box's one line; ``now`` (the controller's UTC clock by default) dates the autostop's times."""
    host = line_of(record.get("host") or "?", 80)
    cost = _cost_part(record)
    if record.get("state") == UNREACHABLE or not record.get("reachable", True):
        return _down_line(record)
    state = line_of(record.get("state") or "unknown", 40).upper()
    headline = _headline(record)
    for said in (f"{state}: ", f"{state} "):  # the state is said once
        if headline.upper().startswith(said):
            headline = headline[len(said) :]
    runs = dicts(record.get("runs"))
    # One run: its summary says what the headline would (the run's own state included), and more.
    named = RUN_STATE_WORD.sub("", headline, count=1)
    one = len(runs) == 1 and isinstance(runs[0].get("summary"), str) and named.startswith(f"run {runs[0].get('run')}")
    tail = []
    if record.get("state") != "unknown" or record.get("disks") or record.get("gpu"):
        tail.append(f"{_disk_part(record)}, {_gpu_part(record)}")
    autostop = record.get("autostop") if isinstance(record.get("autostop"), Mapping) else None
    now = now or datetime.now(timezone.utc)
    booted = record["box"].get("container_started_at") if isinstance(record.get("box"), Mapping) else None
    stop = record.get("our_stop") if isinstance(record.get("our_stop"), Mapping) else None
    if record.get("box_state") == states.STOPPED and stop:  # the stop says it once, with what it still bills
        tail.append(f"STOPPED by {stop.get('by')} at {clock(stop.get('at'), now)}: {_stopped_part(record)}")
    else:
        tail += [autostop_piece(autostop, now, booted), cost]
    ending = ""
    if record.get("escalate") is True:
        ending = f"  ESCALATED -> {', '.join(strings(record.get('actions')) or ['investigate'])}"
    head = [] if one else [headline]
    # The runs' summaries give way first, so the autostop, the cost and the escalation stay on a long line.
    others = [part for part in (*head, *tail) if part]
    room = BOX_LINE_CHARS - len(f"{host}  {state}  ") - sum(len(part) + 3 for part in others) - len(ending)
    summaries = _runs_part(record)
    if len(summaries) > room:
        summaries = summaries[: max(room - 3, 0)] + "..."
    text = f"{host}  {state}  " + " | ".join(part for part in (*head, summaries, *tail) if part) + ending
    return text if len(text) <= BOX_LINE_CHARS else text[: BOX_LINE_CHARS - 3] + "..."


def lines(record: Mapping[str, Any]) -> List[str]:
    """The box's line and its reasons, indented."""
    if record.get("state") == UNREACHABLE or not record.get("reachable", True):
        box_state = record.get("box_state") if record.get("box_state") in states.ADVICE else states.UNREACHABLE
        return [str(record.get("line") or line(record)), f"    {states.ADVICE[box_state]}"]
    reasons = strings(record.get("reasons")) or []
    shown = [f"    {reason}" for reason in reasons[:SHOWN_REASONS]]
    if len(reasons) > SHOWN_REASONS:
        shown.append(f"    (+{len(reasons) - SHOWN_REASONS} more reasons in the report)")
    return [str(record.get("line") or line(record)), *shown]


def no_record(host: str) -> Dict[str, Any]:
    """A host of the play without a patrol record: it never reached its patrol step (a task timeout, a refused
    setting, or the host was unreachable before the step ran)."""
    record = unreachable(host, "no patrol record: the host never reached its patrol step (unreachable, or timed out)")
    return dict(record, status=UNREACHABLE.upper(), line=line(record))


def summary(records: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
    """Hosts per state, the escalated, unreachable (GONE ones too, which are also re-rent) and re-rent hosts, the
    stopped and interrupted ones, the fleet's total per hour (what the hosts that set ``hourly_usd`` bill now: a
    stopped one its storage), and one line."""
    records = list(records)
    by_state: Dict[str, int] = {}
    escalated: List[str] = []
    down: List[str] = []
    re_rent: List[str] = []
    notes: List[str] = []
    stopped: Dict[str, List[str]] = {state: [] for state in DOWN_STATES}
    for record in records:
        host, state = str(record.get("host") or "?"), str(record.get("state") or "unknown")
        by_state[state] = by_state.get(state, 0) + 1
        if state == UNREACHABLE:
            down.append(host)
            re_rent += [host] if record.get("box_state") == states.GONE else []
        elif state in stopped:
            stopped[state].append(host)
        elif record.get("escalate") is True:
            escalated.append(host)
            actions = strings(record.get("actions")) or []
            re_rent += [host] if "re_rent" in actions else []
            notes.append(f"{host} ({state}{' -> ' + ', '.join(actions) if actions else ''})")
    hourly = fleet_hourly(records)
    order = [state for state in (*STATES, *DOWN_STATES, UNREACHABLE) if state in by_state]
    text = f"{len(records)} hosts" + (": " + ", ".join(f"{by_state[s]} {s}" for s in order) if order else "")
    if escalated:
        text += f"; escalated: {', '.join(notes)}"
    if re_rent:
        text += f"; re-rent: {', '.join(re_rent)}"
    if down:
        text += f"; unreachable: {', '.join(down)}"
    for state, hosts in stopped.items():
        text += f"; {state}: {', '.join(hosts)}" if hosts else ""
    if hourly is not None:
        text += f"; {cost_text({'hourly_usd': hourly})}"
    return {
        "hosts": len(records), "by_state": {s: by_state[s] for s in order}, "escalated": escalated,
        "unreachable": down, "re_rent": re_rent, **stopped, "hourly_usd_total": hourly, "line": text,
    }  # fmt: skip
