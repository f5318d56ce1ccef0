"""The meter_stop module through its argument spec, against the fake provider CLI symlinked onto PATH."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any, Dict

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.modules import meter_stop
from ansible_collections.remote_gpu.trainer.tests.workload.harness import FAKE_PROVIDER

RETURNED = set(yaml.safe_load(meter_stop.RETURN))
ALWAYS = RETURNED - {"would_run", "manual_steps"}
LIST_PODS = ["runpodctl", "pod", "list", "--all", "--output", "json"]


def verbs(ident: str = "p1") -> Dict[str, Any]:
    status = {"command": LIST_PODS, "list": "", "id": ident, "state_key": "desiredStatus"}
    return {
        "stop": {
            "command": ["runpodctl", "pod", "stop", ident],
            "status": status,
            "final_states": ["EXITED"],
            "survives": ["data_dir", "durable_dir"],
            "irreversible": False,
        },
        "delete": {
            "command": ["runpodctl", "pod", "delete", ident],
            "status": status,
            "final_states": ["TERMINATED"],
            "survives": [],
            "irreversible": True,
        },
        "shutdown": {"manual_steps": ["Console -> Stop"], "survives": ["data_dir"], "irreversible": False},
    }


def args(verb: str = "stop", ident: str = "p1", **options: Any) -> Dict[str, Any]:
    return {"verbs": verbs(ident), "verb": verb, "timeout_s": 3, "poll_interval_s": 0.05, **options}


def test_stops_a_running_pod(provider, run_module):
    provider.add("p1")
    code, result = run_module(meter_stop, args())
    assert code == 0 and result["changed"] is True and result["verb"] == "stop"
    assert result["final_state"] == "EXITED" and result["states"] == ["RUNNING", "EXITED"]
    assert set(result) >= ALWAYS
    assert [argv[2] for argv in provider.calls()] == ["list", "stop", "list"]


def test_delete_ends_gone(provider, run_module):
    provider.add("p1")
    code, result = run_module(meter_stop, args("delete"))
    assert code == 0 and result["gone"] is True and provider.instances() == {}


def test_a_second_run_is_a_no_op(provider, run_module):
    provider.add("p1")
    run_module(meter_stop, args())
    code, result = run_module(meter_stop, args())
    assert code == 0 and result["changed"] is False and result["already"] is True
    assert [argv[2] for argv in provider.calls()] == ["list", "stop", "list", "list"]


def test_a_box_that_answered_refuses_a_stopped_pod_as_a_stale_id(provider, run_module):
    # delete's final state is TERMINATED, but stop declares EXITED: a stopped pod, not the box that answered.
    provider.add("p1", "--status", "exited")
    code, result = run_module(meter_stop, args("delete", box_answered=True))
    assert code == 1 and result["stale_id"] is True and set(result) >= ALWAYS
    assert "instance p1 is already EXITED, yet the box answered" in result["msg"]
    assert provider.calls() == [LIST_PODS] and provider.instances()["p1"]["status"] == "exited"
    code, result = run_module(meter_stop, args("delete"))  # without box_answered: deleting a stopped pod is fine
    assert code == 0 and result["stale_id"] is False and provider.instances() == {}


def test_check_mode_runs_nothing(provider, run_module):
    provider.add("p1")
    code, result = run_module(meter_stop, args(), check_mode=True)
    assert code == 0 and result["changed"] is True
    assert result["would_run"] == ["runpodctl", "pod", "stop", "p1"]
    assert set(result) >= RETURNED - {"manual_steps"} and provider.calls() == []


def test_a_sticky_stop_fails_with_every_key(provider, run_module):
    provider.add("p1", "--behaviour", "sticky")
    code, result = run_module(meter_stop, args(timeout_s=0.3))
    assert code == 1 and result["failed"] is True
    assert "exited 0 but the instance" in result["msg"] and "is still RUNNING after" in result["msg"]
    assert set(result) >= ALWAYS and result["command_rc"] == 0 and result["final_state"] is None


def test_a_failing_status_cli_fails_and_is_not_gone(provider, run_module):
    provider.add("p1")
    provider.add("other")
    fault = [sys.executable, str(FAKE_PROVIDER), "set", "--state", str(provider.state), "--status-fault", "traceback"]
    subprocess.run(fault, check=True)
    code, result = run_module(meter_stop, args("delete", timeout_s=0.2))
    assert code == 1 and result["gone"] is False and result["states"] == ["unknown"]
    assert result["status_error"].startswith("exited 1: FileNotFoundError: [Errno 2] No such file or directory")


def test_an_empty_instance_id_is_refused_before_anything_runs(provider, run_module):
    code, result = run_module(meter_stop, args(ident=""))
    assert code == 1
    assert result["msg"] == (
        "meter_stop_verbs.stop.command[3] is empty (runpodctl pod stop ''): is instance_id set for this host?"
    )
    assert set(result) >= ALWAYS and result["polls"] == 0 and provider.calls() == []


def test_an_empty_instance_id_is_refused_in_check_mode_too(provider, run_module):
    code, result = run_module(meter_stop, args(ident=""), check_mode=True)
    assert code == 1 and "is instance_id set" in result["msg"]


def test_a_misspelt_verb_names_the_closest(run_module):
    code, result = run_module(meter_stop, args("stp"))
    assert code == 1 and result["msg"].endswith("did you mean 'stop'?") and set(result) >= ALWAYS


def test_a_verb_done_by_hand_fails_with_its_steps(provider, run_module):
    code, result = run_module(meter_stop, args("shutdown"))
    assert code == 1 and result["manual_steps"] == ["Console -> Stop"]
    assert result["msg"] == "meter_stop_verb shutdown is done by hand: Console -> Stop" and provider.calls() == []


def test_verb_none_stops_nothing(provider, run_module):
    code, result = run_module(meter_stop, args("none"))
    assert code == 0 and result["changed"] is False and result["command"] == [] and provider.calls() == []


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("timeout_s", math.nan, "timeout_s must be a finite number between 0 and 86400, got nan"),
        ("timeout_s", math.inf, "timeout_s must be a finite number between 0 and 86400, got inf"),
        ("timeout_s", -1, "timeout_s must be a finite number between 0 and 86400, got -1"),
        ("poll_interval_s", 0, "poll_interval_s must be a finite number above 0 and at most 3600, got 0"),
        ("poll_interval_s", math.nan, "poll_interval_s must be a finite number above 0 and at most 3600, got nan"),
        ("command_timeout_s", math.inf, "command_timeout_s must be a finite number above 0 and at most 3600, got"),
        ("command_timeout_s", 0, "command_timeout_s must be a finite number above 0 and at most 3600, got 0"),
    ],
)
def test_bad_timeouts_fail_with_one_line_and_run_nothing(provider, run_module, option, value, problem):
    provider.add("p1")
    code, result = run_module(meter_stop, args(**{option: value}))
    assert code == 1 and problem in result["msg"] and "\n" not in result["msg"]
    assert result["polls"] == 0 and result["command_rc"] is None and provider.calls() == []


def test_a_bad_declaration_fails_with_one_line(provider, run_module):
    options = args()
    options["verbs"]["stop"]["status"]["state_key"] = "data..status"
    code, result = run_module(meter_stop, options)
    assert code == 1 and result["msg"].startswith("meter_stop_verbs.stop.status.state_key must be a dotted JSON path")
    assert provider.calls() == []


def test_a_missing_required_option_fails(run_module):
    code, result = run_module(meter_stop, {"verb": "stop"})
    assert code == 1 and "missing required arguments: verbs" in result["msg"]


def test_a_missing_cli_fails_and_is_not_gone(provider, run_module, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, result = run_module(meter_stop, args())
    assert code == 1 and result["gone"] is False and result["command_rc"] == 127
    assert "command not found" in result["msg"]
