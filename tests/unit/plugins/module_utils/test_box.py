"""box_health's orchestration: probes, memory readings and verdicts put together."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box import _box

GIB = 1024**3


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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
    assert sorted((f["code"], f["level"]) for f in result["findings"]) == [
        ("cgroup_memory_low", "WARN"),
        ("checkpoint_budget_exceeded", "FAIL"),
        ("dir_unwritable", "FAIL"),
    ]
    disk = result["facts"]["disk"]
    assert disk["data"]["writable"] is True
    assert disk["data"]["label"] == "data"
    assert disk["durable"]["exists"] is False
    assert result["facts"]["memory"] == {"host_total_mib": 65536, "cgroup_limit_mib": 2048, "cgroup_version": 2}
