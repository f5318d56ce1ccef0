# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one NVML reader (the ``pynvml`` module of package nvidia-ml-py): gpu_health's backend and vram_zombies' view.

The ``pynvml`` module is passed in, so each module decides how it is imported and tests can run
the real binding against the simulator's library, or a stub. One lost GPU must not abort the run: every
per-device call is guarded, NVML_ERROR_GPU_IS_LOST marks that GPU lost and stops reading it, and
other errors (not supported, no permission, a symbol the driver lacks) read as "no value".
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import (
    MIB,
    NOT_SUPPORTED,
    Gpu,
    cuda_version_text,
    normalize_bus_id,
)

_NA = object()  # a reading NVML could not give
_UNSUPPORTED = object()  # NVML_ERROR_NOT_SUPPORTED: the feature does not exist on this GPU

# Stable NVML return codes (nvml.h), so this file does not depend on the binding's constants.
_NOT_SUPPORTED = 3
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_MAX_NVLINKS = 36  # NVML_NVLINK_MAX_LINKS in current headers


class NvmlLibraryMissing(Exception):
    """libnvidia-ml.so.1 is not installed (another backend may still work)."""


class NvmlNoDriver(Exception):
    """The library is there but the driver is not usable."""


class _GpuLost(Exception):
    pass


