"""meter_stop's flow with the shipped platform profiles, against the real fake provider CLI run as the runner.

The fake (tests/workload/fake_provider.py) is symlinked as ``runpodctl``, ``vastai`` and ``curl`` into a bin folder on
PATH; its state file and calls file are the tests' independent view of what ran. The profiles are loaded from
inventories/group_vars and rendered as Ansible would. Reading and the deadline arithmetic are tested with injected
runners and clocks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

import jinja2
import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop import (
    MeterStopError,
    Plan,
    error_line,
    meter_stop,
    parse_verb,
    plan_for,
    scrub,
    stopped_states,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import FAKE_PROVIDER

REPO = Path(__file__).resolve().parents[4]
PROFILES = ("runpod", "vastai", "lambda", "autodl", "generic_ssh")
RESULT_KEYS = {
    "verb",
    "command",
    "final_state",
    "gone",
    "already",
    "polls",
    "states",
    "command_rc",
    "command_error",
    "status_error",
    "stale_id",
    "msg",
}
FAST = {"timeout_s": 3.0, "poll_interval_s": 0.05, "command_timeout_s": 10.0}
_JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)
_JINJA.filters["expanduser"] = os.path.expanduser


def _render(node: Any, context: Dict[str, Any]) -> Any:
    if isinstance(node, str):
        return _JINJA.from_string(node).render(**context)
    if isinstance(node, list):
        return [_render(item, context) for item in node]
    if isinstance(node, dict):
        return {key: _render(value, context) for key, value in node.items()}
    return node


def profile(platform: str, instance_id: str, **variables: Any) -> Dict[str, Any]:
    """The shipped profile's meter-stop variables, rendered for a host with ``instance_id``."""
    loaded = yaml.safe_load((REPO / "inventories" / "group_vars" / f"{platform}.yml").read_text(encoding="utf-8"))
    context = dict(loaded, instance_id=instance_id, **variables)
    return dict(loaded, meter_stop_verbs=_render(loaded["meter_stop_verbs"], context))


def shipped(platform: str, ident: str, verb: str = "", **options: Any) -> Plan:
    """A plan for a shipped profile's verb (its default verb unless named)."""
    variables = {key: options.pop(key) for key in list(options) if key == "lambda_auth_header_file"}
    loaded = profile(platform, ident, **variables)
    return plan_for(parse_verb(loaded["meter_stop_verbs"], verb or loaded["meter_stop_verb"]), **{**FAST, **options})


def declared(verb: Dict[str, Any], **options: Any) -> Plan:
    return plan_for(parse_verb({"v": verb}, "v"), **{**FAST, **options})


@pytest.fixture
def lambda_key(provider, tmp_path: Path) -> Path:
    """The fake curl on PATH too, and a header file holding the key it accepts."""
    subprocess.run([sys.executable, str(FAKE_PROVIDER), "install", str(provider.bin), "--faces", "curl"], check=True)
    header = tmp_path / "auth-header"
    header.write_text("Authorization: Bearer fake-lambda-key\n", encoding="utf-8")
    return header


def fake_set(provider, *options: str) -> None:
    subprocess.run([sys.executable, str(FAKE_PROVIDER), "set", "--state", str(provider.state), *options], check=True)


LIST_PODS = ["runpodctl", "pod", "list", "--all", "--output", "json"]
LIST_VAST = ["vastai", "show", "instances", "--raw"]


# --- every shipped profile -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", PROFILES)
def test_every_verb_of_every_shipped_profile_parses(platform):
    loaded = profile(platform, "i-123", lambda_auth_header_file="/tmp/h")
    for name in [*loaded["meter_stop_verbs"], loaded["meter_stop_verb"]]:
        verb = parse_verb(loaded["meter_stop_verbs"], name)
        assert verb.kind in ("command", "manual", "none")
        assert set(verb.survives) <= {"data_dir", "durable_dir"}
        if verb.command:
            assert "i-123" in " ".join(verb.command) and verb.status.instance_id == "i-123"
    assert isinstance(loaded["instance_id_env"], list)
    old_keys = {"meter_stop_cmd", "meter_stop_status_cmd", "meter_stop_gone_pattern", "durable_survives"}
    assert not old_keys & set(loaded)


