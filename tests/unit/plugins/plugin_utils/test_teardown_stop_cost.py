"""Teardown's cost ends at the stop: the meter-stop it ran (its time kept in the record, which patrol reads), or, for
a box already stopped and silent, the stop of ours the controller's reports know; storage bills after it (issue 29,
item 7)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import parse_since
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._report import write_report
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.plugin_utils.test_teardown_flow import (
    FakeAction,
    gate,
    run,
    scratch_answer,
    teardown,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import Provider


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_the_meter_stop_teardown_ran_is_the_costs_end_and_storage_bills_after(provider: Provider) -> None:
    provider.add("pod-1")
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, {"hourly_usd": 2.5, "hourly_usd_stopped": "0.02"}, confirm="b1")
    before = datetime.now(timezone.utc)
    assert run(flow) == ("TORN_DOWN", None, "")
    cost = flow.record["cost"]
    stopped = parse_since(cost["stopped_at"])
    assert stopped is not None and before - timedelta(seconds=1) <= stopped <= datetime.now(timezone.utc)
    assert (cost["hourly_usd_stopped"], cost["meter_stopped"]) == (0.02, True)


def test_a_silent_box_stopped_by_its_autostop_costs_up_to_that_stop(provider: Provider, tmp_path: Path) -> None:
    """The box stopped itself an hour ago; a teardown now must not count the GPU rate to its own end."""
    provider.add("pod-1", "--status", "exited")
    now = datetime.now(timezone.utc)
    stop = now - timedelta(hours=1)
    autostop = {
        "armed": True, "state": "stopped", "generation_current": True,
        "stop": {"issued_at": iso(stop), "outcome": "stopped"},
    }  # fmt: skip
    box = {"since": iso(now - timedelta(hours=4)), "container_started_at": iso(now - timedelta(hours=4))}
    seen = {"host": "b1", "state": "done", "reachable": True, "box": box, "autostop": autostop}
    write_report(str(tmp_path), "patrol", {"generated_at": iso(stop - timedelta(minutes=5)), "hosts": [seen]})
    host_vars = {"hourly_usd": 2.0, "hourly_usd_stopped": 0.01, "teardown_report_dir": str(tmp_path)}
    flow = teardown(FakeAction({}), host_vars)
    assert flow.provider_state().startswith("the provider says instance pod-1 is EXITED")
    cost = flow.record["cost"]
    assert cost["hours"] == pytest.approx(3.0, abs=0.01) and cost["usd"] == 6.01
    assert cost["stopped_at"] == iso(stop)
    assert flow.record["meter_stop"]["stopped_by"] == "autostop"
