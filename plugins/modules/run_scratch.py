#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_scratch
short_description: Remove a torn-down run's scratch files, refusing anything that is not scratch
version_added: "0.2.0"
description:
  - The last box step of teardown, after its gate passed. Removes C(<data_dir>/runs/<run>) and each of
    O(extra_paths), then writes the tombstone C(<data_dir>/runs/.torn_down/<run>.json) (atomically) with C(run),
    C(removed_at) (ISO 8601 UTC) and C(removed) (C(path), C(files), C(bytes) per removed path, added to those of an
    earlier tombstone of the run).
  - B(Refusals.) Every target is resolved (realpath) and checked, all of them before any is removed; one refusal
    fails the module and removes nothing. A target is refused when it resolves to C(/); to a home directory (the
    password database's, C(/root), C(/home), C(/home/*), C($HOME)) or holds one; to a mount point
    (C(/proc/self/mountinfo) or C(os.path.ismount)) or a tree holding one (a directory on another device, found by
    walking the tree without following links); to a path not strictly inside the resolved O(data_dir) (so also
    O(data_dir) itself, and a run directory that is a link pointing elsewhere); to O(durable_dir), or the
    durable_dir the run's C(run.json) records, or a path inside or holding either; when a directory in it cannot be
    read. An extra path is also refused when it is relative, holds a C(..) component, holds C(<data_dir>/runs) or
    lies inside another run's directory. The run is refused while it is alive (its runner lives, or a process
    carrying its C(RGT_RUN_DIR) does) and while its C(run.json) cannot be read. A O(data_dir) that resolves to C(/)
    is refused.
  - B(Links are never followed.) A target that is a symbolic link is unlinked (what it points at stays); links
    inside a removed tree are unlinked, so a link into the durable directory never costs a durable file.
  - Before removing, the module takes the box's launch lock (C(<data_dir>/runs/.launch.lock), as
    C(training_run) does), checks again that the run is not alive, and checks that each target is still the
    file it checked (device and inode).
  - A missing target is nothing to do; when nothing existed the module returns C(changed=false) and leaves an
    earlier tombstone as it is (so a second teardown is a no-op).
  - Checks and removal run in forked children under O(timeout_s), so a hung mount fails the module instead of
    hanging it.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+.
options:
  run:
    description: The run's name, its directory under C(<data_dir>/runs/); matches C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$).
    type: str
    required: true
  data_dir:
    description: The profile's scratch directory (absolute), holding C(runs/<run>/). Every target must lie inside it.
    type: path
    required: true
  durable_dir:
    description: The profile's durable directory (absolute); nothing inside, equal to or holding it is removed.
    type: path
  extra_paths:
    description: More absolute paths inside O(data_dir) to remove (the profile's C(scratch_extra_paths)).
    type: list
    elements: path
    default: []
  state:
    description: V(absent) removes the scratch; the only state.
    type: str
    choices: [absent]
    default: absent
  timeout_s:
    description: Seconds the checks and the removal together may take, above 0 and at most 86400.
    type: float
    default: 600
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Every check runs (a refusal fails as it would); nothing is removed or written; RV(would_remove) lists
      what would go and C(changed) whether anything would.
notes:
  - Run it only after C(teardown_gate) passed and the user confirmed; the refusals are a last line of defence, not
    the gate.
"""

EXAMPLES = r"""
- name: Remove the run's scratch (the gate passed, the user confirmed)
  remote_gpu.trainer.run_scratch:
    run: abl-2026-12
    data_dir: /root/autodl-tmp
    durable_dir: /root/autodl-fs
    extra_paths: [/root/autodl-tmp/hf_cache]
  register: scratch
"""

RETURN = r"""
msg:
  description: One line, for example C(removed 1 path(s\), 12 file(s\), 3221225472 bytes of run abl), C(would
    remove ...) or C(nothing to remove for run abl (torn down at ...\)); on failure why, naming the path.
  returned: always
  type: str
removed:
  description: What was removed (empty in check mode), one entry per target; on a failed removal, what went before
    the failure.
  returned: always
  type: list
  elements: dict
  contains:
    path: {description: The target as named (normalised)., type: str}
    files: {description: 'Files, links and other non-directories in it (1 for a file or a link).', type: int}
    bytes: {description: Sum of the sizes of its regular files., type: int}
would_remove:
  description: In check mode, what would be removed (same keys as RV(removed)); empty otherwise.
  returned: always
  type: list
  elements: dict
tombstone:
  description: The tombstone's path when it was written now, would be written (check mode) or exists from an
    earlier teardown; null when there is none.
  returned: always
  type: str
refused:
  description: The module failed on a refusal (nothing was removed).
  returned: always
  type: bool
problems:
  description: Every refusal, one line each naming the target (the first one is in RV(msg)); empty unless refused.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils._options import Between, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils._run_scratch import ScratchFailure, run_scratch

ARGUMENT_SPEC = {
    "run": {"type": "str", "required": True},
    "data_dir": {"type": "path", "required": True},
    "durable_dir": {"type": "path"},
    "extra_paths": {"type": "list", "elements": "path", "default": []},
    "state": {"type": "str", "choices": ["absent"], "default": "absent"},
    "timeout_s": {"type": "float", "default": 600.0},
}
OPTION_BOUNDS = {"timeout_s": Between(0, 86400, above_low=True)}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    try:
        result = run_scratch(module.params, module.check_mode)
    except ValueError as exc:  # a bad run name or a relative path: the message names the option
        module.fail_json(msg=str(exc), refused=False, problems=[], removed=[], would_remove=[], tombstone=None)
    except ScratchFailure as exc:
        module.fail_json(msg=str(exc), **exc.facts)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
