# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown filters for the verdicts: one host's record from every step's evidence, and its lines.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
A record holds what the modules returned, never a secret: the pull's argv is redacted by ``teardown_pull``.
"""

from __future__ import annotations

import shlex
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ansible_collections.remote_gpu.trainer.plugins.filter.fleet import UNREACHABLE
from ansible_collections.remote_gpu.trainer.plugins.filter.teardown import CONFIRM_STEP, GATE_STEPS, _line

STATUSES = ("TORN_DOWN", "CHECKED", "UNCONFIRMED", "REFUSED", "FAILED", UNREACHABLE)
FAILING = ("REFUSED", "UNCONFIRMED", "FAILED")
UNREACHABLE_REASON = "unreachable, or stopped before the teardown ran (see its task error)"
GATE_KEYS = ("passed", "step", "reason", "run", "cells", "missing_cells", "durable", "artifacts", "scratch")
GATE_KEYS += ("torn_down", "notes")
SCRATCH_KEYS = ("changed", "removed", "would_remove", "tombstone", "refused", "problems", "msg")
METER_KEYS = ("command", "would_run", "final_state", "gone", "already", "polls", "states", "command_rc")
METER_KEYS += ("command_output_tail", "status_output_tail", "msg")
STOP_KEYS = ("changed", "state", "pgid", "sid", "msg")
LINE_CHARS = 600


def _mapping(value: Any) -> Optional[Mapping[str, Any]]:
    """A registered result that ran: a mapping, not skipped."""
    return value if isinstance(value, Mapping) and not value.get("skipped") else None


def _size(count: Any) -> str:
    value = float(count) if isinstance(count, (int, float)) and not isinstance(count, bool) else 0.0
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop always returns


def _pick(result: Optional[Mapping[str, Any]], keys: Iterable[str]) -> Optional[Dict[str, Any]]:
    return {key: result.get(key) for key in keys if key in result} if result is not None else None


def _scratch(result: Any, check_mode: bool, confirmed: bool) -> Optional[Dict[str, Any]]:
    ran = _mapping(result)
    if ran is None:
        return None
    record = _pick(ran, SCRATCH_KEYS) or {}
    record["check_mode"] = bool(check_mode or not confirmed)
    record["failed"] = bool(ran.get("failed") or ran.get("unreachable"))
    if ran.get("unreachable"):
        record["msg"] = _line(ran.get("msg") or "host unreachable")
    return record


def _meter(result: Any, mode: str, *, verb: str, steps: Any, irreversible: bool, preview: bool) -> Dict[str, Any]:
    base: Dict[str, Any] = {"verb": verb, "irreversible": irreversible}
    if mode == "none":
        return dict(base, state="none", msg="no meter-stop on this platform (meter_stop_verb none)")
    if mode == "manual":
        shown = [str(step) for step in steps or []]
        return dict(base, state="manual", steps=shown, msg="stop it in the provider's console: " + " | ".join(shown))
    ran = _mapping(result)
    if ran is None:
        return dict(base, state="not_run", msg="the meter-stop did not run")
    record = dict(base, **(_pick(ran, METER_KEYS) or {}))
    if ran.get("failed") or not (preview or ran.get("final_state") or ran.get("gone") is True):
        record["state"] = "failed"
    elif preview:
        record["state"] = "would_run"
    elif ran.get("already"):
        record["state"] = "already"
    else:
        record["state"] = "stopped"
    return record


def _first_missing(evidence: Mapping[str, Any]) -> str:
    """The step a task error stopped: the first whose evidence is missing."""
    for step, key in (
        ("validate", "gate"),
        ("survival", "survival"),
        ("pull", "pull"),
        ("load_verify", "load_verify"),
        (CONFIRM_STEP, "confirmation"),
        ("scratch", "scratch"),
    ):
        if evidence.get(key) is None:
            return step
    return "meter_stop"


def _status_of_step(step: str) -> str:
    if step in GATE_STEPS:
        return "REFUSED"
    if step == CONFIRM_STEP:
        return "UNCONFIRMED"
    return "FAILED"


def _warnings(record: Mapping[str, Any], gate: Optional[Mapping[str, Any]], host: str) -> List[str]:
    warnings = []
    meter = record.get("meter_stop") or {}
    status = record["status"]
    acting = status in ("TORN_DOWN", "CHECKED", "UNCONFIRMED") or record.get("step") == "meter_stop"
    if record.get("irreversible") and acting:
        warnings.append(
            f"meter-stop verb {record.get('verb')} is irreversible: the instance and its disks are destroyed; "
            "only the verified durable copy remains"
        )
    if acting and meter.get("state") == "manual":
        warnings.append("the meter is still running: stop it in the provider's console (steps below)")
    if record.get("check_mode") and not (record.get("confirmation") or {}).get("confirmed", True):
        warnings.append(f"not confirmed: a real teardown stops before acting (set confirm_teardown={host} or all)")
    cells = [cell for cell in (gate or {}).get("cells") or [] if isinstance(cell, Mapping)]
    accepted = [str(cell.get("name")) for cell in cells if cell.get("accepted")]
    if accepted:
        warnings.append(f"cells accepted unfinished (their results are not secured): {', '.join(accepted)}")
    warnings += [_line(note) for note in (gate or {}).get("notes") or []]
    return warnings


def teardown_result(
    host: str,
    run: str,
    *,
    gate: Any = None,
    stopped: Any = None,
    survival: Any = None,
    pull: Any = None,
    load_verify: Any = None,
    confirmation: Any = None,
    scratch: Any = None,
    meter: Any = None,
    meter_mode: str = "command",
    verb: str = "none",
    irreversible: bool = False,
    manual_steps: Any = None,
    platform: str = "",
    data_loss_clocks: Any = None,
    problem: Any = None,
    error: str = "",
    check_mode: bool = False,
) -> Dict[str, Any]:
    """One host's teardown record from each step's evidence (null where the step did not run).

    The status: the step in ``problem`` (the first that stopped the box) refuses it (a gate step), leaves it
    ``UNCONFIRMED`` (``confirm``) or fails it (``scratch``, ``meter_stop``); unreachable before the box ever
    answered is ``UNREACHABLE``; ``error`` (a task that stopped the box) counts at the first step without evidence.
    Else ``CHECKED`` in check mode, ``UNCONFIRMED`` without confirmation, ``TORN_DOWN``.
    """
    gate_result = _mapping(gate)
    confirmed = bool((confirmation or {}).get("confirmed")) if isinstance(confirmation, Mapping) else False
    preview = bool(check_mode or not confirmed)
    evidence = {
        "gate": gate_result,
        "survival": survival,
        "pull": pull,
        "load_verify": load_verify,
        "confirmation": confirmation,
        "scratch": _mapping(scratch),
    }
    problem = dict(problem) if isinstance(problem, Mapping) and problem.get("step") else {}
    if not problem and error:
        problem = {"step": _first_missing(evidence), "reason": _line(error), "unreachable": False}
    if not problem and not check_mode and isinstance(confirmation, Mapping) and not confirmed:
        problem = {"step": CONFIRM_STEP, "reason": _line(confirmation.get("reason") or "not confirmed")}
    reachable = not (problem.get("unreachable") and (gate_result is None or gate_result.get("unreachable")))
    if not reachable:
        status = UNREACHABLE
    elif problem:
        status = _status_of_step(str(problem["step"]))
    else:
        status = "CHECKED" if check_mode else "TORN_DOWN"
    reached_meter = status in ("TORN_DOWN", "CHECKED", "UNCONFIRMED") or problem.get("step") == "meter_stop"
    scratch_record = _scratch(scratch, check_mode, confirmed)
    stop_record = _pick(_mapping(stopped), STOP_KEYS)
    meter_record = None
    if reached_meter:
        meter_record = _meter(
            meter, meter_mode, verb=verb, steps=manual_steps, irreversible=bool(irreversible), preview=preview
        )
    answered = gate_result if gate_result is not None and not gate_result.get("unreachable") else None
    record: Dict[str, Any] = {
        "host": host,
        "reachable": reachable,
        "run": run,
        "status": status,
        "step": problem.get("step"),
        "reason": problem.get("reason", ""),
        "check_mode": bool(check_mode),
        "platform": platform or None,
        "verb": verb,
        "irreversible": bool(irreversible),
        "gate": _pick(answered, GATE_KEYS),
        "stop_running": stop_record,
        "survival": survival if isinstance(survival, Mapping) else None,
        "pull": pull if isinstance(pull, Mapping) else None,
        "load_verify": load_verify if isinstance(load_verify, Mapping) else None,
        "confirmed": confirmed,
        "confirmation": confirmation if isinstance(confirmation, Mapping) else None,
        "scratch": scratch_record,
        "meter_stop": meter_record,
        "data_loss_clocks": [str(clock) for clock in data_loss_clocks or []],
    }
    record["changed"] = not check_mode and any(
        bool(part and part.get("changed"))
        for part in (
            stop_record,
            record["pull"],
            scratch_record if confirmed else None,
            meter_record if confirmed else None,
        )
    )
    record["error"] = problem.get("reason", "") if not reachable else ""
    record["warnings"] = _warnings(record, record["gate"], host)
    record["line"] = teardown_line(record)
    return record


def teardown_unreachable(host: str, reason: str = UNREACHABLE_REASON) -> Dict[str, Any]:
    """The record of a host that never answered (or stopped before the teardown's first task)."""
    record = teardown_result(host, "?", problem={"step": "run_alive", "reason": reason, "unreachable": True})
    record["reason"] = record["error"] = _line(reason)
    record["line"] = teardown_line(record)
    return record


# ---- the lines ------------------------------------------------------------------------------------------------


def _gate_part(gate: Mapping[str, Any]) -> str:
    cells = [cell for cell in gate.get("cells") or [] if isinstance(cell, Mapping)]
    durable = gate.get("durable") or {}
    run_state = (gate.get("run") or {}).get("state")
    done = sum(1 for cell in cells if cell.get("done"))
    parts = [f"{done}/{len(cells)} cells done"] if cells else []
    if run_state == "torn_down":
        parts = ["torn down before"]
    if durable.get("files") or durable.get("exists"):
        parts.append(f"durable {durable.get('files') or 0} files, {_size(durable.get('bytes'))} verified")
    else:
        parts.append("no durable copy (accept_no_artifacts)")
    return "gate passed (" + "; ".join(parts) + ")"


def _pull_part(pull: Mapping[str, Any]) -> str:
    if not pull.get("to") or not pull.get("passed"):
        return ""
    if pull.get("dry_run"):
        return f"would pull {pull.get('received_count') or 0} new files to {pull['to']} (not verified: check mode)"
    came = f"{pull.get('received_count') or 0} new" if pull.get("received_count") else "nothing new"
    return f"pulled to {pull['to']} ({came}; {pull.get('files') or 0} files, {_size(pull.get('bytes'))} verified)"


def _load_part(load: Mapping[str, Any]) -> str:
    checks = [check for check in load.get("checks") or [] if isinstance(check, Mapping)]
    if not load.get("ran"):
        return f"load-verify: {load['note']}" if load.get("note") and load.get("command") else ""
    failed = len(load.get("failed") or [])
    return f"load-verify {len(checks) - failed}/{len(checks)} passed ({load.get('on')})"


def _removed(entries: Any) -> str:
    entries = [entry for entry in entries or [] if isinstance(entry, Mapping)]
    if not entries:
        return ""
    paths = ", ".join(str(entry.get("path")) for entry in entries[:3]) + (" ..." if len(entries) > 3 else "")
    files = sum(entry.get("files") or 0 for entry in entries if isinstance(entry.get("files"), int))
    size = sum(entry.get("bytes") or 0 for entry in entries if isinstance(entry.get("bytes"), int))
    return f"{paths} ({files} files, {_size(size)})"


def _scratch_part(scratch: Optional[Mapping[str, Any]]) -> str:
    if not scratch or scratch.get("failed"):
        return ""
    if scratch.get("check_mode"):
        would = _removed(scratch.get("would_remove"))
        return f"would remove {would}" if would else "no scratch left to remove"
    removed = _removed(scratch.get("removed"))
    return f"removed {removed}" if removed else "scratch already removed"


def _meter_part(meter: Optional[Mapping[str, Any]]) -> str:
    if not meter:
        return ""
    verb = f"{meter.get('verb')}{', IRREVERSIBLE' if meter.get('irreversible') else ''}"
    state = meter.get("state")
    if state == "would_run":
        argv = meter.get("would_run") or meter.get("command") or []
        return f"meter-stop ({verb}) would run: {shlex.join(str(item) for item in argv)}"
    if state == "already":
        return f"meter-stop ({verb}): already {meter.get('final_state') or 'gone'}, nothing run"
    if state == "stopped":
        return f"meter-stop ({verb}): {meter.get('msg') or meter.get('final_state')}"
    if state == "manual":
        return f"meter-stop ({verb}) is manual: see the steps"
    if state == "none":
        return "no meter-stop (verb none)"
    return ""


def _bounded(line: str) -> str:
    """At most LINE_CHARS, on one line (the parts are one-line already; the double spaces stay)."""
    line = line.replace("\n", " ")
    return line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 3] + "..."


