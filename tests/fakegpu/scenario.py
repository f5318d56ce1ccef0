"""Load, validate and resolve a simulated GPU box ("scenario", see shared/contracts/gpu-scenario.md).

Every part of the simulator goes through this module, so the NVML library, nvidia-smi and dmesg all agree
on one validated, defaults-filled view of the file.

    python tests/fakegpu/scenario.py check FILE     # exit 0 and a one-line summary, or exit 1 with the key path
"""

from __future__ import annotations

import copy
import hashlib
import sys
from typing import Any, Dict, List, Tuple

import yaml

NOT_SUPPORTED = "not_supported"
NOT_AVAILABLE = "not_available"  # a reading the driver cannot give (NVML_VALUE_NOT_AVAILABLE, nvidia-smi [N/A])


class ScenarioError(ValueError):
    """The scenario file is unreadable or breaks the schema; the message names the key path."""


class _Choice:
    """A value that is either the string ``not_supported`` or a mapping with ``schema``."""

    def __init__(self, schema: Dict[str, Any]) -> None:
        self.schema = schema


class _IntOrWord:
    """An int, or the one word that stands for a value the driver cannot give."""

    def __init__(self, word: str) -> None:
        self.word = word


class _ListOf:
    def __init__(self, item: Any) -> None:
        self.item = item


_COUNTERS = {"corrected": int, "uncorrected": int}

# The per-GPU schema. Leaves are Python types; int accepts no bool, float accepts int.
GPU_SCHEMA: Dict[str, Any] = {
    "name": str,
    "uuid": str,
    "pci_bus_id": str,
    "lost": bool,
    "temperature_c": int,
    "clocks_mhz": {"sm": int, "sm_max": int, "mem": int, "mem_max": int},
    "clocks_event_reasons": int,
    "power_w": {"draw": float, "limit": float, "default_limit": float},
    "memory_mib": {"total": int, "used": int},
    "utilization_pct": {"gpu": int, "memory": int},
    "persistence_mode": bool,
    "mig_mode": _Choice({"current": bool, "pending": bool}),  # not_supported: an extension for consumer cards
    "ecc": _Choice({"enabled": bool, "volatile": _COUNTERS, "aggregate": _COUNTERS}),
    "remapped_rows": _Choice({"corrected": int, "uncorrected": int, "pending": bool, "failure": bool}),
    "retired_pages": _Choice({"single_bit": int, "double_bit": int, "pending": bool}),
    "pcie": {"gen": int, "gen_max": int, "width": int, "width_max": int, "replay_counter": int},
    "nvlinks": _ListOf({"active": bool, "crc_errors": int, "replay_errors": int, "recovery_errors": int}),
    # `name` is an extension: what nvidia-smi prints as process_name (NVML has no name in the process list);
    # so is used_memory_mib `not_available` (Windows WDDM: NVML_VALUE_NOT_AVAILABLE, nvidia-smi "[N/A]").
    "processes": _ListOf({"pid": int, "used_memory_mib": _IntOrWord(NOT_AVAILABLE), "name": str}),
}

TIMELINE_SCHEMA = _ListOf({"after_s": float, "set": GPU_SCHEMA})

SCHEMA: Dict[str, Any] = {
    "driver": {"loaded": bool, "library": str, "version": str, "cuda_version": int},
    "kernel_log": {"readable": bool, "lines": _ListOf(str)},
    "gpus": _ListOf(dict(GPU_SCHEMA, timeline=TIMELINE_SCHEMA)),
    # Used by the fleet tool only; the simulator checks its shape and ignores its meaning.
    "box": {
        "hostname": str,
        "data_size_mib": int,
        "data_inodes": int,
        "durable_size_mib": int,
        "durable_inodes": int,
        "memory_limit_mib": int,
    },
}

DEFAULT_DRIVER: Dict[str, Any] = {"loaded": True, "library": "present", "version": "550.54.15", "cuda_version": 12040}
DEFAULT_KERNEL_LOG: Dict[str, Any] = {"readable": True, "lines": []}
DEFAULT_GPU: Dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3",
    "lost": False,
    "temperature_c": 34,
    "clocks_mhz": {"sm": 1980, "sm_max": 1980, "mem": 2619, "mem_max": 2619},
    "clocks_event_reasons": 0x1,
    "power_w": {"draw": 71.5, "limit": 700.0, "default_limit": 700.0},
    "memory_mib": {"total": 81559, "used": 0},
    "utilization_pct": {"gpu": 0, "memory": 0},
    "persistence_mode": True,
    "mig_mode": {"current": False, "pending": False},
    "ecc": {
        "enabled": True,
        "volatile": {"corrected": 0, "uncorrected": 0},
        "aggregate": {"corrected": 0, "uncorrected": 0},
    },
    "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
    "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": False},
    "pcie": {"gen": 5, "gen_max": 5, "width": 16, "width_max": 16, "replay_counter": 0},
    "nvlinks": [],
    "processes": [],
    "timeline": [],
}
DEFAULT_NVLINK: Dict[str, Any] = {"active": True, "crc_errors": 0, "replay_errors": 0, "recovery_errors": 0}
DEFAULT_PROCESS_NAME = "python"

