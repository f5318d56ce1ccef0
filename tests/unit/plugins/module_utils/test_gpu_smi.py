"""nvidia-smi parsers against real captured outputs (drivers 535..610) and the smi backend on scripted output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _gpu_smi as smi
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _smi_parse as parse
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import (
    NOT_SUPPORTED,
    normalize_bus_id,
    reason_names,
)
from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES

Q_FULL = sorted((CAPTURES / "q_full").glob("*.txt"))
QUERY_CSV = sorted((CAPTURES / "query_csv").glob("*.txt"))
COMPUTE_APPS = sorted((CAPTURES / "compute_apps").glob("*.txt"))


def _list_l_names(capture: Path) -> list | None:
    """GPU names from the `nvidia-smi -L` capture of the same host, read with an independent regex."""
    key = re.sub(r"__(idle|load)$", "", capture.stem)
    listing = CAPTURES / "list_L" / f"{key}.txt"
    if not listing.exists():
        return None
    return re.findall(r"^GPU \d+: (.+?) \(UUID:", listing.read_text(), flags=re.MULTILINE)


def test_captures_are_present():
    assert len(Q_FULL) >= 30 and len(QUERY_CSV) >= 21 and len(COMPUTE_APPS) >= 20


@pytest.mark.parametrize("capture", Q_FULL, ids=lambda p: p.stem)
def test_q_full_parses_every_capture(capture):
    text = capture.read_text()
    parsed = parse.parse_q(text)
    assert parsed["driver_version"] and re.match(r"^\d+\.\d+", parsed["driver_version"])
    assert parsed["cuda_version"] and re.match(r"^\d+\.\d+$", parsed["cuda_version"])
    assert len(parsed["gpus"]) == parsed["attached_gpus"] == len(re.findall(r"^GPU [0-9A-F]{8}:", text, re.M))
    names = _list_l_names(capture)
    if names is not None:
        assert [gpu["name"] for gpu in parsed["gpus"]] == names
    for gpu in parsed["gpus"]:
        assert re.match(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$", gpu["pci_bus_id"])
        assert gpu["lost"] is False
        temperature = gpu["samples"][0]["temperature_c"]
        if "PAGE_RETIREMENT" not in text and "page-retirement" not in capture.name:
            assert 10 <= temperature <= 100
            assert gpu["uuid"].startswith("GPU-")
            assert 0 < gpu["samples"][0]["sm_clock_mhz"] <= gpu["sm_clock_max_mhz"] <= 4000
            assert gpu["memory_total_mib"] >= 4096
            assert 0 <= gpu["samples"][0]["memory_used_mib"] <= gpu["memory_total_mib"]
            assert gpu["power_limit_w"] > 50 and gpu["power_default_limit_w"] > 50
            assert gpu["pcie"]["width"] == gpu["pcie"]["width_max"] == 16
            assert 1 <= gpu["pcie"]["gen"] <= gpu["pcie"]["gen_max"] <= 5


def _q(name: str) -> dict:
    return parse.parse_q((CAPTURES / "q_full" / name).read_text())


def test_h100_535_161_has_hw_slowdown_and_power_brake_on_all_gpus():
    gpus = _q("gpud__8x-h100-80gb-hbm3__535.161.08.txt")["gpus"]
    assert len(gpus) == 8
    for gpu in gpus:
        assert reason_names(gpu["samples"][0]["reasons"]) == ["hw_slowdown", "hw_power_brake_slowdown"]


def test_rtx4090_c_has_sw_power_cap_on_two_gpus():
    gpus = _q("gpud__8x-rtx4090__535.154.05__c.txt")["gpus"]
    capped = [gpu for gpu in gpus if "sw_power_cap" in reason_names(gpu["samples"][0]["reasons"])]
    assert len(capped) == 2


def test_page_retirement_capture_has_zero_counts_and_nothing_pending():
    parsed = _q("azurehpc__8gpu__535.86.10__d-page-retirement.txt")
    assert [gpu["retired_pages"] for gpu in parsed["gpus"]] == [
        {"single_bit": 0, "double_bit": 0, "pending": False}
    ] * 8
    assert parsed["gpus"][7]["pci_bus_id"] == "00000008:00:00.0"


def test_a10_capture_reports_a_pending_row_remap():
    (gpu,) = _q("gpud__a10__535.129.03.txt")["gpus"]
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 4, "pending": True, "failure": False}
    assert gpu["ecc"]["volatile_uncorrected"] == 0 and gpu["ecc"]["enabled"] is True


def test_consumer_cards_read_as_not_supported():
    (gpu,) = _q("nge__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04__load.txt")["gpus"]
    assert gpu["ecc"] == gpu["remapped_rows"] == gpu["retired_pages"] == NOT_SUPPORTED
    assert gpu["mig_mode"] == {"current": None, "pending": None}


def test_610_layout_nested_power_limit_and_kmd_version():
    parsed = _q("nge__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04__load.txt")
    assert parsed["driver_version"] == "610.57.04" and parsed["cuda_version"] == "13.3"
    (gpu,) = parsed["gpus"]
    assert gpu["power_limit_w"] == 250.0 and gpu["power_default_limit_w"] == 250.0
    assert gpu["samples"][0]["power_draw_w"] == 97.75  # average is N/A here, instantaneous is not


def test_mig_capture_and_compute_processes_only():
    (gpu,) = _q("nge__linux-x86_64__nvidia-h100-mig__590.48.01__load.txt")["gpus"]
    assert gpu["mig_mode"] == {"current": True, "pending": True}
    assert [p["pid"] for p in gpu["processes"]] == [21180, 21181, 21198]
    desktop = _q("nge__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04__load.txt")["gpus"][0]
    assert desktop["processes"] == [{"pid": 28511, "used_memory_mib": 230}, {"pid": 28512, "used_memory_mib": 370}]


@pytest.mark.parametrize("capture", QUERY_CSV, ids=lambda p: p.stem)
def test_query_csv_parses_every_capture(capture):
    rows = parse.parse_query_csv(capture.read_text())
    assert len(rows) >= 1
    names = _list_l_names(capture)
    if names is not None:
        assert [row["name"] for row in rows] == names
    for row in rows:
        sample = parse.sample_from_row(row)
        assert 0 <= sample["memory_used_mib"] <= 100_000
        if "temperature.gpu" not in row:  # the exporter's short field list
            assert sample["temperature_c"] is None and row["driver_version"] == "466.63"
            continue
        assert 10 <= sample["temperature_c"] <= 100
        assert sample["sm_clock_mhz"] > 0
        if "clocks_event_reasons.active" in row:
            assert sample["reasons"] is not None and sample["reasons"] < 0x200
            assert set(reason_names(sample["reasons"])) == {
                name
                for name in ("gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown")
                if row.get(f"clocks_event_reasons.{name}") == "Active"
            }
        if "index" in row:
            assert parse.integer(row["index"]) == rows.index(row)
            assert normalize_bus_id(row["pci.bus_id"]) == row["pci.bus_id"]


def test_query_csv_placeholders_read_as_none():
    (row,) = parse.parse_query_csv(
        (CAPTURES / "query_csv" / "netdata__tesla-p100-pcie-16gb__csv-nounits.txt").read_text()
    )
    assert row["fan.speed"] == "[N/A]" and parse.number(row["fan.speed"]) is None
    assert parse.number(row["power.draw"]) == 28.16
    for text in ("[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "Requested functionality has been deprecated"):
        assert parse.clean(text) is None
    assert parse.clean("[GPU is lost]") == parse.LOST


@pytest.mark.parametrize("capture", COMPUTE_APPS, ids=lambda p: p.stem)
def test_compute_apps_captures(capture):
    text = capture.read_text()
    by_bus = parse.parse_compute_apps(text, fields=None)
    rows = [line for line in text.splitlines()[1:] if line.strip()]
    assert sum(len(procs) for procs in by_bus.values()) == len(rows)
    for bus_id, procs in by_bus.items():
        assert bus_id == "00000000:" + bus_id[9:] and all(p["pid"] > 0 for p in procs)
        if "windows" not in capture.name:
            assert all(p["used_memory_mib"] > 0 for p in procs)


def test_nvlink_status_and_lost_handles():
    text = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n"
    )
    assert parse.parse_nvlink_status(text) == {0: [{"link": 0, "active": True}, {"link": 1, "active": False}], 1: []}
    err = "Unable to determine the device handle for GPU0000:18:00.0: Unknown Error\n"
    assert parse.lost_bus_ids(err) == ["00000000:18:00.0"]


class ScriptedRunner:
    """Answers nvidia-smi argv with canned (rc, stdout, stderr), recording every call."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, argv, timeout):
        self.calls.append((list(argv), timeout))
        for prefix, answer in self.answers:
            if argv[1].startswith(prefix):
                return answer(argv) if callable(answer) else answer
        return 127, "", "not scripted"


