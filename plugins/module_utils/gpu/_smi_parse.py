# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Parsers for nvidia-smi's outputs: CSV queries, compute apps, ``nvlink -s`` and ``-q``.

Pure (text in, data model out) and tested against real captured outputs of drivers 535 to 610.
Placeholders such as ``[N/A]``, ``[Not Supported]``, ``[Unknown Error]`` and ``Requested functionality
has been deprecated`` read as "no value"; ``[GPU is lost]`` marks the GPU lost.
"""

from __future__ import annotations

import csv
import re
from typing import Any, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import (
    NOT_SUPPORTED,
    normalize_bus_id,
    reason_mask,
)

LOST = "__gpu_is_lost__"

# One query per sample: identity (to map rows to GPUs) plus the readings judged over the window.
SAMPLE_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "uuid",
    "temperature.gpu",
    "clocks.sm",
    "clocks.max.sm",
    "power.draw",
    "enforced.power.limit",
    "memory.used",
    "memory.total",
    "clocks_event_reasons.active",
)
# Drivers before 535 only know the old name of the reasons field.
OLD_FIELD_NAMES = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}
APPS_FIELDS = ("gpu_bus_id", "pid", "used_memory")

_PLACEHOLDER = re.compile(
    r"^\[?(n/a|not supported|unknown error|function not found|insufficient permissions|"
    r"requested functionality has been deprecated|err!|not available)\]?$",
    re.IGNORECASE,
)
_LOST_TEXT = re.compile(r"gpu is lost", re.IGNORECASE)
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)")
_HEX = re.compile(r"^\s*0x([0-9a-fA-F]+)")
_KEY_VALUE = re.compile(r"^(\S.*?)\s*:\s(.*)$|^(\S.*?)\s*:$")
_NO_HANDLE = re.compile(r"Unable to determine the device handle for (?:GPU\s*)?([0-9A-Fa-f:.]+)")

# -q's "Clocks Event Reasons" (535+) / "Clocks Throttle Reasons" (older) entries.
_Q_REASONS = {
    "idle": "gpu_idle",
    "applications clocks setting": "applications_clocks_setting",
    "sw power cap": "sw_power_cap",
    "hw slowdown": "hw_slowdown",
    "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "display clock setting": "display_clock_setting",
}


# --------------------------------------------------------------------------- value helpers


def clean(raw: Optional[str]) -> Optional[str]:
    """A field's text, or None for placeholders; ``LOST`` for ``[GPU is lost]``."""
    if raw is None:
        return None
    text = raw.strip()
    if not text or _PLACEHOLDER.match(text):
        return None
    if _LOST_TEXT.search(text):
        return LOST
    return text


def number(raw: Optional[str]) -> Optional[float]:
    text = clean(raw)
    match = _NUMBER.match(text) if text and text != LOST else None
    return float(match.group(1)) if match else None


def integer(raw: Optional[str]) -> Optional[int]:
    value = number(raw)
    return int(value) if value is not None else None


def hex_mask(raw: Optional[str]) -> Optional[int]:
    text = clean(raw)
    match = _HEX.match(text) if text and text != LOST else None
    return int(match.group(1), 16) if match else None


def flag(raw: Optional[str]) -> Optional[bool]:
    """Enabled/Yes/Active -> True, Disabled/No/Not Active -> False, else None."""
    text = (clean(raw) or "").lower()
    if text in ("enabled", "yes", "active", "on", "pending"):
        return True
    if text in ("disabled", "no", "not active", "off", "none"):
        return False
    return None


# --------------------------------------------------------------------------- CSV queries


