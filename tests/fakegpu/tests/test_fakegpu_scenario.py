"""Scenario loading: defaults, validation messages with key paths, timelines, the check CLI."""

from __future__ import annotations

import subprocess
import sys

import flatten
import pytest
import scenario
import yaml
from fakegpu_helpers import FAKEGPU, SCENARIOS
from scenario import ScenarioError

SHARED_SCENARIOS = [
    "healthy-h100.yml",
    "healthy-8x-h100.yml",
    "rtx4090-consumer.yml",
    "xid79-fallen-off-bus.yml",
    "xid48-dbe.yml",
    "xid13-app-fault.yml",
    "thermal-throttle-midwindow.yml",
    "container-no-dmesg-orphan-vram.yml",
    "driver-not-loaded.yml",
    "library-absent.yml",
    "gpu-lost.yml",
    "row-remap-pending.yml",
    "power-capped.yml",
    "pcie-degraded.yml",
    "mig-enabled.yml",
    "old-driver.yml",
]


def test_empty_scenario_is_one_healthy_idle_h100() -> None:
    box = scenario.validate(None)
    assert box["driver"] == {"loaded": True, "library": "present", "version": "550.54.15", "cuda_version": 12040}
    assert box["kernel_log"] == {"readable": True, "lines": []}
    (gpu,) = box["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["clocks_mhz"] == {"sm": 1980, "sm_max": 1980, "mem": 2619, "mem_max": 2619}
    assert gpu["memory_mib"] == {"total": 81559, "used": 0}
    assert gpu["power_w"] == {"draw": 71.5, "limit": 700.0, "default_limit": 700.0}
    assert gpu["clocks_event_reasons"] == 1
    assert gpu["ecc"]["enabled"] is True
    assert gpu["lost"] is False
    assert gpu["pci_bus_id"] == "00000000:18:00.0"
    assert gpu["uuid"].startswith("GPU-") and len(gpu["uuid"]) == 40


def test_partial_values_merge_with_defaults() -> None:
    box = scenario.validate({"gpus": [{"clocks_mhz": {"sm": 900}, "ecc": {"volatile": {"uncorrected": 2}}}, {}]})
    first, second = box["gpus"]
    assert first["clocks_mhz"] == {"sm": 900, "sm_max": 1980, "mem": 2619, "mem_max": 2619}
    assert first["ecc"]["volatile"] == {"corrected": 0, "uncorrected": 2}
    assert first["ecc"]["enabled"] is True
    assert second["pci_bus_id"] == "00000000:28:00.0"
    assert first["uuid"] != second["uuid"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpus": [{}, {"clocks_mhz": {"sm_max": "1980"}}]}, "gpus[1].clocks_mhz.sm_max: expected int, got str"),
        ({"gpus": [{"temprature_c": 80}]}, "gpus[0].temprature_c: unknown key"),
        ({"driver": {"loded": False}}, "driver.loded: unknown key"),
        ({"gpus": [{"lost": "yes"}]}, "gpus[0].lost: expected bool, got str"),
        ({"gpus": [{"temperature_c": True}]}, "gpus[0].temperature_c: expected int, got bool"),
        ({"gpus": [{"ecc": "off"}]}, "gpus[0].ecc: expected mapping or 'not_supported', got str"),
        ({"gpus": [{"nvlinks": [{"activ": True}]}]}, "gpus[0].nvlinks[0].activ: unknown key"),
        ({"gpus": [{"processes": [{"pid": 1}]}]}, "gpus[0].processes[0]: missing required key used_memory_mib"),
        ({"kernel_log": {"lines": "Xid 79"}}, "kernel_log.lines: expected list, got str"),
        ({"box": {"hostname": 7}}, "box.hostname: expected str, got int"),
        ({"box": {"disk_mib": 7}}, "box.disk_mib: unknown key"),
        ({"driver": {"library": "missing"}}, "driver.library: expected one of present, absent"),
        (
            {"gpus": [{"timeline": [{"after_s": 1, "set": {"clocks_mhz": {"smm": 1}}}]}]},
            "gpus[0].timeline[0].set.clocks_mhz.smm: unknown key",
        ),
        (
            {"gpus": [{"timeline": [{"after_s": 3, "set": {}}, {"after_s": 1, "set": {}}]}]},
            "gpus[0].timeline[1].after_s: entries must be in time order",
        ),
        ({"gpus": [{"timeline": [{"set": {}}]}]}, "gpus[0].timeline[0]: needs both after_s and set"),
        ([], ": expected mapping, got list"),
    ],
)
def test_validation_errors_name_the_key_path(data: object, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        scenario.validate(data)
    assert message in str(caught.value)


def test_power_accepts_integers_and_feature_strings() -> None:
    box = scenario.validate(
        {
            "gpus": [
                {
                    "power_w": {"draw": 70},
                    "ecc": "not_supported",
                    "remapped_rows": "not_supported",
                    "retired_pages": "not_supported",
                    "mig_mode": "not_supported",
                }
            ]
        }
    )
    gpu = box["gpus"][0]
    assert gpu["power_w"]["draw"] == 70.0 and isinstance(gpu["power_w"]["draw"], float)
    assert [gpu[key] for key in ("ecc", "remapped_rows", "retired_pages", "mig_mode")] == ["not_supported"] * 4


def test_timeline_deep_merges_and_applies_only_when_due() -> None:
    box = scenario.validate(
        {
            "gpus": [
                {
                    "timeline": [
                        {
                            "after_s": 2,
                            "set": {"temperature_c": 86, "clocks_mhz": {"sm": 900}, "clocks_event_reasons": 0x40},
                        },
                        {"after_s": 5, "set": {"lost": True}},
                    ]
                }
            ]
        }
    )
    gpu = box["gpus"][0]
    assert scenario.gpu_at(gpu, 1.99)["temperature_c"] == 34
    hot = scenario.gpu_at(gpu, 2.0)
    assert (hot["temperature_c"], hot["clocks_mhz"]["sm"], hot["clocks_mhz"]["sm_max"]) == (86, 900, 1980)
    assert hot["clocks_event_reasons"] == 0x40 and hot["lost"] is False
    later = scenario.gpu_at(gpu, 6)
    assert later["lost"] is True and later["temperature_c"] == 86
    assert "timeline" not in later


def test_timeline_can_switch_a_feature_between_supported_and_not() -> None:
    box = scenario.validate(
        {
            "gpus": [
                {"ecc": "not_supported", "timeline": [{"after_s": 1, "set": {"ecc": {"volatile": {"uncorrected": 1}}}}]}
            ]
        }
    )
    ecc = scenario.gpu_at(box["gpus"][0], 1)["ecc"]
    assert ecc["enabled"] is True and ecc["volatile"] == {"corrected": 0, "uncorrected": 1}


def test_flatten_emits_one_complete_block_per_state(tmp_path) -> None:
    path = tmp_path / "box.yml"
    path.write_text(yaml.safe_dump({"gpus": [{"timeline": [{"after_s": 2.5, "set": {"temperature_c": 90}}]}, {}]}))
    lines = flatten.flatten(str(path))
    assert lines[-1] == "@end"
    headers = [line for line in lines if line.startswith("@gpu")]
    assert headers == ["@gpu 0 -1", "@gpu 0 2.5", "@gpu 1 -1"]
    second_block = lines[lines.index("@gpu 0 2.5") : lines.index("@gpu 1 -1")]
    assert "temperature_c=90" in second_block and "clocks_mhz.sm=1980" in second_block
    assert "gpu_count=2" in lines


@pytest.mark.parametrize("name", SHARED_SCENARIOS)
def test_shared_scenarios_are_valid(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(FAKEGPU / "scenario.py"), "check", str(SCENARIOS / name)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")


def test_check_cli_reports_the_key_path(tmp_path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("gpus:\n  - {}\n  - clocks_mhz: {sm_max: fast}\n")
    result = subprocess.run(
        [sys.executable, str(FAKEGPU / "scenario.py"), "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert "gpus[1].clocks_mhz.sm_max: expected int, got str" in result.stderr


def test_shared_scenarios_have_their_defining_traits() -> None:
    def load(name: str) -> dict:
        return scenario.load(str(SCENARIOS / name))

    assert len(load("healthy-8x-h100.yml")["gpus"]) == 8
    assert all(
        len(g["nvlinks"]) == 18 and all(link["active"] for link in g["nvlinks"])
        for g in load("healthy-8x-h100.yml")["gpus"]
    )
    consumer = load("rtx4090-consumer.yml")["gpus"][0]
    assert [consumer[k] for k in ("ecc", "remapped_rows", "retired_pages")] == ["not_supported"] * 3
    assert consumer["nvlinks"] == []
    thermal = load("thermal-throttle-midwindow.yml")["gpus"][0]
    assert scenario.gpu_at(thermal, 2)["clocks_mhz"]["sm"] == 900
    assert scenario.gpu_at(thermal, 2)["temperature_c"] == 86
    orphan = load("container-no-dmesg-orphan-vram.yml")
    assert orphan["kernel_log"]["readable"] is False
    assert orphan["gpus"][0]["processes"][0]["used_memory_mib"] == 30720
    assert load("driver-not-loaded.yml")["driver"]["loaded"] is False
    assert load("library-absent.yml")["driver"]["library"] == "absent"
    assert [g["lost"] for g in load("gpu-lost.yml")["gpus"]] == [False, False, True, False]
    assert any(": 79," in line for line in load("xid79-fallen-off-bus.yml")["kernel_log"]["lines"])
    assert any(": 48," in line for line in load("xid48-dbe.yml")["kernel_log"]["lines"])
    assert any(": 13," in line for line in load("xid13-app-fault.yml")["kernel_log"]["lines"])
    assert load("row-remap-pending.yml")["gpus"][0]["remapped_rows"]["pending"] is True
    capped = load("power-capped.yml")["gpus"][0]["power_w"]
    assert capped["limit"] < 0.9 * capped["default_limit"]
    pcie = load("pcie-degraded.yml")["gpus"][0]["pcie"]
    assert pcie["width"] < pcie["width_max"]
    assert load("mig-enabled.yml")["gpus"][0]["mig_mode"]["current"] is True
    assert load("old-driver.yml")["driver"]["version"].startswith("470.")
