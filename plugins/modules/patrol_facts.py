#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: patrol_facts
short_description: One read-only patrol tick of a rented GPU box, its training runs and their cells
version_added: "0.1.0"
description:
  - Gathers, in one call, everything a patrol needs to judge a box and returns the C(patrol_facts) fields of the
    collection's findings contract under C(ansible_facts.patrol) and as plain keys, with per-run and per-cell detail.
  - B(Runs.) Every run under C(<data_dir>/runs/) that holds a C(run.json) (or only O(run)). Liveness comes from
    C(run.json), the runner's process group and session with the start-time guard against PID reuse that
    M(remote_gpu.trainer.vram_zombies) uses, never from process-name patterns that could match the patrol itself.
    Cells come from C(spec.json) and each cell's C(result.json).
  - B(Cell logs.) Each cell's log is read as bytes from where the previous tick stopped (a cursor of inode and
    offset under C(<run>/.patrol/)), at most O(max_scan_bytes) per log per tick, so a tick's cost does not grow with
    the log's size. A truncated or rotated log is scanned again from its start. Lines split on newlines and on
    carriage returns (progress bars), decoded leniently. Crash signatures are counted since the log's start (the
    cursor keeps the counts and first lines); progress is the last epoch / step marker, from the new bytes or, on
    a first tick or when behind, from the log's last 64 KiB.
  - B(Box.) GPU utilization and memory per GPU (NVML, else nvidia-smi), Xids in the kernel log since the newest
    patrolled run started (the M(remote_gpu.trainer.gpu_health) decoder, so a GPU that falls off the bus escalates
    with action C(re_rent)), bytes and inodes used on the data directory and the runs' durable directories, and
    the container's memory from the run's C(monitor.jsonl) (current, limit, peak over the recent samples).
  - B(Curves.) For the fleet page, each run carries its C(monitor.jsonl) (C(monitor.jsonl.1) then C(monitor.jsonl))
    as at most 120 samples spread evenly over the run, read by seeking to evenly spaced offsets (a few hundred KiB
    whatever the files' sizes), and each cell its training loss as at most 200 points over the whole log, kept in
    its cursor and fed only each tick's new bytes (every Nth loss line, N doubled when full). The loss is read from
    what frameworks print (the Hugging Face Trainer's log dicts, progress bars redrawn after a carriage return with
    C(loss=0.123) or C(train_loss_step=0.1), C(step 120 loss 0.4), JSON lines), never C(eval_loss), C(val_loss)
    or a best-so-far. Lines that are not a sample or not a number are left out; a NaN or Inf loss is a null point.
  - B(Deadlines.) The probes run in three rounds of child processes, each under O(timeout_s), so a hung network
    mount or a hung driver becomes a reason, never a hung patrol.
  - B(Cells.) Each cell is judged on its own evidence, its state one of C(pending) (not started), C(running),
    C(stalled), C(failed) (its command ended non-zero or by a signal), C(crashed) (started, no result, and
    nothing of it alive, so it died with its runner), C(done) (succeeded, outputs secured) and C(sync_failed)
    (exited 0 but its copy to the durable directory failed). A cell runs while a process of it lives (its
    environment carries the runner's C(RGT_RUN_DIR) and C(RGT_CELL)) or its live runner says it started it.
  - A running cell is C(stalled) when its own log has not grown for O(stall_after_s) (timed by the ticks' clock,
    never by file mtimes) and its own GPUs (C(run.json)'s C(cells[].gpus), else the run's) are not busy in the
    newest C(monitor.jsonl) sample, or when its GPUs were at or below O(gpu_idle_pct) in the newest
    O(gpu_idle_samples) samples; a silent cell whose GPUs are busy is "silent, GPUs busy", not stalled. Whatever
    its siblings do. Escalated as C(stalled:<run>/<cell>), action C(investigate), the reason naming the cell.
  - Progress and ETA come from live cells only; a run's ETA schedules its running cells' own ETAs and its pending
    cells on the run's slots (C(gpus) / C(gpus_per_cell), C(max_parallel)); a run with a stalled cell has none.
  - B(Decision table), for each run (the box takes the worst, in the order C(unknown), C(crashed), C(incomplete),
    C(stalled), C(runner_gone), C(sync_failed), C(disk_pressure), C(running), C(done), C(idle)).
  - C(running) - the runner is alive and no cell is stalled. Not escalated by itself.
  - C(stalled) - the runner (or a cell outliving it) is alive and a cell is stalled.
  - A cell that failed in a live run escalates C(cell_failed:<run>/<cell>) with its exception line and the retries
    left, action C(investigate); the run goes on with its other cells.
  - A crash signature C(disk_full) ("No space left on device") in an unfinished cell's log escalates
    C(disk_full:<run>/<cell>), action C(free_disk), during the run and after it.
  - A NaN or Inf loss seen once escalates C(nan_loss:<run>/<cell>), action C(investigate), also after the run ended
    (a run DONE with NaN stays flagged). A log deleted, truncated or replaced escalates C(log_lost:<run>/<cell>).
  - C(runner_gone) - the runner is dead but a cell of it is still alive. Escalated C(runner_gone:<run>), action
    C(investigate), the advice being to let it finish, or stop it (a relaunch would stop the healthy training).
  - C(sync_failed) - the runner is gone and every cell not done exited 0 but its sync failed. Each such cell
    escalates C(sync_failed:<run>/<cell>) with its cause, action C(free_disk) when it is out of space, else
    C(investigate); never C(restart_job).
  - C(done) - not alive, C(DONE) written and every cell done (succeeded and its outputs secured). Not escalated.
  - C(crashed) - not alive, cells not done, and a crash signature (or exit 137 / SIGKILL) in an unfinished cell's
    log explains it. Escalated, action C(restart_job); the reasons name the cell, the signature and its line.
  - C(incomplete) - not alive and cells not done, with nothing in the logs to explain it (the box was
    restarted, the runner was killed). Escalated, action C(restart_job).
  - B(Many runs.) Over 100 runs, every run without C(DONE) is patrolled and the finished ones are dropped first
    (oldest C(DONE) first), counted in RV(runs_skipped). Runs archived under C(<data_dir>/runs/.archive) are not
    patrolled, only counted in RV(runs_archived).
  - C(disk_pressure) - bytes or inodes used on the data or a durable filesystem at or over
    O(disk_pressure_pct). Escalated, action C(free_disk).
  - C(unknown) - the runs directory or a run's C(run.json) could not be read, or a probe did not answer in time.
    Escalated, action C(investigate).
  - C(idle) - no run on the box. Not escalated.
  - Xid findings of level FAIL since the run started escalate whatever the state, with their own action
    (C(gpu_lost) and hardware Xids C(re_rent)).
  - Each escalation has a stable id in RV(problems) (C(crashed:<run>), C(stalled:<run>/<cell>),
    C(disk_pressure:data), C(gpu_lost:0), ...) that stays the same while the condition lasts, so a controller can
    notify once per new problem. Every id about a run starts with C(<kind>:<run>).
  - Runs under the box's base Python; the runtime venv (O(venv)) lives under the data directory, which may hang,
    so only the GPU probe's child adds its site-packages for C(pynvml), and a hung data directory costs the probes
    a reason naming it, never the tick.
  - B(Whole box.) Whatever O(run) patrols, RV(box) covers every run on the box (its runner or a cell of it alive,
    C(DONE), its start and its last activity), so a controller can tell a box that bills with nothing running, and
    RV(autostop) reports the box's own stop timer from C(<data_dir>/runs/.autostop/armed.json) and the watcher's
    C(<data_dir>/runs/.autostop.json). Both are read under the first round's deadline; a file that is not what it
    should be is a reason, never a failure.
  - B(Tick.) Each tick counts itself in C(<data_dir>/runs/.patrol-tick.json) (C(at), C(tick)), written atomically
    and only where C(<data_dir>/runs) exists; an armed autostop's dead-man timer (C(controller_silence_hours))
    restarts whenever it changes.
  - Strictly read-only on the runs; it writes only its own cursors and the tick file, and nothing in check mode.
  - Needs only the Python standard library; NVML through C(nvidia-ml-py) when the base Python or O(venv) has it.
options:
  data_dir:
    description:
      - The box's data directory; runs live in C(<data_dir>/runs/<run>/) (the launch role's layout).
      - Must be a non-empty path.
    type: path
    required: true
  run:
    description:
      - Patrol only this run. Default, every run under C(<data_dir>/runs/).
      - A run name, letters, digits, C(_), C(.) and C(-), at most 64 characters.
      - A run that is not on the box fails the module with one line naming it and the closest run there (or where
        it was archived).
    type: str
  durable_dir:
    description:
      - Durable directory whose bytes and inodes are measured. Default, each run's C(durable_dir) from C(run.json).
      - When given, must be a non-empty path.
    type: path
  stall_after_s:
    description:
      - Seconds without log growth after which a live run is C(stalled), between 1 and 604800 (a week).
    type: int
    default: 1800
  gpu_idle_pct:
    description:
      - GPU utilization in percent at or below which a GPU counts as idle, between 0 and 100.
    type: float
    default: 5
  gpu_idle_samples:
    description:
      - How many of the newest C(monitor.jsonl) samples must see every GPU idle for a live run to be C(stalled).
      - Between 0 and 1000; 0 turns the GPU-idle rule off. Samples older than O(stall_after_s) do not count.
    type: int
    default: 10
  disk_pressure_pct:
    description:
      - Bytes or inodes used, in percent, at or over which the box is C(disk_pressure), above 0 and at most 100.
    type: float
    default: 95
  gpu_backend:
    description:
      - How GPUs are read. V(auto) tries NVML and falls back to C(nvidia-smi); V(nvml) needs C(nvidia-ml-py).
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
  kernel_log:
    description:
      - Read the kernel log (C(dmesg), else C(journalctl -k)) for Xids since the newest run started.
    type: bool
    default: true
  crash_patterns:
    description:
      - Extra crash signatures, matched per log line beside the built-in ones.
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description:
          - The signature's name in RV(crash_signatures), lower case C(^[a-z][a-z0-9_]{0,39}$), not a built-in name.
        type: str
        required: true
      regex:
        description:
          - A Python regular expression, searched in each line.
        type: str
        required: true
  progress_regex:
    description:
      - A Python regular expression for the progress marker, with named groups among C(epoch), C(epochs),
        C(step) and C(steps) (integers). Default, a built-in one that reads C(epoch 3/20), C(Epoch [3/20]),
        C(step 120/5000) and their usual spellings.
    type: str
  max_scan_bytes:
    description:
      - New bytes read per cell log per tick, at most; a log further behind is caught up over the next ticks.
      - Between 65536 and 1073741824.
    type: int
    default: 67108864
  timeout_s:
    description:
      - Deadline of each of the three probe rounds in seconds, above 0 and at most 600.
    type: float
    default: 10
  venv:
    description:
      - The runtime venv whose C(lib/python*/site-packages) the GPU probe's child adds for C(pynvml) (read only
        there, under the deadline). Default, C(<data_dir>/.remote_gpu_trainer/venv).
      - When given, must be a non-empty path.
    type: path
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Gathers the same facts; the scan cursors are not saved, so the next tick reads those bytes again, and
      the tick file is not written, so a check-mode patrol does not hold back an autostop's dead-man timer.
