"""Directory probes: df semantics, the read-only usage probe, the write probe, the deadline."""

from __future__ import annotations

import builtins
import errno
import os
import time

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box import _disk
from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._box_findings import disk_findings

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def statvfs(blocks: tuple, files: tuple, frsize: int = 4096) -> os.statvfs_result:
    # (f_blocks, f_bfree, f_bavail) and (f_files, f_ffree, f_favail), in os.statvfs_result's field order
    return os.statvfs_result((frsize, frsize, *blocks, *files, 0, 255))


def codes(findings):
    return [(f["code"], f["level"]) for f in findings]


def test_usage_follows_df_semantics_with_reserved_blocks():
    # 1000 blocks, 100 free of which 50 available to users (50 reserved for root), 200 of 1000 inodes free.
    usage = _disk.usage_from_statvfs(statvfs((1000, 100, 50), (1000, 200, 200)))
    assert usage["bytes_total"] == 1000 * 4096
    assert usage["bytes_free"] == 50 * 4096
    assert usage["bytes_used_pct"] == round(100 * 900 / 950, 1)
    assert usage["inodes_free"] == 200
    assert usage["inodes_used_pct"] == 80.0


def test_usage_without_inode_table_has_no_inode_percentage():
    usage = _disk.usage_from_statvfs(statvfs((1000, 500, 500), (0, 0, 0)))
    assert usage["inodes_used_pct"] is None
    assert usage["bytes_used_pct"] == 50.0


class WriteAttempted(Exception):
    """Not an OSError, so a probe that swallows OSError cannot hide the attempt."""


def refuse_writes(monkeypatch):
    """Make every write-mode open raise, through os.open and the builtin open; forked probe children inherit this.

    A read-only mode bit would not do: root writes through it.
    """
    real_os_open, real_open = os.open, builtins.open

    def guarded_os_open(name, flags, *args, **kwargs):
        if flags & WRITE_FLAGS:
            raise WriteAttempted(f"write attempted: {name}")
        return real_os_open(name, flags, *args, **kwargs)

    def guarded_open(name, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            raise WriteAttempted(f"write attempted: {name}")
        return real_open(name, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_os_open)
    monkeypatch.setattr(builtins, "open", guarded_open)


def test_usage_probe_writes_nothing_and_still_reports_usage(tmp_path, monkeypatch):
    (tmp_path / "kept").write_text("x")
    # A file created and deleted again still moves the directory's mtime.
    before = (tmp_path.stat().st_mtime_ns, sorted(os.listdir(tmp_path)))
    refuse_writes(monkeypatch)
    missing = str(tmp_path / "nope")
    results = _disk.probe_usage([str(tmp_path), missing], timeout_s=10)
    usage = results[str(tmp_path)]
    assert usage["exists"] is True
    assert usage["error"] is None
    assert usage["bytes_total"] > 0
    assert 0 <= usage["bytes_used_pct"] <= 100
    assert "writable" not in usage
    assert results[missing] == {"path": missing, "exists": False, "error": "does not exist"}
    assert (tmp_path.stat().st_mtime_ns, sorted(os.listdir(tmp_path))) == before
    # The same guard does stop the write probe, so the assertions above are not vacuous.
    assert "write attempted" in _disk.probe_paths([str(tmp_path)], timeout_s=10)[str(tmp_path)]["probe_error"]


def test_probe_writes_and_cleans_up(tmp_path):
    results = _disk.probe_paths([str(tmp_path)], timeout_s=10)
    result = results[str(tmp_path)]
    assert result["exists"] is True
    assert result["writable"] is True
    assert result["bytes_total"] > 0
    assert 0 <= result["bytes_used_pct"] <= 100
    assert list(tmp_path.iterdir()) == []


def test_probe_reports_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    result = _disk.probe_paths([missing], timeout_s=10)[missing]
    assert result["exists"] is False
    assert result["error"] == "does not exist"
    found = disk_findings("data", result, 90, 97, 10)
    assert codes(found) == [("dir_unwritable", "FAIL")]
    assert found[0]["reason"] == "missing"
    assert found[0]["action"] == "investigate"


def test_probe_reports_failed_write(tmp_path, monkeypatch):
    real_open = os.open

    def read_only_open(name, flags, *args):
        if _disk.PROBE_FILE_PREFIX in str(name):
            raise OSError(errno.EROFS, "Read-only file system", name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", read_only_open)  # inherited by the forked probe child
    result = _disk.probe_paths([str(tmp_path)], timeout_s=10)[str(tmp_path)]
    assert result["writable"] is False
    assert "Read-only file system" in result["error"]
    found = disk_findings("durable", result, 90, 97, 10)
    assert codes(found) == [("dir_unwritable", "FAIL")]
    assert found[0]["reason"] == "write_failed"


def test_hung_probe_times_out_and_child_is_killed(tmp_path, monkeypatch):
    def hang(path):
        time.sleep(120)

    monkeypatch.setattr(_disk, "probe_path", hang)
    healthy = tmp_path / "ok"
    healthy.mkdir()
    results = _disk.probe_paths([str(healthy)], timeout_s=0.3)
    assert results[str(healthy)] == {"path": str(healthy), "timed_out": True}
    found = disk_findings("data", results[str(healthy)], 90, 97, 0.3)
    assert codes(found) == [("dir_unwritable", "FAIL")]
    assert found[0]["reason"] == "timeout"
    assert "did not answer within 0.3 s" in found[0]["message"]


def test_probe_error_in_child_becomes_finding(monkeypatch, tmp_path):
    def broken(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_disk, "probe_path", broken)
    result = _disk.probe_paths([str(tmp_path)], timeout_s=10)[str(tmp_path)]
    assert "Input/output error" in result["probe_error"]
    assert disk_findings("data", result, 90, 97, 10)[0]["reason"] == "probe_error"
