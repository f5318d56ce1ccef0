"""The patrol action: settings refused before the box is asked, one patrol_facts call with the base Python, and
every outcome (an answer, a failed call, garbage, an unreachable box) one record with its line."""

from __future__ import annotations

from typing import Any, Dict, List, Optional
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleConnectionFailure

from ansible_collections.remote_gpu.trainer.plugins.action.patrol import ActionModule

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
    assert record["line"] == "b1  UNREACHABLE  ssh: connect to host 10.0.0.9: timed out"


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
