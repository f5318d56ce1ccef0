#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: training_run
short_description: Start, resume or stop a detached, self-completing training run on a rented box
version_added: "0.1.0"
description:
  - A run is a named queue of cells (one argv each) in C(<data_dir>/runs/<run>/), laid out as the collection's run
    layout contract says (C(run.json), C(cells/<cell>/log), C(cells/<cell>/result.json), C(monitor.jsonl), C(DONE)).
    The module writes the run's C(spec.json) (no secret in it), the secrets into C(.secrets.json) (mode 0600), copies
    the on-box runner's code into C(runner/) (so a run never depends on a later version of the collection) and starts
    it detached; the runner then runs the cells, prunes, copies and verifies each success's artifacts into
    O(durable_dir) and writes C(DONE), with no controller attached.
  - B(Detach.) With tmux installed (O(detach=auto) or V(tmux)), C(tmux new-session -d -s rgt-<run>) (a C(.) in the
    run's name becomes C(_)); else a double fork with C(setsid), stdin from C(/dev/null), stdout and stderr appended
    to C(runner.log). Either way the run survives the SSH session, the Ansible worker and the controller going away.
    The module returns once the runner has registered itself in C(run.json) (at most O(start_timeout_s)).
  - B(Idempotence.) Every start decision is taken under an flock on C(<data_dir>/runs/.launch.lock), held until the
    new runner is registered, so two launches never start two copies of a run. The same run alive (its C(run.json)
    names a live runner, with the PID-reuse guard of C(vram_zombies)) is left alone (C(changed=false)); a run with
    C(DONE) and the same spec is reported done (C(changed=false)); a different run alive on the box refuses the
    start unless O(allow_concurrent). A run whose runner is gone (C(run.json) present, no live runner, no C(DONE))
    is started again, and the runner skips the cells already done (C(succeeded) and C(verified), or C(skipped)
    where the cell declares no artifacts), only copies again a cell whose command succeeded
    (C(cells/<cell>/exit.json)) but whose copy was not verified (never trains it again), and reruns the others;
    RV(outcome), RV(cells_left), RV(recopy_cells) and RV(kept_cells) say so.
  - B(A changed sweep.) On a box holding the run, this launch's spec is compared with the run's C(spec.json) (cells
    added or removed, a cell's C(command), C(checkpoint_dir), C(artifacts), C(optional_artifacts), C(prune),
    C(retries) or C(timeout_s), and the run's O(durable_dir), O(artifacts), O(optional_artifacts), O(prune),
    O(verify_cmd), O(verify_artifacts), O(verify_timeout_s), O(check_finite), O(env), O(env_hook), O(conda_env),
    O(gpus_per_cell), O(max_parallel) and O(stop_on_failure); not O(launch_id), O(gpus) or the monitor's
    settings). Any difference fails the start, in check mode too, naming them (RV(changes)), unless
    O(apply_changes); a live run with another spec is refused even then (stop it first). With O(apply_changes) the
    done cells keep their results (their C(run.json) entry keeps the argv that produced them), the others follow
    the new spec; removing a cell whose command succeeded is refused even then (its files are in the durable copy;
    use a new run name).
  - B(A dead runner's cells.) Processes carrying C(RGT_RUN_DIR=<run_dir>) while the run has no live runner (the
    runner was killed, its cells train on) refuse the start, naming each cell (C(RGT_CELL)) and its pids; wait for
    them, or stop them with O(state=stopped). A new runner never kills and restarts them behind the user's back.
  - B(One launch per run name.) Every launch has an id (RV(launch_id), O(launch_id) or C(<UTC time>-<6 hex>)),
    recorded in C(run.json) and, by the runner's first sync, in C(<durable_dir>/runs/<run>/.launch.json); every sync
    checks it before it copies anything, so one C(MANIFEST.sha256) never mixes two launches. A resume keeps the id
    in the box's C(run.json). A start is refused (in check mode too) when the run was torn down on this box (its
    tombstone C(<data_dir>/runs/.torn_down/<run>.json)), or when C(<durable_dir>/runs/<run>) holds another launch,
    or files with no launch record while this box holds no C(run.json) of the run, since a relaunch would overwrite
    the verified durable copy, often the only one left. O(new_attempt) archives the earlier copy and the tombstone
    instead (a rename, never a deletion) and starts afresh; RV(archived) says where they went.
  - B(Stop.) O(state=stopped) sends SIGTERM to the runner's process group (the runner stops each running cell,
    SIGTERM then SIGKILL after O(stop_grace_s), and records it as failed with C(reason=run stopped)), waits
    O(stop_grace_s) plus 10 s, sends SIGKILL to every process of the run left (its session, its pids, and processes
    carrying C(RGT_RUN_DIR=<run_dir>) in their environment, such as a worker that called setsid), and fails unless
    none is left. Every file stays in place. A run whose runner is gone but whose cells still run (the runner was
    killed) has those processes, found by that variable only, stopped the same way; a run with neither is left
    alone (C(changed=false)).
  - B(Secrets) (O(secrets)) travel as a no_log option, land in C(.secrets.json) (0600) and reach only the cells'
    environment; never C(spec.json), C(run.json), a log line, RV(msg) or the result. A C(.secrets.json) of an
    earlier launch is removed when O(secrets) is not given.
  - Every command is an argv list; nothing builds a shell string from the options. O(env_hook) is the one file a
    shell sources (trusted operator input, the platform profile's, never built from user strings).
  - B(Autostop.) With O(autostop), the box is armed before the run starts (and before a run already running or done
    is reported). The box reads its own instance id from O(autostop.id_env) (this process's environment, else PID
    1's C(/proc/1/environ), where containers keep the platform's variables), checks that every variable
    O(autostop.env) names is set there and that the stop command's program is on C(PATH); any of them missing fails
    the call with one line naming it, and nothing is started. It then writes C(<data_dir>/runs/.autostop/armed.json)
    (0600; variable names, never their values) when the configuration differs from the armed one (a new
    generation; otherwise C(changed=false)), and starts the detached watcher (C(<data_dir>/runs/.autostop/runner/),
    log C(watch.log)) unless a live one holds C(watch.lock). The watcher stops the instance, at most once per
    generation and only with a reversible verb, once every run on the box, in every data dir the box knows (the
    data dir registry launch writes, the run markers of live processes), is C(DONE) and teardown's instance gate
    passes on the box, after O(autostop.idle_minutes) with no new run, or after O(autostop.controller_silence_hours)
    without a patrol tick; it writes its decision to C(<data_dir>/runs/.autostop.json). A process that uses a GPU
    outside every run, or a stage holding the box (a teardown's lease), holds the stop back. With a verb that keeps
    data_dir and durable_dir (C(survives)), an archived run does not block the stop, and the dead-man also stops a
    box whose run ended with a failed cell (every other copy verified); with any other verb RV(autostop.blocked_by)
    and RV(autostop.caveats) say so when arming. O(autostop.disarm) marks C(armed.json) disarmed and the watcher
    exits.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - Linux (C(/proc)), Python 3.8+ on the box; C(tmux) for O(detach=tmux); C(nvidia-smi) to detect the GPUs when
    O(gpus) is not given.
options:
  run:
    description: The run's name, its directory under C(<data_dir>/runs/); matches C(^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$).
    type: str
    required: true
  state:
    description:
      - V(started) starts the run unless it is alive or done (a dead one resumes); V(stopped) stops a live run.
    type: str
    choices: [started, stopped]
    default: started
  data_dir:
    description: The profile's fast scratch directory (absolute), holding C(runs/<run>/).
    type: path
    required: true
  durable_dir:
    description: Absolute directory that survives teardown; the artifacts go to
      C(<durable_dir>/runs/<run>/cells/<cell>/). Required when O(artifacts) is set.
    type: path
  workdir:
    description: The cells' working directory (absolute; default C(<data_dir>/code/<run>)). It must exist (outside
      check mode).
    type: path
  cells:
    description:
      - The run's cells, in queue order. Required for O(state=started).
    type: list
    elements: dict
    suboptions:
      name:
        description: The cell's name, its directory under C(cells/); same pattern as O(run), unique in the run.
        type: str
        required: true
      command:
        description: The cell's argv (rendered by the launch role from the run's command template); never run by a
          shell.
        type: list
        elements: str
        required: true
      timeout_s:
        description: Seconds (at least 1) after which the cell is stopped and recorded as failed with the reason.
        type: float
      retries:
        description: How many times a failed cell runs again (at least 0).
        type: int
        default: 0
      checkpoint_dir:
        description: Absolute directory of the cell's checkpoints, where O(prune) and O(artifacts) apply (default
          the cell's directory).
        type: str
      artifacts:
        description: This cell's own artifact globs; when given (even V([])), they replace O(artifacts) for this
          cell.
        type: list
        elements: str
      optional_artifacts:
        description: This cell's own optional artifact globs; when given (even V([])), they replace
          O(optional_artifacts) for this cell.
        type: list
        elements: str
      prune:
        description: This cell's own prune globs; when given (even V([])), they replace O(prune) for this cell.
        type: list
        elements: str
  env:
    description: Environment variables of the cells (names of letters, digits and C(_)); numbers become text.
      V(WANDB_MODE=online) needs a C(WANDB_API_KEY) secret.
    type: dict
    default: {}
  env_hook:
    description: Absolute path of a file each cell's shell sources before its command (C(/etc/network_turbo) on
      AutoDL); trusted operator input. It must be readable.
    type: path
  conda_env:
    description: A conda environment to activate before each command.
    type: str
  secrets:
    description: Secret environment variables of the cells, a mapping of names to non-empty strings; see the
      description.
    type: dict
  gpus:
    description:
      - The box's GPU indices (each between 0 and 1023) the run may use. Default from C(nvidia-smi
        --query-gpu=index) (10 s timeout); where that fails, none, and each cell gets the whole box.
    type: list
    elements: int
  gpus_per_cell:
    description: GPUs per cell (between 1 and 1024, at most the number of O(gpus)); each cell gets its own
      C(CUDA_VISIBLE_DEVICES) and up to C(len(gpus) // gpus_per_cell) cells run at once. Unset means every GPU for
      each cell, one cell at a time.
    type: int
  max_parallel:
    description: At most this many cells at once (between 1 and 1024).
    type: int
  prune:
    description: Glob patterns (relative, inside the checkpoint directory) of files deleted after a cell succeeds,
      before its artifacts are copied (for example C(latest.pth)); a pattern ending in C(/) (or matching a
      directory, such as C(checkpoint-*/)) removes that directory tree, never following a symlink out. A cell's
      own C(prune) replaces it.
    type: list
    elements: str
    default: []
  artifacts:
    description: Glob patterns (relative) of the files copied to O(durable_dir), re-read and checked by size and
      sha256, then listed in C(MANIFEST.sha256); a pattern that matches nothing fails the cell's sync. A cell's
      own C(artifacts) replaces it.
    type: list
    elements: str
    default: []
  optional_artifacts:
    description: Like O(artifacts), but a pattern may match nothing. A cell's own C(optional_artifacts) replaces
      it.
    type: list
    elements: str
    default: []
  verify_cmd:
    description:
      - An argv run for each artifact after its verified copy (for example a loader that opens the checkpoint);
        C({path}) in an element becomes the copy's absolute path, else the path is appended as the last argument.
        A failure (or a run past O(verify_timeout_s)) makes the cell's sync C(failed) with the loader's message.
    type: list
    elements: str
  verify_artifacts:
    description:
      - Which artifacts O(verify_cmd) runs on, as fnmatch patterns over each artifact's path relative to the cell's
        checkpoint directory (C(*) matches C(/) too; C(**/) may also match no directory), for example C(["*.pt"])
        so that a checkpoint loader never runs on C(config.json). Empty means every artifact. Needs O(verify_cmd);
        O(check_finite) still checks every C(*.safetensors) artifact.
    type: list
    elements: str
    default: []
  verify_timeout_s:
    description: Seconds each O(verify_cmd) may run, between 1 and 86400.
    type: float
    default: 300
  check_finite:
    description: Check every C(*.safetensors) artifact's float tensors for NaN and Inf after the copy (a malformed
      header fails too); a failure makes the cell's sync C(failed).
    type: bool
    default: false
  stop_on_failure:
    description: After a failed cell, start no more cells (running ones finish).
    type: bool
    default: false
  detach:
    description: V(auto) is tmux when installed, else setsid; V(tmux) fails without tmux.
    type: str
    choices: [auto, tmux, setsid]
    default: auto
  allow_concurrent:
    description: Start this run although a different run is alive on the box.
    type: bool
    default: false
  stop_grace_s:
    description: Seconds between SIGTERM and SIGKILL when a cell times out or the run stops, between 0 and 3600.
    type: float
    default: 30
  stopped_by:
    description:
      - With O(state=stopped), who stops the run, one word (teardown's C(stop_running) passes V(teardown)). It is
        written to C(<data_dir>/runs/<run>/stop.json) (C(by), C(at)) before the signal, so each cell the stop ends
        reads C(reason=stopped by teardown at HH:MM UTC), with C(stopped_by), in its C(result.json) and C(exit.json)
        instead of C(run stopped).
    type: str
  monitor_interval_s:
    description: Seconds between two resource samples in C(monitor.jsonl), between 0.1 and 86400.
    type: float
    default: 30
  monitor_max_bytes:
    description: C(monitor.jsonl) is rotated to C(monitor.jsonl.1) beyond this size, between 4096 and 1099511627776.
    type: int
    default: 8388608
  shard:
    description: This box's share of a sweep split across boxes, recorded in C(run.json); C(0 <= index < count).
    type: dict
    suboptions:
      index:
        description: This box's shard, from 0.
        type: int
        required: true
      count:
        description: How many boxes share the sweep.
        type: int
        required: true
  launch_id:
    description:
      - The id of this launch (same pattern as O(run)). Boxes that share one durable directory for a sharded run
        must share it (the launch role passes one id per playbook run to every box); set the id a refusal names to
        add a box to that launch. Default C(<UTC time>-<6 hex>). Ignored when the box holds the run's C(run.json),
        whose launch a resume keeps.
    type: str
  new_attempt:
    description:
      - Start the run as a new attempt although it was torn down on this box or its durable copy holds another
        launch. The durable copy C(<durable_dir>/runs/<run>) is renamed to C(<durable_dir>/runs/<run>@attempt-<N>)
        and the tombstone to C(<data_dir>/runs/.torn_down/<run>@attempt-<N>.json) (the next free I(N); C(@) is in
        no run name), then the run starts from nothing. Refused while this box holds the run's C(run.json).
    type: bool
    default: false
  apply_changes:
    description:
      - Apply a spec that differs from the one the box's run was started with (see B(A changed sweep.)) instead of
        refusing the start; the run resumes with the new spec.
    type: bool
    default: false
  start_timeout_s:
    description: Seconds to wait for the new runner to register in C(run.json), above 0 and at most 600; a runner
      that does not is stopped and the module fails with the end of C(runner.log).
    type: float
    default: 20
  autostop:
    description:
      - Arm (or, with O(autostop.disarm), disarm) the box's own autostop before the run starts; see B(Autostop.)
        above. Unset, autostop is left as it is. The launch role fills it from the platform profile's C(self_stop)
        (O(autostop.id_env), O(autostop.env), O(autostop.verb)) and its C(launch_autostop_*) variables.
      - At least one of O(autostop.idle_minutes) and O(autostop.controller_silence_hours) is needed unless
        O(autostop.disarm).
    type: dict
    suboptions:
      idle_minutes:
        description: Stop the box this many minutes after every run on it is C(DONE) and secured with no new run
          started, between 0 and 14400; null for the dead-man only.
        type: float
      controller_silence_hours:
        description: The dead-man; stop the box after this many hours without a patrol tick (C(patrol_facts)
          writes one), still only when every run is secured; above 0 and at most 8760; null for none.
        type: float
      check_interval_s:
        description: Seconds between two looks of the watcher, between 1 and 3600.
        type: float
        default: 60
      gate_retry_max_s:
        description: The longest wait between two tries of a failed gate (the wait doubles from
          O(autostop.check_interval_s)), between 1 and 86400.
        type: float
        default: 1800
      disarm:
        description: Mark the armed autostop disarmed; the watcher writes state C(disarmed) and exits. The other
          suboptions are ignored.
        type: bool
        default: false
      id_env:
        description: The variables that hold this box's own instance id, the first one set wins (C(RUNPOD_POD_ID),
          C(CONTAINER_ID); a Vast.ai label C(C.<id>) counts as C(<id>)).
        type: list
        elements: str
      env:
        description:
          - The stop command's environment variables, each mapped to the box variable it is read from, for example
            C(VAST_API_KEY) from C(CONTAINER_API_KEY) on Vast.ai. Names only; the watcher reads the values when it
            stops the box.
        type: dict
      verb:
        description: The stop verb, declared as a C(meter_stop_verbs) entry (C(command), C(status), C(final_states),
          C(survives), C(irreversible)); C({instance_id}) in its strings becomes the box's id. An irreversible verb is
          refused (autostop only stops; never delete, destroy or terminate).
        type: dict
      platform:
        description: The platform's name (C(runpod), C(vastai)), recorded in C(armed.json) and used in hints.
        type: str
      timeout_s:
        description: Seconds the watcher polls the status for a final state after the stop command, between 0 and
          86400.
        type: float
        default: 300
      poll_interval_s:
        description: Seconds between two status polls, above 0 and at most 3600.
        type: float
        default: 5
      command_timeout_s:
        description: Seconds each stop or status command may run, above 0 and at most 3600.
        type: float
        default: 60
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: Nothing is written, locked, archived or started; RV(msg), RV(outcome), RV(cells_left),
      RV(recopy_cells), RV(kept_cells) and RV(changes) say whether the run would start or resume and with which
      cells, RV(archived) what O(new_attempt) would archive, and C(changed) whether it would. A start that would be
      refused fails as it would outside check mode, a refused O(autostop) too. O(state=stopped) signals nothing.
      O(autostop) writes and starts nothing; RV(autostop.would) says what it would do.
