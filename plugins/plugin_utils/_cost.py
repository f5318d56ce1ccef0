# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a box costs: the host's ``hourly_usd`` and the box's cost ledger, as the number every stage line shows.

The rate is the user's (inventory, group_vars or ``-e``) and the ledger is the box's, so neither is trusted. One rule
reads ``hourly_usd`` in every stage (:func:`hourly_rate`): a number, or text that is one (``-e hourly_usd=2.5``
gives ``"2.5"``); anything else is one line naming ``hourly_usd``, and a WARNING in every stage, never a refusal:
a bad rate only loses the cost, never a launch, a patrol tick or a teardown.

The cost so far is the rate times the running hours of the box's ledger (``_ledger`` on the box: every billing
segment since the rental was first seen, stopped intervals left out), counted on the box's own clock and returned
with it (``box_now``): a box clock hours off ours changes nothing. A box that sends no ledger (an older module) is
counted from its ``since`` to its ``box_now`` (ours only when it sent none); a start in the future then counts as
zero hours with a note, never a negative cost.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

RATE_VARIABLE = "hourly_usd"
STOPPED_RATE_VARIABLE = "hourly_usd_stopped"
# The longest text a box timestamp may be: anything longer is not an ISO time and is never parsed.
_STAMP_CHARS = 64
# A decimal number as text, sign and exponent allowed; not "nan", "inf", "1_000" or "0x10".
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
# A ledger may claim at most this much more running time than the span from its first_seen to the box's now.
_LEDGER_SLACK_S = 120.0
_SHOWN_SEGMENTS = 8
_NOTES = 8


