"""stage_report reports every host of the play, keeps only a record's known keys, and fails when it cannot write."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Dict
from unittest.mock import MagicMock

import pytest

from ansible_collections.remote_gpu.trainer.plugins.action import stage_report
from ansible_collections.remote_gpu.trainer.plugins.action.stage_report import ActionModule


def report(args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
    task = MagicMock(args=args, async_val=0, check_mode=False)
    action = ActionModule(task, MagicMock(), MagicMock(), loader=None, templar=None, shared_loader_obj=None)
    return action.run(task_vars=task_vars)


def test_every_host_of_the_play_is_reported_and_nothing_raw_is_kept(tmp_path: Path) -> None:
    torn = {"host": "b1", "status": "TORN_DOWN", "line": "b1  TORN_DOWN  runs all: ...", "invocation": {"x": 1}}
    task_vars = {
        "ansible_play_hosts_all": ["b1", "b2"],  # b2 failed before its teardown step: no record
        "hostvars": {"b1": {"teardown_box": torn}, "b2": {}},
    }
    result = report({"stage": "teardown", "result_var": "teardown_box", "report_dir": str(tmp_path)}, task_vars)
    assert not result.get("failed")
    assert result["msg"][0] == "b1  TORN_DOWN  runs all: ..."
    assert result["msg"][1].startswith("b2  REFUSED  runs ? at validate: no teardown record")
    assert result["msg"][2] == "SUMMARY: 2 hosts: 1 TORN_DOWN, 1 REFUSED; refused: b2 (validate)"
    document = json.loads(Path(result["report"]).read_text())
    assert [host["host"] for host in document["hosts"]] == ["b1", "b2"]
    assert "invocation" not in document["hosts"][0]
    assert stat.S_IMODE(os.stat(result["report"]).st_mode) == 0o600


def test_a_report_that_cannot_be_written_fails_after_the_lines(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    task_vars = {"ansible_play_hosts_all": ["b1"], "hostvars": {"b1": {}}}
    result = report(
        {"stage": "teardown", "result_var": "teardown_box", "report_dir": str(tmp_path / "file")}, task_vars
    )
    assert result.get("failed") is True
    assert result["msg"][0].startswith("b1  REFUSED") and result["msg"][-1].startswith("report NOT written")


def patrol_record(host: str, **facts: Any) -> Dict[str, Any]:
    record = {"host": host, "state": "running", "escalate": False, "problems": [], "reasons": [], "reachable": True}
    record.update(facts)
    record["status"] = record["state"].upper()
    record["line"] = f"{host}  {record['status']}"
    return record


def test_a_patrol_tick_reports_every_host_and_keeps_the_notification_state(tmp_path: Path) -> None:
    crashed = patrol_record(
        "b1", state="crashed", escalate=True, problems=["crashed:alpha"], reasons=["alpha: the runner is gone"]
    )
    task_vars = {"ansible_play_hosts_all": ["b1", "b2"], "hostvars": {"b1": {"patrol_box": crashed}, "b2": {}}}
    args = {"stage": "patrol", "result_var": "patrol_box", "report_dir": str(tmp_path), "notify": {"timeout_s": 5}}
    result = report(args, task_vars)
    assert not result.get("failed")
    assert result["msg"][0] == "b1  CRASHED"
    assert result["msg"][1] == "    alpha: the runner is gone"
    # b2 never reached its patrol step: unreachable, never dropped from the report.
    assert result["msg"][2].startswith("b2  UNREACHABLE  no patrol record")
    assert result["msg"][4].startswith("SUMMARY: 2 hosts: 1 crashed, 1 unreachable; escalated: b1 (crashed)")
    assert any(line.startswith("not sent (patrol_notify_webhook_url is not set)") for line in result["msg"])
    state = json.loads((tmp_path / "patrol-state.json").read_text())
    assert state["hosts"]["b1"]["problems"] == ["crashed:alpha"]
    assert stat.S_IMODE(os.stat(tmp_path / "patrol-state.json").st_mode) == 0o600
    document = json.loads((tmp_path / "patrol-latest.json").read_text())
    assert [host["status"] for host in document["hosts"]] == ["CRASHED", "UNREACHABLE"]


def test_a_patrol_tick_in_check_mode_sends_nothing_and_keeps_no_state(tmp_path: Path) -> None:
    crashed = patrol_record("b1", state="crashed", escalate=True, problems=["crashed:alpha"])
    task = MagicMock(async_val=0, check_mode=True)
    task.args = {
        "stage": "patrol", "result_var": "patrol_box", "report_dir": str(tmp_path),
        "notify": {"webhook_url": "http://127.0.0.1:9/hook/SECRET", "timeout_s": 5},
    }  # fmt: skip
    action = ActionModule(task, MagicMock(), MagicMock(), loader=None, templar=None, shared_loader_obj=None)
    result = action.run(task_vars={"ansible_play_hosts_all": ["b1"], "hostvars": {"b1": {"patrol_box": crashed}}})
    assert any(line.startswith("would notify: ") for line in result["msg"])
    assert not (tmp_path / "patrol-state.json").exists()
    assert "SECRET" not in json.dumps(result) and "SECRET" not in (tmp_path / "patrol-latest.json").read_text()


def test_a_patrol_tick_writes_the_fleet_page_beside_its_report(tmp_path: Path) -> None:
    crashed = patrol_record("b1", state="crashed", escalate=True, reasons=["alpha: the runner is gone"])
    task_vars = {"ansible_play_hosts_all": ["b1", "b2"], "hostvars": {"b1": {"patrol_box": crashed}, "b2": {}}}
    result = report({"stage": "patrol", "result_var": "patrol_box", "report_dir": str(tmp_path)}, task_vars)
    assert not result.get("failed")
    assert result["page"] == result["report"][: -len(".json")] + ".html"
    assert result["msg"][-2:] == [f"report: {result['report']}", f"page: {result['page']}"]
    page = Path(result["page"]).read_text()
    assert 'data-host="b1" data-state="crashed"' in page and 'data-host="b2" data-state="unreachable"' in page
    assert (tmp_path / "patrol-latest.html").read_text() == page
    assert stat.S_IMODE(os.stat(result["page"]).st_mode) == 0o600


def test_a_page_that_cannot_be_written_does_not_fail_the_tick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(json_path: str, document: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stage_report, "write_page", refuse)
    task_vars = {"ansible_play_hosts_all": ["b1"], "hostvars": {"b1": {"patrol_box": patrol_record("b1")}}}
    result = report({"stage": "patrol", "result_var": "patrol_box", "report_dir": str(tmp_path)}, task_vars)
    assert not result.get("failed") and "page" not in result
    assert result["msg"][-1] == "page NOT written: [Errno 28] No space left on device"
    assert json.loads(Path(result["report"]).read_text())["hosts"][0]["host"] == "b1"


def test_only_patrol_writes_a_page(tmp_path: Path) -> None:
    task_vars = {"ansible_play_hosts_all": ["b1"], "hostvars": {"b1": {}}}
    result = report({"stage": "teardown", "result_var": "teardown_box", "report_dir": str(tmp_path)}, task_vars)
    assert "page" not in result and not list(tmp_path.glob("*.html"))
