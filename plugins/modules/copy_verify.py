#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: copy_verify
short_description: Check that a copy of files holds each one with the expected size and a sha256 recomputed now
version_added: "0.1.0"
description:
  - Recomputes the size and sha256 of every file of O(expected) under O(path) and compares them. A file missing,
    of another size or content, a symbolic link, or reached through a symbolic link out of O(path) is a mismatch.
  - The teardown role runs it on the controller (C(delegate_to=localhost)) for the copy it pulled, with the
    digests M(remote_gpu.trainer.teardown_gate) recomputed on the box as O(expected).
  - Read-only. The reads happen in a forked child under O(timeout_s), so a hung mount fails instead of hanging.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  path:
    description: The copy's root directory (absolute).
    type: path
    required: true
  expected:
    description: The files the copy must hold, C(path) relative to O(path) (no leading C(/), no C(.) or C(..)
      parts), C(size) in bytes and C(sha256) (64 lowercase hex digits).
    type: list
    elements: dict
    required: true
  timeout_s:
    description: Deadline in seconds for reading and hashing the whole copy; 1 to 86400.
    type: float
    default: 1800
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The module changes nothing in any mode.
seealso:
  - module: remote_gpu.trainer.teardown_gate
"""

EXAMPLES = r"""
- name: Verify the copy pulled to the controller against the box's digests
  remote_gpu.trainer.copy_verify:
    path: "/backups/{{ inventory_hostname }}/sweep-lr"
    expected: "{{ gate.artifacts }}"
  delegate_to: localhost
  register: pulled
"""

RETURN = r"""
passed:
  description: Every expected file is there and matches.
  returned: always
  type: bool
files:
  description: Files found and compared.
  returned: always
  type: int
bytes:
  description: Bytes of the files compared.
  returned: always
  type: int
mismatches:
  description: Per file that does not match, C(path), C(problem), C(size) and C(sha256) found (null when
    unreadable), C(expected_size) and C(expected_sha256); at most 50 listed.
  returned: always
  type: list
  elements: dict
reason:
  description: One line naming the first mismatch, or why the copy could not be read; empty when it passed.
  returned: always
  type: str
msg:
  description: One line, the counts or the reason.
  returned: always
  type: str
  sample: "3 file(s), 12582912 bytes verified"
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, NonEmpty, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._copy_verify import verify_copy

ARGUMENT_SPEC = {
    "path": {"type": "path", "required": True},
    "expected": {"type": "list", "elements": "dict", "required": True},
    "timeout_s": {"type": "float", "default": 1800.0},
}
OPTION_BOUNDS = {"path": NonEmpty(), "timeout_s": Between(1, 86400)}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    try:
        result = verify_copy(module.params["path"], module.params["expected"], module.params["timeout_s"])
    except ValueError as exc:  # an expected entry that is not {path, size, sha256}: the message names it
        module.fail_json(msg=f"expected: {exc}")
    message = f"{result['files']} file(s), {result['bytes']} bytes verified" if result["passed"] else result["reason"]
    module.exit_json(changed=False, msg=message, **result)


if __name__ == "__main__":
    main()
