"""The plain ``nvidia-smi`` table (the layout of drivers 545 and later) of the fake nvidia-smi."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from _smi_fields import EXIT_GPU_LOST, lost_message, mig_on
from scenario import NOT_AVAILABLE

WIDE_RULE = "+" + "-" * 89 + "+"
GPU_RULE = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
NAME_WIDTH = 27
PROCESS_NAME_WIDTH = 37
PROCESS_HEADER = "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |"
PROCESS_HEADER_550 = "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |"


def _name(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 4] + " ..."


def _process_name(name: str, width: int) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def _on_off(flag: bool) -> str:
    return "On" if flag else "Off"


def _gpu_rows(index: int, gpu: Dict[str, Any]) -> List[str]:
    ecc = gpu["ecc"]
    ecc_text = "N/A" if ecc == "not_supported" or not ecc["enabled"] else str(ecc["volatile"]["uncorrected"])
    mig = gpu["mig_mode"]
    mig_text = "N/A" if mig == "not_supported" else ("Enabled" if mig["current"] else "Disabled")
    util_text = "N/A" if mig_on(gpu) else f"{gpu['utilization_pct']['gpu']}%"
    power, memory = gpu["power_w"], gpu["memory_mib"]
    draw, cap = f"{round(power['draw'])}W", f"{round(power['limit'])}W"
    return [
        f"|{index:>4}  {_name(gpu['name']):<31}{_on_off(gpu['persistence_mode']):<3} "
        f"|{gpu['pci_bus_id']:>19} {'Off':>3} |{ecc_text:>21} |",
        f"| N/A{gpu['temperature_c']:>5}C {'P0':>5} {draw:>15} / {cap:>5} "
        f"|{memory['used']:>8}MiB / {memory['total']:>6}MiB |{util_text:>8} {'Default':>12} |",
        f"|{'':41}|{'':24}|{mig_text:>21} |",
        GPU_RULE,
    ]


def table(scenario: Dict[str, Any], selected: List[Tuple[int, Dict[str, Any]]], stamp: str, out: List[str]) -> int:
    lost = [lost_message(gpu) for _index, gpu in selected if gpu["lost"]]
    if lost:  # the real tool prints only the error when a GPU cannot be reached
        out += lost
        return EXIT_GPU_LOST
    driver = scenario["driver"]
    version, cuda = driver["version"], driver["cuda_version"]
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}"
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    out += [
        f"{stamp}       ",
        WIDE_RULE,
        f"| NVIDIA-SMI {version:<23}KMD Version: {version:<14}CUDA UMD Version: {cuda_text:<9}|"
        if major >= 610
        else f"| NVIDIA-SMI {version:<23}Driver Version: {version:<15}CUDA Version: {cuda_text:<9}|",
        GPU_RULE if major >= 575 else "|" + GPU_RULE[1:],
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
    ]
    for index, gpu in selected:
        out += _gpu_rows(index, gpu)
    out += [
        "",
        WIDE_RULE,
        f"| {'Processes:':<88}|",
        PROCESS_HEADER if major >= 575 else PROCESS_HEADER_550,
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * 89 + "|",
    ]
    pid_width = 15 if major >= 575 else 9  # drivers before 575 gave the name the 6 columns
    name_width = PROCESS_NAME_WIDTH + 15 - pid_width
    rows = [
        f"|{index:>5}   N/A  N/A {proc['pid']:>{pid_width}} {'C':>6}   "
        f"{_process_name(proc['name'], name_width):<{name_width}}{_memory(proc['used_memory_mib'])}|"
        for index, gpu in selected
        for proc in gpu["processes"]
    ]
    out += rows or [f"|  {'No running processes found':<87}|"]
    out.append(WIDE_RULE)
    return 0


def _memory(mib: Any) -> str:
    """``  1234MiB``, or `` N/A`` and padding where the driver cannot tell (as a Windows WDDM capture shows)."""
    return f"{'N/A':>4}{'':6}" if mib == NOT_AVAILABLE else f"{mib:>6}MiB "
