"""run_scratch's removal and every refusal, on real files, links, processes and mount points.

Each refusal test also names a valid target before the bad one and proves that it is still there: every target is
checked before any is removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _run_scratch, _scratch_checks
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._run_scratch import (
    ScratchFailure,
    run_scratch,
)

DEAD_PID = 2**22 + 7  # above the kernel's largest PID: never alive
CHECKPOINT = b"w" * 1000


def write_run_json(run_dir: Path, **fields: Any) -> None:
    record = {"schema": 1, "run": run_dir.name, "started_at": datetime.now(timezone.utc).isoformat()}
    record.update({"pgid": DEAD_PID, "sid": DEAD_PID, "pids": [DEAD_PID], "detach": "setsid"}, **fields)
    (run_dir / "run.json").write_text(json.dumps(record))


@pytest.fixture
def box(tmp_path: Path) -> Dict[str, Path]:
    """A finished run r1 (dead runner, one cell, a checkpoint), its durable copy, another run and a cache dir."""
    data, durable = tmp_path / "data", tmp_path / "durable"
    run = data / "runs" / "r1"
    (run / "cells" / "a" / "ckpt").mkdir(parents=True)
    write_run_json(run)
    (run / "cells" / "a" / "log").write_text("epoch 1/1\n")
    (run / "cells" / "a" / "ckpt" / "best.pth").write_bytes(CHECKPOINT)
    (run / "DONE").write_text("")
    saved = durable / "runs" / "r1" / "cells" / "a" / "ckpt"
    saved.mkdir(parents=True)
    (saved / "best.pth").write_bytes(CHECKPOINT)
    (data / "runs" / "other").mkdir()
    (data / "runs" / "other" / "keep").write_text("another run's")
    cache = data / "cache"
    cache.mkdir()
    (cache / "blob").write_bytes(b"12345")
    return {"data": data, "durable": durable, "run": run, "cache": cache, "saved": saved / "best.pth", "tmp": tmp_path}


def params(box: Dict[str, Path], run: Any = "r1", **extra: Any) -> Dict[str, Any]:
    args: Dict[str, Any] = {"runs": [run], "data_dir": str(box["data"]), "durable_dir": str(box["durable"])}
    args.update(extra_paths=[str(box["cache"])], timeout_s=30.0)
    args.update(extra)
    return args


def tree(root: Path) -> Dict[str, bytes]:
    """Every file and link under root (links by target), to prove nothing changed."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[str(path)] = os.readlink(path).encode()
        elif path.is_file():
            found[str(path)] = path.read_bytes()
    return found


def refused(box: Dict[str, Path], fragment: str, **extra: Any) -> ScratchFailure:
    """Run with ``extra``; assert a refusal naming ``fragment`` and that no file anywhere under tmp changed."""
    before = tree(box["tmp"])
    with pytest.raises(ScratchFailure) as failure:
        run_scratch(params(box, **extra), check_mode=False)
    message = str(failure.value)
    assert message.startswith("run_scratch refused: ") and message.endswith("; nothing removed")
    assert "\n" not in message
    assert fragment in message or any(fragment in line for line in failure.value.facts["problems"])
    assert failure.value.facts["refused"] is True and failure.value.facts["removed"] == []
    assert tree(box["tmp"]) == before
    assert not (box["data"] / "runs" / ".torn_down").exists()
    return failure.value


