"""The instance's own files (data dir registry, box lease) and its GPU users, read from real processes: a data dir
named only by a live process's marker is known, a lease held by one stage keeps another out until it expires, and a
process holding a GPU device node is a user of a run only when it or an ancestor carries the run marker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state as box
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import (
    gpu_users,
    named,
    outside_runs,
)

WORKER = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); time.sleep(60)"
HOLD = f"""
import os, subprocess, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
if len(sys.argv) > 2:  # a worker started with env -i under the marked parent: it lost the marker
    subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[2]], env={{"PATH": "/usr/bin:/bin"}})
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def procs() -> Iterator[List[subprocess.Popen[str]]]:
    started: List[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def hold(procs: List[subprocess.Popen[str]], device: Path, env: Dict[str, str], child: Optional[Path] = None) -> int:
    argv = [sys.executable, "-c", HOLD, str(device)] + ([str(child)] if child else [])
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc.pid


def test_the_registry_keeps_every_data_dir_a_launch_used(instance_dir: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "data", tmp_path / "scratch"
    for data_dir in (first, second):
        (data_dir / "runs").mkdir(parents=True)
    box.register_data_dir(str(first), "/durable")
    box.register_data_dir(str(second), None)
    box.register_data_dir(str(first), "/durable")  # again: one entry
    found, problems = box.known_data_dirs([str(first)])
    assert (found, problems) == ([str(first), str(second)], [])
    assert box.durable_dir_of(str(first)) == "/durable" and box.durable_dir_of(str(second)) is None
    assert oct((instance_dir / box.DATA_DIRS).stat().st_mode & 0o777) == "0o600"


def test_a_data_dir_only_a_live_process_names_is_known(tmp_path: Path, procs: List[subprocess.Popen[str]]) -> None:
    hidden = tmp_path / "hidden"
    (hidden / "runs" / "r2").mkdir(parents=True)
    device = tmp_path / "nvidia0"
    device.write_text("")
    hold(procs, device, {"PATH": "/usr/bin:/bin", "RGT_RUN_DIR": str(hidden / "runs" / "r2")})
    found, _problems = box.known_data_dirs(["/data"])
    assert found[0] == "/data" and str(hidden) in found


def test_an_unreadable_registry_is_a_problem_not_an_empty_box(instance_dir: Path) -> None:
    (instance_dir / box.DATA_DIRS).write_text("{not json")
    found, problems = box.known_data_dirs(["/data"])
    assert found == ["/data"] and len(problems) == 1 and "unreadable" in problems[0]


def test_a_lease_keeps_other_holders_out_until_it_expires_or_is_released(instance_dir: Path) -> None:
    now = 1_800_000_000.0
    assert box.take_lease("teardown", "t1", 600, now=now) is None
    assert box.take_lease("teardown", "t1", 600, now=now + 10) is None  # its own refresh
    other = box.take_lease("teardown", "t2", 600, now=now + 20)
    assert other is not None and other["token"] == "t1"
    assert box.active_lease(now=now + 20)["holder"] == "teardown"
    assert box.active_lease(now=now + 700) is None  # expired: a dead controller never pins the box
    assert box.release_lease("t2") is False and box.release_lease("t1") is True
    assert box.active_lease(now=now + 30) is None


def test_a_lease_from_a_clock_far_ahead_does_not_pin_the_box(instance_dir: Path) -> None:
    lease = {"holder": "teardown", "token": "x", "until_epoch": time.time() + 10 * box.MAX_LEASE_S}
    (instance_dir / box.LEASE).write_text(json.dumps(lease))
    assert box.active_lease() is None


def test_an_unreadable_lease_holds_the_box(instance_dir: Path) -> None:
    (instance_dir / box.LEASE).write_text("garbage")
    held = box.active_lease()
    assert held is not None and held["holder"] == "unknown" and "problem" in held


def test_gpu_users_tell_a_hand_started_job_from_a_run_and_its_unmarked_worker(
    tmp_path: Path, procs: List[subprocess.Popen[str]]
) -> None:
    devices = [tmp_path / f"nvidia{index}" for index in range(3)]
    for device in devices:
        device.write_text("")
    pattern = re.compile(rf"^{re.escape(str(tmp_path))}/nvidia(?P<index>[0-9]+)$")
    run_dir = str(tmp_path / "data" / "runs" / "r1")
    runner = hold(procs, devices[0], {"PATH": "/usr/bin:/bin", "RGT_RUN_DIR": run_dir}, child=devices[1])
    by_hand = hold(procs, devices[2], {"PATH": "/usr/bin:/bin"})
    for _attempt in range(100):  # the unmarked worker opens its device after its parent said ready
        users, _unreadable = gpu_users(pattern=pattern)
        if len(users) == 3:
            break
        time.sleep(0.05)
    by_pid = {user["pid"]: user for user in users}
    assert by_pid[runner]["run_dir"] == run_dir and by_pid[runner]["gpus"] == [0]
    worker = next(user for user in users if user["pid"] not in (runner, by_hand))
    assert worker["run_dir"] == run_dir and worker["gpus"] == [1]
    foreign = outside_runs(users)
    assert [user["pid"] for user in foreign] == [by_hand] and foreign[0]["gpus"] == [2]
    assert named(foreign) == f"pid {by_hand} {foreign[0]['name']} (GPU 2)"
    assert os.getpid() not in by_pid