notes:
  - The box is untrusted input. Every number read from its files is checked (NaN, infinities, strings read as
    unknown); a run directory that is not the layout's is reported, never followed.
seealso:
  - module: remote_gpu.trainer.training_run
  - ref: ansible_collections.remote_gpu.trainer.patrol_role
    description: The C(remote_gpu.trainer.patrol) role, which runs this module on every box of a tick, reports,
      notifies and sets the exit code.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
"""

EXAMPLES = r"""
- name: Patrol the box
  remote_gpu.trainer.patrol_facts:
    data_dir: /root/autodl-tmp
  register: tick

- name: Say what needs a human
  ansible.builtin.debug:
    msg: "{{ tick.reasons }}"
  when: tick.escalate

- name: Patrol one run, with a stricter stall rule and a signature of the user's own
  remote_gpu.trainer.patrol_facts:
    data_dir: /workspace
    run: sweep-lr
    stall_after_s: 900
    crash_patterns:
      - name: dataloader_died
        regex: "DataLoader worker \\(pid \\d+\\) is killed"
"""

RETURN = r"""
state:
  description: The box's state, the worst among its runs and probes (see the decision table).
  returned: always
  type: str
  choices: [running, stalled, crashed, incomplete, runner_gone, sync_failed, done, idle, disk_pressure, unknown]
  sample: running