def test_removes_the_run_and_extra_paths_and_writes_the_tombstone(box):
    run_json_bytes = (box["run"] / "run.json").stat().st_size
    result = run_scratch(params(box), check_mode=False)
    assert result["changed"] is True
    assert not box["run"].exists() and not box["cache"].exists()
    assert box["saved"].read_bytes() == CHECKPOINT  # the durable copy stays
    assert (box["data"] / "runs" / "other" / "keep").exists()
    size = len(CHECKPOINT) + len("epoch 1/1\n") + run_json_bytes
    expected = [
        {"path": str(box["run"]), "files": 4, "bytes": size, "run": "r1"},
        {"path": str(box["cache"]), "files": 1, "bytes": 5, "run": None},
    ]
    assert result["removed"] == expected
    tombstone = box["data"] / "runs" / ".torn_down" / "r1.json"
    assert result["runs"] == [{"run": "r1", "state": "removed", "tombstone": str(tombstone), "verified": 0}]
    record = json.loads(tombstone.read_text())
    assert (record["run"], record["state"], record["removed"]) == ("r1", "removed", expected)
    removed_at = datetime.fromisoformat(record["removed_at"])
    assert removed_at.utcoffset().total_seconds() == 0
    assert abs(time.time() - removed_at.timestamp()) < 60
    assert result["msg"] == f"removed 2 path(s), 5 file(s), {sum(e['bytes'] for e in expected)} bytes of run r1"


def test_a_second_call_changes_nothing_and_keeps_the_tombstone(box):
    run_scratch(params(box), check_mode=False)
    tombstone = box["data"] / "runs" / ".torn_down" / "r1.json"
    first = tombstone.read_bytes()
    again = run_scratch(params(box), check_mode=False)
    assert (again["changed"], again["removed"], again["runs"][0]["tombstone"]) == (False, [], str(tombstone))
    assert again["runs"][0]["state"] == "already_removed"
    assert again["msg"].startswith("nothing to remove for run r1 (torn down at ")
    assert tombstone.read_bytes() == first


def test_a_later_extra_path_is_added_to_the_tombstone(box):
    run_scratch(params(box, extra_paths=[]), check_mode=False)
    result = run_scratch(params(box), check_mode=False)
    assert result["removed"] == [{"path": str(box["cache"]), "files": 1, "bytes": 5, "run": None}]
    record = json.loads((box["data"] / "runs" / ".torn_down" / "r1.json").read_text())
    assert [entry["path"] for entry in record["removed"]] == [str(box["run"]), str(box["cache"])]


def test_a_run_that_never_existed_is_nothing_to_do_and_writes_no_tombstone(box):
    result = run_scratch(params(box, run="never", extra_paths=[]), check_mode=False)
    assert (result["changed"], result["removed"], result["runs"][0]["tombstone"]) == (False, [], None)
    assert not (box["data"] / "runs" / ".torn_down").exists()


def test_check_mode_removes_nothing_and_says_what_would_go(box):
    before = tree(box["tmp"])
    result = run_scratch(params(box), check_mode=True)
    assert result["changed"] is True and result["removed"] == []
    assert [entry["path"] for entry in result["would_remove"]] == [str(box["run"]), str(box["cache"])]
    assert result["would_remove"][1] == {"path": str(box["cache"]), "files": 1, "bytes": 5, "run": None}
    assert result["msg"].startswith("would remove 2 path(s), 5 file(s), ") and result["msg"].endswith(" of run r1")
    assert result["runs"][0]["state"] == "would_remove"
    assert result["runs"][0]["tombstone"] == str(box["data"] / "runs" / ".torn_down" / "r1.json")
    assert tree(box["tmp"]) == before
    assert not (box["data"] / "runs" / ".torn_down").exists()


def test_check_mode_refuses_like_a_real_run(box):
    with pytest.raises(ScratchFailure, match="resolves to /"):
        run_scratch(params(box, extra_paths=["/"]), check_mode=True)


# --- links: never followed ------------------------------------------------------------------------------------------


def test_links_inside_the_run_to_durable_files_cost_no_durable_file(box):
    cell = box["run"] / "cells" / "a"
    (cell / "to_file").symlink_to(box["saved"])
    (cell / "to_dir").symlink_to(box["durable"] / "runs" / "r1")
    (cell / "to_root").symlink_to("/")
    durable_before = tree(box["durable"])
    result = run_scratch(params(box), check_mode=False)
    assert not box["run"].exists()
    assert tree(box["durable"]) == durable_before
    assert result["removed"][0]["files"] == 7  # the three links count as entries


