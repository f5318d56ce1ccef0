"""Box verdicts: disk and inode thresholds, the checkpoint budget, the memory minimum."""

from __future__ import annotations

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box import _box_findings

GIB = 1024**3


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
    found = _box_findings.disk_findings("data", probe(used_bytes_pct=bytes_pct, used_inodes_pct=inodes_pct), 90, 97, 5)
    assert codes(found) == expected
    assert all(f["action"] == "free_disk" for f in found)


def test_disk_low_names_the_resource_and_threshold():
    (found,) = _box_findings.disk_findings(
        "durable", probe("/durable", used_inodes_pct=98.2, inodes_free=12), 90, 97, 5
    )
    assert found["resource"] == "inodes"
    assert found["used_pct"] == 98.2
    assert found["threshold_pct"] == 97
    assert found["free"] == 12
    assert found["message"] == "durable fs /durable: inodes 98.2% used (>= 97%), 12 inodes free"


def test_full_disk_reports_both_unwritable_and_disk_low():
    full = probe(used_bytes_pct=100.0, writable=False, error="write probe failed: No space left on device")
    found = _box_findings.disk_findings("data", full, 90, 97, 5)
    assert codes(found) == [("dir_unwritable", "FAIL"), ("disk_low", "FAIL")]


def test_checkpoint_budget():
    assert _box_findings.checkpoint_findings(probe(bytes_free=50 * GIB), None) == []
    assert _box_findings.checkpoint_findings(probe(bytes_free=50 * GIB), 50) == []
    (found,) = _box_findings.checkpoint_findings(probe(bytes_free=50 * GIB), 80)
    assert (found["code"], found["level"], found["action"]) == ("checkpoint_budget_exceeded", "FAIL", "free_disk")
    assert found["budget_bytes"] == 80 * GIB
    assert found["bytes_free"] == 50 * GIB
    assert _box_findings.checkpoint_findings({"path": "/x", "timed_out": True}, 80) == []


def test_memory_findings():
    assert _box_findings.memory_findings(512 * GIB, 60 * GIB, None) == []
    assert _box_findings.memory_findings(512 * GIB, 60 * GIB, 32) == []
    (low,) = _box_findings.memory_findings(512 * GIB, 60 * GIB, 64)
    assert (low["code"], low["level"]) == ("cgroup_memory_low", "WARN")
    assert low["usable_bytes"] == 60 * GIB
    assert low["message"] == "cgroup limit 60.0 GiB < minimum 64 GiB (host has 512.0 GiB)"
    (host_low,) = _box_findings.memory_findings(32 * GIB, None, 64)
    assert host_low["message"] == "host memory 32.0 GiB < minimum 64 GiB"
    (unknown,) = _box_findings.memory_findings(None, None, 64)
    assert (unknown["level"], unknown["action"]) == ("WARN", "investigate")
