#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: patrol
short_description: One patrol tick of one rented box, in one controller step
version_added: "0.1.0"
description:
  - An action plugin; the role C(remote_gpu.trainer.patrol) maps its variables (C(patrol_<option>)) onto these
    options. The decision table, the per-cell states and the report are described in C(docs/patrol.md).
  - Calls M(remote_gpu.trainer.patrol_facts) once on the box, always with the box's base Python (O(python)), never
    the runtime venv's interpreter, which lives under the data directory (a hung data directory would hang the
    exec itself); the module loads the venv's libraries inside its own probes, under their deadline.
  - The record (the task's result) holds the box's state, whether it is escalated, its reasons and problem ids, per
    run and per cell what patrol_facts found, and the box's line. The task itself does not fail, so the report step
    sees every box; M(remote_gpu.trainer.stage_report) writes the fleet's report and sends the notifications, and
    M(remote_gpu.trainer.stage_verdict) turns the record into the play's outcome.
  - Read-only on the box but for patrol_facts' own log cursors and its tick file (none in check mode).
  - The line also shows what the box's autostop will do and what the box costs so far (host variable
    C(hourly_usd)); a box with no live run for over O(idle_billing_minutes) escalates with problem C(idle_billing).
    An autostop stop older than the container's start is history (the box was restarted), so the line says whether
    the watcher is armed again, and idle_billing counts as for any idle box.
  - A box that does not answer is asked about at its provider, from the controller, read-only, with the status
    command of the profile's C(meter_stop_verb) (host variables C(meter_stop_verb), C(meter_stop_verbs),
    C(instance_id)) and told apart (C(box_state)) as C(STOPPED) (the provider says stopped and we stopped it, the
    box's autostop or a teardown, as the previous patrol report and teardown's report in C(patrol_report_dir) say;
    or its owner did, by the status' C(intended_key)), C(INTERRUPTED) (stopped, no stop of ours on record, or the
    intended state still running), C(GONE) (no longer listed) or C(UNREACHABLE) (the provider says it runs, or
    could not be asked, and the line says why). A stopped box bills its storage (host variable
    C(hourly_usd_stopped), the profile's C(stopped_bills)) instead of its GPU rate, from the stop on.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  data_dir:
    description: The box's data directory (absolute); runs live in C(<data_dir>/runs/).
    type: str
    required: true
  run:
    description: Patrol only this run (a run name); empty patrols every run. A name not on the box is an error.
    type: str
    default: ""
  durable_dir:
    description: Durable directory to measure (absolute); empty uses each run's own C(durable_dir).
    type: str
    default: ""
  stall_after_s:
    description: Seconds without log growth, timed by the ticks, after which a live cell is stalled; 1 to 604800.
    type: int
    default: 1800
  gpu_idle_pct:
    description: GPU utilization (percent) at or below which a GPU counts as idle; 0 to 100.
    type: float
    default: 5
  gpu_idle_samples:
    description: Newest monitor samples that must all see a cell's GPUs idle for it to be stalled; 0 to 1000.
    type: int
    default: 10
  disk_pressure_pct:
    description: Bytes or inodes used (percent) at or over which the box is C(disk_pressure); above 0, at most 100.
    type: float
    default: 95
  gpu_backend:
    description: How the GPUs are read.
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
  kernel_log:
    description: Look for Xids in the kernel log since the newest run started.
    type: bool
    default: true
  crash_patterns:
    description: Crash signatures of your own, C({name, regex}) each.
    type: list
    elements: dict
    default: []
  progress_regex:
    description: Regular expression for the progress marker (named groups C(epoch), C(epochs), C(step), C(steps)).
    type: str
    default: ""
  max_scan_bytes:
    description: New bytes read per cell log per tick, at most; 65536 to 1 GiB.
    type: int
    default: 67108864
  timeout_s:
    description: Deadline in seconds of each of the module's probe rounds; above 0, at most 600.
    type: float
    default: 10
  python:
    description:
      - The box's Python for the module. Empty uses C(ansible_python_interpreter) when the inventory names one,
        else C(python3).
    type: str
    default: ""
  idle_billing_minutes:
    description:
      - Minutes the box may bill with no live run before it escalates with problem C(idle_billing) (action
        C(teardown)), unless its armed autostop, on its current settings, will stop it (state C(idle_wait),
        C(silence_wait), C(stopping) or C(stopped)). A number above 0 and at most 43200; C(null) turns it off.
      - The money comes from the host variable C(hourly_usd) (US dollars per hour); a bad value is a warning on the
        line (RV(cost_warning)), never a refusal.
    type: raw
    default: 60
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The same reading; patrol_facts keeps no cursor, and the report step sends nothing.
  action:
    description: Runs on the controller and calls the box's module.
    support: full
seealso:
  - module: remote_gpu.trainer.patrol_facts
  - module: remote_gpu.trainer.stage_report
  - module: remote_gpu.trainer.stage_verdict
"""

EXAMPLES = r"""
- name: Patrol this box
  remote_gpu.trainer.patrol:
    data_dir: "{{ data_dir }}"
    stall_after_s: 1800
  register: patrol_box
"""

RETURN = r"""
status:
  description: The state in capitals (RUNNING, STALLED, ..., STOPPED, INTERRUPTED, UNREACHABLE), as
    M(remote_gpu.trainer.stage_report) reads it.
  returned: always
  type: str
state:
  description: The box's state, the worst among its runs and probes; for a box that did not answer C(stopped),
    C(interrupted) or C(unreachable) (a C(GONE) box too), by its C(box_state).
  returned: always
  type: str
escalate:
  description: Whether a human or automation must act.
  returned: always
  type: bool
reasons:
  description: One line per reason, each naming its run and cell.
  returned: always
  type: list
  elements: str
problems:
  description: Stable problem ids (C(<kind>:<run>) or C(<kind>:<run>/<cell>) for a run's; box-level ones plain).
  returned: always
  type: list
  elements: str
actions:
  description: The findings vocabulary's actions for the escalated problems.
  returned: always
  type: list
  elements: str
headline:
  description: The run the state comes from with that run's cell counts, or how many runs need attention.
  returned: when the box answered
  type: str
runs:
  description: Per run its state, compact summary, ETA and cells (see M(remote_gpu.trainer.patrol_facts)).
  returned: always
  type: list
  elements: dict
examined_runs:
  description: The runs this tick examined (a filtered tick never clears the others' problems).
  returned: always
  type: list
  elements: str
line:
  description: The box's line, as the report prints it.
  returned: always
  type: str
python:
  description: The Python patrol_facts ran with.
  returned: when the box was reachable
  type: str
box:
  description: patrol_facts' C(box) (C(since), C(box_now), C(ledger), C(container_started_at), C(live_runs),
    C(idle), C(idle_since), C(runs_done)), each field checked; null when the box did not answer it.
  returned: always
  type: dict
autostop:
  description: patrol_facts' C(autostop) (C(armed), C(state), C(reason), C(due_at), C(idle_s), C(idle_needed_s),
    C(silence_s), C(silence_needed_s), C(trigger), C(gate), C(stop), C(watcher_pid), C(watcher_alive),
    C(generation), C(generation_current), C(armed_by), ...), each field checked; null when the box did not answer it.
  returned: always
  type: dict
cost:
  description: What the box costs, C({hourly_usd, since, hours, usd}) (and C(note) when the box's figures are odd),
    from the host's C(hourly_usd) and the box's cost ledger (C(box.ledger), its running hours since C(since), the
    rental's first sight, a stopped interval not billed), counted on the box's own clock (C(box.box_now)); null
    when C(hourly_usd) is unset or bad. A stopped box's adds C(stopped_at) (where its GPU hours end),
    C(hourly_usd_stopped) (what it bills now, null when unknown) and C(storage_usd) (what storage cost since the
    stop, in C(usd)).
  returned: always
  type: dict
cost_warning:
  description: Why C(hourly_usd) (or C(hourly_usd_stopped)) was not used (one line naming it), else null.
  returned: always
  type: str
idle_billing:
  description: The box's idle time, C({idle_s, hourly_usd, burning_usd, since}) (C(idle_s) the box's C(box_now)
    minus its C(idle_since), one clock; C(burning_usd) what the idle time cost so far, null without a rate; C(since)
    the box's C(idle_since)), when no run is live; null when a run is
    live, the box did not say when it went idle, or O(idle_billing_minutes) is null.
  returned: always
  type: dict
box_state:
  description: C(RUNNING) (it answered), C(STOPPED), C(INTERRUPTED), C(GONE) or C(UNREACHABLE) (see the description);
    a box that answered whose autostop's confirmed stop is newer than its container's start is C(STOPPED).
  returned: always
  type: str
provider:
  description: What the provider said of a box that did not answer, C({asked, says, state, intended, intended_stop,
    error, command}) (C(says) stopped, gone or running; C(error) why it was not asked or gave no answer).
  returned: when the box did not answer
  type: dict
our_stop:
  description: The stop of ours behind a C(STOPPED) box, C({by, at, source, inferred}) (C(by) autostop or teardown;
    C(inferred) when the autostop was due at C(at) on the last tick and the box's own record is out of reach).
  returned: always
  type: dict
last_seen:
  description: For a box that did not answer, the last tick that saw it run, C({at, since}) (C(since) its billing
    start then).
  returned: when the box did not answer
  type: dict
stopped_bills:
  description: What a stopped instance still bills, as the profile's C(stopped_bills) says; null when not declared.
  returned: always
  type: str
"""
