#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: vram_zombies
short_description: Find, and optionally reap, processes that hold GPU memory after their job died
version_added: 0.1.0
description:
  - Lists every process holding an NVIDIA device node (C(/dev/nvidia[0-9]+), C(/dev/nvidiactl), C(/dev/nvidia-uvm*))
    from C(/proc/*/fd), with NVML's view of each GPU where NVML is available, and judges which holders are zombies
    left by a crashed run (orphaned DDP workers, dataloader children, the children of a dead launcher).
  - B(The container problem.) Rented boxes are usually containers, where NVML and C(nvidia-smi) report B(host) PIDs
    that do not exist, or are other processes, in the container. "Holds the device but nvidia-smi does not list it"
    is therefore true of every healthy job in a container and is not used as evidence. The rules below use only
    evidence that holds in any PID namespace.
  - B(Never candidates) - PID 1; kernel threads; this module's process and its ancestors (the SSH session, the
    Ansible wrapper); other users' processes unless O(all_users); O(protect_pids), processes whose command line
    matches O(protect_patterns), members of a live registered run, and every descendant of these.
  - B(Registered runs) - the launch role writes C(<data_dir>/runs/<run>/run.json). This module reads C(run) (name),
    C(pgid), C(sid) (integers above 1), C(pids) (the launcher's processes) and C(started_at) (ISO 8601, or epoch
    seconds). A process belongs to a run when its process group is C(pgid), its session is C(sid), or it is in
    C(pids). A run is live while its launcher lives - the group leader C(pgid), the session leader C(sid), or a
    process in C(pids) - and was born no later than C(started_at) + 120 s (a younger one is a reused PID).
  - B(Candidates) must be older than O(min_age_s) and have one of these reasons. C(run_dead) - it belongs to a
    registered run whose launcher is gone. C(orphaned) - it, or its topmost ancestor below init, was reparented to
    the namespace's init (PPID 1; PPID 0 means a parent outside the namespace, not a dead one), does not lead its
    own process group, and that group's leader (the launcher) is gone; this catches orphaned workers and their
    dataloader children. A process that leads its own group was detached on purpose (nohup, setsid, tmux) and is
    judged by the registry only. When NVML shows a GPU the process holds busy above O(idle_util_pct) at any sample
    of the O(observe_s) window, an C(orphaned)-only holder is spared, since it may be a live unregistered job.
    C(gpu_idle) and C(old) are added as supporting evidence.
  - If a C(run.json) cannot be read, the processes it should protect are unknown, so the module reports but refuses
    to signal anything (O(kill=true) returns C(kill_refused)).
  - O(kill=true) re-checks each PID's identity (create time and command line) before signalling so a reused PID is
    never hit, sends SIGTERM, waits O(grace_s), sends SIGKILL to survivors and then verifies that the reaped
    processes no longer hold any device (and reports NVML used memory before and after).
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - psutil
  - nvidia-ml-py (optional; without it C(nvml) is null and decisions use /proc evidence only)
options:
  kill:
    description: Signal the candidates. The default only reports.
    type: bool
    default: false
  grace_s:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 10
  min_age_s:
    description: A holder younger than this is never a candidate (a starting job may look orphaned briefly).
    type: float
    default: 120
  observe_s:
    description: Seconds to sample GPU utilization through NVML before deciding; V(0) skips the observation.
    type: float
    default: 2
  idle_util_pct:
    description: A GPU whose utilization stays at or below this percentage over the window is idle.
    type: int
    default: 5
  protect_pids:
    description: PIDs never to judge a zombie, with their descendants. PIDs that do not exist are ignored.
    type: list
    elements: int
    default: []
  protect_patterns:
    description: Regular expressions searched in each process's command line; a match protects it and its descendants.
    type: list
    elements: str
    default: []
  all_users:
    description: Also judge processes owned by other users than the one running the module.
    type: bool
    default: false
  data_dir:
    description: The profile's data directory, holding the run registry C(runs/*/run.json). Unset means no registry.
    type: path
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target, if not
      supported the action will be skipped.
    support: full
    details: Nothing is signalled; C(would_kill) lists the candidates and C(changed) says whether any would be.