# PCI device and subsystem ids of common models (public PCI ids), so both backends report the same ids.
PCI_IDS: Dict[str, Tuple[int, int]] = {
    "NVIDIA H100 80GB HBM3": (0x233010DE, 0x16C110DE),
    "NVIDIA H100 PCIe": (0x233110DE, 0x162610DE),
    "NVIDIA H200": (0x233510DE, 0x18BE10DE),
    "NVIDIA A100-SXM4-80GB": (0x20B210DE, 0x147F10DE),
    "NVIDIA A100-SXM4-40GB": (0x20B010DE, 0x134F10DE),
    "NVIDIA L40S": (0x26B910DE, 0x185110DE),
    "NVIDIA A10": (0x223610DE, 0x148210DE),
    "NVIDIA GeForce RTX 4090": (0x268410DE, 0x167010DE),
    "NVIDIA GeForce RTX 4080 SUPER": (0x270210DE, 0x51101462),
    "NVIDIA GeForce RTX 2080 SUPER": (0x1E8110DE, 0x40051458),
    "NVIDIA GeForce RTX 3090": (0x220410DE, 0x147D10DE),
}


def pci_ids(name: str) -> Tuple[int, int]:
    """(device id, subsystem id) for a model name; 0x0 for models not in the table."""
    return PCI_IDS.get(name, (0, 0))


_LIBRARY_VALUES = ("present", "absent")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_leaf(value: Any, expected: type, path: str) -> Any:
    if expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _fail(path, "float", value)
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    return value if ok else _fail(path, expected.__name__, value)


def _fail(path: str, expected: str, value: Any) -> Any:
    raise ScenarioError(f"{path}: expected {expected}, got {_type_name(value)}")


