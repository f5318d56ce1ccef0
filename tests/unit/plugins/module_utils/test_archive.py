"""run_archive's logic (issue 20, "old results can be retired without stopping the meter"): a run moved aside whole,
never deleted, never while anything of it runs. Real directories, real processes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._launch_attempt import AttemptRefused, plan
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _archive, _archive_durable
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._archive import ArchiveRefused, archive_runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    ARCHIVED_PATTERN,
    list_archived,
    list_runs,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import claim_durable, update_manifest

DEAD_PID = 2**22 + 7
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()
STAMP = "20261201T120000Z"


def make_run(data: Path, name: str, pid: int = DEAD_PID) -> Path:
    """A finished-looking run: run.json naming a runner (dead unless ``pid`` lives), a cell log, a checkpoint."""
    run = data / "runs" / name
    (run / "cells" / "a" / "ckpt").mkdir(parents=True)
    record = {"schema": 1, "run": name, "started_at": datetime.now(timezone.utc).isoformat()}
    record.update(pgid=pid, sid=pid, pids=[pid], detach="setsid", cells=[{"name": "a", "command": ["true"]}])
    (run / "run.json").write_text(json.dumps(record))
    (run / "cells" / "a" / "log").write_text("epoch 1/1 loss: nan\n")
    (run / "cells" / "a" / "ckpt" / "best.pth").write_bytes(os.urandom(64 * 1024))
    (run / "cells" / "a" / "empty").mkdir()
    (run / "cells" / "a" / "latest").symlink_to("ckpt/best.pth")
    (run / ".patrol").mkdir()
    (run / ".patrol" / "cursor.json").write_text("{}")
    (run / "DONE").write_text("")
    return run


def snapshot(root: Path) -> Dict[str, Tuple[Any, ...]]:
    """Every entry under ``root``: kind, inode, mode and, for a file its bytes, for a link its target."""
    found: Dict[str, Tuple[Any, ...]] = {}
    for top, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(top) / name
            info = path.lstat()
            if path.is_symlink():
                found[str(path.relative_to(root))] = ("link", info.st_ino, os.readlink(path))
            elif path.is_dir():
                found[str(path.relative_to(root))] = ("dir", info.st_ino, info.st_mode)
            else:
                found[str(path.relative_to(root))] = ("file", info.st_ino, info.st_mode, path.read_bytes())
    return found


def archive(data: Path, run: Any, check_mode: bool = False, **more: Any) -> Dict[str, Any]:
    return archive_runs(dict({"data_dir": str(data), "run": run}, **more), check_mode, now=NOW)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    make_run(tmp_path / "data", "alpha")
    make_run(tmp_path / "data", "beta")
    return tmp_path / "data"


@pytest.fixture
def marked(data: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A live process carrying alpha's marker, as a worker that left the runner's session would."""
    env = dict(os.environ, RGT_RUN_DIR=str(data / "runs" / "alpha"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    time.sleep(0.2)
    yield child
    child.kill()
    child.wait()


def test_a_finished_run_is_renamed_whole_and_nothing_is_deleted(data):
    before = snapshot(data / "runs" / "alpha")
    result = archive(data, "alpha", reason="results pulled by hand")
    target = data / "runs" / ".archive" / f"alpha-{STAMP}"
    assert result["changed"] is True and result["refused"] is False and result["problems"] == []
    (entry,) = result["runs"]
    assert (entry["state"], entry["path"], entry["from"]) == ("archived", str(target), str(data / "runs" / "alpha"))
    assert (entry["archived_at"], entry["reason"]) == ("2026-12-01T12:00:00Z", "results pulled by hand")
    assert result["msg"] == f"archive: alpha -> .archive/alpha-{STAMP}; nothing deleted"
    assert not (data / "runs" / "alpha").exists()
    # Same inodes, modes, bytes and link targets: a rename, never a copy.
    assert snapshot(target) == before
    record = json.loads(Path(entry["record"]).read_text())
    assert record == {
        "run": "alpha",
        "from": str(data / "runs" / "alpha"),
        "to": str(target),
        "archived_at": "2026-12-01T12:00:00Z",
        "reason": "results pulled by hand",
        "durable": {"state": "no_durable_dir", "dir": None, "from": None, "to": None},
    }
    assert (data / "runs" / "beta").is_dir()


def test_an_archived_run_is_listed_as_archived_never_as_a_run(data):
    archive(data, "alpha")
    assert list_runs(str(data)) == ["beta"]
    (archived,) = list_archived(str(data))
    assert (archived.run, archived.entry, archived.stamp) == ("alpha", f"alpha-{STAMP}", STAMP)
    assert archived.path == str(data / "runs" / ".archive" / f"alpha-{STAMP}")
    # A run name that itself ends like a stamp keeps its whole name.
    match = ARCHIVED_PATTERN.match(f"r-20250101T000000Z-{STAMP}")
    assert match is not None and (match["run"], match["stamp"]) == ("r-20250101T000000Z", STAMP)


def test_archiving_twice_is_a_no_op_that_says_where_the_run_is(data):
    first = archive(data, "alpha", reason="old")
    again = archive_runs({"data_dir": str(data), "run": ["alpha"]}, False, now=NOW + 3600)
    assert again["changed"] is False and again["refused"] is False
    (entry,) = again["runs"]
    assert (entry["state"], entry["path"]) == ("already_archived", first["runs"][0]["path"])
    assert (entry["archived_at"], entry["reason"]) == ("2026-12-01T12:00:00Z", "old")
    assert again["msg"] == f"archive: alpha already archived as .archive/alpha-{STAMP}"
    assert len(list_archived(str(data))) == 1


def test_a_live_run_is_refused_naming_the_process_that_carries_its_marker(data, marked):
    before = snapshot(data)
    with pytest.raises(ArchiveRefused) as refused:
        archive(data, "alpha")
    message = str(refused.value)
    assert message.startswith("archive: run alpha is live: 1 of its processes run (pid ")
    assert str(marked.pid) in message and "RGT_RUN_DIR" in message and message.endswith("; nothing moved")
    assert refused.value.facts["refused"] is True and refused.value.facts["runs"][0]["state"] == "refused"
    after = snapshot(data)
    assert {key: value for key, value in after.items() if key != "runs/.launch.lock"} == before
    marked.kill()
    marked.wait()
    assert archive(data, "alpha")["runs"][0]["state"] == "archived"


def test_a_live_runner_is_refused(tmp_path):
    runner = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own session: pgid = sid = pid
    try:
        make_run(tmp_path / "data", "alpha", pid=runner.pid)
        with pytest.raises(ArchiveRefused, match=rf"run alpha is live: its runner is alive \(pgid {runner.pid}\)"):
            archive(tmp_path / "data", "alpha")
        assert (tmp_path / "data" / "runs" / "alpha" / "run.json").exists()
    finally:
        runner.kill()
        runner.wait()


def test_one_refused_run_moves_none_of_the_others(data, marked):
    with pytest.raises(ArchiveRefused) as refused:
        archive(data, ["beta", "alpha"])
    states = [entry["state"] for entry in refused.value.facts["runs"]]
    assert states == ["not_moved", "refused"]
    assert (data / "runs" / "beta").is_dir() and not (data / "runs" / ".archive").exists()


def test_a_typo_is_refused_with_the_closest_run_named(data):
    with pytest.raises(ArchiveRefused) as refused:
        archive(data, "alpah")
    assert str(refused.value) == (
        f"archive: run alpah: {data / 'runs' / 'alpah'} does not exist; did you mean alpha?; nothing moved"
    )
    with pytest.raises(ArchiveRefused, match="does not exist; runs on this box: alpha, beta; nothing moved"):
        archive(data, "zzz")
    (data.parent / "empty").mkdir()
    with pytest.raises(ArchiveRefused, match="does not exist; there is no run on this box"):
        archive(data.parent / "empty", "alpha")


def test_bad_options_are_one_line_errors_naming_the_option(data):
    with pytest.raises(ValueError, match=r"^run: '\.\./x' is no run name \(a name matches "):
        archive(data, ["alpha", "../x"])
    with pytest.raises(ValueError, match=r"^run must name at least one run$"):
        archive(data, [])
    with pytest.raises(ValueError, match=r"^data_dir must be an absolute path, not 'data'$"):
        archive_runs({"data_dir": "data", "run": "alpha"}, False)
    with pytest.raises(ArchiveRefused, match=r"^data_dir /nonexistent/data: not found$"):
        archive_runs({"data_dir": "/nonexistent/data", "run": "alpha"}, False)


def test_check_mode_says_where_and_writes_nothing(data):
    before = snapshot(data)
    result = archive(data, "alpha", check_mode=True, reason="why")
    (entry,) = result["runs"]
    assert result["changed"] is True and entry["state"] == "would_archive" and entry["reason"] == "why"
    assert entry["path"] == str(data / "runs" / ".archive" / f"alpha-{STAMP}") and entry["record"] is None
    assert result["msg"] == f"archive: alpha would move to .archive/alpha-{STAMP}"
    assert snapshot(data) == before  # not even the launch lock's file


def test_a_torn_down_run_is_nothing_to_do_and_an_unfinished_teardown_is_refused(data):
    tombstones = data / "runs" / ".torn_down"
    tombstones.mkdir()
    (tombstones / "gone.json").write_text(json.dumps({"state": "removed"}))
    result = archive(data, "gone")
    assert (result["changed"], result["runs"][0]["state"]) == (False, "torn_down")
    (tombstones / "beta.json").write_text(json.dumps({"state": "removing"}))
    with pytest.raises(ArchiveRefused, match="run beta: its teardown did not finish"):
        archive(data, "beta")


def test_a_rename_across_filesystems_is_refused_never_copied(data, monkeypatch):
    def cross_device(source: str, target: str) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(_archive.os, "rename", cross_device)  # the forked child inherits it
    with pytest.raises(ArchiveRefused, match=r"is on another filesystem than .*: nothing copied"):
        archive(data, "alpha")
    assert (data / "runs" / "alpha" / "run.json").exists()
    assert not any((data / "runs" / ".archive").iterdir())


def test_a_hung_data_dir_fails_within_the_deadline(data, monkeypatch):
    monkeypatch.setattr(_archive, "_plan", lambda *args: time.sleep(30))
    started = time.monotonic()
    with pytest.raises(ArchiveRefused, match=r"did not answer within 0\.5 s \(a hung mount\?\)"):
        archive_runs({"data_dir": str(data), "run": "alpha", "timeout_s": 0.5}, False)
    assert time.monotonic() - started < 10


# --- the durable copy moves with the run (issue 29, item 5) ---------------------------------------------------------


def with_durable(data: Path, name: str, launch_id: str = "L1") -> Path:
    """Give the run a durable_dir and launch id in its run.json, and that launch's verified durable copy."""
    durable = data.parent / "durable"
    record = json.loads((data / "runs" / name / "run.json").read_text())
    record.update(durable_dir=str(durable), launch_id=launch_id)
    (data / "runs" / name / "run.json").write_text(json.dumps(record))
    copy = durable / "runs" / name
    (copy / "cells" / "a").mkdir(parents=True)
    weights = os.urandom(4096)
    (copy / "cells" / "a" / "best.pth").write_bytes(weights)
    digest = hashlib.sha256(weights).hexdigest()
    (copy / "MANIFEST.sha256").write_text(f"{digest}  4096  cells/a/best.pth\n")
    (copy / ".launch.json").write_text(json.dumps({"run": name, "launch_id": launch_id}))
    return durable


def test_the_durable_copy_moves_with_the_run_out_of_reach_of_a_new_run_of_its_name(data):
    durable = with_durable(data, "alpha")
    before = snapshot(durable / "runs" / "alpha")
    result = archive(data, "alpha")
    (entry,) = result["runs"]
    moved = durable / "runs" / ".archive" / f"alpha-{STAMP}"
    expected = {"state": "moved", "dir": str(durable), "from": str(durable / "runs" / "alpha"), "to": str(moved)}
    assert entry["state"] == "archived" and entry["durable"] == expected
    assert result["msg"] == f"archive: alpha -> .archive/alpha-{STAMP} (durable copy -> {moved}); nothing deleted"
    assert not (durable / "runs" / "alpha").exists() and snapshot(moved) == before  # a rename: same inodes, bytes
    assert json.loads(Path(entry["record"]).read_text())["durable"] == expected
    # A new launch of the name starts afresh (no refusal) and its sync cannot touch the archived copy.
    assert plan("alpha", str(data), str(durable), launch_id="L2", has_scratch=False, new_attempt=False).archives == ()
    fresh = str(durable / "runs" / "alpha")
    claim_durable(fresh, "alpha", "L2")
    update_manifest(fresh, "a", [{"path": "best.pth", "size": 1, "sha256": "0" * 64}])
    assert snapshot(moved) == before
    # Archiving again changes nothing and says where the copy is.
    again = archive(data, "alpha")
    assert again["changed"] is False and again["runs"][0]["durable"] == expected


def test_a_durable_copy_of_another_launch_or_none_is_left_and_said(data):
    durable = with_durable(data, "alpha", launch_id="L1")
    record = json.loads((data / "runs" / "alpha" / "run.json").read_text())
    (data / "runs" / "alpha" / "run.json").write_text(json.dumps(dict(record, launch_id="L0")))
    record = json.loads((data / "runs" / "beta" / "run.json").read_text())
    (data / "runs" / "beta" / "run.json").write_text(json.dumps(dict(record, durable_dir=str(durable))))
    result = archive(data, ["alpha", "beta"], check_mode=True)
    assert [entry["durable"]["state"] for entry in result["runs"]] == ["other_launch", "none"]
    assert result["runs"][0]["durable"]["to"] is None
    result = archive(data, ["alpha", "beta"])
    assert [entry["durable"]["state"] for entry in result["runs"]] == ["other_launch", "none"]
    assert (durable / "runs" / "alpha" / "MANIFEST.sha256").exists()  # another launch's: not this run's to move


def test_check_mode_says_where_the_durable_copy_would_go(data):
    durable = with_durable(data, "alpha")
    before = snapshot(durable)
    result = archive(data, "alpha", check_mode=True)
    moved = durable / "runs" / ".archive" / f"alpha-{STAMP}"
    assert result["runs"][0]["durable"]["state"] == "would_move"
    assert result["msg"] == f"archive: alpha would move to .archive/alpha-{STAMP} (durable copy to {moved})"
    assert snapshot(durable) == before


@pytest.mark.parametrize("obstacle", ["name_taken", "archive_is_a_file", "another_filesystem", "launch_unreadable"])
def test_a_durable_copy_that_cannot_move_refuses_in_one_line_and_nothing_moves(data, monkeypatch, obstacle):
    durable = with_durable(data, "alpha")
    root = durable / "runs" / ".archive"
    if obstacle == "name_taken":
        (root / f"alpha-{STAMP}").mkdir(parents=True)
        why = f"{root / f'alpha-{STAMP}'} exists already (the name is taken)"
    elif obstacle == "archive_is_a_file":
        root.write_text("")
        why = f"{root} is not a directory (a link or a file)"
    elif obstacle == "launch_unreadable":
        (durable / "runs" / "alpha" / ".launch.json").write_text("{no json")
        why = f"{durable / 'runs' / 'alpha'} has an unreadable .launch.json ("
    else:
        real = os.lstat
        source = str(durable / "runs" / "alpha")

        def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            found = real(path, *args, **kwargs)
            if str(path) != source:
                return found
            fields = list(found)
            fields[2] += 1  # st_dev: a volume mounted there
            return os.stat_result(fields)

        monkeypatch.setattr(_archive_durable.os, "lstat", lstat)
        why = f"{source} is on another filesystem than {durable / 'runs'}: a rename cannot move it"
    before = snapshot(data.parent)
    with pytest.raises(ArchiveRefused) as refused:
        archive(data, ["beta", "alpha"])
    message = str(refused.value)
    assert f"run alpha: {why}" in message and message.endswith("; nothing moved") and "\n" not in message
    assert [entry["state"] for entry in refused.value.facts["runs"]] == ["not_moved", "refused"]
    after = snapshot(data.parent)
    assert {key: value for key, value in after.items() if key != "data/runs/.launch.lock"} == before


def test_a_hung_durable_dir_refuses_within_its_deadline(data, monkeypatch):
    with_durable(data, "alpha")
    monkeypatch.setattr(_archive_durable, "DURABLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_archive_durable, "_look", lambda *args: time.sleep(30))
    started = time.monotonic()
    with pytest.raises(ArchiveRefused, match=r"run alpha: durable_dir .* did not answer within 0\.5 s \(a hung mount"):
        archive(data, "alpha")
    assert time.monotonic() - started < 10 and (data / "runs" / "alpha").is_dir()


def test_the_durable_copy_moves_first_and_back_when_the_scratch_cannot_move(data, monkeypatch):
    durable = with_durable(data, "alpha")
    before = snapshot(data.parent)
    real = os.rename
    scratch = str(data / "runs" / "alpha")

    def rename(source: str, target: str) -> None:
        if source == scratch:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(source, target)

    monkeypatch.setattr(_archive.os, "rename", rename)
    with pytest.raises(ArchiveRefused) as refused:
        archive(data, "alpha")
    assert "its durable copy moved back" in str(refused.value)
    after = snapshot(data.parent)
    # Everything where it was; the empty .archive directories made for the moves stay.
    kept = ("data/runs/.launch.lock", "data/runs/.archive", "durable/runs/.archive")
    assert {key: value for key, value in after.items() if key not in kept} == before
    assert (durable / "runs" / "alpha" / "MANIFEST.sha256").exists()


def test_a_sharded_launchs_copy_holding_other_boxes_cells_stays_and_a_new_run_cannot_overwrite_it(data):
    durable = with_durable(data, "alpha")
    (durable / "runs" / "alpha" / "cells" / "peer").mkdir()  # another box's shard of launch L1
    before = snapshot(durable)
    result = archive(data, "alpha")
    (entry,) = result["runs"]
    assert entry["state"] == "archived" and (entry["durable"]["state"], entry["durable"]["to"]) == ("shared", None)
    assert result["msg"].endswith("left: it holds other boxes' cells of the launch); nothing deleted")
    assert snapshot(durable) == before
    # Left in place, it is out of a new run's reach: a launch that would write its cell a is refused, no join offered.
    with pytest.raises(AttemptRefused) as refused:
        plan("alpha", str(data), str(durable), launch_id="L2", has_scratch=False, new_attempt=False, cells=["a"])
    assert "launch_id: L1" not in str(refused.value) and "would overwrite its cell a" in str(refused.value)
