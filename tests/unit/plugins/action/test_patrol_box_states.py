"""A box that does not answer is asked about at its provider (the fake runpodctl and vastai, the profiles' status
commands) and told apart: STOPPED by our autostop or teardown (quiet, exit 0, bills storage), INTERRUPTED (a warning,
once), GONE and UNREACHABLE (alarms, exit code 4); a stopped box bills its storage, not its GPU rate (issue 29,
items 7 and 10). Each tick goes through the patrol action, stage_report (report, notifications) and stage_verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from unittest.mock import MagicMock

import pytest
import yaml
from ansible.errors import AnsibleConnectionFailure

from ansible_collections.remote_gpu.trainer.plugins.action import stage_report, stage_verdict
from ansible_collections.remote_gpu.trainer.plugins.action.patrol import ActionModule
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_billing import clock
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._report import write_report
from ansible_collections.remote_gpu.trainer.tests.workload.harness import FAKE_PROVIDER, Provider

PROFILES = Path(__file__).resolve().parents[4] / "inventories" / "group_vars"
POD, VAST = "pod7stop2k4m", "27331234"
DOWN = AnsibleConnectionFailure("ssh: connect to host 10.0.0.9 port 22: Connection refused")


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def at(moment: datetime) -> str:
    """How a line shows ``moment``: 03:41 UTC today, with its date on another day."""
    return clock(iso(moment), datetime.now(timezone.utc))


def profile(platform: str, instance_id: str, **more: Any) -> Dict[str, Any]:
    """The host's variables as the shipped profile gives them, instance_id rendered in (no templar in these tests)."""
    text = (PROFILES / f"{platform}.yml").read_text().replace("{{ instance_id }}", instance_id)
    return {
        **yaml.safe_load((PROFILES / "all.yml").read_text()),
        **yaml.safe_load(text),
        "instance_id": instance_id,
        **more,
    }


