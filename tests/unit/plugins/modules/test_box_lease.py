"""box_lease through its argument spec (issue 29, item 3): a stage holds the box across calls, another is kept out
until the lease is given back or expires, and check mode writes nothing."""

from __future__ import annotations

import time
from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state
from ansible_collections.remote_gpu.trainer.plugins.modules import box_lease


def test_held_refreshed_refused_to_another_then_released(run_module, instance_dir: Path) -> None:
    code, taken = run_module(box_lease, {"token": "td-1", "ttl_s": 60})
    assert (code, taken["changed"], taken["lease"]["holder"], taken["lease"]["token"]) == (0, True, "teardown", "td-1")
    code, refreshed = run_module(box_lease, {"token": "td-1", "ttl_s": 3600})
    assert code == 0 and refreshed["lease"]["since"] == taken["lease"]["since"]
    held = _box_state.active_lease()
    assert held is not None and 3590 < held["until_epoch"] - time.time() <= 3600
    code, other = run_module(box_lease, {"token": "w-2", "holder": "autostop"})
    assert code == 1 and other["msg"].startswith("the box is held by teardown since ")
    assert other["held_by"]["token"] == "td-1" and other["lease"] is None
    code, foreign = run_module(box_lease, {"token": "w-2", "state": "released"})
    assert (code, foreign["changed"], foreign["released"]) == (0, False, False)
    assert _box_state.active_lease() is not None  # another token never gives the box back
    code, released = run_module(box_lease, {"token": "td-1", "state": "released"})
    assert (code, released["changed"], released["released"]) == (0, True, True)
    assert _box_state.active_lease() is None


def test_check_mode_writes_nothing(run_module, instance_dir: Path) -> None:
    code, result = run_module(box_lease, {"token": "td-1"}, check_mode=True)
    assert (code, result["changed"], result["lease"]) == (0, True, None)
    assert not (instance_dir / _box_state.LEASE).exists()
    assert _box_state.take_lease("teardown", "td-1", 60) is None
    code, result = run_module(box_lease, {"token": "td-1", "state": "released"}, check_mode=True)
    assert (code, result["changed"]) == (0, True) and _box_state.active_lease() is not None


def test_bad_options_fail_in_one_line_naming_them(run_module) -> None:
    for args, message in (
        ({"token": "a b"}, "token must match "),
        ({"token": "t", "ttl_s": 0}, "ttl_s"),
        ({"token": "t", "ttl_s": 99999}, "ttl_s"),
        ({"token": "t", "holder": "Who Me"}, "holder must match "),
    ):
        code, result = run_module(box_lease, args)
        assert code == 1 and message in result["msg"] and "\n" not in result["msg"], result["msg"]
