# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Patrol's money: the box's ``box`` and ``autostop`` facts checked, the autostop piece of the box's line, and the
``idle_billing`` escalation of a box that bills with no live run.

The box is untrusted: each fact is copied only when it has the documented type, so a garbage field is dropped (and
named by the record) instead of breaking the line. Idle time is counted on the box's own clock (its ``box_now``
minus its ``idle_since``), so a box clock hours off ours changes nothing; only a box that sent no ``box_now`` is
counted on the controller's clock, where a box clock ahead of ours counts as not idle yet, never a negative time.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import finite
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import ledger_of
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import parse_since as moment
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line

PROBLEM = "idle_billing"
ACTION = "teardown"
ADVICE = "run remote_gpu.trainer.teardown or arm autostop (launch_autostop)"
# An armed autostop in one of these states (on the armed generation) stops the box without anyone: no escalation.
# Not silence_wait: a dead-man fires only while patrol is silent, and this tick is patrol, so the box bills on.
WAITS = ("idle_wait",)
STOPS = ("stopping", "stopped")
# States in which the watcher is meant to be running (it exits once stopped, disarmed or out of attempts).
WATCHED = (None, "waiting", *WAITS, "silence_wait", "gate_failed", "stopping")
SHOWN_NAMES = 5
BOX_TEXT = ("since", "container_started_at", "idle_since", "box_now")
BOX_NAMES = ("live_runs", "runs_done")
AUTOSTOP_TEXT = ("state", "reason", "due_at", "next_check_at", "updated_at", "trigger", "generation")
AUTOSTOP_NUMBERS = (
    "idle_s",
    "idle_needed_s",
    "silence_s",
    "silence_needed_s",
    "idle_minutes",
    "controller_silence_hours",
)
AUTOSTOP_FLAGS = ("armed", "watcher_alive", "generation_current")
GATE_KEYS = {"passed": bool, "step": str, "reason": str, "checked_at": str}
STOP_KEYS = {"issued_at": str, "outcome": str, "final_state": str, "msg": str, "attempts": int}


def _text(value: Any, limit: int = 200) -> Optional[str]:
    return one_line(value, limit) if isinstance(value, str) else None


def _names(value: Any) -> Optional[List[str]]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return None
    return [one_line(item, 80) for item in value[:200]]


def _typed(value: Any, keys: Mapping[str, type]) -> Optional[Dict[str, Any]]:
    """The keys of ``value`` that have their type (an int is no bool), or None when ``value`` is no mapping."""
    if not isinstance(value, Mapping):
        return None
    kept: Dict[str, Any] = dict.fromkeys(keys)
    for key, kind in keys.items():
        item = value.get(key)
        if isinstance(item, kind) and not (kind is int and isinstance(item, bool)):
            kept[key] = one_line(item, 300) if kind is str else item
    return kept


def box_facts(value: Any) -> Tuple[Optional[Dict[str, Any]], bool]:
    """patrol_facts' ``box`` checked, and whether it was usable (absent is usable: an older module)."""
    if value is None:
        return None, True
    if not isinstance(value, Mapping):
        return None, False
    box: Dict[str, Any] = {key: _text(value.get(key), 64) for key in BOX_TEXT}
    box.update({key: _names(value.get(key)) or [] for key in BOX_NAMES})
    box["idle"] = value.get("idle") if isinstance(value.get("idle"), bool) else None
    box["ledger"] = ledger_of(value.get("ledger"))
    ok = all(value.get(key) is None or box[key] is not None for key in (*BOX_TEXT, "idle", "ledger"))
    ok = ok and all(value.get(key) is None or _names(value.get(key)) is not None for key in BOX_NAMES)
    return box, ok


def autostop_facts(value: Any) -> Tuple[Optional[Dict[str, Any]], bool]:
    """patrol_facts' ``autostop`` checked, and whether it was usable (absent is usable: an older module)."""
    if value is None:
        return None, True
    if not isinstance(value, Mapping):
        return None, False
    facts: Dict[str, Any] = {key: _text(value.get(key)) for key in AUTOSTOP_TEXT}
    facts.update({key: finite(value.get(key)) for key in AUTOSTOP_NUMBERS})
    facts.update({key: value.get(key) if isinstance(value.get(key), bool) else None for key in AUTOSTOP_FLAGS})
    pid = value.get("watcher_pid")
    facts["watcher_pid"] = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    facts["gate"] = _typed(value.get("gate"), GATE_KEYS)
    facts["stop"] = _typed(value.get("stop"), STOP_KEYS)
    if facts["stop"] is not None:
        facts["stop"]["command"] = _names(value["stop"].get("command"))
    facts["armed_by"] = _typed(value.get("armed_by"), {"run": str, "launch_id": str})
    ok = value.get("armed") is None or facts["armed"] is not None
    return facts, ok


