"""A relaunch of a run the box holds: the spec's differences, the outcome, and a dead runner's cells still training."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._launch_attempt import archive
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._relaunch import (
    Decision,
    RelaunchRefused,
    decide,
    decide_start,
    refuse_orphans,
    spec_changes,
    still_training,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._archive import archive_runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import RunSpec, parse_spec
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import claim_durable, update_manifest

STAMP = "2026-12-04T10:00:00Z"


def document(tmp_path: Path, cells=None, **extra: Any) -> Dict[str, Any]:
    base = {
        "run": "r1",
        "data_dir": str(tmp_path / "data"),
        "durable_dir": str(tmp_path / "durable"),
        "workdir": str(tmp_path),
        "cells": cells if cells is not None else [{"name": "a", "command": ["train", "a"]}],
        "artifacts": ["best.pth"],
        "gpus": [0, 1],
        "launch_id": "L1",
    }
    return dict(base, **extra)


def spec_of(tmp_path: Path, cells=None, **extra: Any) -> RunSpec:
    return parse_spec(document(tmp_path, cells, **extra))


def write_cell(tmp_path: Path, cell: str, exit_status: Optional[str], sync: Optional[str]) -> None:
    """A cell's files as the runner leaves them: exit.json when its command ended, result.json once synced."""
    directory = tmp_path / "data" / "runs" / "r1" / "cells" / cell
    directory.mkdir(parents=True, exist_ok=True)
    code = 0 if exit_status == "succeeded" else 1
    if exit_status is not None:
        ended = {"schema": 1, "cell": cell, "status": exit_status, "exit_code": code, "signal": None}
        ended.update(started_at=STAMP, ended_at=STAMP, attempts=1, reason=None, command=["train", cell])
        (directory / "exit.json").write_text(json.dumps(dict(ended, checkpoint_dir=str(directory))))
    if sync is not None:
        result = {"status": exit_status, "exit_code": code, "signal": None, "started_at": STAMP, "ended_at": STAMP}
        (directory / "result.json").write_text(json.dumps(dict(result, sync=sync, artifacts=[])))


def test_an_identical_spec_has_no_changes_whatever_its_launch_id_and_gpu_order(tmp_path):
    old = document(tmp_path)
    assert spec_changes(old, dict(old, launch_id="L2", gpus=[1, 0], monitor_interval_s=5)) == []
    # A spec.json written before the run-wide optional lists existed: absent is the default.
    assert spec_changes(old, dict(old, optional_artifacts=[], verify_timeout_s=300, check_finite=False)) == []
    # A cell that now names the run's own list explicitly copies the same files.
    same = [{"name": "a", "command": ["train", "a"], "artifacts": ["best.pth"]}]
    assert spec_changes(old, document(tmp_path, same)) == []


def test_every_difference_is_named_once(tmp_path):
    old = document(tmp_path, [{"name": "a", "command": ["train", "a"]}, {"name": "b", "command": ["train", "b"]}])
    cells = [
        {"name": "a", "command": ["train", "a", "--lr", "3"], "artifacts": ["model.safetensors"], "retries": 2},
        {"name": "c", "command": ["train", "c"]},
    ]
    new = document(tmp_path, cells, prune=["latest.pth"], env={"SEED": "1"}, verify_cmd=["python", "load.py"])
    assert spec_changes(old, new) == [
        "prune changed",
        "verify_cmd changed",
        "env changed",
        "cell a: command, retries, artifacts changed",
        "cell c added",
        "cell b removed",
    ]
    loader = {"verify_cmd": ["python", "load.py"]}
    assert spec_changes(dict(old, **loader), dict(old, **loader, verify_artifacts=["*.pt"])) == [
        "verify_artifacts changed"
    ]
    assert spec_changes(dict(old, **loader), dict(old, **loader, verify_artifacts=[])) == []  # absent: every one
    # The run's list changed: cells that inherit it are not named again.
    assert spec_changes(old, dict(old, artifacts=["last.pt"])) == ["artifacts changed"]


def test_a_first_launch_starts_every_cell(tmp_path):
    relaunch = decide(spec_of(tmp_path), None, has_scratch=False, live=False, done=False, apply=False)
    assert relaunch.as_facts() == {
        "outcome": "started",
        "changes": [],
        "cells_left": 1,
        "recopy_cells": [],
        "kept_cells": [],
    }


def test_the_same_spec_is_done_when_done_and_already_running_when_live(tmp_path):
    spec = spec_of(tmp_path)
    write_cell(tmp_path, "a", "succeeded", "verified")
    done = decide(spec, spec.to_json(), has_scratch=True, live=False, done=True, apply=False)
    assert (done.outcome, done.changes, done.cells.kept, done.cells.left) == ("done", (), ("a",), ())
    live = decide(spec, spec.to_json(), has_scratch=True, live=True, done=False, apply=False)
    assert live.outcome == "already_running"


