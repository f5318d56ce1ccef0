#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: load_verify
short_description: Prove that artifacts load, by running a user command on each, before teardown deletes anything
version_added: "0.1.0"
description:
  - Part of teardown's gate. Runs each check's argv (the artifact's path already substituted by the caller, for
    example C(python -c "import torch, sys; torch.load(sys.argv[1], weights_only=True)" /path/best.pth)) and
    passes only when every one exits 0 within O(timeout_s).
  - Each argv runs with no shell (an argument such as C(;rm -rf x) reaches the program literally), stdin from
    C(/dev/null), stdout and stderr merged, in a session of its own. On timeout the whole session (its process
    group, and any member that moved to another group) gets SIGTERM, then SIGKILL 5 s later; processes a check
    leaves running when it exits are stopped the same way (RV(checks[].leftovers) counts them).
  - Checks run one after the other, all of them, so that RV(checks) holds the evidence for every artifact.
  - A program that cannot be found gives rc 127 (126 when it cannot be executed) and an RV(checks[].output_tail)
    that names it, never a traceback.
  - Read-only, so it runs in check mode too. Run it on the box, or with C(delegate_to=localhost) on the controller's
    pulled copy.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+.
options:
  checks:
    description: The checks to run, in order. An empty list passes with nothing verified (RV(reason) says so).
    type: list
    elements: dict
    required: true
    suboptions:
      artifact:
        description: The artifact's path as reported in RV(failed_artifacts) and RV(reason) (for example
          C(cells/base/best.pth)); not read by the module.
        type: str
        required: true
      argv:
        description: The command, an argv list (no shell); C(argv[0]) is looked up on C(PATH). Must not be empty.
        type: list
        elements: str
        required: true
  timeout_s:
    description: Seconds each check may run, above 0 and at most 86400.
    type: float
    default: 300
  output_bytes:
    description: How many bytes of each check's output (the last ones) are kept, between 0 and 1048576.
    type: int
    default: 4000
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The checks run in check mode too (they only read); C(changed) is always false.
notes:
  - The command is the user's own; the module cannot stop it from writing. Give it a read-only command.
"""

EXAMPLES = r"""
- name: Load the checkpoint with PyTorch, as the gate's load check
  remote_gpu.trainer.load_verify:
    checks:
      - artifact: cells/base/best.pth
        argv: [python, -c, "import sys, torch; torch.load(sys.argv[1], weights_only=True)",
               /root/autodl-fs/runs/abl/cells/base/best.pth]
    timeout_s: 600
  register: loaded

- name: Load a safetensors file on the controller's copy
  remote_gpu.trainer.load_verify:
    checks:
      - artifact: cells/base/model.safetensors
        argv: [python, -c, "import sys; from safetensors.torch import load_file; load_file(sys.argv[1])",
               /srv/pulled/abl/cells/base/model.safetensors]
  delegate_to: localhost
"""

RETURN = r"""
passed:
  description: Every check exited 0 within O(timeout_s) (also true for an empty O(checks)).
  returned: always
  type: bool
reason:
  description: One line, C(2 load check(s) passed), or naming the first failure, for example C(load check of
    cells/a/best.pth exited with 1 (1 of 2 check(s\) failed\)).
  returned: always
  type: str
failed_artifacts:
  description: The artifacts whose check failed, in order.
  returned: always
  type: list
  elements: str
checks:
  description: One entry per check, in order.
  returned: always
  type: list
  elements: dict
  contains:
    artifact: {description: The check's artifact., type: str}
    argv: {description: The argv that ran., type: list, elements: str}
    rc:
      description: The exit status; 127 when the program was not found, 126 when it could not be executed; null when
        it timed out or was killed by a signal.
      type: int
    signal: {description: 'The signal that ended it (for example 15 after a timeout), or null.', type: int}
    timed_out: {description: It ran past O(timeout_s) and its session was killed., type: bool}
    duration_s: {description: Seconds it ran., type: float}
    output_tail:
      description: The last O(output_bytes) bytes of its stdout and stderr (decoded as UTF-8), or the line naming the
        program that could not be run.
      type: str
    leftovers:
      description: Processes of its session still running when it exited, which the module then stopped.
      type: int
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._load_verify import load_verify

CHECK_OPTIONS = {
    "artifact": {"type": "str", "required": True},
    "argv": {"type": "list", "elements": "str", "required": True},
}
ARGUMENT_SPEC = {
    "checks": {"type": "list", "elements": "dict", "options": CHECK_OPTIONS, "required": True},
    "timeout_s": {"type": "float", "default": 300.0},
    "output_bytes": {"type": "int", "default": 4000},
}
OPTION_BOUNDS = {
    "timeout_s": Between(0, 86400, above_low=True),
    "output_bytes": Between(0, 1048576),
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    try:
        result = load_verify(module.params)
    except ValueError as exc:  # a check the argument spec cannot judge (an empty argv): the message names it
        module.fail_json(msg=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
