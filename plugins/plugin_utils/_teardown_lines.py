# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A box's teardown record as one line (plus indented warnings and steps), and the fleet's summary line."""

from __future__ import annotations

import shlex
from typing import Any, Dict, Iterable, List, Mapping

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import cost_text
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import status_summary

# The steps, in order. A gate step refuses the box, the confirmation leaves it unconfirmed, an action fails it.
GATE_STEPS = (
    "validate",
    "lock",
    "box_lease",
    "instance_id",
    "run_alive",
    "stop_running",
    "cells",
    "durable",
    "other_runs",
    "gpu_users",
    "same_filesystem",
    "survival",
    "pull",
    "pull_verify",
    "load_verify",
)
# What a report keeps of a record: never the module's invocation or raw provider output.
RECORD_KEYS = (
    "host", "status", "step", "reason", "line", "runs", "check_mode", "platform", "stop_meter", "verb", "irreversible",
    "instance_id", "confirmed", "gate", "stop_running", "pull", "load_verify", "scratch", "meter_stop", "warnings",
    "data_loss_clocks", "changed", "cost",
)  # fmt: skip
STATUSES = ("TORN_DOWN", "CLEANED", "CHECKED", "UNCONFIRMED", "STOP_BY_HAND", "REFUSED", "FAILED", "UNREACHABLE")
# The statuses the verdict step fails: the box still bills, or something went wrong.
FAILING = ("UNCONFIRMED", "STOP_BY_HAND", "REFUSED", "FAILED")
LINE_CHARS = 700
KNOWN_BAD_SHOWN = 3  # files named on the line; the report's gate record lists them all


def status_of_step(step: str) -> str:
    if step in GATE_STEPS:
        return "REFUSED"
    return "UNCONFIRMED" if step == "confirm" else "FAILED"


def size(count: Any) -> str:
    value = float(count) if isinstance(count, (int, float)) and not isinstance(count, bool) else 0.0
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _known_bad(entries: Any, run: str = "") -> List[str]:
    """'<path> (<kind>)' per file its run's manifest marks known bad (a check of the run refused the copy)."""
    where = f"{run}/" if run else ""
    return [f"{where}{entry.get('path')} ({entry.get('bad')})" for entry in entries or [] if isinstance(entry, Mapping)]


def _bad_text(named: List[str]) -> str:
    if not named:
        return ""
    more = f" (+{len(named) - KNOWN_BAD_SHOWN} more)" if len(named) > KNOWN_BAD_SHOWN else ""
    return f"{len(named)} known bad: {', '.join(named[:KNOWN_BAD_SHOWN])}{more}"


def _gate_part(gate: Mapping[str, Any], pulled: Iterable[str] = ()) -> str:
    """Per run what the gate found; a run's known-bad files are named here unless its pull names them."""
    parts = []
    for run in gate.get("runs") or []:
        if run.get("state") in ("torn_down", "removing"):
            head = (
                f"{run.get('name')} torn down before"
                if run["state"] == "torn_down"
                else f"{run.get('name')} half removed"
            )
        else:
            head = f"{run.get('name')} {run.get('cells_done')}/{run.get('cells')} cells done"
        durable = f"durable {run.get('durable_files')} files, {size(run.get('durable_bytes'))} verified"
        bad = "" if run.get("name") in pulled else _bad_text(_known_bad(run.get("known_bad")))
        durable += f", {bad}" if bad else ""
        parts.append(f"{head}, {durable}" if run.get("durable_files") else f"{head}, no durable copy")
    instance = gate.get("instance") or {}
    for other in instance.get("other_runs") or []:
        if other.get("abandoned"):
            label = other.get("label") or other.get("name")  # the run, with its data dir when not the host's
            parts.append(f"{label} ABANDONED ({other.get('would_lose') or 'its scratch'})")
    return f"gate passed ({'; '.join(parts) or 'no run on the box'})"


def _pulled(record: Mapping[str, Any]) -> List[str]:
    """The runs a real pull copied to the controller (its line names their known-bad files)."""
    pull = record.get("pull") or {}
    return [] if pull.get("dry_run") else [str(run.get("run")) for run in pull.get("runs") or []]


def _pull_part(pull: Mapping[str, Any], gate: Mapping[str, Any]) -> str:
    runs = pull.get("runs") or []
    if not pull.get("to") or not runs:
        return ""
    new = sum(run.get("received_count") or 0 for run in runs)
    if pull.get("dry_run"):
        return f"would pull {new} new files to {pull['to']} (not verified: check mode)"
    files = sum(run.get("files") or 0 for run in runs)
    total = sum(run.get("bytes") or 0 for run in runs)
    came = f"{new} new" if new else "nothing new"
    names = [str(run.get("run")) for run in runs]
    several = len(names) > 1  # the paths are each run's own: name the run when there are several
    bad = [
        text
        for entry in gate.get("runs") or []
        if entry.get("name") in names
        for text in _known_bad(entry.get("known_bad"), str(entry.get("name")) if several else "")
    ]
    told = f"; {_bad_text(bad)}" if bad else ""
    return f"pulled to {pull['to']} ({came}; {files} files, {size(total)} verified{told})"


def _load_part(load: Mapping[str, Any]) -> str:
    if not load.get("ran"):
        return (
            f"load-verify: {load['note']}" if load.get("note") and load.get("note") != "no load-verify command" else ""
        )
    return f"load-verify {load['checks'] - len(load.get('failed') or [])}/{load['checks']} passed ({load.get('on')})"


