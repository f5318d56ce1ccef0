# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The notifications of a patrol tick: which to send, sending them, and the state kept between ticks.

One message per host with a problem id it did not have on the previous tick (``escalated``; ``warning`` for a box
the provider stopped without us, INTERRUPTED) and one per host whose problems all cleared (``cleared``); a box we
stopped (STOPPED) gets none. The state file is locked from its read to its write, so two ticks at once send
one message per problem; every message of a tick shares one deadline, so a hung webhook costs a tick seconds. The
webhook URL is a secret: it is never part of an error, a line or the state.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_states as states
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_record import (
    CONSOLE_ADVICE,
    UNREACHABLE,
)
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._report import flock_within
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line as _line
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._webhook import redact

STATE_VERSION = 1
MODES = ("send", "check", "off")
# Problem kinds whose id is `<kind>:<run>` or `<kind>:<run>/<cell>`: a tick filtered by run keeps those of the runs
# it did not examine. Box-level kinds (disk_pressure:data, probe_failed:<probe>, Xids, unreachable) are not here.
RUN_KINDS = frozenset(
    ("stalled", "cell_failed", "crashed", "incomplete", "sync_failed", "disk_full", "nan_loss", "log_lost",
     "runner_gone", "unreadable")
)  # fmt: skip
TEXT_CHARS = 1000


class Busy(Exception):
    """Another tick held the state file's lock for longer than this tick would wait."""


@dataclass
class Plan:
    """A tick's notifications before sending: ``messages`` (JSON bodies, at most one per host, in record order),
    ``hosts`` (the state's hosts once every message is delivered), ``previous`` (the previous state's hosts, which
    a host whose message fails keeps) and ``notes`` (lines about the previous state)."""

    mode: str
    now: str
    messages: List[Dict[str, Any]] = field(default_factory=list)
    hosts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    previous: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


@dataclass
class Settled:
    """A tick's outcome: ``state`` to write (unless check mode), ``failed`` ({host, event, error} per message not
    delivered, error redacted) and ``lines`` to print (the plan's notes first)."""

    state: Dict[str, Any]
    failed: List[Dict[str, str]]
    lines: List[str]


# ---- small helpers -------------------------------------------------------------------------------------------


def _strings(value: Any) -> Optional[List[str]]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return None
    return [_line(item) for item in value]


def _slack(text: str) -> str:
    """Slack's three control characters escaped, one bounded line."""
    escaped = _line(text, TEXT_CHARS).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return escaped if len(escaped) <= TEXT_CHARS else escaped[: TEXT_CHARS - 3] + "..."


def _state_of(record: Mapping[str, Any]) -> str:
    if record.get("box_state") in (states.STOPPED, states.INTERRUPTED, states.GONE):
        return str(record["box_state"]).lower()
    if record.get("reachable") is False or record.get("state") == UNREACHABLE:
        return UNREACHABLE
    state = record.get("state")
    return state if isinstance(state, str) and state else "unknown"


def _run_of(problem: str) -> Optional[str]:
    kind, _sep, subject = problem.partition(":")
    return subject.split("/", 1)[0] if kind in RUN_KINDS and subject else None


def _active(record: Mapping[str, Any], before: Sequence[str]) -> List[str]:
    """The problem ids a host has after this tick: its own when escalated, plus the previous ones this tick did not
    examine (a host that did not answer examined nothing; a tick filtered by run examined only ``examined_runs``).
    A box down keeps the previous problems but another box-down one (unreachable, gone, interrupted); a STOPPED box
    only its runs' (an idle_billing of the box that stopped is over: were it restarted, it is told again)."""
    if record.get("box_state") == states.STOPPED:
        return sorted(problem for problem in before if _run_of(problem) is not None)
    if record.get("reachable") is False or record.get("state") == UNREACHABLE:
        down = [states.PROBLEMS[key] for key in states.PROBLEMS]
        now_down = states.PROBLEMS.get(str(record.get("box_state")), UNREACHABLE)
        return sorted({*(problem for problem in before if problem not in down), now_down})
    own: List[str] = []
    if record.get("escalate") is True:
        own = _strings(record.get("problems")) or [f"escalated:{_state_of(record)}"]
    if record.get("run_filter"):
        examined = set(_strings(record.get("examined_runs")) or [])
        own += [problem for problem in before if _run_of(problem) not in (None, *examined)]
    return sorted(set(own))