notes:
  - Use the runtime venv's Python (C(ansible_python_interpreter)); the runner runs with the module's interpreter.
  - With tmux, a tmux server that already runs gives the run its own environment, not the SSH session's.
seealso:
  - module: remote_gpu.trainer.vram_zombies
"""

EXAMPLES = r"""
- name: Start (or resume) a two-cell run, one GPU per cell
  remote_gpu.trainer.training_run:
    run: abl-2026-12
    data_dir: /root/autodl-tmp
    durable_dir: /root/autodl-fs
    cells:
      - name: baseline
        command: [python, -m, src.train, -c, configs/baseline.yaml]
        checkpoint_dir: /root/autodl-tmp/runs/abl-2026-12/cells/baseline/ckpt
      - name: mask-0.3
        command: [python, -m, src.train, -c, configs/mask_0.3.yaml]
        timeout_s: 14400
        retries: 1
    gpus_per_cell: 1
    prune: [latest.pth]
    artifacts: [best.pth]
    env_hook: /etc/network_turbo
    env: {WANDB_MODE: online}
    secrets: {WANDB_API_KEY: "{{ lookup('ansible.builtin.env', 'WANDB_API_KEY') }}"}
  no_log: true
  register: launched

- name: Relaunch a run name that was torn down, archiving its earlier durable copy
  remote_gpu.trainer.training_run:
    run: abl-2026-12
    data_dir: /root/autodl-tmp
    durable_dir: /root/autodl-fs
    cells: "{{ abl_cells }}"
    artifacts: [best.pth]
    new_attempt: true

