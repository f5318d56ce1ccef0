"""teardown_gate on real runs: the real runner syncs real files, then each test breaks one thing a renter meets."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import tombstone_path
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_gate, _teardown_instance
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import (
    parse_manifest,
    teardown_gate,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    kill_session,
    make_run,
    start_runner,
    train,
    wait_for,
)

TWO_CELLS = [{"name": "a", "command": train("--ckpt-kib", "8")}, {"name": "b", "command": train("--ckpt-kib", "8")}]


def gate(root: Path, run: str = "sweep", **more: Any) -> Dict[str, Any]:
    """The gate over one run (the result's only per-run entry, with the verdict of the whole gate)."""
    result = verdict(root, runs=[run], **more)
    return dict(result["runs"][0], passed=result["passed"], step=result["step"], reason=result["reason"])


def verdict(root: Path, **more: Any) -> Dict[str, Any]:
    params = {"data_dir": str(root / "data"), "durable_dir": str(root / "durable")}
    params.update(more)
    return teardown_gate(params)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of two cells that ended with DONE, every best.pth synced and verified by the real runner."""
    root = tmp_path_factory.mktemp("finished")
    run_dir = make_run(root, TWO_CELLS, artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    assert (run_dir / "DONE").exists()
    return root


@pytest.fixture
def box(finished: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run's box (data and durable), for a test to break."""
    shutil.copytree(finished, tmp_path / "box", symlinks=True)
    return tmp_path / "box"


def durable_file(root: Path, cell: str = "a") -> Path:
    return root / "durable" / "runs" / "sweep" / "cells" / cell / "best.pth"


def test_a_finished_run_with_a_verified_copy_passes_and_lists_the_digests_recomputed_now(box):
    result = gate(box)
    assert (result["passed"], result["step"], result["reason"]) == (True, None, "")
    assert result["run"]["state"] == "done"
    assert [cell["done"] for cell in result["cells"]] == [True, True]
    size = durable_file(box).stat().st_size
    assert size == 8 * 1024
    paths = sorted(artifact["path"] for artifact in result["artifacts"])
    assert paths == ["cells/a/best.pth", "cells/b/best.pth"]
    assert result["durable"]["files"] == 2 and result["durable"]["bytes"] == 2 * size
    assert result["durable"]["manifest"]["lines"] == 2


def test_a_live_run_is_refused_at_the_first_step(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--forever")}], artifacts=["best.pth"])
    runner = start_runner(run_dir)
    try:
        wait_for((run_dir / "run.json").exists, 20, "run.json")
        result = gate(tmp_path)
        assert (result["passed"], result["step"]) == (False, "run_alive")
        assert "is alive" in result["reason"]
        assert result["durable"]["files"] == 0  # nothing after the failed step ran
    finally:
        kill_session(runner.pid)
        runner.wait(timeout=10)


def test_a_cell_left_running_after_its_runner_died_is_refused(box):
    # A worker that called setsid outlives a SIGKILLed runner; only its RGT_RUN_DIR says whose it is.
    run_dir = box / "data" / "runs" / "sweep"
    env = dict(os.environ, RGT_RUN_DIR=str(run_dir))
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    try:
        time.sleep(0.2)
        result = gate(box)
        assert (result["passed"], result["step"]) == (False, "run_alive")
        assert str(orphan.pid) in result["reason"]
    finally:
        orphan.kill()
        orphan.wait()


def test_a_failed_cell_is_refused_unless_accepted(tmp_path):
    cells = [{"name": "a", "command": train()}, {"name": "b", "command": train("--crash")}]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"])
    start_runner(run_dir).wait(timeout=60)
    refused = gate(tmp_path)
    assert (refused["passed"], refused["step"], refused["missing_cells"]) == (False, "cells", ["b"])
    assert "b (failed, exit 1)" in refused["reason"]
    accepted = gate(tmp_path, accept_incomplete_cells=["b"])
    assert accepted["passed"], accepted["reason"]
    assert [artifact["path"] for artifact in accepted["artifacts"]] == ["cells/a/best.pth"]
    assert [cell["accepted"] for cell in accepted["cells"]] == [False, True]


def test_a_copy_its_check_refused_is_known_bad_in_the_manifest_and_the_gate_names_it(tmp_path):
    # The runner keeps the faithful copy of b's NaN weights in MANIFEST.sha256: marked, the gate says so.
    cells = [
        {"name": "a", "command": train("--layout", "hf")},
        {"name": "b", "command": train("--layout", "hf", "--nan-weights")},
    ]
    run_dir = make_run(tmp_path, cells, artifacts=["model.safetensors"], check_finite=True)
    start_runner(run_dir).wait(timeout=60)
    accepted = gate(tmp_path, accept_incomplete_cells=["b"])
    assert accepted["passed"], accepted["reason"]
    manifest = accepted["durable"]["manifest"]
    assert manifest["known_bad"] == [{"path": "cells/b/model.safetensors", "bad": "non-finite"}]
    assert manifest["bad_lines"] == [] and manifest["lines"] == 2  # the mark is a comment, not a malformed entry
    assert _teardown_instance._manifest_lines(manifest["path"]) == 2  # nor a file of another run's survey
    assert [artifact["path"] for artifact in accepted["artifacts"]] == ["cells/a/model.safetensors"]


def test_a_cell_without_result_is_missing_and_a_misspelt_acceptance_is_noted(box):
    os.unlink(box / "data" / "runs" / "sweep" / "cells" / "b" / "result.json")
    result = gate(box, accept_incomplete_cells=["bb"])
    assert (result["step"], result["missing_cells"]) == ("cells", ["b"])
    assert "b (no result)" in result["reason"]
    assert any("bb" in note for note in result["notes"])


def test_a_truncated_durable_file_is_refused_naming_file_and_sizes(box):
    path = durable_file(box)
    os.truncate(path, 100)
    result = gate(box)
    assert (result["passed"], result["step"]) == (False, "durable")
    assert result["durable"]["mismatches"][0]["path"] == "cells/a/best.pth"
    assert result["durable"]["mismatches"][0]["size"] == 100
    assert "100 bytes, expected 8192" in result["reason"]
    assert result["artifacts"] == []


def test_one_flipped_byte_of_the_same_size_is_refused(box):
    path = durable_file(box, "b")
    data = bytearray(path.read_bytes())
    data[4000] ^= 0x01
    path.write_bytes(bytes(data))
    result = gate(box)
    assert result["step"] == "durable"
    assert "same size, different sha256" in result["reason"]


def test_a_flipped_byte_with_manifest_and_result_rewritten_to_match_still_fails_on_the_scratch_file(box):
    # Records can be made to agree with a bad copy; the scratch file the copy came from is recomputed too.
    path = durable_file(box)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    new = hashlib.sha256(bytes(data)).hexdigest()
    result_path = box / "data" / "runs" / "sweep" / "cells" / "a" / "result.json"
    record = json.loads(result_path.read_text())
    old = record["artifacts"][0]["sha256"]
    record["artifacts"][0]["sha256"] = new
    result_path.write_text(json.dumps(record))
    manifest = box / "durable" / "runs" / "sweep" / "MANIFEST.sha256"
    manifest.write_text(manifest.read_text().replace(old, new))
    result = gate(box)
    assert result["step"] == "durable"
    assert "the scratch file" in result["reason"] and "differs from its copy" in result["reason"]


def test_a_missing_durable_directory_is_refused(box):
    shutil.rmtree(box / "durable" / "runs" / "sweep")
    result = gate(box)
    assert (result["step"], result["durable"]["exists"]) == ("durable", False)
    assert "does not exist" in result["reason"]


def test_a_manifest_line_that_disagrees_with_the_record_is_refused(box):
    manifest = box / "durable" / "runs" / "sweep" / "MANIFEST.sha256"
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join(lines[1:]) + "\nnot a manifest line\n")
    result = gate(box)
    assert result["step"] == "durable"
    assert "not in MANIFEST.sha256" in result["reason"]
    assert result["durable"]["manifest"]["bad_lines"] == ["not a manifest line"]


def test_a_missing_manifest_is_refused(box):
    os.unlink(box / "durable" / "runs" / "sweep" / "MANIFEST.sha256")
    assert "has no MANIFEST.sha256" in gate(box)["reason"]


def test_a_durable_file_replaced_by_a_symlink_to_scratch_is_refused(box):
    # It would hash right today and vanish with the scratch it points at.
    path = durable_file(box)
    path.unlink()
    path.symlink_to(box / "data" / "runs" / "sweep" / "cells" / "a" / "best.pth")
    result = gate(box)
    assert result["step"] == "durable"
    assert "symbolic link" in result["reason"]


def test_a_durable_run_directory_reached_through_a_symlink_into_the_runs_scratch_is_refused(box):
    durable_run = box / "durable" / "runs" / "sweep"
    moved = box / "data" / "runs" / "sweep" / "copy"
    shutil.move(str(durable_run), str(moved))
    durable_run.symlink_to(moved)
    result = gate(box)
    assert result["step"] == "durable"
    assert f"overlaps {box / 'data' / 'runs'}, which teardown removes" in result["reason"]


def test_a_durable_copy_inside_data_dir_but_outside_what_teardown_removes_passes(box):
    # RunPod and Vast.ai ship durable_dir=/workspace/durable inside data_dir=/workspace: only runs/<run> goes.
    shutil.move(str(box / "durable"), str(box / "data" / "durable"))
    result = gate(box, durable_dir=str(box / "data" / "durable"))
    assert result["passed"], result["reason"]


def test_a_durable_dir_overlapping_an_extra_scratch_path_is_refused(box):
    extra = box / "durable" / "runs"
    result = gate(box, scratch_extra_paths=[str(extra)])
    assert result["step"] == "durable"
    assert f"overlaps {extra}, which teardown removes" in result["reason"]
    holder = gate(box, scratch_extra_paths=[str(box)])
    assert holder["step"] == "durable" and f"overlaps {box}," in holder["reason"]


def test_a_run_that_secured_no_artifacts_is_refused_unless_accepted(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}])
    assert start_runner(run_dir).wait(timeout=60) == 0
    refused = gate(tmp_path)
    assert refused["step"] == "durable"
    assert "secured no artifacts" in refused["reason"]
    assert gate(tmp_path, accept_no_artifacts=True)["passed"]


