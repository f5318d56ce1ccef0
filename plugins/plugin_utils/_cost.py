# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a box costs: the host's ``hourly_usd`` and the box's start, as the number every stage line shows.

The rate is the user's (inventory or group_vars) and the start is the box's own clock, so neither is trusted: a bad
rate is one line naming ``hourly_usd``, a start that cannot be read leaves the cost so far unknown (the rate still
shows), and a start in the future (a box clock ahead of ours) counts as zero hours with a note, never a negative cost.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

RATE_VARIABLE = "hourly_usd"
# The longest text a box timestamp may be: anything longer is not an ISO time and is never parsed.
_STAMP_CHARS = 64


def hourly_rate(task_vars: Mapping[str, Any], templar: Any = None) -> Tuple[Optional[float], Optional[str]]:
    """The host's rate in US dollars per hour and a problem: ``(rate, None)``, ``(None, "hourly_usd: ...")`` for a
    value that is no finite number >= 0 (a bool or a string is none either), or ``(None, None)`` when unset.

    Stage actions read host variables unrendered: a template in it is rendered with ``templar`` (the action's)."""
    value = task_vars.get(RATE_VARIABLE)
    if isinstance(value, str) and "{{" in value and templar is not None:
        try:
            value = templar.template(value)
        except Exception as error:  # any template error: the rate is unknown, and the problem says why
            return None, f"{RATE_VARIABLE}: its template failed: {' '.join(str(error).split())[:160]}"
    if value is None:
        return None, None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
        if math.isfinite(rate) and rate >= 0:
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


def box_cost(rate: Optional[float], since_iso: Any, now: Optional[datetime] = None) -> Optional[Dict[str, Any]]:
    """``{"hourly_usd", "since", "hours", "usd"}`` (plus ``note`` when the box's start is odd) for a box billing
    ``rate`` since ``since_iso``; None when the rate is unknown. ``now`` defaults to the controller's UTC clock."""
    if rate is None:
        return None
    cost: Dict[str, Any] = {"hourly_usd": round(rate, 4), "since": None, "hours": None, "usd": None}
    start = parse_since(since_iso)
    if start is None:
        if since_iso is not None:
            cost["note"] = "the box's start time is unreadable: cost so far unknown"
        return cost
    now = now or datetime.now(timezone.utc)
    if now.tzinfo is None:
        now = now.replace(tzinfo=timezone.utc)
    seconds = (now - start).total_seconds()
    if seconds < 0:
        # The box's clock runs ahead of ours: never a negative cost, and say why it is zero.
        cost["note"] = "clock: the box's start time is in the future (its clock is ahead of the controller's)"
        seconds = 0.0
    hours = seconds / 3600
    cost.update(since=start.isoformat().replace("+00:00", "Z"), hours=round(hours, 3), usd=round(rate * hours, 2))
    return cost


def _dollars(amount: float) -> str:
    return f"${amount:,.2f}"


def cost_text(cost: Optional[Mapping[str, Any]]) -> str:
    """``"$4.20 so far at $2.00/h"``, ``"$2.00/h"`` when the cost so far is unknown, ``""`` without a cost."""
    if not cost or not isinstance(cost.get("hourly_usd"), (int, float)):
        return ""
    rate = _dollars(cost["hourly_usd"]) + "/h"
    usd = cost.get("usd")
    if isinstance(usd, (int, float)) and not isinstance(usd, bool):
        return f"{_dollars(usd)} so far at {rate}"
    return rate


def fleet_hourly(records: Iterable[Mapping[str, Any]]) -> Optional[float]:
    """The fleet's total rate: the sum over records that have a cost and still bill (a cost marked
    ``meter_stopped``, a box teardown just stopped, is left out), None when none has a cost."""
    costs = [record["cost"] for record in records if isinstance(record.get("cost"), Mapping)]
    costs = [cost for cost in costs if isinstance(cost.get("hourly_usd"), (int, float))]
    if not costs:
        return None
    rates = [cost["hourly_usd"] for cost in costs if not cost.get("meter_stopped")]
    return round(sum(rates), 4)
