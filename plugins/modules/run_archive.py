#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_archive
short_description: Move finished or crashed runs aside on a box, never deleting a byte, so patrol stops escalating
  them
version_added: "0.1.0"
description:
  - Renames each run's directory C(<data_dir>/runs/<run>) to C(<data_dir>/runs/.archive/<run>-<UTC stamp>) (stamp
    C(YYYYmmddTHHMMSSZ)) and writes a record beside it, C(<run>-<stamp>.json) (C(run), C(from), C(to),
    C(archived_at), C(reason)). One C(rename) on the runs' own filesystem; never a copy and a delete, so every file
    keeps its bytes and its inode. A rename that would cross filesystems (C(.archive) on another mount) fails and
    copies nothing.
  - B(Its durable copy moves with it.) The run's C(<durable_dir>/runs/<run>) (the durable_dir its C(run.json), else
    its C(spec.json), names) is renamed to C(<durable_dir>/runs/.archive/<run>-<stamp>) (the same entry name), so a
    new run of that name can never write over it; the record says where it went (C(durable)). The durable copy
    moves first, the scratch second; when the durable rename fails nothing of the run moved, and when the scratch
    rename fails the durable copy is moved back. A copy that holds another launch (its C(.launch.json)) is not this
    run's and stays, as does one that also holds cells the run has not (a sharded launch's, shared with its other
    boxes); a run with no durable copy moves its scratch only.
  - Patrol no longer lists an archived run (no escalation on every tick) and counts it; teardown's instance gate
    still counts it as a run on the box (its scratch may hold the only results), so a meter-stop needs it named in
    C(abandon_runs), or moved back and torn down.
  - B(Refusals) (nothing moved, for any run of O(run)). A live run (its runner lives, PID reuse guarded, or a
    process carries its C(RGT_RUN_DIR)), naming the processes; a run directory that does not exist (the closest
    existing run name suggested, else the runs on the box listed); a run whose teardown did not finish (tombstone
    state C(removing)); a run path that is not a directory; a C(.archive) that is a link or a file. A durable copy
    that cannot be moved (durable_dir not answering within 10 s (a hung mount), the copy or
    C(<durable_dir>/runs/.archive) on another filesystem than C(<durable_dir>/runs), its archive name taken, an
    unreadable C(.launch.json) (whose copy it is cannot be told), C(<durable_dir>/runs/.archive) a link or a file).
  - B(Idempotent.) A run already archived (no C(<data_dir>/runs/<run>), an archive entry of that name) or torn down
    already (its tombstone) is left as it is, C(changed=false), and RV(runs) says where it is.
  - The checks and the moves run under the box's launch lock (C(<data_dir>/runs/.launch.lock), as C(training_run)
    and teardown take it), in a forked child under O(timeout_s), so a hung data dir fails the module instead of
    hanging it.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+.
options:
  data_dir:
    description: The profile's scratch directory (absolute), holding C(runs/<run>/).
    type: path
    required: true
  run:
    description: The run to archive, or several (a list, or names separated by commas); each a directory name under
      C(<data_dir>/runs/) matching C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$).
    type: list
    elements: str
    required: true
    aliases: [runs]
  reason:
    description: Why the runs are retired; kept in each archive record.
    type: str
  timeout_s:
    description: Seconds the checks and the moves together may take, above 0 and at most 3600.
    type: float
    default: 60
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Every check runs (a refusal fails as it would); nothing is moved or written; RV(runs) says where each run
      would go.
notes:
  - Nothing is ever deleted. To drop an archived run for good, tear the box down with the run named in
    C(abandon_runs), or move it back, its durable copy first (C(mv <durable_dir>/runs/.archive/<run>-<stamp>
    <durable_dir>/runs/<run>), then C(mv <data_dir>/runs/.archive/<run>-<stamp> <data_dir>/runs/<run>), while no run
    of that name exists in either place) and tear it down with C(pull_to) like any run. See docs/archive.md.
