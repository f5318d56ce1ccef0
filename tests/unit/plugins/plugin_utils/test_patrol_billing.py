"""Patrol's money: idle_billing escalates a box that bills with no live run (once, across ticks), never one whose
armed autostop will stop it or one with a live run; the autostop and the cost on the box's line."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Optional

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_billing as billing
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_record as records
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_notify import notify

NOW = datetime(2026, 12, 4, 3, 29, 0, tzinfo=timezone.utc)
ADVICE = "run remote_gpu.trainer.teardown or arm autostop (launch_autostop)"


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def idle_box(idle_for: timedelta = timedelta(hours=2, minutes=10), **changes: Any) -> Dict[str, Any]:
    box = {
        "since": iso(NOW - timedelta(hours=5)), "container_started_at": iso(NOW - timedelta(hours=6)),
        "live_runs": [], "idle": True, "idle_since": iso(NOW - idle_for), "runs_done": ["r1", "r2"],
    }  # fmt: skip
    return {**box, **changes}


def armed(state: str, **changes: Any) -> Dict[str, Any]:
    autostop = {
        "armed": True, "state": state, "reason": "every run is DONE and secured", "generation": "a1b2c3d4e5f6",
        "generation_current": True, "watcher_alive": True, "watcher_pid": 4242, "due_at": "2026-12-04T03:41:00Z",
        "idle_s": 1080.0, "idle_needed_s": 1800.0, "silence_s": None, "silence_needed_s": None, "trigger": "idle",
        "gate": {"passed": True, "step": None, "reason": "secured", "checked_at": iso(NOW)}, "stop": None,
    }  # fmt: skip
    return {**autostop, **changes}


def judged(
    box: Optional[Dict[str, Any]] = None,
    autostop: Optional[Dict[str, Any]] = None,
    minutes: Optional[float] = 60,
    rate: Optional[float] = 2.0,
    **facts: Any,
) -> Dict[str, Any]:
    """A box's record as the action makes it: the facts checked, the cost, idle_billing judged, the line."""
    answer = {
        "state": "done", "escalate": False, "headline": "DONE run r2: 1/1 cells done",
        "runs": [{"run": "r1", "summary": "r1: done 3/3", "state": "done"},
                 {"run": "r2", "summary": "r2: done 1/1", "state": "done"}],
        "box": box, "autostop": autostop, **facts,
    }  # fmt: skip
    record = records.checked("b1", answer, "python3")
    told = record.get("box") or {}
    record["cost"] = box_cost(rate, told.get("since"), NOW, box_now=told.get("box_now"), ledger=told.get("ledger"))
    billing.escalate(record, minutes, rate, NOW)
    record["line"] = lines.line(record, NOW)
    return record


def test_an_idle_box_over_the_limit_escalates_with_what_it_burns_and_what_to_run() -> None:
    record = judged(idle_box())
    assert (record["escalate"], record["problems"], record["actions"]) == (True, ["idle_billing"], ["teardown"])
    assert record["reasons"][0] == (
        f"idle_billing: no live run for 2 h 10 min (runs r1, r2 DONE); burning $2.00/h: {ADVICE}"
    )
    assert record["idle_billing"] == {
        "idle_s": 7800.0, "hourly_usd": 2.0, "burning_usd": 4.33, "since": iso(NOW - timedelta(hours=2, minutes=10))
    }  # fmt: skip
    assert record["state"] == "done"  # the runs' state stays; the box is escalated for its money
    assert record["line"].endswith("| $10.00 so far since 12-03 22:29 at $2.00/h  ESCALATED -> teardown")


@pytest.mark.parametrize("skew", [timedelta(hours=3), timedelta(hours=-3)])
def test_a_box_clock_hours_off_ours_idles_and_costs_on_its_own_clock(skew: timedelta) -> None:
    """A box 3 h ahead was never flagged and showed $0.00; one 3 h behind was flagged at once and billed 3 h more."""
    box_now = NOW + skew
    ledger = {"first_seen": iso(box_now - timedelta(hours=5)), "running_s": 5 * 3600.0, "segments_total": 1}
    box = idle_box(
        since=iso(box_now - timedelta(hours=5)), idle_since=iso(box_now - timedelta(hours=2, minutes=10)),
        box_now=iso(box_now), ledger=ledger,
    )  # fmt: skip
    record = judged(box)
    assert record["idle_billing"]["idle_s"] == 7800.0 and record["problems"] == ["idle_billing"]
    assert record["reasons"][0].startswith("idle_billing: no live run for 2 h 10 min")
    assert (record["cost"]["hours"], record["cost"]["usd"]) == (5.0, 10.0)
    fresh = judged(dict(box, idle_since=iso(box_now - timedelta(minutes=2))))
    assert fresh["idle_billing"]["idle_s"] == 120.0 and not fresh["escalate"]