Q_TEXT = (CAPTURES / "q_full" / "gpud__8x-h100-80gb-hbm3__535.161.08.txt").read_text()
BUS_IDS = [gpu["pci_bus_id"] for gpu in parse.parse_q(Q_TEXT)["gpus"]]


def _rows(indexes, reasons="0x0000000000000000", lost_line=""):
    lines = [
        f"{i}, {BUS_IDS[i]}, NVIDIA H100 80GB HBM3, GPU-{i}, 40, 1980, 1980, 120.5, 700.00, 3, 81559, {reasons}"
        for i in indexes
    ]
    return "\n".join(lines) + "\n" + lost_line


def test_backend_maps_rows_falls_back_to_old_field_name_and_places_a_lost_gpu():
    def query(argv):
        if "clocks_event_reasons.active" in argv[1]:
            return 2, 'Field "clocks_event_reasons.active" is not a valid field to query.\n', ""
        lost = f"Unable to determine the device handle for GPU{BUS_IDS[1][4:]}: Unknown Error\n"
        return 15, _rows([0, 2, 3, 4, 5, 6, 7], "0x0000000000000004", lost), ""

    run = ScriptedRunner([("-q", (0, Q_TEXT, "")), ("--query-gpu", query), ("nvlink", (0, "", ""))])
    backend = smi.SmiBackend(run, timeout_s=7)
    backend.open()
    gpus = backend.inventory()
    assert backend.complete(gpus) == []
    assert [gpu["index"] for gpu in gpus] == list(range(8))
    assert [gpu["lost"] for gpu in gpus] == [False, True] + [False] * 6
    assert gpus[1]["pci_bus_id"] == BUS_IDS[1] and gpus[2]["pci_bus_id"] == BUS_IDS[2]
    assert gpus[0]["power_default_limit_w"] == 700.0 and gpus[0]["ecc"]["enabled"] is True
    readings = backend.sample()
    assert readings[1] is None and reason_names(readings[0]["reasons"]) == ["sw_power_cap"]
    assert all(timeout == 7 for _argv, timeout in run.calls)
    assert any("clocks_throttle_reasons.active" in argv[1] for argv, _t in run.calls)


