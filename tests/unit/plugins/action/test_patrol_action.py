"""The patrol action: settings refused before the box is asked, one patrol_facts call with the base Python, and
every outcome (an answer, a failed call, garbage, an unreachable box) one record with its line."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, List, Optional
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleConnectionFailure

from ansible_collections.remote_gpu.trainer.plugins.action.patrol import ActionModule
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_notify import notify

FACTS = {
    "state": "running", "escalate": False, "reasons": [], "problems": [], "actions": [], "run": "alpha",
    "headline": "RUNNING run alpha: 1/3 cells done", "cells_done": 1, "cells_total": 3, "alive": 2,
    "runs": [{"run": "alpha", "summary": "alpha: 1/3 done, 2 running"}], "examined_runs": ["alpha"],
    "disks": [{"name": "data", "path": "/data", "bytes_used_pct": 40.0, "inodes_used_pct": 3.0}],
    "gpu": [{"index": 0, "utilization_pct": 97.0}],
}  # fmt: skip


def patrol(
    args: Dict[str, Any], task_vars: Optional[Dict[str, Any]] = None, answer: Any = None, calls: Optional[List] = None
) -> Dict[str, Any]:
    task = MagicMock(args=args, async_val=0, check_mode=False, action="remote_gpu.trainer.patrol")
    connection = MagicMock()
    action = ActionModule(task, connection, MagicMock(), loader=None, templar=None, shared_loader_obj=None)

    def execute(module_name: str, module_args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        if calls is not None:
            calls.append((module_name, module_args, task_vars.get("ansible_python_interpreter")))
        if isinstance(answer, Exception):
            raise answer
        return answer

    action._execute_module = execute  # type: ignore[method-assign]
    action._remove_tmp_path = MagicMock()  # type: ignore[method-assign]
    return action.run(task_vars={"inventory_hostname": "b1", **(task_vars or {})})


def test_one_call_with_the_base_python_never_the_venv_under_the_data_dir() -> None:
    calls: List = []
    record = patrol({"data_dir": "/data"}, {"ansible_python_interpreter": "/usr/bin/python3.10"}, dict(FACTS), calls)
    assert len(calls) == 1
    name, module_args, python = calls[0]
    assert (name, python) == ("remote_gpu.trainer.patrol_facts", "/usr/bin/python3.10")
    assert module_args["venv"] == "/data/.remote_gpu_trainer/venv" and "python" not in module_args
    assert "run" not in module_args  # empty: every run
    assert record["status"] == "RUNNING" and record["python"] == "/usr/bin/python3.10"
    assert record["line"].startswith("b1  RUNNING  alpha: 1/3 done, 2 running | disk data 40%/3% inodes, gpu 97%")
    assert not record.get("failed")


@pytest.mark.parametrize(
    ("configured", "given", "expected"),
    [
        ("auto_silent", "", "python3"),
        (None, "", "python3"),
        ("/opt/py/bin/python", "/usr/bin/python3", "/usr/bin/python3"),
    ],
)
def test_the_interpreter_is_patrol_python_else_a_named_one_else_python3(configured, given, expected) -> None:
    calls: List = []
    task_vars = {"ansible_python_interpreter": configured} if configured else {}
    patrol({"data_dir": "/data", "python": given}, task_vars, dict(FACTS), calls)
    assert calls[0][2] == expected


def test_bad_settings_and_a_misspelt_variable_are_one_escalated_record_before_any_call() -> None:
    calls: List = []
    record = patrol(
        {"data_dir": "data", "stall_after_s": 0, "run": "bad name"}, {"patrol_stal_after_s": 5}, dict(FACTS), calls
    )
    assert calls == []
    assert (record["state"], record["escalate"], record["problems"]) == ("unknown", True, ["patrol_error"])
    reason = record["reasons"][0]
    assert "patrol_stal_after_s is not a variable of this stage (did you mean patrol_stall_after_s?)" in reason
    assert "patrol_data_dir must be an absolute path" in reason
    assert "patrol_stall_after_s must be at least 1" in reason
    assert "patrol_run must be empty or a run name" in reason
    assert not record.get("failed")  # the report lists the box; the verdict step fails it


def test_a_wrong_type_names_the_role_variable() -> None:
    record = patrol({"data_dir": "/data", "timeout_s": "soon"}, answer=dict(FACTS))
    assert record["reasons"] == ["patrol_timeout_s must be a float, not a str"]


def test_an_unreachable_box_is_an_unreachable_record() -> None:
    record = patrol({"data_dir": "/data"}, answer=AnsibleConnectionFailure("ssh: connect to host 10.0.0.9: timed out"))
    assert (record["status"], record["reachable"], record["escalate"]) == ("UNREACHABLE", False, False)
    assert record["line"] == (
        "b1  UNREACHABLE  ssh: connect to host 10.0.0.9: timed out; the provider was not asked: no status command to "
        "ask it with (meter_stop_verb is none)"
    )
    assert record["box_state"] == "UNREACHABLE"


def test_a_failed_call_names_the_python_and_the_error() -> None:
    record = patrol(
        {"data_dir": "/data", "run": "alpah"}, answer={"failed": True, "msg": "run alpah is not on this box"}
    )
    assert (record["state"], record["problems"], record["run_filter"]) == ("unknown", ["patrol_failed"], "alpah")
    assert record["reasons"] == ["patrol_facts failed with python3: run alpah is not on this box"]


def test_a_missing_interpreter_says_which_variable_to_set() -> None:
    record = patrol(
        {"data_dir": "/data"}, answer={"failed": True, "rc": 127, "module_stderr": "/bin/sh: python3: not found"}
    )
    assert "no such Python on the box (set patrol_python" in record["reasons"][0]


@pytest.mark.parametrize("garbage", [{"state": "exploded", "escalate": "yes"}, {"state": "running", "escalate": 1}])
def test_garbage_from_the_box_is_unknown_and_escalated(garbage: Dict[str, Any]) -> None:
    record = patrol({"data_dir": "/data"}, answer=garbage)
    assert record["escalate"] is True and record["state"] in ("unknown", garbage["state"])
    assert record["problems"][0] == "patrol_invalid"
    assert record["reasons"][0].startswith("the box's patrol_facts answer is not usable")


def test_the_cron_playbooks_variables_in_group_vars_are_not_typos() -> None:
    calls: List = []
    record = patrol({"data_dir": "/data"}, {"patrol_cron_inventory": "/srv/rentals.ini"}, dict(FACTS), calls)
    assert len(calls) == 1 and record["state"] == "running"


def idle_facts(idle_for: timedelta) -> Dict[str, Any]:
    """A box whose one run is DONE, idle since ``idle_for`` ago, with no autostop armed."""
    now = datetime.now(timezone.utc)
    stamp = (now - idle_for).strftime("%Y-%m-%dT%H:%M:%SZ")
    box = {"since": stamp, "live_runs": [], "idle": True, "idle_since": stamp, "runs_done": ["alpha"]}
    autostop = {"armed": False, "state": None}
    return dict(FACTS, state="done", headline="DONE run alpha: 3/3 cells done", box=box, autostop=autostop)


def test_an_idle_box_escalates_idle_billing_once_across_two_ticks(tmp_path) -> None:
    options = {"state_file": str(tmp_path / "state.json"), "webhook_url": "", "timeout_s": 5}
    facts = idle_facts(timedelta(hours=2, minutes=10, seconds=5))
    first = patrol({"data_dir": "/data"}, {"hourly_usd": 2}, facts)
    assert (first["status"], first["escalate"], first["problems"]) == ("DONE", True, ["idle_billing"])
    assert first["reasons"][0].startswith("idle_billing: no live run for 2 h 10 min (runs alpha DONE); burning $2.00/h")
    assert first["cost"]["hourly_usd"] == 2.0 and first["idle_billing"]["hourly_usd"] == 2.0
    assert re.search(r"\| \$4\.34 so far since \d\d-\d\d \d\d:\d\d at \$2\.00/h  ESCALATED -> teardown$", first["line"])
    second = patrol({"data_dir": "/data"}, {"hourly_usd": 2}, facts)
    sent = [notify([record], options, str(tmp_path), "2026-12-04T03:00:00Z", False) for record in (first, second)]
    assert sum(text.startswith("not sent") and "new: idle_billing" in text for text in sent[0]) == 1
    assert sent[1] == ["notifications: none due (no new problem, nothing cleared)"]


def test_idle_billing_minutes_stays_on_the_controller_and_null_turns_it_off() -> None:
    calls: List = []
    record = patrol({"data_dir": "/data", "idle_billing_minutes": None}, {}, idle_facts(timedelta(days=2)), calls)
    assert "idle_billing_minutes" not in calls[0][1]
    assert (record["escalate"], record["idle_billing"], record["cost"]) == (False, None, None)
    longer = patrol({"data_dir": "/data", "idle_billing_minutes": "3000"}, {}, idle_facts(timedelta(hours=49)))
    assert longer["escalate"] is False and longer["idle_billing"]["idle_s"] >= 49 * 3600  # whole seconds: may be equal


@pytest.mark.parametrize("minutes", [0, -5, "soon", True])
def test_a_bad_idle_billing_minutes_names_the_variable(minutes: Any) -> None:
    calls: List = []
    record = patrol({"data_dir": "/data", "idle_billing_minutes": minutes}, answer=dict(FACTS), calls=calls)
    assert calls == [] and record["problems"] == ["patrol_error"]
    assert record["reasons"][0].startswith("patrol_idle_billing_minutes must be a number of minutes above 0")


def test_a_bad_hourly_usd_is_a_warning_on_the_line_and_patrol_still_reports() -> None:
    calls: List = []
    record = patrol({"data_dir": "/data"}, {"hourly_usd": "abc"}, dict(FACTS), calls)
    assert len(calls) == 1 and not record.get("failed")
    assert (record["status"], record["escalate"], record["cost"]) == ("RUNNING", False, None)
    assert record["cost_warning"] == "hourly_usd: must be a number of US dollars per hour (>= 0), not 'abc'"
    assert record["line"].endswith(
        "gpu 97% | cost unknown: hourly_usd: must be a number of US dollars per hour (>= 0), not 'abc'"
    )


def test_an_unreachable_box_still_shows_what_it_costs_per_hour() -> None:
    record = patrol({"data_dir": "/data"}, {"hourly_usd": 1.5}, AnsibleConnectionFailure("ssh: timed out"))
    assert record["line"].startswith("b1  UNREACHABLE  ssh: timed out; the provider was not asked: ")
    assert record["line"].endswith(" | $1.50/h")
