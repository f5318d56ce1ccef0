# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Box-level checks for preflight: scratch and durable directories, disk space and inodes, cgroup memory.

Pure standard library so it runs on any managed node (Python 3.8+) before the runtime is bootstrapped.
Every filesystem probe runs in a forked child with a deadline: a dead network mount blocks ``statvfs`` or
``open`` in the kernel, and a patrol or preflight must report that instead of hanging with it.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils._findings import finding

MIB = 1024 * 1024
GIB = 1024 * MIB
PROBE_FILE_PREFIX = ".rgt-preflight-probe-"
# cgroup v1 reports "no limit" as a page-aligned LONG_MAX; anything this large is no limit.
CGROUP_V1_UNLIMITED = 1 << 62


def probe_path(path: str) -> Dict[str, Any]:
    """Inspect one directory: existence, a real write+delete, bytes and inodes. Runs in the probe child."""
    result: Dict[str, Any] = {"path": path, "exists": os.path.isdir(path), "writable": False, "error": None}
    if not result["exists"]:
        result["error"] = "not a directory" if os.path.exists(path) else "does not exist"
        return result
    probe_name = os.path.join(path, f"{PROBE_FILE_PREFIX}{os.getpid()}")
    try:
        fd = os.open(probe_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"preflight\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe_name)
        result["writable"] = True
    except OSError as exc:
        result["error"] = f"write probe failed: {exc.strerror or exc}"
    stats = os.statvfs(path)
    result.update(usage_from_statvfs(stats))
    return result


def usage_from_statvfs(stats: os.statvfs_result) -> Dict[str, Any]:
    """Bytes and inodes as an unprivileged user sees them (``df`` semantics: used / (used + available))."""
    bytes_total = stats.f_blocks * stats.f_frsize
    bytes_free = stats.f_bavail * stats.f_frsize
    bytes_used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
    inodes_total = stats.f_files
    inodes_free = stats.f_favail
    inodes_used = stats.f_files - stats.f_ffree
    return {
        "bytes_total": bytes_total,
        "bytes_free": bytes_free,
        "bytes_used_pct": _pct(bytes_used, bytes_used + bytes_free),
        "inodes_total": inodes_total,
        "inodes_free": inodes_free,
        # Filesystems without an inode table (btrfs, some FUSE mounts) report zero files: nothing to run out of.
        "inodes_used_pct": _pct(inodes_used, inodes_used + inodes_free) if inodes_total else None,
    }


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 1) if whole > 0 else 0.0


def probe_paths(paths: List[str], timeout_s: float) -> Dict[str, Dict[str, Any]]:
    """Probe every path in its own forked child, all under one deadline; a child that misses it is killed."""
    answers = run_with_deadline({path: functools.partial(probe_path, path) for path in paths}, timeout_s)
    results: Dict[str, Dict[str, Any]] = {}
    for path, answer in answers.items():
        if answer.get("timed_out"):
            results[path] = {"path": path, "timed_out": True}
        elif "error" in answer:
            results[path] = {"path": path, "probe_error": answer["error"]}
        else:
            results[path] = answer["value"]
    return results


def disk_findings(
    label: str,
    probe: Dict[str, Any],
    warn_pct: float,
    fail_pct: float,
    timeout_s: float,
) -> List[Dict[str, Any]]:
    """Findings for one probed directory (``label`` is data or durable)."""
    path = probe["path"]
    if probe.get("timed_out"):
        return [
            finding(
                "dir_unwritable",
                "FAIL",
                f"{label} dir {path} did not answer within {timeout_s:g} s (dead or hung mount?)",
                "investigate",
                path=path,
                reason="timeout",
            )
        ]
    if probe.get("probe_error"):
        return [
            finding(
                "dir_unwritable",
                "FAIL",
                f"{label} dir {path} could not be probed: {probe['probe_error']}",
                "investigate",
                path=path,
                reason="probe_error",
            )
        ]
    found = []
    if not probe["exists"] or not probe["writable"]:
        reason = "missing" if not probe["exists"] else "write_failed"
        found.append(
            finding(
                "dir_unwritable",
                "FAIL",
                f"{label} dir {path}: {probe['error']}",
                "investigate",
                path=path,
                reason=reason,
            )
        )
    # A full disk (ENOSPC) also fails the write probe: still say how full, so the action is clear.
    for resource, free_key in (("bytes", "bytes_free"), ("inodes", "inodes_free")):
        used_pct = probe.get(f"{resource}_used_pct")
        if used_pct is None or used_pct < warn_pct:
            continue
        level = "FAIL" if used_pct >= fail_pct else "WARN"
        threshold = fail_pct if level == "FAIL" else warn_pct
        free = probe[free_key]
        free_text = f"{free / GIB:.1f} GiB" if resource == "bytes" else f"{free} inodes"
        found.append(
            finding(
                "disk_low",
                level,
                f"{label} fs {path}: {resource} {used_pct:g}% used (>= {threshold:g}%), {free_text} free",
                "free_disk",
                path=path,
                resource=resource,
                used_pct=used_pct,
                threshold_pct=threshold,
                free=free,
            )
        )
    return found


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