escalate:
  description: Whether a human or automation must act.
  returned: always
  type: bool
  sample: false
reasons:
  description: One line per reason behind RV(state) and RV(escalate), and readings that failed.
  returned: always
  type: list
  elements: str
  sample:
    - "sweep: the runner is gone with 1 of 3 cells not done (c)"
    - "sweep/c: cuda_oom (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"
problems:
  description:
    - Stable ids of the escalated conditions. About a run, C(<kind>:<run>) or C(<kind>:<run>/<cell>) -
      C(crashed:<run>), C(incomplete:<run>), C(runner_gone:<run>), C(unreadable:<run>), C(stalled:<run>/<cell>),
      C(cell_failed:<run>/<cell>), C(sync_failed:<run>/<cell>), C(disk_full:<run>/<cell>), C(nan_loss:<run>/<cell>),
      C(log_lost:<run>/<cell>). About the box, C(disk_pressure:data), C(disk_pressure:durable),
      C(probe_failed:<probe>) and the Xid codes with their GPU (C(gpu_lost:0), ...).
  returned: always
  type: list
  elements: str
  sample: ["crashed:sweep", "stalled:sweep/c"]
actions:
  description: What to do, from the findings vocabulary (C(re_rent), C(free_disk), C(restart_job), C(investigate)).
  returned: always
  type: list
  elements: str
  sample: ["restart_job"]