- name: Add a cell to a finished sweep (only the new cell runs; the done cells keep their results)
  remote_gpu.trainer.training_run:
    run: abl-2026-12
    data_dir: /root/autodl-tmp
    durable_dir: /root/autodl-fs
    cells:
      - name: baseline
        command: [python, -m, src.train, -c, configs/baseline.yaml]
      - name: hf-bert
        command: [python, -m, src.hf_train, --output_dir, /root/autodl-tmp/runs/abl-2026-12/cells/hf-bert]
        artifacts: [model.safetensors, config.json]
        prune: [checkpoint-*/]
    artifacts: [best.pth]
    verify_cmd: [python, -m, src.load_check, "{path}"]
    verify_artifacts: ["*.pth", "*.safetensors"]  # the loader never opens config.json
    check_finite: true
    apply_changes: true

- name: Start it on a RunPod pod that stops itself 30 min after every run is secured
  remote_gpu.trainer.training_run:
    run: abl-2026-12
    data_dir: /workspace/scratch
    durable_dir: /workspace/durable
    cells: "{{ abl_cells }}"
    artifacts: [best.pth]
    autostop:
      idle_minutes: 30
      controller_silence_hours: 12
      platform: runpod
      id_env: [RUNPOD_POD_ID]
      env: {RUNPOD_API_KEY: RUNPOD_API_KEY}
      verb:
        command: [runpodctl, pod, stop, "{instance_id}"]
        status: {command: [runpodctl, pod, get, "{instance_id}"], state_key: desiredStatus}
        final_states: [EXITED]
        survives: [data_dir, durable_dir]
        irreversible: false