notes:
  - Run as the user that owns the jobs, or as root with O(all_users=true) on a shared box.
  - Processes whose descriptors cannot be read (another user's, without root) are counted in C(scan.fd_unreadable).
"""

EXAMPLES = r"""
- name: Report VRAM zombies (changes nothing)
  remote_gpu.trainer.vram_zombies:
    data_dir: /root/autodl-tmp
  register: zombies

- name: Reap them, sparing a notebook kernel
  remote_gpu.trainer.vram_zombies:
    data_dir: /root/autodl-tmp
    kill: true
    protect_patterns: ['ipykernel']
"""

RETURN = r"""
status:
  description: C(clean) (no candidates), C(candidates) (found, not signalled), C(reaped) (all gone) or C(partial).
  returned: always
  type: str
holders:
  description: Every process holding an NVIDIA device node.
  returned: always
  type: list
  elements: dict
  contains:
    pid: {description: Process ID in this namespace., type: int}
    ppid: {description: Parent PID., type: int}
    pgid: {description: Process group., type: int}
    sid: {description: Session., type: int}
    name: {description: Process name., type: str}
    cmdline: {description: Command line joined with spaces., type: str}
    age_s: {description: Seconds since the process started., type: int}
    orphaned: {description: The parent is the namespace's init., type: bool}
    protected: {description: Never a candidate., type: bool}
    protected_by: {description: 'Why it is protected, or null.', type: str}
    devices: {description: Device nodes held open., type: list, elements: str}
    gpus: {description: NVML indexes of the GPUs it holds (all GPUs when it holds only control nodes)., type: list,
           elements: int}
    candidate: {description: Judged a zombie., type: bool}
    rules: {description: 'Rules that convicted it (run_dead, orphaned, gpu_idle, old).', type: list, elements: str}
    reason: {description: One line explaining the decision., type: str}
candidates:
  description: The holders judged zombies, same keys as RV(holders); C(reason) says why.
  returned: always
  type: list
  elements: dict
would_kill:
  description: PIDs that O(kill=true) signals (or would signal in check mode); empty when it would not run.
  returned: always
  type: list
  elements: int
killed:
  description: Reaped processes, each C(pid), C(name) and C(signal) (the last one needed, SIGTERM or SIGKILL).
  returned: always
  type: list
  elements: dict
failed:
  description: Candidates that could not be signalled or still hold a device, each C(pid), C(name), C(error).
  returned: always
  type: list
  elements: dict
skipped:
  description: Candidates not signalled because they were gone or their PID now names another process (C(why)).
  returned: always
  type: list
  elements: dict
kill_refused:
  description: Why O(kill=true) signalled nothing although there were candidates, or null.
  returned: always
  type: str
verification:
  description: After a reap, C(holders_gone) (no reaped process holds a device) and C(memory_used_mib), one
    C(index), C(before_mib), C(after_mib) per GPU from NVML (memory may drop late, or not at all in a simulator);
    null when nothing was signalled.
  returned: always
  type: dict
nvml:
  description: NVML's view per GPU (C(index), C(minor), C(memory_used_mib), C(memory_total_mib), C(utilization_pct)
    samples, C(processes) with host PIDs and C(pid_exists_here)); null when NVML is unavailable.
  returned: always
  type: list
  elements: dict
nvml_error:
  description: Why C(nvml) is null.
  returned: always
  type: str
runs:
  description: Registered runs read from O(data_dir), each C(run), C(path), C(pgid), C(sid), C(live).
  returned: always
  type: list
  elements: dict
registry_problems:
  description: One line per run.json that could not be read or parsed.
  returned: always
  type: list
  elements: str
scan:
  description: Scan counts, C(processes), C(vanished) (exited during the scan), C(fd_unreadable).
  returned: always
  type: dict
findings:
  description: A C(vram_zombies) WARN finding (action C(reap_zombies)) while candidates remain, per findings.md.
  returned: always
  type: list
  elements: dict
"""

import re
from typing import Any, Dict

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _procs
from ansible_collections.remote_gpu.trainer.plugins.module_utils._zombie_scan import scan_and_reap

ARGUMENT_SPEC: Dict[str, Dict[str, Any]] = {
    "kill": {"type": "bool", "default": False},
    "grace_s": {"type": "float", "default": 10.0},
    "min_age_s": {"type": "float", "default": 120.0},
    "observe_s": {"type": "float", "default": 2.0},
    "idle_util_pct": {"type": "int", "default": 5},
    "protect_pids": {"type": "list", "elements": "int", "default": []},
    "protect_patterns": {"type": "list", "elements": "str", "default": []},
    "all_users": {"type": "bool", "default": False},
    "data_dir": {"type": "path"},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    if _procs.PSUTIL_IMPORT_ERROR is not None:
        reason = "to read processes; the preflight role's bootstrap installs it into the box's venv"
        module.fail_json(msg=missing_required_lib("psutil", reason=reason), exception=_procs.PSUTIL_IMPORT_ERROR)
    patterns = []
    for text in module.params["protect_patterns"]:
        try:
            patterns.append(re.compile(text))
        except re.error as exc:
            module.fail_json(msg=f"protect_patterns: invalid regular expression {text!r}: {exc}")
    for name in ("grace_s", "min_age_s", "observe_s"):
        if module.params[name] < 0:
            module.fail_json(msg=f"{name} must be 0 or more, not {module.params[name]}")
    result = scan_and_reap(module.params, patterns, module.check_mode)
    for problem in result["registry_problems"]:
        module.warn(f"run registry: {problem}")
    if result["kill_refused"]:
        module.warn(result["kill_refused"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
