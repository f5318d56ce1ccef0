#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: meter_stop
short_description: Stop a rented instance's billing through the provider's CLI or API and prove it stopped
version_added: "0.1.0"
description:
  - Runs on the controller (C(delegate_to localhost)), where the provider's CLI and its credentials live. The
    platform profiles (C(inventories/group_vars/<platform>.yml)) hold the argv lists for each provider
    (C(meter_stop_cmd), C(meter_stop_status_cmd), C(meter_stop_status_key), C(meter_stop_final_states),
    C(meter_stop_gone_pattern)).
  - B(Flow.) Every option is checked first; an empty argv element (an unset C(instance_id) templated to C("")) is
    refused, naming it, and nothing runs. In check mode nothing runs at all, not even the status command, and
    RV(would_run) names the command. Otherwise the status command runs once; when it reports a final state, or the
    instance is gone, the command is B(not) run (C(changed=false), RV(already)). Else O(command) runs; a non-zero
    exit fails the module unless its output matches O(gone_pattern). Then O(status_command) is polled every
    O(poll_interval_s) until it reports one of O(final_states) or the instance is gone, or O(timeout_s) has passed.
  - B(An exit status of 0 proves nothing.) C(vastai destroy instance ID) without C(-y) asks for confirmation, reads
    end-of-file and aborts with status 0 while the instance keeps billing; a sticky API accepts a stop and ignores
    it. Only the polled status counts, and a command that exited 0 while the instance is still running after
    O(timeout_s) fails the module (C(the meter-stop command exited 0 but the instance ... is still RUNNING after
    300 s)).
  - B(Reading the status.) The status command's stdout must be JSON (a status command that exits non-zero has no
    state). O(status_key) is a dotted path of object keys into it (C(desiredStatus), C(actual_status),
    C(data.status)). Output that is not JSON, a path step that is missing or is not an object (a list, C(null)), or
    a value that is not a non-empty string (a number, C(NaN), C(null)) make that poll's state C(unknown); polling
    goes on, and RV(status_output_tail) shows what the command printed.
  - B(States compare exactly), case included; V(EXITED) is not V(exited). Write O(final_states) as the provider
    prints them.
  - B(Gone.) O(gone_pattern) is searched in the status command's stdout and stderr (the last 64 KiB of each), and
    in the meter-stop command's output when it exits non-zero. It is only consulted when no state was read, so a status
    that names a state is never taken for gone, and never for the runner's own verdicts (a timeout, rc 124; a
    missing or non-executable program, rc 127 and 126, whose C(command not found) would otherwise match
    C(not found)). A meter-stop command that failed saying gone is then polled like one that exited 0, so the status
    command has to agree.
  - Every command runs without a shell, stdin from C(/dev/null), C(LC_ALL=C), within O(command_timeout_s). The
    whole module takes at most about O(timeout_s) + 2 x O(command_timeout_s) + O(poll_interval_s) after the first
    status poll. Output tails are at most 2000 characters.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  command:
    description:
      - The argv that stops the meter, for example V([runpodctl, pod, stop, ID]). No element may be empty.
    type: list
    elements: str
    required: true
  status_command:
    description:
      - The argv that prints the instance's status as JSON, for example V([runpodctl, pod, get, ID]). No element may be
        empty.
    type: list
    elements: str
    required: true
  status_key:
    description:
      - Dotted path of JSON object keys to the state string in the status command's stdout (V(desiredStatus),
        V(actual_status), V(data.status)); no empty step and no whitespace.
    type: str
    required: true
  final_states:
    description:
      - The states that mean the meter stopped, compared exactly (case-sensitive), for example V([EXITED, TERMINATED]).
      - May be empty only when O(gone_pattern) is set (a verb after which the instance no longer exists).
    type: list
    elements: str
    required: true
  gone_pattern:
    description:
      - Python regular expression that, searched in the output, says the instance no longer exists (which counts as
        stopped). Empty never matches. Keep it specific enough that an authentication error cannot match it (the
        RunPod profile's wants the word C(pod) before C(not found), so C(API key not found) does not match).
    type: str
    default: ""
  timeout_s:
    description:
      - Seconds, after the meter-stop command returned, to wait for a final state; between 0 and 86400 (0 polls once).
    type: float
    default: 300
  poll_interval_s:
    description:
      - Seconds between status polls; above 0 and at most 3600.
    type: float
    default: 5
  command_timeout_s:
    description:
      - Seconds each command (the meter-stop command and each status poll) may take; above 0 and at most 3600.
    type: float
    default: 60
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Runs nothing, not even the status command; RV(would_run) names the command and C(changed) is true.
notes:
  - The provider's credentials stay in its CLI's own configuration or in a file the command reads (the Lambda
    profile passes C(-H @file) to curl); never put a key in an argv, where process listings and logs show it.
"""

EXAMPLES = r"""
- name: Stop a RunPod pod and wait until RunPod reports it EXITED
  remote_gpu.trainer.meter_stop:
    command: [runpodctl, pod, stop, "{{ instance_id }}"]
    status_command: [runpodctl, pod, get, "{{ instance_id }}"]
    status_key: desiredStatus
    final_states: [EXITED, TERMINATED]
    gone_pattern: '(?i)\bpod\b.*\bnot found'
  delegate_to: localhost

- name: Destroy a Vast.ai instance (-y, or the CLI aborts with status 0)
  remote_gpu.trainer.meter_stop:
    command: [vastai, destroy, instance, "{{ instance_id }}", -y]
    status_command: [vastai, show, instance, "{{ instance_id }}", --raw]
    status_key: actual_status
    final_states: [exited, stopped]
    gone_pattern: '(?i)not found|no such'
    timeout_s: 600
  delegate_to: localhost
"""

RETURN = r"""
command:
  description: The meter-stop argv (run, or not run when RV(already) or in check mode).
  returned: always
  type: list
  elements: str
would_run:
  description: The argv the module would run.
  returned: check mode
  type: list
  elements: str
final_state:
  description: The final state the last poll read (one of O(final_states)), or null (gone, not stopped, check mode).
  returned: always
  type: str
gone:
  description: The last poll found that the instance no longer exists (counts as stopped).
  returned: always
  type: bool
already:
  description: The first poll found the instance already stopped or gone, so the command was not run.
  returned: always
  type: bool
polls:
  description: Status polls run, the first one included (0 in check mode or when the options were refused).
  returned: always
  type: int
states:
  description: The states the polls read, in order, consecutive repeats collapsed; C(unknown) for a poll without a
    readable state, C(gone) for one that found the instance gone.
  returned: always
  type: list
  elements: str
command_rc:
  description: The meter-stop command's exit status (124 timed out, 127 program missing), or null when it did not run.
  returned: always
  type: int
command_output_tail:
  description: The last 2000 characters of the meter-stop command's stdout and stderr; empty when it did not run.
  returned: always
  type: str
status_output_tail:
  description: The last 2000 characters of the last status poll's stdout and stderr.
  returned: always
  type: str
msg:
  description: One line, for example C(ran runpodctl pod stop abc; the instance is EXITED after 2 polls in 5.0 s),
    or why the meter may still be running.
  returned: always
  type: str
"""

from typing import Any, Dict

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils._meter_stop import (
    MeterStopError,
    meter_stop,
    plan_from,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils._options import Between, option_problems

ARGUMENT_SPEC: Dict[str, Dict[str, Any]] = {
    "command": {"type": "list", "elements": "str", "required": True},
    "status_command": {"type": "list", "elements": "str", "required": True},
    "status_key": {"type": "str", "required": True, "no_log": False},  # a JSON key path, not a secret
    "final_states": {"type": "list", "elements": "str", "required": True},
    "gone_pattern": {"type": "str", "default": ""},
    "timeout_s": {"type": "float", "default": 300.0},
    "poll_interval_s": {"type": "float", "default": 5.0},
    "command_timeout_s": {"type": "float", "default": 60.0},
}
# What the argument spec cannot check; the DOCUMENTATION of each option states its rule.
OPTION_BOUNDS = {
    "timeout_s": Between(0, 86400),
    "poll_interval_s": Between(0, 3600, above_low=True),
    "command_timeout_s": Between(0, 3600, above_low=True),
}


def _empty_result(module: AnsibleModule) -> Dict[str, Any]:
    return {
        "command": list(module.params["command"]),
        "final_state": None,
        "gone": False,
        "already": False,
        "polls": 0,
        "states": [],
        "command_rc": None,
        "command_output_tail": "",
        "status_output_tail": "",
    }


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    problems = option_problems(module.params, OPTION_BOUNDS)
    if problems:
        module.fail_json(msg="; ".join(problems), **_empty_result(module))
    try:
        plan = plan_from(module.params)
    except ValueError as exc:
        module.fail_json(msg=str(exc), **_empty_result(module))
    try:
        changed, result = meter_stop(plan, module.check_mode)
    except MeterStopError as exc:
        module.fail_json(**exc.result)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
