# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Patrol filters: one host's result from its patrol_facts call, its report lines, the fleet summary and the
notifications of a tick.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
The box is untrusted: every field of its answer that the controller uses is checked, and an answer that is not the
module's shape becomes state ``unknown`` with a reason saying what was wrong, never an error of the play.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter.fleet import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REPORT_NOT_WRITTEN,
    EXIT_UNREACHABLE,
    hosts_or_exit,
)

# Worst first, as patrol_facts orders them; "unreachable" is the controller's own state for a host that never
# answered, reported apart from them (exit code 4, not 2).
STATES = ("unknown", "crashed", "incomplete", "stalled", "disk_pressure", "running", "done", "idle")
UNREACHABLE = "unreachable"
CONSOLE_ADVICE = "only the box's owner can see its console: check the balance, power and preemption"
UNREACHABLE_REASON = "unreachable, or stopped before patrol ran"
# Problem ids: `<kind>` or `<kind>:<what>` (a run, a GPU, a directory); anything else from the box is dropped.
PROBLEM_ID = re.compile(r"\A[a-z][a-z0-9_]*(?::[A-Za-z0-9_.:/@+-]{1,120})?\Z")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
LINE_CHARS = 300
TEXT_CHARS = 1000
MAX_REASONS = 20
SHOWN_REASONS = 2
SHOWN_GPUS = 8
STATE_VERSION = 1
MODES = ("send", "check", "off")
# The keys of patrol_facts' answer the report keeps (its RETURN); the rest of a registered result is Ansible's.
FACT_KEYS = (
    "state",
    "escalate",
    "reasons",
    "problems",
    "actions",
    "run",
    "alive",
    "cells_done",
    "cells_total",
    "progress",
    "eta_s",
    "log_idle_s",
    "crash_signatures",
    "disk",
    "disks",
    "gpu",
    "gpu_backend",
    "gpu_error",
    "memory",
    "xids",
    "runs",
    "msg",
)
LIST_KEYS = ("crash_signatures", "disks", "gpu", "xids", "runs")
DICT_KEYS = ("progress", "disk", "memory")


# ---- small checks of the box's values ------------------------------------------------------------------------


