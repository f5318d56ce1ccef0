#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: teardown_gate
short_description: Check on the box that runs' scratch may go and, before a meter-stop, that the whole instance
  may stop
version_added: "0.1.0"
description:
  - The box's part of teardown's gate, on the collection's run layout contract (C(<data_dir>/runs/<run>/) and
    C(<durable_dir>/runs/<run>/)). One call judges every run of O(runs) (every run on the box when empty) and,
    with O(instance), the box itself. Each run stops at its first failed step; RV(step) and RV(reason) are the
    first failure in the order C(box_lease), C(instance_id), C(run_alive), C(cells), C(durable), C(other_runs),
    C(gpu_users), C(same_filesystem).
  - B(box_lease.) With O(hold_box) (never in check mode) the gate first takes the box for this teardown (the box
    lease in the instance directory, C(~/.remote_gpu_trainer/instance/box-lease.json) or C($RGT_INSTANCE_DIR));
    the autostop watcher does not stop a box while a lease is active. Another holder's unexpired lease (a teardown
    from another controller, the watcher stopping the box) refuses here and nothing else is judged. Once judged,
    the lease is held for O(hold_box.ttl_s) more; it expires by itself, so a controller that dies never pins the
    box. M(remote_gpu.trainer.teardown) refreshes it with each later box call and gives it back at its end.
  - B(instance_id.) With O(instance_id), each variable of O(instance_id_env) is read from the module's
    environment, then from C(/proc/1/environ) (containers keep the platform's variables in PID 1's environment).
    A value that is neither O(instance_id) nor C(C.) followed by it (Vast.ai's label) refuses. When the box tells
    no id, the gate passes with RV(instance) C(id_checked) false and a note.
  - B(run_alive.) The run is found, its runner is not alive (the PID-reuse guard of C(training_run)) and no process
    carrying the run's C(RGT_RUN_DIR) in its environment is left (a worker that called C(setsid) still counts).
  - B(cells.) Every cell of C(run.json) is done (C(succeeded), with its sync C(verified), or C(skipped) where the
    run declares no artifacts), or named in O(accept_incomplete_cells).
  - B(durable.) Every artifact recorded in the done cells' C(result.json) is under C(<durable_dir>/runs/<run>/),
    a regular file (not a symbolic link, not reached through one out of that directory), whose size and a sha256
    recomputed now equal the record; C(MANIFEST.sha256) holds the same size and sha256 for it; and the scratch
    file it was copied from, where it still exists, hashes the same (else the copy is stale). Neither the durable
    copy nor O(durable_dir) (resolved) may overlap what teardown removes, C(<data_dir>/runs) or an entry of
    O(scratch_extra_paths); a durable_dir elsewhere inside O(data_dir) (C(/workspace/durable) in
    C(/workspace)) is fine. A run that secured no artifacts fails here unless O(accept_no_artifacts).
  - A run already torn down (the tombstone C(<data_dir>/runs/.torn_down/<run>.json) written by
    M(remote_gpu.trainer.run_scratch), no run directory), or whose removal did not finish (tombstone state
    C(removing), run directory half gone), passes the first two steps, and its durable copy is recomputed
    against its C(MANIFEST.sha256).
  - B(other_runs.) With O(instance), every other run on the box must be torn down already (tombstone, no
    scratch), and no live process may carry any run's marker, unless the run is named in O(abandon_runs). The box
    is every data dir it knows, not only O(data_dir); each data dir a launch registered on the box
    (M(remote_gpu.trainer.training_run) writes C(data_dirs.json) in the instance directory) and each one a live
    process's C(RGT_RUN_DIR) names. A run of another data dir is named with it (C(run r2 in /root/scratch) and
    what it would lose); an empty O(runs) means every run of O(data_dir) only. A refusal names each such run,
    its state and what it would lose; abandoned runs never refuse and are listed with what they lose. Runs
    archived under C(<data_dir>/runs/.archive/) (M(remote_gpu.trainer.run_archive)) count too, as they may hold
    the only results.
  - What the stop keeps decides whether a run that is over loses anything. When O(survives) names both
    C(data_dir) and C(durable_dir), an archived run, or a finished one (DONE, nothing of it live), whose data dir
    and durable dir lie on the filesystems of O(data_dir) and O(durable_dir) loses nothing by the stop and does
    not refuse (a note names it); otherwise it refuses as any other run.
  - B(gpu_users.) With O(instance), no process may use a GPU (hold a C(/dev/nvidia<N>) open) outside every run;
    a job started by hand (C(setsid nohup python3 train.py)) carries no run marker, and the meter-stop would kill
    it. The refusal names its pid, name and GPUs; O(abandon_gpu_users) lets the stop go on, named in the notes.
  - B(same_filesystem.) With O(instance) and O(irreversible), O(durable_dir) (or its nearest existing parent)
    must not have the C(st_dev) of O(data_dir), since an irreversible verb destroys both.
  - Read-only. Every read of O(data_dir) and O(durable_dir) happens in a forked child under a deadline, so a
    hung mount fails the gate instead of hanging the play.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+ on the box.
