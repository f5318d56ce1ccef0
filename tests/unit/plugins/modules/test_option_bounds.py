"""Bad option values fail every module with one line naming the option and its range, before any work.

Each module's work (sampling, probing, scanning) is replaced by a sentinel, so a value that slipped through
validation shows up as the sentinel instead of a hang, and an accepted value is proven to reach the work.
"""

from __future__ import annotations

import json
import math
import signal

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _gpu_health
from ansible_collections.remote_gpu.trainer.plugins.modules import box_health, gpu_health, vram_zombies

MODULES = {"gpu_health": gpu_health, "box_health": box_health, "vram_zombies": vram_zombies}
WORK = {"gpu_health": "check_gpu_health", "box_health": "check_box", "vram_zombies": "scan_and_reap"}

SAMPLE_SECONDS = "sample_seconds must be a finite number between 0 and 600, got"
INTERVAL = "sample_interval_s must be a finite number between 0.05 and 60, got"
PROBE = "probe_timeout_s must be a finite number above 0 and at most 3600, got"
BUDGET = "checkpoint_budget_gb must be a finite number between 0 and 1048576, got"
MEMORY = "min_memory_gb must be a finite number between 0 and 1048576, got"
GRACE = "grace_s must be a finite number between 0 and 3600, got"
MIN_AGE = "min_age_s must be a finite number between 0 and 31536000, got"
OBSERVE = "observe_s must be a finite number between 0 and 600, got"
WARN_PCT = "disk_warn_pct must be a finite number above 0 and at most 100, got"
FAIL_PCT = "disk_fail_pct must be a finite number above 0 and at most 100, got"