def test_runpod_stop_as_shipped_polls_the_list_to_exited(provider):
    provider.add("p1")
    changed, result = meter_stop(shipped("runpod", "p1"), check_mode=False)
    assert changed is True and set(result) == RESULT_KEYS
    assert (result["final_state"], result["gone"], result["already"]) == ("EXITED", False, False)
    assert result["states"] == ["RUNNING", "EXITED"] and result["polls"] == 2 and result["verb"] == "stop"
    assert (result["command_rc"], result["command_error"], result["status_error"]) == (0, "", "")
    assert provider.calls() == [LIST_PODS, ["runpodctl", "pod", "stop", "p1"], LIST_PODS]
    assert provider.instances()["p1"]["status"] == "exited"


def test_runpod_delete_runs_on_a_stopped_pod_and_ends_gone(provider):
    """EXITED is final for stop, not for delete: a stopped pod still bills its volume until deleted."""
    provider.add("p1", "--status", "exited")
    provider.add("other")
    changed, result = meter_stop(shipped("runpod", "p1", "delete"), check_mode=False)
    assert changed is True and result["already"] is False
    assert result["states"] == ["EXITED", "gone"] and result["gone"] is True and result["final_state"] is None
    assert ["runpodctl", "pod", "delete", "p1"] in provider.calls()
    assert list(provider.instances()) == ["other"]


def test_a_pod_missing_from_the_list_is_already_gone_and_nothing_runs(provider):
    provider.add("other")
    changed, result = meter_stop(shipped("runpod", "nope", "delete"), check_mode=False)
    assert changed is False and (result["gone"], result["already"]) == (True, True)
    assert result["states"] == ["gone"] and provider.calls() == [LIST_PODS]


def test_an_already_stopped_pod_is_left_alone(provider):
    provider.add("p1", "--status", "exited")
    changed, result = meter_stop(shipped("runpod", "p1"), check_mode=False)
    assert changed is False and result["already"] is True and result["final_state"] == "EXITED"
    assert result["command_rc"] is None and "not run" in result["msg"] and provider.calls() == [LIST_PODS]


def test_an_exited_pod_whose_box_just_answered_is_a_stale_id_and_nothing_runs(provider):
    # The box answered SSH seconds ago, so it runs: an id the provider calls EXITED names another pod.
    provider.add("p1", "--status", "exited")
    with pytest.raises(MeterStopError) as refused:
        meter_stop(shipped("runpod", "p1"), check_mode=False, box_answered=True)
    result = refused.value.result
    assert result["stale_id"] is True and result["already"] is False and result["states"] == ["EXITED"]
    assert "instance p1 is already EXITED, yet the box answered" in result["msg"] and "stale" in result["msg"]
    assert provider.calls() == [LIST_PODS]


def test_a_stopped_state_of_another_verb_refuses_a_delete_of_a_box_that_answered(provider):
    # EXITED is not final for delete, but it is stopped: deleting it would destroy another (stopped) pod.
    provider.add("p1", "--status", "exited")
    loaded = profile("runpod", "p1")
    delete = parse_verb(loaded["meter_stop_verbs"], "delete")
    stopped = stopped_states(loaded["meter_stop_verbs"], delete)
    assert set(stopped) == {"EXITED", "TERMINATED"}
    with pytest.raises(MeterStopError) as refused:
        meter_stop(plan_for(delete, **FAST), check_mode=False, box_answered=True, stopped_states=stopped)
    assert refused.value.result["stale_id"] is True and "already EXITED" in str(refused.value)
    assert provider.calls() == [LIST_PODS] and provider.instances()["p1"]["status"] == "exited"


def test_a_gone_id_whose_box_just_answered_is_a_stale_id(provider):
    provider.add("other")
    with pytest.raises(MeterStopError) as refused:
        meter_stop(shipped("runpod", "p1"), check_mode=False, box_answered=True)
    assert refused.value.result["stale_id"] is True and refused.value.result["gone"] is True
    assert "lists no instance p1, yet the box answered" in str(refused.value) and provider.calls() == [LIST_PODS]