options:
  runs:
    description: The runs to tear down, each a directory name under C(<data_dir>/runs/) matching
      C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$); empty means every run on the box.
    type: list
    elements: str
    default: []
    aliases: [run]
  data_dir:
    description: The profile's scratch directory (absolute), holding C(runs/<run>/).
    type: path
    required: true
  durable_dir:
    description: The profile's durable directory (absolute), holding C(runs/<run>/). Required when a run has
      artifacts.
    type: path
  scratch_extra_paths:
    description: The absolute paths teardown removes beside the runs' directories (the profile's
      C(scratch_extra_paths)); the durable copy must not overlap any of them.
    type: list
    elements: path
    default: []
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
  instance:
    description: The teardown stops the instance's meter, so the gate judges the whole box (C(other_runs),
      C(same_filesystem)), not only O(runs).
    type: bool
    default: false
  abandon_runs:
    description: Other runs on the box the user gives up (with O(instance)); each is listed with what it loses
      and never refuses. A run may not be in both O(runs) and O(abandon_runs).
    type: list
    elements: str
    default: []
  survives:
    description: What the meter-stop keeps, from its verb's C(survives) (C(data_dir), C(durable_dir)); with both, a
      finished or archived run on those filesystems loses nothing by the stop and does not refuse (O(instance)).
    type: list
    elements: str
    choices: [data_dir, durable_dir]
    default: []
  abandon_gpu_users:
    description: Let the meter-stop kill the processes that use a GPU outside every run (O(instance)); each is
      named in the notes. Without it such a process refuses at C(gpu_users).
    type: bool
    default: false
  hold_box:
    description: Take the box for this teardown before it is judged, and hold it for C(ttl_s) seconds once judged
      (refreshed by a later call with the same C(token)). Nothing is taken in check mode.
    type: dict
    suboptions:
      token:
        description: This teardown's own token (letters, digits and C(_.:-), at most 128); another token's lease
          refuses at C(box_lease).
        type: str
        required: true
      ttl_s:
        description: Seconds the lease lasts after the gate, 1 to 14400; it expires by itself after them.
        type: float
        default: 900
  instance_id:
    description: The instance the controller is about to stop; checked against the id the box tells
      (O(instance_id_env)). Empty skips the check.
    type: str
    default: ''
  instance_id_env:
    description: Environment variables that hold the box's own instance id, in order (C(RUNPOD_POD_ID);
      C(CONTAINER_ID), C(VAST_CONTAINERLABEL)).
    type: list
    elements: str
    default: []
  irreversible:
    description: The meter-stop verb destroys the instance's disks (with O(instance)); then O(durable_dir) on the
      filesystem of O(data_dir) refuses.
    type: bool
    default: false
  verify_timeout_s:
    description: Deadline in seconds for reading and hashing each run's durable copy and scratch files, each; 1
      to 86400.
    type: float
    default: 1800
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The module changes nothing on the runs in any mode; with O(hold_box), outside check mode, it writes the
      box lease.
