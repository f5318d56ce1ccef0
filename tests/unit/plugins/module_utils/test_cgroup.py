"""Memory readings: /proc/self/cgroup, cgroup v1 and v2 limits up the ancestors, the host's MemTotal."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box import _cgroup

GIB = 1024**3


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_parse_proc_cgroup_variants():
    assert _cgroup.parse_proc_cgroup("0::/\n") == ("/", None)
    hybrid = "9:name=systemd:/\n4:memory:/docker/abc\n0::/docker/abc\n"
    assert _cgroup.parse_proc_cgroup(hybrid) == ("/docker/abc", "/docker/abc")
    assert _cgroup.parse_proc_cgroup("3:cpu,memory:/job\n") == (None, "/job")
    assert _cgroup.parse_proc_cgroup("") == (None, None)


def test_cgroup_v2_takes_tightest_ancestor_limit(tmp_path):
    write(tmp_path / "proc_cgroup", "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "cg"
    write(root / "kubepods/pod1/ctr/memory.max", "max\n")
    write(root / "kubepods/pod1/memory.max", str(8 * GIB))
    write(root / "kubepods/memory.max", str(64 * GIB))
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(root)) == (2, 8 * GIB)


def test_cgroup_v2_namespaced_container_reads_the_mount_root(tmp_path):
    write(tmp_path / "proc_cgroup", "0::/\n")
    write(tmp_path / "cg/memory.max", "4294967296\n")
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "cg")) == (2, 4 * GIB)


def test_cgroup_v2_unlimited(tmp_path):
    write(tmp_path / "proc_cgroup", "0::/\n")
    write(tmp_path / "cg/memory.max", "max\n")
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "cg")) == (2, None)


def test_cgroup_v1_unlimited_and_limited(tmp_path):
    write(tmp_path / "proc_cgroup", "4:memory:/process_api/abc\n0::/\n")
    root = tmp_path / "cg"
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory/process_api/abc/memory.limit_in_bytes", "9223372036854771712\n")
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(root)) == (1, None)
    write(root / "memory/process_api/abc/memory.limit_in_bytes", str(16 * GIB))
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(root)) == (1, 16 * GIB)


def test_cgroup_unreadable(tmp_path):
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) == (None, None)
    write(tmp_path / "proc_cgroup", "0::/\n")
    assert _cgroup.cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "nocg")) == (None, None)


def test_host_memory_total(tmp_path):
    write(tmp_path / "meminfo", "MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    assert _cgroup.host_memory_total(str(tmp_path / "meminfo")) == 16384000 * 1024
    assert _cgroup.host_memory_total(str(tmp_path / "nope")) is None