- name: Stop it (files stay)
  remote_gpu.trainer.training_run:
    run: abl-2026-12
    data_dir: /root/autodl-tmp
    state: stopped
    stop_grace_s: 60
"""

RETURN = r"""
msg:
  description: One line, for example C(run abl started (tmux, pgid 812\)...), C(run abl already running (pgid
    812\)), C(would resume run abl (setsid\)...) or C(stopped run abl (pgid 812\)...).
  returned: always
  type: str
run:
  description: The run's name.
  returned: always
  type: str
run_dir:
  description: C(<data_dir>/runs/<run>).
  returned: always
  type: str
state:
  description: C(running) (a live runner), C(done) (C(DONE) written), C(stopped) (registered, no live runner, not
    done) or C(absent) (never registered). In check mode, the state a start would lead to.
  returned: always
  type: str
pgid:
  description: The runner's process group from C(run.json), or null.
  returned: always
  type: int
sid:
  description: The runner's session from C(run.json), or null.
  returned: always
  type: int
pids:
  description: The runner's pids from C(run.json).
  returned: always
  type: list
  elements: int
started_at:
  description: When the runner started (ISO 8601 UTC, from C(run.json)), or null.
  returned: always
  type: str
detach:
  description: C(tmux) or C(setsid) (in check mode, what a start would use), or null.
  returned: always
  type: str