def test_backend_driver_not_loaded_and_missing_binary():
    no_driver = (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "")
    with pytest.raises(smi.SmiNoDriver, match="couldn't communicate"):
        smi.SmiBackend(ScriptedRunner([("--query-gpu", no_driver)])).open()
    with pytest.raises(smi.SmiNoDriver, match="not found"):
        smi.SmiBackend(ScriptedRunner([])).open()
    with pytest.raises(smi.SmiError, match="timed out"):
        smi.SmiBackend(ScriptedRunner([("--query-gpu", (124, "", ""))])).open()


def test_the_open_query_is_the_first_sample_and_the_static_reads_are_merged_by_complete():
    run = ScriptedRunner([("-q", (0, Q_TEXT, "")), ("--query-gpu", (0, _rows(range(8)), "")), ("nvlink", (0, "", ""))])
    backend = smi.SmiBackend(run, timeout_s=7)
    backend.open()
    gpus = backend.inventory()
    first = backend.sample()
    queries = [argv[1] for argv, _t in run.calls if argv[1].startswith("--query-gpu")]
    assert len(queries) == 1 and sorted(first) == list(range(8)) and first[0]["temperature_c"] == 40
    backend.sample()
    assert len([argv for argv, _t in run.calls if argv[1].startswith("--query-gpu")]) == 2
    assert "ecc" not in gpus[0] and backend.versions()["driver_version"] is None  # -q is merged by complete()
    backend.complete(gpus)
    assert gpus[0]["ecc"]["enabled"] is True and gpus[0]["power_default_limit_w"] == 700.0
    assert backend.versions()["driver_version"] == "535.161.08"
    assert sorted(argv[1] for argv, _t in run.calls if not argv[1].startswith("--query-gpu")) == ["-q", "nvlink"]
    backend.close()


