"""``nvidia-smi -q`` and ``-q -d <SECTIONS>`` of the fake nvidia-smi.

Renders the sections the scenario models, in the real tool's order, with its labels and indentation. The
label column is 42 wide before driver 575 and 55 wide from then on, as the real tool's output changed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from _smi_fields import EVENT_REASONS, mig_on
from scenario import NOT_AVAILABLE, pci_ids

PROCESS_LABELS = ("GPU instance ID", "Compute instance ID", "Process ID", "Type", "Name", "Used GPU Memory")
Line = Tuple[int, str, Optional[str]]  # (indent level, label, value or None for a section title)

# -d names and the sections each one shows.
DISPLAY_SECTIONS: Dict[str, Tuple[str, ...]] = {
    "MEMORY": ("FB Memory Usage",),
    "UTILIZATION": ("Utilization",),
    "ECC": ("ECC Mode", "ECC Errors"),
    "TEMPERATURE": ("Temperature",),
    "POWER": ("GPU Power Readings", "Power Readings"),
    "CLOCK": ("Clocks", "Max Clocks"),
    "PERFORMANCE": ("Performance State", "Clocks Event Reasons", "Clocks Throttle Reasons"),
    "PAGE_RETIREMENT": ("Retired Pages",),
    "ROW_REMAPPER": ("Remapped Rows",),
    "PCIE": ("PCI",),
    "PIDS": ("Processes",),
    "COMPUTE": ("Compute Mode",),
}


def driver_major(version: str) -> int:
    try:
        return int(version.split(".", maxsplit=1)[0])
    except ValueError:
        return 0


def _na(feature: Any, pick: Callable[[Dict[str, Any]], Any]) -> str:
    return "N/A" if feature == "not_supported" else str(pick(feature))


def _enabled(flag: bool) -> str:
    return "Enabled" if flag else "Disabled"


def _yes_no(flag: bool) -> str:
    return "Yes" if flag else "No"


def _pci(gpu: Dict[str, Any]) -> List[Line]:
    domain, bus, rest = gpu["pci_bus_id"].split(":")
    device_id, subsystem_id = pci_ids(gpu["name"])
    pcie = gpu["pcie"]
    return [
        (1, "PCI", None),
        (2, "Bus", f"0x{int(bus, 16):02X}"),
        (2, "Device", f"0x{int(rest.split('.')[0], 16):02X}"),
        (2, "Domain", f"0x{int(domain, 16):04X}"),
        (2, "Device Id", f"0x{device_id:08X}" if device_id else "N/A"),
        (2, "Bus Id", gpu["pci_bus_id"]),
        (2, "Sub System Id", f"0x{subsystem_id:08X}" if subsystem_id else "N/A"),
        (2, "GPU Link Info", None),
        (3, "PCIe Generation", None),
        (4, "Max", str(pcie["gen_max"])),
        (4, "Current", str(pcie["gen"])),
        (4, "Device Current", str(pcie["gen"])),
        (4, "Device Max", str(pcie["gen_max"])),
        (4, "Host Max", "N/A"),
        (3, "Link Width", None),
        (4, "Max", f"{pcie['width_max']}x"),
        (4, "Current", f"{pcie['width']}x"),
        (2, "Replays Since Reset", str(pcie["replay_counter"])),
    ]


def _reasons(gpu: Dict[str, Any], major: int) -> List[Line]:
    title = "Clocks Event Reasons" if major >= 530 else "Clocks Throttle Reasons"
    lines: List[Line] = [(1, title, None)]
    for bit, _suffix, label in EVENT_REASONS:
        level = 3 if bit in (0x40, 0x80) else 2  # thermal and power brake are kinds of HW Slowdown
        lines.append((level, label, "Active" if gpu["clocks_event_reasons"] & bit else "Not Active"))
    return lines


def driver_tuple(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def splits_sram_errors(name: str, driver_version: str) -> bool:
    """Drivers from 535.161 count uncorrectable SRAM errors as parity / SEC-DED, except on pre-Ampere GPUs."""
    older_family = any(tag in name for tag in ("RTX 20", "TITAN V", "TITAN RTX", "V100", "Tesla T4", "Quadro RTX"))
    return driver_tuple(driver_version) >= (535, 161) and not older_family


VOLTA_TAGS = ("TITAN V", "V100")
VOLTA_LOCATIONS = ("Device Memory", "Register File", "L1 Cache", "L2 Cache", "Texture Memory", "Texture Shared", "CBU")


def _volta_ecc_errors(ecc: Any) -> List[Line]:
    """Volta reports single / double bit errors per memory location."""
    lines: List[Line] = [(1, "ECC Errors", None)]
    for counter, title in (("volatile", "Volatile"), ("aggregate", "Aggregate")):
        lines.append((2, title, None))
        for kind, bits in (("corrected", "Single Bit"), ("uncorrected", "Double Bit")):
            count = _na(ecc, lambda e, c=counter, k=kind: e[c][k])
            lines.append((3, bits, None))
            lines += [
                (4, where, count if where == "Device Memory" else _na(ecc, lambda _: 0)) for where in VOLTA_LOCATIONS
            ]
            lines.append((4, "Total", count))
    return lines


def _ecc_errors(ecc: Any, split_sram: bool) -> List[Line]:
    lines: List[Line] = [(1, "ECC Errors", None)]
    for counter, title in (("volatile", "Volatile"), ("aggregate", "Aggregate")):
        lines.append((2, title, None))
        zero = _na(ecc, lambda _: 0)
        sram = [("SRAM Correctable", zero)]
        if split_sram:
            sram += [("SRAM Uncorrectable Parity", zero), ("SRAM Uncorrectable SEC-DED", zero)]
        else:
            sram.append(("SRAM Uncorrectable", zero))
        dram = [
            ("DRAM Correctable", _na(ecc, lambda e, c=counter: e[c]["corrected"])),
            ("DRAM Uncorrectable", _na(ecc, lambda e, c=counter: e[c]["uncorrected"])),
        ]
        lines += [(3, label, text) for label, text in sram + dram]
    return lines


def _power(gpu: Dict[str, Any], major: int) -> List[Line]:
    power = gpu["power_w"]
    draw, limit, default = (f"{power[key]:.2f} W" for key in ("draw", "limit", "default_limit"))
    if major < 530:
        return [
            (1, "Power Readings", None),
            (2, "Power Management", "Supported"),
            (2, "Power Draw", draw),
            (2, "Power Limit", limit),
            (2, "Default Power Limit", default),
            (2, "Enforced Power Limit", limit),
        ]
    readings = (
        [("Average Power Draw", draw), ("Instantaneous Power Draw", draw)] if major >= 575 else [("Power Draw", draw)]
    )
    limits = [("Current Power Limit", limit), ("Requested Power Limit", limit), ("Default Power Limit", default)]
    lines: List[Line] = [(1, "GPU Power Readings", None)] + [(2, label, text) for label, text in readings]
    if major >= 610:  # the limits moved under a "ceiling" title
        return lines + [(2, "GPU Ceiling Power Limit", None)] + [(3, label, text) for label, text in limits]
    return lines + [(2, label, text) for label, text in limits]


def _processes(gpu: Dict[str, Any]) -> List[Line]:
    if not gpu["processes"]:
        return [(1, "Processes", "None")]
    lines: List[Line] = [(1, "Processes", None)]
    for proc in gpu["processes"]:
        lines += [
            (2, "GPU instance ID", "N/A"),
            (2, "Compute instance ID", "N/A"),
            (2, "Process ID", str(proc["pid"])),
            (3, "Type", "C"),
            (3, "Name", proc["name"]),
            (
                3,
                "Used GPU Memory",
                "N/A" if proc["used_memory_mib"] == NOT_AVAILABLE else f"{proc['used_memory_mib']} MiB",
            ),
        ]
    return lines


def gpu_lines(gpu: Dict[str, Any], index: int, driver_version: str) -> List[Line]:
    """Every section the fake renders for one GPU, in the real tool's order."""
    major = driver_major(driver_version)
    clocks, memory, mig = gpu["clocks_mhz"], gpu["memory_mib"], gpu["mig_mode"]
    lines: List[Line] = [
        (1, "Product Name", gpu["name"]),
        (1, "Persistence Mode", _enabled(gpu["persistence_mode"])),
        (1, "MIG Mode", None),
        (2, "Current", _na(mig, lambda m: _enabled(m["current"]))),
        (2, "Pending", _na(mig, lambda m: _enabled(m["pending"]))),
        (1, "GPU UUID", gpu["uuid"]),
        (1, "Minor Number", str(index)),
    ]
    lines += _pci(gpu)
    lines += [(1, "Fan Speed", "N/A"), (1, "Performance State", "P0")]
    lines += _reasons(gpu, major)
    lines += [
        (1, "FB Memory Usage", None),
        (2, "Total", f"{memory['total']} MiB"),
        (2, "Reserved", "0 MiB"),
        (2, "Used", f"{memory['used']} MiB"),
        (2, "Free", f"{max(0, memory['total'] - memory['used'])} MiB"),
        (1, "Compute Mode", "Default"),
        (1, "Utilization", None),
        (2, "GPU" if major >= 575 else "Gpu", "N/A" if mig_on(gpu) else f"{gpu['utilization_pct']['gpu']} %"),
        (2, "Memory", "N/A" if mig_on(gpu) else f"{gpu['utilization_pct']['memory']} %"),
        (1, "ECC Mode", None),
        (2, "Current", _na(gpu["ecc"], lambda e: _enabled(e["enabled"]))),
        (2, "Pending", _na(gpu["ecc"], lambda e: _enabled(e["enabled"]))),
    ]
    if any(tag in gpu["name"] for tag in VOLTA_TAGS):
        lines += _volta_ecc_errors(gpu["ecc"])
    else:
        lines += _ecc_errors(gpu["ecc"], splits_sram_errors(gpu["name"], driver_version))
    pages, rows = gpu["retired_pages"], gpu["remapped_rows"]
    lines += [
        (1, "Retired Pages", None),
        (2, "Single Bit ECC", _na(pages, lambda p: p["single_bit"])),
        (2, "Double Bit ECC", _na(pages, lambda p: p["double_bit"])),
        (2, "Pending Page Blacklist", _na(pages, lambda p: _yes_no(p["pending"]))),
    ]
    if rows == "not_supported":
        lines.append((1, "Remapped Rows", "N/A"))
    else:
        lines += [
            (1, "Remapped Rows", None),
            (2, "Correctable Error", str(rows["corrected"])),
            (2, "Uncorrectable Error", str(rows["uncorrected"])),
            (2, "Pending", _yes_no(rows["pending"])),
            (2, "Remapping Failure Occurred", _yes_no(rows["failure"])),
        ]
    lines += [(1, "Temperature", None), (2, "GPU Current Temp", f"{gpu['temperature_c']} C")]
    lines += _power(gpu, major)
    for title, cur, mem in (("Clocks", "sm", "mem"), ("Max Clocks", "sm_max", "mem_max")):
        lines += [
            (1, title, None),
            (2, "Graphics", f"{clocks[cur]} MHz"),
            (2, "SM", f"{clocks[cur]} MHz"),
            (2, "Memory", f"{clocks[mem]} MHz"),
            (2, "Video", "N/A"),
        ]
    lines += _processes(gpu)
    return lines