def test_a_changed_spec_is_refused_naming_the_differences_unless_applied(tmp_path):
    old = spec_of(tmp_path)
    write_cell(tmp_path, "a", "succeeded", "verified")
    new = spec_of(tmp_path, [{"name": "a", "command": ["train", "a"]}, {"name": "c", "command": ["train", "c"]}])
    for live, done in ((False, True), (False, False), (True, False)):
        with pytest.raises(RelaunchRefused) as refused:
            decide(new, old.to_json(), has_scratch=True, live=live, done=done, apply=False)
        assert refused.value.changes == ("cell c added",)
        assert str(refused.value).endswith("; changes: cell c added") and "\n" not in str(refused.value)
        if not live:
            assert str(refused.value) == (
                "run r1 on this box has another spec: set launch_apply_changes: true (module: apply_changes) to run "
                "the changed cells, or use a new run name; changes: cell c added"
            )
    applied = decide(new, old.to_json(), has_scratch=True, live=False, done=True, apply=True)
    assert applied.as_facts() == {
        "outcome": "resumed",
        "changes": ["cell c added"],
        "cells_left": 1,
        "recopy_cells": [],
        "kept_cells": ["a"],
    }


def test_a_live_run_is_never_changed_even_with_apply_changes(tmp_path):
    old = spec_of(tmp_path)
    with pytest.raises(RelaunchRefused) as refused:
        decide(spec_of(tmp_path, env={"X": "1"}), old.to_json(), has_scratch=True, live=True, done=False, apply=True)
    assert str(refused.value).startswith("run r1 is running on this box with another spec: let it end or stop it")


def test_a_succeeded_command_whose_copy_failed_is_recopied_not_retrained(tmp_path):
    cells = [{"name": n, "command": ["train", n]} for n in ("a", "b", "c", "d")]
    spec = spec_of(tmp_path, cells)
    write_cell(tmp_path, "a", "succeeded", "verified")
    write_cell(tmp_path, "b", "succeeded", "failed")  # its artifact glob matched nothing
    write_cell(tmp_path, "c", "succeeded", None)  # the runner was killed during the copy
    write_cell(tmp_path, "d", "failed", "skipped")
    relaunch = decide(spec, spec.to_json(), has_scratch=True, live=False, done=False, apply=False)
    assert relaunch.as_facts() == {
        "outcome": "resumed",
        "changes": [],
        "cells_left": 1,
        "recopy_cells": ["b", "c"],
        "kept_cells": ["a"],
    }


def test_a_cell_without_artifacts_of_its_own_is_done_by_a_skipped_sync(tmp_path):
    cells = [{"name": "a", "command": ["train", "a"], "artifacts": []}, {"name": "b", "command": ["train", "b"]}]
    spec = spec_of(tmp_path, cells)
    write_cell(tmp_path, "a", "succeeded", "skipped")
    write_cell(tmp_path, "b", "succeeded", "skipped")  # b inherits the run's artifacts: skipped is not done
    relaunch = decide(spec, spec.to_json(), has_scratch=True, live=False, done=False, apply=False)
    assert (relaunch.cells.kept, relaunch.cells.recopy) == (("a",), ("b",))


def test_removing_a_cell_whose_command_succeeded_is_refused_even_with_apply_changes(tmp_path):
    old = spec_of(tmp_path, [{"name": "a", "command": ["train", "a"]}, {"name": "b", "command": ["train", "b"]}])
    write_cell(tmp_path, "a", "succeeded", "verified")
    write_cell(tmp_path, "b", "succeeded", "failed")
    new = spec_of(tmp_path, [{"name": "a", "command": ["train", "a"]}])
    with pytest.raises(RelaunchRefused) as refused:
        decide(new, old.to_json(), has_scratch=True, live=False, done=False, apply=True)
    assert str(refused.value) == (
        "run r1: cell b is not in this launch but succeeded, and the durable copy holds their files: keep them in "
        "the sweep, or use a new run name"
    )
    write_cell(tmp_path, "b", "failed", "skipped")  # a failed cell copied nothing: it may go
    relaunch = decide(new, old.to_json(), has_scratch=True, live=False, done=False, apply=True)
    assert (relaunch.outcome, relaunch.changes) == ("resumed", ("cell b removed",))


