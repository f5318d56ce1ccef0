"""Box-level checks: directory probes, disk and inode thresholds, checkpoint budget, cgroup memory."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _box

GIB = 1024**3


def statvfs(blocks: tuple, files: tuple, frsize: int = 4096) -> os.statvfs_result:
    # (f_blocks, f_bfree, f_bavail) and (f_files, f_ffree, f_favail), in os.statvfs_result's field order
    return os.statvfs_result((frsize, frsize, *blocks, *files, 0, 255))


def probe(path="/data", used_bytes_pct=10.0, used_inodes_pct=10.0, **extra):
    base = {
        "path": path,
        "exists": True,
        "writable": True,
        "error": None,
        "bytes_total": 100 * GIB,
        "bytes_free": 50 * GIB,
        "bytes_used_pct": used_bytes_pct,
        "inodes_total": 1000,
        "inodes_free": 900,
        "inodes_used_pct": used_inodes_pct,
    }
    base.update(extra)
    return base


def codes(findings):
    return [(f["code"], f["level"]) for f in findings]


def test_usage_follows_df_semantics_with_reserved_blocks():
    # 1000 blocks, 100 free of which 50 available to users (50 reserved for root), 200 of 1000 inodes free.
    usage = _box.usage_from_statvfs(statvfs((1000, 100, 50), (1000, 200, 200)))
    assert usage["bytes_total"] == 1000 * 4096
    assert usage["bytes_free"] == 50 * 4096
    assert usage["bytes_used_pct"] == round(100 * 900 / 950, 1)
    assert usage["inodes_free"] == 200
    assert usage["inodes_used_pct"] == 80.0


def test_usage_without_inode_table_has_no_inode_percentage():
    usage = _box.usage_from_statvfs(statvfs((1000, 500, 500), (0, 0, 0)))
    assert usage["inodes_used_pct"] is None
    assert usage["bytes_used_pct"] == 50.0


def test_probe_writes_and_cleans_up(tmp_path):
    results = _box.probe_paths([str(tmp_path)], timeout_s=10)
    result = results[str(tmp_path)]
    assert result["exists"] is True
    assert result["writable"] is True
    assert result["bytes_total"] > 0
    assert 0 <= result["bytes_used_pct"] <= 100
    assert list(tmp_path.iterdir()) == []


def test_probe_reports_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    result = _box.probe_paths([missing], timeout_s=10)[missing]
    assert result["exists"] is False
    assert result["error"] == "does not exist"
    found = _box.disk_findings("data", result, 90, 97, 10)
    assert codes(found) == [("dir_unwritable", "FAIL")]
    assert found[0]["reason"] == "missing"
    assert found[0]["action"] == "investigate"


def test_probe_reports_failed_write(tmp_path, monkeypatch):
    real_open = os.open

    def read_only_open(name, flags, *args):
        if _box.PROBE_FILE_PREFIX in str(name):
            raise OSError(errno.EROFS, "Read-only file system", name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", read_only_open)  # inherited by the forked probe child
    result = _box.probe_paths([str(tmp_path)], timeout_s=10)[str(tmp_path)]
    assert result["writable"] is False
    assert "Read-only file system" in result["error"]
    found = _box.disk_findings("durable", result, 90, 97, 10)
    assert codes(found) == [("dir_unwritable", "FAIL")]
    assert found[0]["reason"] == "write_failed"


def test_hung_probe_times_out_and_child_is_killed(tmp_path, monkeypatch):
    def hang(path):
        time.sleep(120)

    monkeypatch.setattr(_box, "probe_path", hang)
    healthy = tmp_path / "ok"
    healthy.mkdir()
    results = _box.probe_paths([str(healthy)], timeout_s=0.3)
    assert results[str(healthy)] == {"path": str(healthy), "timed_out": True}
    found = _box.disk_findings("data", results[str(healthy)], 90, 97, 0.3)
    assert codes(found) == [("dir_unwritable", "FAIL")]
    assert found[0]["reason"] == "timeout"
    assert "did not answer within 0.3 s" in found[0]["message"]


def test_probe_error_in_child_becomes_finding(monkeypatch, tmp_path):
    def broken(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_box, "probe_path", broken)
    result = _box.probe_paths([str(tmp_path)], timeout_s=10)[str(tmp_path)]
    assert "Input/output error" in result["probe_error"]
    assert _box.disk_findings("data", result, 90, 97, 10)[0]["reason"] == "probe_error"


@pytest.mark.parametrize(
    ("bytes_pct", "inodes_pct", "expected"),
    [
        (89.9, 10.0, []),
        (90.0, 10.0, [("disk_low", "WARN")]),
        (97.0, 10.0, [("disk_low", "FAIL")]),
        (10.0, 98.5, [("disk_low", "FAIL")]),
        (92.0, 99.0, [("disk_low", "WARN"), ("disk_low", "FAIL")]),
    ],
)
def test_disk_low_thresholds_cover_bytes_and_inodes(bytes_pct, inodes_pct, expected):
    found = _box.disk_findings("data", probe(used_bytes_pct=bytes_pct, used_inodes_pct=inodes_pct), 90, 97, 5)
    assert codes(found) == expected
    assert all(f["action"] == "free_disk" for f in found)


def test_disk_low_names_the_resource_and_threshold():
    (found,) = _box.disk_findings("durable", probe("/durable", used_inodes_pct=98.2, inodes_free=12), 90, 97, 5)
    assert found["resource"] == "inodes"
    assert found["used_pct"] == 98.2
    assert found["threshold_pct"] == 97
    assert found["free"] == 12
    assert found["message"] == "durable fs /durable: inodes 98.2% used (>= 97%), 12 inodes free"


def test_full_disk_reports_both_unwritable_and_disk_low():
    full = probe(used_bytes_pct=100.0, writable=False, error="write probe failed: No space left on device")
    assert codes(_box.disk_findings("data", full, 90, 97, 5)) == [("dir_unwritable", "FAIL"), ("disk_low", "FAIL")]


def test_checkpoint_budget():
    assert _box.checkpoint_findings(probe(bytes_free=50 * GIB), None) == []
    assert _box.checkpoint_findings(probe(bytes_free=50 * GIB), 50) == []
    (found,) = _box.checkpoint_findings(probe(bytes_free=50 * GIB), 80)
    assert (found["code"], found["level"], found["action"]) == ("checkpoint_budget_exceeded", "FAIL", "free_disk")
    assert found["budget_bytes"] == 80 * GIB
    assert found["bytes_free"] == 50 * GIB
    assert _box.checkpoint_findings({"path": "/x", "timed_out": True}, 80) == []


def test_parse_proc_cgroup_variants():
    assert _box.parse_proc_cgroup("0::/\n") == ("/", None)
    hybrid = "9:name=systemd:/\n4:memory:/docker/abc\n0::/docker/abc\n"
    assert _box.parse_proc_cgroup(hybrid) == ("/docker/abc", "/docker/abc")
    assert _box.parse_proc_cgroup("3:cpu,memory:/job\n") == (None, "/job")
    assert _box.parse_proc_cgroup("") == (None, None)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_tightest_ancestor_limit(tmp_path):
    write(tmp_path / "proc_cgroup", "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "cg"
    write(root / "kubepods/pod1/ctr/memory.max", "max\n")
    write(root / "kubepods/pod1/memory.max", str(8 * GIB))
    write(root / "kubepods/memory.max", str(64 * GIB))
    assert _box.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(root)) == (2, 8 * GIB)


def test_cgroup_v2_namespaced_container_reads_the_mount_root(tmp_path):
    write(tmp_path / "proc_cgroup", "0::/\n")
    write(tmp_path / "cg/memory.max", "4294967296\n")
    assert _box.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "cg")) == (2, 4 * GIB)


def test_cgroup_v2_unlimited(tmp_path):
    write(tmp_path / "proc_cgroup", "0::/\n")
    write(tmp_path / "cg/memory.max", "max\n")
    assert _box.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "cg")) == (2, None)


def test_cgroup_v1_unlimited_and_limited(tmp_path):
    write(tmp_path / "proc_cgroup", "4:memory:/process_api/abc\n0::/\n")
    root = tmp_path / "cg"
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory/process_api/abc/memory.limit_in_bytes", "9223372036854771712\n")
    assert _box.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(root)) == (1, None)
    write(root / "memory/process_api/abc/memory.limit_in_bytes", str(16 * GIB))
    assert _box.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(root)) == (1, 16 * GIB)


def test_cgroup_unreadable(tmp_path):
    assert _box.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) == (None, None)
    write(tmp_path / "proc_cgroup", "0::/\n")
    assert _box.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "nocg")) == (None, None)


def test_host_memory_total(tmp_path):
    write(tmp_path / "meminfo", "MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    assert _box.host_memory_total(str(tmp_path / "meminfo")) == 16384000 * 1024
    assert _box.host_memory_total(str(tmp_path / "nope")) is None


def test_memory_findings():
    assert _box.memory_findings(512 * GIB, 60 * GIB, None) == []
    assert _box.memory_findings(512 * GIB, 60 * GIB, 32) == []
    (low,) = _box.memory_findings(512 * GIB, 60 * GIB, 64)
    assert (low["code"], low["level"]) == ("cgroup_memory_low", "WARN")
    assert low["usable_bytes"] == 60 * GIB
    assert low["message"] == "cgroup limit 60.0 GiB < minimum 64 GiB (host has 512.0 GiB)"
    (host_low,) = _box.memory_findings(32 * GIB, None, 64)
    assert host_low["message"] == "host memory 32.0 GiB < minimum 64 GiB"
    (unknown,) = _box.memory_findings(None, None, 64)
    assert (unknown["level"], unknown["action"]) == ("WARN", "investigate")


def test_check_box_end_to_end(tmp_path):
    data, durable = tmp_path / "data", tmp_path / "durable"
    data.mkdir()
    write(tmp_path / "proc_cgroup", "0::/\n")
    write(tmp_path / "cg/memory.max", str(2 * GIB))
    write(tmp_path / "meminfo", "MemTotal: 67108864 kB\n")
    result = _box.check_box(
        str(data),
        durable_dir=str(durable),
        checkpoint_budget_gb=1e9,
        min_memory_gb=8,
        proc_cgroup=str(tmp_path / "proc_cgroup"),
        cgroup_root=str(tmp_path / "cg"),
        meminfo_path=str(tmp_path / "meminfo"),
    )
    assert sorted(codes(result["findings"])) == [
        ("cgroup_memory_low", "WARN"),
        ("checkpoint_budget_exceeded", "FAIL"),
        ("dir_unwritable", "FAIL"),
    ]
    disk = result["facts"]["disk"]
    assert disk["data"]["writable"] is True
    assert disk["data"]["label"] == "data"
    assert disk["durable"]["exists"] is False
    assert result["facts"]["memory"] == {"host_total_mib": 65536, "cgroup_limit_mib": 2048, "cgroup_version": 2}
