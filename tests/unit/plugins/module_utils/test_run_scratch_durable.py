"""run_scratch checks the durable copy again at the moment of deletion, records a removal before it starts, and
finishes one that stopped halfway (issue 19, items 2, 8 and 9). Real runs of the real runner; the gate's artifacts
are what run_scratch receives, as the teardown action passes them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import tombstone_path
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._run_scratch import (
    ScratchFailure,
    run_scratch,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate
from ansible_collections.remote_gpu.trainer.tests.workload.harness import make_run, start_runner, train

CELLS = [{"name": name, "command": train("--ckpt-kib", "8")} for name in ("a", "b")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("finished")
    run_dir = make_run(root, CELLS, artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    return root


@pytest.fixture
def box(finished: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished, tmp_path / "box", symlinks=True)
    return tmp_path / "box"


def paths(root: Path, durable: str = "durable") -> Dict[str, Any]:
    return {"data_dir": str(root / "data"), "durable_dir": str(root / durable)}


def artifacts(root: Path, durable: str = "durable", **more: Any) -> List[Dict[str, Any]]:
    result = teardown_gate(dict(paths(root, durable), runs=["sweep"], **more))
    assert result["passed"], result["reason"]
    return result["runs"][0]["artifacts"]


def scratch(root: Path, expected: Any = None, durable: str = "durable", **more: Any) -> Dict[str, Any]:
    params = dict(paths(root, durable), runs=["sweep"], timeout_s=30.0, **more)
    if expected is not None:
        params["expected"] = {"sweep": expected}
    return run_scratch(params, check_mode=False)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))


def tombstone(root: Path) -> Dict[str, Any]:
    return json.loads(Path(tombstone_path(str(root / "data"), "sweep")).read_text())


def test_each_cell_s_durable_files_are_hashed_again_before_its_scratch_goes(box):
    result = scratch(box, artifacts(box))
    assert result["runs"] == [
        {"run": "sweep", "state": "removed", "tombstone": tombstone_path(str(box / "data"), "sweep"), "verified": 2}
    ]
    assert not (box / "data" / "runs" / "sweep").exists()
    assert tombstone(box)["state"] == "removed"


def test_a_durable_file_changed_after_the_gate_stops_before_any_scratch_goes(box):
    expected = artifacts(box)
    flip(box / "durable" / "runs" / "sweep" / "cells" / "a" / "best.pth")
    with pytest.raises(ScratchFailure) as failure:
        scratch(box, expected)
    message = str(failure.value)
    assert message.startswith("run_scratch stopped: the durable copy changed since the gate (run sweep, cell a: ")
    assert "cells/a/best.pth: same size, different sha256" in message and message.endswith("nothing more removed")
    assert failure.value.facts["removed"] == []
    assert failure.value.facts["durable_mismatch"]["cell"] == "a"
    scratch_run = box / "data" / "runs" / "sweep"
    assert (scratch_run / "cells" / "a" / "best.pth").exists() and (scratch_run / "cells" / "b" / "best.pth").exists()
    assert (scratch_run / "run.json").exists()
    assert tombstone(box)["state"] == "removing"


def test_a_change_in_the_second_cell_keeps_its_scratch_and_reports_the_first_cell_removed(box):
    expected = artifacts(box)
    flip(box / "durable" / "runs" / "sweep" / "cells" / "b" / "best.pth")
    with pytest.raises(ScratchFailure, match=r"cell b: .*cells/b/best.pth.*after removing 1 path") as failure:
        scratch(box, expected)
    scratch_run = box / "data" / "runs" / "sweep"
    assert [entry["path"] for entry in failure.value.facts["removed"]] == [str(scratch_run / "cells" / "a")]
    assert not (scratch_run / "cells" / "a").exists()
    assert (scratch_run / "cells" / "b" / "best.pth").exists()


def test_a_durable_file_replaced_by_a_link_to_its_scratch_stops(box):
    expected = artifacts(box)
    saved = box / "durable" / "runs" / "sweep" / "cells" / "a" / "best.pth"
    saved.unlink()
    saved.symlink_to(box / "data" / "runs" / "sweep" / "cells" / "a" / "best.pth")
    with pytest.raises(ScratchFailure, match=r"cell a: .*symbolic link"):
        scratch(box, expected)
    assert (box / "data" / "runs" / "sweep" / "cells" / "a" / "best.pth").exists()


def test_without_expected_the_manifest_is_what_the_durable_copy_must_hold(box):
    os.truncate(box / "durable" / "runs" / "sweep" / "cells" / "b" / "best.pth", 5)
    with pytest.raises(ScratchFailure, match=r"cell b: .*5 bytes, expected 8192"):
        scratch(box)
    assert (box / "data" / "runs" / "sweep" / "cells" / "b").exists()


def test_a_removal_stopped_halfway_is_finished_by_the_gate_and_a_rerun(box):
    expected = artifacts(box)
    run_dir = box / "data" / "runs" / "sweep"
    # What a removal killed by its deadline leaves: the tombstone says removing, run.json and cell a are gone.
    Path(tombstone_path(str(box / "data"), "sweep")).parent.mkdir()
    Path(tombstone_path(str(box / "data"), "sweep")).write_text(
        json.dumps({"run": "sweep", "state": "removing", "removing": [], "removed": []})
    )
    shutil.rmtree(run_dir / "cells" / "a")
    (run_dir / "run.json").unlink()
    gate = teardown_gate(dict(paths(box), runs=["sweep"], instance=True))
    assert gate["passed"], gate["reason"]
    assert gate["runs"][0]["run"]["state"] == "removing"
    assert len(gate["runs"][0]["artifacts"]) == 2  # checked against the manifest
    finished = scratch(box, expected)
    assert finished["changed"] is True and finished["runs"][0]["state"] == "removed"
    assert not run_dir.exists() and tombstone(box)["state"] == "removed"
    again = scratch(box, expected)
    assert (again["changed"], again["removed"], again["runs"][0]["state"]) == (False, [], "already_removed")


def test_a_removal_whose_tree_is_already_gone_only_needs_its_tombstone_finished(box):
    shutil.rmtree(box / "data" / "runs" / "sweep")
    Path(tombstone_path(str(box / "data"), "sweep")).parent.mkdir()
    Path(tombstone_path(str(box / "data"), "sweep")).write_text(json.dumps({"run": "sweep", "state": "removing"}))
    checked = run_scratch(dict(paths(box), runs=["sweep"]), check_mode=True)
    assert (checked["changed"], checked["runs"][0]["state"]) == (True, "would_remove")
    result = scratch(box)
    assert (result["changed"], result["removed"], result["runs"][0]["verified"]) == (True, [], 2)
    assert tombstone(box)["state"] == "removed"


def test_the_tombstone_says_removing_before_anything_goes(box, tmp_path, monkeypatch):
    seen = tmp_path / "seen"
    real = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:  # runs in the removal's child: it writes to a file
        with open(seen, "a") as log:
            log.write(f"{tombstone(box)['state']} {os.path.basename(path)}\n")
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert run_scratch(dict(paths(box), runs=["sweep"]), check_mode=False)["changed"] is True
    assert seen.read_text().splitlines() == ["removing a", "removing b", "removing sweep"]
    assert tombstone(box)["state"] == "removed"


def test_durable_dir_inside_data_dir_passes_the_gate_and_run_scratch(tmp_path):
    # RunPod's and Vast.ai's profiles as shipped: data_dir=/workspace, durable_dir=/workspace/durable.
    durable = tmp_path / "data" / "durable"
    run_dir = make_run(tmp_path, CELLS, artifacts=["best.pth"], durable_dir=str(durable))
    durable.mkdir()
    assert start_runner(run_dir).wait(timeout=60) == 0
    gate = teardown_gate(dict(paths(tmp_path, "data/durable"), runs=["sweep"], instance=True))
    assert gate["passed"], gate["reason"]
    result = scratch(tmp_path, gate["runs"][0]["artifacts"], durable="data/durable")
    assert result["changed"] and not run_dir.exists()
    assert (durable / "runs" / "sweep" / "cells" / "a" / "best.pth").stat().st_size == 8192


def test_packed_cells_sharing_the_box_s_gpus_are_each_checked_then_removed(tmp_path):
    cells = [{"name": f"c{index}", "command": train("--ckpt-kib", "4", "--step-s", "0.05")} for index in range(4)]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"], gpus=[0, 1], gpus_per_cell=1)
    assert start_runner(run_dir).wait(timeout=60) == 0
    views = json.loads((run_dir / "run.json").read_text())["cells"]
    assert {tuple(view["gpus"]) for view in views} == {(0,), (1,)}  # two at a time, one GPU each
    expected = artifacts(tmp_path)
    assert sorted(entry["path"] for entry in expected) == [f"cells/c{index}/best.pth" for index in range(4)]
    result = scratch(tmp_path, expected)
    assert result["runs"][0]["verified"] == 4 and not run_dir.exists()


def test_expected_must_name_only_runs_being_removed_and_valid_entries(box):
    with pytest.raises(ValueError, match="expected names run 'other', which runs does not"):
        run_scratch(dict(paths(box), runs=["sweep"], expected={"other": []}), check_mode=False)
    with pytest.raises(ValueError, match=r"expected.sweep: expected\[0\].size must be a non-negative integer"):
        run_scratch(dict(paths(box), runs=["sweep"], expected={"sweep": [{"path": "cells/a/x"}]}), check_mode=False)