def test_stopped_states_skip_verbs_read_another_way_and_broken_declarations(provider):
    loaded = profile("runpod", "p1")
    verbs = dict(loaded["meter_stop_verbs"], broken={"command": ["x"]})
    verbs["other"] = dict(verbs["stop"], status=dict(verbs["stop"]["status"], state_key="status"), final_states=["X"])
    stop = parse_verb(verbs, "stop")
    assert stopped_states(verbs, stop) == ("EXITED", "TERMINATED")


def test_a_slow_provider_is_polled_until_final_and_states_are_deduped(provider):
    provider.add("p1", "--settle-polls", "2")
    _changed, result = meter_stop(shipped("runpod", "p1"), check_mode=False)
    assert result["states"] == ["RUNNING", "EXITED"] and result["polls"] == 4
    assert [argv[2] for argv in provider.calls()].count("stop") == 1


def test_a_sticky_stop_that_exits_0_fails_loudly_after_the_deadline(provider):
    provider.add("p1", "--behaviour", "sticky")
    with pytest.raises(MeterStopError) as failed:
        meter_stop(shipped("runpod", "p1", timeout_s=0.3), check_mode=False)
    result = failed.value.result
    assert "exited 0 but the instance (runpodctl pod list --all --output json) is still RUNNING after" in str(
        failed.value
    )
    assert result["msg"] == str(failed.value) and set(result) == RESULT_KEYS
    assert result["command_rc"] == 0 and result["states"] == ["RUNNING"] and result["polls"] >= 3
    assert provider.instances()["p1"]["status"] == "running"


@pytest.mark.parametrize(
    ("platform", "fault", "error"),
    [
        ("runpod", "traceback", "exited 1: FileNotFoundError: [Errno 2] No such file or directory:"),
        ("vastai", "traceback", "exited 1: FileNotFoundError: [Errno 2] No such file or directory:"),
        ("runpod", "auth", "exited 1: API key not found: run 'runpodctl doctor'"),
        ("vastai", "auth", "exited 1: Error: API key not found."),
    ],
)
def test_a_failing_status_cli_is_never_gone_and_the_meter_stop_fails_loudly(provider, platform, fault, error):
    """The old gone patterns ("(?i)not found|no such") read these failures as "the instance is gone"."""
    ident = "42"
    provider.add(ident)
    fake_set(provider, "--status-fault", fault)
    with pytest.raises(MeterStopError) as failed:
        meter_stop(shipped(platform, ident, timeout_s=0.2), check_mode=False)
    result = failed.value.result
    assert result["gone"] is False and result["already"] is False and result["states"] == ["unknown"]
    assert result["status_error"].startswith(error) and "is still unknown (exited 1:" in result["msg"]
    assert "Traceback" not in json.dumps(result)


def test_lambda_with_a_wrong_key_is_unknown_not_gone(provider, lambda_key):
    provider.add("0920582c7ff041399e34823a0be62549")
    lambda_key.write_text("Authorization: Bearer not-the-key\n", encoding="utf-8")
    plan = shipped("lambda", "0920582c7ff041399e34823a0be62549", lambda_auth_header_file=str(lambda_key))
    with pytest.raises(MeterStopError) as failed:
        meter_stop(plan, check_mode=False)
    result = failed.value.result
    assert result["gone"] is False and result["states"] == ["unknown"] and result["command_rc"] == 22
    assert result["status_error"] == "exited 22: API key was invalid, expired, or deleted. (global/invalid-api-key)"
    assert "0920582c7ff041399e34823a0be62549" in provider.instances()


def test_lambda_terminate_as_shipped_ends_gone_and_keeps_no_jupyter_token(provider, lambda_key):
    ident = "0920582c7ff041399e34823a0be62549"
    provider.add(ident, "--settle-polls", "1")
    provider.add("b7e1c2d3a4f5061728394a5b6c7d8e9f")
    listed = subprocess.run(
        ["curl", "-H", f"@{lambda_key}", "https://cloud.lambdalabs.com/api/v1/instances"],
        capture_output=True,
        text=True,
        check=True,
    )
    tokens = [item["jupyter_token"] for item in json.loads(listed.stdout)["data"]]
    plan = shipped("lambda", ident, lambda_auth_header_file=str(lambda_key))
    changed, result = meter_stop(plan, check_mode=False)
    assert changed is True and result["gone"] is True and result["states"] == ["active", "gone"]
    assert list(provider.instances()) == ["b7e1c2d3a4f5061728394a5b6c7d8e9f"]
    assert ("-H", f"@{lambda_key}") == plan.verb.command[5:7]  # the key never in an argv
    shown = json.dumps(result)
    assert tokens and not any(token in shown for token in tokens) and "fake-lambda-key" not in shown


