"""Patrol's words: one line per box with a compact summary per run, the reasons indented, the fleet's summary."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_record as records


def record(**facts: Any) -> Dict[str, Any]:
    answer = {"state": "running", "escalate": False, **facts}
    made = records.checked("b1", answer, "python3")
    return dict(made, line=lines.line(made))


def test_a_box_with_two_runs_shows_the_headline_and_each_runs_summary() -> None:
    made = record(
        state="stalled", escalate=True, actions=["investigate"], problems=["stalled:alpha/c"],
        headline="STALLED run alpha: 2/4 cells done",
        reasons=["alpha/c: alive but its log has not grown for 1900 s (stall_after_s 1800)"],
        runs=[{"run": "alpha", "summary": "alpha: 2/4 done, 1 running, 1 stalled (c)"},
              {"run": "beta", "summary": "beta: done 1/1"}],
        disks=[{"name": "data", "bytes_used_pct": 41.2, "inodes_used_pct": 3}],
        gpu=[{"index": 0, "utilization_pct": 99}, {"index": 1, "utilization_pct": 0}],
    )  # fmt: skip
    assert made["line"] == (
        "b1  STALLED  run alpha: 2/4 cells done | alpha: 2/4 done, 1 running, 1 stalled (c); beta: done 1/1"
        " | disk data 41%/3% inodes, gpu 99% 0%  ESCALATED -> investigate"
    )
    assert lines.lines(made) == [
        made["line"],
        "    alpha/c: alive but its log has not grown for 1900 s (stall_after_s 1800)",
    ]


def test_skipped_and_archived_runs_are_counted_on_the_line() -> None:
    made = record(state="done", runs=[{"run": "r", "summary": "r: done 2/2"}], runs_skipped=140, runs_archived=3)
    assert "r: done 2/2; 140 finished runs not patrolled (over the cap); 3 archived" in made["line"]


def test_reasons_past_eight_point_to_the_report() -> None:
    made = record(reasons=[f"reason {n}" for n in range(11)])
    shown = lines.lines(made)
    assert shown[1:9] == [f"    reason {n}" for n in range(8)]
    assert shown[9] == "    (+3 more reasons in the report)"


def test_an_unreachable_box_says_only_its_owner_sees_the_console() -> None:
    made = records.unreachable("b2", "ssh: connect to host b2 port 22: Connection refused")
    assert lines.lines(made) == [
        "b2  UNREACHABLE  ssh: connect to host b2 port 22: Connection refused",
        f"    {records.CONSOLE_ADVICE} (re-rent when it is gone)",
    ]


@pytest.mark.parametrize(
    "garbage",
    [
        {"state": "running", "escalate": False, "runs": "many", "gpu": [1, None], "disks": {"a": 1}, "headline": 7},
        {"state": "running", "escalate": False, "reasons": "not a list", "cells_total": float("nan"), "eta_s": -3},
    ],
)
def test_garbage_fields_are_named_and_never_break_the_line(garbage: Dict[str, Any]) -> None:
    made = records.checked("b1", garbage, "python3")
    text = lines.line(made)
    assert text.startswith("b1  RUNNING  ")
    assert made["reasons"][-1].startswith("ignored what the box answered for: ")
    assert made["escalate"] is False


def test_problem_ids_the_notifier_cannot_key_on_are_dropped_and_named() -> None:
    made = records.checked("b1", {"state": "crashed", "escalate": True, "problems": ["crashed:a", "x y\n"]}, None)
    assert made["problems"] == ["crashed:a"]
    assert "problem id 'x y'" in made["reasons"][-1]


def test_an_escalation_without_a_problem_id_gets_one() -> None:
    made = records.checked("b1", {"state": "unknown", "escalate": False}, None)
    assert (made["escalate"], made["problems"]) == (True, ["escalated:unknown"])


def test_summary_counts_states_escalations_re_rent_and_unreachable() -> None:
    fleet = [
        record(),
        record(state="crashed", escalate=True, actions=["re_rent"], problems=["gpu_lost:1"]),
        records.unreachable("b3", "timed out"),
    ]
    fleet[1]["host"] = "b2"
    summary = lines.summary(fleet)
    assert summary["line"] == (
        "3 hosts: 1 crashed, 1 running, 1 unreachable; escalated: b2 (crashed -> re_rent); re-rent: b2; unreachable: b3"
    )
    assert (summary["escalated"], summary["unreachable"]) == (["b2"], ["b3"])


@pytest.mark.parametrize(
    ("seconds", "shown"), [(40, "40s"), (720, "12m"), (3 * 3600 + 300, "3h05m"), (93600, "1d2h"), (None, "?")]
)
def test_durations(seconds: Any, shown: str) -> None:
    assert lines.fmt_duration(seconds) == shown


def test_the_state_is_said_once_and_one_runs_summary_stands_for_the_headline() -> None:
    idle = record(state="idle", headline="IDLE: no run on this box")
    assert idle["line"].startswith("b1  IDLE  no run on this box | disk ")
    one = record(
        state="done",
        headline="DONE run demo: 2/2 cells done",
        runs=[{"run": "demo", "summary": "demo: done, 2/2 done"}],
    )
    assert one["line"].startswith("b1  DONE  demo: done, 2/2 done | disk ")


def test_a_run_state_other_than_the_boxes_is_said_by_the_one_runs_summary() -> None:
    made = record(
        state="disk_pressure", escalate=True, actions=["free_disk"], problems=["disk_pressure:data"],
        headline="RUNNING run train-disk: 0/2 cells done (cell_failed:train-disk/fill)",
        runs=[{"run": "train-disk", "summary": "train-disk: running, 0/2 done, 1 failed (fill)"}],
    )  # fmt: skip
    assert made["line"].startswith("b1  DISK_PRESSURE  train-disk: running, 0/2 done, 1 failed (fill) | disk ")
