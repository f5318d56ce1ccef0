"""The resource monitor: one bounded JSON sample a line, cgroup v1 and v2, nvidia-smi, rotation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import types

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner import _monitor
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import (
    Monitor,
    cgroup_memory,
    cpu_times,
    parse_gpu_csv,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import wait_for


def fake_smi(tmp_path, body):
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return [str(script), *_monitor.GPU_QUERY[1:]]


def monitor(tmp_path, **kwargs):
    options = {
        "interval_s": 0.05,
        "max_bytes": 1 << 20,
        "directories": {"data": str(tmp_path), "durable": str(tmp_path / "missing")},
        "marker": b"RGT_RUN_DIR=/nowhere",
    }
    options.update(kwargs)
    if "gpu_query" not in options:
        options["gpu_query"] = fake_smi(tmp_path, "echo '0, 87, 40000, 81559'; echo '1, [N/A], [N/A], 81559'")
    return Monitor(str(tmp_path / "monitor.jsonl"), **options)


def test_a_sample_holds_memory_processes_disk_and_gpus(tmp_path):
    sample = monitor(tmp_path, cells=lambda: {"a": os.getpid()}).sample()
    assert set(sample) >= {"ts", "cgroup", "cpu_pct", "run", "cells", "tracker", "disk", "gpus", "gpu_error"}
    assert sample["run"]["procs"] >= 1 and sample["run"]["rss_bytes"] > 0  # this test's own session
    assert sample["cells"]["a"]["pid"] == os.getpid() and sample["cells"]["a"]["threads"] >= 1
    assert sample["cells"]["a"]["fds"] > 0 and sample["cells"]["a"]["rss_bytes"] > 0
    assert sample["disk"]["data"]["bytes_free"] > 0 and sample["disk"]["data"]["inodes_free"] >= 0
    assert sample["disk"]["durable"]["error"] == "does not exist"
    assert sample["gpus"] == [
        {"index": 0, "util_pct": 87.0, "memory_used_mib": 40000.0, "memory_total_mib": 81559.0},
        {"index": 1, "util_pct": None, "memory_used_mib": None, "memory_total_mib": 81559.0},
    ]
    assert sample["gpu_error"] is None
    json.dumps(sample)  # one JSON object


def test_the_trackers_service_process_is_found_among_the_runs(tmp_path):
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "wandb-service(2-123-s-5)"])
    try:
        cmdline = f"/proc/{service.pid}/cmdline"
        wait_for(lambda: b"wandb-service" in open(cmdline, "rb").read(), what="the process starts")  # noqa: SIM115
        tracker = monitor(tmp_path).sample()["tracker"]
        assert service.pid in tracker["pids"] and tracker["rss_bytes"] > 0
    finally:
        service.kill()
        service.wait()


def test_no_nvidia_smi_is_said_and_not_retried(tmp_path):
    sample = monitor(tmp_path, gpu_query=["/nonexistent/nvidia-smi"]).sample()
    assert (sample["gpus"], sample["gpu_error"]) == (None, "/nonexistent/nvidia-smi not found")


def test_a_hung_nvidia_smi_is_bounded_and_then_rests(tmp_path, monkeypatch):
    monkeypatch.setattr(_monitor, "GPU_TIMEOUT_S", 0.2)
    probe = monitor(tmp_path, gpu_query=fake_smi(tmp_path, "exec sleep 30"))
    started = time.monotonic()
    first = probe.sample()
    assert time.monotonic() - started < 3
    assert first["gpus"] is None and "did not answer within 0.2 s" in first["gpu_error"]
    assert probe.sample()["gpu_error"].endswith("timed out recently")  # no pile of stuck nvidia-smi processes


def test_a_hung_directory_probe_is_bounded_and_then_rests(tmp_path, monkeypatch):
    monkeypatch.setattr(
        _monitor, "probe_usage", lambda paths, timeout_s: {p: {"path": p, "timed_out": True} for p in paths}
    )
    probe = monitor(tmp_path)
    assert probe.sample()["disk"]["durable"] == {"path": str(tmp_path / "missing"), "timed_out": True}
    assert probe.sample()["disk"]["durable"]["skipped"] == "timed out recently"


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_memory_reads_current_and_limit_in_v1_and_v2(tmp_path, version):
    root = tmp_path / "cgroup"
    if version == 2:
        (tmp_path / "self").write_text("0::/\n")
        root.mkdir()
        (root / "memory.current").write_text("1048576\n")
        (root / "memory.max").write_text("8589934592\n")
    else:
        (tmp_path / "self").write_text("5:memory:/\n")
        (root / "memory").mkdir(parents=True)
        (root / "memory" / "memory.usage_in_bytes").write_text("1048576\n")
        (root / "memory" / "memory.limit_in_bytes").write_text("8589934592\n")
    found = cgroup_memory(str(tmp_path / "self"), str(root))
    assert found == {"version": version, "memory_current": 1048576, "memory_max": 8589934592}


def test_cpu_times_and_gpu_csv_parse_what_the_box_writes(tmp_path):
    (tmp_path / "stat").write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    assert cpu_times(str(tmp_path / "stat")) == (150, 1000)
    assert parse_gpu_csv("garbage\n3, 1, 2, 3\n") == [
        {"index": 3, "util_pct": 1.0, "memory_used_mib": 2.0, "memory_total_mib": 3.0}
    ]


def test_the_file_is_rotated_past_its_cap(tmp_path):
    probe = monitor(tmp_path, max_bytes=4096)
    for _index in range(40):
        probe.write({"ts": "x", "pad": "p" * 300})
    current, rotated = tmp_path / "monitor.jsonl", tmp_path / "monitor.jsonl.1"
    assert rotated.exists() and current.stat().st_size <= 4096 and rotated.stat().st_size <= 4096
    assert all(json.loads(line)["ts"] == "x" for line in current.read_text().splitlines())


def test_the_thread_samples_every_interval_and_stops(tmp_path):
    path = tmp_path / "monitor.jsonl"
    probe = monitor(tmp_path)
    probe.start()
    wait_for(lambda: path.exists() and len(path.read_text().splitlines()) >= 3, what="three samples")
    probe.stop()
    count = len(path.read_text().splitlines())
    time.sleep(0.2)
    assert len(path.read_text().splitlines()) == count


class _Nvml:
    """pynvml's calls the monitor makes; GPU 1 is lost (every call on it raises NVMLError)."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        if index == 1:
            raise self.NVMLError("GPU is lost")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=93, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30, free=40 * 2**30)