def test_a_run_dir_that_links_inside_data_dir_is_unlinked_not_followed(box):
    real = box["data"] / "big" / "r1"
    real.parent.mkdir()
    box["run"].rename(real)
    box["run"].symlink_to(real)
    result = run_scratch(params(box, extra_paths=[]), check_mode=False)
    assert not os.path.lexists(box["run"])
    assert (real / "cells" / "a" / "ckpt" / "best.pth").read_bytes() == CHECKPOINT
    assert result["removed"] == [{"path": str(box["run"]), "files": 1, "bytes": 0, "run": "r1"}]


def test_a_data_dir_reached_through_a_link_is_removed_from_its_real_place(box):
    link = box["tmp"] / "data-link"
    link.symlink_to(box["data"])
    result = run_scratch(params(box, data_dir=str(link), extra_paths=[str(link / "cache")]), check_mode=False)
    assert result["changed"] is True
    assert not box["run"].exists() and not box["cache"].exists() and link.is_symlink()
    assert (box["data"] / "runs" / ".torn_down" / "r1.json").exists()


def test_a_target_named_twice_or_inside_another_is_removed_once(box):
    inner = str(box["run"] / "cells")
    result = run_scratch(params(box, extra_paths=[str(box["run"]), inner, str(box["cache"])]), check_mode=False)
    assert [entry["path"] for entry in result["removed"]] == [str(box["run"]), str(box["cache"])]


def test_a_dangling_link_is_unlinked(box):
    dangling = box["data"] / "stale-cache"
    dangling.symlink_to(box["data"] / "gone")
    result = run_scratch(params(box, extra_paths=[str(dangling)]), check_mode=False)
    assert not os.path.lexists(dangling)
    assert result["removed"][1] == {"path": str(dangling), "files": 1, "bytes": 0, "run": None}


def test_a_missing_extra_path_is_fine(box):
    result = run_scratch(params(box, extra_paths=[str(box["data"] / "gone")]), check_mode=False)
    assert [entry["path"] for entry in result["removed"]] == [str(box["run"])]


# --- refusals -------------------------------------------------------------------------------------------------------


def test_refuses_root(box):
    refused(box, "/ resolves to /", extra_paths=[str(box["cache"]), "/"])


def test_refuses_a_data_dir_that_is_root(box):
    refused(box, "data_dir / resolves to /", data_dir="/", extra_paths=[])


@pytest.mark.parametrize("home", ["/root", "/home"])
def test_refuses_a_real_home_directory(box, home):
    refused(box, f"home directory {os.path.realpath(home)}", extra_paths=[str(box["cache"]), home])


def test_refuses_the_users_home_and_a_tree_holding_it(box, monkeypatch):
    alice = box["data"] / "users" / "alice"
    alice.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(alice))
    refused(box, f"resolves to the home directory {alice}", extra_paths=[str(box["cache"]), str(alice)])
    refused(box, f"holds the home directory {alice}", extra_paths=[str(box["cache"]), str(alice.parent)])


def test_refuses_a_home_directory_from_the_password_database(box, monkeypatch):
    bob = box["data"] / "svc" / "bob"
    bob.mkdir(parents=True)
    entry = pwd.struct_passwd(("bob", "x", 1500, 1500, "", str(bob), "/bin/sh"))
    monkeypatch.setattr(pwd, "getpwall", lambda: [entry])
    refused(box, f"resolves to the home directory {bob}", extra_paths=[str(box["cache"]), str(bob)])


def test_refuses_a_run_dir_that_links_to_a_home_directory(box):
    box["run"].rename(box["data"] / "moved")
    box["run"].symlink_to("/root")
    refused(box, "resolves to the home directory /root")


def test_refuses_a_real_mount_point(box, monkeypatch):
    if not os.path.ismount("/dev/shm"):
        pytest.skip("/dev/shm is no mount point here")
    monkeypatch.setattr(_run_scratch, "_remove_one", _must_not_remove)
    with pytest.raises(ScratchFailure, match=r"/dev/shm is a mount point \(/dev/shm\)"):
        run_scratch({"runs": ["r1"], "data_dir": "/dev", "extra_paths": ["/dev/shm"]}, check_mode=False)


