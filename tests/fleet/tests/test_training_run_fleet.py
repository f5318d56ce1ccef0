"""training_run through ansible-playbook on a simulated box: the run outlives every SSH connection that started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fleet_procs
import pytest
from fleet import Fleet

pytestmark = pytest.mark.fleet

REPO = Path(__file__).resolve().parents[3]
FAKE_TRAIN = REPO / "tests" / "workload" / "fake_train.py"  # the checkout is visible on the box at its own path
SCENARIO = REPO / "tests" / "scenarios" / "healthy-h100.yml"
PLAY = """\
- hosts: fleet
  gather_facts: false
  tasks:
    - name: Start the run
      remote_gpu.trainer.training_run:
        run: fleet-run
        data_dir: /data
        durable_dir: /durable
        workdir: /data
        detach: "{{ detach }}"
        cells:
          - {name: a, command: [/usr/bin/python3, "%(fake)s", --step-s, "0.2"]}
          - {name: b, command: [/usr/bin/python3, "%(fake)s", --step-s, "0.2", --show-env, CUDA_VISIBLE_DEVICES]}
        gpus_per_cell: 1
        artifacts: [best.pth]
        prune: [latest.pth]
        monitor_interval_s: 1
      register: launched

    - name: Keep what it returned
      ansible.builtin.copy:
        content: "{{ launched | to_json }}"
        dest: "{{ out }}"
        mode: "0644"
      delegate_to: localhost
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("training-run") / "state")
    fleet.up([str(SCENARIO)], names=["box"])
    yield fleet
    fleet.down()


def launch(fleet: Fleet, tmp_path: Path, detach: str) -> dict:
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAY % {"fake": FAKE_TRAIN})
    out = tmp_path / "launched.json"
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(REPO / ".build" / "collections"), ANSIBLE_NOCOLOR="1")
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    began = time.monotonic()
    done = subprocess.run(
        [str(bin_dir / "ansible-playbook"), "-i", str(fleet.inventory_path), str(playbook),
         "-e", f"detach={detach}", "-e", f"out={out}"],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert time.monotonic() - began < 60
    return json.loads(out.read_text())


def on_box(fleet: Fleet, command: str) -> str:
    result = fleet.ssh("box", command)
    assert result.returncode == 0, f"{command!r}: {result.stderr}"
    return result.stdout


@pytest.mark.parametrize("detach", ["setsid", "tmux"])
def test_the_run_finishes_after_every_ssh_connection_ended(fleet: Fleet, tmp_path: Path, detach: str) -> None:
    on_box(fleet, "rm -rf /data/runs /durable/runs")
    result = launch(fleet, tmp_path, detach)
    assert (result["changed"], result["state"], result["detach"]) == (True, "running", detach)
    fleet_procs.stop_ssh_clients(str(fleet.control_dir))  # the SSH session (and its master) that launched it
    record = json.loads(on_box(fleet, "cat /data/runs/fleet-run/run.json"))
    assert (record["pgid"], record["sid"], record["pids"], record["detach"]) == (
        result["pgid"], result["sid"], result["pids"], detach,
    )  # fmt: skip
    assert [cell["name"] for cell in record["cells"]] == ["a", "b"]
    deadline = time.monotonic() + 60
    while fleet.ssh("box", "test -f /data/runs/fleet-run/DONE").returncode != 0:
        assert time.monotonic() < deadline, on_box(fleet, "cat /data/runs/fleet-run/runner.log")
        time.sleep(0.5)
    manifest = on_box(fleet, "cat /durable/runs/fleet-run/MANIFEST.sha256")
    assert "cells/a/best.pth" in manifest and "cells/b/best.pth" in manifest
    assert "CUDA_VISIBLE_DEVICES=0" in on_box(fleet, "cat /data/runs/fleet-run/cells/b/log")
    again = launch(fleet, tmp_path, detach)
    assert (again["changed"], again["state"]) == (False, "done")
