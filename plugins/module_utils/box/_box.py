# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""box_health's orchestration: probe the scratch and durable directories, read memory, judge both.

Pure standard library so it runs on any managed node (Python 3.8+) before the runtime is bootstrapped.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._box_findings import (
    checkpoint_findings,
    disk_findings,
    memory_findings,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._cgroup import (
    cgroup_memory_limit,
    host_memory_total,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._disk import probe_paths

MIB = 1024 * 1024


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
