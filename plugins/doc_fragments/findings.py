# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The shape of a finding, shared by every module that returns C(findings).

ansible-core merges fragments into DOCUMENTATION only (options, attributes, notes, seealso), never into RETURN,
so each module's RETURN still names C(findings); the keys every finding has are documented here once.
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options: {}
notes:
  - Every entry of C(findings) has C(code) (a stable snake_case identifier), C(level) (C(WARN) or C(FAIL)), C(gpu)
    (a GPU index, or null for a box-level finding), C(message) (one line with the measured values) and C(action)
    (C(re_rent), C(reset_gpu), C(reap_zombies), C(free_disk), C(restart_job), C(investigate) or C(none)), plus the
    measured values behind it. The collection's findings contract and C(docs/findings.md) list every code.
"""