def patrol(host_vars: Dict[str, Any], answer: Any) -> Dict[str, Any]:
    task = MagicMock(args={"data_dir": "/data"}, async_val=0, check_mode=False, action="remote_gpu.trainer.patrol")
    action = ActionModule(task, MagicMock(), MagicMock(), loader=None, templar=None, shared_loader_obj=None)

    def execute(module_name: str, module_args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        if isinstance(answer, Exception):
            raise answer
        return answer

    action._execute_module = execute  # type: ignore[method-assign]
    action._remove_tmp_path = MagicMock()  # type: ignore[method-assign]
    return action.run(task_vars={"inventory_hostname": "b1", **host_vars})


def tick(host_vars: Dict[str, Any], answer: Any, reports: Path) -> Dict[str, Any]:
    """One tick of b1 as the playbook runs it: its record, the report's lines and notifications, the verdict."""
    record = patrol(dict(host_vars, patrol_report_dir=str(reports)), answer)
    play = {"ansible_play_hosts_all": ["b1"], "hostvars": {"b1": {"patrol_box": record}}}
    args = {"stage": "patrol", "result_var": "patrol_box", "report_dir": str(reports), "notify": {}}
    task = MagicMock(args=args, async_val=0, check_mode=False)
    report = stage_report.ActionModule(task, MagicMock(), MagicMock(), None, None, None).run(task_vars=play)
    args = {"result": record, "failing": [], "escalated_fails": True, "fleet_var": "patrol_box"}
    task = MagicMock(args=args, async_val=0, check_mode=False)
    verdict = stage_verdict.ActionModule(task, MagicMock(), MagicMock(), None, None, None).run(task_vars=play)
    document = json.loads(Path(report["report"]).read_text())
    return {"record": record, "said": report["msg"], "verdict": verdict, "report": document}


def exit_code(verdict: Dict[str, Any]) -> int:
    return 2 if verdict.get("failed") else 4 if verdict.get("unreachable") else 0


def sent(said: List[str]) -> List[str]:
    return [line for line in said if line.startswith("not sent (patrol_notify_webhook_url is not set)")]


def seen_running(
    reports: Path, autostop: Optional[Dict[str, Any]], now: datetime, booted: Optional[datetime] = None
) -> None:
    """A previous tick's report in which b1 answered (billing since 5 h ago), with ``autostop`` facts."""
    box = {"since": iso(now - timedelta(hours=5)), "container_started_at": iso(booted or now - timedelta(hours=5))}
    record = {"host": "b1", "status": "DONE", "state": "done", "reachable": True, "box": box, "autostop": autostop}
    write_report(str(reports), "patrol", {"generated_at": iso(now - timedelta(minutes=30)), "hosts": [record]})


def stopped_autostop(at: datetime) -> Dict[str, Any]:
    return {
        "armed": True, "state": "stopped", "generation_current": True, "watcher_alive": False, "trigger": "idle",
        "updated_at": iso(at), "stop": {"issued_at": iso(at), "outcome": "stopped", "final_state": "EXITED"},
    }  # fmt: skip


@pytest.fixture
def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def test_a_box_its_autostop_stopped_is_stopped_quiet_exit_0_and_bills_storage(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add(POD, "--status", "exited")
    stop = now - timedelta(hours=1)
    seen_running(tmp_path, stopped_autostop(stop), now)
    host = profile("runpod", POD, hourly_usd=2.0, hourly_usd_stopped=0.01)
    first = tick(host, DOWN, tmp_path)
    record = first["record"]
    assert (record["status"], record["box_state"], record["escalate"], record["problems"]) == (
        "STOPPED", "STOPPED", False, []
    )  # fmt: skip
    assert record["our_stop"]["by"] == "autostop" and record["our_stop"]["at"] == iso(stop)
    assert record["line"] == (
        f"b1  STOPPED  by autostop at {at(stop)}; the provider says EXITED | bills storage ($0.01/h: the pod "
        "volume (/workspace), until the pod is deleted), $8.01 so far"
    )
    # GPU hours end at the stop (4 h at $2.00), storage since (1 h at $0.01); the fleet counts the storage rate.
    assert record["cost"]["hours"] == pytest.approx(4.0, abs=0.01) and record["cost"]["storage_usd"] == 0.01
    assert first["report"]["summary"]["hourly_usd_total"] == 0.01
    assert first["report"]["summary"]["line"] == "1 hosts: 1 stopped; stopped: b1; $0.01/h"
    assert exit_code(first["verdict"]) == 0 and sent(first["said"]) == []
    assert "notifications: none due (no new problem, nothing cleared)" in first["said"]
    # The next tick finds the stop this tick carried (the box's own record is out of reach while it is down).
    second = tick(host, DOWN, tmp_path)
    assert second["record"]["box_state"] == "STOPPED" and second["record"]["our_stop"]["at"] == iso(stop)
    assert exit_code(second["verdict"]) == 0 and sent(second["said"]) == []


def test_an_autostop_past_its_due_time_on_the_last_tick_stopped_the_box(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add(POD, "--status", "exited")
    due = now - timedelta(minutes=10)
    waiting = {
        "armed": True, "state": "idle_wait", "generation_current": True, "watcher_alive": True, "due_at": iso(due)
    }  # fmt: skip
    seen_running(tmp_path, waiting, now)
    record = tick(profile("runpod", POD), DOWN, tmp_path)["record"]
    assert record["box_state"] == "STOPPED" and record["our_stop"]["inferred"] is True
    assert record["line"].startswith(f"b1  STOPPED  by autostop at {at(due)} (it was due; ")


def test_a_stop_without_ours_is_interrupted_a_warning_once_never_re_rent(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add(POD, "--status", "exited")
    seen_running(tmp_path, None, now)
    first = tick(profile("runpod", POD, hourly_usd=2.0), DOWN, tmp_path)
    record = first["record"]
    assert (record["status"], record["box_state"], record["problems"]) == (
        "INTERRUPTED",
        "INTERRUPTED",
        ["interrupted"],
    )
    assert record["line"].startswith(
        "b1  INTERRUPTED  the provider says EXITED and no stop of ours is on record (outbid, preempted or a host "
        "fault): results not copied off the box may be stranded | bills storage (rate unknown: set hourly_usd_stopped"
    )
    assert "re-rent" not in " ".join(first["said"]) and first["report"]["summary"]["re_rent"] == []
    assert exit_code(first["verdict"]) == 0
    warned = sent(first["said"])
    assert len(warned) == 1 and ":warning: *b1* interrupted: the provider says EXITED" in warned[0]
    assert sent(tick(profile("runpod", POD, hourly_usd=2.0), DOWN, tmp_path)["said"]) == []


def test_vast_exited_while_its_intended_status_is_running_is_interrupted_even_after_our_stop(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add(VAST, "--status", "exited")  # the provider's own stop: intended_status stays running
    seen_running(tmp_path, stopped_autostop(now - timedelta(hours=2)), now)
    record = tick(profile("vastai", VAST), DOWN, tmp_path)["record"]
    assert record["box_state"] == "INTERRUPTED" and record["provider"]["intended"] == "running"
    assert "while the instance's intended state is running: stopped by the provider" in record["line"]


def test_vast_stopped_by_its_owner_is_stopped(provider: Provider, tmp_path: Path, now: datetime) -> None:
    provider.add(VAST, "--status", "exited", "--intended", "stopped")
    record = tick(profile("vastai", VAST), DOWN, tmp_path)["record"]
    assert record["box_state"] == "STOPPED"
    assert record["line"].startswith("b1  STOPPED  by its owner (intended state stopped, no stop of ours on record)")


def test_a_teardown_that_stopped_the_meter_after_the_last_tick_is_our_stop(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add(POD, "--status", "exited")
    seen_running(tmp_path, None, now)
    stopped_at = now - timedelta(minutes=5)
    torn = {
        "host": "b1",
        "status": "TORN_DOWN",
        "meter_stop": {"state": "stopped"},
        "cost": {"stopped_at": iso(stopped_at)},
    }
    write_report(str(tmp_path), "teardown", {"generated_at": iso(now), "hosts": [torn]})
    record = tick(profile("runpod", POD), DOWN, tmp_path)["record"]
    assert record["box_state"] == "STOPPED" and record["our_stop"]["by"] == "teardown"
    assert record["line"].startswith(f"b1  STOPPED  by teardown at {at(stopped_at)}; the provider says EXITED")


def test_a_teardown_stop_older_than_the_last_tick_that_saw_the_box_run_is_history(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add(POD, "--status", "exited")
    torn = {"host": "b1", "status": "TORN_DOWN", "meter_stop": {"state": "stopped"}}
    write_report(str(tmp_path), "teardown", {"generated_at": iso(now - timedelta(days=1)), "hosts": [torn]})
    seen_running(tmp_path, None, now)  # restarted since: patrol saw it run half an hour ago
    assert tick(profile("runpod", POD), DOWN, tmp_path)["record"]["box_state"] == "INTERRUPTED"


def test_an_instance_the_provider_no_longer_lists_is_gone_an_alarm_exit_4(
    provider: Provider, tmp_path: Path, now: datetime
) -> None:
    provider.add("someotherpod")
    seen_running(tmp_path, stopped_autostop(now - timedelta(hours=1)), now)
    done = tick(profile("runpod", POD, hourly_usd=2.0), DOWN, tmp_path)
    record = done["record"]
    assert (record["status"], record["box_state"], record["problems"], record["actions"]) == (
        "UNREACHABLE", "GONE", ["gone"], ["re_rent"]
    )  # fmt: skip
    assert record["line"].startswith(
        "b1  GONE  the provider no longer lists the instance: whatever was only on the box is lost (re-rent) | "
        "bills nothing more, $"
    )
    assert exit_code(done["verdict"]) == 4 and done["report"]["summary"]["re_rent"] == ["b1"]
    assert len(sent(done["said"])) == 1 and done["report"]["summary"]["hourly_usd_total"] == 0.0


@pytest.mark.parametrize(
    "case",
    [
        ({}, [POD], "; the provider says RUNNING: the meter runs"),
        ({"instance_id": ""}, [POD], "; the provider was not asked: no instance_id for this host"),
        ({"meter_stop_verb": "none"}, [POD],
         "; the provider was not asked: no status command to ask it with (meter_stop_verb is none)"),
        ({}, ["set", "--status-fault", "auth"],
         "; the provider was not asked: runpodctl pod list --all --output json exited 1: API key not found"),
    ],
)  # fmt: skip
def test_unreachable_when_the_provider_says_running_or_cannot_be_asked_and_says_which(
    provider: Provider, tmp_path: Path, now: datetime, case: Tuple[Dict[str, Any], List[str], str]
) -> None:
    host_vars, setup, why = case
    if setup[0] == "set":
        provider.add(POD)
        subprocess.run([sys.executable, str(FAKE_PROVIDER), *setup, "--state", str(provider.state)], check=True)
    else:
        provider.add(*setup)
    seen_running(tmp_path, stopped_autostop(now - timedelta(hours=1)), now)
    done = tick({**profile("runpod", POD), **host_vars}, DOWN, tmp_path)
    record = done["record"]
    assert (record["status"], record["box_state"], record["problems"]) == (
        "UNREACHABLE",
        "UNREACHABLE",
        ["unreachable"],
    )
    assert record["line"].startswith(f"b1  UNREACHABLE  {DOWN}{why}")
    assert exit_code(done["verdict"]) == 4 and len(sent(done["said"])) == 1


def test_a_box_whose_stop_still_answers_ssh_bills_storage_from_the_stop_not_its_gpu_rate(
    tmp_path: Path, now: datetime
) -> None:
    """After a self-stop patrol kept counting the GPU rate ($0.06, then $0.07) and the fleet's $/h kept the box."""
    stop = now - timedelta(hours=1)
    box = {
        "since": iso(now - timedelta(hours=3)), "container_started_at": iso(now - timedelta(hours=3)),
        "live_runs": [], "idle": True, "idle_since": iso(now - timedelta(hours=2)), "runs_done": ["r1"],
    }  # fmt: skip
    facts = {"state": "done", "escalate": False, "headline": "DONE run r1: 1/1 cells done", "box": box,
             "autostop": stopped_autostop(stop)}  # fmt: skip
    done = tick(profile("runpod", POD, hourly_usd=2.0, hourly_usd_stopped=0.05), facts, tmp_path)
    record = done["record"]
    assert (record["status"], record["box_state"], record["escalate"]) == ("DONE", "STOPPED", False)
    assert record["cost"]["hours"] == pytest.approx(2.0, abs=0.01) and record["cost"]["usd"] == 4.05
    assert record["cost"]["stopped_at"] == iso(stop) and record["cost"]["hourly_usd_stopped"] == 0.05
    assert record["line"].endswith(
        f"| STOPPED by autostop at {at(stop)}: bills storage ($0.05/h: the pod volume (/workspace), until the "
        "pod is deleted), $4.05 so far"
    )
    assert "$2.00/h" not in record["line"] and done["report"]["summary"]["hourly_usd_total"] == 0.05
    assert exit_code(done["verdict"]) == 0 and sent(done["said"]) == []