def teardown_line(record: Mapping[str, Any]) -> str:
    """One line: host, status, run, and the evidence of each step (or why the box stopped, and what did not happen)."""
    host, status, run = record.get("host", "?"), record.get("status", "?"), record.get("run", "?")
    if status == UNREACHABLE or not record.get("reachable", True):
        return _bounded(f"{host}  {UNREACHABLE}  {_line(record.get('reason') or UNREACHABLE_REASON)}")
    gate = record.get("gate") or {}
    parts = [_gate_part(gate)] if gate.get("passed") else []
    parts += [_pull_part(record.get("pull") or {}), _load_part(record.get("load_verify") or {})]
    head = f"{host}  {status}  run {run}"
    if status == "REFUSED":
        head += f" at {record.get('step')}: {record.get('reason')}"
        parts = [*parts, "nothing deleted, nothing stopped"]
    else:
        parts += [_scratch_part(record.get("scratch")), _meter_part(record.get("meter_stop"))]
    if status == "FAILED":
        head += f" at {record.get('step')}: {record.get('reason')}"
    elif status == "UNCONFIRMED":
        parts.append(f"nothing done: {record.get('reason')}")
    shown = [part for part in parts if part]
    line = f"{head}; " + "; ".join(shown) if status in ("REFUSED", "FAILED") else f"{head}: " + "; ".join(shown)
    return _bounded(line if shown else head)


def teardown_lines(record: Mapping[str, Any]) -> List[str]:
    """The host's line, then one indented line per warning, manual meter-stop step and data-loss clock."""
    if not isinstance(record, Mapping):
        return [f"?  UNKNOWN  not a teardown record: {_line(record, 80)!r}"]
    lines = [str(record.get("line") or teardown_line(record))]
    lines += [f"  WARNING: {warning}" for warning in record.get("warnings") or []]
    meter = record.get("meter_stop") or {}
    if meter.get("state") == "manual":
        lines += [f"  step {index}: {step}" for index, step in enumerate(meter.get("steps") or [], 1)]
    if record.get("status") in ("TORN_DOWN", "CHECKED", "UNCONFIRMED") or record.get("step") == "meter_stop":
        lines += [f"  data-loss clock: {clock}" for clock in record.get("data_loss_clocks") or []]
    return lines


class FilterModule:
    """Teardown filters for the host records and their lines."""

    def filters(self) -> Dict[str, Any]:
        return {
            "teardown_result": teardown_result,
            "teardown_lines": teardown_lines,
        }
