"""One attempt of a cell: its own group in the runner's session, its own log, the command's own status, a clean end."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner import _cell_exec
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import (
    Attempt,
    build_env,
    run_attempt,
    stop_processes,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._env_hook import ENV_WRAPPER, command_argv
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import marker_entry, members, read_stat
from ansible_collections.remote_gpu.trainer.tests.workload.harness import alive, records, train, wait_for

PY = sys.executable


def attempt(tmp_path, argv, *, timeout_s=None, grace_s=1.0, env=None, token="t1"):
    marker = marker_entry(_cell_exec.MARKER_VARIABLE, token)
    environment = dict(os.environ, **(env or {}), **{_cell_exec.MARKER_VARIABLE: token})
    return Attempt(argv, str(tmp_path), environment, str(tmp_path / "log"), timeout_s, grace_s, marker)


def run(tmp_path, argv, stop=None, **kwargs):
    pids = []
    outcome = run_attempt(attempt(tmp_path, argv, **kwargs), stop or threading.Event(), pids.append)
    return outcome, pids


@pytest.mark.parametrize(
    ("args", "exit_code", "signum"),
    [(["--exit", "137"], 137, None), (["--signal-self", "9"], None, 9), (["--crash"], 1, None), ([], 0, None)],
)
def test_the_recorded_status_is_the_commands_own(tmp_path, args, exit_code, signum):
    outcome, _pids = run(tmp_path, train("--out", tmp_path, *args))
    assert (outcome.exit_code, outcome.signal, outcome.reason) == (exit_code, signum, None)
    assert outcome.succeeded == (exit_code == 0)
    if "--crash" in args:
        assert "Traceback (most recent call last)" in (tmp_path / "log").read_text()


def test_own_process_group_inside_the_runners_session_stdin_empty_log_appended(tmp_path):
    probe = "import os, sys; print(os.getpid(), os.getpgrp(), os.getsid(0), repr(sys.stdin.read()))"
    (tmp_path / "log").write_text("earlier attempt\n")
    outcome, pids = run(tmp_path, [PY, "-c", probe])
    run(tmp_path, [PY, "-c", "import sys; print('to stderr', file=sys.stderr)"])
    lines = (tmp_path / "log").read_text().splitlines()
    pid, pgid, sid, stdin = lines[1].split()
    assert int(pid) == int(pgid) == pids[0] != os.getpgrp()  # a group of its own, led by the command
    assert int(sid) == os.getsid(0)  # in the runner's session: patrol finds it by run.json's sid
    assert stdin == "''"  # /dev/null
    assert lines[0] == "earlier attempt" and lines[2] == "to stderr"  # appended, stdout and stderr both
    assert outcome.exit_code == 0


def test_what_the_command_leaves_behind_is_stopped_also_outside_its_group(tmp_path):
    record = tmp_path / "events.jsonl"
    # A grace long enough for a loaded machine: a child SIGKILLed before its handler ran would leave no record.
    outcome, _pids = run(tmp_path, train("--out", tmp_path, "--fork-children", 4, "--record", record), grace_s=10.0)
    assert outcome.exit_code == 0 and outcome.left == 0
    exited = [e for e in records(record) if e["event"] == "child_exit"]
    assert len(exited) == 4  # every child (two of them setsid'd out of the group) got SIGTERM and ended
    assert not any(alive(e["pid"]) for e in exited)
    assert sorted(item["pid"] for item in outcome.leftovers) == sorted(e["pid"] for e in exited)
    assert all(item["stopped"] and item["name"] for item in outcome.leftovers)


def test_a_timeout_stops_the_group_and_says_so(tmp_path):
    outcome, pids = run(tmp_path, train("--forever", "--step-s", 0.05), timeout_s=0.3, grace_s=0.5)
    assert (outcome.exit_code, outcome.signal, outcome.reason) == (None, signal.SIGTERM, "timeout after 0.3 s")
    assert 0.3 <= outcome.ended_at - outcome.started_at < 2
    assert not alive(pids[0])


def stop_when_logged(tmp_path, text):
    """An Event set once ``text`` is in the attempt's log: the command is ready (its signal handlers are set)."""
    stop = threading.Event()

    def watch():
        wait_for(lambda: (tmp_path / "log").exists() and text in (tmp_path / "log").read_text(), what=text)
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    return stop