"""

EXAMPLES = r"""
- name: Retire two finished runs so patrol stops escalating them
  remote_gpu.trainer.run_archive:
    data_dir: /workspace
    run: [abl-2026-11, smoke-test]
    reason: results pulled by hand
  register: archived
"""

RETURN = r"""
msg:
  description: >-
    One line for the box, one part per run, for example C(archive: abl -> .archive/abl-20261201T120000Z (durable
    copy -> /workspace/durable/runs/.archive/abl-20261201T120000Z\); nothing deleted),
    C(archive: abl already archived as .archive/abl-20261201T120000Z) or, on a refusal, why
    (C(archive: run abl is live: its runner is alive (pgid 4242\); stop it first; nothing moved)).
  returned: always
  type: str
runs:
  description: One entry per run of O(run), in order; empty when the data dir itself failed.
  returned: always
  type: list
  elements: dict
  contains:
    run: {description: The run's name., type: str}
    state:
      description: C(archived) (moved now), C(would_archive) (check mode), C(already_archived), C(torn_down)
        (teardown removed its scratch; nothing to move), C(refused) (see C(refused)) or C(not_moved) (another run
        was refused, or a move before it failed).
      type: str
    from: {description: 'The run''s directory, C(<data_dir>/runs/<run>).', type: str}
    path:
      description: Where the run is now (C(archived), C(already_archived)) or would be (C(would_archive),
        C(not_moved)); null otherwise.
      type: str
    record: {description: 'The archive record beside it (C(<path>.json)), when written or found; else null.', type: str}
    archived_at:
      description: UTC time of the move (ISO 8601), from the record for an earlier archive; or null.
      type: str
    reason: {description: 'O(reason) (or the earlier record''s), or null.', type: str}
    refused: {description: 'Why this run was refused (one line), or null.', type: str}
    durable:
      description: The run's durable copy and where it goes, as also kept in the record; null for a run torn down,
        refused before its durable copy was looked at, or archived before durable copies moved.
      type: dict
      contains:
        state:
          description: >-
            C(moved) (renamed now, or by the earlier archive), C(would_move) (check mode), C(not_moved)
            (another run was refused, or a rename failed; the copy is where it was), C(none) (no copy at C(from)),
            C(other_launch) (the copy at C(from) holds another launch: not this run's, left), C(shared) (it also
            holds cells this run has not, a sharded launch's other boxes': left for them; a launch that would
            write one of this run's cells there is refused) or C(no_durable_dir) (the run's files name none).
          type: str
        dir: {description: 'The durable_dir the run''s files name, or null.', type: str}
        from: {description: 'C(<durable_dir>/runs/<run>), or null.', type: str}
        to:
          description: C(<durable_dir>/runs/.archive/<run>-<stamp>) where the copy is or would be; null when nothing
            moves.
          type: str
refused:
  description: A run was refused or the data dir failed (nothing moved, unless a rename failed after earlier ones).
  returned: always
  type: bool
problems:
  description: Each refusal, one line naming the run; empty unless refused.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._archive import ArchiveRefused, archive_runs

ARGUMENT_SPEC = {
    "data_dir": {"type": "path", "required": True},
    "run": {"type": "list", "elements": "str", "required": True, "aliases": ["runs"]},
    "reason": {"type": "str"},
    "timeout_s": {"type": "float", "default": 60.0},
}
OPTION_BOUNDS = {"timeout_s": Between(0, 3600, above_low=True)}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    try:
        module.exit_json(**archive_runs(module.params, module.check_mode))
    except ValueError as exc:  # a bad run name or a relative data_dir: the message names the option
        module.fail_json(msg=str(exc), runs=[], refused=False, problems=[])
    except ArchiveRefused as exc:
        module.fail_json(msg=str(exc), **exc.facts)


if __name__ == "__main__":
    main()