def test_vast_stop_as_shipped_polls_to_exited(provider):
    provider.add("42")
    _changed, result = meter_stop(shipped("vastai", "42"), check_mode=False)
    assert result["final_state"] == "exited" and result["states"] == ["running", "exited"]
    assert provider.calls() == [LIST_VAST, ["vastai", "stop", "instance", "42"], LIST_VAST]


def test_vast_destroy_with_a_new_cli_runs_with_yes_and_ends_gone(provider):
    provider.add("42", "--settle-polls", "1")
    changed, result = meter_stop(shipped("vastai", "42", "destroy"), check_mode=False)
    assert changed is True and result["gone"] is True and result["states"] == ["running", "gone"]
    help_call = ["vastai", "destroy", "instance", "--help"]
    assert provider.calls()[:3] == [LIST_VAST, help_call, ["vastai", "destroy", "instance", "42", "-y"]]
    assert provider.instances() == {}


def test_vast_destroy_with_an_old_cli_is_refused_before_destroying(provider):
    provider.add("42")
    fake_set(provider, "--vastai-release", "old")
    with pytest.raises(MeterStopError) as failed:
        meter_stop(shipped("vastai", "42", "destroy"), check_mode=False)
    assert str(failed.value) == (
        "refused before running vastai destroy instance 42 -y: vastai destroy instance --help shows no '-y, --yes'; "
        "needs a vastai CLI whose destroy instance takes -y (pip install -U vastai)"
    )
    destroys = [argv for argv in provider.calls() if argv[:2] == ["vastai", "destroy"] and "--help" not in argv]
    assert destroys == [] and failed.value.result["command_rc"] is None
    assert provider.instances()["42"]["status"] == "running"


def test_vast_destroy_without_yes_aborts_with_0_and_is_caught(provider):
    provider.add("42")
    verb = {
        "command": ["vastai", "destroy", "instance", "42"],
        "status": {"command": LIST_VAST, "list": "", "id": "42", "state_key": "actual_status"},
        "final_states": [],
        "survives": [],
        "irreversible": True,
    }
    with pytest.raises(MeterStopError, match=r"exited 0 but .* is still running after"):
        meter_stop(declared(verb, timeout_s=0.3), check_mode=False)
    assert "42" in provider.instances()


def test_garbage_status_output_is_unknown(provider):
    provider.add("p1", "--print", "<html>502 Bad Gateway</html>")
    with pytest.raises(MeterStopError, match=r"is still unknown \(exited 0 but printed no JSON: ") as failed:
        meter_stop(shipped("runpod", "p1", timeout_s=0.2), check_mode=False)
    assert failed.value.result["states"] == ["unknown"]
    assert ["runpodctl", "pod", "stop", "p1"] in provider.calls()  # unknown is not stopped: the command ran


def test_a_failing_verb_fails_with_its_error_line(provider):
    provider.add("p1", "--behaviour", "fail")
    with pytest.raises(MeterStopError) as failed:
        meter_stop(shipped("runpod", "p1"), check_mode=False)
    assert str(failed.value) == (
        "the meter-stop command runpodctl pod stop p1 exited 1: "
        "Error: failed to stop pod p1: internal server error (500)"
    )
    assert failed.value.result["command_rc"] == 1 and failed.value.result["polls"] == 1


def test_a_hung_verb_is_cut_at_command_timeout(provider):
    provider.add("p1", "--behaviour", "hang")
    with pytest.raises(MeterStopError, match="runpodctl pod stop p1 timed out") as failed:
        meter_stop(shipped("runpod", "p1", command_timeout_s=1.0), check_mode=False)
    assert failed.value.result["command_rc"] == 124


