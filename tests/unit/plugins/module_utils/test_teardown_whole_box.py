"""teardown_gate judges the whole instance before a meter-stop (issue 29, items 1, 2 and 4): the runs of every data
dir of the box (the registry launch writes, and live processes' markers), the processes that use a GPU outside every
run (a job started by hand), and archived or finished runs by what the stop verb keeps. Real runs, real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import register_data_dir
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._archive import archive_runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import list_archived
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_instance
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._run_scratch import run_scratch
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate
from ansible_collections.remote_gpu.trainer.tests.workload.harness import make_run, start_runner, train

CELL = [{"name": "a", "command": train("--ckpt-kib", "8")}]
KEEPS_DISK = ["data_dir", "durable_dir"]
HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(60)"


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """r1 and r2, finished, each with one synced checkpoint in <box>/durable; the host's data dir <box>/data holds
    r1, and r2 lies in a second data dir, ``<box>/scratch`` (launch_data_dir=...). Built per test: archiving moves
    the durable copy its run.json names."""
    root = tmp_path / "box"
    run_dir = make_run(root, CELL, name="r1", artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    run_dir = make_run(root / "other", CELL, name="r2", artifacts=["best.pth"], durable_dir=str(root / "durable"))
    assert start_runner(run_dir).wait(timeout=60) == 0
    (root / "other" / "data").rename(root / "scratch")
    return root


def gate(root: Path, **more: Any) -> Dict[str, Any]:
    params: Dict[str, Any] = {"data_dir": str(root / "data"), "durable_dir": str(root / "durable"), "runs": []}
    params.update(instance=True, **more)
    return teardown_gate(params, environ_path=str(root / "no-pid1-environ"))


@pytest.fixture
def procs() -> Iterator[List[subprocess.Popen[str]]]:
    started: List[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def start(procs: List[subprocess.Popen[str]], device: Path, **env: str) -> int:
    """A process holding ``device`` open (as CUDA holds /dev/nvidia<N>), with this test's environment plus ``env``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(device)],
        env=dict(os.environ, **env),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc.pid


@pytest.fixture
def gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> List[Path]:
    """Two device nodes the gate reads as GPUs 0 and 1."""
    devices = [tmp_path / f"nvidia{index}" for index in range(2)]
    for device in devices:
        device.write_text("")
    pattern = re.compile(rf"^{re.escape(str(tmp_path))}/nvidia(?P<index>[0-9]+)$")
    monkeypatch.setattr(_teardown_instance, "GPU_DEVICE", pattern)
    return devices


# --- item 1: every data dir of the box --------------------------------------------------------------------------


def test_a_finished_run_in_a_registered_data_dir_blocks_the_meter_stop_named_with_its_data_dir(box):
    scratch = str(box / "scratch")
    assert gate(box)["passed"]  # unregistered and not live, the box cannot know it (a launch registers it)
    register_data_dir(scratch, str(box / "durable"))
    result = gate(box)
    assert (result["passed"], result["step"]) == (False, "other_runs")
    assert result["reason"].startswith(
        f"run r2 in {scratch}: finished, not torn down, would lose the scratch of 1 cell ("
    ), result["reason"]
    assert "1 durable file not pulled" in result["reason"]
    assert [entry["run"]["name"] for entry in result["runs"]] == ["r1"]  # teardown_run=all: the host's data dir
    assert result["instance"]["data_dirs"] == [str(box / "data"), scratch]
    (other,) = result["instance"]["other_runs"]
    assert (other["name"], other["data_dir"], other["state"], other["label"]) == (
        "r2",
        scratch,
        "finished",
        f"r2 in {scratch}",
    )
    abandoned = gate(box, abandon_runs=["r2"])
    assert abandoned["passed"], abandoned["reason"]
    assert any(note.startswith(f"run r2 in {scratch} is abandoned: it loses ") for note in abandoned["notes"])


def test_a_live_run_in_a_data_dir_only_its_process_names_blocks_the_meter_stop(box, procs, tmp_path):
    scratch = box / "scratch"
    device = tmp_path / "not-a-gpu"
    device.write_text("")
    pid = start(procs, device, RGT_RUN_DIR=str(scratch / "runs" / "r2"))
    result = gate(box)
    assert result["step"] == "other_runs"
    assert result["reason"].startswith(f"run r2 in {scratch}: running, would lose its live processes (pid {pid})")
    assert pid in result["instance"]["live_marker_pids"]
    # A run of that name in the host's data dir is another run: torn down there, r2 in scratch still blocks.
    assert str(scratch) in result["instance"]["data_dirs"]


