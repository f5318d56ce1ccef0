"""gpu_health's orchestration: backend choice, the sampling window, the kernel log and option parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone

import pytest
import yaml
from build import environment

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _kernel_log as kl
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_health import check_gpu_health, parse_since
from ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health import default_options
from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES, REPO, SCENARIOS
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
        return check_gpu_health(dict(default_options(), **options), self.run, nvml, sleep=self.sleep,
                                monotonic=self.monotonic, is_visible=lambda pid: pid == 77, now=NOW)  # fmt: skip


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
    assert result["kernel_log"] == {"source": "dmesg", "readable": True, "truncated": False}
    assert result["driver_version"] == "550.54.15" and result["cuda_version"] == "12.4"


def test_a_kernel_log_longer_than_the_cap_is_read_from_its_end_and_says_so():
    older = (XID_48,) + ("[ 8121.700] eth0: link up",) * kl.DEFAULT_MAX_LINES
    result = Box(kernel_lines=older).check(StubNvml([datacenter_gpu(procs=[])]))
    assert result["kernel_log"] == {"source": "dmesg", "readable": True, "truncated": True}
    assert codes(result) == []  # the Xid fell before the kept tail: unseen, and the summary says the tail was cut
    newer = (*older[1:], XID_48)
    result = Box(kernel_lines=newer).check(StubNvml([datacenter_gpu(procs=[])]))
    assert result["kernel_log"]["truncated"] is True and codes(result) == ["xid_hardware"]


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


A10_ROW = "0, 00000000:07:00.0, NVIDIA A10, GPU-a, 33, 225, 1695, 43.89, 150.00, 4, 23028, 0x1\n"


def test_nvidia_smi_reads_its_static_state_while_the_window_runs_and_asks_once_per_sample():
    q_text = (CAPTURES / "q_full" / "gpud__a10__535.129.03.txt").read_text()
    window_running, overlapped = threading.Event(), []

    def smi(argv):
        if argv[1] == "-q":
            overlapped.append(window_running.wait(timeout=2))
            return 0, q_text, ""
        return (0, A10_ROW, "") if argv[1].startswith("--query-gpu") else (0, "", "")

    box = Box(smi=smi)
    box.on_tick.append(lambda _t: window_running.set())
    result = box.check(None, backend="nvidia-smi")
    assert overlapped == [True], "-q must not hold up the window"
    assert codes(result) == ["row_remap_pending"] and result["driver_version"] == "535.129.03"
    calls = [argv[1] for argv in box.calls if argv[0] == "nvidia-smi"]
    # 7 samples in 3 s, the first being the query that names the GPUs; then -q, nvlink -s, the compute apps.
    assert len(calls) == 10 and sum(call.startswith("--query-gpu") for call in calls) == 7
    assert result["gpus"][0]["window"]["samples"] == 7


def test_nvidia_smi_times_the_window_from_the_query_that_opened_it():
    box = Box()

    def smi(argv):
        if argv[1].startswith("--query-gpu"):
            box.t += 0.1  # each query takes 0.1 s
            return 0, A10_ROW, ""
        return 0, "", ""

    box.smi = smi
    result = box.check(None, backend="nvidia-smi")
    # Queries start at 0, 0.5 ... 3.0: the last one ends at 3.1, not one query later.
    assert result["gpus"][0]["window"]["samples"] == 7 and box.t == pytest.approx(3.1)


def test_nvidia_smi_asks_for_the_compute_apps_alongside_the_last_sample():
    apps_asked, queries, overlapped = threading.Event(), [], []

    def smi(argv):
        if argv[1].startswith("--query-compute-apps"):
            apps_asked.set()
            return 0, "00000000:07:00.0, 77, 500\n", ""
        if argv[1].startswith("--query-gpu"):
            queries.append(argv)
            if len(queries) == 7:  # the window's last sample
                overlapped.append(apps_asked.wait(timeout=2))
            return 0, A10_ROW, ""
        return 0, "", ""

    result = Box(smi=smi).check(None, backend="nvidia-smi")
    assert overlapped == [True] and len(queries) == 7
    assert result["gpus"][0]["processes"] == [{"pid": 77, "used_memory_mib": 500, "visible": True}]


def test_nvidia_smi_q_failing_after_the_window_started_still_judges_the_window():
    def smi(argv):
        if argv[1] == "-q":
            return 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", ""
        return (0, A10_ROW, "") if argv[1].startswith("--query-gpu") else (0, "", "")

    result = Box(smi=smi).check(None, backend="nvidia-smi")
    assert codes(result) == ["gpu_query_failed"] and result["status"] == "WARN"
    assert result["gpus"][0]["window"]["samples"] == 7 and result["gpus"][0]["name"] == "NVIDIA A10"


def test_no_gpus_through_nvidia_smi_is_only_a_count_mismatch():
    # nvidia-smi answers every query with "No devices were found" and exit 6 when the box has no GPU.
    result = Box(smi=lambda argv: (6, "No devices were found\n", "")).check(StubNvml([], init_error=LIBRARY_NOT_FOUND))
    assert (result["backend"], result["status"], codes(result)) == ("nvidia-smi", "FAIL", ["gpu_count_mismatch"])


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
    assert result["kernel_log"] == {"source": None, "readable": False, "truncated": False}


def test_xids_map_to_gpus_and_a_lost_gpu_is_reported_once():
    gpus = [datacenter_gpu(procs=[], lost=True)]
    result = Box(kernel_lines=[XID_79, XID_48]).check(StubNvml(gpus))
    # NVML cannot read a lost GPU's bus id, so the kernel log's loss of 0000:18:00 is the same event.
    assert codes(result).count("gpu_lost") == 1 and "xid_hardware" in codes(result)
    assert [f["gpu"] for f in result["findings"] if f["code"] == "gpu_lost"] == [0]
    assert result["gpus"][0]["lost"] is True and result["status"] == "FAIL"


def test_an_xid_on_a_lost_gpus_own_address_is_that_gpus_through_nvml():
    # NVML cannot read a lost GPU's bus id, but it answers GPU_IS_LOST for its address: the Xid is GPU 0's.
    result = Box(kernel_lines=[XID_79, XID_48]).check(StubNvml([datacenter_gpu(procs=[], lost=True)]))
    assert sorted((f["code"], f["gpu"]) for f in result["findings"]) == [
        ("gpu_lost", 0), ("xid_hardware", 0), ("xid_hardware", 0)
    ]  # fmt: skip
    assert result["gpus"][0]["pci_bus_id"] == "00000000:18:00.0"
    assert not any("not one of this box's" in f["message"] for f in result["findings"])


SHARED_HOST_XIDS = (
    "[ 7001.2] NVRM: Xid (PCI:0000:b8:00): 48, pid=5120, name=python3, An uncorrectable double bit error",
    "[ 7002.9] NVRM: Xid (PCI:0000:B8:00): 13, pid=5120, name=python3, Graphics Exception on GPC 0",
)


def two_of_eight():
    """A renter's 2 GPUs of a shared 8-GPU host."""
    return StubNvml([datacenter_gpu(procs=[]), datacenter_gpu(procs=[], bus=b"00000000:3B:00.0")])


