#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: teardown
short_description: Tear one rented box down behind the gate, in one controller step
version_added: "0.1.0"
description:
  - An action plugin; the role C(remote_gpu.trainer.teardown) maps its variables (C(teardown_<option>)) onto these
    options. Every step and status is described in C(docs/teardown.md).
  - "The gate: M(remote_gpu.trainer.teardown_gate) on the box judges the runs (over, every cell done, every durable
    artifact re-hashed now) and, when the meter is to be stopped, the whole instance: every other run on it, in every
    data dir of the box (those launches registered, and those a live run's marker names), torn down already or named
    in O(abandon_runs) (a finished or archived one loses nothing by a verb that keeps data_dir and durable_dir), no
    live process of any run, no process using a GPU outside every run unless O(abandon_gpu_users), the box's own id
    (read from O(instance_id_env)) equal to O(instance_id), and for an irreversible verb the durable directory on
    another device than data_dir."
  - Then, on the controller, the durable directory must survive the verb that runs (O(meter_stop_verbs)), the pull
    with rsync over the connection's own SSH command (ControlPath included) must verify by size and sha256, and the
    load-verify command must pass on every chosen artifact.
  - Only when O(confirm) names the host, M(remote_gpu.trainer.run_scratch) removes the runs' scratch (each cell's
    durable files re-hashed right before its scratch goes) and the verb runs from the controller, polled until the
    provider's status says the instance stopped. A per-box lock on the controller keeps a second teardown of the
    same instance from running at the same time; on the box, the gate takes the box lease (outside check mode), so
    the autostop watcher does not stop the box in the middle of the pull or the load-verify, and a teardown from
    another controller is refused (C(box_lease)). M(remote_gpu.trainer.box_lease) refreshes it before each long step
    and gives it back before the meter-stop, or when the teardown stops early; it expires by itself.
  - The record (the task's result) has the status C(TORN_DOWN), C(CLEANED), C(CHECKED), C(UNCONFIRMED),
    C(STOP_BY_HAND), C(REFUSED), C(FAILED) or C(UNREACHABLE); the task itself does not fail, so the report step sees
    every box. M(remote_gpu.trainer.stage_verdict) turns it into the play's outcome.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  runs:
    description: A run name, several (a list or commas), or C(all) for every run on the box.
    type: raw
    required: true
  stop_meter:
    description: Stop the instance's meter; C(false) removes only the named runs' scratch (C(CLEANED)).
    type: bool
    default: true
  abandon_runs:
    description: Other runs on the box that the meter-stop may lose, in any of its data dirs; each is listed with
      what it loses.
    type: list
    elements: str
    default: []
  abandon_gpu_users:
    description: Let the meter-stop kill the processes that use a GPU outside every run (a job started by hand);
      each is named in the warnings. Without it such a process refuses the box at C(gpu_users). O(stop_running)
      never stops them.
    type: bool
    default: false
  data_dir:
    description: The box's scratch directory (absolute).
    type: str
    required: true
  durable_dir:
    description: The durable directory (absolute).
    type: str
    default: ""
  confirm:
    description: Host names (a list, or one string separated by commas or spaces) or C(all) approving the scratch
      removal, the meter-stop and O(stop_running).
    type: raw
    default: ""
  stop_running:
    description: Stop the live runs being torn down, then run the gate again; needs O(confirm).
    type: bool
    default: false
  stop_grace_s:
    description: Seconds between SIGTERM and SIGKILL for O(stop_running); 0 to 3600.
    type: float
    default: 30
  accept_incomplete_cells:
    description: Cells that may be unfinished.
    type: list
    elements: str
    default: []
  accept_no_artifacts:
    description: Let a run without artifacts pass.
    type: bool
    default: false
  verify_timeout_s:
    description: Deadline of each hashing of a copy; 1 to 86400.
    type: float
    default: 1800
  pull_to:
    description: Controller directory for C(<pull_to>/<host>/<run>/); empty for no pull.
    type: str
    default: ""
  pull_timeout_s:
    description: Seconds one run's rsync may take; 1 to 604800.
    type: float
    default: 7200
  load_verify_artifacts:
    description: fnmatch patterns over C(cells/<cell>/<path>) choosing the artifacts to load.
    type: list
    elements: str
    default: []
  load_verify_on:
    description: C(box) or C(controller). The command is the variable C(teardown_load_verify_cmd), rendered per
      artifact with C(artifact) set.
    type: str
    default: box
  load_verify_timeout_s:
    description: Seconds each load check may run; 1 to 86400.
    type: float
    default: 300
  scratch_extra_paths:
    description: More absolute paths inside data_dir removed with the scratch.
    type: list
    elements: str
    default: []
  scratch_timeout_s:
    description: Deadline of the scratch removal; 1 to 86400.
    type: float
    default: 600
  meter_stop_verb:
    description: The verb of O(meter_stop_verbs) that runs; C(none) stops nothing.
    type: str
    default: none
  meter_stop_verbs:
    description: The profile's verbs, each declared once (see C(docs/teardown.md)).
    type: dict
    default: {}
  instance_id:
    description: The provider's id of the instance; required when the verb runs a command.
    type: str
    default: ""
  instance_id_env:
    description: Environment variables in which the platform tells the box its own id.
    type: list
    elements: str
    default: []
  meter_stop_timeout_s:
    description: Seconds to wait for a final state after the verb; 0 to 86400.
    type: float
    default: 300
  meter_stop_poll_interval_s:
    description: Seconds between status polls; 0.1 to 3600.
    type: float
    default: 5
  data_loss_clocks:
    description: The profile's data-loss clocks, kept in the record.
    type: list
    elements: str
    default: []
  platform:
    description: The profile's platform name, for the lines.
    type: str
    default: ""
  lock_wait_s:
    description: Seconds to wait for another teardown of the same box before refusing; 0 to 86400.
    type: float
    default: 10
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The whole gate runs (the pull as an rsync --dry-run); the scratch removal and the meter-stop only say
      what they would do.
  action:
    description: Runs on the controller and calls the box's modules.
    support: full
seealso:
  - module: remote_gpu.trainer.teardown_gate
  - module: remote_gpu.trainer.run_scratch
  - module: remote_gpu.trainer.meter_stop
  - module: remote_gpu.trainer.stage_report
  - module: remote_gpu.trainer.stage_verdict
"""

EXAMPLES = r"""
- name: Tear this box down behind the gate
  remote_gpu.trainer.teardown:
    runs: abl-2026-12
    data_dir: "{{ data_dir }}"
    durable_dir: "{{ durable_dir }}"
    pull_to: backups
    confirm: "{{ confirm_teardown | default('') }}"
    meter_stop_verb: "{{ meter_stop_verb }}"
    meter_stop_verbs: "{{ meter_stop_verbs }}"
    instance_id: "{{ instance_id }}"
    instance_id_env: "{{ instance_id_env }}"
  register: teardown_box
"""

RETURN = r"""
status:
  description: TORN_DOWN, CLEANED, CHECKED, UNCONFIRMED, STOP_BY_HAND, REFUSED, FAILED or UNREACHABLE.
  returned: always
  type: str
step:
  description: The step that stopped the box (null when none did).
  returned: always
  type: str
reason:
  description: Why, in one line.
  returned: always
  type: str
line:
  description: The box's line, as the report prints it.
  returned: always
  type: str
gate:
  description: Per run its state, cells done and durable copy verified; the instance's evidence (other runs, id
    check, devices).
  returned: when the gate ran
  type: dict
