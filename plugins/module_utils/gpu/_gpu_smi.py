# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The nvidia-smi backend of gpu_health: runs the tool, every call bounded, and samples through _smi_parse.

Only one call stands before the window: the first sample query, which also names the GPUs and finds a missing
tool or driver. The static state (``-q``, ``nvlink -s``) is read in a thread while the window runs, and merged
into the GPUs by ``complete`` afterwards; ``--query-compute-apps`` follows the window.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import RC_NOT_FOUND, RC_TIMEOUT, Runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import normalize_bus_id
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._smi_parse import (
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

    def __init__(self, run: Runner, timeout_s: float = 10.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self.timeout_s = timeout_s
        self.monotonic = monotonic
        # When open() began the query that is the window's first sample: the window is timed from there.
        self.first_sample_at: Optional[float] = None
        self._fields = SAMPLE_FIELDS
        self._static: Dict[str, Any] = {}
        self._index_by_bus: Dict[str, int] = {}
        self._lost: Dict[int, bool] = {}
        # The open() query's answer, handed out as the window's first sample instead of asking again.
        self._first: Optional[Tuple[List[Dict[str, Optional[str]]], List[str]]] = None
        self._static_reader: Optional[_Background] = None
        self._apps: Optional[_Background] = None

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
        """The first sample query (a missing tool or driver shows here), then the static reads in the background."""
        self.first_sample_at = self.monotonic()
        self._first = self._query()
        self._static_reader = _Background(self._read_static)

    def close(self) -> None:
        """Nothing stays open between nvidia-smi calls; a static read still running ends within its timeout."""
        for reader in (self._static_reader, self._apps):
            if reader is not None:
                reader.join()

    def _read_static(self) -> Tuple[Dict[str, Any], Dict[int, List[Dict[str, Any]]]]:
        rc, text = self._smi("-q")
        static = parse_q(text)
        if rc != 0 and not static["gpus"] and not _no_devices(text):
            raise SmiError(f"nvidia-smi -q exited {rc}: {_first_line(text)}")
        return static, self._nvlinks()

    def versions(self) -> Dict[str, Optional[str]]:
        """Driver and CUDA versions, from ``-q``: known after ``complete``."""
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
        """Every GPU as the open() query names it; ``complete`` adds what ``-q`` and ``nvlink -s`` say."""
        if self._first is None:
            self._first = self._query()
        rows, lost = self._first
        gpus: Dict[int, Dict[str, Any]] = {}
        for row in rows:
            index, bus_id = integer(row.get("index")), normalize_bus_id(row.get("pci.bus_id"))
            if index is None:
                continue
            gpus[index] = {
                "index": index,
                "pci_bus_id": bus_id,
                "name": clean(row.get("name")),
                "uuid": clean(row.get("uuid")),
                "lost": row_is_lost(row),
                "sm_clock_max_mhz": integer(row.get("clocks.max.sm")),
                "memory_total_mib": integer(row.get("memory.total")),
                "power_limit_w": number(row.get("enforced.power.limit")),
            }
        self._place_lost(gpus, lost)
        return [gpus[index] for index in sorted(gpus)]

    def _place_lost(self, gpus: Dict[int, Dict[str, Any]], lost: List[str]) -> List[Dict[str, Any]]:
        """Add the lost GPUs nvidia-smi skipped a row for; returns the added ones.

        NVML numbers GPUs in PCI bus order, so each lost GPU gets the lowest free index in bus-id order.
        """
        lost = sorted(set(lost) - {gpu["pci_bus_id"] for gpu in gpus.values()})
        free = (index for index in range(len(gpus) + len(lost)) if index not in gpus)
        added = []
        for bus_id, index in zip(lost, free):
            gpus[index] = {"index": index, "pci_bus_id": bus_id, "lost": True}
            added.append(gpus[index])
        for index, gpu in gpus.items():
            self._index_by_bus[gpu["pci_bus_id"]] = index
            self._lost[index] = self._lost.get(index, False) or bool(gpu["lost"])
        return added

    def complete(self, gpus: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Merge the background reads into ``gpus`` (in place, in index order); returns GPUs only ``-q`` knew of.

        Raises SmiError when ``-q`` failed: the window's readings are still judged.
        """
        if self._static_reader is None:
            self._static_reader = _Background(self._read_static)
        self._static, nvlinks = self._static_reader.result()
        static_by_bus = {gpu["pci_bus_id"]: gpu for gpu in self._static.get("gpus", [])}
        for gpu in gpus:
            static = static_by_bus.get(gpu["pci_bus_id"], {})
            # The query's values win; -q fills what it lacks (ECC, remapper, PCIe, MIG ...). Its processes and
            # sample are from before the window: the module reads both anew.
            for key, value in static.items():
                if key not in ("samples", "processes", "lost") and gpu.get(key) is None:
                    gpu[key] = value
            gpu["lost"] = bool(gpu.get("lost")) or bool(static.get("lost"))
            self._lost[gpu["index"]] = self._lost.get(gpu["index"], False) or gpu["lost"]
        by_index = {gpu["index"]: gpu for gpu in gpus}
        added = self._place_lost(
            by_index, [gpu["pci_bus_id"] for gpu in self._static.get("gpus", []) if gpu.get("lost")]
        )
        gpus[:] = [by_index[index] for index in sorted(by_index)]
        for gpu in gpus:
            gpu["nvlinks"] = nvlinks.get(gpu["index"], [])
        return added

    def _nvlinks(self) -> Dict[int, List[Dict[str, Any]]]:
        try:
            _rc, text = self._smi("nvlink", "-s")
        except SmiError:
            return {}
        # A lost GPU makes the whole command exit non-zero; the other GPUs' links are still listed.
        return parse_nvlink_status(text)

    def sample(self) -> Dict[int, Optional[Dict[str, Any]]]:
        if self._first is not None:  # the open() query is the window's first sample
            (rows, lost), self._first = self._first, None
        else:
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

    def before_last_sample(self) -> None:
        """Ask for the compute apps alongside the window's last sample, not after it."""
        self._apps = _Background(self._compute_apps)

    def _compute_apps(self) -> Tuple[int, str]:
        return self._smi("--query-compute-apps=" + ",".join(APPS_FIELDS), "--format=csv,noheader,nounits")

    def processes(self) -> Dict[int, List[Dict[str, Any]]]:
        rc, text = self._apps.result() if self._apps is not None else self._compute_apps()
        by_bus = parse_compute_apps(text)
        if rc != 0 and not by_bus and not lost_bus_ids(text) and not _no_devices(text):
            raise SmiError(f"nvidia-smi --query-compute-apps exited {rc}: {_first_line(text)}")
        return {index: by_bus.get(bus_id, []) for bus_id, index in self._index_by_bus.items() if not self._lost[index]}

    def lost_indexes(self) -> List[int]:
        return sorted(index for index, lost in self._lost.items() if lost)


class _Background:
    """One call run in a daemon thread; ``result()`` waits for it and returns its value or raises its error."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._call()
        except SmiNoDriver as exc:  # the driver went away after the first query: a part-way failure
            self._error = SmiError(str(exc))
        except Exception as exc:  # any error reaches the caller of result(), not a dead thread
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _no_devices(text: str) -> bool:
    """A box with no GPU: every nvidia-smi query says so (exit 6); that is gpu_count_mismatch, not a failure."""
    return "no devices were found" in text.lower()


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
