# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpu_health's verdict: pure functions from the GPU data model to findings.

Both backends (NVML, nvidia-smi) fill the same data model; nothing here talks to a GPU, so the
same scenario gives the same findings whichever backend read it.

Per GPU the model is a dict with ``index``, ``name``, ``uuid``, ``pci_bus_id``, ``lost``,
``sm_clock_max_mhz``, ``memory_total_mib``, ``power_limit_w``, ``power_default_limit_w``,
``pcie``, ``ecc``, ``remapped_rows``, ``retired_pages``, ``nvlinks``, ``mig_mode``,
``processes`` and the window's ``samples`` (``temperature_c``, ``sm_clock_mhz``,
``power_draw_w``, ``memory_used_mib``, ``reasons`` as the NVML bitmask).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_links import link_findings
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import REASON_BITS, reason_names

# Reasons that mean the board is holding its clocks down against the workload's will. SW power
# cap is not here: a loaded GPU riding its power limit is working as designed.
THROTTLE_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")


def version_tuple(text: Any) -> Optional[Tuple[int, ...]]:
    """Leading dotted number of ``text`` as a tuple, e.g. ``'535.161.08 [..]'`` -> (535, 161, 8)."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", str(text)) if text is not None else None
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def compare_versions(left: Any, right: Any) -> Optional[int]:
    """-1, 0 or 1 comparing dotted versions numerically (``'535.9' < '535.10'``); None if unparsable."""
    a, b = version_tuple(left), version_tuple(right)
    if a is None or b is None:
        return None
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def window_summary(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Min/max of the sampled readings over the window, plus the sample count."""
    summary: Dict[str, Any] = {"samples": len(samples)}
    for key in ("temperature_c", "sm_clock_mhz", "power_draw_w"):
        values = [s[key] for s in samples if s.get(key) is not None]
        summary[key] = {"min": min(values), "max": max(values)} if values else {"min": None, "max": None}
    return summary


def window_reasons(samples: List[Dict[str, Any]]) -> Tuple[List[str], Dict[str, int]]:
    """Reasons active in any sample, in NVML bit order, and in how many samples each was active."""
    counts: Dict[str, int] = {}
    for sample in samples:
        for name in reason_names(sample.get("reasons")):
            counts[name] = counts.get(name, 0) + 1
    return [name for _bit, name in REASON_BITS if name in counts], counts


def _idle(sample: Dict[str, Any]) -> bool:
    return "gpu_idle" in reason_names(sample.get("reasons"))


def _thermal_findings(gpu: Dict[str, Any], limits: Dict[str, Any]) -> List[Dict[str, Any]]:
    index, samples = gpu["index"], gpu.get("samples") or []
    hot_c, floor_pct = limits["temp_hot_c"], limits["sm_clock_floor_pct"]
    max_mhz = gpu.get("sm_clock_max_mhz")
    hot = [s for s in samples if s.get("temperature_c") is not None and s["temperature_c"] >= hot_c]
    if not hot:
        return []
    if max_mhz:
        floor_mhz = max_mhz * floor_pct / 100.0
        # An idle GPU parks its clocks on purpose; only a busy (or unknown) sample can be "crushed".
        crushed = [
            s for s in hot if s.get("sm_clock_mhz") is not None and s["sm_clock_mhz"] < floor_mhz and not _idle(s)
        ]
        if crushed:
            worst = min(crushed, key=lambda s: s["sm_clock_mhz"])
            return [
                finding(
                    "thermal_throttle",
                    "FAIL",
                    f"GPU {index} sm clock {worst['sm_clock_mhz']} MHz < {floor_pct}% of {max_mhz} MHz "
                    f"while at {worst['temperature_c']} C ({len(crushed)} of {len(samples)} samples)",
                    "re_rent",
                    gpu=index,
                    temperature_c=worst["temperature_c"],
                    sm_clock_mhz=worst["sm_clock_mhz"],
                    sm_clock_max_mhz=max_mhz,
                    samples_affected=len(crushed),
                )
            ]
    hottest = max(hot, key=lambda s: s["temperature_c"])
    return [
        finding(
            "running_hot",
            "WARN",
            f"GPU {index} at {hottest['temperature_c']} C (>= {hot_c} C) but sm clock "
            f"{hottest.get('sm_clock_mhz')} MHz not yet below {floor_pct}% of {max_mhz} MHz",
            "investigate",
            gpu=index,
            temperature_c=hottest["temperature_c"],
            sm_clock_mhz=hottest.get("sm_clock_mhz"),
            samples_affected=len(hot),
        )
    ]