def test_without_the_box_s_now_idle_time_is_counted_on_the_controller_s_clock() -> None:
    assert billing.idle_billing(idle_box(), 2.0, NOW)["idle_s"] == 7800.0  # an older module sends no box_now


def test_a_garbage_box_now_or_ledger_is_dropped_and_named() -> None:
    box, ok = billing.box_facts(idle_box(box_now=7, ledger={"running_s": "lots"}))
    assert not ok and box is not None and (box["box_now"], box["ledger"]) == (None, None)


def test_idle_billing_notifies_once_across_two_ticks(tmp_path) -> None:
    options = {"state_file": os.fspath(tmp_path / "state.json"), "webhook_url": "", "timeout_s": 5}
    first = notify([judged(idle_box())], options, os.fspath(tmp_path), iso(NOW), False)
    later = judged(idle_box(timedelta(hours=2, minutes=40)))  # the next tick: idle longer, the same problem
    second = notify([later], options, os.fspath(tmp_path), iso(NOW + timedelta(minutes=30)), False)
    sent = [text for text in first if text.startswith("not sent")]
    assert len(sent) == 1 and "new: idle_billing" in sent[0] and "burning $2.00/h" in sent[0]
    assert second == ["notifications: none due (no new problem, nothing cleared)"]


def test_under_the_limit_or_turned_off_it_is_measured_but_not_escalated() -> None:
    young = judged(idle_box(timedelta(minutes=59)))
    assert young["escalate"] is False and young["idle_billing"]["idle_s"] == 3540.0
    off = judged(idle_box(), minutes=None)
    assert (off["escalate"], off["idle_billing"], off["problems"]) == (False, None, [])


def test_a_live_run_is_never_idle_billing() -> None:
    record = judged(idle_box(idle=False, live_runs=["r3"]), state="running")
    assert (record["escalate"], record["idle_billing"]) == (False, None)


@pytest.mark.parametrize("state", ["idle_wait", "stopping", "stopped"])
def test_an_armed_current_autostop_that_will_stop_the_box_holds_idle_billing_back(state: str) -> None:
    record = judged(idle_box(), armed(state))
    assert (record["escalate"], record["problems"]) == (False, [])
    assert record["idle_billing"]["idle_s"] == 7800.0  # still measured and reported


@pytest.mark.parametrize(
    ("autostop", "why"),
    [
        (armed("gate_failed", gate={"passed": False, "step": "durable", "reason": "r1/model.pt: sha256 differs"}),
         "gate failed at durable: r1/model.pt: sha256 differs; retried, never bypassed"),
        (armed("idle_wait", generation_current=False), "armed, its watcher has not taken up the new settings yet"),
        (armed("idle_wait", watcher_alive=False),
         "armed but its watcher is not running (run launch with launch_autostop again to restart it)"),
        (armed("waiting", reason="run r3 is live"), "armed, waiting (run r3 is live)"),
        (armed("silence_wait", due_at="2026-12-04T09:29:00Z", silence_needed_s=21600.0),
         "dead-man, stops at 09:29 UTC if patrol stays silent (6 h)"),
        (armed("failed", stop={"attempts": 3, "msg": "runpodctl: 401 unauthorized"}),
         "stop FAILED after 3 attempts: runpodctl: 401 unauthorized"),
    ],
)  # fmt: skip
def test_an_autostop_that_will_not_stop_the_box_escalates_and_says_why(autostop: Dict[str, Any], why: str) -> None:
    record = judged(idle_box(), autostop)
    assert record["problems"] == ["idle_billing"]
    assert record["reasons"][0].endswith(
        f"burning $2.00/h: run remote_gpu.trainer.teardown (autostop will not stop it: {why})"
    )
    assert f"autostop: {why}" in record["line"]