def test_an_unknown_run_is_refused_and_a_torn_down_one_is_checked_against_its_manifest(box):
    unknown = gate(box, run="other")
    assert (unknown["step"], unknown["run"]["state"]) == ("run_alive", "absent")
    assert "not found" in unknown["reason"]
    shutil.rmtree(box / "data" / "runs" / "sweep")
    tombstone = Path(tombstone_path(str(box / "data"), "sweep"))
    tombstone.parent.mkdir(parents=True)
    tombstone.write_text(json.dumps({"run": "sweep", "removed_at": "2026-12-04T00:00:00Z", "removed": []}))
    again = gate(box)
    assert (again["passed"], again["run"]["state"]) == (True, "torn_down")
    assert again["torn_down"]["run"] == "sweep"
    assert len(again["artifacts"]) == 2
    os.truncate(durable_file(box), 10)
    assert gate(box)["step"] == "durable"


def test_a_garbage_run_json_and_result_json_refuse_without_a_traceback(box):
    run_dir = box / "data" / "runs" / "sweep"
    (run_dir / "cells" / "a" / "result.json").write_text('{"status": NaN}')
    result = gate(box)
    assert result["step"] == "cells"
    assert "unreadable result.json" in result["reason"]
    (run_dir / "run.json").write_text("[1, 2")
    assert gate(box)["step"] == "run_alive"