def test_refuses_proc_as_a_mount_point_and_outside_data_dir(box, monkeypatch):
    monkeypatch.setattr(_run_scratch, "_remove_one", _must_not_remove)
    failure = refused(box, "/proc is a mount point (/proc)", extra_paths=[str(box["cache"]), "/proc"])
    assert any("outside data_dir" in line for line in failure.facts["problems"])


def _must_not_remove(target):
    raise AssertionError(f"would have removed {target['path']}")


def test_refuses_a_target_that_is_a_mount_point(box, monkeypatch):
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: str(path) == str(box["cache"]) or real_ismount(path))
    refused(box, f"{box['cache']} is a mount point", extra_paths=[str(box["cache"])])


def test_refuses_a_tree_holding_a_mount_point_below(box, monkeypatch):
    mounted = box["run"] / "cells" / "a" / "ckpt"
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: str(path) == str(mounted) or real_ismount(path))
    refused(box, f"{box['run']} holds the mount point {mounted}")


def test_refuses_a_tree_holding_a_listed_mount_point(box, monkeypatch):
    listed = box["cache"] / "nfs"
    monkeypatch.setattr(_scratch_checks, "mount_points", lambda: ["/", str(listed)])
    refused(box, f"{box['cache']} holds the mount point {listed}")


def test_mountinfo_escapes_are_decoded(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("36 35 98:0 /mnt1 /mnt/with\\040space rw - ext3 /dev/root rw\n22 1 0:5 / / rw - ext4 x rw\n")
    assert _scratch_checks.mount_points(str(info)) == ["/mnt/with space", "/"]
    assert _scratch_checks.mount_points(str(tmp_path / "none")) == []


def test_refuses_a_run_dir_linking_outside_data_dir(box):
    elsewhere = box["tmp"] / "elsewhere"
    box["run"].rename(elsewhere)
    box["run"].symlink_to(elsewhere)
    refused(box, f"resolves to {elsewhere}, outside data_dir {box['data']}", extra_paths=[str(box["cache"])])
    assert (elsewhere / "cells" / "a" / "ckpt" / "best.pth").exists()


def test_refuses_a_run_dir_linking_into_durable_dir(box):
    durable = box["data"] / "durable"  # inside data_dir, so only the durable rule can refuse it
    (box["durable"]).rename(durable)
    box["run"].rename(box["data"] / "moved")
    box["run"].symlink_to(durable / "runs" / "r1")
    failure = refused(box, f"is inside durable_dir {durable}", durable_dir=str(durable))
    assert len(failure.facts["problems"]) == 1


def test_refuses_a_parent_link_that_leads_outside_data_dir(box):
    runs = box["data"] / "runs"
    runs.rename(box["tmp"] / "runs-elsewhere")
    runs.symlink_to(box["tmp"] / "runs-elsewhere")
    refused(box, "outside data_dir", extra_paths=[])


def test_refuses_dot_dot_in_an_extra_path_even_when_it_stays_inside(box):
    sneaky = f"{box['data']}/runs/../cache"
    refused(box, "contains '..'", extra_paths=[str(box["cache"]), sneaky])


def test_refuses_a_relative_or_empty_extra_path(box):
    refused(box, "extra_paths entry 'cache' is not an absolute path", extra_paths=["cache"])
    refused(box, "extra_paths entry '' is empty", extra_paths=[""])


def test_refuses_data_dir_itself(box):
    refused(box, f"is data_dir itself ({box['data']})", extra_paths=[str(box["cache"]), str(box["data"])])


def test_refuses_a_path_outside_data_dir(box):
    outside = box["tmp"] / "outside"
    outside.mkdir()
    refused(box, f"resolves to {outside}, outside data_dir", extra_paths=[str(box["cache"]), str(outside)])


def test_refuses_durable_dir_inside_the_run_dir(box):
    durable = box["run"] / "durable"
    durable.mkdir()
    refused(box, f"{box['run']} holds durable_dir {durable}", durable_dir=str(durable))


def test_refuses_durable_dir_equal_to_a_target(box):
    refused(box, f"is durable_dir {box['cache']}", durable_dir=str(box["cache"]))


def test_refuses_a_durable_dir_that_only_run_json_records(box):
    durable = box["run"] / "saved"
    durable.mkdir()
    write_run_json(box["run"], durable_dir=str(durable))
    refused(box, f"holds the durable_dir run.json records {durable}", durable_dir=None)


def test_refuses_extra_paths_that_hold_the_registry_or_another_run(box):
    refused(box, "holds the run registry", extra_paths=[str(box["data"] / "runs")])
    other = box["data"] / "runs" / "other"
    refused(box, "is inside the run registry", extra_paths=[str(other)])
    alias = box["data"] / "registry"
    alias.symlink_to(box["data"] / "runs")
    refused(box, f"{alias} holds the run registry", extra_paths=[str(alias)])


def test_refuses_a_directory_it_cannot_read(box, monkeypatch):
    unreadable = box["run"] / "cells"
    real_scandir = os.scandir

    def scandir(path):
        if str(path) == str(unreadable):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    refused(box, "cannot be read", extra_paths=[str(box["cache"])])


def test_refuses_an_alive_run(box):
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        write_run_json(box["run"], pgid=child.pid, sid=child.pid, pids=[child.pid])
        refused(box, f"run r1 is alive (pgid {child.pid}): stop it first", extra_paths=[str(box["cache"])])
        assert child.poll() is None
        child.kill()
        child.wait()
        assert run_scratch(params(box), check_mode=False)["changed"] is True
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_refuses_while_a_process_of_a_dead_runner_still_runs(box):
    env = dict(os.environ, RGT_RUN_DIR=str(box["run"]))
    orphan = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        refused(box, f"1 process(es) it started still run (pids {orphan.pid})")
    finally:
        orphan.kill()
        orphan.wait()


@pytest.mark.parametrize("content", ['{"pgid": ', "[1, 2]", '{"run": "r1"}', '{"pgid": NaN, "sid": 1}'])
def test_refuses_a_run_json_that_cannot_say_whether_the_run_lives(box, content):
    (box["run"] / "run.json").write_text(content)
    refused(box, "its run.json cannot be read, so whether it is alive is unknown")


def test_every_refusal_is_listed(box):
    failure = refused(box, "resolves to /", extra_paths=["/", "/root", "rel"])
    assert failure.facts["problems"] == [
        "extra_paths entry 'rel' is not an absolute path",
        "/ resolves to /",
        "/root resolves to the home directory /root",
        f"/root resolves to /root, outside data_dir {box['data']}",
    ]
    assert (
        str(failure)
        == "run_scratch refused: extra_paths entry 'rel' is not an absolute path (and 3 more); nothing removed"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"run": "../x"}, "run must match"),
        ({"run": ""}, "run must match"),
        ({"data_dir": "data"}, "data_dir must be an absolute path, not 'data'"),
        ({"durable_dir": "durable"}, "durable_dir must be an absolute path"),
        ({"state": "present"}, "state must be absent, not 'present'"),
    ],
)
def test_bad_options_raise_value_error_naming_them(box, change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_scratch(params(box, **change), check_mode=False)
    assert box["run"].exists()


# --- deadlines and the launch lock ----------------------------------------------------------------------------------


def test_checks_that_hang_fail_within_the_deadline_and_remove_nothing(box, monkeypatch):
    monkeypatch.setattr(_run_scratch, "plan", lambda request: time.sleep(30))
    started = time.monotonic()
    with pytest.raises(ScratchFailure, match=r"did not answer within 0.5 s \(a hung mount\?\); nothing removed"):
        run_scratch(params(box, timeout_s=0.5), check_mode=False)
    assert time.monotonic() - started < 10
    assert box["run"].exists()


def test_a_removal_that_hangs_leaves_the_tombstone_removing_and_a_rerun_finishes_it(box, monkeypatch):
    real = _run_scratch._remove_one
    monkeypatch.setattr(_run_scratch, "_remove_one", lambda target: time.sleep(30))
    with pytest.raises(ScratchFailure, match="removal failed: did not finish within 1 s") as failure:
        run_scratch(params(box, timeout_s=1.0), check_mode=False)
    assert "its tombstone says removing: run again to finish" in str(failure.value)
    tombstone = json.loads((box["data"] / "runs" / ".torn_down" / "r1.json").read_text())
    assert tombstone["state"] == "removing"
    assert tombstone["removing"][0]["path"] == str(box["run"])
    assert not (box["run"] / "cells" / "a").exists() and (box["run"] / "run.json").exists()  # stopped halfway
    monkeypatch.setattr(_run_scratch, "_remove_one", real)
    again = run_scratch(params(box), check_mode=False)
    assert again["runs"][0]["state"] == "removed" and not box["run"].exists() and not box["cache"].exists()
    assert json.loads((box["data"] / "runs" / ".torn_down" / "r1.json").read_text())["state"] == "removed"


def test_a_removal_error_reports_what_went_before_it(box, monkeypatch):
    real = _run_scratch._remove_one

    def remove_one(target):
        if target["path"] == str(box["cache"]):
            raise OSError(f"{target['path']}: Device or resource busy")
        real(target)

    monkeypatch.setattr(_run_scratch, "_remove_one", remove_one)
    with pytest.raises(ScratchFailure, match="Device or resource busy after removing 1 path") as failure:
        run_scratch(params(box), check_mode=False)
    assert [entry["path"] for entry in failure.value.facts["removed"]] == [str(box["run"])]
    record = json.loads((box["data"] / "runs" / ".torn_down" / "r1.json").read_text())
    assert record["state"] == "removed" and [entry["path"] for entry in record["removed"]] == [str(box["run"])]


def test_a_target_swapped_after_the_check_is_not_removed(box, monkeypatch):
    real_plan = _run_scratch.plan

    def plan_then_swap(request):
        answer = real_plan(request)
        os.rename(box["cache"], box["data"] / "cache-old")
        (box["cache"]).mkdir()
        return answer

    monkeypatch.setattr(_run_scratch, "plan", plan_then_swap)
    with pytest.raises(ScratchFailure, match="changed since it was checked"):
        run_scratch(params(box, extra_paths=[str(box["cache"])]), check_mode=False)
    assert (box["data"] / "cache-old" / "blob").exists()


def test_a_run_started_after_the_checks_is_refused_at_removal(box, monkeypatch):
    real_plan = _run_scratch.plan

    def plan_then_start(request):  # runs in the deadline's child: the sleep outlives it, as a runner would
        answer = real_plan(request)
        child = subprocess.Popen(["sleep", "60"], start_new_session=True, close_fds=True)
        write_run_json(box["run"], pgid=child.pid, sid=child.pid, pids=[child.pid])
        return answer

    monkeypatch.setattr(_run_scratch, "plan", plan_then_start)
    try:
        with pytest.raises(ScratchFailure, match=r"run r1 is alive \(pgid \d+\).*; nothing removed"):
            run_scratch(params(box), check_mode=False)
        assert box["run"].exists() and box["cache"].exists()
    finally:
        run_json = json.loads((box["run"] / "run.json").read_text())
        os.kill(run_json["pgid"], 9)


def test_a_held_launch_lock_fails_the_removal(box):
    lock = box["data"] / "runs" / ".launch.lock"
    handle = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with pytest.raises(ScratchFailure, match="another launch on this box held"):
            run_scratch(params(box, timeout_s=2.0), check_mode=False)
        assert box["run"].exists() and box["cache"].exists()
    finally:
        os.close(handle)