run:
  description: The run the plain keys RV(progress), RV(eta_s) and RV(log_idle_s) describe (the newest live run, else
    the newest run), or null when there is none.
  returned: always
  type: str
  sample: sweep
headline:
  description:
    - 'One line naming the run the box''s state comes from, with that run''s own cells
      (C(CRASHED run alpha: 1/3 cells done)), or how many runs need attention
      (C(2 runs need attention: alpha crashed, beta stalled)), or the box''s own trouble, or
      C(IDLE: no run on this box).'
  returned: always
  type: str
  sample: "STALLED run sweep: 1/3 cells done"
examined_runs:
  description: The runs patrolled by this call (a problem of a run not in it was not examined, not cleared).
  returned: always
  type: list
  elements: str
  sample: [sweep]
runs_skipped:
  description: Finished runs not patrolled because the box holds more than 100 runs (unfinished ones never are).
  returned: always
  type: int
  sample: 0
runs_archived:
  description: Runs archived under C(<data_dir>/runs/.archive) (not patrolled).
  returned: always
  type: int
  sample: 2
run_filter:
  description: The O(run) option, or null when every run was patrolled.
  returned: always
  type: str
  sample: sweep
alive:
  description:
    - Live processes of the patrolled runs (runners and their jobs); for a run whose runner is gone, its cells still
      alive.
  returned: always
  type: int
  sample: 3
