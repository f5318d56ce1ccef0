"""teardown_gate and copy_verify through their argument specs, on a run the real runner finished."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from pathlib import Path

import pytest
import yaml

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


def test_the_gate_tells_since_when_the_box_bills_the_run_s_start(run_module, box):
    started = json.loads((box / "data" / "runs" / "sweep" / "run.json").read_text())["started_at"]
    for run in ("sweep", "other"):  # passed or refused, the start is told
        result = run_module(teardown_gate, args(box, run=run))[1]
        told = datetime.fromisoformat(result["instance"]["box_started_at"].replace("Z", "+00:00"))
        assert told == datetime.fromisoformat(started).replace(microsecond=0)


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
    instance_keys |= {"id_source", "same_device", "data_dev", "durable_dev", "box_started_at"}
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
