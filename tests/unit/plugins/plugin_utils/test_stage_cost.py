"""The cost on teardown's line and every stage's fleet total per hour (issue 22); numbers as text read by one rule
with one severity in launch, patrol and teardown (issue 29)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines, _teardown_flow, _teardown_lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._launch_flow import Launch
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import status_summary
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._teardown_flow import Teardown
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.action.test_patrol_action import FACTS, patrol
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.plugin_utils.test_launch_settings import play, settle
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.plugin_utils.test_teardown_flow import FakeAction
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.plugin_utils.test_teardown_flow import (
    settings as teardown_settings,
)

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
    assert len(line) == _teardown_lines.LINE_CHARS and line.endswith("xxx; $4.20 so far since 03-01 10:00 at $2.00/h")
    gone = _teardown_lines.line(record("b2", "UNREACHABLE", reason="ssh: timed out", cost={"hourly_usd": 0.4}))
    assert gone == "b2  UNREACHABLE  ssh: timed out; $0.40/h"
    assert (
        _teardown_lines.line(record("b3", "UNREACHABLE", reason="ssh: timed out")) == "b3  UNREACHABLE  ssh: timed out"
    )


def test_the_report_keeps_the_cost() -> None:
    assert "cost" in _teardown_lines.RECORD_KEYS


# --- numbers as text: one rule and one severity in every stage (issue 29 item 9) ---------------------------------

WARNING = "hourly_usd: must be a number of US dollars per hour (>= 0), not 'abc'"


def launch_rate(tmp_path: Path, value: Any) -> Tuple[Optional[float], List[str]]:
    """Launch's settings for a host with ``hourly_usd``: (its rate, its warnings, as the box's record starts them)."""
    settings, problems = settle(play(tmp_path, {"hourly_usd": value}))
    assert problems == [] and settings is not None  # a bad rate never refuses a launch
    warnings = Launch(SimpleNamespace(_task=SimpleNamespace(check_mode=False)), settings, {}, 1).record["warnings"]
    return settings["hourly_usd"], warnings


def patrol_rate(value: Any) -> Tuple[Optional[float], List[str]]:
    record = patrol({"data_dir": "/data"}, {"hourly_usd": value}, dict(FACTS))
    assert record["status"] == "RUNNING" and not record.get("failed")  # a bad rate never stops a tick
    return (record["cost"] or {}).get("hourly_usd"), [record["cost_warning"]] if record["cost_warning"] else []


def teardown_rate(value: Any) -> Tuple[Optional[float], List[str]]:
    flow = Teardown(FakeAction({}), teardown_settings(), {"hourly_usd": value}, "b1")
    return flow.rate, flow.record["warnings"]  # a bad rate never stops a teardown


@pytest.mark.parametrize(("value", "rate"), [("2.5", 2.5), (" 3 ", 3.0), (2.5, 2.5)])
def test_numeric_text_is_the_rate_in_launch_patrol_and_teardown(tmp_path: Path, value: Any, rate: float) -> None:
    """``-e hourly_usd=2.5`` is the string "2.5": launch refused it while patrol and teardown only warned."""
    assert launch_rate(tmp_path, value) == patrol_rate(value) == teardown_rate(value) == (rate, [])


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", True])
def test_a_bad_rate_is_the_same_one_line_warning_in_every_stage(tmp_path: Path, value: Any) -> None:
    said = launch_rate(tmp_path, value)
    assert said == patrol_rate(value) == teardown_rate(value)
    assert said[0] is None and len(said[1]) == 1 and said[1][0].startswith("hourly_usd: must be a number of US")
    if value == "abc":
        assert said[1] == [WARNING]


@pytest.mark.parametrize("skew_h", [3, -3])
def test_teardown_counts_the_gate_s_ledger_on_the_box_s_clock_plus_its_own_time(skew_h: int, monkeypatch) -> None:
    box_now = datetime.now(timezone.utc) + timedelta(hours=skew_h)
    first_seen = (box_now - timedelta(hours=9)).isoformat()
    instance = {"other_runs": [], "box_started_at": first_seen, "box_now": box_now.isoformat(),
                "ledger": {"first_seen": first_seen, "running_s": 7200.0, "segments_total": 2}}  # fmt: skip
    answer = {"passed": True, "step": None, "reason": "", "runs": [], "instance": instance}
    clock = [100.0]
    monkeypatch.setattr(_teardown_flow.time, "monotonic", lambda: clock[0])
    flow = Teardown(FakeAction({"teardown_gate": [answer]}), teardown_settings(), {"hourly_usd": 2.5}, "b1")
    flow.run_gate()
    assert flow.record["cost"] == {
        "hourly_usd": 2.5,
        "since": first_seen.replace("+00:00", "Z"),
        "hours": 2.0,
        "usd": 5.0,
    }
    clock[0] += 1800  # half an hour of pulls and checks later
    assert flow.cost()["usd"] == 6.25  # 2.5 h: the box's 2 h and the teardown's half hour, never two clocks mixed
