# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stop a rented instance's meter from the controller and prove it stopped: run the declared verb, poll its status.

The verb comes from the profile's declaration (``_meter_stop_verbs.parse_verb``); ``plan_for`` adds the timeouts.
An exit status of 0 proves nothing (``vastai destroy instance ID`` without ``-y`` asks, reads EOF and aborts with
status 0): success is what the status command says afterwards. "Gone" is only ever read from a status command that
exited 0 and printed JSON listing the account's instances without this one; a failing command (a traceback saying
"No such file or directory", an "API key not found") is unknown, never gone. When the box answered moments before
(``box_answered``), a first poll that reads it gone or stopped means the id names another instance (a stale id):
refused, nothing runs. Nothing a provider prints is kept in
the result but the parsed states and one scrubbed error line. Every command is an argv list (no shell) with a
timeout; the runner, the clock and the sleep are injectable.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import (
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
    Runner,
    subprocess_runner,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, option_problems
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop_verbs import (
    NO_VERB,
    SURVIVABLE,
    CliCheck,
    Status,
    Verb,
    parse_verb,
    shown,
)

# The declaration lives in _meter_stop_verbs; these names are this module's interface too.
__all__ = [
    "NO_VERB",
    "SURVIVABLE",
    "CliCheck",
    "MeterStopError",
    "Plan",
    "Status",
    "Verb",
    "check_cli",
    "error_line",
    "meter_stop",
    "parse_verb",
    "plan_for",
    "poll_status",
    "scrub",
    "stopped_states",
]

UNKNOWN = "unknown"
GONE = "gone"
STATE_CHARS = 120
ERROR_CHARS = 200
TIMEOUT_BOUNDS = {
    "timeout_s": Between(0, 86400),
    "poll_interval_s": Between(0, 3600, above_low=True),
    "command_timeout_s": Between(0, 3600, above_low=True),
}
_ERROR_WORD = re.compile(r"(?i)error|fail|denied|not found|invalid|unauthori[sz]ed")
_SECRET_NAME = re.compile(r"(?i)token|key|secret|passw|credential|auth")
_SECRET_PAIR = re.compile(r"(?i)([\w-]*(?:token|key|secret|passw|credential)[\w-]*)(\"?\s*[:=]\s*\"?)[^\s\"',;&)\]}]+")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',;)\]}]+")
_LONG_RUN = re.compile(r"[A-Fa-f0-9]{20,}|[A-Za-z0-9+/_=-]{32,}")
_REDACTED = "***"


class MeterStopError(Exception):
    """The meter-stop failed or was refused; ``result`` holds every return key (the module passes them to fail_json)."""

    def __init__(self, msg: str, result: Dict[str, Any]) -> None:
        super().__init__(msg)
        self.result = dict(result, msg=msg)


@dataclass(frozen=True)
class Plan:
    verb: Verb
    timeout_s: float = 300.0
    poll_interval_s: float = 5.0
    command_timeout_s: float = 60.0


def plan_for(verb: Verb, timeout_s: float, poll_interval_s: float, command_timeout_s: float) -> Plan:
    """A Plan for a verb run from the controller; raises ValueError for bad timeouts or a verb with no command."""
    if verb.command is None:
        how = "is done by hand: " + "; ".join(verb.manual_steps) if verb.manual_steps else "stops nothing"
        raise ValueError(f"meter_stop_verb {verb.name} {how}")
    timeouts = {"timeout_s": timeout_s, "poll_interval_s": poll_interval_s, "command_timeout_s": command_timeout_s}
    problems = option_problems(timeouts, TIMEOUT_BOUNDS)
    if problems:
        raise ValueError("; ".join(problems))
    return Plan(verb, float(timeout_s), float(poll_interval_s), float(command_timeout_s))


# --- reading what the provider printed ---------------------------------------------------------------------------


def scrub(text: str, keep: Sequence[str] = ()) -> str:
    """``text`` without what looks like a secret: values of token/key/secret/password fields, bearer credentials,
    long hex or base64 runs, except a run that is one of ``keep`` (the instance id: Lambda's are 32 hex digits)."""
    text = _SECRET_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{_REDACTED}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {_REDACTED}", text)
    return _LONG_RUN.sub(lambda m: m.group(0) if m.group(0) in keep else _REDACTED, text)


def _redacted(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _REDACTED if _SECRET_NAME.search(str(k)) else _redacted(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_redacted(item) for item in node]
    return node


def _json_error(text: str) -> Optional[str]:
    """The ``error`` of a JSON error object ({"error": {"code", "message"}} or {"error": "..."}), redacted; the code
    goes last, in brackets ("global/invalid-api-key: API ..." would read as a key's value to scrub)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        error = _redacted(error)
        code, message = error.get("code"), error.get("message")
        if message:
            return f"{message} ({code})" if code else str(message)
        return str(code) if code else json.dumps(error)
    return str(error) if isinstance(error, str) and error else None


def error_line(stdout: str, stderr: str, keep: Sequence[str] = ()) -> str:
    """One short, scrubbed line saying why a command failed: a JSON error's code and message, else the last line
    that says error or fail (CLIs print usage hints after it), else the last line."""
    for text in (stderr.strip(), stdout.strip()):
        found = _json_error(text) if text else None
        if found:
            return scrub(found, keep)[:ERROR_CHARS]
    lines = [line.strip() for line in f"{stdout}\n{stderr}".splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_WORD.search(line)]
    picked = (errors or lines or ["no output"])[-1]
    return scrub(picked, keep)[:ERROR_CHARS]


def _failure(rc: int, stdout: str, stderr: str, keep: Sequence[str]) -> str:
    if rc == RC_TIMEOUT:
        return f"timed out ({error_line('', stderr)})"
    if rc in (RC_NOT_FOUND, RC_NOT_EXECUTABLE):  # the runner's own verdict, in stderr
        return f"exited {rc}: {error_line('', stderr, keep)}"
    return f"exited {rc}: {error_line(stdout, stderr, keep)}"


_MISSING = object()


def _at(node: Any, path: str) -> Any:
    """The value at dotted ``path`` ("" is ``node`` itself), or _MISSING when a step is missing or not an object."""
    if path == "":
        return node
    for segment in path.split("."):
        if not isinstance(node, dict) or segment not in node:
            return _MISSING
        node = node[segment]
    return node


def read_state(doc: Any, key: str) -> Optional[str]:
    """The non-empty string at dotted ``key`` of parsed JSON ``doc``; None for anything else (a number, null)."""
    value = _at(doc, key)
    if not isinstance(value, str) or not value.strip():
        return None
    return value[:STATE_CHARS]


@dataclass
class Poll:
    label: str  # the state read, "gone" or "unknown"
    final: bool = False
    gone: bool = False
    error: str = ""  # why no state was read; "" when one was
    intended: Optional[str] = None  # the state at the status' intended_key, when it declares one


def _same_id(value: Any, wanted: str) -> bool:
    return not isinstance(value, bool) and isinstance(value, (str, int)) and str(value) == wanted


def _from_list(doc: Any, status: Status) -> Tuple[Any, str]:
    """The listed instance (None when absent: gone) or an error when the list can not be trusted to be complete."""
    items = _at(doc, status.list_path or "")
    where = f"at {status.list_path!r}" if status.list_path else "as the whole output"
    if not isinstance(items, list):
        return None, f"no list of instances {where}"
    found = []
    for item in items:
        if not isinstance(item, dict) or status.id_key not in item:
            return None, f"a listed instance has no {status.id_key!r}"
        if _same_id(item[status.id_key], status.instance_id):
            found.append(item)
    if len(found) > 1:
        return None, f"{len(found)} listed instances have {status.id_key} {status.instance_id}"
    return (found[0] if found else None), ""


def poll_status(plan: Plan, runner: Runner) -> Poll:
    """Run the status command once. Only an exit 0 with JSON is read: a final state, a state, or (listed mode) the
    instance's absence from the list, which is gone. Anything else is unknown, with the scrubbed reason."""
    status = plan.verb.status
    if status is None:  # plan_for refuses a verb without a command, and parse_verb one without a status
        raise ValueError(f"meter_stop_verbs.{plan.verb.name} has no status command")
    keep = (status.instance_id,)
    rc, stdout, stderr = runner(list(status.command), plan.command_timeout_s)
    if rc != 0:
        return Poll(UNKNOWN, error=_failure(rc, stdout, stderr, keep))
    try:
        doc = json.loads(stdout)
    except (ValueError, RecursionError):
        first = next((line.strip() for line in stdout.splitlines() if line.strip()), "nothing")
        return Poll(UNKNOWN, error=f"exited 0 but printed no JSON: {scrub(first, keep)[:ERROR_CHARS]}")
    if status.list_path is not None:
        doc, problem = _from_list(doc, status)
        if problem:
            return Poll(UNKNOWN, error=problem)
        if doc is None:
            return Poll(GONE, gone=True)
    state = read_state(doc, status.state_key)
    if state is None:
        return Poll(UNKNOWN, error=f"no state (a non-empty string) at {status.state_key!r}")
    intended = read_state(doc, status.intended_key) if status.intended_key else None
    return Poll(state, final=state in plan.verb.final_states, intended=intended)


def check_cli(plan: Plan, runner: Runner) -> Optional[str]:
    """Why the installed CLI can not run the verb safely (its declared check failed), or None."""
    check = plan.verb.cli_check
    if check is None:
        return None
    rc, stdout, stderr = runner(list(check.command), plan.command_timeout_s)
    if rc == 0 and re.search(check.pattern, f"{stdout}\n{stderr}"):
        return None
    seen = _failure(rc, stdout, stderr, ()) if rc != 0 else f"shows no {check.pattern!r}"
    return f"refused before running {shown(plan.verb.command or ())}: {shown(check.command)} {seen}; needs {check.need}"


# --- the flow ----------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What the result reports; filled in as the flow goes. No raw provider output is ever kept."""

    verb: str
    command: List[str]
    final_state: Optional[str] = None
    gone: bool = False
    already: bool = False
    polls: int = 0
    states: List[str] = field(default_factory=list)
    command_rc: Optional[int] = None
    command_error: str = ""
    status_error: str = ""
    stale_id: bool = False

    def record(self, poll: Poll) -> None:
        self.polls += 1
        self.status_error = poll.error
        if not self.states or self.states[-1] != poll.label:
            self.states.append(poll.label)
        self.final_state = poll.label if poll.final else None
        self.gone = poll.gone

    def result(self, msg: str) -> Dict[str, Any]:
        return {
            "verb": self.verb,
            "command": self.command,
            "final_state": self.final_state,
            "gone": self.gone,
            "already": self.already,
            "polls": self.polls,
            "states": self.states,
            "command_rc": self.command_rc,
            "command_error": self.command_error,
            "status_error": self.status_error,
            "stale_id": self.stale_id,
            "msg": msg,
        }


def _polls(count: int) -> str:
    return f"{count} poll" if count == 1 else f"{count} polls"


def _done_word(progress: Progress) -> str:
    return GONE if progress.gone else str(progress.final_state)


def stopped_states(verbs: Mapping[str, Any], verb: Verb) -> Tuple[str, ...]:
    """Every state that means stopped for ``verb``'s status: its final states and those of each other declared verb
    read the same way (RunPod's EXITED, final for stop, is a stopped pod to its delete verb too). A declaration that
    does not parse adds nothing: the verb in use was parsed already."""
    found = list(verb.final_states)
    for name in verbs:
        try:
            other = parse_verb(verbs, str(name))
        except ValueError:
            continue
        if other.status is not None and other.status == verb.status:
            found += [state for state in other.final_states if state not in found]
    return tuple(found)


def _stale_id(plan: Plan, poll: Poll) -> str:
    status = plan.verb.status
    ident = status.instance_id if status is not None else ""
    if poll.gone:
        return (
            f"the provider lists no instance {ident}, yet the box answered: instance_id is wrong (a typo or a stale "
            "id) and the box may still be billing; nothing was stopped"
        )
    named = f"instance {ident}" if ident else "the instance"
    return (
        f"the provider says {named} is already {poll.label}, yet the box answered moments ago: instance_id names "
        f"another instance (a stale or wrong id) and the box may still be billing; nothing was stopped"
    )


def meter_stop(
    plan: Plan,
    check_mode: bool,
    runner: Runner = subprocess_runner,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    *,
    box_answered: bool = False,
    stopped_states: Sequence[str] = (),
) -> Tuple[bool, Dict[str, Any]]:
    """Stop the meter per ``plan``: (changed, result). Raises MeterStopError (with the result) when it did not stop.

    ``box_answered``: the box answered moments ago, so it runs; a first poll that finds it gone, in a final state or
    in one of ``stopped_states`` is a stale id, refused before anything runs."""
    verb, status = plan.verb, plan.verb.status
    if verb.command is None or status is None:  # plan_for made sure
        raise ValueError(f"meter_stop_verbs.{verb.name} has no command and status to run")
    progress = Progress(verb=verb.name, command=list(verb.command))
    if check_mode:
        first = f" after checking {shown(verb.cli_check.command)}" if verb.cli_check else ""
        msg = f"check mode: would run {shown(verb.command)}{first} and poll {shown(status.command)}"
        return True, dict(progress.result(msg), would_run=list(verb.command))
    first_poll = poll_status(plan, runner)
    progress.record(first_poll)
    stopped = first_poll.final or first_poll.gone or first_poll.label in stopped_states
    if box_answered and stopped and first_poll.label != UNKNOWN:
        progress.stale_id = True
        msg = _stale_id(plan, first_poll)
        raise MeterStopError(msg, progress.result(msg))
    if first_poll.final or first_poll.gone:
        progress.already = True
        return False, progress.result(f"the instance is already {_done_word(progress)}: {shown(verb.command)} not run")
    refused = check_cli(plan, runner)
    if refused:
        raise MeterStopError(refused, progress.result(refused))

    rc, stdout, stderr = runner(list(verb.command), plan.command_timeout_s)
    progress.command_rc = rc
    if rc != 0:
        progress.command_error = _failure(rc, stdout, stderr, (status.instance_id,))
        msg = f"the meter-stop command {shown(verb.command)} {progress.command_error}"
        raise MeterStopError(msg, progress.result(msg))

    started = clock()
    deadline = started + plan.timeout_s
    while True:
        poll = poll_status(plan, runner)
        progress.record(poll)
        if poll.final or poll.gone:
            waited = clock() - started
            word = _done_word(progress)
            msg = f"ran {shown(verb.command)}; the instance is {word} after {_polls(progress.polls)} in {waited:.1f} s"
            return True, progress.result(msg)
        remaining = deadline - clock()
        if remaining <= 0 or math.isnan(remaining):
            break
        sleep(min(plan.poll_interval_s, remaining))
    why = f" ({poll.error})" if poll.error else ""
    msg = (
        f"the meter-stop command exited 0 but the instance ({shown(status.command)}) is still {poll.label}{why} "
        f"after {clock() - started:.0f} s; it may still be billing: check the provider's console"
    )
    raise MeterStopError(msg, progress.result(msg))
