# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stop a rented instance's meter from the controller and prove it stopped: run the provider's verb, poll its status.

A provider CLI that exits 0 has not necessarily stopped anything (``vastai destroy instance ID`` without ``-y``
asks, reads EOF and aborts with status 0), so success is what the status command says afterwards, never the
verb's exit status alone. Every command is an argv list (no shell) with a timeout; the runner, the clock and the
sleep are injectable so tests run the real fake provider CLI with tiny deadlines.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Pattern, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils._command import (
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
    Runner,
    subprocess_runner,
)

TAIL_CHARS = 2000
STATE_CHARS = 120
GONE_SEARCH_CHARS = 64 * 1024  # of each stream: a user's regular expression never scans megabytes
UNKNOWN = "unknown"
GONE = "gone"
# The runner's own verdicts: their text ("runpodctl: command not found") must never read as "the instance is gone".
RUNNER_RCS = (RC_TIMEOUT, RC_NOT_EXECUTABLE, RC_NOT_FOUND)
_KEY_SEGMENT = re.compile(r"[^.\s]+")
_ERROR_WORD = re.compile(r"(?i)error|fail|denied|not found")


class MeterStopError(Exception):
    """The meter-stop failed or was refused; ``result`` holds every return key (the module passes them to fail_json)."""

    def __init__(self, msg: str, result: Dict[str, Any]) -> None:
        super().__init__(msg)
        self.result = dict(result, msg=msg)


@dataclass(frozen=True)
class Plan:
    command: Sequence[str]
    status_command: Sequence[str]
    status_key: str
    final_states: Sequence[str]
    gone_pattern: Optional[Pattern[str]] = None
    timeout_s: float = 300.0
    poll_interval_s: float = 5.0
    command_timeout_s: float = 60.0


@dataclass
class Poll:
    label: str  # the state read, "gone" or "unknown"
    final: bool
    gone: bool
    tail: str


@dataclass
class Progress:
    """What the result reports; filled in as the flow goes."""

    command: List[str]
    final_state: Optional[str] = None
    gone: bool = False
    already: bool = False
    polls: int = 0
    states: List[str] = field(default_factory=list)
    command_rc: Optional[int] = None
    command_output_tail: str = ""
    status_output_tail: str = ""

    def record(self, poll: Poll) -> None:
        self.polls += 1
        self.status_output_tail = poll.tail
        if not self.states or self.states[-1] != poll.label:
            self.states.append(poll.label)
        if poll.final:
            self.final_state = poll.label
        self.gone = poll.gone

    def result(self, msg: str) -> Dict[str, Any]:
        return {
            "command": self.command,
            "final_state": self.final_state,
            "gone": self.gone,
            "already": self.already,
            "polls": self.polls,
            "states": self.states,
            "command_rc": self.command_rc,
            "command_output_tail": self.command_output_tail,
            "status_output_tail": self.status_output_tail,
            "msg": msg,
        }


def tail(stdout: str, stderr: str) -> str:
    """The last TAIL_CHARS characters of a command's stdout and stderr together."""
    both = stdout if not stderr else (f"{stdout.rstrip()}\n{stderr}" if stdout.strip() else stderr)
    return both[-TAIL_CHARS:]