def host_memory_total(meminfo_path: str = "/proc/meminfo") -> Optional[int]:
    """MemTotal in bytes, or None when /proc/meminfo cannot be read."""
    try:
        with open(meminfo_path) as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def parse_proc_cgroup(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 memory controller path) from /proc/self/cgroup; either may be None."""
    unified = memory_v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "memory" in controllers.split(","):
            memory_v1 = path
    return unified, memory_v1


def _read_limit(path: str) -> Tuple[bool, Optional[int]]:
    """(file was readable, limit in bytes or None for no limit)."""
    try:
        with open(path) as handle:
            raw = handle.read().strip()
    except OSError:
        return False, None
    if raw in ("max", ""):
        return True, None
    try:
        value = int(raw)
    except ValueError:
        return False, None
    return True, (None if value >= CGROUP_V1_UNLIMITED else value)


def _ancestors(root: str, cgroup_path: str) -> List[str]:
    """Directories from the process's own cgroup up to the mount root; the tightest limit among them applies."""
    parts = [p for p in cgroup_path.strip("/").split("/") if p and p != ".."]
    dirs = [os.path.join(root, *parts[:depth]) for depth in range(len(parts), 0, -1)]
    dirs.append(root)
    return dirs


def cgroup_memory_limit(
    proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> Tuple[Optional[int], Optional[int]]:
    """(cgroup version, effective memory limit in bytes or None when unlimited or unknown).

    A container usually sees its own cgroup as ``/`` (cgroup namespace) with the limit at the mount root;
    without a namespace the path names the container's cgroup below the host's root. Both are walked.
    """
    try:
        with open(proc_cgroup) as handle:
            unified, memory_v1 = parse_proc_cgroup(handle.read())
    except OSError:
        return None, None
    candidates = []
    if memory_v1 is not None:
        candidates.append((1, os.path.join(cgroup_root, "memory"), memory_v1, "memory.limit_in_bytes"))
    if unified is not None:
        candidates.append((2, cgroup_root, unified, "memory.max"))
    for version, root, path, filename in candidates:
        found_any = False
        limits = []
        for directory in _ancestors(root, path):
            readable, limit = _read_limit(os.path.join(directory, filename))
            found_any = found_any or readable
            if limit is not None:
                limits.append(limit)
        if found_any:
            return version, (min(limits) if limits else None)
    return None, None


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


def check_box(
    data_dir: str,
    *,
    durable_dir: Optional[str] = None,
    disk_warn_pct: float = 90.0,
    disk_fail_pct: float = 97.0,
    checkpoint_budget_gb: Optional[float] = None,
    min_memory_gb: Optional[float] = None,
    probe_timeout_s: float = 5.0,
    proc_cgroup: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
    meminfo_path: str = "/proc/meminfo",
) -> Dict[str, Any]:
    """Run every box-level check; returns ``findings`` and ``facts`` (``disk`` per label, ``memory``)."""
    labelled = [("data", data_dir)] + ([("durable", durable_dir)] if durable_dir else [])
    probes = probe_paths(sorted({path for _label, path in labelled}), probe_timeout_s)
    findings: List[Dict[str, Any]] = []
    disk: Dict[str, Dict[str, Any]] = {}
    for label, path in labelled:
        probe = probes[path]
        disk[label] = dict(probe, label=label)
        findings.extend(disk_findings(label, probe, disk_warn_pct, disk_fail_pct, probe_timeout_s))
    findings.extend(checkpoint_findings(probes[data_dir], checkpoint_budget_gb))
    host_total = host_memory_total(meminfo_path)
    cgroup_version, cgroup_limit = cgroup_memory_limit(proc_cgroup, cgroup_root)
    findings.extend(memory_findings(host_total, cgroup_limit, min_memory_gb))
    memory = {
        "host_total_mib": host_total // MIB if host_total is not None else None,
        "cgroup_limit_mib": cgroup_limit // MIB if cgroup_limit is not None else None,
        "cgroup_version": cgroup_version,
    }
    return {"findings": findings, "facts": {"disk": disk, "memory": memory}}