def _previous(state: Any) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """The previous tick's hosts (``{host: {problems, state, since, updated_at}}``) and notes. Accepts the state as
    a dict or the state file's text; empty is a first tick; anything unreadable is a note and a fresh start."""
    if state is None or state in ("", b""):
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


def _first_reason(record: Mapping[str, Any]) -> str:
    reasons = _strings(record.get("reasons")) or []
    return reasons[0] if reasons else str(record.get("msg") or "no reason given")


def _message(host: str, event: str, problems: List[str], record: Mapping[str, Any], was: List[str]) -> Dict[str, Any]:
    state = _state_of(record)
    if event == "cleared":
        text = f":white_check_mark: *{host}* cleared, now {state}: was {', '.join(was)}"
    elif state == UNREACHABLE and record.get("box_state") == states.UNREACHABLE:
        text = f":warning: *{host}* unreachable: {_first_reason(record)}"  # the provider's answer with it
    elif state == UNREACHABLE:
        text = f":warning: *{host}* unreachable: {record.get('error') or 'unreachable'}; {CONSOLE_ADVICE}"
    elif state in (states.GONE.lower(), states.INTERRUPTED.lower()):
        text = f":warning: *{host}* {state}: {_first_reason(record)}"
    else:
        actions = _strings(record.get("actions")) or []
        text = f":rotating_light: *{host}* escalated, {state}: {_first_reason(record)}"
        reasons = _strings(record.get("reasons")) or []
        if len(reasons) > 1:
            text += f" (+{len(reasons) - 1} more)"
        text += f" | new: {', '.join(problems)}" + (f" | actions: {', '.join(actions)}" if actions else "")
    return {"text": _slack(text), "host": host, "event": event, "problems": problems, "report": dict(record)}


# ---- plan and settle -----------------------------------------------------------------------------------------


