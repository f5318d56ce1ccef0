"""A box that answers after a self-stop was restarted: its autostop's stop is older than the container's start, so it
is history. The line says so and whether the watcher is armed again; idle_billing escalates as for any idle box
(issue 29, item 11)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Dict

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_billing as billing
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_record as records
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_states as states
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost

NOW = datetime(2026, 12, 4, 3, 29, 0, tzinfo=timezone.utc)
NOT_ARMED = "not armed (launch with launch_autostop to arm it again)"


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def stopped(watcher_alive: bool = False) -> Dict[str, Any]:
    """The decision the watcher left when it stopped the box at 02:05 (and exited)."""
    return {
        "armed": True, "state": "stopped", "generation": "a1b2c3d4e5f6", "generation_current": True,
        "watcher_alive": watcher_alive, "trigger": "idle", "updated_at": "2026-12-04T02:05:12Z",
        "stop": {"issued_at": "2026-12-04T02:05:09Z", "outcome": "stopped", "final_state": "EXITED"},
    }  # fmt: skip


def judged(booted: datetime, autostop: Dict[str, Any]) -> Dict[str, Any]:
    """A box idle for 2 h 10 min whose container started at ``booted``, judged as the action does."""
    box = {
        "since": iso(NOW - timedelta(hours=5)), "container_started_at": iso(booted), "live_runs": [], "idle": True,
        "idle_since": iso(NOW - timedelta(hours=2, minutes=10)), "runs_done": ["r1"],
    }  # fmt: skip
    answer = {"state": "done", "escalate": False, "headline": "DONE run r1: 1/1 cells done", "box": box,
              "autostop": autostop, "runs": [{"run": "r1", "summary": "r1: done 1/1", "state": "done"}]}  # fmt: skip
    record = records.checked("b1", answer, "python3")
    states.answered_state(record)
    record["cost"] = box_cost(2.0, box["since"], NOW)
    billing.escalate(record, 60, 2.0, NOW)
    record["line"] = lines.line(record, NOW)
    return record


def test_a_stop_older_than_the_boot_is_history_and_idle_billing_escalates() -> None:
    record = judged(NOW - timedelta(minutes=40), stopped())
    piece = f"autostop: stopped the box at 02:05 UTC, restarted since at 02:49 UTC: {NOT_ARMED}"
    assert piece in record["line"]
    assert (record["escalate"], record["problems"], record["box_state"]) == (True, ["idle_billing"], "RUNNING")
    assert record["reasons"][0].endswith(
        "burning $2.00/h: run remote_gpu.trainer.teardown (autostop will not stop it: stopped the box at 02:05 UTC, "
        f"restarted since at 02:49 UTC: {NOT_ARMED})"
    )
    assert record["cost"]["usd"] == 10.0 and "stopped_at" not in record["cost"]  # it bills its GPU rate again


def test_a_watcher_running_again_after_the_restart_is_re_armed() -> None:
    autostop = stopped(watcher_alive=True)
    assert billing.autostop_piece(autostop, NOW, iso(NOW - timedelta(minutes=40))) == (
        "autostop: stopped the box at 02:05 UTC, restarted since at 02:49 UTC: re-armed, its watcher runs again"
    )
    assert billing.will_stop(autostop, iso(NOW - timedelta(minutes=40))) is False


def test_a_stop_newer_than_the_boot_still_holds_idle_billing_back() -> None:
    record = judged(NOW - timedelta(hours=6), stopped())
    assert (record["escalate"], record["problems"], record["box_state"]) == (False, [], "STOPPED")
    assert billing.will_stop(stopped(), iso(NOW - timedelta(hours=6))) is True
    assert billing.will_stop(stopped()) is True  # a boot time unknown: the stop stands