def test_a_missing_cli_never_reads_as_gone(provider, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MeterStopError, match="exited 127: runpodctl: command not found") as failed:
        meter_stop(shipped("runpod", "p1"), check_mode=False)
    result = failed.value.result
    assert result["states"] == ["unknown"] and result["gone"] is False
    assert result["status_error"] == "exited 127: runpodctl: command not found" and provider.calls() == []


def test_check_mode_runs_nothing(provider):
    provider.add("42")
    changed, result = meter_stop(shipped("vastai", "42", "destroy"), check_mode=True)
    assert changed is True and result["would_run"] == ["vastai", "destroy", "instance", "42", "-y"]
    assert "after checking vastai destroy instance --help" in result["msg"]
    assert result["polls"] == 0 and result["command_rc"] is None and not provider.calls_file.exists()


def test_the_fake_keeps_its_state_under_concurrent_writers(provider):
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(provider.add, [f"i{n}" for n in range(24)]))
    assert sorted(provider.instances()) == sorted(f"i{n}" for n in range(24))


def test_the_fake_installed_with_a_state_file_needs_no_environment_and_names_the_key_it_saw(tmp_path):
    """On a box the faces run with the platform's environment only: install --state bakes the state file in."""
    bin_dir, state = tmp_path / "usr-local-bin", tmp_path / "provider" / "state.json"
    state.parent.mkdir()
    install = [sys.executable, str(FAKE_PROVIDER), "install", str(bin_dir), "--faces", "runpodctl", "vastai"]
    subprocess.run([*install, "--state", str(state)], check=True)
    for ident in ("p1", "42"):
        subprocess.run([sys.executable, str(FAKE_PROVIDER), "add", "--state", str(state), ident], check=True)

    def face(argv: List[str], folder: Path = bin_dir, **env: str) -> subprocess.CompletedProcess:
        path = {"PATH": f"{folder}:/usr/bin:/bin"}
        return subprocess.run(argv, check=False, env=dict(path, **env), capture_output=True, text=True)

    stop = face(["runpodctl", "pod", "stop", "p1"], RUNPOD_API_KEY="rk-pod-scoped-key")
    show = face(["vastai", "show", "instance", "42", "--raw"])
    assert (stop.returncode, show.returncode) == (0, 0), stop.stderr + show.stderr
    assert json.loads(state.read_text())["instances"]["p1"]["status"] == "exited"
    logged = Path(f"{state}.calls.jsonl").read_text()
    calls = [json.loads(line) for line in logged.splitlines()]
    assert [(call["argv"], call["key_env"]) for call in calls] == [
        (["runpodctl", "pod", "stop", "p1"], "RUNPOD_API_KEY"),
        (["vastai", "show", "instance", "42", "--raw"], None),
    ]
    assert "rk-pod-scoped-key" not in logged
    # Installed without --state the faces still need FAKE_PROVIDER_STATE, as before.
    subprocess.run([*install[:3], str(tmp_path / "plain")], check=True)
    plain = face(["runpodctl", "pod", "get", "p1"], tmp_path / "plain")
    assert plain.returncode != 0 and "FAKE_PROVIDER_STATE" in plain.stderr


# --- reading, with injected runners --------------------------------------------------------------------------------

Reply = Tuple[int, str, str]


def listed(*pods: Tuple[Any, str]) -> str:
    return json.dumps([{"id": ident, "desiredStatus": state} for ident, state in pods])


def scripted(status: List[Reply], command: Reply = (0, "", "")):
    """A runner answering status polls from ``status`` (the last one repeats) and the verb with ``command``."""
    calls: List[List[str]] = []

    def run(argv: List[str], _timeout: float) -> Reply:
        calls.append(argv)
        if argv[:3] == ["runpodctl", "pod", "list"]:
            return status[min(len(calls_of(calls, "list")) - 1, len(status) - 1)]
        return command

    return run, calls


def calls_of(calls: List[List[str]], word: str) -> List[List[str]]:
    return [argv for argv in calls if argv[2] == word]


def run_with(plan: Plan, runner) -> Dict[str, Any]:
    try:
        return meter_stop(plan, False, runner=runner, sleep=lambda _s: None)[1]
    except MeterStopError as failed:
        return failed.result


