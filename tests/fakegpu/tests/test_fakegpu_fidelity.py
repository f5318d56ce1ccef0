"""Fidelity against real nvidia-smi outputs in shared/captures (read at test time, never copied).

For a captured machine, a scenario is built from the facts the capture itself states (model, driver,
bus id, memory, processes ...); the fake's output for it must then have the capture's layout: header
names, units and field order, [N/A] where the real tool printed [N/A], section names and key spellings.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import _smi_fields as fields
import pytest
import yaml
from fakegpu_helpers import csv_rows, run

from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES


def captures(pattern: str) -> List[Path]:
    """The capture files for ``pattern``; a missing capture set fails loudly instead of skipping."""
    found = sorted(CAPTURES.glob(pattern))
    assert found, f"no captures match {CAPTURES}/{pattern}: set RGT_CAPTURES to the shared/captures folder"
    return found


def cuda_code(text: str) -> int:
    major, minor = text.split(maxsplit=1)[0].split(".")
    return int(major) * 1000 + int(minor) * 10


def scenario_file(tmp_path: Path, driver: str, cuda: int, gpus: List[dict]) -> Path:
    path = tmp_path / "captured.yml"
    path.write_text(yaml.safe_dump({"driver": {"version": driver, "cuda_version": cuda}, "gpus": gpus}))
    return path


def smi(env: Dict[str, str], *args: str):
    result = run(["nvidia-smi", *args], env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


# ----------------------------------------------------------------------------- --query-gpu


FEATURE_FIELDS = ("ecc.", "remapped_rows.", "retired_pages.", "mig.mode.", "utilization.gpu", "utilization.memory")


def features_from_csv(row: Dict[str, str]) -> dict:
    gpu: dict = {"name": row["name"], "pci_bus_id": row["pci.bus_id"]}
    if row.get("memory.total [MiB]", "[N/A]") != "[N/A]":
        gpu["memory_mib"] = {"total": int(row["memory.total [MiB]"].split()[0]), "used": 0}
    for field, key in (
        ("ecc.mode.current", "ecc"),
        ("remapped_rows.pending", "remapped_rows"),
        ("retired_pages.pending", "retired_pages"),
        ("mig.mode.current", "mig_mode"),
    ):
        if row.get(field) == "[N/A]":
            gpu[key] = "not_supported"
    if row.get("mig.mode.current") == "Enabled":
        gpu["mig_mode"] = {"current": True, "pending": True}
    return gpu


@pytest.mark.parametrize("capture", captures("query_csv/nge__linux-*.txt"), ids=lambda p: p.stem)
def test_query_gpu_layout_matches_capture(capture: Path, sim_env, tmp_path) -> None:
    command = capture.with_suffix(".cmd").read_text().split()
    query = next(arg for arg in command if arg.startswith("--query-gpu="))
    header, values = csv_rows(capture.read_text())[:2]
    row = dict(zip(header, values))
    path = scenario_file(tmp_path, row["driver_version"], 12040, [features_from_csv(row)])
    ours_header, ours = csv_rows(smi(sim_env(path), query, "--format=csv"))
    assert ours_header == header
    assert len(ours) == len(values)
    for name, real, fake in zip(header, values, ours):
        field = name.split(" [")[0]
        # Unmodelled fields must read like the real tool; modelled ones where the scenario says not_supported.
        if real in ("[N/A]", "N/A") and (not fields.modelled(field) or field.startswith(FEATURE_FIELDS)):
            assert fake == real, f"{name}: capture {real!r}, fake {fake!r}"
        unit = re.fullmatch(r".* \[(.+)\]", name)
        if unit and fake not in ("[N/A]", "N/A"):
            assert fake.endswith(" " + unit.group(1)), f"{name}: {fake!r} lacks the unit"
        if real.startswith("0x") and fake.startswith("0x"):
            assert len(fake) == len(real), f"{name}: {fake!r} vs {real!r}"


def test_unmodelled_fields_print_bracketed_na(sim_env, write_scenario) -> None:
    out = smi(sim_env(write_scenario("{}")), "--query-gpu=serial,vbios_version,temperature.memory", "--format=csv")
    assert out.splitlines()[1] == "[N/A], [N/A], N/A"


# ------------------------------------------------------------------------------------ -L


@pytest.mark.parametrize("capture", captures("list_L/nge__linux-*.txt"), ids=lambda p: p.stem)
def test_list_line_format_matches_capture(capture: Path, sim_env, tmp_path) -> None:
    lines = [line for line in capture.read_text().splitlines() if line.startswith("GPU ")]
    parsed = [re.fullmatch(r"GPU (\d+): (.+) \(UUID: (GPU-[0-9a-f-]+)\)", line) for line in lines]
    assert all(parsed), lines
    path = scenario_file(tmp_path, "590.48.01", 13010, [{"name": m.group(2), "uuid": m.group(3)} for m in parsed])
    assert smi(sim_env(path), "-L").splitlines() == lines


# ------------------------------------------------------------------------------------ -q

Section = Tuple[str, List[str]]  # (title line, the lines under it)


def first_gpu_sections(text: str) -> Tuple[List[str], List[Section]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("GPU "))
    head = lines[:start]
    sections: List[Section] = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("GPU "):
            break
        if line.startswith("    ") and not line.startswith("        "):
            sections.append((line.rstrip(), []))
        elif sections:
            sections[-1][1].append(line.rstrip())
    return head, sections


def label(line: str) -> str:
    return line.split(" : ", maxsplit=1)[0].rstrip() if " : " in line else line.rstrip()


def colon(line: str) -> int:
    return line.index(" : ") if " : " in line else -1


def scenario_from_qlog(text: str) -> Tuple[str, int, List[dict]]:
    value = {label(line).strip(): line.split(" : ", 1)[1].strip() for line in text.splitlines() if " : " in line}
    _head, sections = first_gpu_sections(text)
    titles = {label(title).strip(): (title, body) for title, body in sections}
    gpu: dict = {"name": value["Product Name"]}
    if titles["ECC Mode"][1][0].endswith("N/A"):
        gpu["ecc"] = "not_supported"
    if "Remapped Rows" in titles and titles["Remapped Rows"][0].endswith("N/A"):
        gpu["remapped_rows"] = "not_supported"
    if titles["Retired Pages"][1][0].endswith("N/A"):
        gpu["retired_pages"] = "not_supported"
    mig = titles.get("MIG Mode", ("", []))[1]
    if mig and mig[0].endswith("N/A"):
        gpu["mig_mode"] = "not_supported"
    elif mig and mig[0].endswith("Enabled"):
        gpu["mig_mode"] = {"current": True, "pending": True}
    processes = titles.get("Processes", ("", []))[1]
    pids = [line.split(" : ")[1].strip() for line in processes if label(line).strip() == "Process ID"]
    gpu["processes"] = [{"pid": int(pid), "used_memory_mib": 1} for pid in pids]
    count = int(value["Attached GPUs"])
    return value["Driver Version"].split()[0], cuda_code(value["CUDA Version"]), [gpu] * count


QLOG_CAPTURES = captures("q_full/nge__linux-*.txt") + captures("q_full/gpud__*.txt")


@pytest.mark.parametrize("capture", QLOG_CAPTURES, ids=lambda p: p.stem)
def test_query_log_sections_match_capture(capture: Path, sim_env, tmp_path) -> None:
    real_text = capture.read_text()
    driver, cuda, gpus = scenario_from_qlog(real_text)
    fake_text = smi(sim_env(scenario_file(tmp_path, driver, cuda, gpus)), "-q")
    real_head, real_sections = first_gpu_sections(real_text)
    fake_head, fake_sections = first_gpu_sections(fake_text)
    assert "==============NVSMI LOG==============" in fake_head
    real_cols = {label(line): colon(line) for line in real_head if " : " in line}
    for line in fake_head:
        if " : " in line:
            assert colon(line) == real_cols[label(line)], line
    real_titles = [label(title) for title, _body in real_sections]
    cursor = 0
    for title, body in fake_sections:
        assert label(title) in real_titles[cursor:], f"section {label(title)!r} missing or out of order"
        cursor = real_titles.index(label(title), cursor) + 1
        real_title, real_body = real_sections[cursor - 1]
        assert (" : " in title) == (" : " in real_title), f"{title!r} vs {real_title!r}"
        real_lines = {label(line): line for line in real_body}
        for line in body:
            assert label(line) in real_lines, f"{label(title)}: {label(line)!r} not in the capture"
            assert colon(line) == colon(real_lines[label(line)]), f"{line!r} vs {real_lines[label(line)]!r}"


@pytest.mark.parametrize("display", ["PERFORMANCE", "PAGE_RETIREMENT"])
def test_query_log_display_filter_keeps_the_header(display: str, sim_env, write_scenario) -> None:
    out = smi(sim_env(write_scenario("gpus: [{}, {}]")), "-q", "-d", display).splitlines()
    reference = captures("q_full/azurehpc__*page-retirement*.txt")[0].read_text().splitlines()
    assert out[:3] == reference[:3]
    assert [label(line) for line in out[3:8]] == [label(line) for line in reference[3:8]]
    assert sum(line.startswith("GPU ") for line in out) == 2
    titles = {line.strip() for line in out if line.startswith("    ") and not line.startswith("     ")}
    expected = {"PERFORMANCE": {"Performance State : P0", "Clocks Event Reasons"}, "PAGE_RETIREMENT": {"Retired Pages"}}
    assert {re.sub(r"\s+:", " :", t) for t in titles} == expected[display]


# -------------------------------------------------------------------- --query-compute-apps


@pytest.mark.parametrize("capture", captures("compute_apps/nge__linux-*__load.txt"), ids=lambda p: p.stem)
def test_compute_apps_match_capture(capture: Path, sim_env, tmp_path) -> None:
    header, *rows = csv_rows(capture.read_text())
    fields = [re.sub(r" \[.*\]$", "", name) for name in header]
    column = {name: fields.index(name) for name in fields}
    first = rows[0]
    procs = [
        {
            "pid": int(r[column["pid"]]),
            "name": r[column["process_name"]],
            "used_memory_mib": int(r[column["used_gpu_memory"]].split()[0]),
        }
        for r in rows
    ]
    gpu = {
        "name": first[column["gpu_name"]],
        "pci_bus_id": first[column["gpu_bus_id"]],
        "uuid": first[column["gpu_uuid"]],
        "processes": procs,
    }
    out = smi(
        sim_env(scenario_file(tmp_path, "590.48.01", 13010, [gpu])),
        "--query-compute-apps=" + ",".join(fields),
        "--format=csv",
    )
    ours_header, *ours = csv_rows(out)
    assert ours_header == header
    skip = {column["timestamp"], column["gpu_serial"]}
    assert [[v for i, v in enumerate(r) if i not in skip] for r in ours] == [
        [v for i, v in enumerate(r) if i not in skip] for r in rows
    ]


# ---------------------------------------------------------------------------- plain table

GPU_ROW = re.compile(r"\|\s+(\d+)\s+(.+?)\s+(On|Off)\s+\|\s+(\S+)\s+Off\s+\|\s+(\S+)\s+\|")
STAT_ROW = re.compile(
    r"\|\s+N/A\s+(\d+)C\s+P0\s+(\d+)W /\s+(\d+)W\s+\|\s+(\d+)MiB /\s+(\d+)MiB\s+\|\s+(\d+)%\s+Default\s+\|"
)
PROC_ROW = re.compile(r"\|\s+(\d+)\s+N/A\s+N/A\s+(\d+)\s+C\s+(\S+)\s+(\d+)MiB \|")
TABLE_CAPTURES = captures("smi_table/nge__linux-x86_64__nvidia-h*00__590*.txt") + captures(
    "smi_table/gpud__8x-h100-80gb-hbm3__550*.txt"
)


def scenario_from_table(lines: List[str]) -> Tuple[str, int, List[dict]]:
    version = re.search(r"Driver Version: (\S+)", lines[2]).group(1)
    cuda = cuda_code(re.search(r"CUDA Version: (\S+)", lines[2]).group(1))
    gpus = []
    for number, line in enumerate(lines):
        match = GPU_ROW.fullmatch(line)
        if not match:
            continue
        stats = STAT_ROW.fullmatch(lines[number + 1])
        assert stats, lines[number + 1]
        temp, draw, cap, used, total, util = (int(v) for v in stats.groups())
        ecc = match.group(5)
        gpus.append(
            {
                "name": match.group(2),
                "persistence_mode": match.group(3) == "On",
                "pci_bus_id": match.group(4),
                "temperature_c": temp,
                "power_w": {"draw": float(draw), "limit": float(cap)},
                "memory_mib": {"total": total, "used": used},
                "utilization_pct": {"gpu": util, "memory": 0},
                "ecc": "not_supported" if ecc == "N/A" else {"volatile": {"uncorrected": int(ecc)}},
                "processes": [],
            }
        )
    for line in lines:
        match = PROC_ROW.fullmatch(line)
        if match:
            gpus[int(match.group(1))]["processes"].append(
                {"pid": int(match.group(2)), "name": match.group(3), "used_memory_mib": int(match.group(4))}
            )
    return version, cuda, gpus


@pytest.mark.parametrize("capture", TABLE_CAPTURES, ids=lambda p: p.stem)
def test_plain_table_matches_capture(capture: Path, sim_env, tmp_path) -> None:
    real = capture.read_text().splitlines()
    version, cuda, gpus = scenario_from_table(real)
    assert gpus, "no GPU rows parsed"
    fake = smi(sim_env(scenario_file(tmp_path, version, cuda, gpus))).splitlines()
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}       ", fake[0])
    assert fake[1:] == real[1:]
