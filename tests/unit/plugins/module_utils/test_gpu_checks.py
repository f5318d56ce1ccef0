"""gpu_health's verdict: every finding code, the thresholds and the "this is normal" rules."""

from __future__ import annotations

import copy

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_checks import (
    box_findings,
    compare_versions,
    gpu_findings,
    window_summary,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import (
    NOT_SUPPORTED,
    cuda_version_text,
    normalize_bus_id,
    reason_mask,
    reason_names,
)
from ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health import default_options

IDLE, SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_BRAKE = (
    reason_mask([name])
    for name in ("gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                 "hw_power_brake_slowdown")
)  # fmt: skip
DEFAULTS = default_options()


def sample(temperature=40, sm=1980, power=300.0, used=0, reasons=0):
    return {"temperature_c": temperature, "sm_clock_mhz": sm, "power_draw_w": power, "memory_used_mib": used,
            "reasons": reasons}  # fmt: skip


HEALTHY = {
    "index": 0,
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-0",
    "pci_bus_id": "00000000:18:00.0",
    "lost": False,
    "sm_clock_max_mhz": 1980,
    "memory_total_mib": 81559,
    "power_limit_w": 700.0,
    "power_default_limit_w": 700.0,
    "pcie": {"gen": 5, "gen_max": 5, "width": 16, "width_max": 16, "replay_counter": 0},
    "ecc": {"enabled": True, "volatile_uncorrected": 0, "volatile_corrected": 0},
    "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
    "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": False},
    "nvlinks": [{"link": 0, "active": True}],
    "mig_mode": {"current": False, "pending": False},
    "processes": [],
    "samples": [sample() for _index in range(7)],
}


def gpu(**changes):
    model = copy.deepcopy(HEALTHY)
    model.update(changes)
    return model


def codes(model, **limits):
    return [f["code"] for f in gpu_findings(model, dict(DEFAULTS, **limits))]


def test_healthy_gpu_has_no_findings():
    assert codes(gpu()) == []


def test_sw_power_cap_under_load_and_idle_are_normal():
    loaded = [sample(temperature=75, sm=1755, power=698.0, reasons=SW_POWER_CAP)] * 7
    idle = [sample(temperature=30, sm=345, power=70.0, reasons=IDLE)] * 7
    assert codes(gpu(samples=loaded)) == []
    assert codes(gpu(samples=idle)) == []


@pytest.mark.parametrize("bit", [HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_BRAKE])
def test_throttle_reasons_fail(bit):
    (found,) = gpu_findings(gpu(samples=[sample(reasons=bit)]), DEFAULTS)
    assert (found["code"], found["level"], found["gpu"], found["action"]) == ("throttle_active", "FAIL", 0, "re_rent")
    assert found["reasons"] == reason_names(bit)


def test_throttle_starting_mid_window_is_caught():
    window = [sample()] * 4 + [sample(temperature=86, sm=900, reasons=HW_THERMAL)] * 3
    found = gpu_findings(gpu(samples=window), DEFAULTS)
    assert [f["code"] for f in found] == ["throttle_active", "thermal_throttle"]
    assert "3/7 samples" in found[0]["message"]
    assert found[1]["sm_clock_mhz"] == 900 and found[1]["samples_affected"] == 3


def test_one_idle_reading_does_not_mask_a_loaded_hot_one():
    window = [sample(temperature=86, sm=1200)] + [sample(temperature=40, sm=345, reasons=IDLE)] * 6
    assert codes(gpu(samples=window)) == ["thermal_throttle"]


def test_thermal_throttle_thresholds_are_options():
    hot_slow = [sample(temperature=83, sm=1385)]  # 1385 < 0.70 * 1980 = 1386
    assert codes(gpu(samples=hot_slow)) == ["thermal_throttle"]
    assert codes(gpu(samples=[sample(temperature=83, sm=1386)])) == ["running_hot"]
    assert codes(gpu(samples=[sample(temperature=82, sm=900)])) == []
    assert codes(gpu(samples=hot_slow), temp_hot_c=90) == []
    assert codes(gpu(samples=hot_slow), sm_clock_floor_pct=60) == ["running_hot"]


def test_idle_gpu_parked_clock_is_not_thermal_throttle():
    assert codes(gpu(samples=[sample(temperature=84, sm=345, reasons=IDLE)])) == ["running_hot"]


def test_memory_health_codes():
    assert codes(gpu(ecc={"enabled": True, "volatile_uncorrected": 2})) == ["ecc_uncorrectable"]
    rows = {"correctable": 0, "uncorrectable": 3, "pending": True, "failure": True}
    assert codes(gpu(remapped_rows=rows)) == ["row_remap_failure", "row_remap_pending"]
    assert codes(gpu(retired_pages={"single_bit": 0, "double_bit": 1, "pending": True})) == ["retired_pages_pending"]


def test_not_supported_features_give_no_finding():
    model = gpu(ecc=NOT_SUPPORTED, remapped_rows=NOT_SUPPORTED, retired_pages=NOT_SUPPORTED, nvlinks=[],
                mig_mode={"current": None, "pending": None}, pcie={})  # fmt: skip
    assert codes(model) == []


def test_pcie_width_degradation_warns_but_idle_generation_downshift_is_normal():
    assert codes(gpu(pcie={"gen": 1, "gen_max": 5, "width": 16, "width_max": 16})) == []
    (found,) = gpu_findings(gpu(pcie={"gen": 5, "gen_max": 5, "width": 8, "width_max": 16}), DEFAULTS)
    assert (found["code"], found["level"], found["width"]) == ("pcie_degraded", "WARN", 8)


def test_nvlink_down():
    links = [{"link": 0, "active": True}, {"link": 1, "active": False}]
    (found,) = gpu_findings(gpu(nvlinks=links), DEFAULTS)
    assert (found["code"], found["level"], found["links"]) == ("nvlink_down", "FAIL", [1])


def links(*states):
    return [{"link": number, "active": active} for number, active in enumerate(states)]


def test_links_all_inactive_without_a_bridge_are_normal_unless_nvlinks_are_expected():
    # A PCIe card without a bridge reports every link inactive; a card without NVLink reports none.
    assert codes(gpu(nvlinks=links(*[False] * 12))) == [] and codes(gpu(nvlinks=[])) == []
    (found,) = gpu_findings(gpu(nvlinks=links(*[False] * 12)), dict(DEFAULTS, expected_nvlinks=12))
    assert (found["code"], found["level"], found["active"], found["expected"]) == ("nvlink_down", "FAIL", 0, 12)
    assert "0 of 12 expected" in found["message"]
    assert codes(gpu(nvlinks=[]), expected_nvlinks=4) == ["nvlink_down"]


def test_expected_nvlinks_counts_active_links():
    eighteen = links(*[True] * 18)
    assert codes(gpu(nvlinks=eighteen), expected_nvlinks=18) == []
    (found,) = gpu_findings(gpu(nvlinks=links(*[True] * 17)), dict(DEFAULTS, expected_nvlinks=18))
    assert (found["code"], found["active"], found["links"]) == ("nvlink_down", 17, [])
    (found,) = gpu_findings(gpu(nvlinks=links(True, False, True)), dict(DEFAULTS, expected_nvlinks=3))
    assert (found["active"], found["links"]) == (2, [1])  # one finding, naming the link that is down


def test_power_capped_threshold():
    assert codes(gpu(power_limit_w=629.0)) == ["power_capped"]  # < 630 = 90% of 700
    assert codes(gpu(power_limit_w=630.0)) == []
    assert codes(gpu(power_limit_w=629.0), power_cap_pct=80) == []


def test_mig_enabled_unless_allowed():
    assert codes(gpu(mig_mode={"current": True, "pending": True})) == ["mig_enabled"]
    assert codes(gpu(mig_mode={"current": False, "pending": True})) == ["mig_enabled"]
    assert codes(gpu(mig_mode={"current": True, "pending": True}), allow_mig=True) == []


def test_foreign_processes_say_whether_holders_are_visible():
    hidden = gpu(processes=[{"pid": 4242, "used_memory_mib": 30720, "visible": False}],
                 samples=[sample(used=30800)])  # fmt: skip
    (found,) = gpu_findings(hidden, DEFAULTS)
    assert (found["code"], found["level"], found["action"]) == ("foreign_processes", "WARN", "investigate")
    assert "not in this PID namespace" in found["message"] and found["visible_pids"] == []
    visible = gpu(processes=[{"pid": 77, "used_memory_mib": 500, "visible": True}], samples=[sample(used=600)])
    (found,) = gpu_findings(visible, DEFAULTS)
    assert found["action"] == "reap_zombies" and "visible here: pid 77" in found["message"]


def test_memory_occupied_counts_only_unlisted_memory():
    assert codes(gpu(samples=[sample(used=1025)])) == ["memory_occupied"]
    assert codes(gpu(samples=[sample(used=1024)])) == []
    assert codes(gpu(samples=[sample(used=5000)]), occupied_mib_threshold=8192) == []
    listed = gpu(processes=[{"pid": 1, "used_memory_mib": 4000, "visible": False}], samples=[sample(used=4500)])
    assert codes(listed) == ["foreign_processes"]


def test_unknown_per_process_memory_is_unknown_not_zero():
    # Windows (WDDM) and some drivers report "[N/A]" per process: the holders' memory is unknown.
    procs = [
        {"pid": 12444, "used_memory_mib": None, "visible": False},
        {"pid": 7, "used_memory_mib": 300, "visible": False},
    ]
    (found,) = gpu_findings(gpu(processes=procs, samples=[sample(used=30000)]), DEFAULTS)
    assert (found["code"], found["used_memory_mib"]) == ("foreign_processes", None)
    assert "holding 0 MiB" not in found["message"] and "per-process memory unknown for pid 12444" in found["message"]
    alone = gpu(processes=[{"pid": 12444, "used_memory_mib": None, "visible": False}], samples=[sample(used=30000)])
    assert codes(alone) == ["foreign_processes"]  # not memory_occupied: the 30000 MiB may all be that process's


def test_lost_gpu_is_only_gpu_lost():
    (found,) = gpu_findings({"index": 3, "lost": True, "pci_bus_id": "00000000:3B:00.0"}, DEFAULTS)
    assert (found["code"], found["level"], found["gpu"]) == ("gpu_lost", "FAIL", 3)
    assert "00000000:3B:00.0" in found["message"]


def test_lost_gpu_without_bus_id_says_no_none():
    # NVML cannot read a lost GPU's bus id.
    (found,) = gpu_findings({"index": 1, "lost": True, "pci_bus_id": None}, DEFAULTS)
    assert found["message"] == "GPU 1 is lost: the driver cannot reach it"


def test_model_mismatch_is_a_regex_search():
    assert codes(gpu(), expected_gpu_model="H100") == []
    assert codes(gpu(), expected_gpu_model="^NVIDIA A100") == ["gpu_model_mismatch"]


def test_box_findings_count_missing_and_versions():
    gpus = [gpu(index=0), gpu(index=1)]
    limits = dict(DEFAULTS, expected_gpu_count=4, min_driver_version="550.54.15", min_cuda_version="12.4")
    found = box_findings(gpus, [0, 5], limits, "535.161.08", "12.2")
    assert [f["code"] for f in found] == ["gpu_count_mismatch", "gpu_missing", "driver_too_old", "driver_too_old"]
    assert found[1]["gpu"] == 5 and all(f["level"] == "FAIL" for f in found)
    assert box_findings(gpus, None, dict(DEFAULTS, min_driver_version="535.9"), "535.10", "12.4") == []
    assert [f["code"] for f in box_findings([], None, DEFAULTS, None, None)] == ["gpu_count_mismatch"]


def test_version_comparison_is_numeric():
    assert compare_versions("535.9", "535.10") == -1
    assert compare_versions("535.161.08", "535.161.8") == 0
    assert compare_versions("550", "535.161.08") == 1
    assert compare_versions("12.4", "12.10") == -1
    assert compare_versions("610.57.04 [Deprecated; ...]", "610.57.04") == 0
    assert compare_versions(None, "1") is None and compare_versions("N/A", "1") is None
    assert cuda_version_text(12040) == "12.4" and cuda_version_text(13010) == "13.1" and cuda_version_text(0) is None


def test_reason_and_bus_id_helpers():
    assert reason_names(0x88) == ["hw_slowdown", "hw_power_brake_slowdown"]
    assert reason_mask(["gpu_idle", "display_clock_setting"]) == 0x101
    assert normalize_bus_id("GPU0000:18:00.0") == "00000000:18:00.0"
    assert normalize_bus_id("00000000:3b:00.0") == "00000000:3B:00.0"
    assert normalize_bus_id("PCI:0000:3b:00") == normalize_bus_id("0000:3B:00.0") == "00000000:3B:00.0"
    assert normalize_bus_id("nonsense") is None


def test_window_summary():
    window = [sample(temperature=40, sm=345, power=70.0), sample(temperature=86, sm=1980, power=None)]
    assert window_summary(window) == {
        "samples": 2,
        "temperature_c": {"min": 40, "max": 86},
        "sm_clock_mhz": {"min": 345, "max": 1980},
        "power_draw_w": {"min": 70.0, "max": 70.0},
    }


def test_a_required_version_the_box_does_not_report_is_a_warning_not_a_pass():
    gpus = [gpu(index=0)]
    limits = dict(DEFAULTS, min_driver_version="550", min_cuda_version="12.4")
    found = box_findings(gpus, None, limits, None, "N/A")
    assert [(f["code"], f["level"], f["component"]) for f in found] == [
        ("version_unknown", "WARN", "driver"),
        ("version_unknown", "WARN", "CUDA driver"),
    ]
    assert "550" in found[0]["message"] and "N/A" in found[1]["message"]
    # Nothing required: an unreadable version is nobody's concern.
    assert box_findings(gpus, None, DEFAULTS, None, None) == []