cells_done:
  description: Finished cells (succeeded, outputs secured), over every patrolled run.
  returned: always
  type: int
  sample: 2
cells_total:
  description: Expected cells, over every patrolled run.
  returned: always
  type: int
  sample: 3
progress:
  description:
    - The last epoch / step marker in the current cell's log, or null. C(epoch), C(epochs_total), C(step),
      C(steps_total) (integers or null) and C(line), the line they were read from (at most 200 characters).
  returned: always
  type: dict
  sample: {epoch: 3, epochs_total: 20, step: 120, steps_total: 500, line: "epoch 3/20 step 120/500 loss 0.41"}
eta_s:
  description:
    - Seconds left for RV(run), from its running cells' own ETAs and its pending cells on its free slots; null
      without progress totals, or when a cell of it is stalled.
  returned: always
  type: int
  sample: 5400
log_idle_s:
  description: Seconds since a cell log of RV(run) last grew, on the ticks' clock, or null.
  returned: always
  type: float
  sample: 12.5
crash_signatures:
  description: Signatures found in the cells' logs since they started, with C(signature), C(count) and C(first_line).
  returned: always
  type: list
  elements: dict
  sample:
    - signature: cuda_oom
      count: 1
      first_line: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
disk:
  description: The fullest of RV(disks), C(path), C(bytes_used_pct), C(inodes_used_pct).
  returned: always
  type: dict
  sample: {path: /root/autodl-tmp, bytes_used_pct: 61.2, inodes_used_pct: 3.0}
disks:
  description:
    - Each measured directory, C(name) (C(data) or C(durable)), C(path), C(error) (null, or why it could not be
      measured), C(bytes_used_pct), C(inodes_used_pct), C(bytes_free), C(inodes_free).
  returned: always
  type: list
  elements: dict
gpu:
  description: Per GPU C(index), C(utilization_pct), C(memory_used_mib), C(memory_total_mib) (null where unread).
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, utilization_pct: 97.0, memory_used_mib: 70211.0, memory_total_mib: 81559.0}]
gpu_backend:
  description: C(nvml) or C(nvidia-smi), whichever answered or was tried last; null when the probe hung.
  returned: always
  type: str
  sample: nvml
gpu_error:
  description: Why the GPUs could not be read, or null.
  returned: always
  type: str
memory:
  description:
    - From the recent C(monitor.jsonl) samples, C(cgroup_current_bytes), C(cgroup_max_bytes) (null when unlimited or
      unknown) and C(recent_peak_bytes).
  returned: always
  type: dict
  sample: {cgroup_current_bytes: 21474836480, cgroup_max_bytes: 64424509440, recent_peak_bytes: 30064771072}
xids:
  description: Kernel-log findings since the newest run started, C(code), C(level), C(message), C(action), C(gpu),
    C(pci), C(xid).
  returned: always
  type: list
  elements: dict
