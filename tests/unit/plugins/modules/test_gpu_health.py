"""The gpu_health module: driven through its argument spec, and end to end under the GPU simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from build import environment

from ansible_collections.remote_gpu.trainer.plugins.modules import gpu_health
from ansible_collections.remote_gpu.trainer.tests.testpaths import REPO

SCENARIOS = sorted((REPO / "tests" / "scenarios").glob("*.yml"))
COLLECTIONS = REPO / ".build" / "collections"
FAST = {"sample_seconds": 1, "sample_interval_s": 0.25}


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fakegpu"))


def sim_env(sim_dir, scenario):
    env = dict(os.environ)
    env.update(environment(sim_dir, str(scenario)))
    env["PYTHONPATH"] = str(COLLECTIONS)
    return env


def run_in_simulator(sim_dir, scenario, **args):
    """The module as Ansible runs it: a fresh Python process, here with the simulator's environment."""
    payload = json.dumps({"ANSIBLE_MODULE_ARGS": args})
    module = "ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health"
    done = subprocess.run(
        [sys.executable, "-m", module, payload],
        env=sim_env(sim_dir, scenario),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


def codes(result):
    return sorted(f["code"] for f in result["findings"])


# ----------------------------------------------------------------------------- argument spec


def test_unknown_backend_fails_naming_the_option_and_choices(run_module):
    rc, result = run_module(gpu_health, {"backend": "cuda"})
    assert rc == 1 and result["failed"] is True
    assert "backend" in result["msg"] and "auto, nvml, nvidia-smi" in result["msg"] and "\n" not in result["msg"]


def test_nvml_backend_without_pynvml_names_the_package_and_the_bootstrap(run_module, monkeypatch):
    monkeypatch.setattr(gpu_health, "HAS_PYNVML", False)
    rc, result = run_module(gpu_health, {"backend": "nvml"})
    assert rc == 1 and "nvidia-ml-py" in result["msg"] and "bootstrap" in result["msg"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"sample_interval_s": 0}, "sample_interval_s"),
        ({"sample_seconds": -1}, "sample_seconds"),
        ({"xid_since": "last week"}, "xid_since"),
        ({"expected_gpu_model": "H100("}, "expected_gpu_model"),
        ({"gpus": ["zero"]}, "gpus"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_option(run_module, args, named):
    rc, result = run_module(gpu_health, dict(args, backend="nvidia-smi"))
    assert rc == 1 and named in result["msg"] and "\n" not in result["msg"]


def test_auto_without_nvml_or_nvidia_smi_is_a_no_driver_finding(run_module, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no dmesg, no journalctl
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    rc, result = run_module(gpu_health, {"sample_seconds": 0})
    assert rc == 0 and result["changed"] is False and result["status"] == "FAIL"
    assert codes(result) == ["kernel_log_unreadable", "no_driver"] and result["gpus"] == []


def test_check_mode_reads_the_simulated_box_through_nvidia_smi(run_module, monkeypatch, sim_dir):
    # nvidia-smi is found on PATH at call time, so this backend can run in-process under the simulator.
    for key, value in environment(sim_dir, str(REPO / "tests" / "scenarios" / "healthy-h100.yml")).items():
        monkeypatch.setenv(key, value)
    rc, result = run_module(gpu_health, dict(FAST, backend="nvidia-smi", _ansible_check_mode=True))
    assert rc == 0 and result["changed"] is False
    assert (result["status"], result["backend"], result["findings"]) == ("PASS", "nvidia-smi", [])
    (gpu,) = result["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["window"]["samples"] == 5
    assert result["kernel_log"]["readable"] is True and result["sample_seconds"] == 1


# ----------------------------------------------------------------------------- end to end, both backends


# What the shared scenarios are written to show: (status, codes that must be among the findings).
EXPECTED = {
    "healthy-h100": ("PASS", []),
    "healthy-8x-h100": ("PASS", []),
    "rtx4090-consumer": ("PASS", []),
    "driver-not-loaded": ("FAIL", ["no_driver"]),
    "library-absent": ("FAIL", ["no_driver"]),
    "gpu-lost": ("FAIL", ["gpu_lost", "kernel_log_unreadable"]),
    "xid79-fallen-off-bus": ("FAIL", ["gpu_lost"]),
    "xid48-dbe": ("FAIL", ["ecc_uncorrectable", "xid_hardware"]),
    "xid13-app-fault": ("WARN", ["xid_application"]),
    "row-remap-pending": ("FAIL", ["row_remap_pending"]),
    "thermal-throttle-midwindow": ("FAIL", ["thermal_throttle", "throttle_active"]),
    "mig-enabled": ("WARN", ["mig_enabled"]),
    "pcie-degraded": ("WARN", ["pcie_degraded"]),
    "power-capped": ("WARN", ["power_capped"]),
    "container-no-dmesg-orphan-vram": ("WARN", ["foreign_processes", "kernel_log_unreadable"]),
    "old-driver": ("FAIL", ["driver_too_old"]),
    "pcie-no-nvlink-bridge": ("PASS", []),
    "shared-host-other-tenant-xid": ("WARN", ["xid_other_gpu"]),
}


def test_every_shared_scenario_states_the_verdict_it_shows():
    # A scenario without an expected verdict is only checked for backend parity, which a wrong verdict passes.
    assert sorted(path.stem for path in SCENARIOS) == sorted(EXPECTED)


def scenario_args(scenario: Path) -> dict:
    """Fast windows, long enough to reach the scenario's last timeline change."""
    data = yaml.safe_load(scenario.read_text()) or {}
    last_change = max([step["after_s"] for gpu in data.get("gpus") or [] for step in gpu.get("timeline") or []] or [0])
    args = {**FAST, "sample_seconds": max(1, last_change + 1)}
    if scenario.stem == "old-driver":
        args["min_driver_version"] = "535.104.05"
    return args


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.stem)
def test_every_scenario_gives_the_same_verdict_through_both_backends(sim_dir, scenario):
    args = scenario_args(scenario)
    nvml = run_in_simulator(sim_dir, scenario, backend="nvml", **args)
    smi = run_in_simulator(sim_dir, scenario, backend="nvidia-smi", **args)
    messages = [f["message"] for f in nvml["findings"] + smi["findings"]]
    assert (nvml["status"], codes(nvml)) == (smi["status"], codes(smi)), messages
    assert [g["index"] for g in nvml["gpus"]] == [g["index"] for g in smi["gpus"]]
    if "no_driver" not in codes(nvml):
        assert len(nvml["gpus"]) == len((yaml.safe_load(scenario.read_text()) or {}).get("gpus") or [None])
        assert (nvml["backend"], smi["backend"]) == ("nvml", "nvidia-smi")
    status, must_have = EXPECTED[scenario.stem]
    assert nvml["status"] == status and set(must_have) <= set(codes(nvml)), messages
    if status == "PASS":
        assert codes(nvml) == []


def write_scenario(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(data))
    return path


BOOT = {"readable": True, "lines": ["[    5.300871] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15"]}

FOCUSED = {
    "mid_window_throttle": (
        {"kernel_log": BOOT, "gpus": [{"timeline": [
            {"after_s": 0.4, "set": {"temperature_c": 87, "clocks_mhz": {"sm": 900}, "clocks_event_reasons": 0x40}}
        ]}]},
        "FAIL", ["thermal_throttle", "throttle_active"],
    ),
    "lost_and_foreign": (
        {"kernel_log": BOOT, "gpus": [
            {"processes": [{"pid": 999999, "used_memory_mib": 30720}], "memory_mib": {"total": 81559, "used": 30800}},
            {"lost": True},
        ]},
        "FAIL", ["foreign_processes", "gpu_lost"],
    ),
    "driver_not_loaded": ({"driver": {"loaded": False}, "kernel_log": BOOT}, "FAIL", ["no_driver"]),
    "consumer_card_capped_and_degraded": (
        {"kernel_log": {"readable": False}, "gpus": [{
            "name": "NVIDIA GeForce RTX 4090", "ecc": "not_supported", "remapped_rows": "not_supported",
            "retired_pages": "not_supported", "power_w": {"draw": 30.0, "limit": 300.0, "default_limit": 450.0},
            "pcie": {"gen": 1, "gen_max": 4, "width": 8, "width_max": 16, "replay_counter": 0},
        }]},
        "WARN", ["kernel_log_unreadable", "pcie_degraded", "power_capped"],
    ),
    "memory_faults_and_mig": (
        {"kernel_log": BOOT, "gpus": [{
            "ecc": {"enabled": True, "volatile": {"corrected": 0, "uncorrected": 3},
                    "aggregate": {"corrected": 0, "uncorrected": 3}},
            "remapped_rows": {"corrected": 0, "uncorrected": 2, "pending": True, "failure": False},
            "mig_mode": {"current": True, "pending": True}, "nvlinks": [{"active": True}, {"active": False}],
        }]},
        "FAIL", ["ecc_uncorrectable", "mig_enabled", "nvlink_down", "row_remap_pending"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FOCUSED))
@pytest.mark.parametrize("backend", ["nvml", "nvidia-smi"])
def test_focused_scenarios(sim_dir, tmp_path, name, backend):
    data, status, expected = FOCUSED[name]
    result = run_in_simulator(sim_dir, write_scenario(tmp_path, name, data), backend=backend, **FAST)
    assert (result["status"], codes(result)) == (status, expected)
    assert result["backend"] == backend


def test_auto_falls_back_to_nvidia_smi_without_the_library_and_reports_no_driver_without_either(sim_dir, tmp_path):
    healthy = REPO / "tests" / "scenarios" / "healthy-h100.yml"
    env = sim_env(sim_dir, healthy)
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # nvidia-smi stays, libnvidia-ml.so.1 is gone
    payload = json.dumps({"ANSIBLE_MODULE_ARGS": dict(FAST)})
    module = "ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health"
    done = subprocess.run([sys.executable, "-m", module, payload], env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    result = json.loads(done.stdout)
    assert (result["backend"], result["status"]) == ("nvidia-smi", "PASS")
    absent = write_scenario(tmp_path, "absent", {"driver": {"library": "absent"}, "kernel_log": BOOT})
    result = run_in_simulator(sim_dir, absent, **FAST)
    assert (result["status"], codes(result)) == ("FAIL", ["no_driver"])
