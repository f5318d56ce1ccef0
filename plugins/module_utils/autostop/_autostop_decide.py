# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The autostop watcher's decision, pure: what it saw (runs, the patrol tick), what it remembers (its clocks, the
gate's last verdict, the stops it issued), the armed timers and the monotonic time -> the state and what to do next.

- The runs are every run of the box, in every data dir it knows (a run of another data dir names it). The idle
  clock restarts whenever the set of runs, any run's state or started_at, or the set of GPU users outside any run
  changes; it counts only while every run is over (DONE, torn down, or ended without DONE) and no process outside a
  run uses a GPU. A run that ended without DONE (a failed cell) never lets the idle timer stop the box: only the
  dead-man may, through the gate's ``kept`` below. The silence clock (the dead-man) restarts at the watcher's
  start and whenever the patrol tick file changes. Both read ``time.monotonic``: a wall clock jump changes nothing.
- The gate (teardown's, with the instance) runs once when every run first is DONE, again right before a stop, and,
  when it fails, again after check_interval_s * 2^n (at most gate_retry_max_s); a failed gate is never bypassed,
  but one: the dead-man fires on a gate that failed only at cells when the stop keeps the disk (``kept``: the box
  side found every other copy verified with those cells accepted), since such a stop loses nothing.
- While a stage holds the box (its lease: a teardown pulling and verifying), nothing is gated or stopped.
- A stop is issued at most once per generation: after stopping / stopped / unconfirmed only the status is polled;
  a stop command that failed is tried again, MAX_STOP_ATTEMPTS in all.

Pure standard library, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

RUN_STATES = ("live", "done", "ended", "not_done", "gone")
SECURED = ("done", "gone")
OVER = (*SECURED, "ended")  # nothing of the run runs any more
MAX_STOP_ATTEMPTS = 3
MIN_SLEEP_S = 0.05
ACTIONS = ("wait", "gate", "stop", "poll", "exit")


@dataclass(frozen=True)
class RunSeen:
    """One run as the watcher saw it: ``live`` (its runner runs), ``done`` (DONE), ``ended`` (its runner ended
    without DONE: a cell failed or was stopped), ``not_done``, ``gone`` (torn down: only its tombstone is left)."""

    name: str
    state: str
    reason: str = ""
    started_at: Optional[str] = None
    data_dir: str = ""  # "": the armed data dir; else the other data dir the run lives in

    @property
    def label(self) -> str:
        return f"run {self.name}" + (f" in {self.data_dir}" if self.data_dir else "")

    def as_dict(self) -> Dict[str, Any]:
        seen = {"run": self.name, "state": self.state, "reason": self.reason}
        return dict(seen, data_dir=self.data_dir) if self.data_dir else seen


@dataclass(frozen=True)
class Observation:
    runs: Tuple[RunSeen, ...] = ()
    tick: Optional[str] = None  # the patrol tick file's content (None: no tick yet)
    problem: Optional[str] = None  # why the runs could not be read: nothing is known, nothing stops
    outside: Tuple[str, ...] = ()  # each process outside any run that uses a GPU, named ("pid 42 python3 (GPU 0)")
    lease: Optional[Tuple[str, str, str]] = None  # (holder, since, until) of the stage holding the box


@dataclass(frozen=True)
class Timers:
    """The armed timings, seconds (fractions allowed); a trigger that is None never fires."""

    idle_s: Optional[float]
    silence_s: Optional[float]
    check_interval_s: float
    gate_retry_max_s: float


@dataclass
class Memory:
    """What one watcher remembers for one generation; every time is ``time.monotonic``."""

    generation: Optional[str]
    started: float
    runs_key: Optional[Tuple[Tuple[str, ...], ...]] = None
    idle_since: Optional[float] = None
    tick: Optional[str] = None
    tick_seen: bool = False
    silence_since: float = 0.0
    gate: Optional[Dict[str, Any]] = None  # {passed, step, reason, kept, checked_at}: the last verdict on runs_key
    gate_failures: int = 0
    next_gate_at: Optional[float] = None
    stop_outcome: Optional[str] = None  # stopping / stopped / unconfirmed / failed, for this generation
    stop_reason: str = ""
    stop_attempts: int = 0
    next_stop_at: Optional[float] = None  # the next try of a failed stop, or the next status poll
    polls: int = 0


def expect_run(obs: Observation, run: Optional[str]) -> Observation:
    """``obs`` with ``run`` (the run whose launch armed autostop) counted as not DONE until it shows up: arming
    comes before the run starts, and a box whose older runs are all DONE must not stop in between."""
    if run is None or obs.problem is not None or any(seen.name == run and not seen.data_dir for seen in obs.runs):
        return obs
    waiting = RunSeen(run, "not_done", "it armed autostop and has not started yet")
    return replace(obs, runs=(*obs.runs, waiting))


def new_memory(generation: Optional[str], now: float) -> Memory:
    return Memory(generation=generation, started=now, silence_since=now)


@dataclass
class Decision:
    state: str
    reason: str
    action: str = "wait"
    sleep_s: float = 60.0
    due_in_s: Optional[float] = None
    idle_s: Optional[float] = None
    idle_needed_s: Optional[float] = None
    silence_s: Optional[float] = None
    silence_needed_s: Optional[float] = None
    trigger: Optional[str] = None
    runs: List[Dict[str, Any]] = field(default_factory=list)


def backoff(timers: Timers, failures: int) -> float:
    """check_interval_s * 2^(failures - 1), at most gate_retry_max_s."""
    exponent = min(max(failures - 1, 0), 40)
    return min(timers.check_interval_s * 2**exponent, max(timers.gate_retry_max_s, timers.check_interval_s))


def span(seconds: float) -> str:
    """A duration for a line: "40 s", "12 min", "2.5 h"."""
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _clocks(obs: Observation, memory: Memory, now: float) -> None:
    runs = sorted(obs.runs, key=lambda run: (run.data_dir, run.name))
    key = tuple((run.data_dir, run.name, run.state, run.started_at or "") for run in runs)
    key += tuple(("", "gpu user outside runs", name, "") for name in sorted(obs.outside))
    if obs.problem is not None:  # nothing is known of the runs: the idle clock starts again once they are read
        memory.runs_key, memory.idle_since = None, None
    elif key != memory.runs_key:
        # A new run, a run started again, a run's state changed, a GPU job by hand came or went: what the gate
        # verified is no longer the box.
        over = bool(runs) and all(run.state in OVER for run in obs.runs) and not obs.outside
        memory.runs_key, memory.idle_since = key, now if over else None
        memory.gate, memory.gate_failures, memory.next_gate_at = None, 0, None
    if not memory.tick_seen or obs.tick != memory.tick:
        memory.tick, memory.tick_seen, memory.silence_since = obs.tick, True, now


def gate_checked(memory: Memory, verdict: Dict[str, Any], timers: Timers, now: float) -> None:
    """Record the gate's verdict (``passed``, ``step``, ``reason``, ``checked_at``); a failure schedules a retry."""
    memory.gate = {key: verdict.get(key) for key in ("passed", "step", "reason", "kept", "checked_at")}
    if verdict.get("passed"):
        memory.gate_failures, memory.next_gate_at = 0, None
    else:
        memory.gate_failures += 1
        memory.next_gate_at = now + backoff(timers, memory.gate_failures)


def gate_allows(gate: Optional[Dict[str, Any]], trigger: Optional[str]) -> bool:
    """The gate's verdict lets a stop on ``trigger`` go: it passed, or the dead-man fired and only failed cells the
    stop keeps on its disk held it (``kept``)."""
    if not gate:
        return False
    return bool(gate.get("passed")) or (trigger == "controller_silence" and bool(gate.get("kept")))


def _hhmm(moment: str) -> str:
    """``14:02`` of an ISO 8601 UTC time (``2030-01-01T14:02:07Z``); the text itself when it is not one."""
    return moment[11:16] if len(moment) >= 16 and moment[10:11] == "T" else moment


def held_by(lease: Tuple[str, str, str]) -> str:
    holder, since, until = lease
    return f"{holder} holds the box since {_hhmm(since)} (until {_hhmm(until)} UTC): no stop while it does"


def stop_issued(memory: Memory, reason: str) -> None:
    """A stop command is about to run: one attempt more, and ``stopping`` until it ends."""
    memory.stop_attempts += 1
    memory.stop_outcome, memory.stop_reason, memory.next_stop_at = "stopping", reason, None


def stop_ended(memory: Memory, outcome: str, reason: str, timers: Timers, now: float) -> None:
    """Record how a stop (or a status poll after one) ended: ``stopped``, ``unconfirmed`` (the status is polled
    again after a backoff) or ``failed`` (the stop is tried again after a backoff, MAX_STOP_ATTEMPTS in all)."""
    memory.stop_outcome, memory.stop_reason = outcome, reason
    if outcome == "failed":
        memory.next_stop_at = now + backoff(timers, memory.stop_attempts)
    elif outcome == "unconfirmed":
        memory.polls += 1
        memory.next_stop_at = now + backoff(timers, memory.polls)


def _sleep(timers: Timers, now: float, *moments: Optional[float]) -> float:
    waits = [timers.check_interval_s] + [moment - now for moment in moments if moment is not None]
    return max(MIN_SLEEP_S, min(waits))


def _unsecured(runs: Tuple[RunSeen, ...]) -> str:
    shown = [
        f"{run.label} is {'live' if run.state == 'live' else 'not DONE'}" + (f" ({run.reason})" if run.reason else "")
        for run in runs
        if run.state not in SECURED
    ]
    return "; ".join(shown[:3]) + (f"; and {len(shown) - 3} more" if len(shown) > 3 else "")


def _gate_failed(memory: Memory, timers: Timers, now: float, facts: Dict[str, Any]) -> Decision:
    """The gate failed: retried after a backoff; when only failed cells the stop keeps failed it, the dead-man
    still stops the box once the controller is silent long enough."""
    gate = memory.gate or {}
    retry_in = max(0.0, (memory.next_gate_at or now) - now)
    reason = f"gate failed at {gate.get('step')}: {gate.get('reason')}; retry in {span(retry_in)}"
    moments = [memory.next_gate_at]
    if gate.get("kept") and timers.silence_s is not None:
        silence_left = timers.silence_s - (now - memory.silence_since)
        facts["due_in_s"] = silence_left
        moments.append(now + silence_left)
        reason += f"; the dead-man stops it in {span(silence_left)} without a patrol tick ({gate['kept']})"
    action = "gate" if retry_in <= 0 else "wait"
    return Decision("gate_failed", reason, action=action, sleep_s=_sleep(timers, now, *moments), **facts)


def _holding(obs: Observation, memory: Memory, timers: Timers) -> str:
    """What keeps the box from a stop before any gate: unreadable runs, a stage's lease, a GPU job outside any run,
    no run, a run not over (or one that ended without DONE, without a dead-man to act on it); "" when nothing
    does."""
    if obs.problem is not None:
        return f"the runs cannot be read: {obs.problem}"
    if obs.lease is not None:
        return held_by(obs.lease)
    if obs.outside:
        shown = ", ".join(obs.outside[:3]) + (f" and {len(obs.outside) - 3} more" if len(obs.outside) > 3 else "")
        return f"a process outside any run uses a GPU: {shown}; a stop would kill it"
    if not obs.runs:
        return "no run on this box yet"
    ended = any(run.state == "ended" for run in obs.runs)
    return _unsecured(obs.runs) if memory.idle_since is None or (ended and timers.silence_s is None) else ""


def _issued(memory: Memory, timers: Timers, now: float) -> Decision:
    """After a stop was issued for this generation: never another, only the status."""
    if memory.stop_outcome == "stopped":
        return Decision("stopped", memory.stop_reason, action="exit", sleep_s=0.0)
    due = memory.next_stop_at is None or now >= memory.next_stop_at
    return Decision(
        str(memory.stop_outcome),
        memory.stop_reason,
        action="poll" if due else "wait",
        sleep_s=_sleep(timers, now, memory.next_stop_at),
    )


def decide(obs: Observation, memory: Memory, timers: Timers, now: float) -> Decision:
    """The state and the next action (``wait``, ``gate``: run the gate now, ``stop``: run the gate again and stop
    if it passes, ``poll``: the status only, ``exit``). ``memory``'s clocks are brought up to ``obs`` in place."""
    _clocks(obs, memory, now)
    if memory.stop_outcome in ("stopping", "stopped", "unconfirmed"):
        return _issued(memory, timers, now)
    runs = [run.as_dict() for run in obs.runs]
    silence_s = now - memory.silence_since
    facts: Dict[str, Any] = {"runs": runs, "silence_needed_s": timers.silence_s, "idle_needed_s": timers.idle_s}
    facts["silence_s"] = silence_s if timers.silence_s is not None else None
    if memory.stop_outcome == "failed" and memory.stop_attempts >= MAX_STOP_ATTEMPTS:
        reason = f"gave up after {memory.stop_attempts} attempts: {memory.stop_reason}; arm again to retry"
        return Decision("failed", reason, sleep_s=timers.check_interval_s, **facts)
    holding = _holding(obs, memory, timers)
    if holding:
        return Decision("waiting", holding, sleep_s=_sleep(timers, now), **facts)
    idle_s = now - memory.idle_since
    facts["idle_s"] = idle_s
    left = [need - done for need, done in ((timers.idle_s, idle_s), (timers.silence_s, silence_s)) if need is not None]
    due_in = max(0.0, min(left))
    facts["due_in_s"] = due_in
    if memory.gate is None:
        what = "DONE" if all(run.state in SECURED for run in obs.runs) else "over"
        return Decision("waiting", f"every run is {what}: checking the gate", action="gate", sleep_s=0.0, **facts)
    silenced = timers.silence_s is not None and silence_s >= timers.silence_s
    kept = memory.gate.get("kept") if timers.silence_s is not None else None
    if not memory.gate["passed"] and not (kept and silenced):
        return _gate_failed(memory, timers, now, facts)
    waiting = "idle_wait" if timers.idle_s is not None else "silence_wait"
    trigger = None
    if not memory.gate["passed"]:
        waiting, trigger = "gate_failed", "controller_silence"
    elif timers.idle_s is not None and idle_s >= timers.idle_s and all(run.state in SECURED for run in obs.runs):
        trigger = "idle"
    elif silenced:
        trigger = "controller_silence"
    if trigger is None:
        parts = []
        if timers.idle_s is not None:
            parts.append(f"idle {span(idle_s)} of {span(timers.idle_s)}")
        if timers.silence_s is not None:
            parts.append(f"{span(silence_s)} of {span(timers.silence_s)} without a patrol tick")
        reason = f"every run is DONE and secured; stops in {span(due_in)} ({', '.join(parts)})"
        return Decision(waiting, reason, sleep_s=_sleep(timers, now, now + due_in), **facts)
    facts["trigger"] = trigger
    if memory.stop_outcome == "failed" and memory.next_stop_at is not None and now < memory.next_stop_at:
        retry_in = memory.next_stop_at - now
        reason = (
            f"stop attempt {memory.stop_attempts} of {MAX_STOP_ATTEMPTS} failed: {memory.stop_reason}; "
            f"retry in {span(retry_in)}"
        )
        return Decision("failed", reason, sleep_s=_sleep(timers, now, memory.next_stop_at), **facts)
    if not memory.gate["passed"]:
        reason = f"dead-man: patrol silent {span(silence_s)}; {kept}: stopping"
        return Decision(waiting, reason, action="stop", sleep_s=0.0, **facts)
    why = f"idle {span(idle_s)}" if trigger == "idle" else f"{span(silence_s)} without a patrol tick"
    return Decision(waiting, f"{why} with every run secured: stopping", action="stop", sleep_s=0.0, **facts)
