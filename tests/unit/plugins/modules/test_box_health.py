"""box_health module: argument handling and the returned shape, run through AnsibleModule."""

from __future__ import annotations

from ansible_collections.remote_gpu.trainer.plugins.modules import box_health


def test_healthy_dirs_pass(tmp_path, run_module):
    (tmp_path / "data").mkdir()
    (tmp_path / "durable").mkdir()
    code, result = run_module(
        box_health,
        {
            "data_dir": str(tmp_path / "data"),
            "durable_dir": str(tmp_path / "durable"),
            "disk_warn_pct": 99.9,
            "disk_fail_pct": 100,
        },
    )
    assert code == 0
    assert result["changed"] is False
    assert [f["code"] for f in result["findings"] if f["code"] != "disk_low"] == []
    assert set(result["facts"]["disk"]) == {"data", "durable"}
    assert result["facts"]["disk"]["durable"]["writable"] is True
    assert result["facts"]["memory"]["host_total_mib"] > 0


def test_missing_durable_dir_fails_with_finding_not_error(tmp_path, run_module):
    code, result = run_module(
        box_health, {"data_dir": str(tmp_path), "durable_dir": str(tmp_path / "gone"), "_ansible_check_mode": True}
    )
    assert code == 0
    assert result["status"] == "FAIL"
    unwritable = [f for f in result["findings"] if f["code"] == "dir_unwritable"]
    assert [f["path"] for f in unwritable] == [str(tmp_path / "gone")]


def test_checkpoint_budget_and_memory_minimum(tmp_path, run_module):
    code, result = run_module(
        box_health, {"data_dir": str(tmp_path), "checkpoint_budget_gb": 1048576, "min_memory_gb": 1048576}
    )
    assert code == 0
    found = {f["code"]: f["level"] for f in result["findings"]}
    assert found["checkpoint_budget_exceeded"] == "FAIL"
    assert found["cgroup_memory_low"] == "WARN"
    assert result["status"] == "FAIL"


def test_inconsistent_thresholds_are_rejected(tmp_path, run_module):
    code, result = run_module(box_health, {"data_dir": str(tmp_path), "disk_warn_pct": 95, "disk_fail_pct": 90})
    assert code == 1
    assert result["failed"] is True
    assert "disk_warn_pct" in result["msg"]
