# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Box verdicts: findings from the directory probes (``_disk``) and the memory readings (``_cgroup``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding

GIB = 1024**3


def disk_findings(
    label: str,
    probe: Dict[str, Any],
    warn_pct: float,
    fail_pct: float,
    timeout_s: float,
) -> List[Dict[str, Any]]:
    """Findings for one probed directory (``label`` is data or durable)."""
    unanswered = _unanswered_probe(label, probe, timeout_s)
    if unanswered is not None:
        return [unanswered]
    found = _missing_or_unwritable(label, probe)
    # A full disk (ENOSPC) also fails the write probe: still say how full, so the action is clear.
    for resource in ("bytes", "inodes"):
        found.extend(_disk_low(label, probe, resource, warn_pct, fail_pct))
    return found


def _dir_unwritable(path: str, message: str, reason: str) -> Dict[str, Any]:
    return finding("dir_unwritable", "FAIL", message, "investigate", path=path, reason=reason)


def _unanswered_probe(label: str, probe: Dict[str, Any], timeout_s: float) -> Optional[Dict[str, Any]]:
    """The probe gave no answer: its child missed the deadline (a dead or hung mount) or raised."""
    path = probe["path"]
    if probe.get("timed_out"):
        message = f"{label} dir {path} did not answer within {timeout_s:g} s (dead or hung mount?)"
        return _dir_unwritable(path, message, "timeout")
    if probe.get("probe_error"):
        return _dir_unwritable(path, f"{label} dir {path} could not be probed: {probe['probe_error']}", "probe_error")
    return None


def _missing_or_unwritable(label: str, probe: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The directory is missing, or the write probe failed in it."""
    if probe["exists"] and probe["writable"]:
        return []
    reason = "write_failed" if probe["exists"] else "missing"
    return [_dir_unwritable(probe["path"], f"{label} dir {probe['path']}: {probe['error']}", reason)]


def _disk_low(
    label: str, probe: Dict[str, Any], resource: str, warn_pct: float, fail_pct: float
) -> List[Dict[str, Any]]:
    """WARN or FAIL when ``resource`` (bytes or inodes) is used at or above the warn or fail percentage."""
    used_pct = probe.get(f"{resource}_used_pct")
    if used_pct is None or used_pct < warn_pct:
        return []
    level = "FAIL" if used_pct >= fail_pct else "WARN"
    threshold = fail_pct if level == "FAIL" else warn_pct
    free = probe[f"{resource}_free"]
    free_text = f"{free / GIB:.1f} GiB" if resource == "bytes" else f"{free} inodes"
    return [
        finding(
            "disk_low",
            level,
            f"{label} fs {probe['path']}: {resource} {used_pct:g}% used (>= {threshold:g}%), {free_text} free",
            "free_disk",
            path=probe["path"],
            resource=resource,
            used_pct=used_pct,
            threshold_pct=threshold,
            free=free,
        )
    ]


def checkpoint_findings(probe: Dict[str, Any], budget_gb: Optional[float]) -> List[Dict[str, Any]]:
    """FAIL when the data filesystem has less free space than the run declared it will write."""
    if budget_gb is None or "bytes_free" not in probe:
        return []
    budget_bytes = int(budget_gb * GIB)
    if probe["bytes_free"] >= budget_bytes:
        return []
    return [
        finding(
            "checkpoint_budget_exceeded",
            "FAIL",
            f"{probe['path']}: {probe['bytes_free'] / GIB:.1f} GiB free < checkpoint budget {budget_gb:g} GiB",
            "free_disk",
            path=probe["path"],
            bytes_free=probe["bytes_free"],
            budget_bytes=budget_bytes,
        )
    ]


def memory_findings(
    host_total: Optional[int], cgroup_limit: Optional[int], min_memory_gb: Optional[float]
) -> List[Dict[str, Any]]:
    """WARN when the memory the job can really use (the tighter of host and cgroup) is below the minimum."""
    if min_memory_gb is None:
        return []
    known = [value for value in (host_total, cgroup_limit) if value is not None]
    usable = min(known) if known else None
    if usable is None:
        return [
            finding(
                "cgroup_memory_low",
                "WARN",
                f"could not read host or cgroup memory to compare with the {min_memory_gb:g} GiB minimum",
                "investigate",
                min_bytes=int(min_memory_gb * GIB),
            )
        ]
    if usable >= min_memory_gb * GIB:
        return []
    source = "cgroup limit" if cgroup_limit is not None and usable == cgroup_limit else "host memory"
    host_text = f" (host has {host_total / GIB:.1f} GiB)" if host_total and source == "cgroup limit" else ""
    return [
        finding(
            "cgroup_memory_low",
            "WARN",
            f"{source} {usable / GIB:.1f} GiB < minimum {min_memory_gb:g} GiB{host_text}",
            "re_rent",
            usable_bytes=usable,
            cgroup_limit_bytes=cgroup_limit,
            host_total_bytes=host_total,
            min_bytes=int(min_memory_gb * GIB),
        )
    ]
