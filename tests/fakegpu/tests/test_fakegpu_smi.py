"""The fake nvidia-smi: values agree with the scenario and with NVML; errors behave like the real tool."""

from __future__ import annotations

import time

import pytest
import scenario
from fakegpu_helpers import SCENARIOS, csv_rows, probe, run

QUERY = (
    "index,name,uuid,pci.bus_id,temperature.gpu,clocks.current.sm,clocks.max.sm,clocks.current.memory,"
    "clocks.max.memory,power.draw,power.limit,power.default_limit,memory.used,memory.total,utilization.gpu,"
    "utilization.memory,clocks_event_reasons.active,clocks_throttle_reasons.active,"
    "clocks_event_reasons.hw_thermal_slowdown,clocks_throttle_reasons.hw_thermal_slowdown,persistence_mode,"
    "ecc.mode.current,ecc.errors.uncorrected.volatile.total,ecc.errors.corrected.aggregate.total,"
    "remapped_rows.pending,remapped_rows.failure,retired_pages.pending,pcie.link.gen.current,pcie.link.gen.max,"
    "pcie.link.width.current,pcie.link.width.max,mig.mode.current,driver_version"
)


def smi(env: dict, *args: str):
    return run(["nvidia-smi", *args], env)


def query(env: dict, fields: str = QUERY, fmt: str = "csv,noheader,nounits", *extra: str):
    result = smi(env, f"--query-gpu={fields}", f"--format={fmt}", *extra)
    return result, csv_rows(result.stdout)


@pytest.mark.parametrize(
    "name",
    [
        "healthy-8x-h100.yml",
        "rtx4090-consumer.yml",
        "xid48-dbe.yml",
        "row-remap-pending.yml",
        "power-capped.yml",
        "pcie-degraded.yml",
        "mig-enabled.yml",
        "old-driver.yml",
    ],
)
def test_query_gpu_agrees_with_nvml(sim_env, name: str) -> None:
    env = sim_env(SCENARIOS / name)
    result, rows = query(env)
    assert result.returncode == 0, result.stdout
    nvml = probe(env)
    assert len(rows) == nvml["count"]
    for row, view in zip(rows, nvml["gpus"]):
        (
            index,
            gpu_name,
            uuid,
            bus,
            temp,
            sm,
            sm_max,
            mem,
            mem_max,
            draw,
            limit,
            default,
            used,
            total,
            util,
            util_mem,
            active,
            throttle,
            thermal,
            thermal_old,
            persistence,
            ecc_mode,
            ecc_unc,
            ecc_corr,
            rr_pending,
            rr_failure,
            rp_pending,
            gen,
            gen_max,
            width,
            width_max,
            mig,
            driver,
        ) = row
        assert int(index) == view["index"] and gpu_name == view["name"] and uuid == view["uuid"]
        assert bus == view["pci"]["bus_id"] and driver == nvml["driver"]
        assert [int(temp), int(sm), int(sm_max), int(mem), int(mem_max)] == [
            view[k] for k in ("temperature", "sm", "sm_max", "mem", "mem_max")
        ]
        assert [round(float(v) * 1000) for v in (draw, limit, default)] == [
            view["power_mw"],
            view["limit_mw"],
            view["default_limit_mw"],
        ]
        assert [int(used), int(total)] == [view["memory"]["used_mib"], view["memory"]["total_mib"]]
        if "error" in view["utilization"]:
            assert [util, util_mem] == ["[N/A]", "[N/A]"]
        else:
            assert [int(util), int(util_mem)] == [view["utilization"]["gpu"], view["utilization"]["memory"]]
        assert int(active, 16) == int(throttle, 16) == view["reasons"]
        assert thermal == thermal_old == ("Active" if view["reasons"] & 0x40 else "Not Active")
        assert persistence == ("Enabled" if view["persistence"] else "Disabled")
        if "error" in view["ecc_mode"]:
            assert [ecc_mode, ecc_unc, ecc_corr] == ["[N/A]"] * 3
        else:
            assert ecc_mode == ("Enabled" if view["ecc_mode"][0] else "Disabled")
            assert [int(ecc_unc), int(ecc_corr)] == [view["ecc_volatile_uncorrected"], view["ecc_aggregate_corrected"]]
        if "error" in view["remapped_rows"]:
            assert [rr_pending, rr_failure] == ["[N/A]"] * 2
        else:
            assert [rr_pending, rr_failure] == ["Yes" if v else "No" for v in view["remapped_rows"][2:]]
        expected_rp = (
            "[N/A]" if isinstance(view["retired_pending"], dict) else ("Yes" if view["retired_pending"] else "No")
        )
        assert rp_pending == expected_rp
        assert [int(gen), int(gen_max), int(width), int(width_max)] == view["pcie"][:4]
        assert mig == ("[N/A]" if "error" in view["mig"] else ("Enabled" if view["mig"][0] else "Disabled"))