def test_an_unknown_rate_says_to_set_hourly_usd() -> None:
    record = judged(idle_box(), rate=None)
    assert record["reasons"][0] == (
        f"idle_billing: no live run for 2 h 10 min (runs r1, r2 DONE); {ADVICE} (set hourly_usd to see what it costs)"
    )
    assert record["idle_billing"]["burning_usd"] is None and record["cost"] is None


def test_an_already_escalated_box_keeps_its_first_reason_and_gains_the_problem() -> None:
    record = judged(
        idle_box(runs_done=["r1"]), state="crashed", escalate=True, problems=["crashed:r2"], actions=["restart_job"],
        reasons=["r2: the runner is gone with 1 of 1 cells not done (a)"],
        runs=[{"run": "r1", "state": "done"}, {"run": "r2", "state": "crashed"}],
    )  # fmt: skip
    assert record["problems"] == ["crashed:r2", "idle_billing"] and record["actions"] == ["restart_job", "teardown"]
    assert record["reasons"][0].startswith("r2: the runner is gone")
    assert "(runs r1 DONE; r2 crashed)" in record["reasons"][1]


def test_the_line_shows_the_armed_timer_and_the_cost() -> None:
    record = judged(idle_box(timedelta(minutes=18)), armed("idle_wait"))
    assert record["line"] == (
        "b1  DONE  run r2: 1/1 cells done | r1: done 3/3; r2: done 1/1 | disk ?, gpu none"
        " | autostop: stops at 03:41 UTC (idle 18/30 min) | $10.00 so far since 12-03 22:29 at $2.00/h"
    )


@pytest.mark.parametrize(
    ("autostop", "piece"),
    [
        (armed("stopped", stop={"issued_at": "2026-12-04T02:05:09Z"}), "autostop: stopped the box at 02:05 UTC"),
        (armed("stopping", stop={"issued_at": "2026-12-03T23:59:00Z"}),
         "autostop: stopping the box (stop issued at 2026-12-03 23:59 UTC)"),
        (armed("silence_wait", due_at="2026-12-04T09:29:00Z", silence_needed_s=21600.0),
         "autostop: dead-man, stops at 09:29 UTC if patrol stays silent (6 h)"),
        (armed(None), "autostop: armed, its watcher has written no decision yet"),
        ({"armed": False, "state": None}, ""),
        (None, ""),
    ],
)  # fmt: skip
def test_the_autostop_piece_says_what_the_box_will_do(autostop: Optional[Dict[str, Any]], piece: str) -> None:
    checked, usable = billing.autostop_facts(autostop)
    assert usable and billing.autostop_piece(checked, NOW) == piece


def test_a_long_line_gives_way_in_the_run_summaries_never_the_money() -> None:
    runs = [{"run": f"r{n}", "summary": f"r{n}: done 1/1 " + "x" * 150, "state": "done"} for n in range(6)]
    record = judged(idle_box(), armed("gate_failed", gate={"step": "durable", "reason": "y" * 100}), runs=runs)
    assert len(record["line"]) <= lines.BOX_LINE_CHARS
    assert record["line"].endswith("| $10.00 so far since 12-03 22:29 at $2.00/h  ESCALATED -> teardown")
    assert "autostop: gate failed at durable: " in record["line"]


@pytest.mark.parametrize(
    "garbage",
    [{"box": "idle", "autostop": ["armed"]}, {"box": {"idle": "yes", "live_runs": [1]}, "autostop": {"armed": "on"}}],
)
def test_garbage_box_and_autostop_facts_are_named_and_never_escalate(garbage: Dict[str, Any]) -> None:
    record = records.checked("b1", {"state": "done", "escalate": False, **garbage}, "python3")
    billing.escalate(record, 60, 2.0, NOW)
    assert record["reasons"][-1] == "ignored what the box answered for: box, autostop"
    assert (record["escalate"], record["idle_billing"]) == (False, None)
    assert lines.line(record, NOW).startswith("b1  DONE  ")


def test_the_fleet_summary_adds_the_rates_of_the_hosts_that_set_one() -> None:
    paid = [judged(idle_box(), rate=2.0), dict(judged(idle_box(), rate=5.2), host="b2"), judged(rate=None)]
    summary = lines.summary(paid)
    assert summary["hourly_usd_total"] == 7.2 and summary["line"].endswith("; $7.20/h")
    assert lines.summary([judged(rate=None)])["hourly_usd_total"] is None
