#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: vram_zombies
short_description: Find, and optionally reap, processes that hold GPU memory after their job died
version_added: "0.1.0"
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
    seconds; a time without a UTC offset is the box's local time, honouring C(TZ)). A process belongs to a run
    when its process group is C(pgid), its session is C(sid), or it is in C(pids). A run is live while its
    launcher lives - the group leader C(pgid), the session leader C(sid), or a process in C(pids) - and was born
    no later than C(started_at) + 120 s (a younger one is a reused PID).
  - B(Orphaned) means the process's parent is an adopter - the namespace's init (PPID 1) or a process matching
    O(subreaper_patterns) - not that a group leader is missing. PPID 0 means a parent outside the namespace
    (C(docker exec)), which is alive.
  - B(The live-job rule.) A holder is never a candidate while any process on its ancestor chain, up to the first
    adopter, is alive (so a live launcher protects its whole tree whatever its process group, as after
    C(nohup launcher &), and so does the leftover shell of C(cd /tmp && setsid launcher &)), while an ancestor is
    missing from the process table or outside the namespace (it may be alive), nor while any process of its process
    group or session other than itself and other candidates is alive (not defunct). PID 1 counts as such a member
    unless it matches O(subreaper_patterns) (it may be the job's own launcher, as in
    C(docker run image python launcher.py)); subreapers never do. "Other candidates" is the greatest such set -
    start from the holders that pass every other guard and repeatedly drop any with a live ancestor or a live group
    or session member outside the set, until none is dropped - so an orphaned worker and its dataloader children,
    all old holders, go together. Each holder's C(reason) names the live process that protected it.
  - B(Candidates) are the holders left by that rule that are older than O(min_age_s) and whose chain reaches an
    adopter; their rules are C(orphaned) (it, or its topmost ancestor below the adopter, is orphaned), and
    C(run_dead) when it also belongs to a registered run whose launcher is gone. A holder that leads its own
    process group or session was detached on purpose (nohup, setsid, tmux) and is spared unless it belongs to a
    dead registered run. When NVML shows a GPU the process holds busy above
    O(idle_util_pct) at any sample of the O(observe_s) window, a holder that belongs to no dead registered run is
    spared, since it may be a live unregistered job. Spared holders are no candidates, so they protect their own
    descendants and group. C(gpu_idle) and C(old) are added as supporting evidence.
  - If a C(run.json) cannot be read, or O(data_dir) (or its C(runs)) is missing or not a directory, the processes
    the registry should protect are unknown, so the module reports it in RV(registry_problems) and a warning, and
    refuses to signal anything (O(kill=true) returns C(kill_refused)). A O(data_dir) without C(runs) is an empty
    registry. The registry is read in a forked child with a 10 s deadline, so a data dir on a dead network mount
    is such a problem instead of a hang.
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
    description: Seconds between SIGTERM and SIGKILL, between 0 and 3600.
    type: float
    default: 10
  min_age_s:
    description:
      - A holder younger than this is never a candidate (a starting job may look orphaned briefly).
      - Seconds between 0 and 31536000 (365 days).
    type: float
    default: 120
  observe_s:
    description:
      - Seconds to sample GPU utilization through NVML before deciding, between 0 and 600; V(0) skips the observation.
      - The window is only taken when some holder could be a candidate. Utilization can only spare a holder (a busy
        GPU) or add C(gpu_idle) to a conviction, never make one, so with no holder at all (the normal case before a
        launch), or none that could be a candidate, the module does not sample and says so in RV(observation) and
        RV(msg).
    type: float
    default: 2
  idle_util_pct:
    description:
      - A GPU whose utilization stays at or below this percentage over the window is idle.
      - A percentage between 0 and 100.
    type: int
    default: 5
  protect_pids:
    description:
      - PIDs never to judge a zombie, with their descendants. PIDs that do not exist are ignored.
      - Each PID must be an integer between 1 and 4194304 (the kernel's PID limit).
    type: list
    elements: int
    default: []
  protect_patterns:
    description: Regular expressions searched in each process's command line; a match protects it and its descendants.
    type: list
    elements: str
    default: []
  subreaper_patterns:
    description:
      - Regular expressions searched in each process's command line (joined with spaces); a match is a subreaper, a
        process that adopts the orphans below it (C(tini), C(dumb-init), C(systemd --user)) and is no job's
        member. It counts as init - a holder whose parent it is, is orphaned; it never protects through the
        ancestor chain or by sharing a process group or session - so anchor the pattern to the whole command.
      - Needed where the adopter shares the jobs' session (C(tini) or C(docker-init) as PID 1) or is not PID 1.
    type: list
    elements: str
    default: []
  all_users:
    description: Also judge processes owned by other users than the one running the module.
    type: bool
    default: false
  data_dir:
    description:
      - The profile's data directory, holding the run registry C(runs/*/run.json). Unset means no registry.
      - When given, must be a non-empty path.
    type: path
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
  - remote_gpu.trainer.findings
attributes:
  check_mode:
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
  description:
    - C(clean) (no candidates), C(candidates) (found, not signalled), C(reaped) (every signalled candidate is gone)
      or C(partial) (some survived or could not be signalled).
    - It stays C(candidates) when O(kill=true) signalled nothing because every candidate was already gone or its
      PID now names another process (see RV(skipped)); scan again.
    - C(clean) says nothing about the registry; check RV(registry_problems).
  returned: always
  type: str
msg:
  description: One line, for example C(3 holder(s), 2 candidate(s); GPU utilization sampled for 2s), or naming why no
    NVML observation window was taken.
  returned: always
  type: str
observation:
  description: The NVML utilization window, C(requested_s) (O(observe_s)), C(window_s) (seconds actually sampled,
    0 when skipped) and C(skipped) (why it was not taken - O(observe_s) is 0, or no holder could be a candidate - or
    null).
  returned: always
  type: dict
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
    orphaned: {description: The parent is the namespace's init or a subreaper (O(subreaper_patterns))., type: bool}
    protected: {description: Never a candidate., type: bool}
    protected_by: {description: 'Why it is protected, or null.', type: str}
    devices: {description: Device nodes held open., type: list, elements: str}
    gpus: {description: NVML indexes of the GPUs it holds (all GPUs when it holds only control nodes)., type: list,
           elements: int}
    candidate: {description: Judged a zombie., type: bool}
    rules: {description: 'Rules that convicted it (run_dead, orphaned, gpu_idle, old).', type: list, elements: str}
    reason: {description: 'One line explaining the decision; when a live process kept it from being a candidate, that
             process''s PID and command line.', type: str}
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
  description: One line per run.json that could not be read or parsed, or one saying that O(data_dir) (or its
    C(runs)) is missing, not a directory or did not answer in time, so the registry could not be read.
  returned: always
  type: list
  elements: str
scan:
  description: Scan counts, C(processes), C(vanished) (exited during the scan), C(fd_unreadable) (descriptors or
    identity unreadable). Every process costs one C(/proc/PID/fd) listing and one C(/proc/PID/stat) read; command
    lines and owners are read for holders and the processes a decision can name (their ancestors, process groups
    and sessions; every process when O(subreaper_patterns) is set).
  returned: always
  type: dict
findings:
  description: A C(vram_zombies) WARN finding (action C(reap_zombies)) while candidates remain, per findings.md.
  returned: always
  type: list
  elements: dict
"""

import re
from typing import Any, Dict, List, Pattern

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, NonEmpty, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs import _procs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._zombie_scan import scan_and_reap

ARGUMENT_SPEC: Dict[str, Dict[str, Any]] = {
    "kill": {"type": "bool", "default": False},
    "grace_s": {"type": "float", "default": 10.0},
    "min_age_s": {"type": "float", "default": 120.0},
    "observe_s": {"type": "float", "default": 2.0},
    "idle_util_pct": {"type": "int", "default": 5},
    "protect_pids": {"type": "list", "elements": "int", "default": []},
    "protect_patterns": {"type": "list", "elements": "str", "default": []},
    "subreaper_patterns": {"type": "list", "elements": "str", "default": []},
    "all_users": {"type": "bool", "default": False},
    "data_dir": {"type": "path"},
}
# What the argument spec cannot check; the DOCUMENTATION of each option states its rule.
OPTION_BOUNDS = {
    "grace_s": Between(0, 3600),
    "min_age_s": Between(0, 31536000),
    "observe_s": Between(0, 600),
    "idle_util_pct": Between(0, 100),
    "protect_pids": Between(1, 4194304),
    "data_dir": NonEmpty(),
}


def _compiled(module: AnsibleModule, name: str) -> List[Pattern[str]]:
    patterns = []
    for text in module.params[name]:
        try:
            patterns.append(re.compile(text))
        except re.error as exc:
            module.fail_json(msg=f"{name}: invalid regular expression {text!r}: {exc}")
    return patterns


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    if _procs.PSUTIL_IMPORT_ERROR is not None:
        reason = "to read processes; the preflight role's bootstrap installs it into the box's venv"
        module.fail_json(msg=missing_required_lib("psutil", reason=reason), exception=_procs.PSUTIL_IMPORT_ERROR)
    patterns, subreapers = _compiled(module, "protect_patterns"), _compiled(module, "subreaper_patterns")
    result = scan_and_reap(module.params, patterns, module.check_mode, subreapers)
    for problem in result["registry_problems"]:
        module.warn(f"run registry: {problem}")
    if result["kill_refused"]:
        module.warn(result["kill_refused"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