def parse_query_csv(text: str, fields: Optional[Tuple[str, ...]] = None) -> List[Dict[str, Optional[str]]]:
    """Rows of ``--query-*=... --format=csv[,noheader][,nounits]`` as dicts keyed by field name.

    Without ``fields`` the first line is the header (units in brackets are dropped from the keys).
    Values keep their text (units included when the tool printed them); lines that are not rows
    of the expected width (error lines, "No devices were found") are skipped.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if fields is None:
        if not lines:
            return []
        header = next(csv.reader([lines[0]], skipinitialspace=True))
        fields = tuple(re.sub(r"\s*\[[^\]]*\]$", "", key.strip()) for key in header)
        lines = lines[1:]
    rows = []
    for values in csv.reader(lines, skipinitialspace=True):
        if len(values) == len(fields):
            rows.append(dict(zip(fields, (v.strip() for v in values))))
    return rows


def lost_bus_ids(text: str) -> List[str]:
    """Bus ids of GPUs nvidia-smi could not get a handle for (a lost GPU)."""
    found = []
    for match in _NO_HANDLE.finditer(text):
        bus_id = normalize_bus_id(match.group(1))
        if bus_id and bus_id not in found:
            found.append(bus_id)
    return found


def sample_from_row(row: Dict[str, Optional[str]]) -> Dict[str, Any]:
    """One window sample from a ``SAMPLE_FIELDS`` row."""
    reasons = row.get("clocks_event_reasons.active", row.get("clocks_throttle_reasons.active"))
    return {
        "temperature_c": integer(row.get("temperature.gpu")),
        "sm_clock_mhz": integer(row.get("clocks.sm", row.get("clocks.current.sm"))),
        "power_draw_w": number(row.get("power.draw")),
        "memory_used_mib": integer(row.get("memory.used")),
        "reasons": hex_mask(reasons),
    }


def row_is_lost(row: Dict[str, Optional[str]]) -> bool:
    return any(clean(value) == LOST for value in row.values())


def parse_compute_apps(text: str, fields: Tuple[str, ...] = APPS_FIELDS) -> Dict[str, List[Dict[str, Any]]]:
    """``--query-compute-apps`` rows grouped by normalized GPU bus id."""
    by_bus: Dict[str, List[Dict[str, Any]]] = {}
    for row in parse_query_csv(text, fields):
        bus_id, pid = normalize_bus_id(row.get("gpu_bus_id")), integer(row.get("pid"))
        if bus_id is None or pid is None:
            continue
        memory = row.get("used_memory", row.get("used_gpu_memory"))
        by_bus.setdefault(bus_id, []).append({"pid": pid, "used_memory_mib": integer(memory)})
    return by_bus


def parse_nvlink_status(text: str) -> Dict[int, List[Dict[str, Any]]]:
    """``nvidia-smi nvlink -s``: per GPU index, each reported link and whether it is active."""
    links: Dict[int, List[Dict[str, Any]]] = {}
    current: Optional[int] = None
    for line in text.splitlines():
        gpu = re.match(r"^GPU\s+(\d+):", line)
        if gpu:
            current = int(gpu.group(1))
            links.setdefault(current, [])
            continue
        link = re.match(r"^\s+Link\s+(\d+):\s*(.*)$", line)
        if link and current is not None:
            state = link.group(2).strip().lower()
            links[current].append({"link": int(link.group(1)), "active": "inactive" not in state})
    return links


# --------------------------------------------------------------------------- nvidia-smi -q


def _tree(text: str) -> Dict[str, Any]:
    """-q output as nested nodes ``{key, value, children}``, by indentation."""
    root: Dict[str, Any] = {"key": "", "value": None, "children": []}
    stack: List[Tuple[int, Dict[str, Any]]] = [(-1, root)]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("="):
            continue
        indent = len(line) - len(line.lstrip(" "))
        match = _KEY_VALUE.match(line.strip())
        if match:
            key = (match.group(1) or match.group(3)).strip()
            value = match.group(2).strip() if match.group(2) is not None else ""
        else:
            key, value = line.strip(), None
        while stack[-1][0] >= indent:
            stack.pop()
        node = {"key": key, "value": value, "children": []}
        stack[-1][1]["children"].append(node)
        stack.append((indent, node))
    return root


def _child(node: Optional[Dict[str, Any]], *names: str) -> Optional[Dict[str, Any]]:
    """First direct child whose key is one of ``names`` (case-insensitive)."""
    if node is None:
        return None
    wanted = [name.lower() for name in names]
    for child in node["children"]:
        if child["key"].lower() in wanted:
            return child
    return None


def _find(node: Optional[Dict[str, Any]], *names: str) -> Optional[Dict[str, Any]]:
    """First descendant (depth first) whose key is one of ``names``."""
    if node is None:
        return None
    direct = _child(node, *names)
    if direct is not None:
        return direct
    for child in node["children"]:
        found = _find(child, *names)
        if found is not None:
            return found
    return None


def _value(node: Optional[Dict[str, Any]], *path: str) -> Optional[str]:
    for name in path:
        node = _child(node, name)
    return node["value"] if node is not None else None


def _first_number(section: Optional[Dict[str, Any]], *names: str) -> Optional[float]:
    """The first of ``names`` (in preference order) found under ``section`` with a numeric value."""
    for name in names:
        node = _find(section, name)
        value = number(node["value"]) if node is not None else None
        if value is not None:
            return value
    return None


def _q_reasons(gpu: Dict[str, Any]) -> Optional[int]:
    section = _child(gpu, "Clocks Event Reasons", "Clocks Throttle Reasons", "Clocks Throttle Reasons (Active)")
    if section is None:
        return None
    active = []

    def walk(node: Dict[str, Any]) -> None:
        for child in node["children"]:
            name = _Q_REASONS.get(child["key"].lower())
            if name and flag(child["value"]):
                active.append(name)
            walk(child)

    walk(section)
    return reason_mask(active)


def _q_ecc(gpu: Dict[str, Any]) -> Any:
    enabled = flag(_value(gpu, "ECC Mode", "Current"))
    if enabled is None:
        return NOT_SUPPORTED
    errors = _child(gpu, "ECC Errors")
    result: Dict[str, Any] = {"enabled": enabled}
    for scope in ("volatile", "aggregate"):
        section = _child(errors, scope.capitalize())
        uncorrected = corrected = None
        double_bit = _child(section, "Double Bit")
        if double_bit is not None:  # pre-535 layout: Single Bit / Double Bit with a Total each
            uncorrected = integer(_value(double_bit, "Total"))
            corrected = integer(_value(_child(section, "Single Bit"), "Total"))
        elif section is not None:
            for child in section["children"]:
                key, count = child["key"].lower(), integer(child["value"])
                if count is None:
                    continue
                if "uncorrectable" in key:
                    uncorrected = (uncorrected or 0) + count
                elif "correctable" in key:
                    corrected = (corrected or 0) + count
        result[f"{scope}_uncorrected"] = uncorrected
        result[f"{scope}_corrected"] = corrected
    return result


def _q_remapped_rows(gpu: Dict[str, Any]) -> Any:
    section = _child(gpu, "Remapped Rows")
    if section is None or not section["children"]:
        return NOT_SUPPORTED
    pending = flag(_value(section, "Pending"))
    failure = flag(_value(section, "Remapping Failure Occurred"))
    if pending is None and failure is None:
        return NOT_SUPPORTED
    return {
        "correctable": integer(_value(section, "Correctable Error")),
        "uncorrectable": integer(_value(section, "Uncorrectable Error")),
        "pending": pending,
        "failure": failure,
    }


def _q_retired_pages(gpu: Dict[str, Any]) -> Any:
    section = _child(gpu, "Retired Pages")
    if section is None:
        return NOT_SUPPORTED
    pending = None
    for child in section["children"]:
        if child["key"].lower().startswith("pending"):
            pending = flag(child["value"])
    single = integer(_value(section, "Single Bit ECC"))
    double = integer(_value(section, "Double Bit ECC"))
    if pending is None and single is None and double is None:
        return NOT_SUPPORTED
    return {"single_bit": single, "double_bit": double, "pending": pending}


def _q_processes(gpu: Dict[str, Any]) -> List[Dict[str, Any]]:
    processes = []
    for node in (_child(gpu, "Processes") or {"children": []})["children"]:
        if node["key"].lower() == "process id" and integer(node["value"]) is not None:
            if (_value(node, "Type") or "C").strip().upper().startswith("G"):
                continue  # graphics-only clients; NVML's compute list leaves them out too
            processes.append(
                {"pid": integer(node["value"]), "used_memory_mib": integer(_value(node, "Used GPU Memory"))}
            )
    return processes


def _q_gpu(node: Dict[str, Any]) -> Dict[str, Any]:
    power = _child(node, "GPU Power Readings", "Power Readings")
    clocks, max_clocks = _child(node, "Clocks"), _child(node, "Max Clocks")
    link = _child(_child(node, "PCI"), "GPU Link Info")
    pcie_gen, pcie_width = _child(link, "PCIe Generation"), _child(link, "Link Width")
    draw = _first_number(power, "Power Draw", "Average Power Draw", "Instantaneous Power Draw")
    limit = _first_number(power, "Current Power Limit", "Enforced Power Limit")
    name = clean(_value(node, "Product Name"))
    sample = {
        "temperature_c": integer(_value(node, "Temperature", "GPU Current Temp")),
        "sm_clock_mhz": integer(_value(clocks, "SM")),
        "power_draw_w": draw,
        "memory_used_mib": integer(_value(node, "FB Memory Usage", "Used")),
        "reasons": _q_reasons(node),
    }
    return {
        "pci_bus_id": normalize_bus_id(node["key"]),
        "name": name if name != LOST else None,
        "uuid": clean(_value(node, "GPU UUID")),
        "lost": LOST in (name, clean(_value(node, "GPU UUID"))),
        "sm_clock_max_mhz": integer(_value(max_clocks, "SM")),
        "memory_total_mib": integer(_value(node, "FB Memory Usage", "Total")),
        "power_limit_w": limit,
        "power_default_limit_w": _first_number(power, "Default Power Limit"),
        "persistence_mode": flag(_value(node, "Persistence Mode")),
        "mig_mode": {
            "current": flag(_value(node, "MIG Mode", "Current")),
            "pending": flag(_value(node, "MIG Mode", "Pending")),
        },
        "pcie": {
            "gen": integer(_value(pcie_gen, "Current")),
            "gen_max": integer(_value(pcie_gen, "Max")),
            "width": integer(_value(pcie_width, "Current")),
            "width_max": integer(_value(pcie_width, "Max")),
            "replay_counter": integer(_value(_child(node, "PCI"), "Replays Since Reset")),
        },
        "ecc": _q_ecc(node),
        "remapped_rows": _q_remapped_rows(node),
        "retired_pages": _q_retired_pages(node),
        "processes": _q_processes(node),
        "samples": [sample],
    }


def parse_q(text: str) -> Dict[str, Any]:
    """``nvidia-smi -q`` (full or ``-d`` subsets): driver/CUDA versions and one dict per GPU section."""
    root = _tree(text)
    driver = clean(_value(root, "KMD Version")) or clean(_value(root, "Driver Version"))
    cuda = clean(_value(root, "CUDA UMD Version")) or clean(_value(root, "CUDA Version"))
    gpus = [_q_gpu(node) for node in root["children"] if re.match(r"^GPU [0-9A-Fa-f]+:", node["key"])]
    for bus_id in lost_bus_ids(text):
        if bus_id not in [gpu["pci_bus_id"] for gpu in gpus]:
            gpus.append({"pci_bus_id": bus_id, "lost": True})
    return {
        "driver_version": driver.split()[0] if driver else None,
        "cuda_version": cuda.split()[0] if cuda else None,
        "attached_gpus": integer(_value(root, "Attached GPUs")),
        "gpus": gpus,
    }