def _error_line(text: str) -> str:
    """The last line that says error or fail (CLIs print usage hints after the error), else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_WORD.search(line)]
    picked = errors or lines
    return picked[-1][:300] if picked else "no output"


def shown(argv: Sequence[str]) -> str:
    return shlex.join(list(argv))


def read_state(stdout: str, key: str) -> Optional[str]:
    """The string at dotted ``key`` of the JSON in ``stdout``; None when it is not JSON, a step is missing or not an
    object (a list, null), or the value is not a non-empty string (a number, NaN, null)."""
    try:
        node: Any = json.loads(stdout)
    except (ValueError, RecursionError):
        return None
    for segment in key.split("."):
        if not isinstance(node, dict) or segment not in node:
            return None
        node = node[segment]
    if not isinstance(node, str) or not node.strip():
        return None
    return node[:STATE_CHARS]


def poll_status(plan: Plan, runner: Runner) -> Poll:
    """Run the status command once. A final state wins; a state read that is not final is never "gone"; only output
    without a state (and not the runner's own timeout or missing-program verdict) is matched against the pattern."""
    rc, stdout, stderr = runner(list(plan.status_command), plan.command_timeout_s)
    text = tail(stdout, stderr)
    state = read_state(stdout, plan.status_key) if rc == 0 else None
    if state is not None:
        return Poll(state, state in plan.final_states, False, text)
    if _gone(plan, rc, stdout, stderr):
        return Poll(GONE, False, True, text)
    return Poll(UNKNOWN, False, False, text)


def _gone(plan: Plan, rc: int, stdout: str, stderr: str) -> bool:
    if plan.gone_pattern is None or rc in RUNNER_RCS:
        return False
    return plan.gone_pattern.search(f"{stdout[-GONE_SEARCH_CHARS:]}\n{stderr[-GONE_SEARCH_CHARS:]}") is not None


def plan_problems(params: Mapping[str, Any]) -> List[str]:
    """What is wrong with the options beyond the argument spec and the numeric bounds, one line each."""
    problems: List[str] = []
    for name in ("command", "status_command"):
        argv = params[name]
        if not argv:
            problems.append(f"{name} is an empty argv list: nothing to run")
        for index, arg in enumerate(argv):
            if not str(arg).strip():
                problems.append(
                    f"{name}[{index}] is empty ({shown(argv)}): is instance_id set for this host?"
                    if index
                    else f"{name}[0] (the program) is empty"
                )
    key = params["status_key"]
    if not all(_KEY_SEGMENT.fullmatch(segment) for segment in key.split(".")):
        problems.append(f"status_key must be a dotted JSON path such as desiredStatus or data.status, got {key!r}")
    if not params["final_states"] and not params.get("gone_pattern"):
        problems.append("final_states is empty and gone_pattern is empty: no status would ever count as stopped")
    if any(not str(state).strip() for state in params["final_states"]):
        problems.append(f"final_states must hold non-empty states, got {list(params['final_states'])!r}")
    return problems


def compile_gone(text: str) -> Optional[Pattern[str]]:
    """The gone pattern, or None for an empty one; raises ValueError naming the option for a bad expression."""
    if not text:
        return None
    try:
        return re.compile(text)
    except re.error as exc:
        raise ValueError(f"gone_pattern: invalid regular expression {text!r}: {exc}") from exc


def plan_from(params: Mapping[str, Any]) -> Plan:
    """Validated options as a Plan; raises ValueError with one line naming every problem."""
    problems = plan_problems(params)
    if problems:
        raise ValueError("; ".join(problems))
    return Plan(
        command=[str(arg) for arg in params["command"]],
        status_command=[str(arg) for arg in params["status_command"]],
        status_key=params["status_key"],
        final_states=[str(state) for state in params["final_states"]],
        gone_pattern=compile_gone(params.get("gone_pattern") or ""),
        timeout_s=float(params["timeout_s"]),
        poll_interval_s=float(params["poll_interval_s"]),
        command_timeout_s=float(params["command_timeout_s"]),
    )


def _polls(count: int) -> str:
    return f"{count} poll" if count == 1 else f"{count} polls"


def _done_word(progress: Progress) -> str:
    return "gone" if progress.gone else str(progress.final_state)


def meter_stop(
    plan: Plan,
    check_mode: bool,
    runner: Runner = subprocess_runner,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Tuple[bool, Dict[str, Any]]:
    """Stop the meter per ``plan``: (changed, result). Raises MeterStopError (with the result) when it did not stop."""
    progress = Progress(command=list(plan.command))
    if check_mode:
        result = progress.result(f"check mode: would run {shown(plan.command)} and poll {shown(plan.status_command)}")
        return True, dict(result, would_run=list(plan.command))
    first = poll_status(plan, runner)
    progress.record(first)
    if first.final or first.gone:
        progress.already = True
        word = _done_word(progress)
        return False, progress.result(f"the instance is already {word}: {shown(plan.command)} was not run")

    rc, stdout, stderr = runner(list(plan.command), plan.command_timeout_s)
    progress.command_rc = rc
    progress.command_output_tail = tail(stdout, stderr)
    # A non-zero exit that says "gone" is done only if the status command agrees: polled like an exit 0.
    if rc != 0 and not _gone(plan, rc, stdout, stderr):
        detail = "timed out" if rc == RC_TIMEOUT else f"exited {rc}"
        msg = f"the meter-stop command {shown(plan.command)} {detail}: {_error_line(progress.command_output_tail)}"
        raise MeterStopError(msg, progress.result(msg))

    started = clock()
    deadline = started + plan.timeout_s
    while True:
        poll = poll_status(plan, runner)
        progress.record(poll)
        if poll.final or poll.gone:
            waited = clock() - started
            msg = (
                f"ran {shown(plan.command)}; the instance is {_done_word(progress)} after {_polls(progress.polls)} "
                f"in {waited:.1f} s"
            )
            return True, progress.result(msg)
        remaining = deadline - clock()
        if remaining <= 0 or math.isnan(remaining):
            break
        sleep(min(plan.poll_interval_s, remaining))
    waited = clock() - started
    exited = "exited 0" if rc == 0 else f"exited {rc} saying the instance is gone"
    msg = (
        f"the meter-stop command {exited} but the instance ({shown(plan.status_command)}) is still {poll.label} "
        f"after {waited:.0f} s; it may still be billing: check the provider's console"
    )
    raise MeterStopError(msg, progress.result(msg))