def test_units_header_and_id_selection(sim_env) -> None:
    env = sim_env(SCENARIOS / "healthy-8x-h100.yml")
    result, rows = query(env, "index,memory.total,power.draw,temperature.gpu,fan.speed", "csv", "-i", "3,1")
    assert result.returncode == 0
    assert rows[0] == ["index", "memory.total [MiB]", "power.draw [W]", "temperature.gpu", "fan.speed [%]"]
    assert rows[1] == ["3", "81559 MiB", "74.10 W", "31", "[N/A]"]
    assert rows[2][0] == "1"
    nounits = query(env, "memory.total,power.draw", "csv,nounits", "--id=0")[1]
    assert nounits == [["memory.total [MiB]", "power.draw [W]"], ["81559", "71.20"]]
    uuid = scenario.load(str(SCENARIOS / "healthy-8x-h100.yml"))["gpus"][5]["uuid"]
    assert query(env, "index", "csv,noheader", "-i", uuid)[1] == [["5"]]
    assert query(env, "index", "csv,noheader", "-i", "00000000:9A:00.0")[1] == [["4"]]
    missing = smi(env, "--query-gpu=index", "--format=csv", "-i", "8")
    assert (missing.returncode, missing.stdout) == (6, "No devices were found\n")


def test_invalid_field_and_missing_format(sim_env) -> None:
    env = sim_env(SCENARIOS / "healthy-h100.yml")
    bad = smi(env, "--query-gpu=index,temprature.gpu", "--format=csv")
    assert bad.returncode == 2 and 'Field "temprature.gpu" is not a valid field to query.' in bad.stdout
    assert smi(env, "--query-gpu=index").returncode == 2


def test_list_gpus(sim_env) -> None:
    env = sim_env(SCENARIOS / "healthy-8x-h100.yml")
    box = scenario.load(str(SCENARIOS / "healthy-8x-h100.yml"))
    result = smi(env, "-L")
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {gpu['uuid']})" for i, gpu in enumerate(box["gpus"])
    ]


def test_compute_apps_show_host_pids(sim_env) -> None:
    env = sim_env(SCENARIOS / "container-no-dmesg-orphan-vram.yml")
    result = smi(env, "--query-compute-apps=pid,process_name,used_gpu_memory,gpu_bus_id", "--format=csv")
    assert result.returncode == 0
    assert csv_rows(result.stdout) == [
        ["pid", "process_name", "used_gpu_memory [MiB]", "gpu_bus_id"],
        ["4242", "[Not Found]", "30720 MiB", "00000000:18:00.0"],
    ]
    idle = smi(sim_env(SCENARIOS / "healthy-h100.yml"), "--query-compute-apps=pid", "--format=csv,noheader")
    assert (idle.returncode, idle.stdout) == (0, "")


def test_driver_not_loaded(sim_env) -> None:
    result = smi(sim_env(SCENARIOS / "driver-not-loaded.yml"), "-L")
    assert result.returncode == 9
    assert result.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    assert "Make sure that the latest NVIDIA driver is installed and running." in result.stdout


def test_library_absent_means_no_nvidia_smi(sim_env, sim_dir) -> None:
    env = sim_env(SCENARIOS / "library-absent.yml")
    with pytest.raises(FileNotFoundError):
        smi(env, "-L")
    direct = run([str(sim_dir / "bin" / "nvidia-smi"), "-L"], env)
    assert direct.returncode == 127 and "nvidia-smi: command not found" in direct.stderr


def test_lost_gpu_row_and_exit_code(sim_env) -> None:
    env = sim_env(SCENARIOS / "gpu-lost.yml")
    result, rows = query(env, "index,pci.bus_id", "csv,noheader")
    assert result.returncode == 15
    assert rows == [
        ["0", "00000000:18:00.0"],
        ["1", "00000000:2A:00.0"],
        ["Unable to determine the device handle for GPU0000:3A:00.0: Unknown Error"],
        ["3", "00000000:5D:00.0"],
    ]
    table = smi(env)
    assert table.returncode == 15
    assert table.stdout == "Unable to determine the device handle for GPU0000:3A:00.0: Unknown Error\n"
    assert smi(env, "-i", "1", "-L").returncode == 0