def number_of(value: Any) -> Optional[float]:
    """The one rule for a number a user gives: a finite int or float, or text that is a decimal number (surrounding
    spaces ignored: ``"2.5"``, ``" 3 "``, ``"1e2"``); None for anything else (a bool, ``"abc"``, ``"nan"``,
    ``"inf"``, a list)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str) and len(value) <= _STAMP_CHARS and _DECIMAL.fullmatch(value.strip()):
        number = float(value.strip())
    else:
        return None
    return number if math.isfinite(number) else None


def hourly_rate(task_vars: Mapping[str, Any], templar: Any = None) -> Tuple[Optional[float], Optional[str]]:
    """The host's rate in US dollars per hour and a problem: ``(rate, None)``, ``(None, "hourly_usd: ...")`` for a
    value that is no number >= 0 (see :func:`number_of`), or ``(None, None)`` when unset. Every stage shows the
    problem as a warning and goes on without a cost.

    Stage actions read host variables unrendered: a template in it is rendered with ``templar`` (the action's)."""
    value = task_vars.get(RATE_VARIABLE)
    if isinstance(value, str) and "{{" in value and templar is not None:
        try:
            value = templar.template(value)
        except Exception as error:  # any template error: the rate is unknown, and the problem says why
            return None, f"{RATE_VARIABLE}: its template failed: {' '.join(str(error).split())[:160]}"
    if value is None:
        return None, None
    rate = number_of(value)
    if rate is not None and rate >= 0:
        return rate, None
    shown = repr(str(value) if isinstance(value, str) else value)  # a tagged string's repr is a plain one
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return None, f"{RATE_VARIABLE}: must be a number of US dollars per hour (>= 0), not {shown}"


def parse_since(since: Any) -> Optional[datetime]:
    """An aware UTC datetime from a box's ISO timestamp (naive means UTC), or None for anything else."""
    if not isinstance(since, str) or not since.strip() or len(since) > _STAMP_CHARS:
        return None
    text = since.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    try:
        return moment.astimezone(timezone.utc)
    except (OverflowError, ValueError):
        return None


def _line(value: Any, limit: int) -> str:
    line = " ".join(str(value).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _stamp(value: Any) -> Optional[str]:
    """A box timestamp as ISO 8601 UTC ending in Z, or None when it is none."""
    moment = parse_since(value)
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def _seconds(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def ledger_of(value: Any) -> Optional[Dict[str, Any]]:
    """A box's ``ledger`` checked (``{first_seen, running_s, segments_total, segments, stopped_at, notes}``, each
    field of its documented type or null), or None when it is no mapping or has no usable ``running_s``."""
    if not isinstance(value, Mapping) or _seconds(value.get("running_s")) is None:
        return None
    segments: List[Dict[str, Any]] = []
    for entry in value.get("segments") if isinstance(value.get("segments"), list) else []:
        if isinstance(entry, Mapping) and len(segments) < _SHOWN_SEGMENTS:
            by = entry.get("ended_by")
            segments.append(
                {
                    "start": _stamp(entry.get("start")),
                    "end": _stamp(entry.get("end")),
                    "ended_by": _line(by, 32) if isinstance(by, str) else None,
                    "running_s": _seconds(entry.get("running_s")),
                }
            )
    total = value.get("segments_total")
    notes = value.get("notes") if isinstance(value.get("notes"), list) else []
    return {
        "first_seen": _stamp(value.get("first_seen")),
        "running_s": _seconds(value["running_s"]),
        "segments_total": total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None,
        "segments": segments,
        "stopped_at": _stamp(value.get("stopped_at")),
        "notes": [_line(note, 300) for note in notes[:_NOTES] if isinstance(note, str)],
    }


def box_cost(
    rate: Optional[float],
    since_iso: Any,
    now: Optional[datetime] = None,
    *,
    box_now: Any = None,
    ledger: Any = None,
    later_s: float = 0.0,
) -> Optional[Dict[str, Any]]:
    """``{"hourly_usd", "since", "hours", "usd"}`` (plus ``note`` when the box's figures are odd) for a box billing
    ``rate``; None when the rate is unknown.

    With the box's ``ledger`` (see :func:`ledger_of`): its running hours, ``since`` its ``first_seen``. Without
    one: from ``since_iso`` to the box's own ``box_now``, else to ``now`` (the controller's UTC clock by default).
    ``later_s``: seconds the controller counted since the box answered (a teardown's steps up to its meter-stop),
    added to the box's figures (not to the controller's clock, which counts them already)."""
    if rate is None:
        return None
    cost: Dict[str, Any] = {"hourly_usd": round(rate, 4), "since": None, "hours": None, "usd": None}
    figures = ledger_of(ledger)
    start = parse_since(figures["first_seen"] if figures and figures["first_seen"] else since_iso)
    later = _seconds(later_s) or 0.0
    if figures is not None:
        seconds = figures["running_s"]
        told = parse_since(box_now)
        if told is not None and start is not None and seconds > (told - start).total_seconds() + _LEDGER_SLACK_S:
            # More running time than the box has existed for: a garbage ledger, never a bill.
            seconds = max((told - start).total_seconds(), 0.0)
            cost["note"] = "the box's ledger counts more running time than since its first_seen: cut to that span"
    elif start is None:
        if since_iso is not None:
            cost["note"] = "the box's start time is unreadable: cost so far unknown"
        return cost
    else:
        clock = parse_since(box_now)
        if clock is None:  # the controller's clock counts the time since the box answered already
            clock, later = now or datetime.now(timezone.utc), 0.0
        if clock.tzinfo is None:
            clock = clock.replace(tzinfo=timezone.utc)
        seconds = (clock - start).total_seconds()
        if seconds < 0:
            # The box's clock runs ahead of ours: never a negative cost, and say why it is zero.
            cost["note"] = "clock: the box's start time is in the future (its clock is ahead of the controller's)"
            seconds = 0.0
    hours = (seconds + later) / 3600
    since = None if start is None else start.isoformat().replace("+00:00", "Z")
    cost.update(since=since, hours=round(hours, 3), usd=round(rate * hours, 2))
    return cost


def _dollars(amount: float) -> str:
    return f"${amount:,.2f}"


def cost_text(cost: Optional[Mapping[str, Any]]) -> str:
    """``"$4.20 so far since 12-06 21:40 at $2.00/h"`` (``since`` in UTC, left out when unknown), ``"$2.00/h"``
    when the cost so far is unknown, ``""`` without a cost."""
    if not cost or not isinstance(cost.get("hourly_usd"), (int, float)):
        return ""
    rate = _dollars(cost["hourly_usd"]) + "/h"
    usd = cost.get("usd")
    if isinstance(usd, (int, float)) and not isinstance(usd, bool):
        start = parse_since(cost.get("since"))
        since = f" since {start:%m-%d %H:%M}" if start is not None else ""
        return f"{_dollars(usd)} so far{since} at {rate}"
    return rate


def fleet_hourly(records: Iterable[Mapping[str, Any]]) -> Optional[float]:
    """The fleet's total rate: the sum over records that have a cost of what each bills now: a stopped box (a cost
    with ``stopped_at``) its storage rate ``hourly_usd_stopped`` (0 when unknown), a box whose meter teardown just
    stopped (``meter_stopped``) nothing, any other its ``hourly_usd``; None when none has a cost."""
    costs = [record["cost"] for record in records if isinstance(record.get("cost"), Mapping)]
    costs = [cost for cost in costs if isinstance(cost.get("hourly_usd"), (int, float))]
    if not costs:
        return None
    rates = [_billing_now(cost) for cost in costs if not cost.get("meter_stopped")]
    return round(sum(rates), 4)


def _billing_now(cost: Mapping[str, Any]) -> float:
    if cost.get("stopped_at") is None:
        return float(cost["hourly_usd"])
    storage = cost.get("hourly_usd_stopped")
    return float(storage) if isinstance(storage, (int, float)) and not isinstance(storage, bool) else 0.0


def stopped_rate(task_vars: Mapping[str, Any], templar: Any = None) -> Tuple[Optional[float], Optional[str]]:
    """The host's ``hourly_usd_stopped`` (what its instance bills while stopped: storage), read by the rule of
    ``hourly_usd``: ``(rate, None)``, ``(None, problem naming hourly_usd_stopped)``, ``(None, None)`` when unset."""
    rate, problem = hourly_rate({RATE_VARIABLE: task_vars.get(STOPPED_RATE_VARIABLE)}, templar)
    if problem is not None:
        problem = STOPPED_RATE_VARIABLE + problem[len(RATE_VARIABLE) :]
    return rate, problem


def stopped_cost(
    cost: Optional[Mapping[str, Any]], stopped_iso: Any, storage_rate: Optional[float], now: datetime, cut: bool = True
) -> Optional[Dict[str, Any]]:
    """A stopped box's cost: ``cost`` (box_cost's, counted up to ``now``, on the stop's clock) with the GPU hours
    after the stop at ``stopped_iso`` taken out (``cut``; False when the box's ledger ended them at the stop
    already) and ``stopped_at``, ``hourly_usd_stopped`` (storage per hour, None unknown) and ``storage_usd`` (what
    storage cost since the stop, None unknown, added to ``usd``). ``cost`` itself when the stop's time is unreadable
    (the box then counts as billing), None without a cost."""
    stopped = parse_since(stopped_iso)
    if cost is None or stopped is None:
        return None if cost is None else dict(cost)
    after_h = max((now - stopped).total_seconds(), 0.0) / 3600
    result = dict(cost)
    hours, rate = result.get("hours"), result.get("hourly_usd")
    if cut and isinstance(hours, (int, float)) and isinstance(rate, (int, float)):
        hours = max(hours - after_h, 0.0)
        result.update(hours=round(hours, 3), usd=round(rate * hours, 2))
    storage_usd = None if storage_rate is None else round(storage_rate * after_h, 2)
    if isinstance(result.get("usd"), (int, float)) and storage_usd is not None:
        result["usd"] = round(result["usd"] + storage_usd, 2)
    result.update(
        stopped_at=stopped.isoformat().replace("+00:00", "Z"),
        hourly_usd_stopped=None if storage_rate is None else round(storage_rate, 4),
        storage_usd=storage_usd,
    )
    return result