def _throttle_findings(gpu: Dict[str, Any]) -> List[Dict[str, Any]]:
    samples = gpu.get("samples") or []
    _names, counts = window_reasons(samples)
    active = [name for name in THROTTLE_REASONS if name in counts]
    if not active:
        return []
    described = ", ".join(f"{name} ({counts[name]}/{len(samples)} samples)" for name in active)
    return [
        finding(
            "throttle_active",
            "FAIL",
            f"GPU {gpu['index']} clocks held down: {described}",
            "re_rent",
            gpu=gpu["index"],
            reasons=active,
        )
    ]


def _memory_health_findings(gpu: Dict[str, Any]) -> List[Dict[str, Any]]:
    index, found = gpu["index"], []
    ecc = gpu.get("ecc")
    if isinstance(ecc, dict) and (ecc.get("volatile_uncorrected") or 0) > 0:
        found.append(
            finding(
                "ecc_uncorrectable",
                "FAIL",
                f"GPU {index} has {ecc['volatile_uncorrected']} volatile uncorrected ECC errors",
                "re_rent",
                gpu=index,
                volatile_uncorrected=ecc["volatile_uncorrected"],
            )
        )
    rows = gpu.get("remapped_rows")
    if isinstance(rows, dict):
        if rows.get("failure"):
            found.append(
                finding(
                    "row_remap_failure",
                    "FAIL",
                    f"GPU {index} row remapping failed ({rows.get('uncorrectable')} uncorrectable rows)",
                    "re_rent",
                    gpu=index,
                    uncorrectable=rows.get("uncorrectable"),
                )
            )
        if rows.get("pending"):
            found.append(
                finding(
                    "row_remap_pending",
                    "FAIL",
                    f"GPU {index} has a row remap pending: needs a GPU reset a renter cannot do",
                    "re_rent",
                    gpu=index,
                    uncorrectable=rows.get("uncorrectable"),
                )
            )
    pages = gpu.get("retired_pages")
    if isinstance(pages, dict) and pages.get("pending"):
        found.append(
            finding(
                "retired_pages_pending",
                "FAIL",
                f"GPU {index} has a page retirement pending ({pages.get('double_bit')} double-bit pages retired)",
                "re_rent",
                gpu=index,
                double_bit=pages.get("double_bit"),
                single_bit=pages.get("single_bit"),
            )
        )
    return found


def _power_findings(gpu: Dict[str, Any], limits: Dict[str, Any]) -> List[Dict[str, Any]]:
    limit, default = gpu.get("power_limit_w"), gpu.get("power_default_limit_w")
    pct = limits["power_cap_pct"]
    if not limit or not default or limit >= default * pct / 100.0:
        return []
    return [
        finding(
            "power_capped",
            "WARN",
            f"GPU {gpu['index']} power limit {limit:g} W < {pct}% of default {default:g} W",
            "investigate",
            gpu=gpu["index"],
            power_limit_w=limit,
            power_default_limit_w=default,
        )
    ]


def _mig_findings(gpu: Dict[str, Any], limits: Dict[str, Any]) -> List[Dict[str, Any]]:
    mig = gpu.get("mig_mode") or {}
    if limits["allow_mig"] or not (mig.get("current") or mig.get("pending")):
        return []
    state = "on" if mig.get("current") else "pending"
    return [
        finding(
            "mig_enabled",
            "WARN",
            f"GPU {gpu['index']} MIG mode {state}: jobs see only a slice of the GPU",
            "investigate",
            gpu=gpu["index"],
            current=bool(mig.get("current")),
            pending=bool(mig.get("pending")),
        )
    ]


def _occupancy_findings(gpu: Dict[str, Any], limits: Dict[str, Any]) -> List[Dict[str, Any]]:
    index, found = gpu["index"], []
    processes = gpu.get("processes") or []
    listed_mib = sum(p["used_memory_mib"] for p in processes if p.get("used_memory_mib") is not None)
    # "[N/A]" per process (Windows WDDM, some drivers): unknown, never 0 MiB.
    unknown = [p["pid"] for p in processes if p.get("used_memory_mib") is None]
    if processes:
        visible = [p["pid"] for p in processes if p.get("visible")]
        hidden = [p["pid"] for p in processes if not p.get("visible")]
        parts = []
        if visible:
            parts.append(f"visible here: pid {', '.join(map(str, visible))}")
        if hidden:
            # NVML reports host PIDs: inside a container our own processes show up this way too.
            pids = ", ".join(map(str, hidden))
            parts.append(f"not in this PID namespace (host PIDs: this container's or another's): pid {pids}")
        holding = f"holding {listed_mib} MiB" if not unknown else "holding memory"
        if unknown:
            holding += f" ({listed_mib} MiB known; per-process memory unknown for pid {', '.join(map(str, unknown))})"
        found.append(
            finding(
                "foreign_processes",
                "WARN",
                f"GPU {index} already has {len(processes)} compute process(es) {holding}; " + "; ".join(parts),
                "reap_zombies" if visible else "investigate",
                gpu=index,
                pids=[p["pid"] for p in processes],
                visible_pids=visible,
                used_memory_mib=None if unknown else listed_mib,
            )
        )
    used = _last(gpu.get("samples") or [], "memory_used_mib")
    threshold = limits["occupied_mib_threshold"]
    # With a holder's memory unknown, nothing says how much no listed process holds.
    if used is not None and not unknown and used - listed_mib > threshold:
        found.append(
            finding(
                "memory_occupied",
                "WARN",
                f"GPU {index} has {used} MiB in use, {used - listed_mib} MiB of it held by no process listed here "
                f"(> {threshold} MiB): the holders are not visible from this box",
                "investigate",
                gpu=index,
                memory_used_mib=used,
                unaccounted_mib=used - listed_mib,
            )
        )
    return found