def test_a_run_torn_down_in_its_own_data_dir_no_longer_blocks(box):
    register_data_dir(str(box / "scratch"), str(box / "durable"))
    removed = run_scratch(
        {"runs": ["r2"], "data_dir": str(box / "scratch"), "durable_dir": str(box / "durable")}, False
    )
    assert removed["changed"] is True
    result = gate(box)
    assert result["passed"], result["reason"]
    (other,) = result["instance"]["other_runs"]
    assert (other["state"], other["torn_down"], other["data_dir"]) == ("torn_down", True, str(box / "scratch"))


# --- item 2: GPU users outside every run ------------------------------------------------------------------------


def test_a_gpu_job_started_by_hand_blocks_the_meter_stop_until_abandoned(box, gpus, procs):
    by_hand = start(procs, gpus[1])  # setsid nohup python3 train.py: no run marker
    start(procs, gpus[0], RGT_RUN_DIR=str(box / "data" / "runs" / "r1"))  # a worker r1 left behind
    result = gate(box)
    assert result["step"] == "run_alive"  # r1's worker is r1's: its run's step names it
    assert [user["pid"] for user in result["instance"]["gpu_users"]] == [by_hand]
    worker = procs.pop()
    worker.kill()
    worker.wait()
    result = gate(box)
    assert (result["passed"], result["step"]) == (False, "gpu_users")
    assert result["reason"].startswith(f"pid {by_hand} python")
    assert "(GPU 1)" in result["reason"] and "abandon_gpu_users" in result["reason"]
    (user,) = result["instance"]["gpu_users"]
    assert (user["pid"], user["gpus"]) == (by_hand, [1])
    allowed = gate(box, abandon_gpu_users=True)
    assert allowed["passed"], allowed["reason"]
    assert any(note.startswith(f"abandoned GPU users: pid {by_hand} ") for note in allowed["notes"])


def test_a_gpu_user_never_counts_without_a_meter_stop(box, gpus, procs):
    start(procs, gpus[0])
    result = teardown_gate({"data_dir": str(box / "data"), "durable_dir": str(box / "durable"), "runs": ["r1"]})
    assert result["passed"], result["reason"]


# --- item 4: what the stop verb keeps ---------------------------------------------------------------------------


def test_an_archived_run_blocks_only_a_stop_that_does_not_keep_the_disk(box):
    data = str(box / "data")
    archive_runs({"data_dir": data, "run": "r1"}, check_mode=False)
    (entry,) = list_archived(data)
    refused = gate(box)
    assert refused["step"] == "other_runs"
    assert refused["reason"].startswith(f"run r1 (as .archive/{entry.entry}): archived, would lose ")
    assert gate(box, survives=["durable_dir"])["step"] == "other_runs"  # a stop that wipes the scratch
    kept = gate(box, survives=KEEPS_DISK)
    assert kept["passed"], kept["reason"]
    (other,) = kept["instance"]["other_runs"]
    assert (other["kept"], other["abandoned"]) == (True, False)
    assert (
        f"run r1 (as .archive/{entry.entry}) is archived: the meter-stop keeps data_dir and durable_dir, so it "
        "loses nothing of it" in kept["notes"]
    )


def test_a_finished_run_loses_nothing_by_a_stop_that_keeps_the_disk_a_live_one_still_blocks(box, procs, tmp_path):
    scratch = str(box / "scratch")
    register_data_dir(scratch, str(box / "durable"))
    kept = gate(box, survives=KEEPS_DISK)
    assert kept["passed"], kept["reason"]
    assert (
        f"run r2 in {scratch} is finished, not torn down: the meter-stop keeps data_dir and durable_dir, so it "
        "loses nothing of it" in kept["notes"]
    )
    device = tmp_path / "not-a-gpu"
    device.write_text("")
    start(procs, device, RGT_RUN_DIR=f"{scratch}/runs/r2")
    live = gate(box, survives=KEEPS_DISK)
    assert live["step"] == "other_runs" and live["reason"].startswith(f"run r2 in {scratch}: running")


def test_a_data_dir_on_another_filesystem_is_not_kept_by_what_the_verb_keeps(box, monkeypatch):
    # The verb's survives speaks of the profile's data_dir: /root/scratch beside a /workspace volume is not kept.
    scratch = str(box / "scratch")
    register_data_dir(scratch, str(box / "durable"))
    real = _teardown_instance._device_of

    def elsewhere(path: str) -> Dict[str, Any]:
        found = real(path)
        return dict(found, dev=found["dev"] + 1) if path == scratch else found

    monkeypatch.setattr(_teardown_instance, "_device_of", elsewhere)
    result = gate(box, survives=KEEPS_DISK)
    assert result["step"] == "other_runs" and result["reason"].startswith(f"run r2 in {scratch}: finished"), result[
        "reason"
    ]


def test_survives_takes_only_data_dir_and_durable_dir(box):
    with pytest.raises(ValueError, match="survives: each entry must be data_dir or durable_dir, not 'scratch'"):
        gate(box, survives=["scratch"])
