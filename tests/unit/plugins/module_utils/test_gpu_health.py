"""gpu_health's orchestration: backend choice, the sampling window, the kernel log and option parsing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils._gpu_health import check_gpu_health, parse_since
from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.module_utils.test_gpu_nvml import (
    LIBRARY_NOT_FOUND,
    StubNvml,
    datacenter_gpu,
)

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
XID_79 = "[ 8121.602] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
BOOT_LINES = ("[    0.000000] Linux version 6.1.0 (gcc 12.2.0)",)
XID_48 = "[ 8121.602] NVRM: Xid (PCI:0000:18:00): 48, pid=1234, name=python, An uncorrectable double bit error"


class Box:
    """A scripted box: kernel log lines (or unreadable) and optional nvidia-smi answers; a fake clock."""

    def __init__(self, kernel_lines=BOOT_LINES, smi=None):
        self.kernel_lines, self.smi, self.t, self.calls = kernel_lines, smi, 0.0, []
        self.on_tick = []

    def run(self, argv, timeout):
        self.calls.append(argv)
        if argv[0] == "dmesg":
            if self.kernel_lines is None:
                return 1, "", "dmesg: read kernel buffer failed: Operation not permitted\n"
            return 0, "".join(line + "\n" for line in self.kernel_lines), ""
        if argv[0] == "journalctl":
            return 0, "-- No entries --\n", ""
        if argv[0] == "nvidia-smi" and self.smi is not None:
            return self.smi(argv)
        return 127, "", f"{argv[0]}: command not found"

    def sleep(self, seconds):
        self.t += seconds
        for callback in self.on_tick:
            callback(self.t)

    def monotonic(self):
        return self.t

    def check(self, nvml, **options):
        return check_gpu_health(options, self.run, nvml, sleep=self.sleep, monotonic=self.monotonic,
                                is_visible=lambda pid: pid == 77, now=NOW)  # fmt: skip


def codes(result):
    return [f["code"] for f in result["findings"]]


def test_parse_since():
    assert parse_since("boot", NOW) is None and parse_since(None, NOW) is None
    assert parse_since("24h", NOW) == NOW - timedelta(hours=24)
    assert parse_since("30m", NOW) == NOW - timedelta(minutes=30)
    assert parse_since("2025-02-28T10:00:00Z", NOW) == datetime(2025, 2, 28, 10, tzinfo=timezone.utc)
    assert parse_since("2025-02-28T10:00:00", NOW) == datetime(2025, 2, 28, 10, tzinfo=timezone.utc)
    assert parse_since("2025-02-28T12:00:00+02:00", NOW) == datetime(2025, 2, 28, 10, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="xid_since"):
        parse_since("yesterday", NOW)


def test_healthy_box_passes_with_a_full_window():
    box = Box()
    result = box.check(StubNvml([datacenter_gpu(procs=[])]))
    assert (result["status"], result["backend"], codes(result)) == ("PASS", "nvml", [])
    (gpu,) = result["gpus"]
    assert gpu["window"]["samples"] == 7 and box.t == pytest.approx(3.0)
    assert gpu["clocks_event_reasons"] == ["gpu_idle"] and gpu["temperature_c"] == 35
    assert result["kernel_log"] == {"source": "dmesg", "readable": True}
    assert result["driver_version"] == "550.54.15" and result["cuda_version"] == "12.4"


def test_throttle_starting_mid_window_is_caught_end_to_end():
    stub = StubNvml([datacenter_gpu(procs=[])])
    box = Box()

    def heat_up(t):
        if t >= 2.0:
            stub.gpus[0].update(temp=87, sm=900, reasons=0x40)

    box.on_tick.append(heat_up)
    result = box.check(stub)
    assert codes(result) == ["throttle_active", "thermal_throttle"] and result["status"] == "FAIL"
    window = result["gpus"][0]["window"]
    assert window["temperature_c"] == {"min": 35, "max": 87} and window["sm_clock_mhz"]["min"] == 900


def test_processes_carry_visibility_and_foreign_processes_message():
    result = Box().check(StubNvml([datacenter_gpu(procs=[(77, 500), (4242, 30720)], used_mib=31300)]))
    (found,) = result["findings"]
    assert found["code"] == "foreign_processes" and found["visible_pids"] == [77]
    assert result["gpus"][0]["processes"] == [
        {"pid": 77, "used_memory_mib": 500, "visible": True},
        {"pid": 4242, "used_memory_mib": 30720, "visible": False},
    ]


def test_auto_falls_back_to_nvidia_smi_when_the_library_is_missing():
    q_text = (CAPTURES / "q_full" / "gpud__a10__535.129.03.txt").read_text()

    def smi(argv):
        if argv[1] == "-q":
            return 0, q_text, ""
        if argv[1].startswith("--query-gpu"):
            return 0, "0, 00000000:07:00.0, NVIDIA A10, GPU-a, 33, 225, 1695, 43.89, 150.00, 4, 23028, 0x1\n", ""
        return 0, "", ""

    result = Box(smi=smi).check(StubNvml([], init_error=LIBRARY_NOT_FOUND))
    assert result["backend"] == "nvidia-smi" and codes(result) == ["row_remap_pending"]
    assert result["driver_version"] == "535.129.03" and result["gpus"][0]["window"]["samples"] == 7


def test_no_library_and_no_nvidia_smi_is_a_no_driver_finding():
    result = Box().check(None)
    assert result["status"] == "FAIL" and codes(result) == ["no_driver"] and result["gpus"] == []
    assert "nvidia-smi not found" in result["findings"][0]["message"]


def test_driver_not_loaded():
    result = Box().check(StubNvml([], init_error=9), backend="nvml")
    assert codes(result) == ["no_driver"] and result["backend"] == "nvml"


def test_unreadable_kernel_log_warns():
    result = Box(kernel_lines=None).check(StubNvml([datacenter_gpu(procs=[])]))
    assert codes(result) == ["kernel_log_unreadable"] and result["status"] == "WARN"
    assert result["kernel_log"] == {"source": None, "readable": False}


def test_xids_map_to_gpus_and_a_lost_gpu_is_reported_once():
    gpus = [datacenter_gpu(procs=[], lost=True)]
    result = Box(kernel_lines=[XID_79, XID_48]).check(StubNvml(gpus))
    # NVML cannot read a lost GPU's bus id, so the kernel log's loss of 0000:18:00 is the same event.
    assert codes(result).count("gpu_lost") == 1 and "xid_hardware" in codes(result)
    assert [f["gpu"] for f in result["findings"] if f["code"] == "gpu_lost"] == [0]
    assert result["gpus"][0]["lost"] is True and result["status"] == "FAIL"


def test_requested_indexes_and_missing_ones():
    stub = StubNvml([datacenter_gpu(procs=[]), datacenter_gpu(procs=[], bus=b"00000000:3B:00.0", temp=90)])
    result = Box().check(stub, gpus=[0, 4], expected_gpu_count=2)
    assert [gpu["index"] for gpu in result["gpus"]] == [0]
    assert codes(result) == ["gpu_missing"] and result["findings"][0]["gpu"] == 4


def test_single_sample_window():
    result = Box().check(StubNvml([datacenter_gpu(procs=[])]), sample_seconds=0)
    assert result["gpus"][0]["window"]["samples"] == 1 and result["sample_seconds"] == 0


def test_bad_option_values_raise_before_sampling():
    box = Box()
    with pytest.raises(ValueError, match="expected_gpu_model"):
        box.check(StubNvml([datacenter_gpu()]), expected_gpu_model="H100(")
    with pytest.raises(ValueError, match="xid_since"):
        box.check(StubNvml([datacenter_gpu()]), xid_since="last tuesday")
    assert box.calls == [] and box.t == 0
