"""The patrol_facts module: driven through its argument spec, and end to end under the GPU simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from build import environment

from ansible_collections.remote_gpu.trainer.plugins.modules import patrol_facts
from ansible_collections.remote_gpu.trainer.tests.testpaths import REPO
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    kill_session,
    make_run,
    start_runner,
    train,
    wait_for,
)

COLLECTIONS = REPO / ".build" / "collections"
SCENARIOS = REPO / "tests" / "scenarios"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        pytest.param({"stall_after_s": 0}, "stall_after_s must be an integer between 1 and 604800", id="stall-0"),
        pytest.param({"gpu_idle_pct": float("nan")}, "gpu_idle_pct must be a finite number", id="idle-nan"),
        pytest.param({"disk_pressure_pct": 0}, "disk_pressure_pct must be a finite number above 0", id="disk-0"),
        pytest.param({"timeout_s": float("inf")}, "timeout_s must be a finite number above 0", id="timeout-inf"),
        pytest.param({"max_scan_bytes": 10}, "max_scan_bytes must be an integer between 65536", id="scan-tiny"),
        pytest.param({"run": "../etc"}, "run must match", id="run-traversal"),
        pytest.param({"data_dir": " "}, "data_dir must be a non-empty path", id="data-blank"),
    ],
)
def test_bad_options_fail_with_one_line_naming_the_option_and_its_range(tmp_path, run_module, args, named):
    code, result = run_module(patrol_facts, dict({"data_dir": str(tmp_path)}, **args))
    assert code == 1 and result["failed"] is True
    assert named in result["msg"] and "\n" not in result["msg"]


def test_an_unknown_gpu_backend_names_the_choices(tmp_path, run_module):
    code, result = run_module(patrol_facts, {"data_dir": str(tmp_path), "gpu_backend": "cuda"})
    assert code == 1 and "gpu_backend" in result["msg"] and "auto, nvml, nvidia-smi" in result["msg"]


def test_a_crash_pattern_that_does_not_compile_names_the_pattern(tmp_path, run_module):
    patterns = [{"name": "mine", "regex": "unclosed ("}]
    code, result = run_module(patrol_facts, {"data_dir": str(tmp_path), "crash_patterns": patterns})
    assert code == 1 and "crash_patterns" in result["msg"] and "mine" in result["msg"]
    assert "Traceback" not in result["msg"]


def test_a_crash_pattern_without_a_regex_is_refused_by_the_spec(tmp_path, run_module):
    code, result = run_module(patrol_facts, {"data_dir": str(tmp_path), "crash_patterns": [{"name": "mine"}]})
    assert code == 1 and "regex" in result["msg"]


def test_a_progress_regex_without_the_named_groups_names_the_option(tmp_path, run_module):
    code, result = run_module(patrol_facts, {"data_dir": str(tmp_path), "progress_regex": r"iter (\d+)"})
    assert code == 1 and "progress_regex" in result["msg"]


def test_nvml_backend_without_pynvml_names_the_package_and_the_venv_it_looked_in(tmp_path, run_module, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # neither the base Python nor the venv has it
    args = {"data_dir": str(tmp_path), "gpu_backend": "nvml", "kernel_log": False, "venv": str(tmp_path / "venv")}
    code, result = run_module(patrol_facts, args)
    assert code == 0 and "needs nvidia-ml-py" in result["gpu_error"] and str(tmp_path / "venv") in result["gpu_error"]


def test_a_run_asked_for_that_is_not_on_the_box_fails_naming_it_and_the_closest_run(tmp_path, run_module):
    make_run(tmp_path, [{"name": "a", "command": train()}])
    (tmp_path / "data" / "runs" / "sweep" / "run.json").write_text(json.dumps({"schema": 1, "run": "sweep"}))
    args = {"data_dir": str(tmp_path / "data"), "run": "swep", "kernel_log": False, "gpu_backend": "nvidia-smi"}
    code, result = run_module(patrol_facts, args)
    assert code == 1 and result["failed"] is True and "\n" not in result["msg"]
    assert result["msg"].startswith("run swep is not on this box") and "closest run there is sweep" in result["msg"]


def test_the_new_keys_are_returned_and_documented(tmp_path, run_module):
    (tmp_path / "data").mkdir()
    args = {"data_dir": str(tmp_path / "data"), "kernel_log": False, "gpu_backend": "nvidia-smi"}
    code, result = run_module(patrol_facts, args)
    assert code == 0
    assert (result["headline"], result["examined_runs"], result["runs_skipped"]) == ("IDLE: no run on this box", [], 0)
    assert (result["runs_archived"], result["run_filter"]) == (0, None)
    documented = yaml.safe_load(patrol_facts.RETURN)
    assert set(result["ansible_facts"]["patrol"]) <= set(documented)


def test_the_facts_are_returned_as_plain_keys_and_under_ansible_facts(tmp_path, run_module):
    patterns = [{"name": "dataloader_died", "regex": r"DataLoader worker \(pid \d+\) is killed"}]
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    (run_dir / "cells" / "a").mkdir(parents=True)
    (run_dir / "cells" / "a" / "log").write_text(
        "epoch 1/2 step 1/3 loss 0.5\nDataLoader worker (pid 4242) is killed\n"
    )
    (run_dir / "run.json").write_text(
        json.dumps({"schema": 1, "run": "sweep", "started_at": "2026-12-03T10:00:00+00:00", "pgid": 2**22 + 7,
                    "sid": 2**22 + 7, "pids": [2**22 + 7], "detach": "setsid", "cells": [{"name": "a"}]})
    )  # fmt: skip
    args = {"data_dir": str(tmp_path / "data"), "crash_patterns": patterns, "kernel_log": False}
    code, result = run_module(patrol_facts, dict(args, gpu_backend="nvidia-smi"))
    assert code == 0 and result["changed"] is False
    facts = result["ansible_facts"]["patrol"]
    assert {key: result[key] for key in facts} == facts
    assert (facts["state"], facts["cells_total"], facts["alive"]) == ("incomplete", 1, 0)
    assert [s["signature"] for s in facts["crash_signatures"]] == ["dataloader_died"]
    assert facts["progress"] is None  # a cell that is not running shows no progress
    assert facts["runs"][0]["cells"][0]["progress"]["epoch"] == 1


def scenario_with(tmp_path, source: str, **gpu: object) -> str:
    data = yaml.safe_load((SCENARIOS / source).read_text())
    for entry in data["gpus"]:
        entry.update(gpu)
    path = tmp_path / "scenario.yml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run_in_simulator(tmp_path, scenario: str, **args: object):
    """The module as Ansible runs it, in a fresh Python process that sees the scenario's GPUs."""
    env = dict(os.environ, **environment(str(tmp_path / "sim"), scenario), PYTHONPATH=str(COLLECTIONS))
    payload = json.dumps({"ANSIBLE_MODULE_ARGS": args})
    module = "ansible_collections.remote_gpu.trainer.plugins.modules.patrol_facts"
    done = subprocess.run(
        [sys.executable, "-m", module, payload], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


@pytest.mark.parametrize("backend", ["nvml", "nvidia-smi"])
def test_a_live_run_on_a_busy_simulated_gpu_is_running_with_its_utilization(tmp_path, backend):
    scenario = scenario_with(tmp_path, "healthy-h100.yml", utilization_pct={"gpu": 87, "memory": 40})
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--forever", "--step-s", 0.05)}])
    process = start_runner(run_dir)
    try:
        wait_for((run_dir / "cells" / "a" / "log").exists, what="the cell's log")
        facts = run_in_simulator(tmp_path, scenario, data_dir=str(tmp_path / "data"), gpu_backend=backend)
        assert (facts["state"], facts["escalate"], facts["gpu_backend"], facts["gpu_error"]) == (
            "running",
            False,
            backend,
            None,
        )
        assert [(g["index"], g["utilization_pct"], g["memory_total_mib"]) for g in facts["gpu"]] == [(0, 87.0, 81559.0)]
    finally:
        kill_session(process.pid)
        process.wait(timeout=10)


@pytest.mark.parametrize("backend", ["nvml", "nvidia-smi"])
def test_a_gpu_lost_on_the_simulated_box_escalates_with_re_rent_on_either_backend(tmp_path, backend):
    scenario = str(SCENARIOS / "xid79-fallen-off-bus.yml")
    (tmp_path / "data").mkdir()
    facts = run_in_simulator(tmp_path, scenario, data_dir=str(tmp_path / "data"), gpu_backend=backend)
    assert facts["escalate"] is True and facts["actions"] == ["re_rent"]
    assert [p.split(":")[0] for p in facts["problems"]] == ["gpu_lost"]
    assert [g["index"] for g in facts["gpu"] if g["utilization_pct"] is not None] == [0]
