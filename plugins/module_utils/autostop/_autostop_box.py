# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the autostop watcher does to the box: look at the whole instance (every run in every data dir it knows,
the GPU users outside any run, the stage holding the box) and the patrol tick, run teardown's gate in each data
dir, take the box for the stop and record it, run the stop verb's commands with the armed environment. Every look
runs in a forked child under a deadline; every command has a timeout and its process group is killed when it runs
out; no environment value ever leaves here but in the command's environment (output that echoes one is masked).
Pure standard library, Linux ``/proc``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from typing import Any, Dict, List, Optional, Pattern, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_state as state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_decide import Observation, RunSeen
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import (
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
    Runner,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state as box_state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import (
    GPU_DEVICE,
    gpu_users,
    named,
    outside_runs,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._stops import record_stop
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, read_json_quietly
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    list_runs,
    patrol_tick_path,
    run_dir,
    tombstone_path,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_instance import box_ids

OBSERVE_TIMEOUT_S = 30.0
MAX_TICK_BYTES = 4096
# The gate hashes every durable file (each run's verify bounded by VERIFY_TIMEOUT_S, twice: copy and scratch).
VERIFY_TIMEOUT_S = 1800.0
KILL_WAIT_S = 5.0


LEASE_SLACK_S = 120.0
LEASE_HOLDER = "autostop"


# --- what the watcher sees ---------------------------------------------------------------------------------------


def _seen(data_dir: str, name: str) -> List[Any]:
    """[name, state, reason, started_at] of one run (in the observing child)."""
    tombstone = read_json_quietly(tombstone_path(data_dir, name))
    if not os.path.isdir(run_dir(data_dir, name)):
        return [name, "gone", "torn down", None] if tombstone is not None else [name, "not_done", "no directory", None]
    if tombstone is not None and tombstone.get("state") == "removing":
        return [name, "not_done", "teardown is removing its scratch", None]
    disk = OnDisk(data_dir, name)
    started = disk.record.get("started_at")
    started = None if started is None else str(started)
    if disk.live:
        return [name, "live", f"its runner runs, pgid {disk.record.get('pgid')}", started]
    if disk.done:
        return [name, "done", "", started]
    if disk.problem or disk.registered is None:
        return [name, "not_done", disk.problem or "no run.json yet", started]
    return [name, "ended", "its runner ended without DONE", started]


def _observe(data_dir: str, with_tick: bool) -> Dict[str, Any]:
    if not os.path.isdir(data_dir):
        raise ValueError(f"data_dir {data_dir}: {'not a directory' if os.path.lexists(data_dir) else 'not found'}")
    runs = [_seen(data_dir, name) for name in list_runs(data_dir)]
    tick = None
    try:
        if with_tick:
            with open(patrol_tick_path(data_dir), "rb") as handle:
                tick = handle.read(MAX_TICK_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        pass
    return {"runs": runs, "tick": tick}


def _holder(lease: Optional[Dict[str, Any]]) -> Optional[List[str]]:
    if lease is None:
        return None
    return [state.one_line(str(lease.get(key) or "?"), 64) for key in ("holder", "since", "until")]


def _instance(data_dir: str, device: Pattern[str]) -> Dict[str, Any]:
    """Every data dir of the box (the armed one first), the lease holding the box and the GPU users outside any
    run, named (in a child: a registered data dir may be a hung mount)."""
    data_dirs, problems = box_state.known_data_dirs([data_dir])
    users, _unreadable = gpu_users(pattern=device)
    outside = [named([user]) for user in outside_runs(users)]
    return {
        "data_dirs": data_dirs,
        "problems": problems,
        "lease": _holder(box_state.active_lease()),
        "outside": outside,
    }


def observe(data_dir: str, timeout_s: float = OBSERVE_TIMEOUT_S, device: Pattern[str] = GPU_DEVICE) -> Observation:
    """The instance: the runs of every data dir, the GPU users outside any run, the stage holding the box, and the
    patrol tick of the armed data dir; each read in a child under a deadline (a hung mount is a problem, not a
    hang). A data dir that cannot be read is a problem: nothing is known, nothing stops."""
    answer = run_with_deadline({"box": functools.partial(_instance, data_dir, device)}, timeout_s)["box"]
    if "value" not in answer:
        why = answer.get("error") or f"did not answer within {timeout_s:g} s"
        return Observation(problem=state.one_line(f"the box's data dirs cannot be listed: {why}", 300))
    box = answer["value"]
    if box["problems"]:
        return Observation(problem=state.one_line(box["problems"][0], 300))
    dirs = [data_dir, *(path for path in box["data_dirs"] if path != data_dir)]
    probes = {path: functools.partial(_observe, path, path == data_dir) for path in dirs}
    seen = run_with_deadline(probes, timeout_s)
    runs: List[RunSeen] = []
    for path in dirs:
        if "value" not in seen[path]:
            why = seen[path].get("error") or f"data_dir {path} did not answer within {timeout_s:g} s (a hung mount?)"
            return Observation(problem=state.one_line(why, 300))
        where = "" if path == data_dir else path
        runs += [RunSeen(str(n), str(s), str(r), t, where) for n, s, r, t in seen[path]["value"]["runs"]]
    lease = box["lease"]
    return Observation(
        runs=tuple(runs),
        tick=seen[data_dir]["value"]["tick"],
        outside=tuple(box["outside"]),
        lease=(lease[0], lease[1], lease[2]) if lease else None,
    )


def gate_params(
    armed: state.Armed, data_dir: Optional[str] = None, durable_dir: Optional[str] = None
) -> Dict[str, Any]:
    """teardown_gate's options for the armed data dir: every run in it and the instance (its id, every other run of
    every data dir of the box and its processes, the GPU users, what the stop verb keeps: ``survives``). For another
    data dir of the box (``data_dir``, with the ``durable_dir`` launch recorded for it): every run in it, judged as
    strictly as the armed data dir's (the instance is judged once, from the armed data dir, whose filesystems are
    the ones ``survives`` names)."""
    if data_dir is not None:
        return {"data_dir": data_dir, "durable_dir": durable_dir, "runs": [], "verify_timeout_s": VERIFY_TIMEOUT_S}
    return {
        "data_dir": armed.data_dir,
        "durable_dir": armed.durable_dir,
        "runs": [],
        "instance": True,
        "instance_id": armed.instance_id,
        "instance_id_env": list(armed.id_env),
        "irreversible": False,
        "survives": list(armed.plan.verb.survives) if armed.plan else [],
        "verify_timeout_s": VERIFY_TIMEOUT_S,
    }


def _failed_cells(params: Dict[str, Any], result: Dict[str, Any], where: str, environ_path: str) -> Optional[str]:
    """What a gate failed only at cells would keep, when the gate passes with those cells accepted (every other
    copy verified): ``run r1 has a failed cell (b)``; None when something else fails then."""
    failed = {entry["run"]["name"]: entry["missing_cells"] for entry in result["runs"] if entry["step"] == "cells"}
    cells = sorted({cell for names in failed.values() for cell in names})
    if not cells or teardown_gate(dict(params, accept_incomplete_cells=cells), environ_path=environ_path)["step"]:
        return None
    return "; ".join(
        f"run {run}{where} has {'a failed cell' if len(names) == 1 else 'failed cells'} ({', '.join(names)})"
        for run, names in sorted(failed.items())
    )


def _gate_verdict(armed: state.Armed, environ_path: str) -> Dict[str, Any]:
    """The gate in every data dir of the box (the armed one first, with the instance; each other one on its runs):
    the first failure, or ``kept`` when only failed cells fail it and the stop keeps the disk."""
    data_dirs, problems = box_state.known_data_dirs([armed.data_dir])
    if problems:
        return {"passed": False, "step": "run_alive", "reason": problems[0]}
    keeps = state.keeps_disk(armed.plan.verb.survives if armed.plan else ())
    kept: List[str] = []
    first: Optional[Dict[str, Any]] = None
    for data_dir in data_dirs:
        other = data_dir != armed.data_dir
        params = gate_params(armed, data_dir, box_state.durable_dir_of(data_dir)) if other else gate_params(armed)
        result = teardown_gate(params, environ_path=environ_path)
        if result["passed"]:
            continue
        where = f" in {data_dir}" if other else ""
        reason = f"data_dir {data_dir}: {result['reason']}" if other else result["reason"]
        verdict = {"passed": False, "step": result["step"], "reason": reason}
        found = _failed_cells(params, result, where, environ_path) if keeps and result["step"] == "cells" else None
        if found is None:
            return verdict
        kept.append(found)
        first = first or verdict
    if first is not None:
        return dict(first, kept=f"{'; '.join(kept)}, kept on the disk the stop keeps")
    return {"passed": True, "step": None, "reason": ""}


def run_gate(armed: state.Armed, runs: int, environ_path: str) -> Dict[str, Any]:
    """The gate's verdict ``{passed, step, reason, kept}`` over every data dir of the box, run in a child: whatever
    it touches, it ends."""
    timeout_s = (2 * VERIFY_TIMEOUT_S + 60) * max(runs, 1) + 120
    check = functools.partial(_gate_verdict, armed, environ_path)
    answer = run_with_deadline({"gate": check}, timeout_s)["gate"]
    if "value" in answer:
        return answer["value"]
    why = answer.get("error") or f"did not answer within {timeout_s:g} s"
    return {"passed": False, "step": "gate", "reason": f"the gate could not run: {state.one_line(why, 300)}"}


# --- the moment of the stop ---------------------------------------------------------------------------------------


def _claim(token: str, ttl_s: float, device: Pattern[str]) -> Dict[str, Any]:
    """Take the box for the stop (the lease a teardown takes: whoever takes it first holds the box) and look for GPU
    users outside any run once more; what holds the stop back, if anything."""
    users, _unreadable = gpu_users(pattern=device)
    outside = outside_runs(users)
    if outside:
        return {"outside": [named([user]) for user in outside]}
    try:
        other = box_state.take_lease(LEASE_HOLDER, token, ttl_s)
    except (OSError, TimeoutError) as exc:
        # The instance dir cannot be written (a read-only home): no stage can take it either; read what is there.
        other = box_state.active_lease()
        return {"lease": _holder(other), "note": f"the box lease could not be taken: {state.one_line(str(exc), 200)}"}
    return {"lease": _holder(other)}


def claim_box(armed: state.Armed, token: str, device: Pattern[str] = GPU_DEVICE) -> Tuple[Optional[Observation], str]:
    """Right before the stop command: the box taken for the stop, or an observation of what holds it (a stage's
    lease taken since the last look, a GPU job started by hand); and a note."""
    plan = armed.plan
    ttl_s = (plan.command_timeout_s + plan.timeout_s if plan else 0.0) + LEASE_SLACK_S
    answer = run_with_deadline({"claim": functools.partial(_claim, token, ttl_s, device)}, OBSERVE_TIMEOUT_S)["claim"]
    if "value" not in answer:
        why = answer.get("error") or f"did not answer within {OBSERVE_TIMEOUT_S:g} s"
        return Observation(problem=state.one_line(f"the box could not be taken for the stop: {why}", 300)), ""
    found = answer["value"]
    if found.get("outside"):
        return Observation(outside=tuple(found["outside"])), ""
    lease = found.get("lease")
    held = Observation(lease=(lease[0], lease[1], lease[2])) if lease else None
    return held, str(found.get("note") or "")


def release_box(token: str) -> None:
    """Give the box back after a stop that did not take (one that did ends with the box)."""
    release = functools.partial(box_state.release_lease, token)
    run_with_deadline({"release": release}, OBSERVE_TIMEOUT_S)


def record(armed: state.Armed) -> str:
    """Record the stop in the box's stop record before its command runs; a problem line, or ""."""
    verb = armed.plan.verb.name if armed.plan else None
    entry = functools.partial(record_stop, "autostop", verb=verb, data_dirs=[armed.data_dir])
    answer = run_with_deadline({"record": entry}, OBSERVE_TIMEOUT_S)["record"]
    if "value" not in answer:
        return state.one_line(f"the stop record was not written: {answer.get('error') or 'no answer in time'}", 300)
    problems = answer["value"][1]
    return state.one_line(f"the stop record: {problems[0]}", 300) if problems else ""


# --- the stop command ----------------------------------------------------------------------------------------------


def stop_env(armed: state.Armed, environ_path: str) -> Tuple[Dict[str, str], List[str], List[str]]:
    """(the command's environment, the secret values in it, the box variables not found)."""
    found, _unreadable = box_ids([box for _cmd, box in armed.env], environ_path)
    values = {name: value for name, value, _source in found}
    env = dict(os.environ, LC_ALL="C", LANG="C")
    env.pop("RGT_RUN_DIR", None)  # the stop command is no run's process
    secrets, missing = [], []
    for command_var, box_var in armed.env:
        if box_var in values:
            env[command_var] = values[box_var]
            secrets.append(values[box_var])
        else:
            missing.append(box_var)
    return env, secrets, missing


def hide(text: str, secrets: Sequence[str]) -> str:
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def env_runner(env: Dict[str, str], secrets: Sequence[str]) -> Runner:
    """A runner (``_command.Runner``) with ``env``, its process group killed on timeout, output without a secret."""

    def run(argv: List[str], timeout: float) -> Tuple[int, str, str]:
        try:
            # Not run_command: the on-box watcher has no AnsibleModule, and a timeout kills the whole group.
            proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True,
            )  # fmt: skip
        except FileNotFoundError:
            return RC_NOT_FOUND, "", f"{argv[0]}: command not found"
        except PermissionError as exc:
            return RC_NOT_EXECUTABLE, "", f"{argv[0]}: {exc.strerror}"
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            # A grandchild that left the group may keep the pipes: the command is over for us anyway.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=KILL_WAIT_S)
            return RC_TIMEOUT, "", f"timed out after {timeout:g} s"
        text = [hide(data[-1024 * 1024 :].decode("utf-8", errors="replace"), secrets) for data in (out, err)]
        return proc.returncode, text[0], text[1]

    return run
