"""meter_stop's flow against the real fake provider CLI (tests/workload/fake_provider.py) run as the runner.

The fake is symlinked as ``runpodctl`` and ``vastai`` into a bin folder on PATH; its state file and calls file are
the tests' independent view of what ran. Parsing and the deadline arithmetic are tested directly with injected
runners and clocks.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _meter_stop
from ansible_collections.remote_gpu.trainer.plugins.module_utils._meter_stop import (
    MeterStopError,
    meter_stop,
    plan_from,
    read_state,
)

RESULT_KEYS = {
    "command",
    "final_state",
    "gone",
    "already",
    "polls",
    "states",
    "command_rc",
    "command_output_tail",
    "status_output_tail",
    "msg",
}


FAST = {"timeout_s": 3.0, "poll_interval_s": 0.05, "command_timeout_s": 10.0}


def runpod(ident: str = "p1", verb: str = "stop", **options: Any) -> Dict[str, Any]:
    return {
        **FAST,
        "command": ["runpodctl", "pod", verb, ident],
        "status_command": ["runpodctl", "pod", "get", ident],
        "status_key": "desiredStatus",
        "final_states": ["EXITED", "TERMINATED"],
        "gone_pattern": r"(?i)\bpod\b.*\bnot found",
        **options,
    }


def vast(ident: str = "42", command: Any = None, **options: Any) -> Dict[str, Any]:
    return {
        **FAST,
        "command": command or ["vastai", "stop", "instance", ident],
        "status_command": ["vastai", "show", "instance", ident, "--raw"],
        "status_key": "actual_status",
        "final_states": ["exited", "stopped"],
        "gone_pattern": "(?i)not found|no such",
        **options,
    }


def test_stop_runs_once_and_polls_to_exited(provider):
    provider.add("p1", "--status", "RUNNING")
    changed, result = meter_stop(plan_from(runpod()), check_mode=False)
    assert changed is True
    assert set(result) == RESULT_KEYS
    assert (result["final_state"], result["gone"], result["already"]) == ("EXITED", False, False)
    assert result["states"] == ["RUNNING", "EXITED"] and result["polls"] == 2
    assert result["command_rc"] == 0 and 'pod "p1" stopped' in result["command_output_tail"]
    assert '"desiredStatus": "EXITED"' in result["status_output_tail"]
    get = ["runpodctl", "pod", "get", "p1"]
    assert provider.calls() == [get, ["runpodctl", "pod", "stop", "p1"], get]
    assert provider.instances()["p1"]["status"] == "exited"


def test_a_slow_provider_is_polled_until_final_and_states_are_deduped(provider):
    provider.add("p1", "--settle-polls", "2")
    _changed, result = meter_stop(plan_from(runpod()), check_mode=False)
    assert result["states"] == ["RUNNING", "EXITED"]
    assert result["polls"] == 4  # before the command, twice still RUNNING, then EXITED
    assert [argv[2] for argv in provider.calls()].count("stop") == 1


def test_an_already_stopped_instance_is_left_alone(provider):
    provider.add("p1", "--status", "exited")
    changed, result = meter_stop(plan_from(runpod()), check_mode=False)
    assert changed is False and result["already"] is True
    assert result["final_state"] == "EXITED" and result["command_rc"] is None
    assert provider.calls() == [["runpodctl", "pod", "get", "p1"]]
    assert "was not run" in result["msg"]


def test_an_already_gone_pod_counts_as_done_and_runs_nothing(provider):
    changed, result = meter_stop(plan_from(runpod("nope", verb="delete")), check_mode=False)
    assert changed is False
    assert (result["gone"], result["already"], result["final_state"]) == (True, True, None)
    assert result["states"] == ["gone"] and "pod nope not found" in result["status_output_tail"]
    assert provider.calls() == [["runpodctl", "pod", "get", "nope"]]


def test_a_sticky_stop_that_exits_0_fails_loudly_after_the_deadline(provider):
    provider.add("p1", "--behaviour", "sticky")
    with pytest.raises(MeterStopError) as failed:
        meter_stop(plan_from(runpod(timeout_s=0.3)), check_mode=False)
    result = failed.value.result
    assert "exited 0 but the instance (runpodctl pod get p1) is still RUNNING after" in str(failed.value)
    assert result["msg"] == str(failed.value) and set(result) == RESULT_KEYS
    assert result["command_rc"] == 0 and result["states"] == ["RUNNING"] and result["polls"] >= 3
    assert result["final_state"] is None and result["gone"] is False
    assert provider.instances()["p1"]["status"] == "running"


def test_vast_destroy_without_yes_aborts_with_0_and_is_caught(provider):
    provider.add("42")
    command = ["vastai", "destroy", "instance", "42"]
    with pytest.raises(MeterStopError, match=r"exited 0 but .* is still running after"):
        meter_stop(plan_from(vast(command=command, timeout_s=0.3)), check_mode=False)
    assert "42" in provider.instances()
    assert command in provider.calls()


def test_vast_destroy_with_yes_ends_gone_which_counts_as_done(provider):
    provider.add("42", "--settle-polls", "1")
    changed, result = meter_stop(plan_from(vast(command=["vastai", "destroy", "instance", "42", "-y"])), False)
    assert changed is True
    assert (result["gone"], result["final_state"], result["already"]) == (True, None, False)
    assert result["states"] == ["running", "gone"]
    assert "instance 42 not found" in result["status_output_tail"]
    assert provider.instances() == {}


def test_vast_stop_polls_to_exited(provider):
    provider.add("42")
    _changed, result = meter_stop(plan_from(vast()), check_mode=False)
    assert result["final_state"] == "exited" and result["states"] == ["running", "exited"]


def test_runpod_delete_ends_gone(provider):
    provider.add("p1")
    changed, result = meter_stop(plan_from(runpod(verb="delete")), check_mode=False)
    assert changed is True and result["gone"] is True and provider.instances() == {}


def test_garbage_status_output_is_unknown_and_fails_with_its_tail(provider):
    provider.add("p1", "--print", "<html>502 Bad Gateway</html>")
    with pytest.raises(MeterStopError, match="is still unknown after") as failed:
        meter_stop(plan_from(runpod(timeout_s=0.2)), check_mode=False)
    result = failed.value.result
    assert result["states"] == ["unknown"] and "502 Bad Gateway" in result["status_output_tail"]
    assert ["runpodctl", "pod", "stop", "p1"] in provider.calls()  # unknown is not stopped: the command ran


def test_a_failing_verb_fails_with_its_error_line(provider):
    provider.add("p1", "--behaviour", "fail")
    with pytest.raises(MeterStopError) as failed:
        meter_stop(plan_from(runpod()), check_mode=False)
    assert str(failed.value).startswith("the meter-stop command runpodctl pod stop p1 exited 1: Error: failed to stop")
    assert failed.value.result["command_rc"] == 1 and failed.value.result["polls"] == 1


def test_a_hung_verb_is_cut_at_command_timeout(provider):
    provider.add("p1", "--behaviour", "hang")
    with pytest.raises(MeterStopError, match="runpodctl pod stop p1 timed out") as failed:
        meter_stop(plan_from(runpod(command_timeout_s=1.0)), check_mode=False)
    assert failed.value.result["command_rc"] == 124


def test_a_missing_cli_never_reads_as_gone(provider, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    # "(?i)not found" would match the runner's own "runpodctl: command not found".
    with pytest.raises(MeterStopError, match="exited 127: runpodctl: command not found") as failed:
        meter_stop(plan_from(runpod(gone_pattern="(?i)not found")), check_mode=False)
    assert failed.value.result["states"] == ["unknown"] and failed.value.result["gone"] is False
    assert provider.calls() == []


def test_the_old_in_pod_verb_is_refused_by_the_fake(provider):
    provider.add("p1")
    with pytest.raises(MeterStopError, match='unknown command "remove"'):
        meter_stop(plan_from(runpod(command=["runpodctl", "remove", "pod", "p1"])), check_mode=False)


def test_an_empty_argv_element_is_refused_and_names_instance_id(provider):
    provider.add("p1")
    empty_id = r"^command\[3\] is empty \(runpodctl pod stop ''\): is instance_id set for this host\?"
    with pytest.raises(ValueError, match=empty_id):
        plan_from(runpod(ident=""))
    with pytest.raises(ValueError, match=r"status_command\[3\] is empty"):
        plan_from(dict(runpod(), status_command=["runpodctl", "pod", "get", " "]))
    with pytest.raises(ValueError, match=r"command\[0\] \(the program\) is empty"):
        plan_from(dict(runpod(), command=["", "pod"]))
    with pytest.raises(ValueError, match="command is an empty argv list"):
        plan_from(dict(runpod(), command=[]))
    assert provider.calls() == []


def test_check_mode_runs_nothing(provider):
    provider.add("p1")
    changed, result = meter_stop(plan_from(runpod()), check_mode=True)
    assert changed is True and result["would_run"] == ["runpodctl", "pod", "stop", "p1"]
    assert result["polls"] == 0 and result["command_rc"] is None
    assert not provider.calls_file.exists()
    assert provider.instances()["p1"]["status"] == "running"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"status_key": "data..status"}, "status_key must be a dotted JSON path"),
        ({"status_key": ""}, "status_key must be a dotted JSON path"),
        ({"status_key": "data status"}, "status_key must be a dotted JSON path"),
        ({"final_states": [], "gone_pattern": ""}, "no status would ever count as stopped"),
        ({"final_states": ["EXITED", ""]}, "final_states must hold non-empty states"),
        ({"gone_pattern": "(unclosed"}, "gone_pattern: invalid regular expression"),
    ],
)
def test_bad_plans_are_refused(change, problem):
    with pytest.raises(ValueError, match=problem):
        plan_from(dict(runpod(), **change))


def test_final_states_may_be_empty_with_a_gone_pattern():
    plan = plan_from(dict(runpod(verb="delete"), final_states=[]))
    assert plan.final_states == [] and plan.gone_pattern is not None


@pytest.mark.parametrize(
    ("stdout", "key", "state"),
    [
        ('{"desiredStatus": "EXITED"}', "desiredStatus", "EXITED"),
        ('{"data": {"status": "terminated"}}', "data.status", "terminated"),
        ('{"data": [{"status": "terminated"}]}', "data.status", None),  # a list on the way
        ('{"data": null}', "data.status", None),
        ('{"desiredStatus": NaN}', "desiredStatus", None),
        ('{"desiredStatus": 3}', "desiredStatus", None),
        ('{"desiredStatus": ""}', "desiredStatus", None),
        ('{"desiredStatus": null}', "desiredStatus", None),
        ('["EXITED"]', "desiredStatus", None),
        ("null", "desiredStatus", None),
        ("", "desiredStatus", None),
        ("<html>oops</html>", "desiredStatus", None),
        ('{"desiredStatus": "EXIT', "desiredStatus", None),
        ("[" * 100000 + "]" * 100000, "desiredStatus", None),  # nesting deep enough to overflow the parser
        ('Update available!\n{"desiredStatus": "EXITED"}', "desiredStatus", None),  # not JSON as a whole
    ],
)
def test_read_state(stdout, key, state):
    assert read_state(stdout, key) == state


def test_states_compare_exactly():
    calls: List[List[str]] = []

    def runner(argv: List[str], _timeout: float):
        calls.append(argv)
        return 0, '{"desiredStatus": "exited"}', ""

    with pytest.raises(MeterStopError, match="is still exited after"):
        meter_stop(plan_from(runpod(timeout_s=0)), False, runner=runner, sleep=lambda _s: None)
    assert calls[1] == ["runpodctl", "pod", "stop", "p1"]


def test_a_state_read_is_never_taken_for_gone():
    def runner(argv: List[str], _timeout: float):
        return 0, '{"desiredStatus": "RUNNING", "note": "pod volume not found"}', ""

    with pytest.raises(MeterStopError, match="is still RUNNING"):
        meter_stop(plan_from(runpod(timeout_s=0)), False, runner=runner, sleep=lambda _s: None)


def test_a_verb_failing_as_gone_must_be_confirmed_by_the_status():
    def runner(argv: List[str], _timeout: float):
        if argv[2] == "get":
            return 0, '{"desiredStatus": "RUNNING"}', ""
        return 1, "", "Error: pod p1 not found"

    with pytest.raises(MeterStopError) as failed:
        meter_stop(plan_from(runpod(timeout_s=0)), False, runner=runner, sleep=lambda _s: None)
    assert "exited 1 saying the instance is gone but the instance" in str(failed.value)
    assert "is still RUNNING" in str(failed.value)


def test_a_verb_failing_as_gone_then_confirmed_is_done():
    polls: List[int] = []

    def runner(argv: List[str], _timeout: float):
        if argv[2] == "get":
            polls.append(1)
            return (0, '{"desiredStatus": "RUNNING"}', "") if len(polls) == 1 else (1, "", "pod p1 not found")
        return 1, "", "Error: pod p1 not found"

    changed, result = meter_stop(plan_from(runpod()), False, runner=runner, sleep=lambda _s: None)
    assert changed is True and result["gone"] is True and result["command_rc"] == 1


def test_the_deadline_runs_on_the_injected_clock():
    now = [1000.0]
    naps: List[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        now[0] += seconds

    def runner(argv: List[str], _timeout: float):
        now[0] += 0.5  # each command takes half a second
        return 0, '{"desiredStatus": "RUNNING"}', ""

    params = runpod(timeout_s=10, poll_interval_s=3)
    with pytest.raises(MeterStopError, match=r"still RUNNING after 10 s") as failed:
        meter_stop(plan_from(params), False, runner=runner, clock=lambda: now[0], sleep=sleep)
    # The deadline is 10 s after the command returned; polls end 0.5, 4.0, 7.5 and 10.5 s after it, and the last
    # nap is cut to what was left.
    assert naps == [3, 3, 2.5]
    assert failed.value.result["polls"] == 1 + 4


def test_a_nan_clock_ends_the_loop():
    def runner(argv: List[str], _timeout: float):
        return 0, '{"desiredStatus": "RUNNING"}', ""

    with pytest.raises(MeterStopError):
        meter_stop(plan_from(runpod()), False, runner=runner, clock=lambda: math.nan, sleep=lambda _s: None)


def test_output_tails_are_bounded():
    def runner(argv: List[str], _timeout: float):
        if argv[2] == "get":
            return 0, "x" * 10000, "e" * 10000
        return 3, "y" * 10000, "z" * 10000

    with pytest.raises(MeterStopError) as failed:
        meter_stop(plan_from(runpod()), False, runner=runner)
    result = failed.value.result
    assert len(result["status_output_tail"]) == _meter_stop.TAIL_CHARS
    assert len(result["command_output_tail"]) == _meter_stop.TAIL_CHARS and result["command_output_tail"][-1] == "z"
    assert len(str(failed.value)) < 500


def test_every_command_gets_the_command_timeout():
    timeouts: List[float] = []

    def runner(argv: List[str], timeout: float):
        timeouts.append(timeout)
        return 0, '{"desiredStatus": "EXITED"}' if len(timeouts) > 2 else '{"desiredStatus": "RUNNING"}', ""

    meter_stop(plan_from(runpod(command_timeout_s=7)), False, runner=runner, sleep=lambda _s: None)
    assert timeouts == [7.0, 7.0, 7.0]


def test_the_fake_keeps_its_state_under_concurrent_writers(provider):
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(provider.add, [f"i{n}" for n in range(24)]))
    assert sorted(provider.instances()) == sorted(f"i{n}" for n in range(24))


def test_a_status_command_that_fails_has_no_state():
    calls: List[List[str]] = []

    def runner(argv: List[str], _timeout: float):
        calls.append(argv)
        if argv[2] == "stop":
            return 0, "", ""
        return 2, '{"desiredStatus": "EXITED"}', "Error: rate limited"

    with pytest.raises(MeterStopError, match="is still unknown after") as failed:
        meter_stop(plan_from(runpod(timeout_s=0)), False, runner=runner, sleep=lambda _s: None)
    assert failed.value.result["states"] == ["unknown"] and failed.value.result["already"] is False
    assert calls[1] == ["runpodctl", "pod", "stop", "p1"]
