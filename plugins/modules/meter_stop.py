#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: meter_stop
short_description: Stop a rented instance's billing with a declared verb and prove it stopped
version_added: "0.1.0"
description:
  - Runs on the controller (C(delegate_to localhost)), where the provider's CLI and its credentials live. The
    platform profiles (C(inventories/group_vars/<platform>.yml)) declare each verb once under C(meter_stop_verbs)
    and pick one with C(meter_stop_verb); pass them as O(verbs) and O(verb). docs/teardown.md describes every
    platform's verbs.
  - B(One declaration per verb.) O(verbs) maps a verb name to C(command) (the argv), C(status) (how its state is
    read), C(final_states), C(survives) (which of C(data_dir), C(durable_dir) outlive it) and C(irreversible); or,
    for a verb done in a console, C(manual_steps) with C(survives) and C(irreversible). The name is only a label;
    what the verb does is what its declaration says, and a C(command) that says delete, destroy, terminate, remove,
    rm or release must be declared C(irreversible), which can not list C(data_dir) in C(survives).
  - B(Flow.) The declaration is checked first; an empty argv element (an unset C(instance_id) rendered to C("")) or
    an unrendered template is refused, naming it, and nothing runs. In check mode nothing runs at all, and
    RV(would_run) names the command. Otherwise the status command runs once; when it reports a final state, or the
    instance is gone, the command is B(not) run (C(changed=false), RV(already)). Else the C(cli_check) runs, if
    declared, and a CLI that fails it is refused before the verb runs. Then the command runs (a non-zero exit fails
    the module) and the status is polled every O(poll_interval_s) until a final state or gone, or O(timeout_s).
  - B(A stale id.) With O(box_answered) (the box answered SSH moments before, so it runs), a first poll that finds
    the instance gone, or in a final state of any declared verb read through the same status command (RunPod's
    C(EXITED) for its C(delete) verb too), means C(instance_id) names another instance, so the module fails with
    RV(stale_id) and runs nothing, rather than report C(already) while the box bills on, or delete a stopped
    instance that is not this box.
  - B(An exit status of 0 proves nothing.) C(vastai destroy instance ID) without C(-y) asks, reads end-of-file and
    aborts with status 0 while the instance keeps billing; only the polled status counts.
  - B(Reading the status.) C(status.command) must exit 0 and print JSON; anything else (a traceback, C(API key not
    found), a timeout, a missing program, text) is C(unknown), never gone, and RV(status_error) says why. With
    C(status.list) (a dotted path to the list of the account's instances, C("") for the whole output), the instance
    whose C(status.id_key) (default C(id)) equals C(status.id) is read, and an instance B(missing from a list that
    was read) is gone; a listed entry without that key, or two with the id, are C(unknown). Without C(status.list)
    the output is the instance itself. C(status.state_key) is a dotted path to the state, a non-empty string.
    States compare exactly, case included.
  - B(cli_check.) C(cli_check.command) must exit 0 and print C(cli_check.pattern) (a Python regular expression),
    else the verb is refused with C(cli_check.need) in the message (for example the Vast.ai profile checks that
    C(vastai destroy instance --help) shows C(-y, --yes), which older releases reject).
  - B(Nothing the provider prints is kept) but the states read and one short error line, from which values of
    token, key, secret and password fields, bearer credentials and long hex or base64 runs are removed (Lambda's
    instance list carries a C(jupyter_token)).
  - Every command runs without a shell, stdin from C(/dev/null), C(LC_ALL=C), within O(command_timeout_s). The
    whole module takes at most about O(timeout_s) + 3 x O(command_timeout_s) + O(poll_interval_s) after the first
    status poll.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  verbs:
    description:
      - The declared verbs (a profile's C(meter_stop_verbs)), rendered, as described above.
    type: dict
    required: true
  verb:
    description:
      - The verb to run, a key of O(verbs). V(none) stops nothing (C(changed=false)); a verb with C(manual_steps)
        fails the module with the steps, since the instance bills until someone follows them.
    type: str
    required: true
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
      - Seconds each command (the check, the meter-stop command and each status poll) may take; above 0 and at most
        3600.
    type: float
    default: 60
  box_answered:
    description:
      - The box answered moments ago (teardown passes true after its gate ran on the box). A first poll that reads
        the instance gone or stopped then fails the module as a stale or wrong instance id (RV(stale_id)).
    type: bool
    default: false
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
- name: Stop the box's meter with its profile's declared verb
  remote_gpu.trainer.meter_stop:
    verbs: "{{ meter_stop_verbs }}"
    verb: "{{ meter_stop_verb }}"
  delegate_to: localhost

- name: Delete a RunPod pod, read from the account's pod list (a pod missing from it is gone)
  remote_gpu.trainer.meter_stop:
    verb: delete
    verbs:
      delete:
        command: [runpodctl, pod, delete, "{{ instance_id }}"]
        status:
          command: [runpodctl, pod, list, --all, --output, json]
          list: ""
          id: "{{ instance_id }}"
          state_key: desiredStatus
        final_states: [TERMINATED]
        survives: []
        irreversible: true
    timeout_s: 600
  delegate_to: localhost
"""

RETURN = r"""
verb:
  description: The verb run (O(verb)).
  returned: always
  type: str
command:
  description: The meter-stop argv (run, or not run when RV(already), refused or in check mode).
  returned: always
  type: list
  elements: str
would_run:
  description: The argv the module would run.
  returned: check mode
  type: list
  elements: str
manual_steps:
  description: The console steps of a verb done by hand (the module fails, since the instance still bills).
  returned: when O(verb) declares manual_steps
  type: list
  elements: str
final_state:
  description: The final state the last poll read (one of the verb's final_states), or null (gone, not stopped, check
    mode).
  returned: always
  type: str
gone:
  description: The last poll read the instance's absence from the listed instances (counts as stopped).
  returned: always
  type: bool
already:
  description: The first poll found the instance already stopped or gone, so the command was not run.
  returned: always
  type: bool
polls:
  description: Status polls run, the first one included (0 in check mode or when the declaration was refused).
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
command_error:
  description: 'Why the meter-stop command failed, one scrubbed line (for example C(exited 1: Error: failed to stop pod
    p1)); empty when it did not fail.'
  returned: always
  type: str