def test_not_supported_features_in_query_log(sim_env) -> None:
    result = smi(sim_env(SCENARIOS / "rtx4090-consumer.yml"), "-q", "-d", "ECC,PAGE_RETIREMENT,ROW_REMAPPER")
    assert result.returncode == 0
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    assert "    ECC Mode" in lines
    assert any(line.startswith("        Current") and line.endswith(": N/A") for line in lines)
    assert any(line.startswith("    Remapped Rows") and line.endswith(": N/A") for line in lines)
    assert any(line.startswith("        Pending Page Blacklist") and line.endswith(": N/A") for line in lines)
    assert not any("Temperature" in line for line in lines)


def test_nvlink_status(sim_env) -> None:
    result = smi(sim_env(SCENARIOS / "healthy-8x-h100.yml"), "nvlink", "-s", "-i", "0")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[0].startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-")
    assert lines[1:] == [f"\t Link {n}: 26.562 GB/s" for n in range(18)]
    consumer = smi(sim_env(SCENARIOS / "rtx4090-consumer.yml"), "nvlink", "--status")
    assert (consumer.returncode, consumer.stdout) == (0, "")  # before driver 595: nothing for a card without NVLink


def test_nvlink_status_prints_the_real_tools_three_shapes(sim_env, write_scenario) -> None:
    # Real outputs: "<inactive>" among active links (Azure/azhpc-diagnostics#73), the all-inactive line of a
    # card without a bridge (leptonai/gpud#1085), "Device does not have or support Nvlink" (driver 595+,
    # canonical/checkbox#2727; empty output before, canonical/checkbox#2617).
    path = write_scenario(
        "driver: {version: '595.71.05'}\n"
        "gpus:\n"
        "  - {nvlinks: [{active: true}, {active: false}, {active: true}]}\n"
        "  - {name: NVIDIA A100 80GB PCIe, nvlinks: [{active: false}, {active: false}]}\n"
        "  - {name: NVIDIA GeForce RTX 4090, nvlinks: []}\n"
    )
    result = smi(sim_env(path), "nvlink", "-s")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and [line.split(" (UUID")[0] for line in lines if line.startswith("GPU")] == [
        "GPU 0: NVIDIA H100 80GB HBM3", "GPU 1: NVIDIA A100 80GB PCIe", "GPU 2: NVIDIA GeForce RTX 4090"
    ]  # fmt: skip
    assert [line for line in lines if not line.startswith("GPU")] == [
        "\t Link 0: 26.562 GB/s",
        "\t Link 1: <inactive>",
        "\t Link 2: 26.562 GB/s",
        "NVML: Unable to retrieve NVLink information as all links are inActive",
        "Device does not have or support Nvlink",
    ]


def test_unknown_per_process_memory_prints_na_as_the_real_tool(sim_env, write_scenario) -> None:
    path = write_scenario("gpus:\n  - processes: [{pid: 12444, used_memory_mib: not_available}]\n")
    env = sim_env(path)
    apps = smi(env, "--query-compute-apps=pid,used_memory", "--format=csv,noheader")
    assert apps.stdout.splitlines() == ["12444, [N/A]"]
    q = smi(env, "-q", "-d", "PIDS").stdout.splitlines()
    assert any(line.strip().startswith("Used GPU Memory") and line.endswith(": N/A") for line in q)
    table = [line for line in smi(env).stdout.splitlines() if "12444" in line]
    assert len(table) == 1 and table[0].endswith(" N/A      |") and len(table[0]) == 91  # as the WDDM capture


def test_dmon_samples(sim_env) -> None:
    result = smi(sim_env(SCENARIOS / "power-capped.yml"), "dmon", "-s", "pucvmet", "-c", "3", "-i", "0")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 5
    assert lines[0].split()[:4] == ["#", "gpu", "pwr", "gtemp"]
    assert lines[2].split()[:3] == ["0", "399", "58"]


def test_timeline_through_nvidia_smi_counts_from_the_callers_first_call(sim_env) -> None:
    env = sim_env(SCENARIOS / "thermal-throttle-midwindow.yml")
    fields = "temperature.gpu,clocks.current.sm,clocks_event_reasons.hw_thermal_slowdown"
    first = query(env, fields)[1]
    perf = smi(env, "-q", "-d", "PERFORMANCE").stdout
    assert first == [["74", "1980", "Not Active"]]
    assert _labelled(perf, "HW Thermal Slowdown") == "Not Active"
    time.sleep(2.2)
    assert query(env, fields)[1] == [["86", "900", "Active"]]
    assert _labelled(smi(env, "-q", "-d", "PERFORMANCE").stdout, "HW Thermal Slowdown") == "Active"


def _labelled(text: str, label: str) -> str:
    (line,) = [line for line in text.splitlines() if line.strip().startswith(label + " ")]
    assert line.startswith("            " + label)  # nested under HW Slowdown
    return line.split(":", 1)[1].strip()
