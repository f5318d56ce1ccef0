# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpu_health without Ansible: pick a backend, sample a window, read the kernel log, judge.

``check_gpu_health(options, run, nvml)`` returns the module's result (less ``changed``); ``options``
are the module's parameters, every one present (the module's argument spec holds the defaults). The
backends fill one data model (see ``_gpu_checks``); the verdict is the same pure functions whichever
backend read the GPUs.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import Runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding, status_of
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _kernel_log, _xid
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_checks import (
    box_findings,
    gpu_findings,
    window_reasons,
    window_summary,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import (
    bus_key,
    normalize_bus_id,
    same_gpu,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_nvml import (
    NvmlBackend,
    NvmlLibraryMissing,
    NvmlNoDriver,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_smi import SmiBackend, SmiError, SmiNoDriver
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid_findings import xid_findings

BACKENDS = ("auto", "nvml", "nvidia-smi")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Ten years is the whole log of any box; longer durations overflow datetime arithmetic.
MAX_SINCE_DAYS = 3650


def parse_since(value: Optional[str], now: datetime) -> Optional[datetime]:
    """``xid_since``: ``boot`` -> None (the whole log), ``24h``/``30m``/``7d`` -> now minus that,
    or an ISO-8601 time (UTC when it has no offset). Raises ValueError otherwise."""
    invalid = ValueError(
        f"xid_since must be 'boot', a duration of at most {MAX_SINCE_DAYS}d like 24h / 30m / 7d,"
        f" or an ISO-8601 time, not {value!r}"
    )
    text = (value or "boot").strip()
    if text.lower() == "boot":
        return None
    duration = _DURATION.match(text)
    if duration:
        seconds = float(duration.group(1)) * _UNIT_SECONDS[duration.group(2).lower()]
        if seconds > MAX_SINCE_DAYS * 86400:  # also inf, from a few hundred digits
            raise invalid
        return now - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise invalid from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def pid_visible(pid: int) -> bool:
    """Whether ``pid`` exists in this PID namespace (NVML reports host PIDs)."""
    return os.path.exists(f"/proc/{int(pid)}")


def _open_backend(
    choice: str, run: Runner, nvml: Any, timeout_s: float, monotonic: Callable[[], float] = time.monotonic
) -> Tuple[Any, Optional[str], str]:
    """(opened backend or None, why none could start, name of the backend that answered last)."""
    if choice in ("auto", "nvml"):
        if nvml is None:
            if choice == "nvml":
                return None, "the pynvml module (package nvidia-ml-py) is not importable", "nvml"
        else:
            backend = NvmlBackend(nvml)
            try:
                backend.open()
                return backend, None, backend.name
            except NvmlNoDriver as exc:
                return None, str(exc), backend.name
            except NvmlLibraryMissing as exc:
                if choice == "nvml":
                    return None, f"libnvidia-ml.so.1 not found: {exc}", backend.name
    smi = SmiBackend(run, timeout_s, monotonic=monotonic)
    try:
        smi.open()
    except SmiNoDriver as exc:
        return None, str(exc) if choice == "nvidia-smi" else f"no NVML library and {exc}", smi.name
    except SmiError as exc:
        return None, f"nvidia-smi failed: {exc}", smi.name
    return smi, None, smi.name


def _sample_window(
    backend: Any,
    gpus: List[Dict[str, Any]],
    *,
    seconds: float,
    interval: float,
    sleep: Callable[[float], None],
    monotonic: Callable[[], float],
    start: Optional[float] = None,
) -> None:
    """Append one sample per GPU at t = 0, interval, 2*interval ... up to ``seconds``.

    ``start``: when the first sample was taken, if the backend took it while opening (nvidia-smi's first query).
    """
    start = monotonic() if start is None else start
    tick = 0
    while True:
        if interval <= 0 or start + (tick + 1) * interval > start + seconds + 1e-9:
            backend.before_last_sample()
        readings = backend.sample()
        for gpu in gpus:
            reading = readings.get(gpu["index"])
            if reading is not None:
                gpu["samples"].append(reading)
        tick += 1
        next_at = start + tick * interval
        if interval <= 0 or next_at > start + seconds + 1e-9:
            return
        sleep(max(0.0, next_at - monotonic()))


def _public_gpu(gpu: Dict[str, Any]) -> Dict[str, Any]:
    """A GPU of the data model as the module returns it (the latest sample on top, window below)."""
    samples = gpu.pop("samples")
    last = samples[-1] if samples else {}
    return {
        "index": gpu["index"],
        "name": gpu.get("name"),
        "uuid": gpu.get("uuid"),
        "pci_bus_id": gpu.get("pci_bus_id"),
        "lost": bool(gpu.get("lost")),
        "temperature_c": last.get("temperature_c"),
        "sm_clock_mhz": last.get("sm_clock_mhz"),
        "sm_clock_max_mhz": gpu.get("sm_clock_max_mhz"),
        "power_draw_w": last.get("power_draw_w"),
        "memory_used_mib": last.get("memory_used_mib"),
        "memory_total_mib": gpu.get("memory_total_mib"),
        "power_limit_w": gpu.get("power_limit_w"),
        "power_default_limit_w": gpu.get("power_default_limit_w"),
        "clocks_event_reasons": window_reasons(samples)[0],
        "persistence_mode": gpu.get("persistence_mode"),
        "pcie": gpu.get("pcie") or {},
        "processes": gpu.get("processes") or [],
        "ecc": gpu.get("ecc"),
        "remapped_rows": gpu.get("remapped_rows"),
        "retired_pages": gpu.get("retired_pages"),
        "nvlinks": gpu.get("nvlinks") or [],
        "mig_mode": gpu.get("mig_mode") or {},
        "window": window_summary(samples),
    }


def _read_kernel_log(
    options: Dict[str, Any], run: Runner
) -> Tuple[Dict[str, Any], Optional[List[Dict[str, Any]]], Optional[Dict[str, Any]]]:
    """(summary, parsed events or None, the kernel_log_unreadable finding or None)."""
    log = _kernel_log.read_kernel_log(run, options["kernel_log_timeout_s"])
    summary = {"source": log.get("source"), "readable": log.get("lines") is not None, "truncated": log["truncated"]}
    unreadable = _kernel_log.kernel_log_finding(log)
    return summary, (None if unreadable is not None else _xid.parse_kernel_log(log["lines"])), unreadable


def _name_lost_gpus(backend: Any, gpus: List[Dict[str, Any]], events: List[Dict[str, Any]]) -> None:
    """Give a lost GPU whose bus id NVML could not read the kernel log's address that NVML says is its own.

    Only NVML leaves a lost GPU unnamed (nvidia-smi names it in its error line). NVML numbers GPUs in
    PCI bus order, so a claimed address belongs to the one unnamed GPU its named neighbours bracket.
    """
    if not isinstance(backend, NvmlBackend) or all(gpu.get("pci_bus_id") for gpu in gpus):
        return
    addresses = {normalize_bus_id(event["pci"]) for event in events} - {None}
    addresses = {a for a in addresses if not any(same_gpu(a, gpu.get("pci_bus_id")) for gpu in gpus)}
    for bus_id in sorted(backend.claim(sorted(addresses)), key=bus_key):
        key = bus_key(bus_id)
        fits = []
        for position, gpu in enumerate(gpus):
            before = [bus_key(g["pci_bus_id"]) for g in gpus[:position] if g.get("pci_bus_id")]
            after = [bus_key(g["pci_bus_id"]) for g in gpus[position + 1 :] if g.get("pci_bus_id")]
            if not gpu.get("pci_bus_id") and all(k < key for k in before) and all(key < k for k in after):
                fits.append(gpu)
        if len(fits) == 1:
            fits[0]["pci_bus_id"] = bus_id


def _addresses_complete(gpus: Optional[List[Dict[str, Any]]], expected: Optional[int]) -> bool:
    """Whether the box's GPU addresses are all known, so an Xid elsewhere is another GPU of the host.

    Not when a GPU is unnamed, or fewer GPUs than expected are listed (a GPU that fell off the bus may
    have vanished from the driver's list), or none at all.
    """
    if not gpus or not all(gpu.get("pci_bus_id") for gpu in gpus):
        return False
    return expected is None or len(gpus) >= expected


def _xid_findings(
    options: Dict[str, Any], events: List[Dict[str, Any]], gpus: Optional[List[Dict[str, Any]]], now: datetime
) -> List[Dict[str, Any]]:
    bus_ids = {gpu["index"]: gpu["pci_bus_id"] for gpu in gpus or [] if gpu.get("pci_bus_id")}
    since = parse_since(options["xid_since"], now)
    complete = _addresses_complete(gpus, options["expected_gpu_count"])
    return xid_findings(events, bus_ids, since=since, boot_time=_kernel_log.boot_time(), complete=complete)


def _without_duplicate_losses(xid_found: List[Dict[str, Any]], gpus: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The kernel log's gpu_lost for a GPU the backend already reported lost says nothing new."""
    lost = [gpu for gpu in gpus if gpu.get("lost")]
    lost_indexes = {gpu["index"] for gpu in lost}
    unmapped_lost = any(not gpu.get("pci_bus_id") for gpu in lost)
    kept = []
    for item in xid_found:
        if item["code"] == "gpu_lost" and (
            item.get("gpu") in lost_indexes or (item.get("gpu") is None and unmapped_lost)
        ):
            continue
        kept.append(item)
    return kept


def _reject_bad_values(options: Dict[str, Any], now: datetime) -> None:
    """Option values only the checks can validate, rejected before spending the sampling window."""
    parse_since(options["xid_since"], now)
    if options["expected_gpu_model"]:
        try:
            re.compile(options["expected_gpu_model"])
        except re.error as exc:
            raise ValueError(f"expected_gpu_model is not a valid regular expression: {exc}") from None


def _attach_processes(backend: Any, gpus: List[Dict[str, Any]], is_visible: Callable[[int], bool]) -> None:
    """Each GPU's compute processes, each marked visible or not in this PID namespace; losses seen meanwhile."""
    processes = backend.processes()
    for gpu in gpus:
        gpu["lost"] = gpu.get("lost") or gpu["index"] in backend.lost_indexes()
        gpu["processes"] = [
            dict(proc, visible=bool(is_visible(proc["pid"]))) for proc in processes.get(gpu["index"], [])
        ]


def _read_gpus(
    backend: Any,
    options: Dict[str, Any],
    requested: Optional[List[int]],
    events: List[Dict[str, Any]],
    *,
    sleep: Callable[[float], None],
    monotonic: Callable[[], float],
    is_visible: Callable[[int], bool],
) -> Tuple[Dict[str, Optional[str]], Optional[List[Dict[str, Any]]], List[Dict[str, Any]]]:
    """(driver and CUDA versions, every GPU or None, findings): the requested GPUs get a sampled window.

    nvidia-smi failing part-way is a finding, and what was read before it is still judged.
    """
    versions: Dict[str, Optional[str]] = {"driver_version": None, "cuda_version": None}
    all_gpus: Optional[List[Dict[str, Any]]] = None
    found: List[Dict[str, Any]] = []
    try:
        try:
            all_gpus = backend.inventory()
            selected = [gpu for gpu in all_gpus if requested is None or gpu["index"] in requested]
            for gpu in selected:
                gpu["samples"] = []
            seconds, interval = options["sample_seconds"], options["sample_interval_s"]
            _sample_window(
                backend, selected, seconds=seconds, interval=interval, sleep=sleep, monotonic=monotonic,
                start=backend.first_sample_at,
            )  # fmt: skip
            _attach_processes(backend, selected, is_visible)
        finally:
            # What nvidia-smi read while the window ran, also after a window that failed part-way.
            # A lost GPU only that read names gets no readings, but is judged.
            for gpu in backend.complete(all_gpus) if all_gpus is not None else []:
                if requested is None or gpu["index"] in requested:
                    gpu["samples"] = []
        _name_lost_gpus(backend, all_gpus, events)
    except SmiError as exc:
        found.append(finding("gpu_query_failed", "WARN", f"reading the GPUs failed part-way: {exc}", "investigate"))
    finally:
        versions.update(backend.versions())
        backend.close()
    return versions, all_gpus, found


def _judge_gpus(
    all_gpus: Optional[List[Dict[str, Any]]],
    requested: Optional[List[int]],
    options: Dict[str, Any],
    versions: Dict[str, Optional[str]],
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(box and per-GPU findings, the sampled GPUs as the module returns them)."""
    found: List[Dict[str, Any]] = []
    if all_gpus is not None:  # an inventory that failed says nothing about the GPU count
        found += box_findings(all_gpus, requested, options, versions["driver_version"], versions["cuda_version"])
    sampled = [gpu for gpu in all_gpus or [] if "samples" in gpu]
    for gpu in sampled:
        found += gpu_findings(gpu, options)
    return found, [_public_gpu(gpu) for gpu in sampled]


def _kernel_log_findings(
    options: Dict[str, Any],
    events: Optional[List[Dict[str, Any]]],
    unreadable: Optional[Dict[str, Any]],
    all_gpus: Optional[List[Dict[str, Any]]],
    *,
    requested: Optional[List[int]],
    now: datetime,
) -> List[Dict[str, Any]]:
    """The Xid findings of the requested GPUs (and of no GPU in particular), or kernel_log_unreadable."""
    if unreadable is not None:
        return [unreadable]
    found = _xid_findings(options, events or [], all_gpus, now)
    found = [f for f in found if requested is None or f.get("gpu") is None or f["gpu"] in requested]
    return _without_duplicate_losses(found, all_gpus or [])


def check_gpu_health(
    options: Dict[str, Any],
    run: Runner,
    nvml: Any,
    *,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
    is_visible: Callable[[int], bool] = pid_visible,
    now: Optional[datetime] = None,
) -> Dict[str, Any]:
    """Run every gpu_health check; ``options`` are the module's parameters, every one present."""
    now = now or datetime.now(timezone.utc)
    _reject_bad_values(options, now)
    requested = options["gpus"] or None
    # Read first: naming a lost GPU needs the log's addresses while NVML is still open.
    kernel_log, events, unreadable = _read_kernel_log(options, run)
    backend, no_driver, backend_name = _open_backend(
        options["backend"], run, nvml, options["command_timeout_s"], monotonic=monotonic
    )
    result: Dict[str, Any] = {"driver_version": None, "cuda_version": None, "gpus": []}
    result.update(kernel_log=kernel_log, backend=backend_name)
    all_gpus: Optional[List[Dict[str, Any]]] = None
    if backend is None:
        findings = [finding("no_driver", "FAIL", f"no usable NVIDIA driver: {no_driver}", "re_rent")]
    else:
        versions, all_gpus, findings = _read_gpus(
            backend, options, requested, events or [], sleep=sleep, monotonic=monotonic, is_visible=is_visible
        )
        result.update(versions)
        verdicts, result["gpus"] = _judge_gpus(all_gpus, requested, options, versions)
        findings += verdicts
    findings += _kernel_log_findings(options, events, unreadable, all_gpus, requested=requested, now=now)
    result.update(findings=findings, status=status_of(findings), sample_seconds=options["sample_seconds"])
    return result
