"""stage_verdict turns a box's record into the play's outcome, and so ansible-playbook's exit code."""

from __future__ import annotations

from typing import Any, Dict
from unittest.mock import MagicMock

import pytest

from ansible_collections.remote_gpu.trainer.plugins.action.stage_verdict import ActionModule


def verdict(args: Dict[str, Any], task_vars: Dict[str, Any] | None = None) -> Dict[str, Any]:
    task = MagicMock(args=args, async_val=0, check_mode=False)
    action = ActionModule(task, MagicMock(), MagicMock(), loader=None, templar=None, shared_loader_obj=None)
    return action.run(task_vars=task_vars or {})


def fleet(**statuses: str) -> Dict[str, Any]:
    return {
        "ansible_play_hosts_all": list(statuses),
        "hostvars": {host: {"teardown_box": {"status": status}} for host, status in statuses.items()},
    }


@pytest.mark.parametrize("status", ["REFUSED", "UNCONFIRMED", "STOP_BY_HAND", "FAILED"])
def test_a_box_that_still_bills_or_was_refused_fails_its_host(status: str) -> None:
    result = verdict({"result": {"status": status, "line": f"b1  {status}  ..."}})
    assert result.get("failed") is True and result["msg"] == f"b1  {status}  ..."


@pytest.mark.parametrize("status", ["TORN_DOWN", "CLEANED", "CHECKED"])
def test_a_box_done_is_ok(status: str) -> None:
    result = verdict({"result": {"status": status}})
    assert not result.get("failed") and not result.get("unreachable")


def test_an_unreachable_box_alone_is_unreachable_exit_4() -> None:
    result = verdict(
        {"result": {"status": "UNREACHABLE"}, "fleet_var": "teardown_box"}, fleet(b1="UNREACHABLE", b2="TORN_DOWN")
    )
    assert result.get("unreachable") is True and not result.get("failed")


def test_an_unreachable_box_beside_a_refused_one_fails_so_the_exit_code_is_2() -> None:
    result = verdict(
        {"result": {"status": "UNREACHABLE"}, "fleet_var": "teardown_box"}, fleet(b1="UNREACHABLE", b2="REFUSED")
    )
    assert result.get("failed") is True and not result.get("unreachable")


def test_no_record_is_a_failure_never_a_pass() -> None:
    result = verdict({"result": "whatever"})
    assert result.get("failed") is True and "no stage record" in result["msg"]