def _last(samples: List[Dict[str, Any]], key: str) -> Any:
    for sample in reversed(samples):
        if sample.get(key) is not None:
            return sample[key]
    return None


def _at_bus(gpu: Dict[str, Any]) -> str:
    # NVML cannot read the bus id of a lost GPU; say nothing rather than "None".
    return f" ({gpu['pci_bus_id']})" if gpu.get("pci_bus_id") else ""


def gpu_findings(gpu: Dict[str, Any], limits: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every per-GPU finding for one GPU of the data model."""
    if gpu.get("lost"):
        return [
            finding(
                "gpu_lost",
                "FAIL",
                f"GPU {gpu['index']}{_at_bus(gpu)} is lost: the driver cannot reach it",
                "re_rent",
                gpu=gpu["index"],
                pci_bus_id=gpu.get("pci_bus_id"),
            )
        ]
    found: List[Dict[str, Any]] = []
    pattern = limits.get("expected_gpu_model")
    if pattern and gpu.get("name") and not re.search(pattern, gpu["name"]):
        found.append(
            finding(
                "gpu_model_mismatch",
                "FAIL",
                f"GPU {gpu['index']} is {gpu['name']!r}, not {pattern!r}",
                "re_rent",
                gpu=gpu["index"],
                name=gpu["name"],
            )
        )
    found += _throttle_findings(gpu)
    found += _thermal_findings(gpu, limits)
    found += _memory_health_findings(gpu)
    found += link_findings(gpu, limits)
    found += _power_findings(gpu, limits)
    found += _mig_findings(gpu, limits)
    found += _occupancy_findings(gpu, limits)
    return found


def box_findings(
    gpus: List[Dict[str, Any]],
    requested: Optional[List[int]],
    limits: Dict[str, Any],
    driver_version: Optional[str],
    cuda_version: Optional[str],
) -> List[Dict[str, Any]]:
    """Findings about the box as a whole: GPU count, requested indexes, driver and CUDA versions."""
    found: List[Dict[str, Any]] = []
    present = [gpu["index"] for gpu in gpus]
    expected = limits.get("expected_gpu_count")
    if (expected is not None and len(gpus) < expected) or (expected is None and not gpus):
        wanted = expected if expected is not None else 1
        found.append(
            finding(
                "gpu_count_mismatch",
                "FAIL",
                f"{len(gpus)} GPU(s) visible, expected {'at least ' if expected is None else ''}{wanted}",
                "re_rent",
                count=len(gpus),
                expected=wanted,
            )
        )
    for index in requested or []:
        if index not in present:
            found.append(
                finding(
                    "gpu_missing",
                    "FAIL",
                    f"GPU {index} was requested but the box has only indexes {present}",
                    "re_rent",
                    gpu=index,
                    present=present,
                )
            )
    for label, have, want in (
        ("driver", driver_version, limits.get("min_driver_version")),
        ("CUDA driver", cuda_version, limits.get("min_cuda_version")),
    ):
        if not want:
            continue
        order = compare_versions(have, want)
        if order is None and gpus:  # a requirement that could not be checked is not a pass
            found.append(
                finding(
                    "version_unknown",
                    "WARN",
                    f"{label} version {have!r} cannot be read, so the required {want} is not checked",
                    "investigate",
                    component=label,
                    version=have,
                    required=want,
                )
            )
        elif order == -1:
            found.append(
                finding(
                    "driver_too_old",
                    "FAIL",
                    f"{label} version {have} is older than the required {want}",
                    "re_rent",
                    component=label,
                    version=have,
                    required=want,
                )
            )
    return found
