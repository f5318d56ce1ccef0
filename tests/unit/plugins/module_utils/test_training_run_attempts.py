"""Which launch a run name belongs to: the tombstone and durable checks, and the archive of an earlier attempt."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _launch_attempt
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._launch_attempt import (
    Archive,
    Attempt,
    AttemptRefused,
    archive,
    new_launch_id,
    plan,
    recorded_launch_id,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN, tombstone_path


@pytest.fixture
def box(tmp_path):
    data, durable = tmp_path / "data", tmp_path / "durable"
    (data / "runs").mkdir(parents=True)
    durable.mkdir()
    return {"data": data, "durable": durable}


def decide(box, launch_id="L2", has_scratch=False, new_attempt=False, durable=True) -> Attempt:
    durable_dir = str(box["durable"]) if durable else None
    return plan(
        "r1", str(box["data"]), durable_dir, launch_id=launch_id, has_scratch=has_scratch, new_attempt=new_attempt
    )


def durable_copy(box, launch_id=None) -> Path:
    """An earlier launch's verified copy of r1: a file, its manifest and (with an id) its launch record."""
    run = box["durable"] / "runs" / "r1"
    (run / "cells" / "a").mkdir(parents=True)
    (run / "cells" / "a" / "best.pth").write_bytes(b"weights")
    (run / "MANIFEST.sha256").write_text(f"{'0' * 64}  7  cells/a/best.pth\n")
    if launch_id is not None:
        (run / ".launch.json").write_text(json.dumps({"run": "r1", "launch_id": launch_id}))
    return run


def tombstone(box) -> Path:
    path = Path(tombstone_path(str(box["data"]), "r1"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"run": "r1", "removed": []}')
    return path


def test_a_first_launch_and_a_box_of_the_same_launch_start_with_nothing_to_archive(box):
    assert decide(box) == Attempt("L2")
    durable_copy(box, "L2")  # a sharded peer's cells, synced under the same launch id
    assert decide(box) == Attempt("L2")
    assert decide(box, new_attempt=True) == Attempt("L2")  # new_attempt never archives its own launch's copy


def test_a_tombstone_refuses_and_names_the_way_out(box):
    path = tombstone(box)
    with pytest.raises(AttemptRefused) as refused:
        decide(box, durable=False)
    assert str(refused.value) == (
        f"run r1 was torn down on this box ({path}), its durable copy is the only one left: "
        "set launch_new_attempt: true (module: new_attempt) to archive it and start afresh, or use a new run name"
    )


@pytest.mark.parametrize(
    ("launch_id", "why"),
    [
        ("L1", "holds launch L1, not L2"),
        (None, "holds files of an earlier launch (no .launch.json), not L2"),
    ],
)
def test_a_durable_copy_of_another_launch_refuses(box, launch_id, why):
    run = durable_copy(box, launch_id)
    with pytest.raises(AttemptRefused) as refused:
        decide(box)
    assert str(refused.value).startswith(f"run r1: {run} {why}: set launch_new_attempt: true (module: new_attempt)")
    assert ("set launch_id: L1 to add this box" in str(refused.value)) == (launch_id is not None)


def test_an_unreadable_launch_record_refuses(box):
    run = durable_copy(box)
    (run / ".launch.json").write_text("{not json")
    with pytest.raises(AttemptRefused, match=r"has an unreadable \.launch\.json"):
        decide(box)


def test_a_resume_of_the_same_launch_is_allowed_also_over_files_from_before_launch_ids(box):
    durable_copy(box, "L1")
    assert decide(box, launch_id="L1", has_scratch=True) == Attempt("L1")
    (box["durable"] / "runs" / "r1" / ".launch.json").unlink()
    assert decide(box, launch_id="L1", has_scratch=True) == Attempt("L1")


def test_a_resume_whose_durable_copy_holds_another_launch_is_refused(box):
    durable_copy(box, "L0")
    with pytest.raises(AttemptRefused, match=r"^run r1: this box resumes launch L1 but .* holds launch L0: use a new"):
        decide(box, launch_id="L1", has_scratch=True)


def test_new_attempt_is_refused_while_the_box_holds_the_runs_scratch(box):
    with pytest.raises(AttemptRefused, match="launch_new_attempt starts a run from nothing, but this box holds"):
        decide(box, has_scratch=True, new_attempt=True)
    tombstone(box)  # a teardown stopped halfway: the scratch is still there
    with pytest.raises(AttemptRefused, match="is still there: finish the teardown first"):
        decide(box, has_scratch=True)


def test_new_attempt_plans_one_free_attempt_number_for_the_copy_and_the_tombstone(box):
    run, path = durable_copy(box, "L1"), tombstone(box)
    (box["durable"] / "runs" / "r1@attempt-1").mkdir()
    (path.parent / "r1@attempt-2.json").write_text("{}")
    (path.parent / "r10@attempt-7.json").write_text("{}")  # another run's archive
    attempt = decide(box, new_attempt=True)
    assert attempt == Attempt(
        "L2",
        (Archive(str(run), f"{run}@attempt-3"), Archive(str(path), str(path.parent / "r1@attempt-3.json"))),
    )


def test_archive_renames_and_never_replaces_what_is_there(box):
    run, path = durable_copy(box, "L1"), tombstone(box)
    attempt = decide(box, new_attempt=True)
    archive(attempt)
    assert not run.exists() and (box["durable"] / "runs" / "r1@attempt-1" / "cells" / "a" / "best.pth").exists()
    assert not path.exists() and (path.parent / "r1@attempt-1.json").exists()
    again = durable_copy(box, "L2")
    (box["durable"] / "runs" / "r1@attempt-2").mkdir()  # appeared after the plan: an empty dir os.rename would take
    with pytest.raises(AttemptRefused, match=r"could not archive .* exists\); nothing started") as failed:
        archive(Attempt("L3", (Archive(str(again), f"{again}@attempt-2"),)))
    assert failed.value.done == () and (again / "cells" / "a" / "best.pth").exists()


def test_a_durable_dir_that_does_not_answer_refuses_within_the_deadline(box, monkeypatch):
    monkeypatch.setattr(_launch_attempt, "DURABLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(_launch_attempt, "durable_owner", lambda path: time.sleep(30))
    began = time.monotonic()
    with pytest.raises(AttemptRefused, match=r"did not answer within 0\.3 s \(a hung mount\?\)"):
        decide(box)
    assert time.monotonic() - began < 5


def test_launch_ids_are_valid_names_and_only_valid_recorded_ids_count():
    launch_id = new_launch_id(0.0)
    assert launch_id.startswith("19700101T000000Z-") and NAME_PATTERN.match(launch_id)
    assert new_launch_id() != new_launch_id()
    assert recorded_launch_id({"launch_id": launch_id}) == launch_id
    assert recorded_launch_id({}) is None and recorded_launch_id({"launch_id": "../x"}) is None
    assert os.sep not in launch_id
