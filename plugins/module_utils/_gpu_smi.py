# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The nvidia-smi backend of gpu_health: runs the tool, every call bounded, and samples through _smi_parse."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils._command import RC_NOT_FOUND, RC_TIMEOUT, Runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils._gpu_model import normalize_bus_id
from ansible_collections.remote_gpu.trainer.plugins.module_utils._smi_parse import (
    APPS_FIELDS,
    OLD_FIELD_NAMES,
    SAMPLE_FIELDS,
    clean,
    integer,
    lost_bus_ids,
    number,
    parse_compute_apps,
    parse_nvlink_status,
    parse_q,
    parse_query_csv,
    row_is_lost,
    sample_from_row,
)

SMI = "nvidia-smi"
_NO_DRIVER = re.compile(r"couldn't communicate with the NVIDIA driver|NVIDIA-SMI has failed", re.IGNORECASE)


class SmiError(Exception):
    """nvidia-smi failed in a way that is not a missing driver."""


class SmiNoDriver(Exception):
    """nvidia-smi is missing, or says the driver is not loaded."""


class SmiBackend:
    """Reads the GPUs through ``nvidia-smi``; every call is bounded by ``timeout_s``."""

    name = "nvidia-smi"

    def __init__(self, run: Runner, timeout_s: float = 10.0) -> None:
        self.run = run
        self.timeout_s = timeout_s
        self._fields = SAMPLE_FIELDS
        self._static: Dict[str, Any] = {}
        self._index_by_bus: Dict[str, int] = {}
        self._lost: Dict[int, bool] = {}

    def _smi(self, *args: str) -> Tuple[int, str]:
        rc, out, err = self.run([SMI, *args], self.timeout_s)
        text = out + ("\n" + err if err else "")
        if rc == RC_NOT_FOUND:
            raise SmiNoDriver("nvidia-smi not found on PATH")
        if rc == RC_TIMEOUT:
            raise SmiError(f"nvidia-smi {args[0]} timed out after {self.timeout_s:g} s")
        if rc == 9 or _NO_DRIVER.search(text):
            raise SmiNoDriver(_first_line(text) or f"nvidia-smi exited {rc}")
        return rc, text

    def open(self) -> None:
        rc, text = self._smi("-q")
        self._static = parse_q(text)
        if rc != 0 and not self._static["gpus"] and not _no_devices(text):
            raise SmiError(f"nvidia-smi -q exited {rc}: {_first_line(text)}")

    def close(self) -> None:
        """Nothing stays open between nvidia-smi calls."""

    def versions(self) -> Dict[str, Optional[str]]:
        return {"driver_version": self._static.get("driver_version"), "cuda_version": self._static.get("cuda_version")}

    def _query(self) -> Tuple[List[Dict[str, Optional[str]]], List[str]]:
        """Rows of one sample query, and the bus ids reported lost; retries once with old field names."""
        for _attempt in range(2):
            rc, text = self._smi("--query-gpu=" + ",".join(self._fields), "--format=csv,noheader,nounits")
            if rc != 0 and "not a valid field" in text.lower() and self._fields == SAMPLE_FIELDS:
                self._fields = tuple(OLD_FIELD_NAMES.get(field, field) for field in SAMPLE_FIELDS)
                continue
            rows = parse_query_csv(text, self._fields)
            if rc != 0 and not rows and not lost_bus_ids(text) and not _no_devices(text):
                raise SmiError(f"nvidia-smi --query-gpu exited {rc}: {_first_line(text)}")
            return rows, lost_bus_ids(text)
        raise SmiError("nvidia-smi rejects the clocks event reasons field under both its names")

    def inventory(self) -> List[Dict[str, Any]]:
        rows, lost = self._query()
        static_by_bus = {gpu["pci_bus_id"]: gpu for gpu in self._static.get("gpus", [])}
        gpus: Dict[int, Dict[str, Any]] = {}
        for row in rows:
            index, bus_id = integer(row.get("index")), normalize_bus_id(row.get("pci.bus_id"))
            if index is None:
                continue
            gpu = {key: value for key, value in static_by_bus.get(bus_id, {}).items() if key != "samples"}
            gpu.update(
                {
                    "index": index,
                    "pci_bus_id": bus_id,
                    "name": clean(row.get("name")) or gpu.get("name"),
                    "uuid": clean(row.get("uuid")) or gpu.get("uuid"),
                    "lost": row_is_lost(row) or bool(gpu.get("lost")),
                    "sm_clock_max_mhz": integer(row.get("clocks.max.sm")) or gpu.get("sm_clock_max_mhz"),
                    "memory_total_mib": integer(row.get("memory.total")) or gpu.get("memory_total_mib"),
                    "power_limit_w": number(row.get("enforced.power.limit")) or gpu.get("power_limit_w"),
                }
            )
            gpus[index] = gpu
        lost += [gpu["pci_bus_id"] for gpu in self._static.get("gpus", []) if gpu.get("lost")]
        # nvidia-smi skips a lost GPU's row; NVML numbers GPUs in PCI bus order, so give each lost
        # GPU the lowest free index in bus-id order.
        lost = sorted(set(lost) - {gpu["pci_bus_id"] for gpu in gpus.values()})
        free = (index for index in range(len(gpus) + len(lost)) if index not in gpus)
        for bus_id, index in zip(lost, free):
            gpus[index] = {"index": index, "pci_bus_id": bus_id, "lost": True}
        for index, gpu in gpus.items():
            self._index_by_bus[gpu["pci_bus_id"]] = index
            self._lost[index] = bool(gpu["lost"])
        nvlinks = self._nvlinks()
        for index, gpu in gpus.items():
            gpu["nvlinks"] = nvlinks.get(index, [])
        return [gpus[index] for index in sorted(gpus)]

    def _nvlinks(self) -> Dict[int, List[Dict[str, Any]]]:
        try:
            _rc, text = self._smi("nvlink", "-s")
        except SmiError:
            return {}
        # A lost GPU makes the whole command exit non-zero; the other GPUs' links are still listed.
        return parse_nvlink_status(text)

    def sample(self) -> Dict[int, Optional[Dict[str, Any]]]:
        rows, lost = self._query()
        readings: Dict[int, Optional[Dict[str, Any]]] = dict.fromkeys(self._lost)
        for bus_id in lost:
            if bus_id in self._index_by_bus:
                self._lost[self._index_by_bus[bus_id]] = True
        for row in rows:
            index = integer(row.get("index"))
            if index is None or index not in self._lost:
                continue
            if row_is_lost(row):
                self._lost[index] = True
            elif not self._lost[index]:
                readings[index] = sample_from_row(row)
        return readings

    def processes(self) -> Dict[int, List[Dict[str, Any]]]:
        rc, text = self._smi("--query-compute-apps=" + ",".join(APPS_FIELDS), "--format=csv,noheader,nounits")
        by_bus = parse_compute_apps(text)
        if rc != 0 and not by_bus and not lost_bus_ids(text) and not _no_devices(text):
            raise SmiError(f"nvidia-smi --query-compute-apps exited {rc}: {_first_line(text)}")
        return {index: by_bus.get(bus_id, []) for bus_id, index in self._index_by_bus.items() if not self._lost[index]}

    def lost_indexes(self) -> List[int]:
        return sorted(index for index, lost in self._lost.items() if lost)


def _no_devices(text: str) -> bool:
    """A box with no GPU: every nvidia-smi query says so (exit 6); that is gpu_count_mismatch, not a failure."""
    return "no devices were found" in text.lower()


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
