"""The cost on teardown's line and every stage's fleet total per hour (issue 22)."""

from __future__ import annotations

from typing import Any, Dict

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines, _teardown_lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import status_summary

COST = {"hourly_usd": 2.0, "since": "2025-03-01T10:00:00Z", "hours": 2.1, "usd": 4.2}


def record(host: str, status: str = "TORN_DOWN", **more: Any) -> Dict[str, Any]:
    return {"host": host, "status": status, "step": None, "runs": ["r1"], **more}


def test_the_fleet_summary_adds_the_total_per_hour_only_when_a_box_has_a_cost() -> None:
    records = [
        record("b1", cost=COST),
        record("b2", "REFUSED", step="cells", cost={"hourly_usd": 5.2, "usd": None}),
        record("b3", cost=None),
    ]
    summary = status_summary(records, ("TORN_DOWN", "REFUSED"), (), ("REFUSED",))
    assert summary["line"] == "3 hosts: 2 TORN_DOWN, 1 REFUSED; refused: b2 (cells); $7.20/h"
    assert summary["hourly_usd_total"] == 7.2
    plain = status_summary([record("b1"), record("b3", cost=None)], ("TORN_DOWN",), (), ())
    assert (plain["line"], plain["hourly_usd_total"]) == ("2 hosts: 2 TORN_DOWN", None)


def test_teardown_and_launch_summaries_carry_the_total() -> None:
    teardown = _teardown_lines.summary([record("b1", cost=COST), record("b2", "UNREACHABLE", cost=COST)])
    assert teardown["line"].endswith("; unreachable: b2; $4.00/h") and teardown["hourly_usd_total"] == 4.0
    launch = _launch_lines.summary([{"host": "b1", "status": "STARTED", "cost": COST}])
    assert launch["hourly_usd_total"] == 2.0 and "$2.00/h" in launch["line"]


def test_the_teardown_line_ends_with_the_cost_even_when_cut() -> None:
    refused = record("b1", "REFUSED", step="durable", reason="x" * 2000, cost=COST)
    line = _teardown_lines.line(refused)
    assert len(line) == _teardown_lines.LINE_CHARS and line.endswith("xxx; $4.20 so far at $2.00/h")
    gone = _teardown_lines.line(record("b2", "UNREACHABLE", reason="ssh: timed out", cost={"hourly_usd": 0.4}))
    assert gone == "b2  UNREACHABLE  ssh: timed out; $0.40/h"
    assert (
        _teardown_lines.line(record("b3", "UNREACHABLE", reason="ssh: timed out")) == "b3  UNREACHABLE  ssh: timed out"
    )


def test_the_report_keeps_the_cost() -> None:
    assert "cost" in _teardown_lines.RECORD_KEYS