def test_a_command_ignoring_sigterm_gets_sigkill_after_the_grace(tmp_path):
    stop = stop_when_logged(tmp_path, "epoch 1/")
    outcome, _pids = run(tmp_path, train("--forever", "--ignore-sigterm", "--step-s", 0.05), stop=stop, grace_s=0.3)
    assert (outcome.exit_code, outcome.signal, outcome.reason) == (None, signal.SIGKILL, "run stopped")


def test_a_command_that_catches_the_stop_and_exits_0_still_reads_as_stopped(tmp_path):
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print('ready', flush=True);"
        " time.sleep(30)"
    )
    outcome, _pids = run(tmp_path, [PY, "-c", script], stop=stop_when_logged(tmp_path, "ready"))
    assert (outcome.exit_code, outcome.signal, outcome.reason) == (0, signal.SIGTERM, "run stopped")
    assert not outcome.succeeded


def test_a_command_that_cannot_start_is_recorded_not_raised(tmp_path):
    outcome, pids = run(tmp_path, ["/nonexistent/train"])
    assert (outcome.exit_code, outcome.signal, pids) == (_cell_exec.EXIT_NOT_STARTED, None, [])
    assert outcome.reason.startswith("could not start: No such file or directory")
    assert "rgt: could not start" in (tmp_path / "log").read_text()


def test_the_environment_layers_later_ones_win():
    env = build_env({"A": "os", "B": "os"}, {"B": "default", "C": "default"}, {"C": "spec"}, {"D": "s"}, {"A": "rgt"})
    assert env == {"A": "rgt", "B": "default", "C": "spec", "D": "s"}


def test_without_hook_or_conda_the_argv_runs_as_is():
    assert command_argv(("python", "t.py"), None, None) == ["python", "t.py"]


def test_the_wrapper_is_a_constant_and_keeps_every_argument_and_the_exit_status(tmp_path):
    hook = tmp_path / "hook"
    hook.write_text("export HOOKED=yes\nset -- clobbered\nshift\n")
    show = "import json, os, sys; print(json.dumps([os.environ['HOOKED']] + sys.argv[1:]))"
    argv = command_argv((PY, "-c", show), str(hook), None)
    assert argv[:3] == ["bash", "-c", ENV_WRAPPER] and argv[3:8] == ["rgt", str(hook), "", "", "--"]
    tricky = ["a b", "$HOME", "'q'", "--", ""]
    done = subprocess.run([*argv, *tricky], capture_output=True, text=True, check=False)
    assert json.loads(done.stdout) == ["yes", *tricky]
    status = subprocess.run([*command_argv((PY, "-c", "raise SystemExit(3)"), str(hook), None)], check=False)
    assert status.returncode == 3  # exec: the status is the command's, not the wrapper's


def hooked(tmp_path, text, argv):
    hook = tmp_path / "network_turbo"
    hook.write_text(text)
    status = str(tmp_path / ".hook-status")
    wrapped = command_argv(argv, str(hook), None, status)
    spec = attempt(tmp_path, wrapped)
    return run_attempt(dataclasses.replace(spec, env_hook=str(hook), hook_status=status), threading.Event(), [].append)


@pytest.mark.parametrize("ending", ["exit 1", "exit 0"])
def test_an_env_hook_that_exits_is_no_exit_of_the_command(tmp_path, ending):
    ran = tmp_path / "ran"
    outcome = hooked(tmp_path, f"echo turbo on\n{ending}\n", ["touch", str(ran)])
    reason = f"env hook {tmp_path / 'network_turbo'} failed ({ending}): the command never started"
    assert (outcome.exit_code, outcome.signal, outcome.reason, outcome.hook_failed) == (None, None, reason, True)
    assert not outcome.succeeded and outcome.describe() == reason and not ran.exists()
    assert not (tmp_path / ".hook-status").exists()  # read once: the next attempt starts clean
    assert f"rgt: {reason}" in (tmp_path / "log").read_text()


