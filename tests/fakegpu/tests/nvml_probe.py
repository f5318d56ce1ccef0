"""Read everything the simulator models through the real pynvml and print it as JSON.

Each value is the call's result, or {"error": "<NVMLError subclass name>"}. Arguments:
    (none)           every GPU once
    --sleep S        read, sleep S seconds, read again ("before"/"after")
    --rewrite FILE   read, replace the scenario file with FILE's text (new mtime), read again
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pynvml as nv


def call(function, *args):
    try:
        value = function(*args)
    except nv.NVMLError as exc:
        return {"error": type(exc).__name__}
    if isinstance(value, bytes):
        return value.decode()
    return value


def gpu(handle):
    def links():
        states = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS + 1):
            state = call(nv.nvmlDeviceGetNvLinkState, handle, link)
            if isinstance(state, dict):
                states.append(state)
                break
            errors = [call(nv.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter) for counter in (0, 1, 2)]
            states.append({"active": state, "replay": errors[0], "recovery": errors[1], "crc": errors[2]})
        return states

    def procs():
        result = call(nv.nvmlDeviceGetComputeRunningProcesses, handle)
        if isinstance(result, dict):
            return result
        # pynvml turns NVML_VALUE_NOT_AVAILABLE into None
        return [
            {"pid": p.pid, "used_mib": None if p.usedGpuMemory is None else p.usedGpuMemory // 1048576} for p in result
        ]

    def memory():
        info = call(nv.nvmlDeviceGetMemoryInfo, handle)
        return (
            info if isinstance(info, dict) else {"total_mib": info.total // 1048576, "used_mib": info.used // 1048576}
        )

    def utilization():
        rates = call(nv.nvmlDeviceGetUtilizationRates, handle)
        return rates if isinstance(rates, dict) else {"gpu": rates.gpu, "memory": rates.memory}

    def pci():
        info = call(nv.nvmlDeviceGetPciInfo, handle)
        return info if isinstance(info, dict) else {"bus_id": info.busId, "device_id": info.pciDeviceId}

    return {
        "index": call(nv.nvmlDeviceGetIndex, handle),
        "name": call(nv.nvmlDeviceGetName, handle),
        "uuid": call(nv.nvmlDeviceGetUUID, handle),
        "pci": pci(),
        "temperature": call(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
        "sm": call(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
        "sm_max": call(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM),
        "mem": call(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM),
        "mem_max": call(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_MEM),
        "reasons": call(nv.nvmlDeviceGetCurrentClocksEventReasons, handle),
        "throttle_reasons": call(nv.nvmlDeviceGetCurrentClocksThrottleReasons, handle),
        "power_mw": call(nv.nvmlDeviceGetPowerUsage, handle),
        "limit_mw": call(nv.nvmlDeviceGetEnforcedPowerLimit, handle),
        "management_limit_mw": call(nv.nvmlDeviceGetPowerManagementLimit, handle),
        "default_limit_mw": call(nv.nvmlDeviceGetPowerManagementDefaultLimit, handle),
        "memory": memory(),
        "utilization": utilization(),
        "persistence": call(nv.nvmlDeviceGetPersistenceMode, handle),
        "mig": call(nv.nvmlDeviceGetMigMode, handle),
        "ecc_mode": call(nv.nvmlDeviceGetEccMode, handle),
        "ecc_volatile_uncorrected": call(nv.nvmlDeviceGetTotalEccErrors, handle, 1, nv.NVML_VOLATILE_ECC),
        "ecc_aggregate_corrected": call(nv.nvmlDeviceGetTotalEccErrors, handle, 0, nv.NVML_AGGREGATE_ECC),
        "ecc_dram_volatile_uncorrected": call(nv.nvmlDeviceGetMemoryErrorCounter, handle, 1, 0, 2),
        "remapped_rows": call(nv.nvmlDeviceGetRemappedRows, handle),
        "retired_sbe": call(nv.nvmlDeviceGetRetiredPages, handle, 0),
        "retired_dbe": call(nv.nvmlDeviceGetRetiredPages_v2, handle, 1),
        "retired_pending": call(nv.nvmlDeviceGetRetiredPagesPendingStatus, handle),
        "pcie": [
            call(fn, handle)
            for fn in (
                nv.nvmlDeviceGetCurrPcieLinkGeneration,
                nv.nvmlDeviceGetMaxPcieLinkGeneration,
                nv.nvmlDeviceGetCurrPcieLinkWidth,
                nv.nvmlDeviceGetMaxPcieLinkWidth,
                nv.nvmlDeviceGetPcieReplayCounter,
            )
        ],
        "nvlinks": links(),
        "processes": procs(),
        "graphics_processes": call(nv.nvmlDeviceGetGraphicsRunningProcesses, handle),
    }


def snapshot():
    count = nv.nvmlDeviceGetCount()
    return {
        "driver": call(nv.nvmlSystemGetDriverVersion),
        "cuda": call(nv.nvmlSystemGetCudaDriverVersion_v2),
        "cuda_v1": call(nv.nvmlSystemGetCudaDriverVersion),
        "nvml_version": call(nv.nvmlSystemGetNVMLVersion),
        "count": count,
        "gpus": [gpu(nv.nvmlDeviceGetHandleByIndex(index)) for index in range(count)],
        "bad_index": call(nv.nvmlDeviceGetHandleByIndex, count),
    }


def main(argv):
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        print(json.dumps({"init_error": type(exc).__name__}))
        return 0
    if argv[:1] == ["--sleep"]:
        before = snapshot()
        time.sleep(float(argv[1]))
        result = {"before": before, "after": snapshot()}
    elif argv[:1] == ["--rewrite"]:
        before = snapshot()
        target = os.environ["FAKEGPU_SCENARIO"]
        shutil.copyfile(argv[1], target)
        stamp = time.time() + 5  # a clearly different mtime even on coarse-grained filesystems
        os.utime(target, (stamp, stamp))
        result = {"before": before, "after": snapshot()}
    else:
        result = snapshot()
    nv.nvmlShutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
