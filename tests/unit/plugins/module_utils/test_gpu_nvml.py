"""The NVML reader (gpu_health's backend, vram_zombies' view) against a stand-in for the pynvml binding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import NOT_SUPPORTED, same_gpu
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_nvml import (
    NvmlBackend,
    NvmlLibraryMissing,
    NvmlNoDriver,
    read_gpu_view,
)

MIB = 1024 * 1024
NOT_SUPPORTED_RC, NOT_FOUND, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND, GPU_IS_LOST = 3, 6, 9, 12, 13, 15


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class StubNvml:
    """Answers the binding's calls from per-GPU dicts; a GPU dict value that is an int error code is raised."""

    NVMLError = NVMLError
    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 0, 1
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, gpus, init_error=None, without=()):
        self.gpus, self.init_error, self.calls = gpus, init_error, []
        for name in without:
            setattr(self, name, None)

    def _get(self, handle, key):
        self.calls.append(key)
        gpu = self.gpus[handle]
        if gpu.get("lost"):
            raise NVMLError(GPU_IS_LOST)
        value = gpu.get(key, NOT_SUPPORTED_RC)
        if isinstance(value, int) and not isinstance(value, bool) and value in (NOT_SUPPORTED_RC, FUNCTION_NOT_FOUND):
            raise NVMLError(value)
        return value

    def nvmlInit(self):
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        """As nvml.h documents it: GPU_IS_LOST for a lost GPU of this box, NOT_FOUND for any other address."""
        self.calls.append(("by_bus", bus_id))
        for index, gpu in enumerate(self.gpus):
            if same_gpu(_text(gpu.get("bus", b"")), _text(bus_id)):
                if gpu.get("lost"):
                    raise NVMLError(GPU_IS_LOST)
                return index
        raise NVMLError(NOT_FOUND)

    def nvmlDeviceGetName(self, h):
        return self._get(h, "name")

    def nvmlDeviceGetUUID(self, h):
        return self._get(h, "uuid")

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._get(h, "bus"))

    def nvmlDeviceGetMaxClockInfo(self, h, _clock):
        return self._get(h, "sm_max")

    def nvmlDeviceGetClockInfo(self, h, _clock):
        return self._get(h, "sm")

    def nvmlDeviceGetTemperature(self, h, _sensor):
        return self._get(h, "temp")

    def nvmlDeviceGetPowerUsage(self, h):
        return self._get(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._get(h, "limit_mw")

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        return self._get(h, "default_mw")

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self._get(h, "total_mib") * MIB, used=self._get(h, "used_mib") * MIB)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._get(h, "reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._get(h, "old_reasons")

    def nvmlDeviceGetPersistenceMode(self, h):
        return self._get(h, "persistence")

    def nvmlDeviceGetMigMode(self, h):
        return self._get(h, "mig")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._get(h, "gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._get(h, "gen_max")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._get(h, "width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._get(h, "width_max")

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._get(h, "replays")

    def nvmlDeviceGetEccMode(self, h):
        return self._get(h, "ecc_mode")

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter):
        return self._get(h, "ecc")[(error_type, counter)]

    def nvmlDeviceGetRemappedRows(self, h):
        return self._get(h, "rows")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._get(h, "pages_pending")

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return self._get(h, "pages")[cause]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return self._get(h, "links")[link] if link < len(self.gpus[h].get("links", [])) else self._get(h, "none")

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=mib * MIB) for pid, mib in self._get(h, "procs")]

    def nvmlDeviceGetUtilizationRates(self, h):
        samples = self._get(h, "util")
        return SimpleNamespace(gpu=samples.pop(0) if samples else 0)

    def nvmlDeviceGetMinorNumber(self, h):
        return self._get(h, "minor")


def datacenter_gpu(**changes):
    gpu = {
        "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1", "bus": b"00000000:18:00.0", "sm_max": 1980, "sm": 1980,
        "temp": 35, "power_mw": 71500, "limit_mw": 700000, "default_mw": 700000, "total_mib": 81559, "used_mib": 0,
        "reasons": 0x1, "persistence": 1, "mig": [0, 0], "gen": 5, "gen_max": 5, "width": 16, "width_max": 16,
        "replays": 0, "ecc_mode": [1, 1], "ecc": {(1, 0): 0, (0, 0): 0, (1, 1): 0, (0, 1): 0},
        "rows": (0, 0, 0, 0), "pages_pending": 0, "pages": {0: [], 1: [0x1000]}, "links": [1, 1],
        "procs": [(4242, 30720)],
    }  # fmt: skip
    gpu.update(changes)
    return gpu