runs:
  description:
    - 'Per run C(run), C(state) (a state of the decision table), C(escalate), C(reasons), C(problems), C(actions),
      C(alive), C(started_at), C(cells_done), C(cells_total), C(progress) (the first live cell''s, else the last
      done cell''s), C(eta_s) (null when a cell is stalled), C(log_idle_s), C(current_cell), C(summary) (one compact
      line, C(alpha: stalled, 2/4 done, 1 running 37%, 1 stalled (c))), C(monitor_series) and C(cells).'
    - Per cell C(name), C(state) (C(pending), C(running), C(stalled), C(failed), C(crashed), C(done),
      C(sync_failed)), C(status), C(exit_code), C(signal), C(sync), C(sync_error) (the result's cause, or null),
      C(done), C(attempts), C(retries_left), C(gpus) (its GPU indices, null for all), C(alive) (a process of it
      lives), C(log_bytes), C(log_error), C(log_idle_s) (ticks' clock), C(silent_gpus_busy), C(progress),
      C(progress_fraction) (0 to 1, live cells only), C(eta_s), C(lost) (why its log is lost, or null),
      C(crash_signatures), C(exception) (the line that says why it failed, or null), C(nan_seen) and C(loss_series).
    - C(monitor_series), null without a sample and for runs past the 8 newest (runs with a live cell count as
      newest), else the run's C(monitor.jsonl) (C(monitor.jsonl.1) first) as at
      most 120 samples spread over the run, sorted by time, every list aligned with C(t) - C(t) (epoch seconds),
      C(gpus) (per GPU C(index), C(util_pct) and C(mem_used_mib), lists of numbers or nulls, and C(mem_total_mib),
      its last reading or null), C(container_mem_bytes) (the cgroup's memory per sample, integers or nulls),
      C(container_max_bytes) (its last limit, null when unlimited) and C(points) (how many samples).
    - C(loss_series), null until the log printed a training loss, else at most 200 points over the whole log -
      C(x) (the step printed on the line when every loss line has one and they never go back, else the count of
      loss lines, from 1), C(loss) (numbers, null for NaN or Inf), C(x_label) (C(step) or C(line)), C(last) (the
      newest loss, null for NaN or Inf) and C(points).
  returned: always
  type: list
  elements: dict
msg:
  description: One line, C(<state>) with the run the state comes from (its own cells done) or the headline, and the
    first reason.
  returned: always
  type: str
  sample: "running: run sweep, 1/3 cells done"
box:
  description:
    - The whole box, every run on it whatever O(run) patrols. C(since), when it started billing, the cost ledger's
      C(first_seen) (the rental's first sight, which archive, cleanup and resume never move); C(box_now), the box's
      own clock (the controller counts idle time and cost on it); C(ledger), the box's cost ledger
      C({first_seen, running_s, segments_total, segments, stopped_at, notes}) as training_run returns it (recorded by
      each tick, except in check mode, which computes the same figures); C(container_started_at), PID
      1's start (the container's, or the machine's boot); C(live_runs), the runs whose runner or a cell of it is
      alive; C(idle), true when no run is live (null when the runs could not be read in time); C(idle_since), with
      no live run, the newest of the container's start and each run's last activity (the newest mtime of its
      C(run.json), C(DONE) and its cells' C(result.json) and C(exit.json)), else null; C(runs_done), the runs with
      C(DONE). Times are ISO 8601 UTC, null where unknown.
  returned: always
  type: dict
  sample:
    since: "2026-12-03T01:02:44Z"
    box_now: "2026-12-03T03:29:00Z"
    ledger:
      first_seen: "2026-12-03T01:02:44Z"
      running_s: 8776.0
      segments_total: 1
      segments: [{start: "2026-12-03T01:02:44Z", end: null, ended_by: null, running_s: 8776.0}]
      stopped_at: null
      notes: []
    container_started_at: "2026-12-03T01:02:44Z"
    live_runs: []
    idle: true
    idle_since: "2026-12-03T03:11:40Z"
    runs_done: [sweep-a, sweep-b]
autostop:
  description:
    - The box's own stop timer (launch's C(launch_autostop)). C(armed) is false and every other key null when there
      is no C(armed.json) (or it cannot be read); all are null when the box could not be read in time.
    - From the watcher's C(.autostop.json), C(state) (C(waiting), C(idle_wait), C(silence_wait), C(gate_failed),
      C(stopping), C(stopped), C(failed), C(unconfirmed), C(disarmed), or C(unreadable) when the file cannot be read or
      trusted, with a reason), C(reason), C(due_at) (when the timer fires,
      an estimate), C(next_check_at), C(updated_at) (when the watcher last wrote), C(idle_s), C(idle_needed_s),
      C(silence_s), C(silence_needed_s), C(trigger) (C(idle) or C(controller_silence)), C(gate) (C(passed),
      C(step), C(reason), C(checked_at)) and C(stop) (C(issued_at), C(command), C(outcome), C(final_state), C(msg),
      C(attempts), C(result)); null until the watcher wrote them.
    - C(watcher_pid) and C(watcher_alive), the watcher process; C(generation), armed.json's configuration, and
      C(generation_current), whether the watcher's decision is about that configuration (false until it acts on
      it); from C(armed.json), C(armed_by) (C(run), C(launch_id)), C(idle_minutes) and C(controller_silence_hours).
  returned: always
  type: dict
  sample:
    armed: true
    state: idle_wait
    reason: every run is DONE and secured; stopping after 30 min idle
    due_at: "2026-12-03T03:41:40+00:00"
    next_check_at: "2026-12-03T03:24:40+00:00"
    updated_at: "2026-12-03T03:23:40+00:00"
    idle_s: 720.0
    idle_needed_s: 1800.0
    silence_s: null
    silence_needed_s: null
    trigger: idle
    gate: {passed: true, step: null, reason: every run secured, checked_at: "2026-12-03T03:11:52+00:00"}
    stop: null
    watcher_pid: 4242
    watcher_alive: true
    generation: 3f9a0c1b2d4e
    generation_current: true
    armed_by: {run: sweep-b, launch_id: null}
    idle_minutes: 30.0
    controller_silence_hours: null
ansible_facts:
  description: Every key above under C(patrol).
  returned: always
  type: dict
  contains:
    patrol:
      description: The same facts as the plain keys.
      type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, NonEmpty, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    compile_progress,
    compile_signatures,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol import PatrolError, patrol

ARGUMENT_SPEC = {
    "data_dir": {"type": "path", "required": True},
    "run": {"type": "str"},
    "durable_dir": {"type": "path"},
    "stall_after_s": {"type": "int", "default": 1800},
    "gpu_idle_pct": {"type": "float", "default": 5.0},
    "gpu_idle_samples": {"type": "int", "default": 10},
    "disk_pressure_pct": {"type": "float", "default": 95.0},
    "gpu_backend": {"type": "str", "choices": ["auto", "nvml", "nvidia-smi"], "default": "auto"},
    "kernel_log": {"type": "bool", "default": True},
    "crash_patterns": {
        "type": "list",
        "elements": "dict",
        "default": [],
        "options": {"name": {"type": "str", "required": True}, "regex": {"type": "str", "required": True}},
    },
    "progress_regex": {"type": "str"},
    "max_scan_bytes": {"type": "int", "default": 64 * 2**20},
    "timeout_s": {"type": "float", "default": 10.0},
    "venv": {"type": "path"},
}
# What the argument spec cannot check; the DOCUMENTATION of each option states its rule.
OPTION_BOUNDS = {
    "data_dir": NonEmpty(),
    "durable_dir": NonEmpty(),
    "stall_after_s": Between(1, 604800),
    "gpu_idle_pct": Between(0, 100),
    "gpu_idle_samples": Between(0, 1000),
    "disk_pressure_pct": Between(0, 100, above_low=True),
    "max_scan_bytes": Between(65536, 2**30),
    "timeout_s": Between(0, 600, above_low=True),
    "venv": NonEmpty(),
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    check_options(module, OPTION_BOUNDS)
    params = module.params
    if params["run"] is not None and not NAME_PATTERN.match(params["run"]):
        module.fail_json(msg=f"run must match {NAME_PATTERN.pattern} (a run name), got {params['run']!r}")
    try:
        scanning = {
            "signatures": compile_signatures(params["crash_patterns"]),
            "progress": compile_progress(params["progress_regex"]),
            "max_bytes": params["max_scan_bytes"],
        }
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    try:
        facts = patrol(params, scanning, module.check_mode)
    except PatrolError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, ansible_facts={"patrol": facts}, **facts)


if __name__ == "__main__":
    main()
