"""The load_verify module through its argument spec: a pass, a failure, a hang, check mode and bad options."""

from __future__ import annotations

import math
import sys
import time

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.modules import load_verify

PY = sys.executable


def check(artifact: str, code: str) -> dict:
    return {"artifact": artifact, "argv": [PY, "-c", code]}


def test_every_check_passing_passes(run_module):
    code, result = run_module(load_verify, {"checks": [check("a.pth", "print('ok')"), check("b.pth", "pass")]})
    assert code == 0 and result["changed"] is False
    assert (result["passed"], result["failed_artifacts"], result["reason"]) == (True, [], "2 load check(s) passed")
    assert [c["output_tail"] for c in result["checks"]] == ["ok\n", ""]


def test_a_failing_check_fails_the_gate_not_the_module(run_module):
    failing = check("a.pth", "import sys; print('_pickle.UnpicklingError: invalid load key'); sys.exit(1)")
    code, result = run_module(load_verify, {"checks": [failing]})
    assert code == 0 and result["passed"] is False and result["failed_artifacts"] == ["a.pth"]
    assert "invalid load key" in result["checks"][0]["output_tail"]
    assert result["reason"] == "load check of a.pth exited with 1 (1 of 1 check(s) failed)"


def test_a_hang_times_out(run_module):
    started = time.monotonic()
    _code, result = run_module(
        load_verify, {"checks": [check("a.pth", "import time; time.sleep(300)")], "timeout_s": 1}
    )
    assert time.monotonic() - started < 10
    assert result["passed"] is False and result["checks"][0]["timed_out"] is True
    assert result["checks"][0]["rc"] is None


def test_check_mode_runs_the_checks_too(run_module):
    code, result = run_module(load_verify, {"checks": [check("a.pth", "import sys; sys.exit(2)")]}, check_mode=True)
    assert code == 0 and result["changed"] is False
    assert result["passed"] is False and result["checks"][0]["rc"] == 2


def test_a_missing_program_is_reported_not_raised(run_module):
    code, result = run_module(load_verify, {"checks": [{"artifact": "a.pth", "argv": ["no-such-loader-xyz"]}]})
    assert code == 0 and result["checks"][0]["rc"] == 127
    assert result["checks"][0]["output_tail"] == "program not found: no-such-loader-xyz"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"timeout_s": math.nan}, "timeout_s must be a finite number above 0 and at most 86400, got nan"),
        ({"timeout_s": 0}, "timeout_s must be a finite number above 0 and at most 86400, got 0"),
        ({"timeout_s": math.inf}, "timeout_s must be a finite number above 0 and at most 86400, got inf"),
        ({"output_bytes": -1}, "output_bytes must be an integer between 0 and 1048576, got -1"),
        ({"checks": [{"artifact": "a", "argv": []}]}, "checks[0].argv must be a non-empty list of strings, got []"),
        ({"checks": [{"argv": ["true"]}]}, "missing required arguments: artifact found in checks"),
    ],
)
def test_bad_options_fail_in_one_line_naming_the_option(run_module, args, message):
    code, result = run_module(load_verify, dict({"checks": [check("a", "pass")]}, **args))
    assert code == 1 and result["msg"].startswith(message)
    assert "\n" not in result["msg"]


def test_every_returned_key_is_documented(run_module):
    returned = yaml.safe_load(load_verify.RETURN)
    _code, result = run_module(load_verify, {"checks": [check("a", "pass")]})
    assert set(result) - {"changed", "invocation"} == set(returned)
    assert set(result["checks"][0]) == set(returned["checks"]["contains"])
    options = yaml.safe_load(load_verify.DOCUMENTATION)["options"]
    assert set(options) == set(load_verify.ARGUMENT_SPEC)
    assert set(options["checks"]["suboptions"]) == set(load_verify.CHECK_OPTIONS)
    assert all(options[name].get("default") == spec.get("default") for name, spec in load_verify.ARGUMENT_SPEC.items())
