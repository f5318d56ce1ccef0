"""The fake libnvidia-ml.so.1 through the real, unmodified pynvml (in child processes)."""

from __future__ import annotations

import ctypes
import sys

import pytest
import scenario
from fakegpu_helpers import SCENARIOS, probe, run

NOT_SUPPORTED = {"error": "NVMLError_NotSupported"}
LOST = {"error": "NVMLError_GpuIsLost"}
MIB = 1048576


def expected_view(gpu: dict) -> dict:
    """What NVML must report for one scenario GPU (in the probe's shape)."""

    def feature(key: str, pick):
        return NOT_SUPPORTED if gpu[key] == "not_supported" else pick(gpu[key])

    return {
        "name": gpu["name"],
        "uuid": gpu["uuid"],
        "pci": {"bus_id": gpu["pci_bus_id"], "device_id": scenario.pci_ids(gpu["name"])[0]},
        "temperature": gpu["temperature_c"],
        "sm": gpu["clocks_mhz"]["sm"],
        "sm_max": gpu["clocks_mhz"]["sm_max"],
        "mem": gpu["clocks_mhz"]["mem"],
        "mem_max": gpu["clocks_mhz"]["mem_max"],
        "reasons": gpu["clocks_event_reasons"],
        "throttle_reasons": gpu["clocks_event_reasons"],
        "power_mw": round(gpu["power_w"]["draw"] * 1000),
        "limit_mw": round(gpu["power_w"]["limit"] * 1000),
        "management_limit_mw": round(gpu["power_w"]["limit"] * 1000),
        "default_limit_mw": round(gpu["power_w"]["default_limit"] * 1000),
        "memory": {"total_mib": gpu["memory_mib"]["total"], "used_mib": gpu["memory_mib"]["used"]},
        "utilization": NOT_SUPPORTED
        if gpu["mig_mode"] == {"current": True, "pending": True}
        else dict(gpu["utilization_pct"]),
        "persistence": int(gpu["persistence_mode"]),
        "mig": feature("mig_mode", lambda m: [int(m["current"]), int(m["pending"])]),
        "ecc_mode": feature("ecc", lambda e: [int(e["enabled"])] * 2),
        "ecc_volatile_uncorrected": feature("ecc", lambda e: e["volatile"]["uncorrected"]),
        "ecc_aggregate_corrected": feature("ecc", lambda e: e["aggregate"]["corrected"]),
        "ecc_dram_volatile_uncorrected": feature("ecc", lambda e: e["volatile"]["uncorrected"]),
        "remapped_rows": feature(
            "remapped_rows", lambda r: [r["corrected"], r["uncorrected"], int(r["pending"]), int(r["failure"])]
        ),
        "retired_pending": feature("retired_pages", lambda p: int(p["pending"])),
        "pcie": [gpu["pcie"][k] for k in ("gen", "gen_max", "width", "width_max", "replay_counter")],
        "processes": [
            {"pid": p["pid"], "used_mib": None if p["used_memory_mib"] == "not_available" else p["used_memory_mib"]}
            for p in gpu["processes"]
        ],
        "graphics_processes": [],
    }


@pytest.mark.parametrize(
    "name",
    [
        "healthy-h100.yml",
        "healthy-8x-h100.yml",
        "rtx4090-consumer.yml",
        "xid48-dbe.yml",
        "row-remap-pending.yml",
        "container-no-dmesg-orphan-vram.yml",
        "power-capped.yml",
        "pcie-degraded.yml",
        "mig-enabled.yml",
        "old-driver.yml",
    ],
)
def test_every_modelled_value_reaches_pynvml(sim_env, name: str) -> None:
    box = scenario.load(str(SCENARIOS / name))
    seen = probe(sim_env(SCENARIOS / name))
    assert seen["driver"] == box["driver"]["version"]
    assert seen["cuda"] == seen["cuda_v1"] == box["driver"]["cuda_version"]
    assert seen["count"] == len(box["gpus"])
    assert seen["bad_index"] == {"error": "NVMLError_InvalidArgument"}
    for index, (gpu, view) in enumerate(zip(box["gpus"], seen["gpus"])):
        assert view["index"] == index
        got = {key: view[key] for key in expected_view(gpu)}
        assert got == expected_view(gpu), f"GPU {index} of {name}"
        links = view["nvlinks"]
        assert len(links) == len(gpu["nvlinks"]) + 1 and links[-1] == NOT_SUPPORTED
        for link, model in zip(links, gpu["nvlinks"]):
            assert link == {
                "active": int(model["active"]),
                "replay": model["replay_errors"],
                "recovery": model["recovery_errors"],
                "crc": model["crc_errors"],
            }


def test_literal_values_of_a_consumer_card(sim_env) -> None:
    view = probe(sim_env(SCENARIOS / "rtx4090-consumer.yml"))["gpus"][0]
    assert view["name"] == "NVIDIA GeForce RTX 4090"
    assert view["memory"] == {"total_mib": 24564, "used_mib": 2}
    assert view["sm_max"] == 3120 and view["power_mw"] == 21900
    for key in ("ecc_mode", "ecc_volatile_uncorrected", "remapped_rows", "retired_sbe", "retired_pending", "mig"):
        assert view[key] == NOT_SUPPORTED, key
    assert view["nvlinks"] == [NOT_SUPPORTED]


def test_unknown_process_memory_is_nvml_value_not_available(sim_env, write_scenario) -> None:
    path = write_scenario(
        "gpus:\n  - processes: [{pid: 12444, used_memory_mib: not_available}, {pid: 7, used_memory_mib: 5}]\n"
    )
    assert probe(sim_env(path))["gpus"][0]["processes"] == [{"pid": 12444, "used_mib": None}, {"pid": 7, "used_mib": 5}]


