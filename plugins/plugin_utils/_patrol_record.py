# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One box's patrol record, made from its ``patrol_facts`` answer on the controller.

The box is untrusted: every field of its answer that the controller uses is checked, and an answer that is not the
module's shape becomes state ``unknown`` with a reason saying what was wrong, never an error of the play.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import finite as number
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import STATE_ORDER
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_billing import autostop_facts, box_facts
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line as line_of

# Worst first, as patrol_facts orders them; "unreachable" is the controller's own state for a host that never
# answered, reported apart from them (exit code 4, not 2).
STATES = STATE_ORDER
UNREACHABLE = "unreachable"
CONSOLE_ADVICE = "only the box's owner can see its console: check the balance, power and preemption"
# Problem ids: `<kind>` or `<kind>:<what>` (a run, a run's cell, a GPU, a directory); anything else is dropped.
PROBLEM_ID = re.compile(r"\A[a-z][a-z0-9_]*(?::[A-Za-z0-9_.:/@+-]{1,160})?\Z")
MAX_REASONS = 20
MAX_RUNS_KEPT = 200
FACT_KEYS = (
    "state", "escalate", "reasons", "problems", "actions", "run", "headline", "alive", "cells_done", "cells_total",
    "progress", "eta_s", "log_idle_s", "crash_signatures", "disk", "disks", "gpu", "gpu_backend", "gpu_error",
    "memory", "xids", "runs", "examined_runs", "runs_skipped", "runs_archived", "run_filter", "msg", "box", "autostop",
)  # fmt: skip
# The controller's own keys: the box's cost (hourly_usd), a bad rate's one line, and idle_billing.
MONEY_KEYS = ("cost", "cost_warning", "idle_billing")
# The box's state beside its runs' (_patrol_states: RUNNING, STOPPED, INTERRUPTED, GONE, UNREACHABLE), the provider's
# answer for a box that did not answer, the stop of ours behind a STOPPED box, the last tick that saw it run, and what
# the profile says a stopped instance bills.
BOX_STATE_KEYS = ("box_state", "provider", "our_stop", "last_seen", "stopped_bills")
# Record states of a box the provider says is stopped (a GONE or UNREACHABLE one is "unreachable").
DOWN_STATES = ("stopped", "interrupted")
LIST_KEYS = ("crash_signatures", "disks", "gpu", "xids", "runs")
DICT_KEYS = ("progress", "disk", "memory")
COUNT_KEYS = ("alive", "cells_done", "cells_total", "runs_skipped", "runs_archived")
TEXT_KEYS = ("run", "headline", "gpu_backend", "gpu_error", "msg", "run_filter")


def count(value: Any) -> Optional[int]:
    found = number(value)
    return int(found) if found is not None and found >= 0 and found == int(found) else None


def strings(value: Any) -> Optional[List[str]]:
    """A list of strings (each made one bounded line), or None when ``value`` is not one."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return None
    return [line_of(item) for item in value]


def dicts(value: Any) -> List[Dict[str, Any]]:
    return [dict(item) for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def base(host: str, python: Optional[str] = None) -> Dict[str, Any]:
    """The record's shape with nothing known: every key the report, the lines and the notifier read."""
    record: Dict[str, Any] = dict.fromkeys((*FACT_KEYS, *MONEY_KEYS, *BOX_STATE_KEYS))
    record.update({key: [] for key in LIST_KEYS})
    record.update(reasons=[], problems=[], actions=[], escalate=False, examined_runs=[])
    record.update(host=host, reachable=True, python=python)
    return record


def broken(host: str, reason: str, problem: str, python: Optional[str] = None, run_filter: str = "") -> Dict[str, Any]:
    """A reachable box whose patrol gave no answer the controller can use: unknown, escalated."""
    record = base(host, python)
    record.update(
        state="unknown", escalate=True, reasons=[line_of(reason)], problems=[problem], actions=["investigate"],
        msg=line_of(f"unknown: {reason}"), run_filter=run_filter or None,
    )  # fmt: skip
    return record


def unreachable(host: str, reason: str) -> Dict[str, Any]:
    """A box that never answered: state ``unreachable``, problem ``unreachable``; not escalated (exit code 4, not 2),
    but notified like a problem."""
    record = base(host)
    why = line_of(reason or "unreachable")
    record.update(
        reachable=False, state=UNREACHABLE, error=why, reasons=[f"{why}; {CONSOLE_ADVICE}"], problems=[UNREACHABLE],
        actions=["investigate"], msg=f"{UNREACHABLE}: {why}",
    )  # fmt: skip
    return record