def _line(text: Any, limit: int = LINE_CHARS) -> str:
    """One bounded line: messages from the box and from Ansible can span lines or be huge."""
    line = " ".join(str(text if text is not None else "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _number(value: Any) -> Optional[float]:
    """A finite number, or None (booleans, strings, NaN and infinities are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> Optional[int]:
    number = _number(value)
    return int(number) if number is not None and number >= 0 and number == int(number) else None


def _strings(value: Any) -> Optional[List[str]]:
    """A list of strings (each made one bounded line), or None when ``value`` is not one."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return None
    return [_line(item) for item in value]


def _dicts(value: Any) -> List[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _fmt_pct(value: Any) -> str:
    number = _number(value)
    return "?" if number is None else f"{number:.0f}%"


def _fmt_duration(seconds: Any) -> str:
    """``1d2h``, ``3h05m``, ``12m``, ``40s``: an ETA or an idle time, to the minute past an hour."""
    number = _number(seconds)
    if number is None or number < 0:
        return "?"
    total = int(number)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m"
    return f"{secs}s"


# ---- one host's result ---------------------------------------------------------------------------------------


def _python_missing(result: Mapping[str, Any]) -> bool:
    """Whether a module call failed because its interpreter is not on the box (the shell's 127, or Ansible's
    "The module interpreter ... was not found"). ``failed`` itself is no evidence: the role registers the call
    under ``failed_when: false``, which sets it false."""
    msg = str(result.get("msg") or "")
    return result.get("rc") == 127 or bool(re.search(r"interpreter .* was not found", msg))


def _failure_reason(result: Mapping[str, Any]) -> str:
    for key in ("msg", "module_stderr", "stderr", "module_stdout"):
        lines = str(result.get(key) or "").strip().splitlines()
        if lines:
            return _line(lines[0])
    return "no message"


def _base(host: str) -> Dict[str, Any]:
    """The result's shape with nothing known: every key the report and the lines read."""
    base: Dict[str, Any] = dict.fromkeys(FACT_KEYS)
    base.update({key: [] for key in LIST_KEYS})
    base.update(reasons=[], problems=[], actions=[], escalate=False)
    base.update(host=host, reachable=True, python=None)
    return base


def _broken(host: str, reason: str, problem: str, python: Optional[str] = None) -> Dict[str, Any]:
    """A reachable host whose patrol did not give an answer the controller can use: unknown, escalated."""
    result = _base(host)
    result.update(
        state="unknown",
        escalate=True,
        reasons=[_line(reason)],
        problems=[problem],
        actions=["investigate"],
        python=python,
        msg=_line(f"unknown: {reason}"),
    )
    return result


def _copy_fields(facts: Mapping[str, Any], result: Dict[str, Any]) -> List[str]:
    """Copy every field but state and escalate into ``result``, checked; returns what was ignored."""
    ignored: List[str] = []
    for key in ("reasons", "actions", "problems"):
        items = _strings(facts.get(key))
        if items is None:
            ignored.append(key)
            items = []
        if key == "problems":
            dropped = [item for item in items if not PROBLEM_ID.match(item)]
            ignored += [f"problem id {item[:40]!r}" for item in dropped]
            items = [item for item in items if item not in dropped]
        if key == "reasons" and len(items) > MAX_REASONS:
            items = [*items[:MAX_REASONS], f"+{len(items) - MAX_REASONS} more reasons"]
        result[key] = list(dict.fromkeys(items))
    for key in ("alive", "cells_done", "cells_total", "eta_s", "log_idle_s"):
        number = _number(facts.get(key))
        number = None if number is None or number < 0 else number
        result[key] = _count(number) if key in ("alive", "cells_done", "cells_total") else number
        if facts.get(key) is not None and result[key] is None:
            ignored.append(key)
    for key in ("run", "gpu_backend", "gpu_error", "msg"):
        value = facts.get(key)
        result[key] = _line(value) if isinstance(value, str) else None
        if value is not None and not isinstance(value, str):
            ignored.append(key)
    for key in DICT_KEYS:
        value = facts.get(key)
        result[key] = dict(value) if isinstance(value, Mapping) else None
        if value is not None and not isinstance(value, Mapping):
            ignored.append(key)
    for key in LIST_KEYS:
        value = facts.get(key)
        result[key] = _dicts(value)
        if value is not None and (not isinstance(value, list) or len(result[key]) != len(value)):
            ignored.append(key)
    return ignored


def _checked(host: str, facts: Mapping[str, Any], python: Optional[str]) -> Dict[str, Any]:
    """The module's facts, each field the controller uses checked; a bad state or escalate makes it unknown."""
    result = _base(host)
    result["python"] = python
    wrong: List[str] = []
    state, escalate = facts.get("state"), facts.get("escalate")
    if state not in STATES:
        wrong.append(f"state {_line(state, 40)!r}")
    if not isinstance(escalate, bool):
        wrong.append(f"escalate {_line(escalate, 40)!r}")
    ignored = _copy_fields(facts, result)
    result.update(state=state if state in STATES else "unknown", escalate=escalate is True)
    if wrong:
        reason = f"the box's patrol_facts answer is not usable: {', '.join(wrong)}"
        result.update(escalate=True, msg=_line(f"unknown: {reason}"))
        result["reasons"].insert(0, _line(reason))
        result["problems"] = list(dict.fromkeys(["patrol_invalid", *result["problems"]]))
        result["actions"] = list(dict.fromkeys([*result["actions"], "investigate"]))
    elif state == "unknown":
        # unknown means a reading failed: always a human's job, whatever the box said.
        result["escalate"] = True
    if result["escalate"] and not result["problems"]:
        # Notifications go by problem id: an escalation must have one.
        result["problems"] = [f"escalated:{result['state']}"]
    if ignored:
        result["reasons"].append(_line(f"ignored what the box answered for: {', '.join(dict.fromkeys(ignored))}"))
    if not result["msg"]:
        result["msg"] = f"{result['state']}: {result['reasons'][0] if result['reasons'] else 'no reason given'}"
    return result


def patrol_result(
    host: str,
    tick: Optional[Mapping[str, Any]],
    fallback: Optional[Mapping[str, Any]] = None,
    *,
    python: str = "",
    base_python: str = "",
    error: str = "",
) -> Dict[str, Any]:
    """One host's patrol result from its ``patrol_facts`` call (``tick``) and, when that call found no Python,
    the call with the base Python (``fallback``): the module's facts plus ``host``, ``reachable`` and ``python``.

    ``error`` (a task that stopped the host's patrol) makes it ``unknown`` with problem ``patrol_error``; a failed
    call ``patrol_failed``; an answer of the wrong shape ``patrol_invalid``. All three escalate.
    """
    if not isinstance(host, str) or not host:
        raise AnsibleFilterError(f"patrol_result: the host must be a non-empty string, not {host!r}")
    if error:
        return _broken(host, f"patrol stopped: {error}", "patrol_error")
    used, used_python = tick, python or None
    if isinstance(fallback, Mapping) and not fallback.get("skipped"):
        used, used_python = fallback, base_python or None
    if not isinstance(used, Mapping) or used.get("skipped"):
        return _broken(host, "patrol_facts did not run", "patrol_failed")
    if used.get("unreachable"):
        # The role calls the module with ignore_unreachable, so that a tick whose every box is unreachable still
        # reaches the report and the notifications (ansible-playbook ends a run whose whole play is unreachable).
        return patrol_unreachable(host, _failure_reason(used))
    facts = used.get("ansible_facts", {}).get("patrol") if isinstance(used.get("ansible_facts"), Mapping) else None
    facts = facts if isinstance(facts, Mapping) else used
    # The module always answers a state: without one the call failed (failed_when: false hides ``failed``).
    if used.get("failed") or "state" not in facts:
        if used is fallback and _python_missing(used):
            reason = f"no Python on the box: neither {python} nor {base_python} runs"
        else:
            reason = f"patrol_facts failed with {used_python or 'the default Python'}: {_failure_reason(used)}"
        return _broken(host, reason, "patrol_failed", used_python)
    return _checked(host, facts, used_python)


def patrol_unreachable(host: str, reason: str = UNREACHABLE_REASON) -> Dict[str, Any]:
    """The result of a host that never answered: state ``unreachable``, problem ``unreachable``.

    Not ``escalate`` (the exit code is 4 for it, 2 is for escalated boxes), but notified like a problem.
    """
    result = _base(host)
    why = _line(reason or UNREACHABLE_REASON)
    result.update(
        reachable=False,
        state=UNREACHABLE,
        error=why,
        reasons=[f"{why}; {CONSOLE_ADVICE}"],
        problems=[UNREACHABLE],
        actions=["investigate"],
        msg=f"{UNREACHABLE}: {why}",
    )
    return result


def patrol_results(
    hostnames: Iterable[str], hostvars: Mapping[str, Any], key: str = "patrol_result"
) -> List[Dict[str, Any]]:
    """Every targeted host's result; a host without one (or with something else under ``key``) never answered."""
    if isinstance(hostnames, (str, Mapping)):
        raise AnsibleFilterError("patrol_results expects a list of host names")
    results = []
    for host in hostnames:
        record = (hostvars.get(host) or {}).get(key)
        if isinstance(record, Mapping) and record.get("state") in (*STATES, UNREACHABLE):
            results.append(dict(record))
        else:
            results.append(patrol_unreachable(str(host)))
    return results


# ---- the report lines ----------------------------------------------------------------------------------------


def _progress_part(result: Mapping[str, Any]) -> str:
    progress = result.get("progress") if isinstance(result.get("progress"), Mapping) else None
    parts = []
    if progress:
        for name, total in (("epoch", "epochs_total"), ("step", "steps_total")):
            value, limit = _count(progress.get(name)), _count(progress.get(total))
            if value is not None:
                parts.append(f"{name} {value}/{limit}" if limit else f"{name} {value}")
    text = "progress: " + (" ".join(parts) if parts else "no epoch / step marker seen")
    if _number(result.get("eta_s")) is not None:
        text += f", ETA {_fmt_duration(result.get('eta_s'))}"
    if _number(result.get("log_idle_s")) is not None:
        text += f"; logs grew {_fmt_duration(result.get('log_idle_s'))} ago"
    return text


def _disk_part(result: Mapping[str, Any]) -> str:
    disks = _dicts(result.get("disks"))
    if not disks and isinstance(result.get("disk"), Mapping):
        disks = [result["disk"]]
    shown = []
    for disk in disks:
        where = _line(disk.get("path") or disk.get("name") or "?", 80)
        if disk.get("error"):
            shown.append(f"{where} {_line(disk.get('error'), 80)}")
        else:
            bytes_pct, inodes_pct = _fmt_pct(disk.get("bytes_used_pct")), _fmt_pct(disk.get("inodes_used_pct"))
            shown.append(f"{where} {bytes_pct} bytes / {inodes_pct} inodes used")
    return "disk: " + ("; ".join(shown) if shown else "not measured")


def _gpu_part(result: Mapping[str, Any]) -> str:
    gpus = _dicts(result.get("gpu"))
    if not gpus:
        return "gpu: " + (_line(result.get("gpu_error"), 120) if result.get("gpu_error") else "none seen")
    shown = []
    for gpu in gpus[:SHOWN_GPUS]:
        index = _count(gpu.get("index"))
        used, total = _number(gpu.get("memory_used_mib")), _number(gpu.get("memory_total_mib"))
        memory = f" {used / 1024:.0f}/{total / 1024:.0f} GiB" if used is not None and total else ""
        shown.append(f"{'?' if index is None else index}: {_fmt_pct(gpu.get('utilization_pct'))}{memory}")
    more = f", +{len(gpus) - SHOWN_GPUS} more" if len(gpus) > SHOWN_GPUS else ""
    return f"gpu util: {', '.join(shown)}{more}"


def _headline(result: Mapping[str, Any]) -> str:
    host, state = _line(result.get("host") or "?", 80), _line(result.get("state") or "unknown", 40)
    cells_done, cells_total = _count(result.get("cells_done")), _count(result.get("cells_total"))
    parts = []
    if isinstance(result.get("run"), str):
        parts.append(f"run {_line(result['run'], 80)}")
    if cells_total:
        parts.append(f"{cells_done or 0}/{cells_total} cells done")
    elif state != "idle":
        parts.append("no cells")
    alive = _count(result.get("alive"))
    if alive:
        parts.append(f"{alive} alive")
    line = f"{host}  {state.upper()}  " + ", ".join(parts or ["no run"])
    if result.get("escalate") is True:
        actions = _strings(result.get("actions")) or ["investigate"]
        line += f"  ESCALATED -> {', '.join(actions)}"
    return line


def patrol_lines(result: Mapping[str, Any]) -> List[str]:
    """3 to 5 lines for one host: the state and cells, the progress and ETA, disk and GPUs, the reasons.

    Written for any input: a field of the wrong type is shown as unknown, never an error.
    """
    if not isinstance(result, Mapping):
        return [f"?  UNKNOWN  not a patrol result: {_line(result, 80)!r}", "  progress: ?", "  disk: ?  gpu: ?"]
    if not result.get("reachable", True) or result.get("state") == UNREACHABLE:
        host = _line(result.get("host") or "?", 80)
        return [
            f"{host}  UNREACHABLE",
            f"  {_line(result.get('error') or UNREACHABLE_REASON)}",
            f"  {CONSOLE_ADVICE} (re-rent when it is gone)",
        ]
    lines = [_headline(result), f"  {_progress_part(result)}", f"  {_disk_part(result)}; {_gpu_part(result)}"]
    reasons = _strings(result.get("reasons")) or []
    if reasons:
        shown = reasons[:SHOWN_REASONS]
        more = f" (+{len(reasons) - SHOWN_REASONS} more)" if len(reasons) > SHOWN_REASONS else ""
        lines.append("  " + _line(f"reasons: {' | '.join(shown)}{more}", 2 * LINE_CHARS))
    problems = _strings(result.get("problems")) or []
    if result.get("escalate") is True and problems:
        lines.append("  " + _line(f"problems: {', '.join(problems)}"))
    return lines


# ---- the fleet summary ---------------------------------------------------------------------------------------


def _state_of(result: Mapping[str, Any]) -> str:
    if not result.get("reachable", True):
        return UNREACHABLE
    state = result.get("state")
    return state if state in STATES else "unknown"


def patrol_summary(results: Iterable[Mapping[str, Any]], report_error: str = "") -> Dict[str, Any]:
    """Hosts per state, the escalated and unreachable hosts, those to re-rent, the exit code and one line.

    Exit code: 3 when ``report_error`` says the report was not written, else 2 when a host escalated (whatever the
    others), else 4 when a host is unreachable, else 0.
    """
    if isinstance(results, (str, Mapping)):
        raise AnsibleFilterError("patrol_summary expects a list of patrol results")
    results = [result for result in results if isinstance(result, Mapping)]
    by_state: Dict[str, int] = {}
    escalated: List[str] = []
    unreachable: List[str] = []
    re_rent: List[str] = []
    notes: List[str] = []
    for result in results:
        host, state = str(result.get("host") or "?"), _state_of(result)
        by_state[state] = by_state.get(state, 0) + 1
        if state == UNREACHABLE:
            unreachable.append(host)
            continue
        if result.get("escalate") is True:
            escalated.append(host)
            actions = _strings(result.get("actions")) or []
            if "re_rent" in actions:
                re_rent.append(host)
            notes.append(f"{host} ({state}{' -> ' + ', '.join(actions) if actions else ''})")
    order = (*STATES, UNREACHABLE)
    by_state = {state: by_state[state] for state in order if state in by_state}
    if report_error:
        exit_code = EXIT_REPORT_NOT_WRITTEN
    elif escalated:
        exit_code = EXIT_FAILED
    elif unreachable:
        exit_code = EXIT_UNREACHABLE
    else:
        exit_code = EXIT_OK
    line = f"{len(results)} hosts" + (": " + ", ".join(f"{n} {s}" for s, n in by_state.items()) if by_state else "")
    if escalated:
        line += f"; escalated: {', '.join(notes)}"
    if re_rent:
        line += f"; re-rent: {', '.join(re_rent)}"
    if unreachable:
        line += f"; unreachable: {', '.join(unreachable)}"
    summary = {
        "hosts": len(results),
        "by_state": by_state,
        "escalated": escalated,
        "unreachable": unreachable,
        "re_rent": re_rent,
        "exit_code": exit_code,
        "line": line,
    }
    if report_error:
        summary["report_error"] = report_error
    return summary


def patrol_exit(hosts: str, exit_code: Any) -> str:
    """``hosts`` unchanged when the tick's exit code is 0 or 2 (the enforce play fails the escalated boxes, which
    gives 2), else end ansible-playbook at once with that code: 4 (unreachable boxes and nothing escalated: the role
    calls the module with ignore_unreachable, so Ansible no longer counts them), 3 (the report was not written).

    Meant for the last play's ``hosts:``, which ansible-playbook templates in its own process.
    """
    return hosts_or_exit(hosts, exit_code, playbook="patrol", nothing_worse="nothing escalated")


# ---- notifications -------------------------------------------------------------------------------------------


def _slack(text: str) -> str:
    """Slack's three control characters escaped, one bounded line."""
    escaped = _line(text, TEXT_CHARS).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return escaped if len(escaped) <= TEXT_CHARS else escaped[: TEXT_CHARS - 3] + "..."


def _active(result: Mapping[str, Any]) -> List[str]:
    """The problem ids a host has now: its problems when escalated, ``unreachable`` when it never answered."""
    if _state_of(result) == UNREACHABLE:
        return [UNREACHABLE]
    if result.get("escalate") is not True:
        return []
    problems = _strings(result.get("problems")) or []
    return sorted(set(problems)) or [f"escalated:{_state_of(result)}"]


def _previous(state: Any) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """The hosts of the previous tick's state (``{host: {problems, state, since, notified_at}}``) and notes.

    Accepts the state as a dict or as the state file's text; empty means none (a first tick). Anything unreadable
    is a note and a fresh start, never an error: the patrol must go on.
    """
    if state is None or state == "":
        return {}, []
    if isinstance(state, (str, bytes)):
        try:
            state = json.loads(state)
        except ValueError as error:
            return {}, [f"the previous notification state is not JSON ({_line(error, 80)}): starting afresh"]
    hosts = state.get("hosts") if isinstance(state, Mapping) else None
    if not isinstance(hosts, Mapping):
        return {}, ["the previous notification state has no hosts mapping: starting afresh"]
    kept: Dict[str, Dict[str, Any]] = {}
    bad = []
    for host, entry in hosts.items():
        problems = _strings(entry.get("problems")) if isinstance(entry, Mapping) else None
        if not isinstance(host, str) or problems is None:
            bad.append(str(host)[:40])
            continue
        kept[host] = {**entry, "problems": sorted(set(problems))}
    notes = [f"ignored unreadable entries of the notification state: {', '.join(bad)}"] if bad else []
    return kept, notes


def _first_reason(result: Mapping[str, Any]) -> str:
    reasons = _strings(result.get("reasons")) or []
    return reasons[0] if reasons else str(result.get("msg") or "no reason given")


def _message(host: str, event: str, problems: List[str], result: Mapping[str, Any], was: List[str]) -> Dict[str, Any]:
    state = _state_of(result)
    if event == "cleared":
        text = f":white_check_mark: *{host}* cleared, now {state}: was {', '.join(was)}"
    elif state == UNREACHABLE:
        text = f":warning: *{host}* unreachable: {result.get('error') or UNREACHABLE_REASON}; {CONSOLE_ADVICE}"
    else:
        actions = _strings(result.get("actions")) or []
        text = f":rotating_light: *{host}* escalated, {state}: {_first_reason(result)}"
        reasons = _strings(result.get("reasons")) or []
        if len(reasons) > 1:
            text += f" (+{len(reasons) - 1} more)"
        text += f" | new: {', '.join(problems)}" + (f" | actions: {', '.join(actions)}" if actions else "")
    return {"text": _slack(text), "host": host, "event": event, "problems": problems, "report": dict(result)}


def _delivery_errors(delivered: Any) -> Dict[str, str]:
    """Host -> why its message was not delivered, from the webhook task's registered loop results."""
    errors: Dict[str, str] = {}
    for sent in _dicts(delivered):
        item = sent.get("item") if isinstance(sent.get("item"), Mapping) else {}
        host = item.get("host")
        if not isinstance(host, str) or sent.get("skipped"):
            continue
        status = sent.get("status")
        if sent.get("failed") or not isinstance(status, int) or not 200 <= status < 300:
            why = URL.sub("<webhook>", _line(sent.get("msg") or "no answer", 200))
            errors[host] = f"status {status}: {why}"
    return errors


def patrol_notifications(
    previous: Any,
    results: Iterable[Mapping[str, Any]],
    *,
    now: str = "",
    mode: str = "send",
    delivered: Optional[Sequence[Any]] = None,
) -> Dict[str, Any]:
    """The notifications of this tick and the notification state to keep, from the previous tick's state.

    A host gets one ``escalated`` message when it has a problem id it did not have on the previous tick (listing
    the new ids; ``unreachable`` counts as one) and one ``cleared`` message when it had problems and has none now.
    Hosts not in ``results`` keep their state. ``mode``: ``send`` (``delivered``, the webhook task's loop results,
    names the messages that failed: those hosts keep their previous state, so the next tick sends again),
    ``check`` (nothing is sent, the caller does not save the state) or ``off`` (no webhook: the state is kept as
    if sent, so setting a webhook later does not send problems that are already known).
    Returns ``messages``, ``state``, ``failed`` (``{host, event, error}``) and ``lines`` to print.
    """
    if mode not in MODES:
        raise AnsibleFilterError(f"patrol_notifications: mode must be one of {', '.join(MODES)}, not {mode!r}")
    if isinstance(results, (str, Mapping)):
        raise AnsibleFilterError("patrol_notifications expects a list of patrol results")
    hosts, lines = _previous(previous)
    state_hosts = {host: dict(entry) for host, entry in hosts.items()}
    messages: List[Dict[str, Any]] = []
    for result in results:
        if not isinstance(result, Mapping) or not isinstance(result.get("host"), str):
            continue
        host = result["host"]
        before = hosts.get(host, {}).get("problems", [])
        active = _active(result)
        new = [problem for problem in active if problem not in before]
        if new:
            messages.append(_message(host, "escalated", new, result, before))
        elif before and not active:
            messages.append(_message(host, "cleared", before, result, before))
        if active:
            since = hosts[host].get("since") if before and host in hosts else now
            state_hosts[host] = {"problems": active, "state": _state_of(result), "since": since, "updated_at": now}
        else:
            state_hosts.pop(host, None)
    errors = _delivery_errors(delivered) if mode == "send" and delivered is not None else {}
    failed = []
    for message in messages:
        host = message["host"]
        if host in errors:
            failed.append({"host": host, "event": message["event"], "error": errors[host]})
            if host in hosts:
                state_hosts[host] = dict(hosts[host])
            else:
                state_hosts.pop(host, None)
            lines.append(f"webhook FAILED for {host} ({message['event']}): {errors[host]}; sent again next tick")
        elif mode == "check":
            lines.append(f"would notify: {message['text']}")
        elif mode == "off":
            lines.append(f"not sent (patrol_notify_webhook_url is not set): {message['text']}")
        else:
            lines.append(f"notified: {message['text']}")
    if not messages:
        lines.append("notifications: none due (no new problem, nothing cleared)")
    elif mode == "check":
        lines.append(f"notifications: {len(messages)} would be sent (check mode: none sent, state not updated)")
    elif mode == "off":
        lines.append(f"notifications: {len(messages)} due, none sent (no webhook); the state records them")
    else:
        sent = len(messages) - len(failed)
        lines.append(
            f"notifications: {sent} sent"
            + (f", {len(failed)} FAILED ({', '.join(f['host'] for f in failed)})" if failed else "")
        )
    state = {"version": STATE_VERSION, "updated_at": now, "hosts": dict(sorted(state_hosts.items()))}
    return {"messages": messages, "state": state, "failed": failed, "lines": lines}


class FilterModule:
    """Patrol report and notification filters."""

    def filters(self) -> Dict[str, Any]:
        return {
            "patrol_result": patrol_result,
            "patrol_results": patrol_results,
            "patrol_unreachable": patrol_unreachable,
            "patrol_lines": patrol_lines,
            "patrol_summary": patrol_summary,
            "patrol_exit": patrol_exit,
            "patrol_notifications": patrol_notifications,
        }