def _check(value: Any, schema: Any, path: str) -> Any:
    """Validate ``value`` against ``schema``; return a copy with floats normalised. All keys are optional."""
    if isinstance(schema, _Choice):
        if value == NOT_SUPPORTED:
            return value
        if not isinstance(value, dict):
            raise ScenarioError(f"{path}: expected mapping or '{NOT_SUPPORTED}', got {_type_name(value)}")
        return _check(value, schema.schema, path)
    if isinstance(schema, _IntOrWord):
        if value == schema.word:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ScenarioError(f"{path}: expected int or '{schema.word}', got {_type_name(value)}")
    if isinstance(schema, _ListOf):
        if not isinstance(value, list):
            _fail(path, "list", value)
        return [_check(item, schema.item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            _fail(path, "mapping", value)
        checked = {}
        for key, item in value.items():
            sub_path = f"{path}.{key}" if path else str(key)
            if key not in schema:
                raise ScenarioError(f"{sub_path}: unknown key (allowed: {', '.join(sorted(schema))})")
            checked[key] = _check(item, schema[key], sub_path)
        return checked
    return _check_leaf(value, schema, path)


def deep_merge(base: Any, override: Any) -> Any:
    """Mappings merge key by key; anything else (lists, scalars, 'not_supported') replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = copy.deepcopy(base)
        for key, value in override.items():
            merged[key] = deep_merge(merged.get(key), value)
        return merged
    return copy.deepcopy(override)


def default_uuid(index: int, hostname: str = "", pci_bus_id: str = "") -> str:
    """A stable UUID per (hostname, bus id, index), in NVIDIA's GPU-8-4-4-4-12 form."""
    digest = hashlib.sha1(f"{hostname}/{pci_bus_id}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def default_pci_bus_id(index: int) -> str:
    """Bus 0x18, 0x28, 0x38, ... (mod 0x100), like the spread-out buses of an 8-GPU server."""
    return f"00000000:{(0x18 + 0x10 * index) % 0x100:02X}:00.0"


def _complete_gpu(gpu: Dict[str, Any], index: int, hostname: str) -> Dict[str, Any]:
    full = deep_merge(DEFAULT_GPU, gpu)
    full.setdefault("pci_bus_id", default_pci_bus_id(index))
    full.setdefault("uuid", default_uuid(index, hostname, full["pci_bus_id"]))
    _normalise(full, f"gpus[{index}]")
    return full


def _normalise(gpu: Dict[str, Any], path: str) -> None:
    """Fill what a partial value left out: feature mappings, NVLink and process entries."""
    for key in ("mig_mode", "ecc", "remapped_rows", "retired_pages"):
        if isinstance(gpu[key], dict):
            gpu[key] = deep_merge(DEFAULT_GPU[key], gpu[key])
    gpu["nvlinks"] = [deep_merge(DEFAULT_NVLINK, link) for link in gpu["nvlinks"]]
    processes = []
    for number, proc in enumerate(gpu["processes"]):
        for key in ("pid", "used_memory_mib"):
            if key not in proc:
                raise ScenarioError(f"{path}.processes[{number}]: missing required key {key}")
        processes.append(dict({"name": DEFAULT_PROCESS_NAME}, **proc))
    gpu["processes"] = processes


def validate(data: Any) -> Dict[str, Any]:
    """Check a parsed scenario and return it complete: defaults applied, one entry per GPU."""
    if data is None:
        data = {}
    checked = _check(data, SCHEMA, "")
    driver = deep_merge(DEFAULT_DRIVER, checked.get("driver", {}))
    if driver["library"] not in _LIBRARY_VALUES:
        raise ScenarioError(f"driver.library: expected one of {', '.join(_LIBRARY_VALUES)}, got {driver['library']!r}")
    hostname = checked.get("box", {}).get("hostname", "")
    gpus = []
    for index, gpu in enumerate(checked.get("gpus", [{}])):
        full = _complete_gpu(gpu, index, hostname)
        previous = 0.0
        for step, entry in enumerate(full["timeline"]):
            path = f"gpus[{index}].timeline[{step}]"
            if "after_s" not in entry or "set" not in entry:
                raise ScenarioError(f"{path}: needs both after_s and set")
            if entry["after_s"] < previous:
                raise ScenarioError(f"{path}.after_s: entries must be in time order ({entry['after_s']} < {previous})")
            previous = entry["after_s"]
        timeline_states(full, f"gpus[{index}].timeline")
        gpus.append(full)
    result = {
        "driver": driver,
        "kernel_log": deep_merge(DEFAULT_KERNEL_LOG, checked.get("kernel_log", {})),
        "gpus": gpus,
    }
    if "box" in checked:
        result["box"] = checked["box"]
    return result


def load(path: str) -> Dict[str, Any]:
    """Read and validate a scenario file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from exc
    return validate(data)


def timeline_states(gpu: Dict[str, Any], path: str = "gpus[].timeline") -> List[Tuple[float, Dict[str, Any]]]:
    """The GPU's complete state after each timeline entry, as (after_s, state), in time order."""
    state = {key: value for key, value in gpu.items() if key != "timeline"}
    states = []
    for step, entry in enumerate(gpu["timeline"]):
        state = deep_merge(state, entry["set"])
        _normalise(state, f"{path}[{step}].set")
        states.append((entry["after_s"], state))
    return states


def gpu_at(gpu: Dict[str, Any], elapsed_s: float) -> Dict[str, Any]:
    """The GPU as it is ``elapsed_s`` seconds after the caller's first call."""
    current = {key: value for key, value in gpu.items() if key != "timeline"}
    for after_s, state in timeline_states(gpu):
        if after_s <= elapsed_s:
            current = state
    return current


def state_at(scenario: Dict[str, Any], elapsed_s: float) -> Dict[str, Any]:
    """The whole box at ``elapsed_s``: every GPU with its due timeline entries applied."""
    resolved = dict(scenario)
    resolved["gpus"] = [gpu_at(gpu, elapsed_s) for gpu in scenario["gpus"]]
    return resolved


def main(argv: List[str]) -> int:
    if len(argv) != 2 or argv[0] != "check":
        print("usage: scenario.py check FILE", file=sys.stderr)
        return 2
    try:
        scenario = load(argv[1])
    except ScenarioError as exc:
        print(f"invalid scenario: {exc}", file=sys.stderr)
        return 1
    names = sorted({gpu["name"] for gpu in scenario["gpus"]})
    print(f"ok: {argv[1]}: {len(scenario['gpus'])} GPU(s) {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