BAD = [
    # item 3: non-finite numbers defeat the reaper's guards
    ("vram_zombies", {"min_age_s": math.nan}, MIN_AGE),
    ("vram_zombies", {"min_age_s": math.inf}, MIN_AGE),
    ("vram_zombies", {"min_age_s": -1}, MIN_AGE),
    ("vram_zombies", {"grace_s": math.nan}, GRACE),
    ("vram_zombies", {"grace_s": math.inf}, GRACE),
    ("vram_zombies", {"grace_s": -1}, GRACE),
    ("vram_zombies", {"grace_s": 3601}, GRACE),
    # item 10: hangs, busy loops and tracebacks
    ("gpu_health", {"sample_seconds": math.nan}, SAMPLE_SECONDS),
    ("gpu_health", {"sample_seconds": math.inf}, SAMPLE_SECONDS),
    ("gpu_health", {"sample_seconds": 1e6}, SAMPLE_SECONDS),
    ("gpu_health", {"sample_seconds": -1}, SAMPLE_SECONDS),
    ("gpu_health", {"sample_interval_s": math.nan}, INTERVAL),
    ("gpu_health", {"sample_interval_s": 0}, INTERVAL),
    ("gpu_health", {"sample_interval_s": 0.01}, INTERVAL),
    ("gpu_health", {"sample_interval_s": math.inf}, INTERVAL),
    ("vram_zombies", {"observe_s": math.inf}, OBSERVE),
    ("vram_zombies", {"observe_s": 1e9}, OBSERVE),
    ("vram_zombies", {"observe_s": math.nan}, OBSERVE),
    ("vram_zombies", {"observe_s": -1}, OBSERVE),
    ("gpu_health", {"kernel_log_timeout_s": math.inf}, "kernel_log_timeout_s must be a finite number above 0 and"),
    ("gpu_health", {"kernel_log_timeout_s": math.nan}, "kernel_log_timeout_s must be a finite number above 0 and"),
    ("gpu_health", {"kernel_log_timeout_s": 0}, "kernel_log_timeout_s must be a finite number above 0 and"),
    ("gpu_health", {"command_timeout_s": math.inf}, "command_timeout_s must be a finite number above 0 and at most"),
    ("gpu_health", {"command_timeout_s": math.nan}, "command_timeout_s must be a finite number above 0 and at most"),
    ("gpu_health", {"command_timeout_s": -1}, "command_timeout_s must be a finite number above 0 and at most"),
    ("box_health", {"probe_timeout_s": math.nan}, PROBE),
    ("box_health", {"probe_timeout_s": math.inf}, PROBE),
    ("box_health", {"probe_timeout_s": 0}, PROBE),
    ("box_health", {"probe_timeout_s": -1}, PROBE),
    ("box_health", {"checkpoint_budget_gb": math.nan}, BUDGET),
    ("box_health", {"checkpoint_budget_gb": math.inf}, BUDGET),
    ("box_health", {"checkpoint_budget_gb": "1e400"}, BUDGET),
    ("box_health", {"min_memory_gb": math.nan}, MEMORY),
    ("box_health", {"min_memory_gb": math.inf}, MEMORY),
    ("box_health", {"min_memory_gb": "1e400"}, MEMORY),
    # item 11: silently accepted
    ("gpu_health", {"min_driver_version": "abc"}, "min_driver_version must be dotted numbers such as 535.104.05, got"),
    ("gpu_health", {"min_driver_version": "535.x"}, "min_driver_version must be dotted numbers"),
    ("gpu_health", {"min_cuda_version": "x.y"}, "min_cuda_version must be dotted numbers such as 12.2, got 'x.y'"),
    ("gpu_health", {"power_cap_pct": -1}, "power_cap_pct must be an integer between 0 and 100, got -1"),
    ("gpu_health", {"power_cap_pct": 101}, "power_cap_pct must be an integer between 0 and 100, got 101"),
    ("gpu_health", {"sm_clock_floor_pct": 500}, "sm_clock_floor_pct must be an integer between 0 and 100, got 500"),
    ("gpu_health", {"temp_hot_c": -5}, "temp_hot_c must be an integer between 0 and 150, got -5"),
    ("gpu_health", {"temp_hot_c": 151}, "temp_hot_c must be an integer between 0 and 150, got 151"),
    ("gpu_health", {"occupied_mib_threshold": -1}, "occupied_mib_threshold must be an integer between 0 and 1048576"),
    ("gpu_health", {"expected_gpu_count": -3}, "expected_gpu_count must be an integer between 1 and 256, got -3"),
    ("gpu_health", {"expected_gpu_count": 0}, "expected_gpu_count must be an integer between 1 and 256, got 0"),
    ("gpu_health", {"gpus": [0, -1]}, "gpus entries must be integers between 0 and 255, got -1"),
    ("gpu_health", {"gpus": [256]}, "gpus entries must be integers between 0 and 255, got 256"),
    ("box_health", {"checkpoint_budget_gb": -5}, BUDGET),
    ("box_health", {"min_memory_gb": -1}, MEMORY),
    ("box_health", {"data_dir": ""}, "data_dir must be a non-empty path, got ''"),
    ("box_health", {"durable_dir": ""}, "durable_dir must be a non-empty path, got ''"),
    ("vram_zombies", {"data_dir": ""}, "data_dir must be a non-empty path, got ''"),
    ("vram_zombies", {"idle_util_pct": -5}, "idle_util_pct must be an integer between 0 and 100, got -5"),
    ("vram_zombies", {"idle_util_pct": 500}, "idle_util_pct must be an integer between 0 and 100, got 500"),
    ("vram_zombies", {"protect_pids": [-1]}, "protect_pids entries must be integers between 1 and 4194304, got -1"),
    ("vram_zombies", {"protect_pids": [42, 0]}, "protect_pids entries must be integers between 1 and 4194304, got 0"),
    # box_health's thresholds, once checked ad hoc in the module
    ("box_health", {"disk_warn_pct": math.nan}, WARN_PCT),
    ("box_health", {"disk_warn_pct": 0}, WARN_PCT),
    ("box_health", {"disk_fail_pct": math.inf}, FAIL_PCT),
    ("box_health", {"disk_fail_pct": 101}, FAIL_PCT),
    ("box_health", {"disk_warn_pct": 95, "disk_fail_pct": 90}, "disk_warn_pct must be at most disk_fail_pct, got 95"),
]