@pytest.mark.parametrize(
    ("stdout", "status_error"),
    [
        ('{"pods": []}', "no list of instances as the whole output"),
        ('[{"name": "p1", "desiredStatus": "EXITED"}]', "a listed instance has no 'id'"),
        (listed(("p1", "RUNNING"), ("p1", "EXITED")), "2 listed instances have id p1"),
        ('[{"id": "p1", "desiredStatus": 3}]', "no state (a non-empty string) at 'desiredStatus'"),
        ('[{"id": "p1", "desiredStatus": ""}]', "no state (a non-empty string) at 'desiredStatus'"),
        ("[" * 100000 + "]" * 100000, "exited 0 but printed no JSON"),
        ('Update available!\n[{"id": "p1"}]', "exited 0 but printed no JSON: Update available!"),
    ],
)
def test_a_list_that_can_not_be_trusted_is_unknown_never_gone(stdout, status_error):
    runner, _calls = scripted([(0, stdout, "")])
    result = run_with(shipped("runpod", "p1", timeout_s=0), runner)
    assert result["gone"] is False and result["states"] == ["unknown"]
    assert result["status_error"].startswith(status_error)


def test_a_status_that_fails_with_a_json_state_has_no_state():
    runner, calls = scripted([(2, listed(("p1", "EXITED")), "Error: rate limited")])
    result = run_with(shipped("runpod", "p1", timeout_s=0), runner)
    assert result["states"] == ["unknown"] and result["status_error"] == "exited 2: Error: rate limited"
    assert calls[1] == ["runpodctl", "pod", "stop", "p1"]


def test_numeric_ids_match_the_inventory_s_string():
    runner, _calls = scripted([(0, json.dumps([{"id": 42, "actual_status": "exited"}]), "")])
    plan = declared(
        {
            "command": ["runpodctl", "pod", "stop", "42"],
            "status": {"command": LIST_PODS, "list": "", "id": "42", "state_key": "actual_status"},
            "final_states": ["exited"],
            "survives": [],
            "irreversible": False,
        }
    )
    assert run_with(plan, runner)["final_state"] == "exited"


def test_an_id_listed_as_true_is_not_the_instance_1():
    runner, _calls = scripted([(0, json.dumps([{"id": True, "desiredStatus": "RUNNING"}]), "")])
    assert run_with(shipped("runpod", "1", timeout_s=0), runner)["gone"] is True


def test_states_compare_exactly():
    runner, calls = scripted([(0, listed(("p1", "exited")), "")])
    result = run_with(shipped("runpod", "p1", timeout_s=0), runner)
    assert "is still exited after" in result["msg"] and calls[1] == ["runpodctl", "pod", "stop", "p1"]


def test_a_failing_verb_is_not_polled_even_if_it_says_gone():
    runner, calls = scripted([(0, listed(("p1", "RUNNING")), "")], command=(1, "", "Error: pod p1 not found"))
    result = run_with(shipped("runpod", "p1"), runner)
    assert result["msg"] == "the meter-stop command runpodctl pod stop p1 exited 1: Error: pod p1 not found"
    assert result["gone"] is False and len(calls) == 2