def test_gpus_are_read_through_nvml_when_it_is_open_and_smi_is_not_asked(tmp_path):
    calls = tmp_path / "smi-calls"
    smi = fake_smi(tmp_path, f"echo called >> {calls}; echo '0, 1, 2, 3'")
    sample = monitor(tmp_path, gpu_query=smi, nvml=_Nvml()).sample()
    assert sample["gpus"] == [
        {"index": 0, "util_pct": 93.0, "memory_used_mib": 40960.0, "memory_total_mib": 81920.0},
        {"index": 1, "util_pct": None, "memory_used_mib": None, "memory_total_mib": None},
    ]
    assert sample["gpu_error"] is None and not calls.exists()


def test_nvml_failing_as_a_whole_is_a_gpu_error_not_a_dead_monitor(tmp_path):
    broken = _Nvml()

    def no_driver():
        raise _Nvml.NVMLError("Driver Not Loaded")

    broken.nvmlDeviceGetCount = no_driver
    sample = monitor(tmp_path, nvml=broken).sample()
    assert sample["gpus"] is None and sample["gpu_error"] == "NVML: NVMLError: Driver Not Loaded"


def test_run_processes_with_the_session_leader_outside_the_namespace_counts_only_the_runner_group(monkeypatch):
    # Every process of an outside session reads session 0: matching on 0 would count the whole box as the run's.
    outsider = subprocess.Popen(["sleep", "30"], start_new_session=True)
    member = subprocess.Popen(["sleep", "30"])
    try:
        real_stats = _monitor.list_procs()
        zeroed = [dataclasses.replace(stat, sid=0) if stat.pid == outsider.pid else stat for stat in real_stats]
        monkeypatch.setattr(_monitor, "list_procs", lambda: zeroed)
        monkeypatch.setattr(os, "getsid", lambda pid: 0)
        found = {stat.pid for stat in _monitor.run_processes(b"RGT_RUN_DIR=/nowhere")}
        assert member.pid in found and os.getpid() in found and outsider.pid not in found
    finally:
        for child in (outsider, member):
            child.kill()
            child.wait()