def select(lines: List[Line], displays: Optional[List[str]]) -> List[Line]:
    """Keep only the sections the -d list names (all when None)."""
    if displays is None:
        return lines
    wanted = {title for name in displays for title in DISPLAY_SECTIONS[name]}
    kept, keep = [], False
    for line in lines:
        if line[0] == 1:
            keep = line[1] in wanted
        if keep:
            kept.append(line)
    return kept


def render(lines: List[Line], width: int) -> List[str]:
    text = []
    for level, label, value in lines:
        key = "    " * level + label
        column = 42 if level >= 2 and label in PROCESS_LABELS else width  # process entries keep the old width
        text.append(key if value is None else f"{key:<{column}}: {value}")
    return text


def header(driver_version: str, cuda_version: int, gpu_count: int, timestamp: str) -> List[str]:
    major = driver_major(driver_version)
    width = 55 if major >= 575 else 42
    cuda = f"{cuda_version // 1000}.{cuda_version % 1000 // 10}"
    versions = [("Driver Version", driver_version), ("CUDA Version", cuda)]
    if major >= 610:  # the renamed versions, with the old names kept and marked deprecated
        versions = [
            ("Driver Version", f"{driver_version} [Deprecated; will be removed in CUDA 14.0. Use KMD Version instead]"),
            ("CUDA Version", f"{cuda} [Deprecated; will be removed in CUDA 14.0. Use CUDA UMD Version instead]"),
            ("KMD Version", driver_version),
            ("CUDA UMD Version", cuda),
        ]
    return [
        "",
        "==============NVSMI LOG==============",
        "",
        f"{'Timestamp':<{width}}: {timestamp}",
        *(f"{label:<{width}}: {value}" for label, value in versions),
        "",
        f"{'Attached GPUs':<{width}}: {gpu_count}",
    ]