attach:
  description: The command that watches a live run (C(tmux attach -t rgt-<run>) or C(tail -f <run_dir>/runner.log)),
    or null.
  returned: always
  type: str
resumed:
  description: Some cells were already done, so this start (or the live runner's) skips them.
  returned: always
  type: bool
outcome:
  description: What this launch did (in check mode, would do) with the run; V(started) (a new run), V(resumed) (a
    run already on the box started again), V(already_running) (left alone, same spec) or V(done) (finished with
    the same spec, nothing started). Not returned when the module fails.
  returned: success
  type: str
  sample: resumed
cells_left:
  description: How many cells will run their command (in check mode, would).
  returned: success
  type: int
recopy_cells:
  description: Cells whose command succeeded (C(exit.json)) but whose copy is not verified; the runner copies and
    verifies them again, without training them.
  returned: success
  type: list
  elements: str
kept_cells:
  description: Cells whose result is done and kept as it is.
  returned: success
  type: list
  elements: str
changes:
  description: "How this launch's spec differs from the box's C(spec.json), one short phrase each (C(cell c added),
    C(cell a: command changed), C(artifacts changed)); empty when it does not, or when the box has no such run."
  returned: success, and when a changed spec is refused
  type: list
  elements: str
launch_id:
  description: The launch the run belongs to (from C(run.json) for a run already there; in check mode, the id a
    start would use), or null for a run registered before launch ids.
  returned: always
  type: str
  sample: 20261204T101500Z-3fa9c2