status_error:
  description: 'Why the last status poll read no state, one scrubbed line (for example C(exited 1: API key not
    found)); empty when it read a state or gone.'
  returned: always
  type: str
stale_id:
  description: With O(box_answered), the first poll found the instance gone or stopped while its box answers, so
    the id names another instance; nothing was run.
  returned: always
  type: bool
msg:
  description: One line, for example C(ran runpodctl pod stop abc; the instance is EXITED after 2 polls in 5.0 s),
    or why the meter may still be running.
  returned: always
  type: str
"""

from typing import Any, Dict

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop import (
    NO_VERB,
    MeterStopError,
    meter_stop,
    parse_verb,
    plan_for,
    stopped_states,
)

ARGUMENT_SPEC: Dict[str, Dict[str, Any]] = {
    "verbs": {"type": "dict", "required": True},
    "verb": {"type": "str", "required": True},
    "timeout_s": {"type": "float", "default": 300.0},
    "poll_interval_s": {"type": "float", "default": 5.0},
    "command_timeout_s": {"type": "float", "default": 60.0},
    "box_answered": {"type": "bool", "default": False},
}


def _result(verb: str, command: Any = None) -> Dict[str, Any]:
    """Every return key, for a run that stopped before the first poll."""
    return {
        "verb": verb,
        "command": list(command or []),
        "final_state": None,
        "gone": False,
        "already": False,
        "polls": 0,
        "states": [],
        "command_rc": None,
        "command_error": "",
        "status_error": "",
        "stale_id": False,
    }


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    params = module.params
    try:
        verb = parse_verb(params["verbs"], params["verb"])
    except ValueError as exc:
        module.fail_json(msg=str(exc), **_result(params["verb"]))
    if verb.name == NO_VERB:
        module.exit_json(changed=False, msg="verb none: nothing is stopped", **_result(verb.name))
    try:
        plan = plan_for(verb, params["timeout_s"], params["poll_interval_s"], params["command_timeout_s"])
    except ValueError as exc:
        extra = {"manual_steps": list(verb.manual_steps)} if verb.manual_steps else {}
        module.fail_json(msg=str(exc), **_result(verb.name, verb.command), **extra)
    try:
        stopped = stopped_states(params["verbs"], verb)
        changed, result = meter_stop(
            plan, module.check_mode, box_answered=params["box_answered"], stopped_states=stopped
        )
    except MeterStopError as exc:
        module.fail_json(**exc.result)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
