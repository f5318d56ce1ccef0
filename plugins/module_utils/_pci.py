# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""PCI bus ids, read in one place whichever tool wrote them.

NVML and nvidia-smi write ``00000000:3B:00.0``, the kernel log ``0000:3b:00`` or ``PCI:0000:3b:00``,
nvidia-smi's error lines ``GPU0000:3B:00.0``. A GPU is one (domain, bus, device): the function is
always 0 and hex case means nothing, so every comparison goes through ``bus_key``.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

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