seealso:
  - module: remote_gpu.trainer.copy_verify
  - module: remote_gpu.trainer.run_scratch
"""

EXAMPLES = r"""
- name: Check that every run on the box is safe before a RunPod pod is deleted
  remote_gpu.trainer.teardown_gate:
    runs: [sweep-lr]
    data_dir: /workspace
    durable_dir: /workspace/durable
    instance: true
    irreversible: true
    instance_id: abc123xyz
    instance_id_env: [RUNPOD_POD_ID]
    abandon_runs: [smoke-test]
  register: gate

- name: Refuse when the gate did not pass
  ansible.builtin.fail:
    msg: "{{ gate.step }}: {{ gate.reason }}"
  when: not gate.passed
"""

RETURN = r"""
passed:
  description: Every run and every instance check passed.
  returned: always
  type: bool
step:
  description: The first failed step, C(box_lease), C(instance_id), C(run_alive), C(cells), C(durable),
    C(other_runs), C(gpu_users) or C(same_filesystem); null when the gate passed.
  returned: always
  type: str
reason:
  description: One line saying why that step failed, naming the run; empty when the gate passed.
  returned: always
  type: str
  sample: "run r1: durable copy does not match: cells/a/best.pth: 1024 bytes, expected 4096"
runs:
  description: One entry per run judged, in order.
  returned: always
  type: list
  elements: dict
  contains:
    passed: {description: The run passed every step., type: bool}
    step: {description: 'The run''s first failed step, or null.', type: str}
    reason: {description: 'Why, or empty.', type: str}
    run:
      description: C(name), C(state) (C(running), C(stopped), C(done), C(absent), C(torn_down) or C(removing)),
        and from C(run.json) C(pgid), C(sid) and C(started_at).
      type: dict
    cells:
      description: Per cell of C(run.json), C(name), C(status) (C(succeeded), C(failed), or null without a
        result), C(sync), C(done) and C(accepted) (unfinished, but named in O(accept_incomplete_cells)).
      type: list
      elements: dict
    missing_cells: {description: The cells neither done nor accepted., type: list, elements: str}
    durable:
      description:
        - C(dir) (C(<durable_dir>/runs/<run>)), C(exists), C(files) and C(bytes) compared, C(mismatches) (each
          C(path) and C(problem), with C(size), C(sha256), C(expected_size) and C(expected_sha256) where known),
          C(manifest) (C(path), C(sha256) of the manifest file, C(lines), C(bad_lines), and C(known_bad), the C(path)
          and C(bad) kind, for example C(non-finite), of each copy a check of the run refused, as the manifest marks it
          with a C(# bad) comment) and C(extra) (files there that the manifest does not list).
      type: dict
    artifacts:
      description: The durable copy's files as recomputed now, C(path) (relative to C(<durable_dir>/runs/<run>/)),
        C(size) and C(sha256); what a pull must match, and the run's entry of run_scratch's
        O(remote_gpu.trainer.run_scratch#module:expected). Empty unless the run passed.
      type: list
      elements: dict
    scratch: {description: 'C(dir) (C(<data_dir>/runs/<run>)) and whether it C(exists).', type: dict}
    torn_down:
      description: The tombstone of an earlier teardown (C(run), C(state), C(removed_at), C(removed)) when the
        run is torn down or its removal did not finish; null otherwise.
      type: dict
    notes: {description: What the gate noticed about the run without failing., type: list, elements: str}
instance:
  description:
    - The box. C(runs_on_box) (listed with O(instance) or empty O(runs)); C(data_dirs), every data dir of the box
      judged (O(data_dir) first); C(other_runs), each C(name), C(data_dir) (where it lies), C(label) (the name, with
      C(in <data_dir>) for another data dir and C((as .archive/<entry>\)) for an archived run), C(state)
      (C(running), C(finished), C(stopped), C(removing), C(unknown), C(absent), C(torn_down) or C(archived)),
      C(archived) (the archive entry's name, or null), C(torn_down),
      C(abandoned), C(kept) (the stop keeps its disk, see O(survives)), C(would_lose) (one line, for example C(2
      cells' scratch (1.5 GiB\), 3 durable files not pulled)), C(pids), C(cells), C(bytes), C(durable_files);
      C(live_marker_pids) (live processes carrying the marker of a run not in O(runs), in any data dir).
    - C(gpu_users), each process using a GPU outside every run (C(pid), C(name), C(command), C(gpus)), at most 20;
      C(gpu_users_unreadable), how many processes' open files could not be read (another user's).
    - An archived run's entry also says where its scratch lies (C(data_dir), C(scratch_dir)) and where its durable
      copy is (C(durable_dir), the archived copy's directory, or null when it has none; C(durable_moved), whether
      the archive moved it out of reach of a new run of its name; C(durable_files), the entries of its manifest;
      C(durable_verified), every entry there at its listed size, null without a copy; C(durable_check), C(size);
      C(durable_problem), why it does not verify or was not found, or null). See docs/archive.md.
    - C(id_checked), C(id_expected), C(id_found), C(id_source) (the variable and where it was read);
      C(same_device) (null when not compared), C(data_dev), C(durable_dev).
    - The box's cost ledger, whatever the verdict, with or without O(instance), read only (the gate records
      nothing). C(box_started_at), since when the box bills (ISO 8601 UTC ending in C(Z)), the ledger's
      C(first_seen) (the rental's first sight, the earliest of the ledger's own, PID 1's start and, before a
      ledger exists, the runs' C(started_at); a start before 2000 or more than a day ahead is ignored);
      C(box_now), the box's own clock; C(ledger), C({first_seen, running_s, segments_total, segments, stopped_at,
      notes}) as training_run returns it (C(running_s), the seconds the box ran over every boot, a stopped
      interval not counted). Teardown's cost counts from it, on the box's clock.
  returned: always
  type: dict
lease:
  description: The box lease this teardown holds after the call (C(holder), C(token), C(since), C(until)), or null
    (no O(hold_box), check mode, or not taken).
  returned: always
  type: dict
held_by:
  description: Another stage's lease that refused the gate at C(box_lease) (C(holder), C(token), C(since), C(until)),
    or null.
  returned: always
  type: dict
notes:
  description: What the gate noticed about the box without failing (an id not cross-checked, abandoned runs and
    what they lose, runs the stop keeps, abandoned GPU users, an O(abandon_runs) name not on the box, the box lease
    not taken).
  returned: always
  type: list
  elements: str
msg:
  description: One line, C(gate passed) or the failed step and its reason.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, NonEmpty, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate

ARGUMENT_SPEC = {
    "runs": {"type": "list", "elements": "str", "default": [], "aliases": ["run"]},
    "data_dir": {"type": "path", "required": True},
    "durable_dir": {"type": "path"},
    "scratch_extra_paths": {"type": "list", "elements": "path", "default": []},
    "accept_incomplete_cells": {"type": "list", "elements": "str", "default": []},
    "accept_no_artifacts": {"type": "bool", "default": False},
    "instance": {"type": "bool", "default": False},
    "abandon_runs": {"type": "list", "elements": "str", "default": []},
    "instance_id": {"type": "str", "default": ""},
    "instance_id_env": {"type": "list", "elements": "str", "default": []},
    "irreversible": {"type": "bool", "default": False},
    "verify_timeout_s": {"type": "float", "default": 1800.0},
    "survives": {"type": "list", "elements": "str", "choices": ["data_dir", "durable_dir"], "default": []},
    "abandon_gpu_users": {"type": "bool", "default": False},
    "hold_box": {
        "type": "dict",
        "options": {
            "token": {"type": "str", "required": True, "no_log": False},
            "ttl_s": {"type": "float", "default": 900.0},
        },
    },
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
        result = teardown_gate(module.params, check_mode=module.check_mode)
    except ValueError as exc:  # a name or path only the layout's rules can judge: the message names the option
        module.fail_json(msg=str(exc))
    message = "gate passed" if result["passed"] else f"{result['step']}: {result['reason']}"
    module.exit_json(changed=False, msg=message, **result)


if __name__ == "__main__":
    main()
