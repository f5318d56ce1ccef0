#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stage_verdict
short_description: Turn a box's stage record into the play's outcome, and so ansible-playbook's exit code
version_added: "0.1.0"
description:
  - An action plugin, the last task of a stage. A record whose status is in O(failing) fails the host (exit code
    2); C(UNREACHABLE) marks it unreachable (exit code 4), or, with O(fleet_var), fails it when another box of the
    play failed (ansible-playbook would report 4 over 2); anything else is ok.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  result:
    description: The box's record, as the stage's task registered it.
    type: raw
    required: true
  failing:
    description: The statuses that fail the host.
    type: list
    elements: str
    default: [UNCONFIRMED, STOP_BY_HAND, REFUSED, FAILED]
  fleet_var:
    description: The variable holding every box's record (the stage's registered result); with it, an unreachable
      box fails instead when another box's status is in O(failing), so the exit code is 2, not 4.
    type: str
  escalated_fails:
    description: A record whose C(escalate) is true fails too (for patrol, a box that needs a human), whatever
      its status.
    type: bool
    default: false
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Changes nothing in any mode.
  action:
    description: Runs on the controller.
    support: full
"""

EXAMPLES = r"""
- name: Fail the boxes refused, unconfirmed, left to stop by hand or failed
  remote_gpu.trainer.stage_verdict:
    result: "{{ teardown_box }}"
    fleet_var: teardown_box
"""

RETURN = r"""
msg:
  description: The box's line.
  returned: always
  type: str
"""
