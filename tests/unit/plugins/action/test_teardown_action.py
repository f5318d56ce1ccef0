"""The teardown action refuses a box at validate, naming the role variable, before it touches the box."""

from __future__ import annotations

from typing import Any, Dict
from unittest.mock import MagicMock

from ansible.template import trust_as_template
from ansible.vars.hostvars import HostVarsVars

from ansible_collections.remote_gpu.trainer.plugins.action.teardown import ActionModule, warnings_of
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._teardown_peers import shared_instance_id
from ansible_collections.remote_gpu.trainer.tests.workload.harness import runpod_stop_verb


def refused(args: Dict[str, Any], task_vars: Dict[str, Any] | None = None, host: str = "b1") -> Dict[str, Any]:
    task = MagicMock(args=args, async_val=0, check_mode=False, action="remote_gpu.trainer.teardown")
    connection = MagicMock()
    action = ActionModule(task, connection, MagicMock(), loader=None, templar=None, shared_loader_obj=None)
    result = action.run(task_vars={"inventory_hostname": host, **(task_vars or {})})
    assert connection.exec_command.call_count == 0  # nothing ran on the box
    return result


def test_a_bad_type_and_a_missing_run_name_the_role_variables() -> None:
    result = refused({"data_dir": "/data", "stop_grace_s": "abc"})
    assert (result["status"], result["step"]) == ("REFUSED", "validate")
    assert (
        result["reason"] == "missing required arguments: teardown_run; teardown_stop_grace_s must be a float, not a str"
    )
    assert not result.get("failed")  # the report lists the box; the verdict step fails it


def test_a_misspelt_variable_and_a_bad_setting_are_told_together() -> None:
    result = refused({"runs": "r1", "data_dir": "data"}, {"teardown_pul_to": "/x"})
    assert result["step"] == "validate"
    assert "teardown_pul_to is not a variable of this stage (did you mean teardown_pull_to?)" in result["reason"]
    assert "teardown_data_dir (the profile's data_dir) must be an absolute path" in result["reason"]
    assert result["line"].startswith("b1  REFUSED  runs r1 at validate: ")


def test_a_refused_box_tells_its_rate_and_a_bad_rate_is_a_warning_not_a_refusal() -> None:
    result = refused({"runs": "r1", "data_dir": "data"}, {"hourly_usd": 2.5})
    assert result["cost"] == {"hourly_usd": 2.5, "since": None, "hours": None, "usd": None}
    assert result["line"].endswith("; $2.50/h") and result["warnings"] == []
    bad = refused({"runs": "r1", "data_dir": "data"}, {"hourly_usd": "2,50"})
    assert bad["cost"] is None and "/h" not in bad["line"]
    assert bad["warnings"] == ["hourly_usd: must be a number of US dollars per hour (>= 0), not '2,50'"]
    assert "hourly_usd" not in bad["reason"]  # refused for its data_dir only


def test_a_box_clock_ahead_of_ours_is_a_cost_warning() -> None:
    cost = {"hourly_usd": 1.0, "since": "x", "hours": 0.0, "usd": 0.0, "note": "clock: the box's start is ahead"}
    record = {"host": "b1", "status": "TORN_DOWN", "cost": cost}
    assert warnings_of(record) == ["cost: clock: the box's start is ahead"]


def stopping(instance_id: str) -> Dict[str, Any]:
    verb = runpod_stop_verb(instance_id)
    return {"runs": "r1", "data_dir": "/data", "meter_stop_verb": "stop", "meter_stop_verbs": {"stop": verb}} | {
        "instance_id": instance_id,
        "platform": "runpod",
    }


def test_two_hosts_of_the_play_with_one_instance_id_are_both_refused_each_naming_the_other() -> None:
    # b2's id is a template: what counts is its value for b2, as hostvars renders it.
    b2 = HostVarsVars({"instance_id": trust_as_template("{{ pod }}"), "pod": "pod-1", "platform": "runpod"}, None, "b2")
    hostvars = {"b1": {"instance_id": "pod-1", "platform": "runpod"}, "b2": b2, "b3": {"instance_id": "pod-3"}}
    play = {"ansible_play_hosts_all": ["b1", "b2", "b3"], "hostvars": hostvars}
    first = refused(stopping("pod-1"), play, host="b1")
    second = refused(stopping("pod-1"), play, host="b2")
    assert (first["status"], first["step"], second["status"], second["step"]) == (
        "REFUSED", "instance_id", "REFUSED", "instance_id",
    )  # fmt: skip
    assert first["reason"].startswith("instance_id pod-1 is also the instance_id of b2 in this play")
    assert second["reason"].startswith("instance_id pod-1 is also the instance_id of b1 in this play")
    assert first["line"].startswith("b1  REFUSED  runs r1 at instance_id: ") and "gate" not in first


def test_the_same_id_on_another_platform_or_without_a_meter_stop_is_no_clash() -> None:
    vast = {"instance_id": "pod-1", "platform": "vastai"}
    play = {"ansible_play_hosts_all": ["b1", "b2"], "hostvars": {"b1": {}, "b2": vast}}
    result = refused(dict(stopping("pod-1"), data_dir="data"), play)
    assert result["step"] == "validate" and "instance_id" not in result["reason"]
    assert shared_instance_id(play, "b1", "pod-1", "runpod") is None
    clash = shared_instance_id(play, "b1", "pod-1", "vastai")
    assert clash is not None and clash == shared_instance_id(play, "b1", "pod-1", "")  # no platform: any