def plan(previous_state: Any, records: Sequence[Mapping[str, Any]], now: str, mode: str) -> Plan:
    """This tick's messages and the state once they are delivered, from the previous state (dict, text or None).

    Hosts without a record (another ``--limit``) keep their entry; a record without a string ``host`` is skipped,
    and so is a second record of the same host. Raises ValueError for a bad ``mode`` or ``records``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if isinstance(records, (str, bytes, Mapping)):
        raise ValueError("records must be a list of patrol records")
    previous, notes = _previous(previous_state)
    result = Plan(mode=mode, now=now, previous=previous, notes=notes)
    result.hosts = {host: dict(entry) for host, entry in previous.items()}
    seen = set()
    for record in records:
        if not isinstance(record, Mapping) or not isinstance(record.get("host"), str) or record["host"] in seen:
            continue
        host = record["host"]
        seen.add(host)
        before = previous.get(host, {}).get("problems", [])
        active = _active(record, before)
        new = [problem for problem in active if problem not in before]
        if record.get("box_state") == states.STOPPED:
            pass  # stopped on purpose: no warning, and nothing to clear (its problems are moot while it is down)
        elif new:
            # An interrupted box is a warning (its results may be stranded), not an alarm: told once, as one.
            event = "warning" if record.get("box_state") == states.INTERRUPTED else "escalated"
            result.messages.append(_message(host, event, new, record, before))
        elif before and not active:
            result.messages.append(_message(host, "cleared", before, record, before))
        if active:
            since = previous[host].get("since") if before else now
            result.hosts[host] = {"problems": active, "state": _state_of(record), "since": since, "updated_at": now}
        else:
            result.hosts.pop(host, None)
    return result


Delivered = Mapping[Union[str, int], Optional[str]]


def _errors(plan_: Plan, delivered: Optional[Delivered]) -> Dict[str, str]:
    """Host -> why its message was not delivered (send mode only; a message without an answer was not sent).
    ``delivered`` is keyed by host, or by message index as send_all answers."""
    if plan_.mode != "send":
        return {}
    by_host: Dict[str, Optional[str]] = {}
    for key, error in (delivered or {}).items():
        host = plan_.messages[key]["host"] if isinstance(key, int) and 0 <= key < len(plan_.messages) else key
        if isinstance(host, str):
            by_host[host] = error
    errors = {}
    for message in plan_.messages:
        error = by_host.get(message["host"], "not sent")
        if error is not None:
            errors[message["host"]] = redact(error)
    return errors


def _lines(plan_: Plan, errors: Mapping[str, str]) -> List[str]:
    out = list(plan_.notes)
    for message in plan_.messages:
        host = message["host"]
        if host in errors:
            out.append(f"webhook FAILED for {host} ({message['event']}): {errors[host]}; sent again next tick")
        elif plan_.mode == "check":
            out.append(f"would notify: {message['text']}")
        elif plan_.mode == "off":
            out.append(f"not sent (patrol_notify_webhook_url is not set): {message['text']}")
        else:
            out.append(f"notified: {message['text']}")
    count = len(plan_.messages)
    if not count:
        out.append("notifications: none due (no new problem, nothing cleared)")
    elif plan_.mode == "check":
        out.append(f"notifications: {count} would be sent (check mode: none sent, state not updated)")
    elif plan_.mode == "off":
        out.append(f"notifications: {count} due, none sent (no webhook); the state records them")
    else:
        failed = [m["host"] for m in plan_.messages if m["host"] in errors]
        out.append(
            f"notifications: {count - len(failed)} sent"
            + (f", {len(failed)} FAILED ({', '.join(failed)})" if failed else "")
        )
    return out


def settle(plan_: Plan, delivered: Optional[Delivered] = None) -> Settled:
    """The state to keep, the failures and the lines to print. A host whose message failed (an error, or no answer
    at all in send mode) keeps its previous entry, so the next tick sends that message again."""
    errors = _errors(plan_, delivered)
    hosts = dict(plan_.hosts)
    for host in errors:
        if host in plan_.previous:
            hosts[host] = dict(plan_.previous[host])
        else:
            hosts.pop(host, None)
    state = {"version": STATE_VERSION, "updated_at": plan_.now, "hosts": dict(sorted(hosts.items()))}
    failed = [
        {"host": m["host"], "event": m["event"], "error": errors[m["host"]]}
        for m in plan_.messages
        if m["host"] in errors
    ]
    return Settled(state=state, failed=failed, lines=_lines(plan_, errors))


# ---- the state file ------------------------------------------------------------------------------------------


@dataclass
class StateFile:
    """The state file as a locked tick sees it: ``state`` (its text, "" when there is none yet) and ``notes`` (an
    unreadable file starts afresh with a note); ``write`` replaces it."""

    path: str
    state: str
    notes: List[str]

    def write(self, state: Mapping[str, Any]) -> None:
        """Replace the file at once (a reader never sees half of it), mode 0600. Raises OSError."""
        temporary = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(json.dumps(state, indent=2) + "\n")
            os.replace(temporary, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)


def _read(path: str) -> StateFile:
    try:
        with open(path, encoding="utf-8") as stream:
            return StateFile(path, stream.read(), [])
    except FileNotFoundError:
        return StateFile(path, "", [])
    except (OSError, UnicodeDecodeError) as error:
        return StateFile(path, "", [f"notification state unreadable, starting afresh: {_line(error, 200)}"])


@contextlib.contextmanager
def locked_state(path: str, wait_s: float) -> Iterator[StateFile]:
    """Hold an flock on ``<path>.lock`` (0600) for the block, then read the state: plan, send and write inside
    the block. Waits up to ``wait_s`` seconds for another tick (which then re-reads what that one wrote), then
    raises Busy. The kernel drops the lock when its holder dies. Raises OSError when the lock cannot be made."""
    path = os.path.abspath(os.path.expanduser(path))
    lock = f"{path}.lock"
    handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not flock_within(handle, wait_s):
            raise Busy(f"another patrol tick held {lock} for {wait_s:g}s")
        yield _read(path)
    finally:
        os.close(handle)
