# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What ``training_run`` decides on a box: start a run, leave a live or finished one alone, resume a dead one, stop one.

Every decision that starts something is taken under an flock on ``<data_dir>/runs/.launch.lock``, held until the
new runner has registered itself in ``run.json``: two launches racing on one box never start two copies of a run,
nor two runs where ``allow_concurrent`` is off. A run name that was torn down, or whose durable copy holds another
launch, is refused unless the user asks for a new attempt (``_launch_attempt``); a launch over the box's own copy of
the run (a changed spec, a dead runner's cells still training) is decided by ``_relaunch``. The runner (``_runner``)
does the cells; this side writes its input (``spec.json``, ``.secrets.json``), installs its code, detaches it and
reads back the run's state. Secrets reach only the 0600 file: never a message, a result or another file. With the
``autostop`` option the box is armed (``_autostop_arm``) before anything starts: a refused arm starts nothing. Pure
standard library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_arm import Arming, apply, prepare
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import subprocess_runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import register_data_dir
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import (
    GPU_DEVICE,
    gpu_users,
    named,
    outside_runs,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._ledger import cost_basis
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._launch_attempt import (
    AttemptRefused,
    archive,
    recorded_launch_id,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._relaunch import (
    RelaunchRefused,
    archived_text,
    decide_start,
    summary,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._runner_start import (
    LaunchError,
    detach_kind,
    start_runner,
    tmux_ready,
    wait_registered,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import (
    OnDisk,
    facts,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    RUN_MARKER,
    LaunchLockBusy,
    Run,
    launch_lock,
    run_dir,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import (
    ENV_NAME_CHARS,
    RunSpec,
    load_spec,
    parse_spec,
    secrets_json,
    spec_json,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_run import STOPPER, write_stop_record
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._runner import RUN_PY, RUNNER_MODULES

GPU_QUERY = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
GPU_TIMEOUT_S = 10.0
DATA_DIR_TIMEOUT_S = 10.0
LOCK_MARGIN_S = 30.0  # another launch holds the lock for at most its start_timeout_s, plus its writes
STOP_SETTLE_S = 10.0  # after stop_grace_s, the runner still writes its cells' results and exits
# The keys spec.json takes from the module's options as they are.
SPEC_OPTIONS = (
    "run", "data_dir", "durable_dir", "workdir", "env_hook", "conda_env", "gpus_per_cell", "max_parallel", "prune",
    "artifacts", "optional_artifacts", "verify_cmd", "verify_artifacts", "verify_timeout_s", "check_finite",
    "stop_on_failure", "stop_grace_s", "monitor_interval_s", "monitor_max_bytes", "shard", "launch_id",
)  # fmt: skip


def detect_gpus(runner: Callable[[List[str], float], Tuple[int, str, str]] = subprocess_runner) -> List[int]:
    """The box's GPU indices from nvidia-smi (bounded); [] (the whole box, no CUDA_VISIBLE_DEVICES) without it."""
    rc, out, _err = runner(list(GPU_QUERY), GPU_TIMEOUT_S)
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if rc != 0 or not all(line.isdigit() for line in lines):
        return []
    return sorted({int(line) for line in lines})


def _secrets(values: Any) -> Dict[str, str]:
    """Validate the secrets' names and types; messages name the variable, never its value."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError("secrets must be a mapping of environment variable names to strings")
    for key, value in values.items():
        valid = isinstance(key, str) and bool(key) and not key[0].isdigit() and set(key) <= ENV_NAME_CHARS
        if not valid:
            raise ValueError(f"secrets: {key!r} is not an environment variable name")
        if not isinstance(value, str) or not value:
            raise ValueError(f"secrets.{key} must be a non-empty string")
    return dict(values)


def build_spec(params: Mapping[str, Any], gpus: List[int]) -> Tuple[RunSpec, Dict[str, str]]:
    """The run's spec and secrets from the module's options; ValueError names the bad option."""
    document: Dict[str, Any] = {key: params.get(key) for key in SPEC_OPTIONS}
    document["workdir"] = params.get("workdir") or os.path.join(str(params.get("data_dir")), "code", params["run"])
    document["cells"] = [
        {key: value for key, value in cell.items() if value is not None} if isinstance(cell, dict) else cell
        for cell in params.get("cells") or []
    ]
    env = params.get("env") or {}
    # YAML turns OMP_NUM_THREADS: 4 into a number; the environment holds text.
    document["env"] = {
        k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in env.items()
    }
    document["gpus"] = list(gpus)
    shard = params.get("shard")
    if shard is not None:
        index, count = shard.get("index"), shard.get("count")
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"shard needs 1 <= count and 0 <= index < count, got index {index!r}, count {count!r}")
        document["shard"] = {"index": index, "count": count}
    spec = parse_spec({k: v for k, v in document.items() if v is not None})
    secrets = _secrets(params.get("secrets"))
    if spec.env.get("WANDB_MODE") == "online" and "WANDB_API_KEY" not in secrets and "WANDB_API_KEY" not in spec.env:
        raise ValueError("env WANDB_MODE=online needs a WANDB_API_KEY secret (without a key W&B cannot log online)")
    return spec, secrets


def _probe_data_dir(data_dir: str) -> None:
    answer = run_with_deadline({"isdir": functools.partial(os.path.isdir, data_dir)}, DATA_DIR_TIMEOUT_S)["isdir"]
    if answer.get("timed_out"):
        raise LaunchError(f"data_dir {data_dir} did not answer within {DATA_DIR_TIMEOUT_S:g} s (a hung mount?)")
    if "error" in answer or (not answer.get("value") and os.path.lexists(data_dir)):
        raise LaunchError(f"data_dir {data_dir} is not a usable directory")


def _probe_durable_dir(spec: RunSpec) -> None:
    """A run that declares artifacts needs its durable_dir now: found missing only at the first sync, every cell
    would train for hours and end "sync failed". Never created here: a missing one may be an unmounted volume."""
    if not spec.durable_dir or not any(spec.declares_artifacts(cell) for cell in spec.cells):
        return
    probe = functools.partial(os.path.isdir, spec.durable_dir)
    answer = run_with_deadline({"isdir": probe}, DATA_DIR_TIMEOUT_S)["isdir"]
    if answer.get("timed_out"):
        raise LaunchError(
            f"durable_dir {spec.durable_dir} did not answer within {DATA_DIR_TIMEOUT_S:g} s (a hung mount?)"
        )
    if not answer.get("value"):
        raise LaunchError(
            f"durable_dir {spec.durable_dir} is not a directory on the box: mount its volume (or create it) before "
            "launching; the cells' artifacts would have nowhere to go"
        )


def write_run_files(spec: RunSpec, secrets: Mapping[str, str]) -> str:
    """spec.json (0644), .secrets.json (0600, removed when there are none: an old one must not reach new cells)
    and the runner's code; the path of run.py."""
    os.makedirs(spec.run_dir, exist_ok=True)
    write_json_atomic(spec_json(spec.run_dir), spec.to_json())
    os.chmod(spec_json(spec.run_dir), 0o644)
    if secrets:
        write_json_atomic(secrets_json(spec.run_dir), dict(secrets), private=True)
    elif os.path.lexists(secrets_json(spec.run_dir)):
        os.unlink(secrets_json(spec.run_dir))
    return detach.install_runner(spec.run_dir, RUNNER_MODULES, RUN_PY)


def _probe_box(spec: RunSpec, check_mode: bool, warn: Callable[[str], None]) -> None:
    """What the run needs on the box before anything is decided: its directories, env_hook and workdir."""
    _probe_data_dir(spec.data_dir)
    _probe_durable_dir(spec)
    if spec.env_hook and not os.access(spec.env_hook, os.R_OK):
        raise LaunchError(f"env_hook {spec.env_hook} is not a readable file")
    if not os.path.isdir(spec.workdir):
        if not check_mode:
            raise LaunchError(f"workdir {spec.workdir} is not a directory (bring the code first)")
        warn(f"workdir {spec.workdir} is not a directory yet")


def _arming(params: Mapping[str, Any]) -> Optional[Arming]:
    """The ``autostop`` option validated and checked on the box (AutostopRefused, a ValueError); None when unset."""
    options = params.get("autostop")
    if options is None:
        return None
    where = {key: params.get(key) for key in ("data_dir", "durable_dir", "run", "launch_id")}
    return prepare(dict(options, **where))


def _register(spec: RunSpec, warn: Callable[[str], None]) -> None:
    """Tell the box this data dir holds runs: a teardown or a watcher armed for another data dir must see them."""
    try:
        register_data_dir(spec.data_dir, spec.durable_dir)
    except (OSError, TimeoutError) as exc:
        warn(
            f"data_dir {spec.data_dir} is not in the box's data dir registry ({exc}): a teardown or an autostop armed "
            "for another data dir sees this run only while it runs (set RGT_INSTANCE_DIR to a writable directory)"
        )


def _warn_foreign_gpus(gpus: List[int], warn: Callable[[str], None]) -> None:
    """A GPU this run may be given that a process of no run holds (a job started by hand) is shared, not free: said,
    not refused (the runner only waits for GPUs other runs hold)."""
    users, _unreadable = gpu_users(pattern=GPU_DEVICE)
    given = set(gpus)
    for gpu in sorted({g for user in outside_runs(users) for g in user["gpus"] if not given or g in given}):
        holders = [user for user in outside_runs(users) if gpu in user["gpus"]]
        warn(
            f"GPU {gpu} is in use by {named(holders)}, which belongs to no run (started by hand?): a cell given GPU "
            f"{gpu} shares it; stop that process, or launch on other GPUs (launch_gpus)"
        )


def _with_autostop(result: Dict[str, Any], autostop: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    if autostop is None:
        return dict(result, autostop=None)
    changed = bool(result.get("changed")) or autostop["changed"]
    return dict(result, autostop=autostop, changed=changed, msg=f"{result['msg']}; autostop: {autostop['reason']}")


def started(params: Mapping[str, Any], check_mode: bool, warn: Callable[[str], None]) -> Dict[str, Any]:
    gpus = params.get("gpus")
    spec, secrets = build_spec(params, list(gpus) if gpus is not None else detect_gpus())
    _probe_box(spec, check_mode, warn)
    how, tmux = detach_kind(params.get("detach") or "auto")
    arming = _arming(params)
    start_timeout_s = params["start_timeout_s"]
    # Another launch holds the lock while its runner registers (a dead runner's cells are refused, never waited on).
    lock = launch_lock(spec.data_dir, start_timeout_s + LOCK_MARGIN_S)
    try:
        with contextlib.nullcontext() if check_mode else lock:
            try:
                decision = decide_start(spec, params, how, check_mode, warn)
            except RelaunchRefused as exc:
                raise LaunchError(str(exc), exc.facts) from exc
            if not check_mode:
                _register(decision.spec, warn)
            if decision.relaunch.outcome in ("started", "resumed"):
                _warn_foreign_gpus(list(decision.spec.gpus), warn)
            # Armed before the runner starts: a run never goes unwatched, and a failed arm starts nothing.
            autostop = None if arming is None else apply(replace(arming, launch_id=decision.spec.launch_id), check_mode)
            if decision.result is not None:
                return _with_autostop(decision.result, autostop)
            spec, attempt = decision.spec, decision.attempt
            archived = [item.as_fact() for item in attempt.archives]
            try:
                if how == "tmux" and tmux is not None:
                    tmux_ready(tmux, spec.run)
                archive(attempt)
                try:
                    run_py = write_run_files(spec, secrets)
                except OSError as exc:
                    raise LaunchError(f"could not write the run's files under {spec.run_dir}: {exc}") from exc
                runner = start_runner(spec, how, tmux, run_py, decision.disk.record.get("started_at"))
                disk = wait_registered(spec, runner, start_timeout_s, secrets)
            except AttemptRefused as exc:
                done = [item.as_fact() for item in exc.done]
                raise LaunchError(str(exc), {"launch_id": spec.launch_id, "archived": done}) from exc
            except LaunchError as exc:  # an archive (a rename) stays done: the failure says where the copy went
                exc.facts.update(launch_id=spec.launch_id, archived=archived)
                raise
    except LaunchLockBusy as exc:
        raise LaunchError(str(exc)) from exc
    relaunch = decision.relaunch
    result = facts(spec, spec.data_dir, spec.run, disk)
    result["skipped_cells"] = result["skipped_cells"] or list(relaunch.cells.kept)
    result.update(changed=True, resumed=bool(result["skipped_cells"]), launch_id=spec.launch_id, archived=archived)
    result.update(relaunch.as_facts())
    where = f"{result['detach']}, pgid {result['pgid']}"
    msg = f"run {spec.run} {relaunch.outcome} ({where}): {summary(relaunch)}"
    if not disk.live:
        msg += f"; its runner already ended ({result['state']})"
    return _with_autostop(dict(result, msg=msg + archived_text(attempt, False)), autostop)


def stopped(params: Mapping[str, Any], check_mode: bool, warn: Callable[[str], None]) -> Dict[str, Any]:
    run, data_dir = params["run"], params["data_dir"]
    if not os.path.isabs(data_dir):
        raise ValueError(f"data_dir must be an absolute path, not {data_dir!r}")
    run_dir(data_dir, run)  # ValueError for a bad name
    stopper = params.get("stopped_by")
    if stopper is not None and not STOPPER.match(stopper):
        raise ValueError(f"stopped_by must be one word of letters, digits, _ . or - (at most 32), not {stopper!r}")
    _probe_data_dir(data_dir)
    arming = _arming(params)
    autostop = None if arming is None else apply(arming, check_mode)
    disk = OnDisk(data_dir, run)
    if disk.problem:
        warn(disk.problem)
    try:
        spec: Optional[RunSpec] = load_spec(disk.run_dir)
    except (OSError, ValueError):
        spec = None
    launch = {"launch_id": recorded_launch_id(disk.record), "archived": []}
    result = dict(facts(spec, data_dir, run, disk), **launch)
    markers = [f"{RUN_MARKER}={disk.run_dir}"]
    # A dead runner's ids may name other processes by now: only the run's marker finds what it left running.
    target = disk.registered if disk.live and disk.registered is not None else Run(run, disk.run_dir)
    leftovers = [] if disk.live else detach.run_members(target, markers)
    if not disk.live and not leftovers:
        return _with_autostop(dict(result, changed=False, msg=f"run {run} is not running ({disk.state})"), autostop)
    grace = params["stop_grace_s"]
    what = f"run {run} (pgid {result['pgid']})" if disk.live else f"{len(leftovers)} process(es) left by run {run}"
    if check_mode:
        return _with_autostop(dict(result, changed=True, msg=f"would stop {what}, SIGKILL after {grace:g} s"), autostop)
    if stopper is not None:  # before the signal: the runner records each cell it stops as stopped by this stopper
        write_stop_record(disk.run_dir, stopper, time.time())
    outcome = detach.stop_run(target, grace, markers, STOP_SETTLE_S)
    after = OnDisk(data_dir, run)
    result = dict(facts(spec, data_dir, run, after), **launch, detach=result["detach"], changed=True)
    if outcome.left:
        pids = ", ".join(str(pid) for pid in outcome.left[:10])
        raise LaunchError(f"run {run}: {len(outcome.left)} process(es) survived SIGKILL: {pids}", result)
    killed = f", {len(outcome.killed)} needed SIGKILL" if outcome.killed else ""
    return _with_autostop(
        dict(result, state=after.state, msg=f"stopped {what}: {outcome.found} process(es){killed}"), autostop
    )


def training_run(params: Mapping[str, Any], check_mode: bool, warn: Callable[[str], None]) -> Dict[str, Any]:
    """The module's work; ValueError (a bad option, a refused autostop) and LaunchError carry the one-line failure
    message. ``box_now``, ``box_started_at`` and ``ledger``: the box's cost ledger for the controller's cost
    (``_ledger.cost_basis``), recorded on the box except in check mode, which computes the same figures."""
    work = stopped if params.get("state") == "stopped" else started
    result = work(params, check_mode, warn)
    return dict(result, **cost_basis([params["data_dir"]], write=not check_mode))
