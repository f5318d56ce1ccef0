# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The Xid findings of ``gpu_health``, from the events ``_xid.parse_kernel_log`` found.

Each event is attributed by PCI address to one of this box's GPUs. A container on a shared host can
often read the host's kernel log, so an event may be another tenant's GPU: when the box knows every
one of its GPUs' addresses (``complete``), an address outside them is ``xid_other_gpu`` (WARN,
investigate: the host has a failing GPU), never a reason to re-rent this box. Another GPU's
application-class or unknown Xids add nothing (another tenant's job fault says nothing about the
host). Without a complete list an unmapped address may be this box's, so it keeps its catalog level.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Iterable, List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import same_gpu
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid import (
    XID_FALLEN_OFF_BUS,
    pick,
    summarize_events,
    xid_info,
)


def pci_to_gpu_index(pci: Optional[str], gpu_bus_ids: Dict[int, str]) -> Optional[int]:
    """The index of the GPU at ``pci`` among ``{index: bus id}``; an address without a domain must be unique."""
    matches = [index for index, bus_id in gpu_bus_ids.items() if same_gpu(pci, bus_id)]
    return matches[0] if len(matches) == 1 else None


def _resolve(timestamp: Optional[datetime], uptime: Optional[float], boot_time: Optional[datetime]) -> Any:
    if timestamp is not None:
        return timestamp
    if uptime is not None and boot_time is not None:
        return boot_time + timedelta(seconds=uptime)
    return None


def _iso(moment: Optional[datetime]) -> Optional[str]:
    return moment.astimezone(timezone.utc).isoformat(timespec="seconds") if moment is not None else None


def _where(group: Dict[str, Any]) -> str:
    if group["gpu"] is not None:
        return f"GPU {group['gpu']} ({group['pci']})"
    if group["other"]:
        return f"GPU at {group['pci']} (not one of this box's GPUs)"
    return f"GPU at {group['pci']} (not matched to this box's GPUs)" if group["pci"] else "an unidentified GPU"


def _when(group: Dict[str, Any]) -> str:
    first, last = _iso(group["first_timestamp"]), _iso(group["last_timestamp"])
    if first is not None:
        return f"at {first}" if first == last else f"from {first} to {last}"
    if group["first_uptime_s"] is not None:
        return f"at {group['first_uptime_s']:.0f} s after boot"
    return "at an unknown time"


def _resolved_events(
    events: Iterable[Dict[str, Any]], since: Optional[datetime], boot_time: Optional[datetime]
) -> List[Dict[str, Any]]:
    kept = []
    for event in events:
        first = _resolve(event["timestamp"], event["uptime_s"], boot_time)
        folded = "last_timestamp" in event or "last_uptime_s" in event
        last = _resolve(event.get("last_timestamp"), event.get("last_uptime_s"), boot_time) if folded else first
        # No time at all: keep it, a fault that cannot be dated cannot be ruled out as recent.
        if since is not None and last is not None and last < since:
            continue
        kept.append(dict(event, timestamp=first, last_timestamp=last))
    return kept


def xid_findings(
    events: Iterable[Dict[str, Any]],
    gpu_bus_ids: Dict[int, str],
    since: Optional[datetime] = None,
    boot_time: Optional[datetime] = None,
    complete: bool = False,
) -> List[Dict[str, Any]]:
    """Findings for parsed kernel-log events: xid_hardware, xid_application, xid_unknown, gpu_lost, xid_other_gpu.

    One finding per (GPU or PCI address, Xid code); a GPU that fell off the bus gets one ``gpu_lost``
    whether the log shows an Xid 79, the NVRM "fallen off the bus" block, or both. Events older than
    ``since`` are ignored; uptime-only events are dated with ``boot_time`` when given; events with no
    time at all are kept. A folded group (see ``parse_kernel_log``) counts in full when its newest event
    is recent. ``gpu`` is the index from ``gpu_bus_ids`` ({index: PCI bus id}) or None when unmapped;
    ``complete`` says ``gpu_bus_ids`` names every GPU of this box (see the module docstring).
    """
    lost: Dict[Optional[str], Dict[str, Any]] = {}
    other_lost: Dict[Optional[str], Dict[str, Any]] = {}
    findings = []
    for group in summarize_events(_resolved_events(events, since, boot_time)):
        pci = group["pci"]
        group["gpu"] = pci_to_gpu_index(pci, gpu_bus_ids) if pci else None
        group["other"] = complete and pci is not None and group["gpu"] is None
        if group["event"] == "fallen_off_bus" or group["code"] == XID_FALLEN_OFF_BUS:
            _merge_lost(other_lost if group["other"] else lost, dict(group))
        if group["event"] == "fallen_off_bus":
            continue
        info = xid_info(group["code"])
        if info["level"] is None:
            continue
        if group["other"]:
            # Its loss is reported once, below; another tenant's job faults are not this host's fault.
            if info["level"] == "FAIL" and group["code"] != XID_FALLEN_OFF_BUS:
                findings.append(_other_gpu_finding(group, f"Xid {info['code']} ({info['name']})", info["kind"]))
            continue
        code = "xid_hardware" if info["level"] == "FAIL" else "xid_application"
        if not info["known"]:
            code = "xid_unknown"
        message = (
            f"{_where(group)}: Xid {info['code']} ({info['name']}, {info['kind']}) seen "
            f"{group['count']}x {_when(group)}: {group['first_line'][:160]}"
        )
        findings.append(_finding(code, info["level"], message, info["action"], group, kind=info["kind"]))
    for group in lost.values():
        message = f"{_where(group)} has fallen off the bus, seen {group['count']}x {_when(group)}: "
        message += group["first_line"][:160]
        findings.append(_finding("gpu_lost", "FAIL", message, "re_rent", group, kind="hardware"))
    for group in other_lost.values():
        findings.append(_other_gpu_finding(group, "it fell off the bus", "hardware"))
    findings.sort(key=lambda f: (f["level"] != "FAIL", f["gpu"] is None, f["gpu"] or 0, f["xid"] or 0))
    return findings


def _other_gpu_finding(group: Dict[str, Any], what: str, kind: str) -> Dict[str, Any]:
    message = (
        f"{_where(group)}: {what}, seen {group['count']}x {_when(group)}: the host has a failing GPU that is "
        f"not this box's (if this box should have more GPUs than it lists, set expected_gpu_count): "
        f"{group['first_line'][:160]}"
    )
    return _finding("xid_other_gpu", "WARN", message, "investigate", group, kind=kind)


def _merge_lost(lost: Dict[Optional[str], Dict[str, Any]], group: Dict[str, Any]) -> None:
    """One gpu_lost per PCI address, whether the log said Xid 79, the NVRM block, or both."""
    merged = lost.get(group["pci"])
    if merged is None:
        lost[group["pci"]] = group
        return
    merged["count"] += group["count"]
    merged["code"] = merged["code"] or group["code"]
    for field, choose in (("first_timestamp", min), ("first_uptime_s", min), ("last_timestamp", max)):
        merged[field] = pick(choose, merged[field], group[field])


def _finding(code: str, level: str, message: str, action: str, group: Dict[str, Any], *, kind: str) -> Dict[str, Any]:
    return finding(
        code,
        level,
        message,
        action,
        gpu=group["gpu"],
        xid=group["code"],
        kind=kind,
        count=group["count"],
        pci=group["pci"],
        first_seen=_iso(group["first_timestamp"]),
        last_seen=_iso(group["last_timestamp"]),
    )