def test_the_deadline_runs_on_the_injected_clock():
    now = [1000.0]
    naps: List[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        now[0] += seconds

    def runner(argv: List[str], _timeout: float) -> Reply:
        now[0] += 0.5  # each command takes half a second
        return 0, listed(("p1", "RUNNING")), ""

    with pytest.raises(MeterStopError, match=r"still RUNNING after 10 s") as failed:
        meter_stop(shipped("runpod", "p1", timeout_s=10, poll_interval_s=3), False, runner, lambda: now[0], sleep)
    # The deadline is 10 s after the command returned; polls end 0.5, 4.0, 7.5 and 10.5 s after it, and the last
    # nap is cut to what was left.
    assert naps == [3, 3, 2.5] and failed.value.result["polls"] == 1 + 4


def test_a_nan_clock_ends_the_loop():
    runner, _calls = scripted([(0, listed(("p1", "RUNNING")), "")])
    with pytest.raises(MeterStopError):
        meter_stop(shipped("runpod", "p1"), False, runner=runner, clock=lambda: math.nan, sleep=lambda _s: None)


def test_every_command_gets_the_command_timeout():
    timeouts: List[float] = []

    def runner(argv: List[str], timeout: float) -> Reply:
        timeouts.append(timeout)
        if argv[:2] == ["vastai", "show"]:  # listed before the destroy, gone after it
            return 0, json.dumps([{"id": 42, "actual_status": "running"}] if len(timeouts) < 3 else []), ""
        return 0, "  -y, --yes  Skip confirmation prompt" if "--help" in argv else "", ""

    meter_stop(shipped("vastai", "42", "destroy", command_timeout_s=7), False, runner=runner, sleep=lambda _s: None)
    assert timeouts == [7.0, 7.0, 7.0, 7.0]  # status, cli check, destroy, status


# --- secrets -------------------------------------------------------------------------------------------------------

TOKEN = "2c60c3b5a671060bc6148900a3ac7a42"


def test_provider_output_with_secrets_never_reaches_the_result():
    body = json.dumps({"data": {"id": "p1", "jupyter_token": TOKEN, "api_key": "sk_live_abc"}})
    runner, _calls = scripted(
        [(1, body, f"Error: upstream refused Authorization: Bearer sk-{TOKEN} (token={TOKEN})")],
        command=(1, f'{{"error": {{"code": "denied", "message": "key {TOKEN} revoked", "token": "{TOKEN}"}}}}', ""),
    )
    result = run_with(shipped("runpod", "p1"), runner)
    shown = json.dumps(result)
    assert TOKEN not in shown and "sk_live_abc" not in shown and "sk-" not in shown
    assert result["command_error"] == "exited 1: key *** revoked (denied)"
    assert result["status_error"] == "exited 1: Error: upstream refused Authorization: Bearer *** (token=***)"


@pytest.mark.parametrize(
    ("text", "scrubbed"),
    [
        ('{"jupyter_token": "abc", "id": "x"}', '{"jupyter_token": "***", "id": "x"}'),
        ("GET /graphql?api_key=rpa_ABCDEF123 failed", "GET /graphql?api_key=*** failed"),
        ("Authorization: Bearer abc.def", "Authorization: Bearer ***"),
        (f"instance {TOKEN} not found", "instance *** not found"),
        ("c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA==", "***"),
        ("API key not found", "API key not found"),
    ],
)
def test_scrub(text, scrubbed):
    assert scrub(text) == scrubbed


def test_scrub_keeps_the_instance_id_but_not_a_secret_around_it():
    assert scrub(f"instance {TOKEN} not found", keep=(TOKEN,)) == f"instance {TOKEN} not found"
    secret = "c2VjcmV0LXNlY3JldC1zZWNyZX" + "p1" + "Qtc2VjcmV0LXNlY3JldA"
    assert scrub(f"pod p1: {secret}", keep=("p1",)) == "pod p1: ***"


def test_error_lines_are_short_and_pick_the_error():
    assert len(error_line("x" * 10000, "e" * 10000)) <= 200
    assert error_line("", "Error: bad flag\nUsage:\n  runpodctl pod [flags]") == "Error: bad flag"
    assert error_line("", "") == "no output"


# --- plan_for ------------------------------------------------------------------------------------------------------


def test_plan_for_refuses_a_verb_done_by_hand_with_its_steps():
    verb = parse_verb(profile("autodl", "")["meter_stop_verbs"], "shutdown")
    with pytest.raises(ValueError, match=r"^meter_stop_verb shutdown is done by hand: AutoDL console -> "):
        plan_for(verb, 300, 5, 60)


@pytest.mark.parametrize(
    ("timeouts", "problem"),
    [
        ((math.nan, 5, 60), "timeout_s must be a finite number between 0 and 86400, got nan"),
        ((300, 0, 60), "poll_interval_s must be an integer above 0 and at most 3600, got 0"),
        ((300, 5, math.inf), "command_timeout_s must be a finite number above 0 and at most 3600, got inf"),
    ],
)
def test_plan_for_refuses_bad_timeouts(timeouts, problem):
    verb = parse_verb(profile("runpod", "p1")["meter_stop_verbs"], "stop")
    with pytest.raises(ValueError) as refused:
        plan_for(verb, *timeouts)
    assert problem in str(refused.value)
