#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: box_lease
short_description: Hold a box for a stage that spans several calls (teardown's pull and load-verify), or give it
  back
version_added: "0.1.0"
description:
  - The box lease lives in the instance directory on the box (C(~/.remote_gpu_trainer/instance/box-lease.json) of
    the user, or C($RGT_INSTANCE_DIR)), outside every data dir. While a lease is active the autostop watcher does
    not stop the box, and another holder (a teardown from another controller) is refused; so a stage that pulls and
    load-verifies for minutes is not stopped under it.
  - O(state=held) takes the box for O(token), or refreshes the lease O(token) already holds, for O(ttl_s) seconds
    from now. Another token's unexpired lease fails the module, naming its holder and until when it holds.
  - O(state=released) gives the box back when O(token) holds it (nothing to do otherwise).
  - A lease expires by itself after O(ttl_s), so a controller that dies mid-stage never pins the box. An unreadable
    lease file holds the box (a stop must not guess) until it is 4 hours old.
  - M(remote_gpu.trainer.teardown) takes the lease in its gate
    (O(remote_gpu.trainer.teardown_gate#module:hold_box)), refreshes it with this module before each long step and
    releases it before the meter-stop.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux, Python 3.8+ on the box.
options:
  token:
    description: The stage's own token (letters, digits and C(_.:-), at most 128).
    type: str
    required: true
  state:
    description: C(held) takes or refreshes the lease; C(released) gives it back.
    type: str
    choices: [held, released]
    default: held
  holder:
    description: Who holds the box, as the watcher and a refusal name it (lower-case letters, digits, C(_), C(-)).
    type: str
    default: teardown
  ttl_s:
    description: Seconds the lease lasts from now, 1 to 14400 (with O(state=held)).
    type: float
    default: 900
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Nothing is written; C(changed) says whether the lease would be taken, refreshed or released, and
      another holder fails the module as it would.
seealso:
  - module: remote_gpu.trainer.teardown_gate
"""

EXAMPLES = r"""
- name: Hold the box while copying results off it by hand
  remote_gpu.trainer.box_lease:
    token: "copy-{{ 999999 | random }}"
    holder: copy
    ttl_s: 3600
  register: lease

- name: Give the box back
  remote_gpu.trainer.box_lease:
    token: "{{ lease.lease.token }}"
    state: released
"""

RETURN = r"""
lease:
  description: The lease O(token) holds after the call (C(holder), C(token), C(since), C(until), ISO 8601 UTC), or
    null (released, or check mode).
  returned: always
  type: dict
held_by:
  description: Another holder's lease that refused the call (C(holder), C(token), C(since), C(until)), or null.
  returned: always
  type: dict
released:
  description: The lease of O(token) was removed (O(state=released)).
  returned: always
  type: bool
msg:
  description: One line saying what was done.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_hold as holding

ARGUMENT_SPEC = {
    "token": {"type": "str", "required": True, "no_log": False},
    "state": {"type": "str", "choices": ["held", "released"], "default": "held"},
    "holder": {"type": "str", "default": "teardown"},
    "ttl_s": {"type": "float", "default": 900.0},
}
OPTION_BOUNDS = {"ttl_s": Between(1, holding.MAX_TTL_S)}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    params = module.params
    try:
        token, ttl_s = holding.checked(params["token"], params["ttl_s"], "box_lease")
    except ValueError as exc:
        module.fail_json(msg=str(exc).replace("box_lease.", "", 1))
    if not holding.HOLDER_NAME.match(params["holder"]):
        module.fail_json(msg=f"holder must match {holding.HOLDER_NAME.pattern}, not {params['holder']!r}")
    empty = {"lease": None, "held_by": None, "released": False}
    if params["state"] == "released":
        current = holding.current()
        mine = current is not None and current.get("token") == token
        if module.check_mode or not mine:
            module.exit_json(changed=mine, msg="would release the box" if mine else "the token holds no lease", **empty)
        released, problem = holding.release(token)
        if problem:
            module.fail_json(msg=problem, **empty)
        module.exit_json(changed=released, **{**empty, "released": released}, msg="released the box")
    if module.check_mode:
        current = holding.current()
        if current is not None and current.get("token") != token:
            module.fail_json(msg=holding.held_by(current), **{**empty, "held_by": current})
        module.exit_json(changed=True, msg=f"would hold the box for {ttl_s:g} s", **empty)
    lease, other, problem = holding.hold(token, ttl_s, params["holder"])
    if other is not None:
        module.fail_json(msg=holding.held_by(other), **{**empty, "held_by": other})
    if problem:
        module.fail_json(msg=problem, **empty)
    module.exit_json(changed=True, msg=f"holding the box until {lease and lease['until']}", **{**empty, "lease": lease})


if __name__ == "__main__":
    main()
