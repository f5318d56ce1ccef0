#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: teardown_gate
short_description: Check on the box that a run's scratch may go - nothing runs, every cell is done, the durable
  copy verifies now
version_added: "0.1.0"
description:
  - The box's part of the teardown role's gate, on the run layout of the collection's run layout contract
    (C(<data_dir>/runs/<run>/) and C(<durable_dir>/runs/<run>/)). It checks, in order, and stops at the first step
    that fails (RV(step), RV(reason)).
  - B(run_alive.) The run is found, its runner is not alive (the PID-reuse guard of C(training_run)) and no process
    carrying the run's C(RGT_RUN_DIR) in its environment is left (a worker that called C(setsid) still counts).
  - B(cells.) Every cell of C(run.json) is done (C(succeeded), with its sync C(verified), or C(skipped) where the
    run declares no artifacts), or named in O(accept_incomplete_cells).
  - B(durable.) Every artifact recorded in the done cells' C(result.json) is under C(<durable_dir>/runs/<run>/),
    a regular file (not a symbolic link, not reached through one out of that directory), whose size and a sha256
    recomputed now equal the record; C(MANIFEST.sha256) holds the same size and sha256 for it; and the scratch
    file it was copied from, where it still exists, hashes the same (else the copy is stale). The durable copy must
    not lie inside O(data_dir). A run that secured no artifacts fails here unless O(accept_no_artifacts).
  - A run the teardown role already removed (the tombstone C(<data_dir>/runs/.torn_down/<run>.json) written by
    M(remote_gpu.trainer.run_scratch), no run directory) passes the first two steps, and its durable copy is
    recomputed against its C(MANIFEST.sha256).
  - Read-only. Every read of O(durable_dir) happens in a forked child under O(verify_timeout_s), so a hung mount
    fails the gate instead of hanging the play.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+ on the box.
options:
  run:
    description: The run's name, its directory under C(<data_dir>/runs/); matches C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$).
    type: str
    required: true
  data_dir:
    description: The profile's scratch directory (absolute), holding C(runs/<run>/).
    type: path
    required: true
  durable_dir:
    description: The profile's durable directory (absolute), holding C(runs/<run>/). Required when the run has
      artifacts.
    type: path
  accept_incomplete_cells:
    description: Cells that may be unfinished (failed, never run, sync failed); their artifacts are not checked.
    type: list
    elements: str
    default: []
  accept_no_artifacts:
    description: Pass the durable step for a run that secured no artifacts (its results live elsewhere, say in a
      tracker). Without it such a run is refused, since its scratch would be the only copy.
    type: bool
    default: false
  verify_timeout_s:
    description: Deadline in seconds for reading and hashing the durable copy and the scratch files, each; 1 to
      86400.
    type: float
    default: 1800
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The module changes nothing in any mode.
seealso:
  - module: remote_gpu.trainer.copy_verify
  - module: remote_gpu.trainer.run_scratch
"""

EXAMPLES = r"""
- name: Check that the run's results are safe before tearing the box down
  remote_gpu.trainer.teardown_gate:
    run: sweep-lr
    data_dir: /workspace
    durable_dir: /workspace/durable
  register: gate

- name: Refuse when the gate did not pass
  ansible.builtin.fail:
    msg: "{{ gate.step }}: {{ gate.reason }}"
  when: not gate.passed
"""

RETURN = r"""
passed:
  description: Every step passed.
  returned: always
  type: bool
step:
  description: The first step that failed, C(run_alive), C(cells) or C(durable); null when the gate passed.
  returned: always
  type: str
reason:
  description: One line saying why that step failed; empty when the gate passed.
  returned: always
  type: str
  sample: "durable copy does not match: cells/a/best.pth: 1024 bytes, expected 4096"
run:
  description: C(name), C(state) (C(running), C(stopped), C(done), C(absent) or C(torn_down)), and from
    C(run.json) C(pgid), C(sid) and C(started_at).
  returned: always
  type: dict
cells:
  description: Per cell of C(run.json), C(name), C(status) (C(succeeded), C(failed), or null without a result),
    C(sync), C(done) and C(accepted) (unfinished, but named in O(accept_incomplete_cells)).
  returned: always
  type: list
  elements: dict
missing_cells:
  description: The cells neither done nor accepted.
  returned: always
  type: list
  elements: str
durable:
  description:
    - C(dir) (C(<durable_dir>/runs/<run>)), C(exists), C(files) and C(bytes) compared, C(mismatches) (each
      C(path) and C(problem), with C(size), C(sha256), C(expected_size) and C(expected_sha256) where known),
      C(manifest) (C(path), C(sha256) of the manifest file, C(lines), C(bad_lines)) and C(extra) (files there that
      the manifest does not list).
  returned: always
  type: dict
artifacts:
  description: The durable copy's files as recomputed now, C(path) (relative to C(<durable_dir>/runs/<run>/)),
    C(size) and C(sha256); what a pull of it must match. Empty unless the gate passed.
  returned: always
  type: list
  elements: dict
scratch:
  description: C(dir) (C(<data_dir>/runs/<run>)) and whether it C(exists).
  returned: always
  type: dict
torn_down:
  description: The tombstone of an earlier teardown (C(run), C(removed_at), C(removed)), or null.
  returned: always
  type: dict
notes:
  description: What the gate noticed without failing, for example a name in O(accept_incomplete_cells) that is no
    cell of the run.
  returned: always
  type: list
  elements: str
msg:
  description: One line, C(gate passed) or the failed step and its reason.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils._options import Between, NonEmpty, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils._teardown_gate import teardown_gate

ARGUMENT_SPEC = {
    "run": {"type": "str", "required": True},
    "data_dir": {"type": "path", "required": True},
    "durable_dir": {"type": "path"},
    "accept_incomplete_cells": {"type": "list", "elements": "str", "default": []},
    "accept_no_artifacts": {"type": "bool", "default": False},
    "verify_timeout_s": {"type": "float", "default": 1800.0},
}
OPTION_BOUNDS = {
    "data_dir": NonEmpty(),
    "durable_dir": NonEmpty(),
    "verify_timeout_s": Between(1, 86400),
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    try:
        result = teardown_gate(module.params)
    except ValueError as exc:  # a run name or path only the layout's rules can judge: the message names it
        module.fail_json(msg=str(exc))
    message = "gate passed" if result["passed"] else f"{result['step']}: {result['reason']}"
    module.exit_json(changed=False, msg=message, **result)


if __name__ == "__main__":
    main()
