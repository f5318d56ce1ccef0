"""patrol_facts' curves end to end: the real runner's monitor on simulated GPUs, packed cells, the module's RETURN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import yaml
from build import environment

from ansible_collections.remote_gpu.trainer.plugins.modules import patrol_facts
from ansible_collections.remote_gpu.trainer.tests.testpaths import REPO
from ansible_collections.remote_gpu.trainer.tests.workload.harness import make_run, start_runner, train

COLLECTIONS = REPO / ".build" / "collections"
SCENARIOS = REPO / "tests" / "scenarios"


def two_busy_gpus(tmp_path: Path) -> str:
    """The 8x H100 scenario cut to two GPUs, one at 87% and 60 GiB, the other at 40% and 20 GiB."""
    data = yaml.safe_load((SCENARIOS / "healthy-8x-h100.yml").read_text())
    data["gpus"] = data["gpus"][:2]
    for gpu, (util, used) in zip(data["gpus"], ((87, 61440), (40, 20480))):
        gpu.update(utilization_pct={"gpu": util, "memory": 30}, memory_mib={"total": 81559, "used": used})
    path = tmp_path / "scenario.yml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def module_in(env: Dict[str, str], **args: Any) -> Dict[str, Any]:
    """The module as Ansible runs it, in a fresh Python that sees the scenario's GPUs."""
    payload = json.dumps({"ANSIBLE_MODULE_ARGS": args})
    module = "ansible_collections.remote_gpu.trainer.plugins.modules.patrol_facts"
    done = subprocess.run(
        [sys.executable, "-m", module, payload], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


def test_packed_cells_on_two_simulated_gpus_carry_the_runs_curves_and_each_cells_loss(tmp_path):
    simulated = environment(str(tmp_path / "sim"), two_busy_gpus(tmp_path))
    env = dict(os.environ, **simulated, PYTHONPATH=str(COLLECTIONS))
    command = train("--epochs", 3, "--steps-per-epoch", 5, "--step-s", 0.1)
    cells = [{"name": "c0", "command": command}, {"name": "c1", "command": command}]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1], gpus_per_cell=1, monitor_interval_s=0.2)
    assert start_runner(run_dir, env=simulated).wait(timeout=60) == 0
    samples = (run_dir / "monitor.jsonl").read_text().splitlines()
    facts = module_in(env, data_dir=str(tmp_path / "data"), kernel_log=False)
    series = facts["runs"][0]["monitor_series"]
    assert series["points"] == len(series["t"]) == min(120, len(samples)) >= 3
    assert series["t"] == sorted(series["t"]) and series["t"][-1] == json.loads(samples[-1])["t"]
    assert [(g["index"], set(g["util_pct"]), set(g["mem_used_mib"]), g["mem_total_mib"]) for g in series["gpus"]] == [
        (0, {87.0}, {61440.0}, 81559.0),
        (1, {40.0}, {20480.0}, 81559.0),
    ]
    assert len(series["container_mem_bytes"]) == series["points"]
    for cell in facts["runs"][0]["cells"]:
        loss = cell["loss_series"]
        assert (loss["points"], loss["x"], loss["x_label"]) == (15, list(range(1, 16)), "line"), cell["name"]
        assert loss["loss"][0] > loss["loss"][-1] == loss["last"] > 0  # fake_train's loss falls
    assert facts["ansible_facts"]["patrol"]["runs"] == facts["runs"]


def test_the_series_keys_are_documented_in_return(tmp_path, run_module):
    documented = yaml.safe_load(patrol_facts.RETURN)["runs"]["description"]
    text = " ".join(documented)
    for key in ("monitor_series", "loss_series", "container_mem_bytes", "container_max_bytes", "mem_total_mib"):
        assert f"C({key})" in text, key
    (tmp_path / "data").mkdir()
    code, result = run_module(patrol_facts, {"data_dir": str(tmp_path / "data"), "kernel_log": False})
    assert code == 0 and result["runs"] == []
