#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: box_health
short_description: Check a rented box's scratch and durable directories, disk space, inodes and memory limit
version_added: "0.1.0"
description:
  - Checks, in one call, what a training run needs from the box besides its GPUs, and reports every
    problem as a finding (see the collection's findings contract).
  - The data and durable directories must exist and take a real write (a temporary file is written,
    fsynced and deleted, also in check mode, since it leaves nothing behind).
  - Bytes and inodes used on each filesystem are compared with O(disk_warn_pct) and O(disk_fail_pct).
    Inodes are checked too because many small files (dataset shards, wandb runs) exhaust them first.
  - Every filesystem probe runs in a child process with a deadline, so a dead network mount yields a
    C(dir_unwritable) finding instead of a hung task.
  - The container's memory limit is read from cgroup v2 C(memory.max) or v1 C(memory.limit_in_bytes)
    (through C(/proc/self/cgroup), taking the tightest limit of the cgroup and its parents) and compared,
    with the host's C(MemTotal), to O(min_memory_gb).
  - Needs only the Python standard library.
options:
  data_dir:
    description:
      - Fast scratch directory where runs and checkpoints are written (the platform profile's data_dir).
      - Must be a non-empty path.
    type: path
    required: true
  durable_dir:
    description:
      - Directory that survives teardown (the profile's durable_dir). Not checked when omitted.
      - When given, must be a non-empty path.
    type: path
  disk_warn_pct:
    description:
      - Bytes or inodes used, in percent, at or above which a WARN C(disk_low) finding is added.
      - A percentage above 0 and at most 100, and at most O(disk_fail_pct).
    type: float
    default: 90
  disk_fail_pct:
    description:
      - Bytes or inodes used, in percent, at or above which the C(disk_low) finding is a FAIL.
      - A percentage above 0 and at most 100.
    type: float
    default: 97
  checkpoint_budget_gb:
    description:
      - Space in GiB the run declares it will write to O(data_dir).
      - Less free space than this is a FAIL C(checkpoint_budget_exceeded) finding. Not checked when omitted.
      - A finite number between 0 and 1048576 (1 PiB).
    type: float
  min_memory_gb:
    description:
      - Minimum memory in GiB the job needs. The tighter of the cgroup limit and the host's memory below
        this is a WARN C(cgroup_memory_low) finding. Not checked when omitted.
      - A finite number between 0 and 1048576 (1 PiB).
    type: float
  probe_timeout_s:
    description:
      - Seconds the directory probes may take together before they count as hung, above 0 and at most 3600.
    type: float
    default: 5
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
  - remote_gpu.trainer.findings
attributes:
  check_mode:
    support: full
    details: The write probe runs in check mode too; it deletes its file and never reports a change.
notes:
  - Disk percentages follow C(df), used space over used plus the space an unprivileged user may still take.
seealso:
  - module: remote_gpu.trainer.gpu_health
  - ref: ansible_collections.remote_gpu.trainer.preflight_role
    description: The C(remote_gpu.trainer.preflight) role, which runs this module with the platform profile's
      directories.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
"""

EXAMPLES = r"""
- name: Check the AutoDL data disk and file storage before a 200 GiB run
  remote_gpu.trainer.box_health:
    data_dir: /root/autodl-tmp
    durable_dir: /root/autodl-fs
    checkpoint_budget_gb: 200
    min_memory_gb: 64
  register: box

- name: Stop when the box cannot hold the run
  ansible.builtin.fail:
    msg: "{{ box.findings | map(attribute='message') | join('; ') }}"
  when: box.status == 'FAIL'
"""

RETURN = r"""
status:
  description: Worst level among the findings, C(PASS) when there are none.
  returned: always
  type: str
  sample: WARN
findings:
  description:
    - One entry per problem, with C(code) (C(dir_unwritable), C(disk_low), C(checkpoint_budget_exceeded),
      C(cgroup_memory_low)), C(level), C(gpu) (always null here), C(message), C(action) and the measured values.
  returned: always
  type: list
  elements: dict
  sample:
    - code: disk_low
      level: FAIL
      gpu: null
      message: "data fs /root/autodl-tmp: inodes 98.2% used (>= 97%), 1203 inodes free"
      action: free_disk
      path: /root/autodl-tmp
      resource: inodes
      used_pct: 98.2
      threshold_pct: 97
      free: 1203
facts:
  description: What was measured.
  returned: always
  type: dict
  contains:
    disk:
      description:
        - Per directory label (C(data), C(durable)) the probe's result. C(path), C(label), C(exists),
          C(writable), C(error), C(bytes_total), C(bytes_free), C(bytes_used_pct), C(inodes_total),
          C(inodes_free), C(inodes_used_pct) (null when the filesystem has no inode table).
        - C(timed_out) is true, and the sizes are absent, when the probe did not answer in time.
      type: dict
      sample:
        data: {path: /data, label: data, exists: true, writable: true, error: null, bytes_total: 1073741824,
               bytes_free: 1048576000, bytes_used_pct: 2.4, inodes_total: 65536, inodes_free: 65530,
               inodes_used_pct: 0.0}
    memory:
      description:
        - C(host_total_mib), C(cgroup_limit_mib) (null when unlimited or unknown),
          C(cgroup_version) (1, 2 or null).
      type: dict
      sample: {host_total_mib: 515896, cgroup_limit_mib: 61440, cgroup_version: 2}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._box import check_box
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import status_of
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, NonEmpty, check_options

ARGUMENT_SPEC = {
    "data_dir": {"type": "path", "required": True},
    "durable_dir": {"type": "path"},
    "disk_warn_pct": {"type": "float", "default": 90.0},
    "disk_fail_pct": {"type": "float", "default": 97.0},
    "checkpoint_budget_gb": {"type": "float"},
    "min_memory_gb": {"type": "float"},
    "probe_timeout_s": {"type": "float", "default": 5.0},
}
# What the argument spec cannot check; the DOCUMENTATION of each option states its rule.
OPTION_BOUNDS = {
    "data_dir": NonEmpty(),
    "durable_dir": NonEmpty(),
    "disk_warn_pct": Between(0, 100, above_low=True),
    "disk_fail_pct": Between(0, 100, above_low=True),
    "checkpoint_budget_gb": Between(0, 1048576),
    "min_memory_gb": Between(0, 1048576),
    "probe_timeout_s": Between(0, 3600, above_low=True),
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS, ordered=[("disk_warn_pct", "disk_fail_pct")])
    params = module.params
    result = check_box(
        params["data_dir"],
        durable_dir=params["durable_dir"],
        disk_warn_pct=params["disk_warn_pct"],
        disk_fail_pct=params["disk_fail_pct"],
        checkpoint_budget_gb=params["checkpoint_budget_gb"],
        min_memory_gb=params["min_memory_gb"],
        probe_timeout_s=params["probe_timeout_s"],
    )
    module.exit_json(changed=False, status=status_of(result["findings"]), **result)


if __name__ == "__main__":
    main()
