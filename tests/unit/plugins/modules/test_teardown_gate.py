"""teardown_gate and copy_verify through their argument specs, on a run the real runner finished."""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_instance
from ansible_collections.remote_gpu.trainer.plugins.modules import copy_verify, teardown_gate
from ansible_collections.remote_gpu.trainer.tests.workload.harness import make_run, start_runner, train


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("box")
    run_dir = make_run(root, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    return root


def args(root: Path, **more):
    return {"run": "sweep", "data_dir": str(root / "data"), "durable_dir": str(root / "durable"), **more}


def test_the_gate_passes_changes_nothing_and_says_so(run_module, box):
    before = sorted((p, p.stat().st_mtime_ns) for p in box.rglob("*"))
    code, result = run_module(teardown_gate, args(box), check_mode=True)
    assert (code, result["changed"], result["passed"], result["msg"]) == (0, False, True, "gate passed")
    assert sorted((p, p.stat().st_mtime_ns) for p in box.rglob("*")) == before


def test_the_gate_tells_the_box_s_ledger_on_its_own_clock_and_records_none(run_module, box, instance_dir):
    started = json.loads((box / "data" / "runs" / "sweep" / "run.json").read_text())["started_at"]
    for run in ("sweep", "other"):  # passed or refused, the cost basis is told
        instance = run_module(teardown_gate, args(box, run=run))[1]["instance"]
        told = datetime.fromisoformat(instance["box_started_at"].replace("Z", "+00:00"))
        assert (
            told <= datetime.fromisoformat(started) and instance["ledger"]["first_seen"] == instance["box_started_at"]
        )
        now = datetime.fromisoformat(instance["box_now"].replace("Z", "+00:00")).timestamp()
        assert abs(now - time.time()) < 60 and instance["ledger"]["running_s"] >= 0
    assert not (instance_dir / "ledger.json").exists() and not (box / "data" / "runs" / ".instance").exists()


def test_a_refused_gate_is_not_a_module_failure_and_names_the_step(run_module, box):
    code, result = run_module(teardown_gate, args(box, run="other"))
    assert code == 0 and result.get("failed") is not True
    assert result["msg"].startswith("run_alive: run other: not found")


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"verify_timeout_s": 0}, "verify_timeout_s"),
        ({"run": "a/b"}, "run"),
        ({"data_dir": "relative"}, "data_dir must be an absolute path"),
        ({"durable_dir": ""}, "durable_dir"),
    ],
)
def test_bad_options_fail_with_one_line_naming_them(run_module, box, more, message):
    code, result = run_module(teardown_gate, args(box, **more))
    assert code == 1 and result["failed"]
    assert message in result["msg"] and "\n" not in result["msg"]


def test_copy_verify_checks_a_copy_against_the_gate_s_digests(run_module, box):
    gate = run_module(teardown_gate, args(box))[1]
    durable_run = box / "durable" / "runs" / "sweep"
    artifacts = gate["runs"][0]["artifacts"]
    code, result = run_module(copy_verify, {"path": str(durable_run), "expected": artifacts})
    assert (code, result["passed"], result["files"]) == (0, True, 1)
    target = durable_run / "cells" / "a" / "best.pth"
    original = target.read_bytes()
    try:
        target.write_bytes(original[:-1])
        broken = run_module(copy_verify, {"path": str(durable_run), "expected": artifacts})[1]
        assert broken["passed"] is False
        assert broken["msg"] == broken["reason"] and "cells/a/best.pth" in broken["msg"]
    finally:
        target.write_bytes(original)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == artifacts[0]["sha256"]
    assert os.path.getsize(target) == artifacts[0]["size"]


def test_copy_verify_refuses_a_bad_expected_entry_in_one_line(run_module, box):
    code, result = run_module(copy_verify, {"path": str(box), "expected": [{"path": "../x", "size": 1}]})
    assert code == 1
    assert result["msg"].startswith("expected: expected[0].") and "\n" not in result["msg"]


