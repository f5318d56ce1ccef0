#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_scratch
short_description: Remove torn-down runs' scratch files, re-checking the durable copy and refusing anything that
  is not scratch
version_added: "0.1.0"
description:
  - The last box step of teardown, after its gate passed. For each run of O(runs), in order, removes
    C(<data_dir>/runs/<run>), then each of O(extra_paths) once, after every run.
  - B(Refusals.) Every target of every run is resolved (realpath) and checked, all of them before any is removed;
    one refusal fails the module and removes nothing. A target is refused when it resolves to C(/); to a home
    directory (the password database's, C(/root), C(/home), C(/home/*), C($HOME)) or holds one; to a mount point
    (C(/proc/self/mountinfo) or C(os.path.ismount)) or a tree holding one (a directory on another device, found by
    walking the tree without following links); to a path not strictly inside the resolved O(data_dir) (so also
    O(data_dir) itself, and a run directory that is a link pointing elsewhere); to O(durable_dir), or the
    durable_dir a run's C(run.json) records, or a path inside or holding either; when a directory in it cannot be
    read. An extra path is also refused when it is relative, holds a C(..) component, holds C(<data_dir>/runs) or
    lies inside a run's directory other than those of O(runs). A run is refused while it is alive (its runner
    lives, or a process carrying its C(RGT_RUN_DIR) does) and while its C(run.json) cannot be read (unless its
    tombstone says C(removing)). A O(data_dir) that resolves to C(/) is refused. A O(durable_dir) elsewhere inside
    O(data_dir) (C(/workspace/durable) in C(/workspace)) is fine.
  - B(The tombstone first.) Before the first file of a run goes, its tombstone
    C(<data_dir>/runs/.torn_down/<run>.json) is written (atomically) with C(state=removing), C(started_at) and
    C(removing) (what is about to go); after the run's directory is gone it says C(state=removed), C(removed_at)
    and C(removed) (C(path), C(files), C(bytes), C(run) per removed path, added to those of an earlier tombstone;
    the extra paths are added to every run's). A removal stopped halfway (its deadline, an error) leaves
    C(removing); a re-run does not need the gone C(run.json), re-checks the durable copy and finishes.
  - B(The durable copy, checked again.) Immediately before a cell's scratch C(cells/<cell>) is removed, that
    cell's durable files (O(expected), else the lines of C(<durable_dir>/runs/<run>/MANIFEST.sha256)) are hashed
    again under O(timeout_s); the run's remaining ones before the rest of its directory. Any difference (size,
    sha256, missing, now a symbolic link) stops the module, failed, with nothing more removed; RV(removed) says what
    already went and RV(durable_mismatch) what differed.
  - B(Links are never followed.) A target that is a symbolic link is unlinked (what it points at stays); links
    inside a removed tree are unlinked, so a link into the durable directory never costs a durable file.
  - Before removing, the module takes the box's launch lock (C(<data_dir>/runs/.launch.lock), as
    C(training_run) does), checks again that no run is alive, and checks that each target is still the file it
    checked (device and inode).
  - A missing target is nothing to do; when nothing existed and no removal was unfinished the module returns
    C(changed=false) and leaves every tombstone as it is (so a second teardown is a no-op).
  - Checks and removal run in forked children under O(timeout_s), so a hung mount fails the module instead of
    hanging it.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+.
options:
  runs:
    description: The runs to remove, each a directory name under C(<data_dir>/runs/) matching
      C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$); at least one.
    type: list
    elements: str
    required: true
    aliases: [run]
  data_dir:
    description: The profile's scratch directory (absolute), holding C(runs/<run>/). Every target must lie inside it.
    type: path
    required: true
  durable_dir:
    description: The profile's durable directory (absolute); nothing inside, equal to or holding it is removed.
      Required when O(expected) lists files.
    type: path
  extra_paths:
    description: More absolute paths inside O(data_dir) to remove (the profile's C(scratch_extra_paths)).
    type: list
    elements: path
    default: []
  expected:
    description:
      - Per run name, the files its durable copy must hold, each C(path) (relative to C(<durable_dir>/runs/<run>/),
        for example C(cells/a/best.pth)), C(size) and C(sha256); the run's C(artifacts) from
        M(remote_gpu.trainer.teardown_gate).
      - A run missing here is checked against its C(MANIFEST.sha256), when there is one.
    type: dict
    default: {}
  state:
    description: V(absent) removes the scratch; the only state.
    type: str
    choices: [absent]
    default: absent
  timeout_s:
    description: Seconds the checks, the re-hashing and the removal together may take, above 0 and at most 86400.
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
- name: Remove the runs' scratch (the gate passed, the user confirmed)
  remote_gpu.trainer.run_scratch:
    runs: [abl-2026-12]
    data_dir: /root/autodl-tmp
    durable_dir: /root/autodl-fs
    extra_paths: [/root/autodl-tmp/hf_cache]
    expected:
      abl-2026-12: "{{ gate.runs[0].artifacts }}"
  register: scratch
"""

RETURN = r"""
msg:
  description: One line, for example C(removed 1 path(s\), 12 file(s\), 3221225472 bytes of run abl), C(would
    remove ...) or C(nothing to remove for run abl (torn down at ...\)); on failure why, naming the run, the cell
    and the path.
  returned: always
  type: str
removed:
  description: What was removed (empty in check mode), one entry per target; on a failure, what went before it
    (a run stopped halfway by one entry per removed cell).
  returned: always
  type: list
  elements: dict
  contains:
    path: {description: The target as named (normalised)., type: str}
    files: {description: 'Files, links and other non-directories in it (1 for a file or a link).', type: int}
    bytes: {description: Sum of the sizes of its regular files., type: int}
    run: {description: 'The run it belongs to; null for an extra path.', type: str}
would_remove:
  description: In check mode, what would be removed (same keys as RV(removed)); empty otherwise.
  returned: always
  type: list
  elements: dict
runs:
  description: One entry per run of O(runs).
  returned: always
  type: list
  elements: dict
  contains:
    run: {description: The run's name., type: str}
    state:
      description: C(removed) (now), C(already_removed) (an earlier teardown), C(nothing) (no scratch, no
        tombstone), C(would_remove) (check mode), C(pending) (not reached) or C(stopped) (its removal stopped
        halfway; its tombstone says C(removing)).
      type: str
    tombstone: {description: 'Its tombstone''s path (written, would be written, or from earlier), or null.', type: str}
    verified: {description: Durable files hashed again before its scratch went., type: int}
durable_mismatch:
  description: The durable file that differed from O(expected) (or the manifest) when the module stopped, with
    C(run), C(cell), C(path), C(problem) and, where known, C(size), C(sha256), C(expected_size), C(expected_sha256);
    null otherwise.
  returned: always
  type: dict
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

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._run_scratch import (
    ScratchFailure,
    run_scratch,
)

ARGUMENT_SPEC = {
    "runs": {"type": "list", "elements": "str", "required": True, "aliases": ["run"]},
    "data_dir": {"type": "path", "required": True},
    "durable_dir": {"type": "path"},
    "extra_paths": {"type": "list", "elements": "path", "default": []},
    "expected": {"type": "dict", "default": {}},
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
        empty = {"removed": [], "would_remove": [], "runs": [], "durable_mismatch": None}
        module.fail_json(msg=str(exc), refused=False, problems=[], **empty)
    except ScratchFailure as exc:
        module.fail_json(msg=str(exc), **exc.facts)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