archived:
  description: What O(new_attempt) moved aside before this start (in check mode, what it would move), each C(from)
    (the earlier durable copy or tombstone) and C(to) (its new name); empty otherwise.
  returned: always
  type: list
  elements: dict
  contains:
    from: {description: The earlier attempt's durable copy or tombstone., type: str}
    to: {description: 'Where it is now, C(...@attempt-<N>) or C(...@attempt-<N>.json).', type: str}
autostop:
  description: What O(autostop) did (in check mode, would do); null when O(autostop) is not given.
  returned: success
  type: dict
  contains:
    armed: {description: 'An armed, not disarmed, C(armed.json) is (in check mode, would be) on the box.', type: bool}
    changed: {description: 'C(armed.json) was written or a watcher started (in check mode, would be).', type: bool}
    state:
      description: V(armed), V(disarmed) (disarmed now, or already) or V(not_armed) (a disarm with nothing armed).
      type: str
    reason: {description: 'One line: what was done and what the watcher stops, and when.', type: str}
    watcher_pid: {description: "The live watcher's pid, or null.", type: int}
    watcher_started: {description: This call started the watcher., type: bool}
    generation:
      description: C(armed.json)'s generation (12 hex digits, new whenever the configuration changes); null in
        check mode when a new one would be made.
      type: str
    idle_minutes: {description: 'The idle timer in minutes, or null.', type: float}
    controller_silence_hours: {description: 'The dead-man timer in hours, or null.', type: float}
    check_interval_s: {description: Seconds between two looks of the watcher., type: float}
    instance_id: {description: The id the box read from O(autostop.id_env)., type: str}
    command: {description: 'The stop command as it will run (the id filled in, no secret), or null.', type: str}
    would: {description: 'In check mode, what arming would do; else null.', type: str}
    decision:
      description: The watcher's last decision from C(.autostop.json) (C(state), C(reason), C(due_at)), or null.
      type: dict
    blocked_by:
      description: One line per archived run, in any data dir of the box, that blocks every stop because the verb
        does not keep data_dir and durable_dir (its C(survives)); empty when the verb keeps both.
      type: list
      elements: str
    caveats:
      description: What the armed stop will never do, such as the dead-man disabled by a run that ended with a
        failed cell when the verb does not keep data_dir and durable_dir; empty otherwise.
      type: list
      elements: str
autostop_refused:
  description: True when the call failed because the box cannot arm the autostop it was asked for (its id, the
    key or the stop command's binary is missing, or the verb is not a stop); nothing was started.
  returned: failure
  type: bool
  sample: true
box_started_at:
  description: Since when the box bills (ISO 8601 UTC), kept for compatibility; the same as RV(ledger.first_seen).
  returned: success
  type: str
  sample: "2026-12-04T10:15:02Z"
box_now:
  description: The box's own clock when it answered (ISO 8601 UTC); the controller counts every duration on it, so a
    box clock off the controller's changes no cost.
  returned: success
  type: str
  sample: "2026-12-06T21:40:09Z"
ledger:
  description:
    - The box's cost ledger (one per box, in the instance dir and mirrored into each data dir as
      C(<data_dir>/runs/.instance/ledger.json)), recorded on the box except in check mode, which computes the same
      figures. It never decreases (archive, cleanup and a resume that rewrites C(started_at) leave it as it was).
  returned: success
  type: dict
  contains:
    first_seen:
      description: The rental's first sight (ISO 8601 UTC), the earliest of the ledger's own, the container's start
        (PID 1's) and, when the ledger was first made, the runs' C(started_at).
      type: str
    running_s:
      description: Seconds the box ran, over every billing segment (a boot, from its PID 1 start, to the stop of ours
        that ended it, else to when it was last seen; the current one to RV(box_now)); a stopped interval is not
        counted. The controller's cost is the host's C(hourly_usd) times these hours.
      type: float
    segments_total: {description: How many segments (boots) the ledger holds., type: int}
    segments:
      description: The newest 8 segments, C({start, end, ended_by, running_s}); C(end) null for the current one,
        C(ended_by) C(autostop) or C(teardown) for a stop of ours, null for one that ended without it.
      type: list
      elements: dict
    stopped_at:
      description: A stop of ours recorded during this boot (ISO 8601 UTC; issued, yet the box still answered), or
        null.
      type: str
    notes:
      description: Copies of the ledger or the stop record that could not be read or written, one line each.
      type: list
      elements: str
skipped_cells:
  description: Names of the cells skipped because they were already done.
  returned: always
  type: list
  elements: str
cells:
  description: Every cell of the run, in queue order.
  returned: always
  type: list
  elements: dict
  contains:
    name: {description: The cell's name., type: str}
    status:
      description: C(succeeded) or C(failed) (its C(result.json)), C(running) (started by the live runner, no result
        yet) or C(pending) (not started, or a result the live runner will replace by running it again).
      type: str
    sync: {description: 'C(verified), C(failed) or C(skipped) from C(result.json), or null.', type: str}
    done: {description: 'Succeeded and its sync verified (or skipped without artifacts): a resume skips it.',
           type: bool}
    exit_code: {description: "The command's own exit status, or null.", type: int}
    signal: {description: 'The signal that ended it, or null.', type: int}
    attempts: {description: 'How many attempts ran, or null.', type: int}
    reason: {description: 'Why it failed, its sync error, or why it is pending; null otherwise.', type: str}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_config import AutostopRefused
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between, check_options
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._training_run import LaunchError, training_run

CELL_OPTIONS = {
    "name": {"type": "str", "required": True},
    "command": {"type": "list", "elements": "str", "required": True},
    "timeout_s": {"type": "float"},
    "retries": {"type": "int", "default": 0},
    "checkpoint_dir": {"type": "str"},
    "artifacts": {"type": "list", "elements": "str"},
    "optional_artifacts": {"type": "list", "elements": "str"},
    "prune": {"type": "list", "elements": "str"},
}
AUTOSTOP_OPTIONS = {
    "idle_minutes": {"type": "float"},
    "controller_silence_hours": {"type": "float"},
    "check_interval_s": {"type": "float", "default": 60.0},
    "gate_retry_max_s": {"type": "float", "default": 1800.0},
    "disarm": {"type": "bool", "default": False},
    "id_env": {"type": "list", "elements": "str"},
    "env": {"type": "dict"},
    "verb": {"type": "dict"},
    "platform": {"type": "str"},
    "timeout_s": {"type": "float", "default": 300.0},
    "poll_interval_s": {"type": "float", "default": 5.0},
    "command_timeout_s": {"type": "float", "default": 60.0},
}
ARGUMENT_SPEC = {
    "run": {"type": "str", "required": True},
    "state": {"type": "str", "choices": ["started", "stopped"], "default": "started"},
    "data_dir": {"type": "path", "required": True},
    "durable_dir": {"type": "path"},
    "workdir": {"type": "path"},
    "cells": {"type": "list", "elements": "dict", "options": CELL_OPTIONS},
    "env": {"type": "dict", "default": {}},
    "env_hook": {"type": "path"},
    "conda_env": {"type": "str"},
    "secrets": {"type": "dict", "no_log": True},
    "gpus": {"type": "list", "elements": "int"},
    "gpus_per_cell": {"type": "int"},
    "max_parallel": {"type": "int"},
    "prune": {"type": "list", "elements": "str", "default": []},
    "artifacts": {"type": "list", "elements": "str", "default": []},
    "optional_artifacts": {"type": "list", "elements": "str", "default": []},
    "verify_cmd": {"type": "list", "elements": "str"},
    "verify_artifacts": {"type": "list", "elements": "str", "default": []},
    "verify_timeout_s": {"type": "float", "default": 300.0},
    "check_finite": {"type": "bool", "default": False},
    "stop_on_failure": {"type": "bool", "default": False},
    "detach": {"type": "str", "choices": ["auto", "tmux", "setsid"], "default": "auto"},
    "allow_concurrent": {"type": "bool", "default": False},
    "stop_grace_s": {"type": "float", "default": 30.0},
    "stopped_by": {"type": "str"},
    "monitor_interval_s": {"type": "float", "default": 30.0},
    "monitor_max_bytes": {"type": "int", "default": 8388608},
    "shard": {
        "type": "dict",
        "options": {"index": {"type": "int", "required": True}, "count": {"type": "int", "required": True}},
    },
    "launch_id": {"type": "str"},
    "new_attempt": {"type": "bool", "default": False},
    "apply_changes": {"type": "bool", "default": False},
    "start_timeout_s": {"type": "float", "default": 20.0},
    "autostop": {"type": "dict", "options": AUTOSTOP_OPTIONS},
}
OPTION_BOUNDS = {
    "gpus": Between(0, 1023),
    "gpus_per_cell": Between(1, 1024),
    "max_parallel": Between(1, 1024),
    "stop_grace_s": Between(0, 3600),
    "monitor_interval_s": Between(0.1, 86400),
    "monitor_max_bytes": Between(4096, 1 << 40),
    "start_timeout_s": Between(0, 600, above_low=True),
    "verify_timeout_s": Between(1, 86400),
}


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[("state", "started", ["cells"])],
        supports_check_mode=True,
    )
    check_options(module, OPTION_BOUNDS)
    try:
        result = training_run(module.params, module.check_mode, module.warn)
    except AutostopRefused as exc:  # the box cannot stop itself as asked: nothing was started
        module.fail_json(msg=str(exc), run=module.params["run"], autostop_refused=True)
    except ValueError as exc:  # a value only the run spec's rules can judge: the message names the option
        module.fail_json(msg=str(exc), run=module.params["run"])
    except LaunchError as exc:
        module.fail_json(msg=str(exc), **dict(exc.facts, run=module.params["run"]))
    except OSError as exc:  # the box's filesystem refused a write: say which path
        module.fail_json(msg=f"run {module.params['run']}: {exc}", run=module.params["run"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
