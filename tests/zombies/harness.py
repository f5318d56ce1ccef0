"""Start and stop fake_job.py launchers from pytest (tests/unit import this by path)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

FAKE_JOB = Path(__file__).resolve().parent / "fake_job.py"
STARTED: List[int] = []  # process groups this test session started, for cleanup


def start_job(state: Path, device: Path, *options: str) -> Dict[str, Any]:
    """Launch fake_job.py in its own session; return its state once every holder has the device open."""
    command = [sys.executable, str(FAKE_JOB), "launch", "--device", str(device), "--state", str(state), *options]
    launcher = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL)
    STARTED.append(launcher.pid)
    deadline = time.monotonic() + 20
    while not state.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"fake job did not start: {command}")
        time.sleep(0.05)
    job = json.loads(state.read_text())
    job["popen"] = launcher
    job["holders"] = sorted(job["workers"] + job["dataloaders"])
    return job


def start_shell_job(script: str, state: Path, shell: str = "sh") -> Dict[str, Any]:
    """Run ``script`` (which starts fake_job.py in the background) in a new session; return the job's state.

    The shell exits once the job is up, leaving the job as a live user's would be after logging out.
    """
    runner = subprocess.Popen([shell, "-c", script], start_new_session=True, stdin=subprocess.DEVNULL)
    STARTED.append(runner.pid)
    runner.wait(timeout=30)
    if not state.exists():
        raise RuntimeError(f"fake job did not start: {script}")
    job = json.loads(state.read_text())
    STARTED.append(job["pgid"])
    job["holders"] = sorted(job["workers"] + job["dataloaders"])
    return job


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def kill_launcher(job: Dict[str, Any]) -> None:
    """SIGKILL the launcher only, leaving its workers orphaned (as a crashed torchrun does)."""
    job["popen"].kill()
    job["popen"].wait(timeout=10)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _live_members(pgids: List[int]) -> List[int]:
    """Processes of the groups ``pgids`` that are not zombies (a zombie holds no device any more)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            members.append(int(entry))
    return members


def stop_all() -> None:
    """Kill every process group this session started (by group id, never by name), and wait until none of their
    processes is left: a SIGKILLed holder keeps its device open until the kernel has torn it down, which a loaded
    machine can delay past the next scan."""
    killed = []
    while STARTED:
        pgid = STARTED.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
            killed.append(pgid)
    deadline = time.monotonic() + 20
    while killed and _live_members(killed) and time.monotonic() < deadline:
        time.sleep(0.05)