def test_a_hung_durable_mount_fails_within_the_deadline(box, monkeypatch):
    real = _teardown_gate._read_durable

    def hang(*args: Any) -> Dict[str, Any]:
        time.sleep(30)
        return real(*args)

    monkeypatch.setattr(_teardown_gate, "_read_durable", hang)
    started = time.monotonic()
    result = gate(box, verify_timeout_s=1)
    assert time.monotonic() - started < 10
    assert result["step"] == "durable"
    assert "did not answer within 1 s" in result["reason"]


def test_bad_options_are_value_errors_naming_them(box):
    with pytest.raises(ValueError, match="data_dir must be an absolute path"):
        gate(box, data_dir="data")
    with pytest.raises(ValueError, match="run"):
        gate(box, run="../x")


def test_parse_manifest_rejects_paths_that_climb_and_malformed_lines():
    good = "a" * 64
    text = f"{good}  12  cells/a/x.pt\n{good}  12  ../etc/passwd\n{good}  x  cells/b\nshort\n\n"
    entries, bad = parse_manifest(text)
    assert entries == {"cells/a/x.pt": {"size": 12, "sha256": good}}
    assert len(bad) == 3


def test_a_cell_that_declares_no_artifacts_of_its_own_passes_with_a_skipped_sync(tmp_path):
    """The done rule is per cell: an eval cell with ``artifacts: []`` beside a run's list needs no durable file."""
    cells = [
        {"name": "a", "command": train("--ckpt-kib", "8")},
        {"name": "eval", "command": train("--ckpt-kib", "8"), "artifacts": []},
    ]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    result = gate(tmp_path)
    assert [(cell["name"], cell["sync"], cell["done"]) for cell in result["cells"]] == [
        ("a", "verified", True),
        ("eval", "skipped", True),
    ]
    assert (result["passed"], result["reason"]) == (True, "")
