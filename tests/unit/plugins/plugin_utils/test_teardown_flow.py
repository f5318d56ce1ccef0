"""One box's teardown on the controller, step by step: the box modules' answers are scripted, the provider's CLI is
the fake one (tests/workload/fake_provider.py) and the templates go through Ansible's own Templar."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional

import pytest
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.template import Templar

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import StageAction, StageError
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._teardown_flow import Teardown
from ansible_collections.remote_gpu.trainer.tests.workload.harness import Provider, runpod_stop_verb

SHA = "a" * 64
STOP = runpod_stop_verb("pod-1")
DELETE = dict(STOP, command=["runpodctl", "pod", "delete", "pod-1"], final_states=["TERMINATED"])
DELETE.update(survives=["durable_dir"], irreversible=True)
SHUTDOWN = {
    "manual_steps": ["Console -> the instance -> Shut down"],
    "survives": ["data_dir", "durable_dir"],
    "irreversible": False,
}


def gate(
    passed: bool = True, *, step: Optional[str] = None, state: str = "finished", reason: str = ""
) -> Dict[str, Any]:
    run = {
        "run": {"name": "r1", "state": state},
        "cells": [{"name": "a", "done": True}],
        "durable": {"dir": "/durable/runs/r1", "exists": True, "files": 1, "bytes": 4},
        "artifacts": [{"path": "cells/a/my best.pth", "size": 4, "sha256": SHA, "cell": "a"}],
        "passed": passed,
    }
    return {"passed": passed, "step": step, "reason": reason, "runs": [run], "instance": {"other_runs": []}}


class FakeTask:
    check_mode = False


class FakeAction:
    """What Teardown needs of its action plugin: module calls (scripted answers, recorded with their check mode)."""

    def __init__(self, answers: Dict[str, List[Any]], check_mode: bool = False) -> None:
        self.answers = answers
        self.calls: List[Dict[str, Any]] = []
        self.leases: List[Dict[str, Any]] = []  # box_lease calls, apart: each may come at any step
        self.on_lease: Callable[[Dict[str, Any]], Any] = lambda args: None
        self._task = FakeTask()
        self._task.check_mode = check_mode
        self._templar = Templar(loader=None, variables={})
        self._connection = None

    def box_module(self, name: str, args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        if name == "box_lease":
            self.leases.append(dict(args, check_mode=self._task.check_mode, after=self.modules()))
            self.on_lease(args)
            scripted = self.answers.get("box_lease")
            return scripted.pop(0) if scripted else {"changed": True}
        self.calls.append({"module": name, "args": args, "check_mode": self._task.check_mode})
        answer = self.answers[name].pop(0)
        return answer(args) if callable(answer) else answer

    check_mode = StageAction.check_mode

    def modules(self) -> List[str]:
        return [call["module"] for call in self.calls]


def settings(**args: Any) -> options.Settings:
    given = {"runs": "r1", "data_dir": "/data", "durable_dir": "/durable", "instance_id": "pod-1"}
    given.update(meter_stop_verb="stop", meter_stop_verbs={"stop": STOP}, meter_stop_poll_interval_s=0.1)
    given.update(args)
    validated = ArgumentSpecValidator(options.ARGUMENT_SPEC).validate(given)
    assert not validated.error_messages
    found, problems = options.settings_of(validated.validated_parameters, {})
    assert not problems, problems
    return found


def scratch_answer(args: Dict[str, Any]) -> Dict[str, Any]:
    return {"changed": True, "removed": [{"run": "r1", "path": "/data/runs/r1", "files": 3, "bytes": 10}]}


def teardown(action: FakeAction, task_vars: Optional[Dict[str, Any]] = None, **args: Any) -> Teardown:
    return Teardown(action, settings(**args), task_vars or {}, "b1")


def run(flow: Teardown, warnings: Optional[List[str]] = None) -> Any:
    sink: Callable[[str], None] = warnings.append if warnings is not None else lambda text: None
    return flow.run(sink)


@pytest.fixture
def pod(provider: Provider) -> Provider:
    provider.add("pod-1")
    return provider


def test_unconfirmed_runs_the_gate_and_only_previews_the_actions(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [{"changed": True, "would_remove": []}]})
    flow = teardown(action)
    assert run(flow) == ("UNCONFIRMED", "confirm", "not confirmed: set confirm_teardown=b1 (or all)")
    assert [(c["module"], c["check_mode"]) for c in action.calls] == [("teardown_gate", False), ("run_scratch", True)]
    assert pod.calls() == []  # not even a status poll
    assert flow.record["meter_stop"]["would_run"] == ["runpodctl", "pod", "stop", "pod-1"]


def test_confirmed_removes_the_scratch_with_the_gates_digests_then_stops_the_pod_once(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, confirm="b1")
    assert run(flow) == ("TORN_DOWN", None, "")
    scratch = action.calls[1]
    assert scratch["check_mode"] is False and scratch["args"]["runs"] == ["r1"]
    assert scratch["args"]["expected"] == {"r1": [{"path": "cells/a/my best.pth", "size": 4, "sha256": SHA}]}
    assert [call[:3] for call in pod.calls()].count(["runpodctl", "pod", "stop"]) == 1
    assert pod.instances()["pod-1"]["status"] == "exited" and flow.record["changed"] is True


def test_a_gate_refusal_stops_the_box_before_anything_is_removed_or_called(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [gate(False, step="other_runs", reason="run r2: running")]})
    with pytest.raises(StageError) as stopped:
        run(teardown(action, confirm="all"))
    assert (stopped.value.step, stopped.value.reason) == ("other_runs", "run r2: running")
    assert action.modules() == ["teardown_gate"] and pod.calls() == []


def test_the_gate_judges_the_instance_when_the_meter_stops_and_not_otherwise() -> None:
    assert teardown(FakeAction({})).gate_args()["instance"] is True
    assert teardown(FakeAction({}), stop_meter=False).gate_args()["instance"] is False
    assert teardown(FakeAction({}), meter_stop_verb="none").gate_args()["instance"] is False


def test_stop_running_without_confirmation_signals_nothing() -> None:
    action = FakeAction({"teardown_gate": [gate(False, step="run_alive", state="running", reason="run r1 is alive")]})
    with pytest.raises(StageError) as stopped:
        run(teardown(action, stop_running=True))
    assert stopped.value.step == "stop_running" and "confirm_teardown=b1" in stopped.value.reason
    assert action.modules() == ["teardown_gate"]


def test_stop_running_in_check_mode_signals_nothing() -> None:
    action = FakeAction({"teardown_gate": [gate(False, step="run_alive", state="running")]}, check_mode=True)
    with pytest.raises(StageError, match="check mode stops nothing"):
        run(teardown(action, stop_running=True, confirm="all"))
    assert action.modules() == ["teardown_gate"]


def test_stop_running_confirmed_stops_the_live_run_then_judges_again(pod: Provider) -> None:
    stopped = {"changed": True, "state": "stopped", "msg": "stopped run r1 (pgid 41): 2 process(es)"}
    action = FakeAction(
        {
            "teardown_gate": [gate(False, step="run_alive", state="running"), gate()],
            "training_run": [stopped],
            "run_scratch": [scratch_answer],
        }
    )
    flow = teardown(action, stop_running=True, confirm="b1")
    assert run(flow)[0] == "TORN_DOWN"
    assert "runs r1: stopped by teardown (stop_running): run r1 (pgid 41): 2 process(es); gate passed" in lines.line(
        flow.record | {"status": "TORN_DOWN"}
    )
    assert action.modules() == ["teardown_gate", "training_run", "teardown_gate", "run_scratch"]
    assert action.calls[1]["args"]["state"] == "stopped" and action.calls[1]["args"]["run"] == "r1"
    assert action.calls[1]["args"]["stopped_by"] == "teardown"  # its cells then read "stopped by teardown at HH:MM"


def test_a_manual_verb_is_stop_by_hand_not_torn_down(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, confirm="b1", meter_stop_verb="shutdown", meter_stop_verbs={"shutdown": SHUTDOWN})
    status, step, _reason = run(flow)
    assert (status, step) == ("STOP_BY_HAND", "meter_stop")
    assert flow.record["meter_stop"]["steps"] == SHUTDOWN["manual_steps"] and pod.calls() == []


def test_a_failing_status_cli_fails_loudly_never_gone(pod: Provider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_STATUS_FAULT", "traceback")
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, confirm="b1", meter_stop_timeout_s=0.3)
    with pytest.raises(StageError) as stopped:
        run(flow)
    assert stopped.value.step == "meter_stop"
    assert flow.record["meter_stop"]["state"] == "failed" and flow.record["meter_stop"]["gone"] is False
    # The verb ran, but nothing the provider said proves the pod stopped: failed, never "gone".
    assert [call[:3] for call in pod.calls()].count(["runpodctl", "pod", "stop"]) == 1


def test_a_scratch_that_fails_its_durable_recheck_stops_before_the_meter(pod: Provider) -> None:
    changed = {"failed": True, "msg": "run_scratch stopped: the durable copy changed since the gate (run r1, cell a)"}
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [changed]})
    with pytest.raises(StageError) as stopped:
        run(teardown(action, confirm="b1"))
    assert stopped.value.step == "scratch" and "changed since the gate" in stopped.value.reason
    assert pod.calls() == []


def test_survival_is_read_from_the_verb_that_runs() -> None:
    # delete's declaration keeps only durable_dir: fine; a verb that keeps nothing refuses the box.
    wiped = dict(DELETE, survives=[])
    action = FakeAction({"teardown_gate": [gate()]})
    with pytest.raises(StageError) as stopped:
        run(teardown(action, confirm="b1", meter_stop_verb="delete", meter_stop_verbs={"delete": wiped}))
    assert stopped.value.step == "survival" and "does not survive delete" in stopped.value.reason


def test_an_irreversible_verb_is_warned_about_before_the_scratch_goes(pod: Provider) -> None:
    warnings: List[str] = []
    order: List[str] = []

    def scratch(args: Dict[str, Any]) -> Dict[str, Any]:
        order.append(f"scratch after {len(warnings)} warning(s)")
        return scratch_answer(args)

    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch]})
    flow = teardown(action, confirm="b1", meter_stop_verb="delete", meter_stop_verbs={"delete": DELETE})
    assert run(flow, warnings)[0] == "TORN_DOWN"
    assert order == ["scratch after 1 warning(s)"] and "IRREVERSIBLE" in warnings[0]
    assert action.calls[0]["args"]["irreversible"] is True  # the gate checks the filesystems for it


def test_a_load_verify_string_renders_each_artifact_as_one_argument() -> None:
    command = "python3 -c 'import sys; open(sys.argv[1], \"rb\").read()' {{ artifact }}"
    action = FakeAction(
        {"teardown_gate": [gate()], "load_verify": [lambda args: {"passed": True, "checks": [{"rc": 0}]}]}
    )
    flow = teardown(action, {"teardown_load_verify_cmd": command}, meter_stop_verb="none")
    flow.run_gate()
    flow.load_verify()
    checks = action.calls[1]["args"]["checks"]
    assert checks == [
        {
            "artifact": "r1/cells/a/my best.pth",
            "argv": [
                "python3",
                "-c",
                'import sys; open(sys.argv[1], "rb").read()',
                "/durable/runs/r1/cells/a/my best.pth",
            ],
        }
    ]
    assert flow.record["load_verify"] == {"on": "box", "ran": True, "checks": 1, "failed": []}


def test_load_verify_patterns_that_match_nothing_refuse_the_box() -> None:
    action = FakeAction({"teardown_gate": [gate()]})
    flow = teardown(action, {"teardown_load_verify_cmd": ["true"]}, load_verify_artifacts=["*.safetensors"])
    flow.run_gate()
    with pytest.raises(StageError, match="match none of the 1 artifacts"):
        flow.load_verify()


def test_an_id_the_provider_does_not_list_is_wrong_when_the_box_answered(provider: Provider) -> None:
    # A typo or a stale id read as "already gone" used to end TORN_DOWN while the box's own pod billed on.
    provider.add("pod-2")
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, confirm="b1")
    with pytest.raises(StageError) as stopped:
        run(flow)
    assert (
        stopped.value.step == "meter_stop" and "lists no instance pod-1, yet the box answered" in stopped.value.reason
    )
    assert [call[:3] for call in provider.calls()] == [["runpodctl", "pod", "list"]]  # nothing stopped


def test_an_exited_pod_whose_box_answered_is_a_stale_id_refused_before_the_stop(provider: Provider) -> None:
    # The provider said EXITED seconds after the box answered the gate: the id names another pod. It used to end
    # TORN_DOWN ("already EXITED, nothing run") while the box billed on.
    provider.add("pod-1", "--status", "exited")
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, confirm="b1")
    with pytest.raises(StageError) as stopped:
        run(flow)
    assert stopped.value.step == "meter_stop" and lines.status_of_step(stopped.value.step) == "FAILED"
    assert "instance pod-1 is already EXITED, yet the box answered" in stopped.value.reason
    assert flow.record["meter_stop"]["state"] == "failed" and flow.record["meter_stop"]["stale_id"] is True
    assert [call[:3] for call in provider.calls()] == [["runpodctl", "pod", "list"]]  # nothing stopped


def test_a_delete_of_a_stopped_pod_whose_box_answered_is_refused_as_a_stale_id(provider: Provider) -> None:
    # EXITED is final for the profile's stop verb: to its delete verb it is a stopped pod that is not this box.
    provider.add("pod-1", "--status", "exited")
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    verbs = {"stop": STOP, "delete": DELETE}
    flow = teardown(action, confirm="b1", meter_stop_verb="delete", meter_stop_verbs=verbs)
    with pytest.raises(StageError, match="is already EXITED, yet the box answered"):
        run(flow)
    assert ["runpodctl", "pod", "delete", "pod-1"] not in provider.calls() and "pod-1" in provider.instances()


def test_known_bad_files_are_kept_in_the_record_and_named_on_the_line_once(pod: Provider) -> None:
    # The line used to say "10 new; 5 files verified" and nothing of the copies a check of the run refused.
    bad = [
        {"path": "cells/b/model.safetensors", "bad": "non-finite"},
        {"path": "cells/c/best.pt", "bad": "verify_cmd"},
    ]
    answer = gate()
    answer["runs"][0]["durable"]["manifest"] = {"lines": 3, "bad_lines": [], "known_bad": bad}
    flow = teardown(FakeAction({"teardown_gate": [answer], "run_scratch": [scratch_answer]}), confirm="b1")
    assert run(flow)[0] == "TORN_DOWN" and flow.record["gate"]["runs"][0]["known_bad"] == bad
    named = "2 known bad: cells/b/model.safetensors (non-finite), cells/c/best.pt (verify_cmd)"
    assert f"r1 1/1 cells done, durable 1 files, 4 B verified, {named}" in lines.line(
        flow.record | {"status": "TORN_DOWN"}
    )
    pulled = {"to": "/pulls/b1", "runs": [{"run": "r1", "received_count": 10, "files": 5, "bytes": 2048}]}
    line = lines.line(flow.record | {"status": "TORN_DOWN", "pull": pulled})
    assert f"pulled to /pulls/b1 (10 new; 5 files, 2.0 KiB verified; {named})" in line and line.count("known bad") == 1


def test_a_failed_load_check_keeps_what_the_command_said() -> None:
    said = "Traceback (most recent call last):\n  ...\n_pickle.UnpicklingError: invalid load key, '\\x00'."
    check = {"artifact": "r1/cells/a/my best.pth", "rc": 1, "timed_out": False, "output_tail": said}
    answer = {"passed": False, "checks": [check], "reason": "load check of r1/cells/a/my best.pth exited with 1"}
    action = FakeAction({"teardown_gate": [gate()], "load_verify": [answer]})
    flow = teardown(action, {"teardown_load_verify_cmd": ["python3", "-c", "...", "{{ artifact }}"]})
    flow.run_gate()
    with pytest.raises(StageError) as stopped:
        flow.load_verify()
    assert stopped.value.step == "load_verify" and "invalid load key" in stopped.value.reason
    assert flow.record["load_verify"]["failed"][0]["output_tail"].endswith("invalid load key, '\\x00'.")


def test_an_unreachable_box_is_told_with_what_the_provider_says_of_its_instance(pod: Provider) -> None:
    # A teardown run again after a meter-stop finds the pod stopped and its box silent: say so, read-only.
    flow = teardown(FakeAction({}))
    assert flow.provider_state() == "the provider says instance pod-1 is RUNNING (not stopped: it may bill)"
    assert ["runpodctl", "pod", "stop", "pod-1"] not in pod.calls()
    assert flow.record["meter_stop"] == {"state": "box_unreachable", "provider_state": "RUNNING", "stopped": False}
    subprocess.run(["runpodctl", "pod", "stop", "pod-1"], check=True, capture_output=True)
    assert flow.provider_state() == "the provider says instance pod-1 is EXITED (stopped: only its storage may bill)"


def test_an_unreachable_box_in_check_mode_calls_nothing(pod: Provider) -> None:
    assert teardown(FakeAction({}, check_mode=True)).provider_state() == "" and pod.calls() == []


def started(hours_ago: float) -> str:
    return (datetime.now(timezone.utc) - timedelta(hours=hours_ago)).isoformat()


def test_the_record_costs_the_host_s_rate_since_the_box_started(pod: Provider) -> None:
    answer = dict(gate(), instance={"other_runs": [], "box_started_at": started(2)})
    action = FakeAction({"teardown_gate": [answer], "run_scratch": [scratch_answer]})
    flow = teardown(action, {"hourly_usd": 2.5}, confirm="b1")
    assert run(flow) == ("TORN_DOWN", None, "")
    cost = flow.record["cost"]
    assert cost["hourly_usd"] == 2.5 and 4.99 <= cost["usd"] <= 5.01 and cost["since"].endswith("Z")
    assert cost["meter_stopped"] is True  # the pod was stopped: it leaves the fleet's total per hour
    assert flow.record["warnings"] == []
    line = lines.line(dict(flow.record, status="TORN_DOWN"))
    assert re.search(r"; \$5\.0\d so far since \d\d-\d\d \d\d:\d\d at \$2\.50/h$", line), line


def test_a_refused_box_still_tells_its_cost_and_the_rate_alone_before_the_gate_answers() -> None:
    refusal = dict(gate(False, step="cells", reason="cells not done"), instance={"box_started_at": started(1)})
    flow = teardown(FakeAction({"teardown_gate": [refusal]}), {"hourly_usd": 1})
    assert flow.record["cost"] == {"hourly_usd": 1.0, "since": None, "hours": None, "usd": None}
    with pytest.raises(StageError):
        run(flow)
    assert 0.99 <= flow.record["cost"]["usd"] <= 1.01


@pytest.mark.parametrize("rate", ["abc", -1, True, float("nan")])
def test_a_bad_hourly_usd_is_a_warning_and_the_teardown_goes_on(pod: Provider, rate: Any) -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, {"hourly_usd": rate}, confirm="b1")
    assert run(flow) == ("TORN_DOWN", None, "")
    assert flow.record["cost"] is None
    assert [w.split(" (>= 0), not ", maxsplit=1)[0] for w in flow.record["warnings"]] == [
        "hourly_usd: must be a number of US dollars per hour"
    ]


def test_without_hourly_usd_there_is_no_cost_and_no_warning(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [scratch_answer]})
    flow = teardown(action, confirm="b1")
    run(flow)
    assert flow.record["cost"] is None and flow.record["warnings"] == []
    assert "/h" not in lines.line(dict(flow.record, status="TORN_DOWN"))


# --- issue 29, item 3: the box lease ---------------------------------------------------------------------------------


def held_gate(passed: bool = True, **more: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """The gate's answer with the lease it took for the token it was given (as teardown_gate's hold_box does)."""

    def answer(args: Dict[str, Any]) -> Dict[str, Any]:
        lease = {"holder": "teardown", "token": args["hold_box"]["token"], "since": "x", "until": "y"}
        return dict(gate(passed, **more), lease=lease, held_by=None)

    return answer


def test_the_gate_takes_the_box_the_long_steps_refresh_it_and_it_is_given_back_before_the_stop(pod: Provider) -> None:
    action = FakeAction(
        {
            "teardown_gate": [held_gate()],
            "load_verify": [lambda args: {"passed": True, "checks": [{"rc": 0}]}],
            "run_scratch": [scratch_answer],
        }
    )
    stops_seen: List[int] = []
    action.on_lease = lambda args: stops_seen.append(len(pod.calls()))
    flow = teardown(action, {"teardown_load_verify_cmd": ["true", "{{ artifact }}"]}, confirm="b1")
    assert run(flow) == ("TORN_DOWN", None, "")
    hold = action.calls[0]["args"]["hold_box"]
    assert hold["token"].startswith("teardown-") and hold["ttl_s"] == 300  # no pull: the next step's slack
    steps = [(lease.get("state", "held"), lease.get("ttl_s"), lease["after"][-1]) for lease in action.leases]
    assert steps == [
        ("held", 600.0, "teardown_gate"),  # load-verify: 300 s for its one check, plus slack
        ("held", 900.0, "load_verify"),  # the scratch: 600 s, plus slack
        ("released", None, "run_scratch"),
    ]
    assert {lease["token"] for lease in action.leases} == {hold["token"]}
    assert all(lease["check_mode"] is False for lease in action.leases)
    assert stops_seen == [0, 0, 0]  # given back before the meter-stop ran
    assert [call[:3] for call in pod.calls()].count(["runpodctl", "pod", "stop"]) == 1


def test_a_teardown_that_stops_early_gives_the_box_back(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [held_gate(False, step="durable", reason="run r1: no copy")]})
    with pytest.raises(StageError, match="no copy"):
        run(teardown(action, confirm="b1"))
    assert [(lease.get("state"), lease["after"]) for lease in action.leases] == [("released", ["teardown_gate"])]


def test_a_box_another_stage_holds_is_refused_and_its_lease_left_alone() -> None:
    other = {"holder": "autostop", "token": "w", "since": "x", "until": "y"}
    refused = dict(gate(False, step="box_lease", reason="the box is held by autostop"), lease=None, held_by=other)
    action = FakeAction({"teardown_gate": [refused]})
    with pytest.raises(StageError) as stopped:
        run(teardown(action, confirm="b1"))
    assert stopped.value.step == "box_lease" and lines.status_of_step("box_lease") == "REFUSED"
    assert action.leases == []  # nothing taken, nothing given back


def test_check_mode_holds_nothing() -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [{"changed": True, "would_remove": []}]}, True)
    assert run(teardown(action, confirm="b1"))[0] == "CHECKED"
    assert "hold_box" not in action.calls[0]["args"] and action.leases == []


def test_the_gate_hears_what_the_verb_keeps_and_the_gpu_users_opt_in(pod: Provider) -> None:
    action = FakeAction({"teardown_gate": [gate()], "run_scratch": [{"changed": True, "would_remove": []}]})
    run(teardown(action, abandon_gpu_users=True))
    args = action.calls[0]["args"]
    assert (args["survives"], args["abandon_gpu_users"]) == (STOP["survives"], True)
    assert lines.status_of_step("gpu_users") == "REFUSED"