def _copy_fields(facts: Mapping[str, Any], record: Dict[str, Any]) -> List[str]:
    """Copy every field but state and escalate into ``record``, checked; returns what was ignored."""
    ignored: List[str] = []
    for key in ("reasons", "actions", "problems", "examined_runs"):
        items = strings(facts.get(key))
        if items is None:
            ignored += [key] if facts.get(key) is not None else []
            items = []
        if key == "problems":
            dropped = [item for item in items if not PROBLEM_ID.match(item)]
            ignored += [f"problem id {item[:40]!r}" for item in dropped]
            items = [item for item in items if item not in dropped]
        if key == "reasons" and len(items) > MAX_REASONS:
            items = [*items[:MAX_REASONS], f"+{len(items) - MAX_REASONS} more reasons"]
        record[key] = list(dict.fromkeys(items))
    for key in (*COUNT_KEYS, "eta_s", "log_idle_s"):
        found = number(facts.get(key))
        found = None if found is None or found < 0 else found
        record[key] = count(found) if key in COUNT_KEYS else found
        if facts.get(key) is not None and record[key] is None:
            ignored.append(key)
    for key in TEXT_KEYS:
        value = facts.get(key)
        record[key] = line_of(value) if isinstance(value, str) else None
        if value is not None and not isinstance(value, str):
            ignored.append(key)
    for key in DICT_KEYS:
        value = facts.get(key)
        record[key] = dict(value) if isinstance(value, Mapping) else None
        if value is not None and not isinstance(value, Mapping):
            ignored.append(key)
    for key in LIST_KEYS:
        value = facts.get(key)
        record[key] = dicts(value)[:MAX_RUNS_KEPT]
        if value is not None and (not isinstance(value, list) or len(dicts(value)) != len(value)):
            ignored.append(key)
    for key, check in (("box", box_facts), ("autostop", autostop_facts)):
        record[key], usable = check(facts.get(key))
        ignored += [] if usable else [key]
    return ignored


def checked(host: str, facts: Mapping[str, Any], python: Optional[str]) -> Dict[str, Any]:
    """The module's facts, each field the controller uses checked; a bad state or escalate makes it unknown."""
    record = base(host, python)
    wrong: List[str] = []
    state, escalate = facts.get("state"), facts.get("escalate")
    if state not in STATES:
        wrong.append(f"state {line_of(state, 40)!r}")
    if not isinstance(escalate, bool):
        wrong.append(f"escalate {line_of(escalate, 40)!r}")
    ignored = _copy_fields(facts, record)
    record.update(state=state if state in STATES else "unknown", escalate=escalate is True)
    if wrong:
        reason = f"the box's patrol_facts answer is not usable: {', '.join(wrong)}"
        record.update(escalate=True, msg=line_of(f"unknown: {reason}"), headline=None)
        record["reasons"].insert(0, line_of(reason))
        record["problems"] = list(dict.fromkeys(["patrol_invalid", *record["problems"]]))
        record["actions"] = list(dict.fromkeys([*record["actions"], "investigate"]))
    elif record["state"] == "unknown":
        record["escalate"] = True  # unknown means a reading failed: always a human's job, whatever the box said
    if record["escalate"] and not record["problems"]:
        record["problems"] = [f"escalated:{record['state']}"]  # notifications go by problem id
    if ignored:
        record["reasons"].append(line_of(f"ignored what the box answered for: {', '.join(dict.fromkeys(ignored))}"))
    if not record["msg"]:
        record["msg"] = f"{record['state']}: {record['reasons'][0] if record['reasons'] else 'no reason given'}"
    return record


def from_answer(host: str, answer: Mapping[str, Any], python: str, run_filter: str) -> Dict[str, Any]:
    """The record of one ``patrol_facts`` call's answer (reachable: the caller handles an unreachable box)."""
    facts = answer.get("ansible_facts", {}).get("patrol") if isinstance(answer.get("ansible_facts"), Mapping) else None
    facts = facts if isinstance(facts, Mapping) else answer
    if answer.get("failed") or "state" not in facts:
        return broken(
            host, f"patrol_facts failed with {python}: {_failure_reason(answer)}", "patrol_failed", python, run_filter
        )
    return checked(host, facts, python)


def _failure_reason(answer: Mapping[str, Any]) -> str:
    if answer.get("rc") == 127 or re.search(r"interpreter .* was not found", str(answer.get("msg") or "")):
        return "no such Python on the box (set patrol_python, or ansible_python_interpreter, to one that exists)"
    for key in ("msg", "module_stderr", "stderr", "module_stdout"):
        lines = str(answer.get(key) or "").strip().splitlines()
        if lines:
            return line_of(lines[-1] if key == "module_stderr" else lines[0])
    return "no message"