def test_links_without_a_bridge_read_inactive_and_no_nvlink_reads_not_supported(sim_env, write_scenario) -> None:
    path = write_scenario("gpus:\n  - {nvlinks: [{active: false}, {active: false}]}\n  - {nvlinks: []}\n")
    bridgeless, without = (gpu["nvlinks"] for gpu in probe(sim_env(path))["gpus"])
    assert [link["active"] for link in bridgeless[:2]] == [0, 0] and bridgeless[2] == NOT_SUPPORTED
    assert without == [NOT_SUPPORTED]


def test_retired_pages_and_dbe_counts(sim_env, write_scenario) -> None:
    path = write_scenario("gpus:\n  - retired_pages: {single_bit: 2, double_bit: 1, pending: true}\n")
    view = probe(sim_env(path))["gpus"][0]
    assert len(view["retired_sbe"]) == 2 and len(view["retired_dbe"]) == 1
    assert set(view["retired_dbe"][0]) == {"address", "timestamp"}
    assert view["retired_pending"] == 1


def test_driver_not_loaded_fails_init(sim_env) -> None:
    assert probe(sim_env(SCENARIOS / "driver-not-loaded.yml")) == {"init_error": "NVMLError_DriverNotLoaded"}


def test_library_absent_is_library_not_found(sim_env, sim_dir) -> None:
    env = sim_env(SCENARIOS / "library-absent.yml")
    assert not (sim_dir / "lib-absent" / "libnvidia-ml.so.1").exists()
    assert probe(env) == {"init_error": "NVMLError_LibraryNotFound"}
    env["LD_LIBRARY_PATH"] = str(sim_dir / "lib")  # even with the library reachable, init refuses
    assert probe(env) == {"init_error": "NVMLError_LibraryNotFound"}


def test_lost_gpu_fails_every_device_call_and_spares_the_others(sim_env) -> None:
    seen = probe(sim_env(SCENARIOS / "gpu-lost.yml"))
    assert seen["count"] == 4
    lost = seen["gpus"][2]
    for key, value in lost.items():
        if key == "pcie":
            assert value == [LOST] * 5
        elif key == "nvlinks":
            assert value == [LOST]
        else:
            assert value == LOST, key
    assert [seen["gpus"][i]["pci"]["bus_id"] for i in (0, 1, 3)] == [
        "00000000:18:00.0",
        "00000000:2A:00.0",
        "00000000:5D:00.0",
    ]


LOOKUP = """
import pynvml as nv
nv.nvmlInit()
by_uuid = nv.nvmlDeviceGetHandleByUUID(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(1)))
by_bus = nv.nvmlDeviceGetHandleByPciBusId("0000:2a:00.0")
print(nv.nvmlDeviceGetIndex(by_uuid), nv.nvmlDeviceGetIndex(by_bus))
try:
    nv.nvmlDeviceGetHandleByUUID("GPU-nope")
except nv.NVMLError_NotFound:
    print("not found")
"""


def test_handles_by_uuid_and_bus_id(sim_env) -> None:
    result = run([sys.executable, "-c", LOOKUP], sim_env(SCENARIOS / "healthy-8x-h100.yml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["1 1", "not found"]


UNINITIALIZED = """
import ctypes, sys
lib = ctypes.CDLL("libnvidia-ml.so.1")
count = ctypes.c_uint(0)
before = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
assert lib.nvmlInit_v2() == 0
after = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
lib.nvmlShutdown()
again = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
lib.nvmlErrorString.restype = ctypes.c_char_p
print(before, after, count.value, again, lib.nvmlErrorString(15).decode())
"""


def test_calls_before_init_are_uninitialized(sim_env) -> None:
    result = run([sys.executable, "-c", UNINITIALIZED], sim_env(SCENARIOS / "healthy-h100.yml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1 0 1 1 GPU is lost"


def test_timeline_changes_after_its_time_and_not_before(sim_env) -> None:
    seen = probe(sim_env(SCENARIOS / "thermal-throttle-midwindow.yml"), "--sleep", "2.2")
    before, after = seen["before"]["gpus"][0], seen["after"]["gpus"][0]
    assert (before["temperature"], before["sm"], before["reasons"]) == (74, 1980, 0)
    assert (after["temperature"], after["sm"], after["sm_max"], after["reasons"]) == (86, 900, 1980, 0x40)
    assert after["power_mw"] == 402600 and after["memory"] == before["memory"]


def test_scenario_file_change_is_seen_mid_process(sim_env, write_scenario) -> None:
    path = write_scenario("gpus: [{temperature_c: 40}]\n")
    replacement = write_scenario("gpus: [{temperature_c: 40, lost: true}, {temperature_c: 41}]\n", "next.yml")
    seen = probe(sim_env(path), "--rewrite", str(replacement))
    assert seen["before"]["count"] == 1 and seen["before"]["gpus"][0]["temperature"] == 40
    assert seen["after"]["count"] == 2
    assert seen["after"]["gpus"][0]["temperature"] == LOST
    assert seen["after"]["gpus"][1]["temperature"] == 41


def test_library_exports_the_symbols_pynvml_needs(sim_dir) -> None:
    lib = ctypes.CDLL(str(sim_dir / "lib" / "libnvidia-ml.so.1"))
    for symbol in (
        "nvmlInitWithFlags",
        "nvmlInit_v2",
        "nvmlShutdown",
        "nvmlErrorString",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetRetiredPages_v2",
        "nvmlDeviceGetHandleByPciBusId_v2",
        "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ):
        assert hasattr(lib, symbol), symbol
