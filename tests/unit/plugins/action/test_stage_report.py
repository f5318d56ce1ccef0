"""stage_report reports every host of the play, keeps only a record's known keys, and fails when it cannot write."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Dict
from unittest.mock import MagicMock

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