GOOD = [
    ("gpu_health", {"sample_seconds": 0, "sample_interval_s": 0.05}),
    ("gpu_health", {"sample_seconds": 600, "sample_interval_s": 60}),
    ("gpu_health", {"kernel_log_timeout_s": 3600, "command_timeout_s": 0.1}),
    ("gpu_health", {"temp_hot_c": 0, "sm_clock_floor_pct": 100, "power_cap_pct": 0, "occupied_mib_threshold": 0}),
    ("gpu_health", {"expected_gpu_count": 1, "gpus": [0, 255]}),
    ("gpu_health", {"expected_gpu_count": 256, "min_driver_version": "535", "min_cuda_version": "12.2"}),
    ("box_health", {"probe_timeout_s": 3600, "checkpoint_budget_gb": 0, "min_memory_gb": 1048576}),
    ("box_health", {"disk_warn_pct": 100, "disk_fail_pct": 100}),
    ("vram_zombies", {"grace_s": 0, "min_age_s": 0, "observe_s": 0, "idle_util_pct": 0}),
    ("vram_zombies", {"grace_s": 3600, "min_age_s": 31536000, "observe_s": 600, "idle_util_pct": 100}),
    ("vram_zombies", {"protect_pids": [1, 4194304]}),
]


class Reached(Exception):
    """The module got past validation to its real work."""


@pytest.fixture(autouse=True)
def deadline():
    # Belt and braces: a bad value that reached a sampling loop must fail this test, not hang the run.
    def expire(_signum, _frame):
        raise TimeoutError("the module hung on a bad option value")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def run(monkeypatch, tmp_path, capsys):
    def refuse(*_args, **_kwargs):
        raise Reached

    def run_module(name, args):
        monkeypatch.setattr(MODULES[name], WORK[name], refuse)
        base = {"data_dir": str(tmp_path)} if name == "box_health" else {}
        with patch_module_args(dict(base, **args)), pytest.raises(SystemExit) as exited:
            MODULES[name].main()
        return exited.value.code, json.loads(capsys.readouterr().out)

    return run_module


@pytest.mark.parametrize(("name", "args", "message"), BAD, ids=[f"{n}-{a}" for n, a, _m in BAD])
def test_bad_values_fail_with_one_line_naming_the_option_and_range(run, name, args, message):
    rc, result = run(name, args)
    assert rc == 1 and result["failed"] is True
    assert result["msg"].startswith(message), result["msg"]
    assert "\n" not in result["msg"]


@pytest.mark.parametrize(("name", "args"), GOOD, ids=[f"{n}-{a}" for n, a in GOOD])
def test_values_at_the_bounds_reach_the_work(run, name, args):
    with pytest.raises(Reached):
        run(name, args)


@pytest.fixture
def no_gpu_work(monkeypatch):
    """xid_since is checked inside check_gpu_health: stop it at its first contact with the box."""

    def refuse(*_args, **_kwargs):
        raise Reached

    monkeypatch.setattr(_gpu_health, "_open_backend", refuse)
    monkeypatch.setattr(_gpu_health._kernel_log, "read_kernel_log", refuse)


@pytest.mark.parametrize("since", ["99999999999d", "3651d", "522w", "87601h", "9" * 400 + "s"])
def test_xid_since_is_bounded_to_ten_years(no_gpu_work, capsys, since):
    with patch_module_args({"xid_since": since}), pytest.raises(SystemExit) as exited:
        gpu_health.main()
    result = json.loads(capsys.readouterr().out)
    assert exited.value.code == 1
    assert result["msg"].startswith("xid_since must be 'boot', a duration of at most 3650d"), result["msg"]
    assert repr(since) in result["msg"]


def test_xid_since_of_ten_years_is_accepted(no_gpu_work):
    with patch_module_args({"xid_since": "3650d"}), pytest.raises(Reached):
        gpu_health.main()


def options_of(module):
    return yaml.safe_load(module.DOCUMENTATION)["options"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_number_option_has_bounds(name):
    numeric = {
        option
        for option, spec in options_of(MODULES[name]).items()
        if spec.get("type") in ("int", "float") or spec.get("elements") == "int"
    }
    assert numeric and numeric <= set(MODULES[name].OPTION_BOUNDS)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_documentation_states_each_bound(name):
    options = options_of(MODULES[name])
    for option, rule in MODULES[name].OPTION_BOUNDS.items():
        text = options[option]["description"]
        text = " ".join(text) if isinstance(text, list) else text
        assert rule.describe() in " ".join(text.split()), option