def test_run_is_an_alias_of_runs_and_every_returned_key_is_documented(run_module, box):
    code, result = run_module(teardown_gate, args(box, instance=True, irreversible=True))
    assert code == 0 and [entry["run"]["name"] for entry in result["runs"]] == ["sweep"]
    assert result["step"] == "same_filesystem"  # tmp's data and durable share one device
    documented = yaml.safe_load(teardown_gate.RETURN)
    assert set(result) - {"changed", "invocation"} == set(documented)
    per_run = set(documented["runs"]["contains"])
    assert set(result["runs"][0]) == per_run
    instance_keys = {"runs_on_box", "other_runs", "live_marker_pids", "id_checked", "id_expected", "id_found"}
    instance_keys |= {"id_source", "same_device", "data_dev", "durable_dev", "box_started_at", "box_now", "ledger"}
    instance_keys |= {"data_dirs", "gpu_users", "gpu_users_unreadable"}
    assert set(result["instance"]) == instance_keys
    options = yaml.safe_load(teardown_gate.DOCUMENTATION)["options"]
    assert set(options) == set(teardown_gate.ARGUMENT_SPEC)
    for name, spec in teardown_gate.ARGUMENT_SPEC.items():
        assert options[name].get("default") == spec.get("default"), name
        assert options[name].get("aliases") == spec.get("aliases"), name


def test_the_box_s_id_is_read_from_pid_1_s_environment(run_module, box, tmp_path, monkeypatch):
    environ = tmp_path / "environ"
    environ.write_bytes(b"HOME=/root\0RUNPOD_POD_ID=sibling9\0")
    monkeypatch.setattr(_teardown_instance, "PID1_ENVIRON", str(environ))
    monkeypatch.delenv("RUNPOD_POD_ID", raising=False)
    more = {"instance_id": "mine42", "instance_id_env": ["RUNPOD_POD_ID"]}
    code, result = run_module(teardown_gate, args(box, **more))
    assert code == 0 and result["step"] == "instance_id"
    assert (
        result["msg"] == f"instance_id: instance_id mine42 is not this box: its RUNPOD_POD_ID ({environ}) says sibling9"
    )


def test_a_relative_scratch_extra_path_fails_in_one_line(run_module, box):
    code, result = run_module(teardown_gate, args(box, scratch_extra_paths=["cache"]))
    assert code == 1 and result["msg"] == "scratch_extra_paths: each entry must be an absolute path, not 'cache'"


# --- issue 29, item 3: the box lease a teardown holds --------------------------------------------------------------


def test_hold_box_takes_the_box_for_the_teardown_and_keeps_out_another(run_module, box, instance_dir):
    code, result = run_module(teardown_gate, args(box, hold_box={"token": "td-1", "ttl_s": 600}))
    assert code == 0 and result["passed"], result["msg"]
    lease = result["lease"]
    assert (lease["holder"], lease["token"], result["held_by"]) == ("teardown", "td-1", None)
    held = _box_state.active_lease()
    assert held is not None and held["token"] == "td-1" and 590 < held["until_epoch"] - time.time() <= 600
    # The same teardown refreshes it; another (a second controller) is refused before anything is judged.
    assert run_module(teardown_gate, args(box, hold_box={"token": "td-1", "ttl_s": 60}))[1]["passed"]
    code, other = run_module(teardown_gate, args(box, hold_box={"token": "td-2", "ttl_s": 60}))
    assert code == 0 and (other["passed"], other["step"], other["runs"]) == (False, "box_lease", [])
    assert other["reason"].startswith("the box is held by teardown since ") and other["lease"] is None
    assert other["held_by"]["token"] == "td-1"
    assert _box_state.release_lease("td-1") and _box_state.active_lease() is None


def test_hold_box_takes_nothing_in_check_mode_and_a_bad_token_is_one_line(run_module, box, instance_dir):
    code, result = run_module(teardown_gate, args(box, hold_box={"token": "td-1"}), check_mode=True)
    assert code == 0 and result["passed"] and result["lease"] is None
    assert _box_state.active_lease() is None and not (instance_dir / _box_state.LEASE).exists()
    code, bad = run_module(teardown_gate, args(box, hold_box={"token": "a b"}))
    assert code == 1 and bad["msg"].startswith("hold_box.token must match ") and _box_state.active_lease() is None


def test_survives_and_abandon_gpu_users_go_through_the_argument_spec(run_module, box):
    code, result = run_module(teardown_gate, args(box, survives=["data_dir", "durable_dir"], abandon_gpu_users=True))
    assert code == 0 and result["passed"]
    assert "abandon_gpu_users has no effect without instance (no meter-stop)" in result["notes"]
    code, bad = run_module(teardown_gate, args(box, survives=["scratch"]))
    assert code == 1 and "survives" in bad["msg"] and "\n" not in bad["msg"]