pull:
  description: Per run the controller copy, what rsync received and what verified.
  returned: when the gate passed
  type: dict
load_verify:
  description: Where it ran, how many checks and which failed.
  returned: when the gate passed
  type: dict
scratch:
  description: What run_scratch removed (or would remove).
  returned: when the box got that far
  type: dict
meter_stop:
  description: The meter-stop's state (would_run, already, stopped, manual, failed, none, not_asked) and the
    parsed provider states.
  returned: when the box got that far
  type: dict
warnings:
  description: Irreversible verbs, abandoned runs, accepted cells, the gate's notes, a bad C(hourly_usd) (the box is
    torn down all the same, without a cost) and a box clock ahead of the controller's.
  returned: always
  type: list
  elements: str
cost:
  description: With the host variable C(hourly_usd), what the box cost up to its teardown, C(hourly_usd),
    C(since) (the gate's C(instance.box_started_at), the ledger's first sight of the rental), C(hours) (the gate's
    C(instance.ledger) running hours, on the box's clock, plus the time this teardown took since the gate) and
    C(usd) (rounded to cents; null with C(since) when the box sent no ledger and its start is unknown), and
    C(meter_stopped) true once this teardown stopped the meter (the box then
    leaves the summary's total per hour); null without C(hourly_usd) or with a bad one.
  returned: always
  type: dict
"""