def test_a_lost_gpu_only_q_names_is_added_by_complete():
    lost_line = f"Unable to determine the device handle for GPU{BUS_IDS[7][4:]}: Unknown Error\n"
    run = ScriptedRunner(
        [("-q", (15, lost_line, "")), ("--query-gpu", (0, _rows(range(7)), "")), ("nvlink", (0, "", ""))]
    )
    backend = smi.SmiBackend(run)
    backend.open()
    gpus = backend.inventory()
    assert len(gpus) == 7
    (added,) = backend.complete(gpus)
    assert added == {"index": 7, "pci_bus_id": BUS_IDS[7], "lost": True, "nvlinks": []}
    assert gpus[-1] is added and backend.lost_indexes() == [7]


def test_q_failing_after_the_open_query_is_a_part_way_error():
    run = ScriptedRunner([("-q", (9, "NVIDIA-SMI has failed because it couldn't communicate\n", "")),
                          ("--query-gpu", (0, _rows(range(8)), ""))])  # fmt: skip
    backend = smi.SmiBackend(run)
    backend.open()
    gpus = backend.inventory()
    with pytest.raises(smi.SmiError, match="couldn't communicate"):
        backend.complete(gpus)


def test_nvlink_status_in_the_real_tools_shapes():
    # Shapes seen in public reports: Azure/azhpc-diagnostics#73 (V100, links down among active ones),
    # leptonai/gpud#1085 (all links inactive), canonical/checkbox#2727 (driver 595, a card without NVLink).
    text = (
        "GPU 0: Tesla V100-SXM2-32GB (UUID: GPU-a)\n"
        "\t Link 0: 25.781 GB/s\n\t Link 1: <inactive>\n\t Link 2: 25.781 GB/s\n"
        "GPU 1: NVIDIA A100 80GB PCIe (UUID: GPU-b)\n"
        "NVML: Unable to retrieve NVLink information as all links are inActive\n"
        "GPU 2: Quadro RTX 4000 with Max-Q Design (UUID: GPU-c)\n"
        "Device does not have or support Nvlink\n"
    )
    assert parse.parse_nvlink_status(text) == {
        0: [{"link": 0, "active": True}, {"link": 1, "active": False}, {"link": 2, "active": True}],
        1: [],  # no link is active: judged like a card without NVLink (see _gpu_links)
        2: [],
    }
    assert parse.parse_nvlink_status("") == {}  # drivers before 595 print nothing for a card without NVLink


def test_unknown_per_process_memory_is_none():
    text = (
        CAPTURES / "compute_apps" / "nge__windows-x86_64__nvidia-geforce-rtx-2080-super__591.86__load.txt"
    ).read_text()
    fields = ("timestamp", "gpu_name", "gpu_bus_id", "gpu_serial", "gpu_uuid", "pid", "process_name", "used_gpu_memory")
    by_gpu = parse.parse_compute_apps("\n".join(text.splitlines()[1:]), fields)
    assert len(by_gpu) == 1
    procs = next(iter(by_gpu.values()))
    assert procs and all(proc["used_memory_mib"] is None for proc in procs)
