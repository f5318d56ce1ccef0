"""The meter_stop module through its argument spec, against the fake provider CLI symlinked onto PATH."""

from __future__ import annotations

import math
from typing import Any, Dict

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.modules import meter_stop

RETURNED = set(yaml.safe_load(meter_stop.RETURN))


def args(ident: str = "p1", **options: Any) -> Dict[str, Any]:
    return {
        "command": ["runpodctl", "pod", "stop", ident],
        "status_command": ["runpodctl", "pod", "get", ident],
        "status_key": "desiredStatus",
        "final_states": ["EXITED", "TERMINATED"],
        "gone_pattern": r"(?i)\bpod\b.*\bnot found",
        "timeout_s": 3,
        "poll_interval_s": 0.05,
        **options,
    }


def test_stops_a_running_pod(provider, run_module):
    provider.add("p1")
    code, result = run_module(meter_stop, args())
    assert code == 0 and result["changed"] is True
    assert result["final_state"] == "EXITED" and result["states"] == ["RUNNING", "EXITED"]
    assert RETURNED - {"would_run"} <= set(result)
    assert [argv[2] for argv in provider.calls()] == ["get", "stop", "get"]


def test_a_second_run_is_a_no_op(provider, run_module):
    provider.add("p1")
    run_module(meter_stop, args())
    code, result = run_module(meter_stop, args())
    assert code == 0 and result["changed"] is False and result["already"] is True
    assert [argv[2] for argv in provider.calls()] == ["get", "stop", "get", "get"]


def test_check_mode_runs_nothing(provider, run_module):
    provider.add("p1")
    code, result = run_module(meter_stop, args(), check_mode=True)
    assert code == 0 and result["changed"] is True
    assert result["would_run"] == ["runpodctl", "pod", "stop", "p1"]
    assert set(result) >= RETURNED
    assert provider.calls() == []


def test_a_sticky_stop_fails_with_every_key(provider, run_module):
    provider.add("p1", "--behaviour", "sticky")
    code, result = run_module(meter_stop, args(timeout_s=0.3))
    assert code == 1 and result["failed"] is True
    assert "exited 0 but the instance" in result["msg"] and "is still RUNNING after" in result["msg"]
    assert RETURNED - {"would_run"} <= set(result)
    assert result["command_rc"] == 0 and result["final_state"] is None


def test_vast_destroy_without_yes_fails(provider, run_module):
    provider.add("42")
    options = {
        "command": ["vastai", "destroy", "instance", "42"],
        "status_command": ["vastai", "show", "instance", "42", "--raw"],
        "status_key": "actual_status",
        "final_states": ["exited", "stopped"],
        "gone_pattern": "(?i)not found|no such",
    }
    code, result = run_module(meter_stop, args(timeout_s=0.3, **options))
    assert code == 1 and "is still running after" in result["msg"]
    assert "Aborted" in result["command_output_tail"]


def test_an_empty_instance_id_is_refused_before_anything_runs(provider, run_module):
    code, result = run_module(meter_stop, args(ident=""))
    assert code == 1
    assert result["msg"].startswith("command[3] is empty (runpodctl pod stop ''): is instance_id set for this host?")
    assert "status_command[3] is empty" in result["msg"]
    assert RETURNED - {"would_run"} <= set(result) and result["polls"] == 0
    assert provider.calls() == []


def test_an_empty_instance_id_is_refused_in_check_mode_too(provider, run_module):
    code, result = run_module(meter_stop, args(ident=""), check_mode=True)
    assert code == 1 and "is instance_id set" in result["msg"]


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
        ("gone_pattern", "(", "gone_pattern: invalid regular expression '('"),
        ("status_key", "data..status", "status_key must be a dotted JSON path"),
    ],
)
def test_bad_options_fail_with_one_line_and_run_nothing(provider, run_module, option, value, problem):
    provider.add("p1")
    code, result = run_module(meter_stop, args(**{option: value}))
    assert code == 1 and problem in result["msg"] and "\n" not in result["msg"]
    assert result["polls"] == 0 and result["command_rc"] is None
    assert provider.calls() == []


def test_a_missing_required_option_fails(run_module):
    code, result = run_module(meter_stop, {"command": ["x"]})
    assert code == 1 and "missing required arguments" in result["msg"]


def test_a_missing_cli_fails_and_is_not_gone(provider, run_module, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, result = run_module(meter_stop, args(gone_pattern="(?i)not found"))
    assert code == 1 and result["gone"] is False and result["command_rc"] == 127
    assert "command not found" in result["msg"]