def test_an_env_hook_that_returns_non_zero_is_reported_and_the_command_runs_with_its_own_status(tmp_path):
    outcome = hooked(tmp_path, "export TURBO=1\nreturn 1\n", ["bash", "-c", 'echo "turbo=$TURBO"; exit 3'])
    assert (outcome.exit_code, outcome.reason, outcome.hook_failed) == (3, None, False)
    log = (tmp_path / "log").read_text()
    assert "returned 1, going on" in log and "turbo=1" in log


def test_a_command_exiting_like_a_failed_hook_is_still_the_commands_exit(tmp_path):
    outcome = hooked(tmp_path, "export TURBO=1\n", ["bash", "-c", "exit 1"])
    assert (outcome.exit_code, outcome.reason, outcome.hook_failed) == (1, None, False)


def test_the_wrapper_refuses_a_missing_hook_and_a_conda_env_it_cannot_activate(tmp_path):
    missing = subprocess.run(
        command_argv(("true",), str(tmp_path / "nope"), None), capture_output=True, text=True, check=False
    )
    assert missing.returncode == 126 and "is not a readable file" in missing.stderr
    env = dict(os.environ, HOME=str(tmp_path), PATH="/usr/bin:/bin")
    env.pop("CONDA_EXE", None)
    no_conda = subprocess.run(
        command_argv(("true",), None, "base"), capture_output=True, text=True, env=env, check=False
    )
    assert no_conda.returncode == 126 and "conda not found" in no_conda.stderr


def test_the_wrapper_activates_the_conda_env(tmp_path):
    profile = tmp_path / "miniconda3" / "etc" / "profile.d"
    profile.mkdir(parents=True)
    (profile / "conda.sh").write_text('conda() { [ "$1" = activate ] && export CONDA_DEFAULT_ENV="$2"; }\n')
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("CONDA_EXE", None)
    show = command_argv(("bash", "-c", 'echo "$CONDA_DEFAULT_ENV"'), None, "torch")
    assert subprocess.run(show, capture_output=True, text=True, env=env, check=False).stdout.strip() == "torch"


def test_members_leave_out_zombies_and_stop_processes_escalates(tmp_path):
    zombie = subprocess.Popen(["true"], process_group=0)
    wait_for(lambda: not alive(zombie.pid), what="true exits")
    assert members(zombie.pid, None) == []  # defunct, not reaped: holds nothing, never counts
    zombie.wait()
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(30)"
    stubborn = subprocess.Popen([PY, "-c", ignore], process_group=0, stdout=subprocess.PIPE)
    stubborn.stdout.readline()
    started = time.monotonic()
    report = stop_processes(stubborn.pid, None, grace_s=0.2, reap=stubborn.poll)
    assert (report.found, report.killed, report.left) == (1, True, 0)
    assert time.monotonic() - started < 5
    assert stubborn.wait(1) == -signal.SIGKILL


def test_a_process_that_no_longer_shows_its_marker_is_waited_for_until_it_is_dead(tmp_path, monkeypatch):
    # A process in its exit drops its environment (so the marker) before its files (so the GPU): the stop must
    # follow the processes it found until they are gone, not stop at the first scan that misses their marker.
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(30)"
    stubborn = subprocess.Popen([PY, "-c", ignore], start_new_session=True, stdout=subprocess.PIPE)
    stubborn.stdout.readline()
    scans = []

    def marker_seen_once(pgid, marker, proc="/proc", since_ticks=None):
        scans.append(pgid)
        return [read_stat(stubborn.pid)] if len(scans) == 1 else []

    monkeypatch.setattr(_cell_exec, "members", marker_seen_once)
    report = stop_processes(None, b"RGT_CELL_TOKEN=x", grace_s=0.3, reap=stubborn.poll)
    assert (report.found, report.killed, report.left) == (1, True, 0)
    assert stubborn.wait(1) == -signal.SIGKILL and len(scans) > 2