class NvmlBackend:
    name = "nvml"
    first_sample_at: Optional[float] = None  # the window starts at its first sample() call

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._handles: Dict[int, Any] = {}
        self._lost: Dict[int, bool] = {}

    # ----------------------------------------------------------------- lifecycle

    def open(self) -> None:
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as exc:
            if exc.value == _LIBRARY_NOT_FOUND:
                raise NvmlLibraryMissing(str(exc)) from exc
            reason = "driver not loaded" if exc.value == _DRIVER_NOT_LOADED else str(exc)
            raise NvmlNoDriver(f"NVML could not start: {reason}") from exc

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    # ----------------------------------------------------------------- guarded calls

    def _call(self, function: str, *args: Any) -> Any:
        fn = getattr(self.nvml, function, None)
        if fn is None:
            return _NA
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if exc.value == _GPU_IS_LOST:
                raise _GpuLost() from exc
            return _UNSUPPORTED if exc.value == _NOT_SUPPORTED else _NA

    def _first(self, functions: List[str], *args: Any) -> Any:
        """The first of ``functions`` that the library has and answers (renamed entry points)."""
        result: Any = _NA
        for function in functions:
            result = self._call(function, *args)
            if result is not _NA:
                return result
        return result

    # ----------------------------------------------------------------- box

    def versions(self) -> Dict[str, Optional[str]]:
        driver = self._call("nvmlSystemGetDriverVersion")
        cuda = self._first(["nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"])
        return {
            "driver_version": _text(driver) if _ok(driver) else None,
            "cuda_version": cuda_version_text(cuda) if _ok(cuda) else None,
        }

    def inventory(self) -> List[Dict[str, Any]]:
        count = self._first(["nvmlDeviceGetCount"])
        gpus = []
        for index in range(count if _ok(count) else 0):
            gpu: Dict[str, Any] = {"index": index, "lost": False}
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", index)
                if not _ok(handle):
                    raise _GpuLost()
                self._handles[index] = handle
                gpu.update(self._static(handle))
            except _GpuLost:
                gpu["lost"] = True
                self._lost[index] = True
            gpus.append(gpu)
        return gpus

    # ----------------------------------------------------------------- per GPU

    def _read(self, function: str, *args: Any, scale: float = 1.0) -> Any:
        value = self._call(function, *args)
        if not _ok(value):
            return None
        return value / scale if scale != 1.0 else value

    def _static(self, handle: Any) -> Dict[str, Any]:
        nvml = self.nvml
        pci = self._call("nvmlDeviceGetPciInfo", handle)
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        mig = self._call("nvmlDeviceGetMigMode", handle)
        persistence = self._read("nvmlDeviceGetPersistenceMode", handle)
        name, uuid = self._read("nvmlDeviceGetName", handle), self._read("nvmlDeviceGetUUID", handle)
        return {
            "name": _text(name) if name is not None else None,
            "uuid": _text(uuid) if uuid is not None else None,
            "pci_bus_id": normalize_bus_id(_text(pci.busId)) if _ok(pci) else None,
            "sm_clock_max_mhz": self._read("nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM),
            "memory_total_mib": memory.total // MIB if _ok(memory) else None,
            "power_limit_w": self._read("nvmlDeviceGetEnforcedPowerLimit", handle, scale=1000.0),
            "power_default_limit_w": self._read("nvmlDeviceGetPowerManagementDefaultLimit", handle, scale=1000.0),
            "persistence_mode": bool(persistence) if persistence is not None else None,
            "mig_mode": {
                "current": bool(mig[0]) if _ok(mig) else None,
                "pending": bool(mig[1]) if _ok(mig) else None,
            },
            "pcie": {
                "gen": self._read("nvmlDeviceGetCurrPcieLinkGeneration", handle),
                "gen_max": self._read("nvmlDeviceGetMaxPcieLinkGeneration", handle),
                "width": self._read("nvmlDeviceGetCurrPcieLinkWidth", handle),
                "width_max": self._read("nvmlDeviceGetMaxPcieLinkWidth", handle),
                "replay_counter": self._read("nvmlDeviceGetPcieReplayCounter", handle),
            },
            "ecc": self._ecc(handle),
            "remapped_rows": self._remapped_rows(handle),
            "retired_pages": self._retired_pages(handle),
            "nvlinks": self._nvlinks(handle),
        }

    def _ecc(self, handle: Any) -> Any:
        nvml = self.nvml
        mode = self._call("nvmlDeviceGetEccMode", handle)
        if mode is _UNSUPPORTED or not _ok(mode):
            return NOT_SUPPORTED
        result: Dict[str, Any] = {"enabled": bool(mode[0])}
        for scope, counter in (("volatile", nvml.NVML_VOLATILE_ECC), ("aggregate", nvml.NVML_AGGREGATE_ECC)):
            for kind, error_type in (
                ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ):
                result[f"{scope}_{kind}"] = self._read("nvmlDeviceGetTotalEccErrors", handle, error_type, counter)
        return result

    def _remapped_rows(self, handle: Any) -> Any:
        rows = self._call("nvmlDeviceGetRemappedRows", handle)
        if not _ok(rows):
            return NOT_SUPPORTED
        correctable, uncorrectable, pending, failure = rows
        return {
            "correctable": correctable,
            "uncorrectable": uncorrectable,
            "pending": bool(pending),
            "failure": bool(failure),
        }

    def _retired_pages(self, handle: Any) -> Any:
        nvml = self.nvml
        pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if not _ok(pending):
            return NOT_SUPPORTED
        single = self._call(
            "nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        double = self._call("nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        return {
            "single_bit": len(single) if _ok(single) else None,
            "double_bit": len(double) if _ok(double) else None,
            "pending": bool(pending),
        }

    def _nvlinks(self, handle: Any) -> List[Dict[str, Any]]:
        links = []
        for link in range(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", _MAX_NVLINKS)):
            state = self._call("nvmlDeviceGetNvLinkState", handle, link)
            if state is _UNSUPPORTED and link == 0:
                break  # no NVLink on this GPU at all
            if _ok(state):
                links.append({"link": link, "active": bool(state)})
        return links

    # ----------------------------------------------------------------- sampling

    def sample(self) -> Dict[int, Optional[Dict[str, Any]]]:
        """One reading per GPU; None for a GPU that is (or just became) lost."""
        nvml, readings = self.nvml, {}
        for index, handle in self._handles.items():
            if self._lost.get(index):
                readings[index] = None
                continue
            try:
                memory = self._call("nvmlDeviceGetMemoryInfo", handle)
                reasons = self._first(
                    ["nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"], handle
                )
                readings[index] = {
                    "temperature_c": self._read("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
                    "sm_clock_mhz": self._read("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM),
                    "power_draw_w": self._read("nvmlDeviceGetPowerUsage", handle, scale=1000.0),
                    "memory_used_mib": memory.used // MIB if _ok(memory) else None,
                    "reasons": reasons if _ok(reasons) else None,
                }
            except _GpuLost:
                self._lost[index] = True
                readings[index] = None
        return readings

    def before_last_sample(self) -> None:
        """Nothing to start early: processes() is one in-process call per GPU."""

    def processes(self) -> Dict[int, List[Dict[str, Any]]]:
        found: Dict[int, List[Dict[str, Any]]] = {}
        for index, handle in self._handles.items():
            if self._lost.get(index):
                continue
            try:
                listed = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
            except _GpuLost:
                self._lost[index] = True
                continue
            found[index] = _process_entries(listed)
        return found

    def claim(self, bus_ids: List[str]) -> List[str]:
        """The bus ids NVML says are this box's GPUs: it answers GPU_IS_LOST for a lost one, NOT_FOUND elsewhere."""
        mine = []
        for bus_id in bus_ids:
            try:
                found = _ok(self._call("nvmlDeviceGetHandleByPciBusId", bus_id.encode()))
            except _GpuLost:
                found = True
            if found:
                mine.append(bus_id)
        return mine

    def lost_indexes(self) -> List[int]:
        return sorted(index for index, lost in self._lost.items() if lost)

    def complete(self, gpus: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Nothing to add: inventory() read the static state (in-process calls, no window to overlap)."""
        return []

    # ----------------------------------------------------------------- vram_zombies' view

    def gpu_view(self, observe_s: float, interval_s: float, pid_exists: Callable[[int], bool]) -> List[Gpu]:
        """Every GPU with its memory, compute processes and utilization sampled over ``observe_s``."""
        nvml = self.nvml
        # Unguarded (NVMLError goes to the caller): without the GPU list there is no view at all.
        handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(nvml.nvmlDeviceGetCount())]
        utilization = self._utilization_window(handles, observe_s, interval_s)
        return [self._gpu_of(index, handle, utilization[index], pid_exists) for index, handle in enumerate(handles)]

    def _optional(self, function: str, *args: Any) -> Any:
        """A reading the view can do without: None when NVML cannot give it, a lost GPU included."""
        try:
            value = self._call(function, *args)
        except _GpuLost:
            return None
        return value if _ok(value) else None

    def _utilization_window(self, handles: List[Any], observe_s: float, interval_s: float) -> List[List[int]]:
        samples: List[List[int]] = [[] for _handle in handles]
        deadline = time.monotonic() + max(observe_s, 0.0)
        while observe_s > 0:
            for index, handle in enumerate(handles):
                rates = self._optional("nvmlDeviceGetUtilizationRates", handle)
                if rates is not None:
                    samples[index].append(int(rates.gpu))
            if time.monotonic() + interval_s > deadline:
                break
            time.sleep(interval_s)
        return samples

    def _gpu_of(self, index: int, handle: Any, utilization: List[int], pid_exists: Callable[[int], bool]) -> Gpu:
        memory = self._optional("nvmlDeviceGetMemoryInfo", handle)
        listed = self._optional("nvmlDeviceGetComputeRunningProcesses", handle)
        # NVML reports host PIDs: in a container this PID may not exist here, or be another process.
        processes = [dict(entry, pid_exists_here=pid_exists(entry["pid"])) for entry in _process_entries(listed)]
        return Gpu(
            index=index,
            minor=self._optional("nvmlDeviceGetMinorNumber", handle),
            memory_used_mib=memory.used // MIB if memory is not None else None,
            memory_total_mib=memory.total // MIB if memory is not None else None,
            utilization_pct=tuple(utilization),
            processes=tuple(processes),
        )


def _process_entries(listed: Any) -> List[Dict[str, Any]]:
    return [
        {
            "pid": int(proc.pid),
            "used_memory_mib": int(proc.usedGpuMemory) // MIB if proc.usedGpuMemory is not None else None,
        }
        for proc in (listed if _ok(listed) else [])
    ]


def _ok(value: Any) -> bool:
    return value is not _NA and value is not _UNSUPPORTED and value is not None


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def read_gpu_view(
    nvml: Any, observe_s: float, pid_exists: Callable[[int], bool], interval_s: float = 0.5
) -> Tuple[Optional[List[Gpu]], Optional[str]]:
    """vram_zombies' view of every GPU, utilization sampled over ``observe_s``; (None, why) without NVML."""
    if nvml is None:
        return None, "pynvml (nvidia-ml-py) is not installed"
    backend = NvmlBackend(nvml)
    try:
        backend.open()
    except (NvmlLibraryMissing, NvmlNoDriver) as exc:
        return None, f"NVML unavailable: {exc.__cause__}"
    try:
        return backend.gpu_view(observe_s, interval_s, pid_exists), None
    except nvml.NVMLError as exc:
        return None, f"NVML query failed: {exc}"
    finally:
        backend.close()