def test_another_tenants_xid_in_the_hosts_kernel_log_warns_and_does_not_fail_the_box():
    result = Box(kernel_lines=SHARED_HOST_XIDS).check(two_of_eight())
    assert (result["status"], codes(result)) == ("WARN", ["xid_other_gpu"])
    (found,) = result["findings"]
    assert (found["gpu"], found["pci"], found["xid"], found["action"]) == (None, "0000:b8:00", 48, "investigate")


def test_an_unmatched_xid_still_fails_when_the_box_lists_fewer_gpus_than_expected():
    # A GPU that fell off the bus can vanish from the driver's list: the address may be this box's third GPU.
    result = Box(kernel_lines=SHARED_HOST_XIDS).check(two_of_eight(), expected_gpu_count=3)
    assert sorted(codes(result)) == ["gpu_count_mismatch", "xid_application", "xid_hardware"]


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


# ----------------------------------------------------------------------------- the simulator, both backends
FAST = {"sample_seconds": 0.5, "sample_interval_s": 0.25}


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fakegpu"))


def through_both_backends(sim_dir, scenario, **args):
    """gpu_health as Ansible runs it (a fresh Python started with the simulator's environment), per backend."""
    results = {}
    for backend in ("nvml", "nvidia-smi"):
        env = dict(os.environ, PYTHONPATH=str(REPO / ".build" / "collections"))
        env.update(environment(sim_dir, str(scenario)))
        payload = json.dumps({"ANSIBLE_MODULE_ARGS": dict(FAST, backend=backend, **args)})
        module = "ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health"
        done = subprocess.run([sys.executable, "-m", module, payload], env=env, capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr + done.stdout
        results[backend] = json.loads(done.stdout)
    return results


def verdict(result):
    return result["status"], sorted((f["code"], f["gpu"], f.get("xid"), f.get("pci")) for f in result["findings"])


def same_verdict(results):
    nvml, smi = (verdict(results[backend]) for backend in ("nvml", "nvidia-smi"))
    assert nvml == smi, [f["message"] for r in results.values() for f in r["findings"]]
    return nvml


SIM_BOOT = {"readable": True, "lines": ["[    5.300871] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15"]}


def scenario_file(tmp_path, data):
    path = tmp_path / "scenario.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_sim_a_lost_gpus_xid_is_attributed_to_it_by_both_backends(sim_dir):
    status, found = same_verdict(through_both_backends(sim_dir, SCENARIOS / "xid79-fallen-off-bus.yml"))
    assert status == "FAIL" and ("xid_hardware", 1, 79, "0000:28:00") in found
    assert [f for f in found if f[0] == "gpu_lost"] == [("gpu_lost", 1, None, None)]


def test_sim_another_tenants_xids_warn_through_both_backends(sim_dir):
    status, found = same_verdict(through_both_backends(sim_dir, SCENARIOS / "shared-host-other-tenant-xid.yml"))
    assert (status, found) == ("WARN", [
        ("xid_other_gpu", None, 48, "0000:9b:00"),
        ("xid_other_gpu", None, 63, "0000:9b:00"),
        ("xid_other_gpu", None, 79, "0000:db:00"),
    ])  # fmt: skip


def test_sim_pcie_cards_without_a_bridge_pass_unless_nvlinks_are_expected(sim_dir):
    scenario = SCENARIOS / "pcie-no-nvlink-bridge.yml"
    assert same_verdict(through_both_backends(sim_dir, scenario)) == ("PASS", [])
    status, found = same_verdict(through_both_backends(sim_dir, scenario, expected_nvlinks=12))
    assert (status, found) == ("FAIL", [("nvlink_down", 0, None, None), ("nvlink_down", 1, None, None)])


def test_sim_nvlink_down_among_active_and_expected_on_a_card_without_nvlink(sim_dir, tmp_path):
    h100 = {"nvlinks": [{"active": True}] * 16 + [{"active": False}, {"active": True}]}
    data = {"kernel_log": SIM_BOOT, "gpus": [h100, {"nvlinks": []}]}
    path = scenario_file(tmp_path, data)
    assert same_verdict(through_both_backends(sim_dir, path)) == ("FAIL", [("nvlink_down", 0, None, None)])
    status, found = same_verdict(through_both_backends(sim_dir, path, expected_nvlinks=17))
    assert (status, found) == ("FAIL", [("nvlink_down", 0, None, None), ("nvlink_down", 1, None, None)])


def test_sim_no_gpus_is_only_a_count_mismatch_on_both_backends(sim_dir, tmp_path):
    path = scenario_file(tmp_path, {"kernel_log": SIM_BOOT, "gpus": []})
    assert same_verdict(through_both_backends(sim_dir, path)) == ("FAIL", [("gpu_count_mismatch", None, None, None)])


def test_sim_unknown_per_process_memory_is_unknown_on_both_backends(sim_dir, tmp_path):
    gpu = {"processes": [{"pid": 999999, "used_memory_mib": "not_available"}], "memory_mib": {"used": 30000}}
    results = through_both_backends(sim_dir, scenario_file(tmp_path, {"kernel_log": SIM_BOOT, "gpus": [gpu]}))
    assert same_verdict(results) == ("WARN", [("foreign_processes", 0, None, None)])
    for result in results.values():
        assert result["gpus"][0]["processes"] == [{"pid": 999999, "used_memory_mib": None, "visible": False}]
        assert "per-process memory unknown" in result["findings"][0]["message"]