# ---- words ---------------------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``45 min``, ``2 h 10 min``, ``3 d 4 h``: how long a box has billed idle."""
    minutes = int(max(seconds, 0) // 60)
    days, rest = divmod(minutes, 1440)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"


def clock(stamp: Any, now: datetime) -> str:
    """A box timestamp as ``03:41 UTC`` (with the date when it is not today's), ``?`` when unreadable."""
    when = moment(stamp)
    if when is None:
        return "?"
    return when.strftime("%H:%M UTC" if when.date() == now.date() else "%Y-%m-%d %H:%M UTC")


def _amount(value: Optional[float], scale: float) -> str:
    return "?" if value is None else f"{value / scale:.0f}"


def stopped_at(autostop: Optional[Mapping[str, Any]]) -> Any:
    """When the box's autostop issued its stop (its decision's time when the stop says none), or None."""
    if not autostop or autostop.get("state") not in STOPS:
        return None
    return (autostop.get("stop") or {}).get("issued_at") or autostop.get("updated_at")


def restarted_since(autostop: Optional[Mapping[str, Any]], booted: Any) -> Optional[str]:
    """``booted`` (the container's start) when the box's autostop stop is older than it: the box was stopped and
    has run again since, so that stop is history and the box bills; else None (no stop, or a boot unknown)."""
    stop, boot = moment(stopped_at(autostop)), moment(booted)
    return booted if stop is not None and boot is not None and stop < boot else None


def autostop_piece(autostop: Optional[Mapping[str, Any]], now: datetime, booted: Any = None) -> str:
    """What the box's autostop will do, for the box's line; "" when none is armed. ``booted``: the container's start
    (box.container_started_at), which makes a stop older than it history."""
    if not autostop or (autostop.get("armed") is not True and autostop.get("state") != "disarmed"):
        return ""
    state, reason = autostop.get("state"), autostop.get("reason") or "no reason given"
    gate, stop = autostop.get("gate") or {}, autostop.get("stop") or {}
    restarted = restarted_since(autostop, booted)
    if restarted is not None:
        again = (
            "re-armed, its watcher runs again"
            if autostop.get("watcher_alive") is True
            else "not armed (launch with launch_autostop to arm it again)"
        )
        when = clock(stopped_at(autostop), now)
        return f"autostop: stopped the box at {when}, restarted since at {clock(restarted, now)}: {again}"
    if autostop.get("watcher_alive") is False and state in WATCHED:
        return "autostop: armed but its watcher is not running (run launch with launch_autostop again to restart it)"
    if state is None:
        return "autostop: armed, its watcher has written no decision yet"
    if autostop.get("generation_current") is False and state not in STOPS:
        return "autostop: armed, its watcher has not taken up the new settings yet"
    if state == "waiting":
        return f"autostop: armed, waiting ({reason})"
    if state == "idle_wait":
        idle = f"idle {_amount(autostop.get('idle_s'), 60)}/{_amount(autostop.get('idle_needed_s'), 60)} min"
        return f"autostop: stops at {clock(autostop.get('due_at'), now)} ({idle})"
    if state == "silence_wait":
        needed = _amount(autostop.get("silence_needed_s"), 3600)
        return f"autostop: dead-man, stops at {clock(autostop.get('due_at'), now)} if patrol stays silent ({needed} h)"
    if state == "gate_failed":
        where = gate.get("step") or "?"
        return f"autostop: gate failed at {where}: {gate.get('reason') or reason}; retried, never bypassed"
    if state == "stopping":
        return f"autostop: stopping the box (stop issued at {clock(stop.get('issued_at'), now)})"
    if state == "stopped":
        return f"autostop: stopped the box at {clock(stop.get('issued_at') or autostop.get('updated_at'), now)}"
    if state in ("failed", "unconfirmed"):
        tries = stop.get("attempts")
        after = f" after {tries} attempt{'s' if tries != 1 else ''}" if isinstance(tries, int) else ""
        return f"autostop: stop {state.upper()}{after}: {stop.get('msg') or reason}"
    if state == "disarmed":
        return "autostop: disarmed"
    return f"autostop: {state} ({reason})"


# ---- idle_billing --------------------------------------------------------------------------------------------


def will_stop(autostop: Optional[Mapping[str, Any]], booted: Any = None) -> bool:
    """Whether the box's armed autostop, on its current settings, stops this box without anyone (a stop older than
    the container's start, ``booted``, stopped an earlier run of the box: this one bills)."""
    if not autostop or autostop.get("armed") is not True or autostop.get("generation_current") is not True:
        return False
    if restarted_since(autostop, booted) is not None:
        return False
    state = autostop.get("state")
    return state in STOPS or (state in WAITS and autostop.get("watcher_alive") is not False)


def idle_billing(box: Optional[Mapping[str, Any]], rate: Optional[float], now: datetime) -> Optional[Dict[str, Any]]:
    """``{idle_s, hourly_usd, burning_usd, since}`` of a box with no live run (``burning_usd``: what its idle time
    cost so far), or None when a run is live or the box did not say when it went idle. ``idle_s`` is the box's
    ``box_now`` minus its ``idle_since`` (one clock); ``now``, the controller's, only when the box sent no now."""
    if not box or box.get("idle") is not True or box.get("live_runs"):
        return None
    since = moment(box.get("idle_since"))
    if since is None:
        return None
    idle_s = max(((moment(box.get("box_now")) or now) - since).total_seconds(), 0.0)
    burning = None if rate is None else round(rate * idle_s / 3600, 2)
    return {"idle_s": round(idle_s, 1), "hourly_usd": rate, "burning_usd": burning, "since": box.get("idle_since")}


def _which_runs(record: Mapping[str, Any], box: Mapping[str, Any]) -> str:
    done = list(box.get("runs_done") or [])
    others = [
        f"{run.get('run')} {run.get('state') or 'not done'}"
        for run in record.get("runs") or []
        if isinstance(run, Mapping) and isinstance(run.get("run"), str) and run["run"] not in done
    ]
    if not done and not others:
        return "no run on the box"
    said = []
    if done:
        more = f" +{len(done) - SHOWN_NAMES}" if len(done) > SHOWN_NAMES else ""
        said.append(f"runs {', '.join(done[:SHOWN_NAMES])}{more} DONE")
    said += others[:SHOWN_NAMES]
    return "; ".join(said)


def escalate(record: Dict[str, Any], minutes: Optional[float], rate: Optional[float], now: datetime) -> None:
    """Set ``record["idle_billing"]`` and escalate a box that billed with no live run for over ``minutes`` (None:
    never), unless its armed autostop will stop it. The problem id stays ``idle_billing`` while it lasts, so the
    notifier sends it once."""
    box, autostop = record.get("box"), record.get("autostop")
    found = idle_billing(box, rate, now) if minutes is not None else None
    record["idle_billing"] = found
    booted = box.get("container_started_at") if box is not None else None
    if found is None or box is None or found["idle_s"] <= minutes * 60 or will_stop(autostop, booted):
        return
    what = ADVICE
    piece = autostop_piece(autostop, now, booted)
    if piece:  # armed, yet it will not stop the box: say what holds it back
        what = f"run remote_gpu.trainer.teardown (autostop will not stop it: {piece.removeprefix('autostop: ')})"
    cost = f"burning ${rate:,.2f}/h: {what}" if rate is not None else f"{what} (set hourly_usd to see what it costs)"
    reason = f"{PROBLEM}: no live run for {duration(found['idle_s'])} ({_which_runs(record, box)}); {cost}"
    reasons = list(record.get("reasons") or [])
    reasons.insert(0 if record.get("escalate") is not True else len(reasons), one_line(reason, 400))
    record.update(
        escalate=True,
        reasons=reasons,
        problems=list(dict.fromkeys([*(record.get("problems") or []), PROBLEM])),
        actions=list(dict.fromkeys([*(record.get("actions") or []), ACTION])),
    )
