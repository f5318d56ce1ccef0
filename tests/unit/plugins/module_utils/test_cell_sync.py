"""Prune, copy, re-read and compare, then the manifest: a file is synced only when its copy was checked."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner import _cell_sync
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import (
    SyncError,
    collect,
    prune,
    sync_cell,
    update_manifest,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._copy_verify import known_bad
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import parse_manifest


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cell(tmp_path):
    base = tmp_path / "data" / "runs" / "sweep" / "cells" / "a"
    (base / "sub").mkdir(parents=True)
    (base / "best.pth").write_bytes(b"best" * 1000)
    (base / "latest.pth").write_bytes(b"latest")
    (base / "sub" / "metrics.json").write_bytes(b"{}")
    (tmp_path / "durable").mkdir()
    return base


def sync(base, tmp_path, artifacts=("best.pth",), prune_patterns=("latest.pth",), cell_name="a", **kwargs):
    return sync_cell(
        str(base),
        prune_patterns=prune_patterns,
        artifact_patterns=artifacts,
        durable_dir=kwargs.pop("durable_dir", str(tmp_path / "durable")),
        run="sweep",
        cell=cell_name,
        **kwargs,
    )


def manifest(tmp_path):
    path = tmp_path / "durable" / "runs" / "sweep" / "MANIFEST.sha256"
    return path.read_text().splitlines() if path.exists() else []


def test_a_verified_sync_prunes_copies_checks_and_writes_the_manifest(cell, tmp_path):
    outcome = sync(cell, tmp_path, artifacts=("best.pth", "sub"))
    assert (outcome.sync, outcome.error, outcome.pruned) == ("verified", None, ("latest.pth",))
    durable = tmp_path / "durable" / "runs" / "sweep" / "cells" / "a"
    assert (durable / "best.pth").read_bytes() == (cell / "best.pth").read_bytes()  # byte for byte
    assert (durable / "sub" / "metrics.json").read_bytes() == b"{}"
    assert not (cell / "latest.pth").exists() and (cell / "best.pth").exists()  # the scratch copy is kept
    assert list(outcome.artifacts) == [
        {"path": "best.pth", "size": 4000, "sha256": sha(b"best" * 1000)},
        {"path": "sub/metrics.json", "size": 2, "sha256": sha(b"{}")},
    ]
    assert manifest(tmp_path) == [
        f"{sha(b'best' * 1000)}  4000  cells/a/best.pth",
        f"{sha(b'{}')}  2  cells/a/sub/metrics.json",
    ]
    assert not [name for name in os.listdir(durable) if name.endswith(".tmp") or _cell_sync.TEMP_MARK in name]


def test_a_second_sync_of_a_cell_replaces_its_lines_and_keeps_the_others(cell, tmp_path):
    (tmp_path / "durable" / "runs" / "sweep").mkdir(parents=True)
    update_manifest(str(tmp_path / "durable" / "runs" / "sweep"), "b", [{"path": "x", "size": 1, "sha256": "0" * 64}])
    sync(cell, tmp_path, artifacts=("best.pth", "sub"))
    (cell / "best.pth").write_bytes(b"better")
    sync(cell, tmp_path)
    assert manifest(tmp_path) == [f"{sha(b'better')}  6  cells/a/best.pth", f"{'0' * 64}  1  cells/b/x"]


def test_cells_finishing_together_never_lose_each_others_lines(tmp_path):
    durable_run = tmp_path / "durable" / "runs" / "sweep"
    durable_run.mkdir(parents=True)

    def write(index):
        update_manifest(str(durable_run), f"c{index}", [{"path": "best.pth", "size": index, "sha256": "a" * 64}])

    threads = [threading.Thread(target=write, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(line.split("  ")[2] for line in manifest(tmp_path)) == [f"cells/c{i}/best.pth" for i in range(8)]


def test_no_artifacts_declared_is_skipped_after_pruning(cell, tmp_path):
    outcome = sync(cell, tmp_path, artifacts=())
    assert (outcome.sync, outcome.pruned) == ("skipped", ("latest.pth",))
    assert not (tmp_path / "durable" / "runs").exists()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "durable_dir .* does not exist"),
        ("file", "durable_dir .* not a directory"),
        ("runs_file", "Not a directory"),
    ],
)
def test_a_durable_dir_that_cannot_take_the_copy_fails_loudly(cell, tmp_path, setup, message):
    durable = tmp_path / "durable"
    if setup == "missing":
        durable.rmdir()
    elif setup == "file":
        durable.rmdir()
        durable.write_text("not a dir")
    else:
        (durable / "runs").write_text("in the way")
    outcome = sync(cell, tmp_path)
    assert outcome.sync == "failed" and outcome.artifacts == ()
    assert re.search(message, outcome.error), outcome.error
    if setup == "missing":
        assert not durable.exists()  # never created: it is a mount, creating it would fill the box's own disk


def test_an_artifact_pattern_matching_nothing_is_a_failure(cell, tmp_path):
    outcome = sync(cell, tmp_path, artifacts=("best.pth", "best_metrics.json"))
    assert outcome.sync == "failed"
    assert outcome.error == f"artifact 'best_metrics.json' matched no file in {cell}"
    assert manifest(tmp_path) == []  # nothing of the cell is listed, not even the file that copied


def test_enospc_while_copying_fails_and_leaves_no_temporary(cell, tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_cell_sync, "_write_all", full)
    outcome = sync(cell, tmp_path)
    assert outcome.sync == "failed"
    assert outcome.error == "No space left on device (ENOSPC)"
    durable = tmp_path / "durable" / "runs" / "sweep" / "cells" / "a"
    assert os.listdir(durable) == [] and manifest(tmp_path) == []


def test_too_little_free_space_fails_before_any_copy(cell, tmp_path, monkeypatch):
    def usage(paths, timeout_s):
        return {path: {"path": path, "exists": True, "error": None, "bytes_free": 10} for path in paths}

    monkeypatch.setattr(_cell_sync, "probe_usage", usage)
    outcome = sync(cell, tmp_path)
    assert outcome.sync == "failed" and outcome.error.endswith("has 10 bytes free, the artifacts need 4000")


def test_a_durable_dir_that_does_not_answer_fails_without_copying(cell, tmp_path, monkeypatch):
    monkeypatch.setattr(_cell_sync, "probe_usage", lambda paths, timeout_s: {p: {"timed_out": True} for p in paths})
    outcome = sync(cell, tmp_path)
    assert outcome.sync == "failed" and "did not answer within" in outcome.error
    assert not (tmp_path / "durable" / "runs").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_copy_that_reads_back_different_is_never_synced(cell, tmp_path, monkeypatch, damage):
    real_hash = _cell_sync.hash_file

    def damaged_then_read(path, drop_cache=False):
        data = bytearray(open(path, "rb").read())  # noqa: SIM115 - tiny file
        if damage == "flip":
            data[10] ^= 0x01
        else:
            del data[100:]
        with open(path, "wb") as handle:
            handle.write(data)
        return real_hash(path, drop_cache)

    monkeypatch.setattr(_cell_sync, "hash_file", damaged_then_read)
    outcome = sync(cell, tmp_path)
    assert outcome.sync == "failed" and "does not match its source" in outcome.error
    assert manifest(tmp_path) == []


def test_a_stop_during_the_sync_is_a_failed_sync(cell, tmp_path):
    outcome = sync(cell, tmp_path, stopped=lambda: True)
    assert (outcome.sync, outcome.error) == ("failed", "run stopped during sync")


def test_prune_removes_only_files_inside_the_cell_directory(tmp_path):
    base = tmp_path / "cell"
    outside = tmp_path / "outside"
    (base / "ckpt").mkdir(parents=True)
    outside.mkdir()
    (outside / "latest.pth").write_bytes(b"not ours")
    (base / "escape").symlink_to(outside, target_is_directory=True)
    (base / "latest.pth").write_bytes(b"x")
    (base / "ckpt" / "latest.pth").write_bytes(b"x")
    deleted, problems = prune(str(base), ["latest.pth*", "**/latest.pth", "escape/latest.pth"])
    assert sorted(deleted) == ["ckpt/latest.pth", "latest.pth"]
    assert (outside / "latest.pth").exists()
    assert problems == [
        f"prune {p!r}: escape/latest.pth is outside {base}, kept" for p in ("**/latest.pth", "escape/latest.pth")
    ]


def test_prune_removes_hf_checkpoint_directories_and_never_follows_a_link_out(tmp_path):
    base = tmp_path / "cell"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"not ours")
    for step in (3, 6):
        (base / f"checkpoint-{step}").mkdir(parents=True)
        (base / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"o" * 100)
    (base / "checkpoint-6" / "escape").symlink_to(outside, target_is_directory=True)  # inside a pruned tree
    (base / "checkpoint-9").symlink_to(outside, target_is_directory=True)  # a link matching the pattern
    (base / "model.safetensors").write_bytes(b"final")
    (base / "log").write_text("the runner's own")
    deleted, problems = prune(str(base), ["checkpoint-*/", "*.log", "lo*"], keep=[str(base / "log")])
    assert (sorted(deleted), problems) == (["checkpoint-3/", "checkpoint-6/", "checkpoint-9"], [])  # a link: no /
    assert sorted(p.name for p in base.iterdir()) == ["log", "model.safetensors"]
    assert (outside / "model.safetensors").read_bytes() == b"not ours"  # the links went, never their target
    assert prune(str(base), ["**"]) == (["log", "model.safetensors"], [])  # never the checkpoint dir itself
    assert base.is_dir()


def test_collect_refuses_an_artifact_leading_outside(tmp_path):
    base = tmp_path / "cell"
    base.mkdir()
    (tmp_path / "secret").write_text("x")
    (base / "best.pth").symlink_to(tmp_path / "secret")
    with pytest.raises(SyncError, match="leads outside"):
        collect(str(base), ["best.pth"])
    (base / "best.pth").unlink()
    (base / "epoch9.pth").write_text("w")
    (base / "best.pth").symlink_to(base / "epoch9.pth")  # the usual best -> epoch link is followed
    assert collect(str(base), ["best.pth"]) == [("best.pth", str(base / "epoch9.pth"))]


@pytest.mark.parametrize(("code", "text"), [(errno.EROFS, "Read-only file system (EROFS)"), (errno.EACCES, "(EACCES)")])
def test_a_read_only_durable_dir_fails_with_its_reason(cell, tmp_path, monkeypatch, code, text):
    durable_runs = str(tmp_path / "durable" / "runs")
    real_makedirs = os.makedirs

    def refuse(path, *args, **kwargs):
        if str(path).startswith(durable_runs):  # as root, chmod cannot make a directory read-only for us
            raise OSError(code, os.strerror(code), str(path))
        return real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", refuse)
    outcome = sync(cell, tmp_path)
    assert outcome.sync == "failed" and text in outcome.error and durable_runs in outcome.error


def durable_files(tmp_path):
    root = tmp_path / "durable"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_first_sync_of_a_launch_records_it_and_the_same_launch_syncs_again(cell, tmp_path):
    assert sync(cell, tmp_path, launch_id="L1").sync == "verified"
    record = json.loads((tmp_path / "durable" / "runs" / "sweep" / ".launch.json").read_text())
    assert (record["run"], record["launch_id"]) == ("sweep", "L1")
    assert sync(cell, tmp_path, cell_name="b", launch_id="L1").sync == "verified"
    assert [line.split("  ")[2] for line in manifest(tmp_path)] == ["cells/a/best.pth", "cells/b/best.pth"]


def test_a_manifest_never_mixes_two_launches(cell, tmp_path):
    assert sync(cell, tmp_path, launch_id="L1").sync == "verified"
    before = durable_files(tmp_path)
    (cell / "best.pth").write_bytes(b"another launch's weights")
    for name in ("a", "b"):  # the same cell overwritten, or a new cell added beside the earlier launch's
        outcome = sync(cell, tmp_path, cell_name=name, launch_id="L2")
        assert (outcome.sync, outcome.artifacts) == ("failed", ())
        durable_run = tmp_path / "durable" / "runs" / "sweep"
        assert outcome.error == f"{durable_run} holds launch L1, this run is launch L2: nothing copied"
    assert durable_files(tmp_path) == before


def test_files_from_before_launch_ids_are_adopted_by_the_launch_that_syncs_into_them(cell, tmp_path):
    assert sync(cell, tmp_path).sync == "verified"  # no launch id: as the runner of an earlier release synced
    assert not (tmp_path / "durable" / "runs" / "sweep" / ".launch.json").exists()
    assert sync(cell, tmp_path, launch_id="L1").sync == "verified"
    assert json.loads((tmp_path / "durable" / "runs" / "sweep" / ".launch.json").read_text())["launch_id"] == "L1"


def test_optional_patterns_may_match_nothing_and_still_verify(cell, tmp_path):
    alone = sync(cell, tmp_path, artifacts=(), optional_patterns=("*.json", "best_metrics.*"))
    assert (alone.sync, alone.error, alone.artifacts) == ("verified", None, ())  # declared, nothing there: verified
    both = sync(cell, tmp_path, artifacts=("best.pth",), optional_patterns=("sub/*.json", "events.*"))
    assert both.sync == "verified" and [a["path"] for a in both.artifacts] == ["best.pth", "sub/metrics.json"]
    assert [line.split("  ")[2] for line in manifest(tmp_path)] == ["cells/a/best.pth", "cells/a/sub/metrics.json"]
    missing = sync(cell, tmp_path, artifacts=("final.pt",), optional_patterns=("best.pth",))
    assert (missing.sync, missing.error) == ("failed", f"artifact 'final.pt' matched no file in {cell}")


class Refuse:
    """A verifier that refuses one artifact by name, as a loader would."""

    def __init__(self, bad):
        self.bad, self.seen = bad, []

    def check(self, relative, path, stopped):
        self.seen.append(path)
        ok = relative != self.bad
        if ok:
            return {"path": relative, "ok": True, "message": "loaded"}
        return {"path": relative, "ok": False, "message": "RuntimeError: truncated", "bad": "verify_cmd"}


def test_an_artifact_its_check_refuses_fails_the_sync_with_the_checks_message(cell, tmp_path):
    refuse = Refuse("best.pth")
    outcome = sync(cell, tmp_path, artifacts=("best.pth", "sub"), verifier=refuse)
    durable = tmp_path / "durable" / "runs" / "sweep" / "cells" / "a"
    assert refuse.seen == [str(durable / "best.pth"), str(durable / "sub" / "metrics.json")]  # the copies
    assert (outcome.sync, outcome.error, outcome.artifacts) == ("failed", "best.pth: RuntimeError: truncated", ())
    assert [(c["path"], c["ok"]) for c in outcome.verify] == [("best.pth", False), ("sub/metrics.json", True)]
    assert "check best.pth: FAILED: RuntimeError: truncated" in outcome.log_lines()
    # The copies are faithful: the manifest says what the durable copy holds, and which of them are known bad.
    lines = manifest(tmp_path)
    assert (
        len(lines) == 3
        and lines[0].endswith("  cells/a/best.pth")
        and lines[1] == "# bad  verify_cmd  cells/a/best.pth"
    )
    entries, malformed = parse_manifest("\n".join(lines))  # a reader of the entries skips the mark
    assert list(entries) == ["cells/a/best.pth", "cells/a/sub/metrics.json"] and malformed == []
    assert known_bad("\n".join(lines)) == [{"path": "cells/a/best.pth", "bad": "verify_cmd"}]
    passed = sync(cell, tmp_path, artifacts=("best.pth",), verifier=Refuse("other"))
    assert (passed.sync, passed.verify) == ("verified", ({"path": "best.pth", "ok": True, "message": "loaded"},))
    assert known_bad("\n".join(manifest(tmp_path))) == []  # a copy that now passes is no longer marked


def test_a_check_cut_short_by_a_stop_marks_nothing_bad(cell, tmp_path):
    stop = threading.Event()

    class Stopping(Refuse):
        def check(self, relative, path, stopped):
            stop.set()  # the run is stopped while this check runs: its failure says nothing of the file
            return super().check(relative, path, stopped)

    outcome = sync(cell, tmp_path, artifacts=("best.pth",), verifier=Stopping("best.pth"), stopped=stop.is_set)
    assert outcome.sync == "failed" and known_bad("\n".join(manifest(tmp_path))) == []


def test_leftover_temporary_copies_of_the_runs_cells_are_cleared(tmp_path):
    durable_run = tmp_path / "durable" / "runs" / "sweep"
    leftovers = [
        "cells/a/.best.pth.rgt-tmp-0a1b2c3d",
        "cells/a/sub/.model.safetensors.rgt-tmp-deadbeef",
        "cells/b/.best.pth.rgt-1234abcd.tmp",  # an earlier version's name
        ".MANIFEST.sha256.rgt-tmp-00ff00ff",
        "MANIFEST.sha256.1234abcd.tmp",
        "..launch.json.89abcdef.tmp",
    ]
    kept = [
        "cells/a/best.pth",
        "cells/a/.hidden-but-ours",
        "cells/a/notes.rgt-tmp-0a1b2c3d",  # not hidden: an artifact's own name
        "cells/other-shard/.best.pth.rgt-tmp-0a1b2c3d",  # another box's cell may be copying it now
        "MANIFEST.sha256",
        ".launch.json",
    ]
    for relative in leftovers + kept:
        (durable_run / relative).parent.mkdir(parents=True, exist_ok=True)
        (durable_run / relative).write_bytes(b"x")
    removed = _cell_sync.clear_temp_copies(str(durable_run), ["a", "b", "never-synced"])
    assert sorted(removed) == sorted(leftovers)
    assert sorted(str(p.relative_to(durable_run)) for p in durable_run.rglob("*") if p.is_file()) == sorted(
        [*kept, ".MANIFEST.sha256.lock"]
    )
    assert _cell_sync.clear_temp_copies(str(tmp_path / "nowhere"), ["a"]) == []


def test_a_copy_in_progress_has_a_name_the_next_start_clears(cell, tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def look(source, destination):
        seen.append(os.path.basename(source))
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", look)
    assert sync(cell, tmp_path).sync == "verified"
    assert _cell_sync.TEMP_NAME.match(seen[0]) and seen[0].startswith(".best.pth.rgt-tmp-")
    assert _cell_sync.TEMP_NAME.match(seen[1]) and seen[1].startswith(".MANIFEST.sha256.rgt-tmp-")
