# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The on-box autostop watcher: ``python3 <data_dir>/runs/.autostop/runner/run.py <data_dir>``, detached by arming.

One per box (an flock on ``watch.lock``, held for life). Every check_interval_s it reads ``armed.json`` again,
looks at the instance (every run in every data dir the box knows, the GPU users outside any run, the stage that
holds the box) and the patrol tick (``_autostop_box``: in children under deadlines), and lets ``_autostop_decide``
say what to do: wait, run teardown's gate in every data dir (every run over, every cell done, the durable copy
hashed against its manifest, no other run or process left, the box's own id), or stop the instance with the armed
verb (``_meter_stop.meter_stop``: the command, then its status polled to a final state). Right before the command
the watcher takes the box's lease (a teardown holding it, or a GPU job started by hand since the last look, holds
the stop back) and records the stop in the box's stop record. ``stopping`` is written before the command runs
(the container may die with it); a generation is stopped at most once. The stop command's environment is this
process's plus the armed ``env`` mapping, each value read from this process's environment or PID 1's; no value is
ever written or logged. ``.autostop.json`` holds the decision,
``watch.log`` a line per state change. Exit 0 once stopped or disarmed, or when another watcher holds the lock.

Pure standard library (Python 3.8+), installed into ``<data_dir>/runs/.autostop/runner/`` (``AUTOSTOP_MODULES``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Pattern, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_decide as decide_mod
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_state as state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_box import (
    claim_box,
    env_runner,
    hide,
    observe,
    record,
    release_box,
    run_gate,
    stop_env,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_decide import (
    Decision,
    Memory,
    Observation,
    Timers,
    decide,
    gate_allows,
    new_memory,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import GPU_DEVICE
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop import (
    MeterStopError,
    meter_stop,
    poll_status,
    shown,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_instance import PID1_ENVIRON

PACKAGE = "ansible_collections.remote_gpu.trainer.plugins.module_utils"
# Every module_utils file the watcher imports, directly or not: arming installs exactly these (a test runs the
# watcher from a tree holding only them).
AUTOSTOP_MODULES = (
    "autostop/_autostop_watch.py", "autostop/_autostop_box.py", "autostop/_autostop_decide.py",
    "autostop/_autostop_state.py", "instance/_box_state.py", "instance/_gpu_users.py", "instance/_stops.py",
    "common/_command.py", "common/_deadline.py", "common/_files.py", "common/_options.py", "instance/_ledger.py",
    "box/_disk.py",
    "layout/_archive_durable.py", "layout/_run_state.py", "layout/_runs.py", "layout/_runspec.py",
    "launch/_run_detach.py", "procs/_proctree.py",
    "runner/_artifact_check.py", "runner/_cell_exec.py", "runner/_cell_files.py", "runner/_cell_sync.py",
    "runner/_env_hook.py", "runner/_procfs.py", "teardown/_copy_verify.py", "teardown/_load_verify.py",
    "teardown/_meter_stop.py", "teardown/_meter_stop_verbs.py", "teardown/_teardown_gate.py",
    "teardown/_teardown_instance.py", "teardown/_teardown_box.py", "teardown/_teardown_hold.py",
)  # fmt: skip
WATCH_PY = f'''#!/usr/bin/env python3
"""The autostop watcher of one box, installed by remote_gpu.trainer.training_run: run.py <data_dir>."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from {PACKAGE}.autostop._autostop_watch import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''
EXIT_OK, EXIT_USAGE = 0, 2


def _rounded(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds, 3)


# --- the loop ------------------------------------------------------------------------------------------------------


class Watcher:
    """The watcher of one box; :meth:`run` returns the exit code. Clock, wall clock and sleep are injectable."""

    def __init__(
        self,
        data_dir: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        *,
        environ_path: str = PID1_ENVIRON,
        gpu_device: Pattern[str] = GPU_DEVICE,
    ) -> None:
        self.data_dir, self.environ_path, self.gpu_device = data_dir, environ_path, gpu_device
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.started_at = state.utc_iso(wall())
        self.memory: Optional[Memory] = None
        self.armed: Optional[state.Armed] = None
        self.previous: Optional[Dict[str, Any]] = None
        self.history: List[Dict[str, Any]] = []
        self.stop: Optional[Dict[str, Any]] = None
        self.trigger: Optional[str] = None
        # (generation, state, what holds it) last written: a waiting box logs each new reason it waits for (a run of
        # another data dir, a GPU job by hand, a teardown's lease); other states log their changes of state only.
        self.published: Optional[Tuple[Optional[str], str, str]] = None

    def run(self) -> int:
        try:
            fd = state.hold_watch_lock(self.data_dir)
        except OSError as exc:
            sys.stderr.write(f"autostop: cannot take {state.watch_lock_path(self.data_dir)}: {exc}\n")
            return EXIT_USAGE
        if fd is None:
            return EXIT_OK  # another watcher holds the box
        try:
            previous = state.read_decision(self.data_dir)
            self.previous = previous if previous is not None and previous.get("state") != "unreadable" else None
            history = (self.previous or {}).get("history")
            self.history = [h for h in history if isinstance(h, dict)] if isinstance(history, list) else []
            while True:
                try:
                    if self.iteration():
                        return EXIT_OK
                except Exception as exc:  # the watcher outlives its own faults; the log says what happened
                    line = f"{state.utc_iso(self.wall())} error {type(exc).__name__}: {exc}"
                    state.publish(self.data_dir, None, line)
                    self.sleep(self.armed.check_interval_s if self.armed else 60.0)
        finally:
            os.close(fd)

    def _current(self, plan: bool = False) -> Tuple[state.Armed, Memory]:
        """The armed settings and the memory a step acts on: set by the loop before any step runs."""
        if self.armed is None or self.memory is None or (plan and self.armed.plan is None):
            raise RuntimeError("the watcher acted before it read armed.json")
        return self.armed, self.memory

    @staticmethod
    def _timers(armed: state.Armed) -> Timers:
        return Timers(armed.idle_s, armed.silence_s, armed.check_interval_s, armed.gate_retry_max_s)

    def _read_armed(self) -> Tuple[Optional[state.Armed], str]:
        doc, problem = state.read_armed(self.data_dir)
        if problem:
            return None, f"armed.json cannot be read: {problem}; arm again"
        if doc is None:
            return None, "armed.json is gone: autostop is not armed"
        try:
            armed = state.parse_armed(doc, self.data_dir)
        except ValueError as exc:
            return None, f"armed.json cannot be used: {state.one_line(str(exc), 300)}; arm again"
        return armed, "disarmed: armed.json says so"

    def _restore(self, generation: str, now: float) -> None:
        """A fresh memory for ``generation``; what an earlier watcher issued for it is kept (at most once)."""
        memory = new_memory(generation, now)
        self.stop, self.trigger = None, None
        previous, self.previous = self.previous, None  # only at the first generation this watcher sees
        if previous is not None and previous.get("generation") == generation:
            stop = previous.get("stop") if isinstance(previous.get("stop"), dict) else None
            attempts = stop.get("attempts") if stop else None
            memory.stop_attempts = attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 0
            self.stop, self.trigger = stop, previous.get("trigger")
            if previous.get("state") in state.ISSUED:  # issued: the status is polled first, whatever it said
                memory.stop_outcome, memory.stop_reason = "stopping", str(previous.get("reason") or "")
            elif previous.get("state") == "failed" and stop is not None:
                memory.stop_outcome, memory.stop_reason = "failed", str(stop.get("msg") or "")
                memory.next_stop_at = now + decide_mod.backoff(self._timers(self.armed), max(memory.stop_attempts, 1))
        self.memory = memory

    def iteration(self) -> bool:
        """One look and decision; True when the watcher is done."""
        armed, why = self._read_armed()
        if armed is None or armed.disarmed:
            generation = armed.generation if armed else (self.memory.generation if self.memory else None)
            self._publish(Decision("disarmed", why, action="exit", sleep_s=0.0), Observation(), generation)
            return True
        self.armed = armed
        timers = self._timers(armed)
        if self.memory is None or self.memory.generation != armed.generation:
            self._restore(armed.generation, self.clock())
        _armed, memory = self._current()
        obs = decide_mod.expect_run(observe(self.data_dir, device=self.gpu_device), armed.armed_by_run)
        decision = decide(obs, memory, timers, self.clock())
        fresh = False
        if decision.action == "gate":
            self._gate(len(obs.runs), timers)
            fresh = True
            decision = decide(obs, memory, timers, self.clock())
        if decision.action == "stop":
            obs = self._stop(decision, len(obs.runs), timers, fresh, obs)
            decision = decide(obs, memory, timers, self.clock())
        elif decision.action == "poll":
            self._poll(timers)
            decision = decide(obs, memory, timers, self.clock())
        self._publish(decision, obs, armed.generation)
        if decision.action == "exit":
            return True
        self.sleep(decision.sleep_s)
        return False

    def _gate(self, runs: int, timers: Timers) -> None:
        armed, _memory = self._current()
        verdict = run_gate(armed, runs, self.environ_path)
        verdict["checked_at"] = state.utc_iso(self.wall())
        decide_mod.gate_checked(self.memory, verdict, timers, self.clock())

    def _stop(self, decision: Decision, runs: int, timers: Timers, fresh: bool, obs: Observation) -> Observation:
        """The gate again (what was verified is verified when it is relied on), the box taken (a stage's lease or a
        GPU job by hand seen now holds it back: the observation returned says so), ``stopping``, the stop record,
        then the stop."""
        armed, memory = self._current(plan=True)
        if not fresh:
            self._gate(runs, timers)
        if not gate_allows(memory.gate, decision.trigger):
            return obs
        token = f"autostop-{armed.generation}-{os.getpid()}"
        held, note = claim_box(armed, token, self.gpu_device)
        if held is not None:
            return replace(obs, problem=held.problem, outside=held.outside or obs.outside, lease=held.lease)
        command = list(armed.plan.verb.command or ())
        self.trigger = decision.trigger
        reason = f"{decision.reason.rsplit(': stopping', 1)[0]}: running {shown(command)}"
        decide_mod.stop_issued(memory, reason)
        self.stop = {
            "issued_at": state.utc_iso(self.wall()), "command": command, "outcome": None, "final_state": None,
            "msg": reason, "attempts": memory.stop_attempts, "result": None, "notes": [note] if note else [],
        }  # fmt: skip
        self._publish(Decision("stopping", reason, trigger=decision.trigger), obs, armed.generation)
        problem = record(armed)
        self.stop["notes"] += [problem] if problem else []
        env, secrets, missing = stop_env(armed, self.environ_path)
        try:
            _changed, result = meter_stop(armed.plan, False, runner=env_runner(env, secrets))
            outcome, ended = ("already" if result.get("already") else "stopped"), "stopped"
        except MeterStopError as exc:
            result = exc.result
            ended = "unconfirmed" if result.get("command_rc") == 0 else "failed"
            outcome = ended
        except Exception as exc:  # a fault of ours is a failed attempt, never a second stop in flight
            result = {"msg": f"{type(exc).__name__}: {exc}"}
            outcome = ended = "failed"
        result = json.loads(hide(json.dumps(result), secrets))
        msg = state.one_line(str(result.get("msg") or ""))
        if ended == "failed" and missing:
            msg += f" (not set on the box: {', '.join(missing)})"
        final = result.get("final_state") or ("gone" if result.get("gone") else None)
        self.stop.update(outcome=outcome, final_state=final, msg=msg, result=result)
        if ended != "stopped":  # a stop that did not take: a teardown may take the box again
            release_box(token)
        decide_mod.stop_ended(memory, ended, msg, timers, self.clock())
        return obs

    def _poll(self, timers: Timers) -> None:
        """A stop was issued for this generation already: read the status, never run the stop again."""
        armed, memory = self._current(plan=True)
        env, secrets, _missing = stop_env(armed, self.environ_path)
        issued = (self.stop or {}).get("issued_at") or "an earlier watcher's time"
        poll, error = None, ""
        try:
            poll = poll_status(armed.plan, env_runner(env, secrets))
        except Exception as exc:  # an unexpected fault reads as an unknown status
            error = f"unknown ({type(exc).__name__}: {exc})"
        if poll is not None and (poll.final or poll.gone):
            if self.stop is not None:
                self.stop.update(final_state=poll.label, outcome=self.stop.get("outcome") or "stopped")
            msg = f"the stop issued at {issued} took effect: the instance is {poll.label}"
            decide_mod.stop_ended(memory, "stopped", msg, timers, self.clock())
            return
        seen = f"still {poll.label}{f' ({poll.error})' if poll.error else ''}" if poll is not None else error
        msg = (
            f"a stop was issued at {issued} and the instance is {hide(seen, secrets)}: "
            "not issuing another (at most once per arming; arm again to stop it again)"
        )
        if self.stop is not None:
            self.stop.update(outcome=self.stop.get("outcome") or "unconfirmed", msg=state.one_line(msg))
        decide_mod.stop_ended(memory, "unconfirmed", state.one_line(msg), timers, self.clock())

    def _publish(self, decision: Decision, obs: Observation, generation: Optional[str]) -> None:
        wall = self.wall()
        at = state.utc_iso(wall)
        reason = state.one_line(decision.reason)
        line = None
        published = (generation, decision.state, reason if decision.state == "waiting" else "")
        if self.published != published:
            self.history = state.with_history(self.history, at, decision.state, reason)
            line = f"{at} {decision.state} {reason}"
            self.published = published
        timers = self._timers(self.armed) if self.armed is not None else None
        timing = decision.state in ("idle_wait", "silence_wait", "gate_failed") and decision.due_in_s is not None
        doc = {
            "version": state.VERSION, "generation": generation, "watcher_pid": os.getpid(),
            "watcher_started_at": self.started_at, "updated_at": at, "state": decision.state, "reason": reason,
            "next_check_at": None if decision.action == "exit" else state.utc_iso(wall + decision.sleep_s),
            "due_at": state.utc_iso(wall + decision.due_in_s) if timing and decision.due_in_s is not None else None,
            "idle_s": _rounded(decision.idle_s), "idle_needed_s": timers.idle_s if timers else None,
            "silence_s": _rounded(decision.silence_s), "silence_needed_s": timers.silence_s if timers else None,
            "trigger": decision.trigger or (self.trigger if decision.state in (*state.ISSUED, "failed") else None),
            "runs": [run.as_dict() for run in obs.runs],
            "gate": self.memory.gate if self.memory is not None and decision.state != "disarmed" else None,
            "stop": self.stop, "history": self.history,
        }  # fmt: skip
        state.publish(self.data_dir, doc, line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``run.py <data_dir>``: watch the box until it is stopped or disarmed."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not os.path.isabs(args[0]):
        sys.stderr.write("usage: run.py <data_dir> (an absolute path)\n")
        return EXIT_USAGE
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the SSH session that armed it may go away
    return Watcher(os.path.normpath(args[0])).run()
