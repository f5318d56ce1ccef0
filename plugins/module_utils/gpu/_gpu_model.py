# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU data model that the readers (NVML, nvidia-smi, kernel log) fill and the verdicts judge.

gpu_health's model is one dict per GPU (described in ``_gpu_checks``); vram_zombies' is the ``Gpu``
dataclass. Both count memory in MiB, say ``NOT_SUPPORTED`` for a feature the GPU lacks, and name
clock event reasons by name, never by bit.

PCI bus ids: NVML and nvidia-smi write ``00000000:3B:00.0``, the kernel log ``0000:3b:00`` or
``PCI:0000:3b:00``, nvidia-smi's error lines ``GPU0000:3B:00.0``. A GPU is one (domain, bus, device):
the function is always 0 and hex case means nothing, so every comparison goes through ``bus_key``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

MIB = 1024 * 1024
NOT_SUPPORTED = "not_supported"

# NVML clocks event reason bits (nvmlClocksEventReason*), in nvidia-smi's order.
REASON_BITS: Tuple[Tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


@dataclass(frozen=True)
class Gpu:
    """NVML's view of one GPU; ``utilization_pct`` holds the samples taken over the observation window."""

    index: int
    minor: Optional[int]
    memory_used_mib: Optional[int]
    memory_total_mib: Optional[int]
    utilization_pct: Tuple[int, ...] = ()
    processes: Tuple[Dict[str, Any], ...] = ()


def reason_names(mask: Optional[int]) -> List[str]:
    """Snake_case names of the bits set in an NVML clocks event reasons mask."""
    if not mask:
        return []
    return [name for bit, name in REASON_BITS if mask & bit]


def reason_mask(names: List[str]) -> int:
    bits = {name: bit for bit, name in REASON_BITS}
    mask = 0
    for name in names:
        mask |= bits.get(name, 0)
    return mask


def cuda_version_text(value: Optional[int]) -> Optional[str]:
    """NVML's CUDA driver version integer (12040) as nvidia-smi prints it (``12.4``)."""
    if not value:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


# --------------------------------------------------------------------------- PCI bus ids

BusKey = Tuple[Optional[int], int, int]  # (domain or None when the text gave none, bus, device)

# Not preceded by a hex digit, so "GPU0000:18:00.0" and "PCI:0000:18:00" read the same as "0000:18:00".
_BUS_ID = re.compile(
    r"(?<![0-9A-Fa-f])(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?(?![0-9A-Fa-f:])"
)


def bus_key(text: Optional[str]) -> Optional[BusKey]:
    """(domain, bus, device) of the first bus id in ``text``; None when there is none."""
    match = _BUS_ID.search(text) if text else None
    if match is None:
        return None
    domain, bus, device = match.groups()
    return (int(domain, 16) if domain is not None else None, int(bus, 16), int(device, 16))


def normalize_bus_id(text: Optional[str]) -> Optional[str]:
    """NVML's spelling, ``00000000:3B:00.0``; None without a domain (the data model always has one)."""
    key = bus_key(text)
    if key is None or key[0] is None:
        return None
    return f"{key[0]:08X}:{key[1]:02X}:{key[2]:02X}.0"


def kernel_pci(text: Optional[str]) -> Optional[str]:
    """The kernel log's spelling, ``0000:3b:00`` (``3b:00`` without a domain): Xid findings' ``pci``."""
    key = bus_key(text)
    if key is None:
        return None
    short = f"{key[1]:02x}:{key[2]:02x}"
    return short if key[0] is None else f"{key[0]:04x}:{short}"


def same_gpu(left: Optional[str], right: Optional[str]) -> bool:
    """Whether two bus ids name one GPU; an address without a domain matches any domain."""
    a, b = bus_key(left), bus_key(right)
    if a is None or b is None:
        return False
    return a[1:] == b[1:] and (a[0] is None or b[0] is None or a[0] == b[0])
