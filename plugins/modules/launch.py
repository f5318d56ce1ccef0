#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: launch
short_description: Launch a training run on one rented box, in one controller step
version_added: "0.1.0"
description:
  - An action plugin; the role C(remote_gpu.trainer.launch) maps its variables (C(launch_<option>), C(id) from the
    role's launch id) onto these options. Every step and status is described in C(docs/launch.md).
  - "Validation first, on the controller: every option, every C(launch_*) variable of the play (an unknown one is
    named with the closest valid name), each cell (a unique C(name), its own keys), the secrets' sources (read here,
    the variable named when unset, never a value), credential-looking names in O(env), the shard plan and each
    cell's argv rendered from the raw C(launch_command) and C(launch_checkpoint_dir) templates. Any problem refuses
    the box at C(validate) and nothing reaches it."
  - Then the preflight gate (this play's C(preflight_result), else the newest C(preflight-<UTC>.json) in
    O(preflight_report_dir) younger than O(preflight_max_age_s)), the runtime probe (the box's Python finds the
    runtime venv, whose Python then runs the modules; a box that does not answer is C(UNREACHABLE)), the code
    (rsync over the connection's own SSH command with the excludes, C(--delete) only with O(code_delete),
    C(--dry-run) in check mode; or C(ansible.builtin.git) on the box) and one M(remote_gpu.trainer.training_run)
    call, whose result is filtered (the record never holds its invocation or a secret).
  - The record (the task's result) has the status C(STARTED), C(RESUMED), C(ALREADY_RUNNING), C(DONE), C(REFUSED),
    C(FAILED) or C(UNREACHABLE); the task itself does not fail, so the report step sees every box.
    M(remote_gpu.trainer.stage_verdict) turns it into the play's outcome.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  run:
    description: The run's name, C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$).
    type: str
    required: true
  cells:
    description: The sweep, in queue order; each a mapping with a unique C(name), the keys the command template
      reads, and optionally C(timeout_s), C(retries), C(checkpoint_dir), C(artifacts), C(optional_artifacts),
      C(prune) (a cell's own key replaces the run's).
    type: list
    elements: raw
    required: true
  data_dir:
    description: The box's scratch directory (absolute); not given, the play's C(data_dir).
    type: str
  durable_dir:
    description: The durable directory (absolute); not given, the play's C(durable_dir); empty for none.
    type: str
  code_dir:
    description: A controller directory pushed to O(code_dest) with rsync; empty for none.
    type: str
    default: ""
  code_excludes:
    description: rsync C(--exclude) patterns.
    type: list
    elements: str
    default: [.git, .venv, __pycache__, "*.pyc", wandb]
  code_delete:
    description: rsync C(--delete) in O(code_dest).
    type: bool
    default: false
  git_repo:
    description: A git URL checked out on the box into O(code_dest); empty for none.
    type: str
    default: ""
  git_ref:
    description: The branch, tag or commit of O(git_repo).
    type: str
    default: HEAD
  git_depth:
    description: Shallow clone depth; 0 for the whole history.
    type: int
    default: 0
  git_environment:
    description: Environment of the git checkout on the box.
    type: dict
    default: {}
  code_dest:
    description: Where the code lands on the box; empty is C(<data_dir>/code/<run>).
    type: str
    default: ""
  workdir:
    description: The cells' working directory; empty is O(code_dest) with a code source, required without one.
    type: str
    default: ""
  env:
    description: Environment of every cell; credential-looking names are refused (use O(secrets)).
    type: dict
    default: {}
  env_hook:
    description: A file on the box sourced before each command; not given, the play's C(env_hook).
    type: str
  conda_env:
    description: A conda environment activated before each command.
    type: str
    default: ""
  secrets:
    description: "C(NAME) to C({env: VARIABLE}) or C({file: PATH}) on the controller."
    type: dict
    default: {}
  gpus:
    description: GPU indices the run may use; empty for every GPU.
    type: list
    elements: int
    default: []
  gpus_per_cell:
    description: GPUs per cell; 0 gives each cell every GPU.
    type: int
    default: 0
  max_parallel:
    description: At most this many cells at once; 0 for no cap.
    type: int
    default: 0
  prune:
    description: Globs (a trailing C(/) for directories) removed in a cell's checkpoint directory before its sync.
    type: list
    elements: str
    default: []
  artifacts:
    description: Globs of the files copied and verified into the durable directory; each must match.
    type: list
    elements: str
    default: []
  optional_artifacts:
    description: Like O(artifacts), but a pattern may match nothing.
    type: list
    elements: str
    default: []
  verify_cmd:
    description: A load check per artifact after its copy, an argv list or one command line; C({path}) is the
      copy's path.
    type: raw
  verify_artifacts:
    description: Which artifacts O(verify_cmd) runs on (fnmatch patterns); empty for all.
    type: list
    elements: str
    default: []
  verify_timeout_s:
    description: Seconds each O(verify_cmd) may run.
    type: float
    default: 300
  check_finite:
    description: Check every C(*.safetensors) artifact for NaN and Inf after the copy.
    type: bool
    default: false
  apply_changes:
    description: Apply a changed sweep to a run already on the box instead of refusing it.
    type: bool
    default: false
  stop_on_failure:
    description: After a failed cell, start no more cells.
    type: bool
    default: false
  detach:
    description: C(auto), C(tmux) or C(setsid); not given, the play's C(detach), else C(auto).
    type: str
  allow_concurrent:
    description: Start beside another live run (never on its GPUs).
    type: bool
    default: false
  stop_grace_s:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 30
  monitor_interval_s:
    description: Seconds between two samples of the resource monitor.
    type: float
    default: 30
  monitor_max_bytes:
    description: Size at which C(monitor.jsonl) is rotated.
    type: int
    default: 8388608
  start_timeout_s:
    description: Seconds to wait for the runner to register.
    type: float
    default: 20
  shard:
    description: Split the cells across O(shard_hosts) (cell I(i) to host I(i mod count), hosts sorted).
    type: bool
    default: false
  shard_hosts:
    description: The hosts to shard across; not given, the inventory's hosts of O(hosts) (never the play's, so
      C(--limit) changes no shard).
    type: list
    elements: str
  hosts:
    description: The host pattern the playbook targets.
    type: str
    default: all
  new_attempt:
    description: Start afresh where the run name was torn down or its durable copy holds an earlier launch.
    type: bool
    default: false
  id:
    description: The launch id (the role passes its own, shared by every box of the play); empty lets the box
      choose.
    type: str
    default: ""
  skip_preflight:
    description: Launch whatever the preflight said.
    type: bool
    default: false
  require_preflight:
    description: Refuse a box without a recent preflight.
    type: bool
    default: false
  preflight_max_age_s:
    description: How old the newest preflight report may be to count.
    type: float
    default: 3600
  preflight_report_dir:
    description: Controller directory of the preflight reports; not given, the play's C(preflight_report_dir),
      else C(reports).
    type: str
  base_python:
    description: The box's Python that runs the runtime probe; empty for the inventory's interpreter or
      C(python3).
    type: str
    default: ""
  runtime_python:
    description: The runtime venv's Python; empty for C(<data_dir>/.remote_gpu_trainer/venv/bin/python).
    type: str
    default: ""
  probe_timeout_s:
    description: Deadline of each step of the runtime probe.
    type: float
    default: 5
  task_timeout_s:
    description: Seconds the training_run call may take.
    type: int
    default: 120
  sync_timeout_s:
    description: Seconds the code sync may take.
    type: int
    default: 1800
  report_dir:
    description: Controller directory of the launch report (read by M(remote_gpu.trainer.stage_report)).
    type: str
    default: reports
  autostop:
    description:
      - Arm the box's own stop through M(remote_gpu.trainer.training_run), before the run starts, from the play's
        C(self_stop) (the platform profile's C(id_env), C(env), C(verb)). A profile with C(self_stop.unsupported)
        or without C(self_stop) refuses the box at C(validate) with the reason, as does a verb that is irreversible
        or does not name C({instance_id}).
    type: bool
    default: false
  autostop_idle_minutes:
    description: Minutes with every run secured before the box stops itself (0 to 14400); null for no idle timer.
    type: raw
    default: 30
  autostop_controller_silence_hours:
    description: Hours without a patrol tick before a box whose runs are all secured stops itself (above 0, at
      most 8760); null for no dead-man timer.
    type: raw
  autostop_check_interval_s:
    description: Seconds between two looks of the box's watcher (1 to 3600).
    type: float
    default: 60
  autostop_disarm:
    description: Disarm the box's autostop (any platform); not with O(autostop).
    type: bool
    default: false
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Everything is validated and the probe runs; rsync runs with C(--dry-run), git and training_run in
      check mode; the line says what would happen (also that it would arm autostop).
  action:
    description: Indicates this has a corresponding action plugin so some parts of the options can be executed on
      the controller.
    support: full
seealso:
  - module: remote_gpu.trainer.training_run
  - module: remote_gpu.trainer.stage_report
  - module: remote_gpu.trainer.stage_verdict
"""

EXAMPLES = r"""
- name: Launch the run on this box
  remote_gpu.trainer.launch:
    run: abl-2026-12
    cells: "{{ launch_cells }}"
    code_dir: ~/src/abl
    artifacts: [best.pt]
    verify_cmd: [python, -m, src.load_check, "{path}"]
    id: "{{ launch_effective_id }}"
  register: launch_box
"""

RETURN = r"""
status:
  description: STARTED, RESUMED, ALREADY_RUNNING, DONE, REFUSED, FAILED or UNREACHABLE.
  returned: always
  type: str
step:
  description: The step that stopped the box (validate, preflight, probe, code, relaunch, training_run,
    unreachable), or null.
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
run:
  description: The run's name (null when it was not valid).
  returned: always
  type: str
launch_id:
  description: The launch the run belongs to.
  returned: after validation
  type: str
cells:
  description: This box's cells; after training_run, each with C(name), C(status), C(sync), C(done), C(exit_code)
    and C(reason).
  returned: always
  type: list
  elements: dict
shard:
  description: C(index), C(count) and C(cells_total) of a sharded sweep, else null.
  returned: after validation
  type: dict
outcome:
  description: training_run's outcome (started, resumed, already_running, done).
  returned: after validation
  type: str
cells_left:
  description: Cells that will run their command.
  returned: after validation
  type: int
recopy_cells:
  description: Cells only copied again (their command succeeded), never retrained.
  returned: after validation
  type: list
  elements: str
kept_cells:
  description: Cells whose result is kept.
  returned: after validation
  type: list
  elements: str
changes:
  description: The sweep's differences from the run on the box (applied, or why it was refused).
  returned: after validation
  type: list
  elements: str
code:
  description: The code sync, C(kind) none, rsync (C(files), C(files_count), C(deleted), C(dry_run), C(argv)) or
    git (C(version), C(changed)).
  returned: after validation
  type: dict
gate:
  description: The preflight gate, C(allowed), C(status), C(source), C(age_s), C(reason).
  returned: after validation
  type: dict
python:
  description: The Python that ran the box's modules.
  returned: after the probe
  type: str
attach:
  description: The command that watches the run.
  returned: after validation
  type: str
pgid:
  description: The runner's process group.
  returned: after validation
  type: int
detach:
  description: tmux or setsid.
  returned: after validation
  type: str
warnings:
  description: A runtime venv that is not ready, training_run's own warnings.
  returned: after validation
  type: list
  elements: str
autostop:
  description:
    - training_run's C(autostop) result (C(armed), C(changed), C(state), C(reason), C(watcher_pid), C(generation),
      C(idle_minutes), C(controller_silence_hours), C(instance_id), C(command), C(would), C(decision), ...) plus
      C(asked) (C(arm), C(disarm), or null when launch left autostop alone); null when training_run said nothing.
  returned: always
  type: dict
cost:
  description:
    - What the box costs, from the host's C(hourly_usd) (a number, or text that is one; a bad value is a warning,
      never a refusal) and training_run's cost ledger (C(ledger), counted on the box's clock C(box_now)),
      C(hourly_usd), C(since) (the ledger's C(first_seen), the rental's first sight), C(hours) (its running hours;
      a stopped interval is not billed), C(usd) (and C(note) when the box's figures are odd); null without
      C(hourly_usd).
  returned: always
  type: dict
check_mode:
  description: Whether this was a check-mode launch.
  returned: always
  type: bool
"""