def test_reads_the_data_model():
    backend = NvmlBackend(StubNvml([datacenter_gpu(links=[1, 0])]))
    backend.open()
    assert backend.versions() == {"driver_version": "550.54.15", "cuda_version": "12.4"}
    (gpu,) = backend.inventory()
    assert gpu["pci_bus_id"] == "00000000:18:00.0" and gpu["power_limit_w"] == 700.0
    assert gpu["ecc"] == {"enabled": True, "volatile_uncorrected": 0, "volatile_corrected": 0,
                          "aggregate_uncorrected": 0, "aggregate_corrected": 0}  # fmt: skip
    assert gpu["retired_pages"] == {"single_bit": 0, "double_bit": 1, "pending": False}
    assert gpu["nvlinks"] == [{"link": 0, "active": True}, {"link": 1, "active": False}]
    assert gpu["mig_mode"] == {"current": False, "pending": False} and gpu["persistence_mode"] is True
    assert backend.sample() == {
        0: {"temperature_c": 35, "sm_clock_mhz": 1980, "power_draw_w": 71.5, "memory_used_mib": 0, "reasons": 1}
    }
    assert backend.processes() == {0: [{"pid": 4242, "used_memory_mib": 30720}]}


def test_not_supported_features_and_renamed_entry_point():
    stub = StubNvml([datacenter_gpu(ecc_mode=NOT_SUPPORTED_RC, rows=NOT_SUPPORTED_RC, pages_pending=NOT_SUPPORTED_RC,
                                    links=[], reasons=FUNCTION_NOT_FOUND, old_reasons=0x4)])  # fmt: skip
    backend = NvmlBackend(stub)
    backend.open()
    (gpu,) = backend.inventory()
    assert gpu["ecc"] == gpu["remapped_rows"] == gpu["retired_pages"] == NOT_SUPPORTED
    assert gpu["nvlinks"] == []
    assert backend.sample()[0]["reasons"] == 0x4  # the pre-535 name answered


def test_gpu_lost_mid_window_does_not_abort_the_others():
    stub = StubNvml([datacenter_gpu(), datacenter_gpu(bus=b"00000000:3B:00.0")])
    backend = NvmlBackend(stub)
    backend.open()
    backend.inventory()
    first = backend.sample()
    stub.gpus[1]["lost"] = True
    second = backend.sample()
    assert first[1] is not None and second[1] is None and second[0]["temperature_c"] == 35
    calls_before = len(stub.calls)
    assert backend.sample()[1] is None and backend.processes().keys() == {0}
    assert stub.calls[calls_before:].count("temp") == 1  # the lost GPU is not asked again
    assert backend.lost_indexes() == [1]


def test_lost_at_inventory():
    backend = NvmlBackend(StubNvml([datacenter_gpu(lost=True)]))
    backend.open()
    assert backend.inventory() == [{"index": 0, "lost": True}]
    assert backend.sample() == {0: None}


@pytest.mark.parametrize(
    ("code", "error"), [(LIBRARY_NOT_FOUND, NvmlLibraryMissing), (DRIVER_NOT_LOADED, NvmlNoDriver)]
)
def test_init_errors(code, error):
    with pytest.raises(error):
        NvmlBackend(StubNvml([], init_error=code)).open()


def test_gpu_view_samples_utilization_and_flags_foreign_pids():
    stub = StubNvml([datacenter_gpu(util=[40, 0, 0, 90], used_mib=30720, procs=[(2**22 + 7, 30720)])])
    gpus, error = read_gpu_view(stub, observe_s=0.25, pid_exists=lambda pid: False, interval_s=0.1)
    assert error is None
    (gpu,) = gpus
    assert gpu.utilization_pct == (40, 0, 0)
    assert (gpu.index, gpu.minor, gpu.memory_used_mib, gpu.memory_total_mib) == (0, None, 30720, 81559)
    assert gpu.processes == ({"pid": 2**22 + 7, "used_memory_mib": 30720, "pid_exists_here": False},)
    skipped, _error = read_gpu_view(stub, observe_s=0, pid_exists=lambda pid: False)
    assert skipped[0].utilization_pct == ()


def test_gpu_view_without_nvml():
    assert read_gpu_view(None, 1, lambda pid: False) == (None, "pynvml (nvidia-ml-py) is not installed")
    failing = StubNvml([], init_error=DRIVER_NOT_LOADED)
    assert read_gpu_view(failing, 1, lambda pid: False) == (None, f"NVML unavailable: {NVMLError(DRIVER_NOT_LOADED)}")
