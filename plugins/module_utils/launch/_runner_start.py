# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""How ``training_run`` starts a run's runner: detached (tmux or setsid) with the module's interpreter, then waited
for until it registers in ``run.json``; a runner that never does is stopped and the failure quotes the end of
``runner.log`` (secrets redacted). Pure standard library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import RunSpec, runner_log

LOG_TAIL_LINES = 3
POLL_S = 0.05


class LaunchError(Exception):
    """The module fails with this one-line message (never a secret) and these facts."""

    def __init__(self, message: str, facts: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.facts = facts or {}


def _log_tail(path: str, secrets: Mapping[str, str]) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - 8192))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    text = " | ".join(line.strip()[:300] for line in lines if line.strip())
    for value in sorted(secrets.values(), key=len, reverse=True):
        text = text.replace(value, "<redacted>")
    return f"; runner.log: {text}" if text else ""


def tmux_ready(tmux: str, run: str) -> None:
    """A session of this name without a live runner: its dead panes are cleared, a live pane refuses the start."""
    session = detach.tmux_session(run)
    panes = detach.tmux_panes(tmux, session, os.environ)
    if panes is None:
        return
    alive = [pid for dead, pid in panes if not dead]
    if alive:
        raise LaunchError(
            f"tmux session {session} exists (pane pid {alive[0]}) but run {run} has no live runner; "
            f"end it (tmux kill-session -t {session}) or set detach: setsid"
        )
    detach.kill_tmux_session(tmux, session, os.environ)


@dataclass(frozen=True)
class Detached:
    """How a runner was just started: ``how`` (tmux / setsid), the tmux binary, its pid, when, and the started_at of
    the run.json it replaces (a dead runner's, on a resume)."""

    how: str
    tmux: Optional[str]
    pid: Optional[int]
    since: float
    previous: Optional[str]

    def gone(self, run: str) -> bool:
        """The runner already ended: its tmux session has no live pane, or its pid is gone."""
        if self.how == "tmux" and self.tmux is not None:
            panes = detach.tmux_panes(self.tmux, detach.tmux_session(run), os.environ)
            return panes is None or all(dead for dead, _pid in panes)
        return self.pid is None or not detach.pid_alive(self.pid)

    def stop(self, run: str) -> None:
        if self.how == "tmux" and self.tmux is not None:
            detach.kill_tmux_session(self.tmux, detach.tmux_session(run), os.environ)
        elif self.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


def start_runner(spec: RunSpec, how: str, tmux: Optional[str], run_py: str, previous: Optional[str]) -> Detached:
    """Detach the runner with the interpreter that runs this module (the runtime venv's, in the role)."""
    argv = [sys.executable, run_py, spec.run_dir]
    env = dict(os.environ, RGT_DETACH=how)
    since = time.time()
    if how == "tmux" and tmux is not None:
        session = detach.tmux_session(spec.run)
        detach.start_tmux(tmux, session, argv, env, spec.run_dir)
        panes = detach.tmux_panes(tmux, session, os.environ)  # the pane's process is the runner (env execs it)
        return Detached(how, tmux, panes[0][1] if panes else None, since, previous)
    pid = detach.start_setsid(argv, env, spec.run_dir, runner_log(spec.run_dir))
    return Detached(how, None, pid, since, previous)


def _registered_since(spec: RunSpec, started: Detached) -> Optional[OnDisk]:
    """The run's state once run.json is the new runner's (its pid; or, unknown, written since the start), else None."""
    disk = OnDisk(spec.data_dir, spec.run)
    run = disk.registered
    if run is None:
        return None
    if started.pid is not None:
        return disk if started.pid in run.pids else None
    fresh = disk.record.get("started_at") != started.previous and (run.started_at or 0.0) >= started.since - 0.5
    return disk if fresh else None


def wait_registered(spec: RunSpec, started: Detached, timeout_s: float, secrets: Mapping[str, str]) -> OnDisk:
    """Until the new runner's run.json names a live pid (or it already finished); LaunchError when it died first."""
    deadline = time.monotonic() + timeout_s
    while True:
        disk = _registered_since(spec, started)
        if disk is not None:
            return disk
        gone = started.gone(spec.run)
        if gone or time.monotonic() >= deadline:
            disk = _registered_since(spec, started)  # it may have registered and ended between two looks
            if disk is not None:
                return disk
            tail = _log_tail(runner_log(spec.run_dir), secrets)
            if gone:
                raise LaunchError(f"the runner of {spec.run} ended before it registered in run.json{tail}")
            started.stop(spec.run)
            raise LaunchError(f"the runner of {spec.run} did not register within {timeout_s:g} s (stopped it){tail}")
        time.sleep(POLL_S)


def detach_kind(requested: str) -> Tuple[str, Optional[str]]:
    tmux = shutil.which("tmux")
    if requested == "tmux" and tmux is None:
        raise LaunchError("detach is tmux but tmux is not installed on this box; use detach: auto or setsid")
    return ("tmux", tmux) if requested in ("auto", "tmux") and tmux else ("setsid", None)
