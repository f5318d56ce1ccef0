# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the autostop watcher does to the box: look at the runs and the patrol tick, run teardown's gate, run the
stop verb's commands with the armed environment. Every look runs in a forked child under a deadline; every
command has a timeout and its process group is killed when it runs out; no environment value ever leaves here
but in the command's environment (output that echoes one is masked). Pure standard library, Linux ``/proc``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from typing import Any, Dict, List, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_state as state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_decide import Observation, RunSeen
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import (
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
    Runner,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
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
    return [name, "not_done", "its runner ended without DONE", started]


def _observe(data_dir: str) -> Dict[str, Any]:
    if not os.path.isdir(data_dir):
        raise ValueError(f"data_dir {data_dir}: {'not a directory' if os.path.lexists(data_dir) else 'not found'}")
    runs = [_seen(data_dir, name) for name in list_runs(data_dir)]
    tick = None
    try:
        with open(patrol_tick_path(data_dir), "rb") as handle:
            tick = handle.read(MAX_TICK_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        pass
    return {"runs": runs, "tick": tick}


def observe(data_dir: str, timeout_s: float = OBSERVE_TIMEOUT_S) -> Observation:
    """The runs and the patrol tick, read in a child under a deadline (a hung mount is a problem, not a hang)."""
    answer = run_with_deadline({"seen": functools.partial(_observe, data_dir)}, timeout_s)["seen"]
    if "value" not in answer:
        why = answer.get("error") or f"data_dir {data_dir} did not answer within {timeout_s:g} s (a hung mount?)"
        return Observation(problem=state.one_line(why, 300))
    runs = tuple(RunSeen(str(n), str(s), str(r), t) for n, s, r, t in answer["value"]["runs"])
    return Observation(runs=runs, tick=answer["value"]["tick"])


def gate_params(armed: state.Armed) -> Dict[str, Any]:
    """teardown_gate's options for the whole box: every run, the instance (its id, other runs and processes)."""
    return {
        "data_dir": armed.data_dir,
        "durable_dir": armed.durable_dir,
        "runs": [],
        "instance": True,
        "instance_id": armed.instance_id,
        "instance_id_env": list(armed.id_env),
        "irreversible": False,
        "verify_timeout_s": VERIFY_TIMEOUT_S,
    }


def _gate_verdict(params: Dict[str, Any], environ_path: str) -> Dict[str, Any]:
    result = teardown_gate(params, environ_path=environ_path)
    return {"passed": bool(result["passed"]), "step": result["step"], "reason": result["reason"]}


def run_gate(armed: state.Armed, runs: int, environ_path: str) -> Dict[str, Any]:
    """The gate's verdict ``{passed, step, reason}``, run in a child: whatever it touches, it ends."""
    timeout_s = (2 * VERIFY_TIMEOUT_S + 60) * max(runs, 1) + 120
    check = functools.partial(_gate_verdict, gate_params(armed), environ_path)
    answer = run_with_deadline({"gate": check}, timeout_s)["gate"]
    if "value" in answer:
        return answer["value"]
    why = answer.get("error") or f"did not answer within {timeout_s:g} s"
    return {"passed": False, "step": "gate", "reason": f"the gate could not run: {state.one_line(why, 300)}"}


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