@pytest.fixture
def orphan(tmp_path):
    """A process of run r1's cell b, carrying the run's marker, whose runner is gone."""
    run_dir = str(tmp_path / "data" / "runs" / "r1")
    env = dict(os.environ, RGT_RUN_DIR=run_dir, RGT_CELL="b")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    deadline = time.monotonic() + 10
    while not still_training("r1", run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield run_dir, child.pid
    child.kill()
    child.wait()


def test_a_dead_runners_cell_still_training_is_named_with_its_pid(orphan):
    run_dir, pid = orphan
    assert still_training("r1", run_dir) == {"b": [pid]}
    with pytest.raises(RelaunchRefused) as refused:
        refuse_orphans("r1", run_dir)
    assert str(refused.value) == (
        f"run r1: cell b still trains (pid {pid}) without its runner: wait for it, or stop it with training_run "
        "state=stopped"
    )
    refuse_orphans("r2", run_dir.replace("/r1", "/r2"))  # another run's marker: nothing of r2 runs


# --- no refusal offers a way out that loses data (issue 29, item 5) --------------------------------------------------


def durable_of(tmp_path: Path, launch_id: str, cell: str) -> Path:
    """A verified durable copy of r1 by launch ``launch_id`` holding ``cell``'s weights."""
    copy = tmp_path / "durable" / "runs" / "r1"
    (copy / "cells" / cell).mkdir(parents=True)
    (copy / "cells" / cell / "best.pth").write_bytes(b"weights")
    (copy / "MANIFEST.sha256").write_text(f"{hashlib.sha256(b'weights').hexdigest()}  7  cells/{cell}/best.pth\n")
    (copy / ".launch.json").write_text(json.dumps({"run": "r1", "launch_id": launch_id}))
    return copy


def files_of(root: Path) -> Dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def start(tmp_path: Path, launch_id: str, cells=None, **params: Any) -> Decision:
    (tmp_path / "data" / "runs").mkdir(parents=True, exist_ok=True)
    return decide_start(spec_of(tmp_path, cells, launch_id=launch_id), params, "setsid", True, lambda text: None)


def sync(copy: Path, launch_id: str, cell: str) -> None:
    """What the new launch's runner does to the durable copy when its cell succeeds."""
    claim_durable(str(copy), "r1", launch_id)
    update_manifest(str(copy), cell, [{"path": "best.pth", "size": 3, "sha256": "1" * 64}])


def test_relaunching_an_archived_runs_name_starts_afresh_and_never_reaches_its_durable_copy(tmp_path):
    # The case: r1 (launch L1) finished and was archived; a launch of the name r1 again.
    run = tmp_path / "data" / "runs" / "r1"
    run.mkdir(parents=True)
    durable = tmp_path / "durable"
    record = {"schema": 1, "run": "r1", "pgid": 2**22 + 7, "sid": 2**22 + 7, "pids": [2**22 + 7], "detach": "setsid"}
    (run / "run.json").write_text(json.dumps(dict(record, durable_dir=str(durable), launch_id="L1")))
    durable_of(tmp_path, "L1", "a")
    moved = archive_runs({"data_dir": str(tmp_path / "data"), "run": "r1"}, False)["runs"][0]["durable"]["to"]
    kept = files_of(Path(moved))
    decision = start(tmp_path, "L2")
    assert (decision.relaunch.outcome, decision.attempt.archives) == ("started", ())
    sync(durable / "runs" / "r1", "L2", "a")
    assert files_of(Path(moved)) == kept


def test_a_copy_holding_this_launchs_cells_is_refused_without_offering_its_launch_id(tmp_path):
    copy = durable_of(tmp_path, "L1", "a")
    kept = files_of(copy)
    with pytest.raises(RelaunchRefused) as refused:
        start(tmp_path, "L2")
    message = str(refused.value)
    assert "launch_id: L1" not in message and "\n" not in message
    assert message == (
        f"run r1: {copy} holds launch L1, not L2: set launch_new_attempt: true (module: new_attempt) to archive it "
        "and start afresh, or use a new run name (joining launch L1 would overwrite its cell a)"
    )
    # Following the way out it offers: the earlier copy is renamed aside whole.
    decision = start(tmp_path, "L2", new_attempt=True)
    archive(decision.attempt)
    assert files_of(tmp_path / "durable" / "runs" / "r1@attempt-1") == kept


def test_joining_a_launch_is_offered_only_where_it_overwrites_nothing(tmp_path):
    copy = durable_of(tmp_path, "L1", "x")  # a sharded peer's cell
    kept = files_of(copy)
    with pytest.raises(RelaunchRefused, match="set launch_id: L1 to add this box to that launch"):
        start(tmp_path, "L2")
    decision = start(tmp_path, "L1")  # following it: this box joins, its cell a beside the peer's x
    assert decision.attempt.archives == ()
    sync(copy, "L1", "a")
    after = files_of(copy)
    assert {name: data for name, data in after.items() if name.startswith("cells/x/")} == {
        name: data for name, data in kept.items() if name.startswith("cells/x/")
    }
    assert "cells/x/best.pth" in after["MANIFEST.sha256"].decode()