def _removed(entries: Any) -> str:
    entries = [entry for entry in entries or [] if isinstance(entry, Mapping)]
    if not entries:
        return ""
    paths = ", ".join(str(entry.get("path")) for entry in entries[:3]) + (" ..." if len(entries) > 3 else "")
    files = sum(entry.get("files") or 0 for entry in entries if isinstance(entry.get("files"), int))
    total = sum(entry.get("bytes") or 0 for entry in entries if isinstance(entry.get("bytes"), int))
    return f"{paths} ({files} files, {size(total)})"


def _scratch_part(scratch: Mapping[str, Any]) -> str:
    if not scratch:
        return ""
    if scratch.get("preview"):
        would = _removed(scratch.get("would_remove"))
        return f"would remove {would}" if would else "no scratch left to remove"
    removed = _removed(scratch.get("removed"))
    return f"removed {removed}" if removed else "scratch already removed"


def _meter_part(meter: Mapping[str, Any], record: Mapping[str, Any]) -> str:
    verb = f"{record.get('verb')}{', IRREVERSIBLE' if record.get('irreversible') else ''}"
    state = meter.get("state")
    if state == "would_run":
        argv = meter.get("would_run") or meter.get("command") or []
        return f"meter-stop ({verb}) would run: {shlex.join(str(item) for item in argv)}"
    if state == "already":
        return f"meter-stop ({verb}): already {meter.get('final_state') or 'gone'}, nothing run"
    if state == "stopped":
        return f"meter-stop ({verb}): {meter.get('msg') or meter.get('final_state')}"
    if state == "manual":
        return f"meter-stop ({verb}) is manual: THE BOX STILL BILLS until you stop it (steps below)"
    return str(meter.get("msg") or "")


def _stop_part(stopped: Any) -> str:
    """The live runs ``stop_running`` stopped before the gate judged again (their cells say stopped by teardown)."""
    said = [
        str(entry.get("msg") or f"run {entry.get('run')}").removeprefix("stopped ")
        for entry in stopped or []
        if isinstance(entry, Mapping) and entry.get("changed")
    ]
    return f"stopped by teardown (stop_running): {', '.join(said)}" if said else ""


def _instance_part(gate: Mapping[str, Any], record: Mapping[str, Any]) -> str:
    instance = (gate or {}).get("instance") or {}
    if not record.get("instance_id") or record.get("verb") in (None, "none") or not instance:
        return ""
    if instance.get("id_checked"):
        return f"instance id {record['instance_id']} matches the box ({instance.get('id_source')})"
    return f"instance id {record['instance_id']} was not cross-checked (the box does not tell its own id)"


def line(record: Mapping[str, Any]) -> str:
    """Host, status, runs, each step's evidence (or why the box stopped, and that nothing after it ran), and what
    the box cost up to now; the cost is kept when the rest is cut."""
    cost = cost_text(record.get("cost") if isinstance(record.get("cost"), Mapping) else None)
    tail = f"; {cost}" if cost else ""
    return _evidence(record)[: LINE_CHARS - len(tail)] + tail


def _evidence(record: Mapping[str, Any]) -> str:
    host, status = record.get("host", "?"), record.get("status", "?")
    runs = ",".join(str(run) for run in record.get("runs") or []) or "?"
    if status == "UNREACHABLE":
        return f"{host}  UNREACHABLE  {record.get('reason') or 'host unreachable'}"
    gate = record.get("gate") or {}
    parts = [_stop_part(record.get("stop_running"))]
    parts += [_gate_part(gate, _pulled(record))] if gate.get("passed") else []
    parts += [_instance_part(gate, record)] if gate.get("passed") else []
    parts += [_pull_part(record.get("pull") or {}, gate), _load_part(record.get("load_verify") or {})]
    head = f"{host}  {status}  runs {runs}"
    if status in ("REFUSED", "FAILED"):
        head += f" at {record.get('step')}: {record.get('reason')}"
    if status == "REFUSED":
        parts.append("nothing deleted, nothing stopped")
    else:
        parts += [_scratch_part(record.get("scratch") or {}), _meter_part(record.get("meter_stop") or {}, record)]
    if status == "UNCONFIRMED":
        parts.append(f"nothing done: {record.get('reason')}")
    shown = [part for part in parts if part]
    joined = f"{head}{';' if status in ('REFUSED', 'FAILED') else ':'} " + "; ".join(shown) if shown else head
    return joined.replace("\n", " ")


def lines(record: Mapping[str, Any]) -> List[str]:
    """The line, then one indented line per warning, manual step and data-loss clock."""
    shown = [str(record.get("line") or line(record))]
    shown += [f"  WARNING: {warning}" for warning in record.get("warnings") or []]
    meter = record.get("meter_stop") or {}
    if meter.get("state") == "manual":
        shown += [f"  step {index}: {step}" for index, step in enumerate(meter.get("steps") or [], 1)]
    if record.get("status") in ("TORN_DOWN", "CHECKED", "UNCONFIRMED", "STOP_BY_HAND"):
        shown += [f"  data-loss clock: {clock}" for clock in record.get("data_loss_clocks") or []]
    return shown


def no_record(host: str) -> Dict[str, Any]:
    """A host of the play without a teardown record: it failed before its teardown step ran."""
    reason = "no teardown record: the host failed before its teardown step ran (see its task error above)"
    record = {"host": host, "status": "REFUSED", "step": "validate", "reason": reason, "runs": ["?"]}
    return dict(record, line=line(record))


def summary(records: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
    """Counts per status, the hosts per outcome and one line."""
    named = ("UNCONFIRMED", "STOP_BY_HAND", "UNREACHABLE")
    return status_summary(list(records), STATUSES, named, ("REFUSED", "FAILED"))
