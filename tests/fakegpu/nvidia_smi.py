"""A fake ``nvidia-smi`` that prints the real tool's formats for the box in $FAKEGPU_SCENARIO.

Supported: ``-L``; ``--query-gpu=... --format=csv[,noheader][,nounits]``; ``--query-compute-apps=...``;
``-q`` and ``-q -d LIST``; ``-i/--id LIST`` (indexes, UUIDs or PCI bus ids); ``nvlink -s``; ``dmon``
(default columns, ``-c N``, ``-d SECONDS``, paced like the real tool); the plain table. Timeline entries count
from the first simulated-GPU call of the process that runs this one (see _clock.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _smi_fields as fields
import _smi_qlog as qlog
from _clock import elapsed_for
from _smi_fields import EXIT_GPU_LOST, lost_message
from _smi_table import table
from scenario import NOT_AVAILABLE, ScenarioError, load, state_at

DRIVER_NOT_LOADED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
EXIT_INVALID_ARGUMENT = 2
EXIT_NOT_FOUND = 6
EXIT_DRIVER_NOT_LOADED = 9
EXIT_COMMAND_NOT_FOUND = 127
COMPUTE_APP_FIELDS = {
    "timestamp": "",
    "gpu_name": "",
    "gpu_bus_id": "",
    "gpu_serial": "",
    "gpu_uuid": "",
    "pid": "",
    "process_name": "",
    "name": "",
    "used_gpu_memory": "MiB",
    "used_memory": "MiB",
}
NVLINK_SPEED = "26.562 GB/s"  # per-link speed an NVLink4 (H100) link reports
NVLINK_ALL_INACTIVE = "NVML: Unable to retrieve NVLink information as all links are inActive"
NVLINK_UNSUPPORTED = "Device does not have or support Nvlink"
NVLINK_UNSUPPORTED_LINE_SINCE = 595  # 580 printed nothing for such a card, 595 prints the line


class UsageError(Exception):
    """Bad arguments: printed and exit 2, as the real tool does."""


def _timestamp_csv(now: float) -> str:
    stamp = datetime.datetime.fromtimestamp(now)
    return stamp.strftime("%Y/%m/%d %H:%M:%S.") + f"{stamp.microsecond // 1000:03d}"


def _timestamp_text(now: float) -> str:
    return time.ctime(now)


def parse_args(argv: List[str]) -> Dict[str, Any]:
    """The options the fake understands, from the real tool's spellings."""
    opts: Dict[str, Any] = {"mode": "table", "ids": None, "format": [], "displays": None, "count": None}
    args = list(argv)
    if args and args[0] in ("nvlink", "dmon"):
        opts["mode"] = args.pop(0)
    while args:
        arg = args.pop(0)
        name, has_value, inline = arg.partition("=")

        def take(name: str = name, has_value: str = has_value, inline: str = inline) -> str:
            if has_value:
                return inline
            if not args:
                raise UsageError(f'Option "{name}" requires a value.')
            return args.pop(0)

        if name in ("-L", "--list-gpus"):
            opts["mode"] = "list"
        elif name in ("-q", "--query"):
            opts["mode"] = "query"
        elif name in ("-d", "--display") and opts["mode"] != "dmon":  # dmon's -d is its delay
            opts["displays"] = [item.strip().upper() for item in take().split(",") if item.strip()]
        elif name in ("-i", "--id"):
            opts["ids"] = [item.strip() for item in take().split(",") if item.strip()]
        elif name == "--query-gpu":
            opts["mode"], opts["fields"] = "query-gpu", take().split(",")
        elif name == "--query-compute-apps":
            opts["mode"], opts["fields"] = "query-apps", take().split(",")
        elif name == "--format":
            opts["format"] = [item.strip() for item in take().split(",")]
        elif name in ("-s", "--status") and opts["mode"] == "nvlink":
            opts["nvlink_status"] = True
        elif name in ("-s", "--select") and opts["mode"] == "dmon":
            take()  # metric groups: the fake always prints the default columns
        elif name in ("-c", "--count") and opts["mode"] == "dmon":
            opts["count"] = int(take())
        elif name in ("-d", "--delay") and opts["mode"] == "dmon":
            opts["delay"] = int(take())
            if opts["delay"] < 1:
                raise UsageError("Invalid delay: the collection interval is at least 1 second.")
        else:
            raise UsageError("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
    if opts["mode"] in ("query-gpu", "query-apps") and "csv" not in opts["format"]:
        raise UsageError("Format must be specified with --format=csv")
    if opts["displays"] is not None:
        unknown = [name for name in opts["displays"] if name not in qlog.DISPLAY_SECTIONS]
        if unknown:
            raise UsageError(f"Invalid display option: {unknown[0]}")
    return opts


def select_gpus(gpus: List[Dict[str, Any]], ids: Optional[List[str]]) -> List[Tuple[int, Dict[str, Any]]]:
    """The (index, gpu) pairs that -i names, in the order given; all GPUs without -i."""
    if ids is None:
        return list(enumerate(gpus))
    chosen = []
    for wanted in ids:
        match = None
        for index, gpu in enumerate(gpus):
            same_bus = wanted.upper().endswith(gpu["pci_bus_id"][4:].upper()) and ":" in wanted
            if wanted == str(index) or wanted == gpu["uuid"] or same_bus:
                match = (index, gpu)
        if match is None:
            return []
        chosen.append(match)
    return chosen


def list_gpus(selected: List[Tuple[int, Dict[str, Any]]], out: List[str]) -> int:
    code = 0
    for index, gpu in selected:
        if gpu["lost"]:
            out.append(lost_message(gpu))
            code = EXIT_GPU_LOST
        else:
            out.append(f"GPU {index}: {gpu['name']} (UUID: {gpu['uuid']})")
    return code


def query_gpu(scenario: Dict[str, Any], selected, opts: Dict[str, Any], now: float, out: List[str]) -> int:
    names = []
    for field in opts["fields"]:
        name = fields.canonical(field.strip())
        if name is None:
            out.append(f'Field "{field.strip()}" is not a valid field to query.')
            out.append("")
            return EXIT_INVALID_ARGUMENT
        names.append(name)
    with_units = "nounits" not in opts["format"]
    if "noheader" not in opts["format"]:
        out.append(", ".join(fields.header(name) for name in names))
    code = 0
    for index, gpu in selected:
        if gpu["lost"]:
            out.append(lost_message(gpu))
            code = EXIT_GPU_LOST
            continue
        row = fields.Row(scenario, gpu, index, _timestamp_csv(now))
        out.append(", ".join(fields.value(name, row, with_units) for name in names))
    return code


def query_apps(selected, opts: Dict[str, Any], now: float, out: List[str]) -> int:
    names = [field.strip() for field in opts["fields"]]
    for name in names:
        if name not in COMPUTE_APP_FIELDS:
            out.append(f'Field "{name}" is not a valid field to query.')
            out.append("")
            return EXIT_INVALID_ARGUMENT
    with_units = "nounits" not in opts["format"]
    if "noheader" not in opts["format"]:
        units = [COMPUTE_APP_FIELDS[name] for name in names]
        out.append(", ".join(f"{name} [{unit}]" if unit else name for name, unit in zip(names, units)))
    code = 0
    for _index, gpu in selected:
        if gpu["lost"]:
            out.append(lost_message(gpu))
            code = EXIT_GPU_LOST
            continue
        for proc in gpu["processes"]:
            memory = str(proc["used_memory_mib"]) + (" MiB" if with_units else "")
            if proc["used_memory_mib"] == NOT_AVAILABLE:
                memory = fields.NA
            values = {
                "timestamp": _timestamp_csv(now),
                "gpu_name": gpu["name"],
                "gpu_bus_id": gpu["pci_bus_id"],
                "gpu_serial": fields.NA,
                "gpu_uuid": gpu["uuid"],
                "pid": str(proc["pid"]),
                "process_name": proc["name"],
                "name": proc["name"],
                "used_gpu_memory": memory,
                "used_memory": memory,
            }
            out.append(", ".join(values[name] for name in names))
    return code


def query_log(scenario: Dict[str, Any], selected, opts: Dict[str, Any], now: float, out: List[str]) -> int:
    driver = scenario["driver"]
    major = qlog.driver_major(driver["version"])
    width = 55 if major >= 575 else 42
    out += qlog.header(driver["version"], driver["cuda_version"], len(scenario["gpus"]), _timestamp_text(now))
    code = 0
    for index, gpu in selected:
        if gpu["lost"]:
            out.append(lost_message(gpu))
            code = EXIT_GPU_LOST
        else:
            out.append(f"GPU {gpu['pci_bus_id']}")
            out += qlog.render(qlog.select(qlog.gpu_lines(gpu, index, driver["version"]), opts["displays"]), width)
        out.append("")
    return code


def nvlink_status(selected, driver_version: str, out: List[str]) -> int:
    """The real tool's three shapes: per-link lines, the all-inactive line (links but no bridge or peer), and
    for a card without NVLink nothing before driver 595, "Device does not have or support Nvlink" since."""
    code = 0
    for index, gpu in selected:
        if gpu["lost"]:
            out.append(lost_message(gpu))
            code = EXIT_GPU_LOST
            continue
        header = f"GPU {index}: {gpu['name']} (UUID: {gpu['uuid']})"
        if not gpu["nvlinks"]:
            if qlog.driver_major(driver_version) >= NVLINK_UNSUPPORTED_LINE_SINCE:
                out += [header, NVLINK_UNSUPPORTED]
            continue
        out.append(header)
        if not any(link["active"] for link in gpu["nvlinks"]):
            out.append(NVLINK_ALL_INACTIVE)
            continue
        for number, link in enumerate(gpu["nvlinks"]):
            out.append(f"\t Link {number}: {NVLINK_SPEED if link['active'] else '<inactive>'}")
    return code


def dmon(scenario: Dict[str, Any], selected, opts: Dict[str, Any]) -> int:
    """Stream samples as the real tool does: the header, the first sample at once, then one every ``-d`` seconds
    (default 1) on a fixed schedule, each flushed when taken and read from the timeline state at its own moment;
    without ``-c`` until killed."""
    for number in (signal.SIGPIPE, signal.SIGINT):  # `dmon | head`, Ctrl-C: end quietly, no traceback
        signal.signal(number, signal.SIG_DFL)
    columns = ["gpu", "pwr", "gtemp", "mtemp", "sm", "mem", "enc", "dec", "jpg", "ofa", "mclk", "pclk"]
    units = ["Idx", "W", "C", "C", "%", "%", "%", "%", "%", "%", "MHz", "MHz"]
    out = ["# " + "".join(f"{name:>6} " for name in columns)[3:], "# " + "".join(f"{unit:>6} " for unit in units)[3:]]
    delay, count = opts.get("delay", 1), opts["count"]
    started = time.monotonic()
    sample = 0
    while count is None or sample < count:
        if sample:
            time.sleep(max(0.0, started + sample * delay - time.monotonic()))
            with contextlib.suppress(ScenarioError):  # a half-written file: keep sampling the last good one
                scenario = load(os.environ.get("FAKEGPU_SCENARIO", ""))
            selected = select_gpus(state_at(scenario, elapsed_for(os.getppid()))["gpus"], opts["ids"])
        for index, gpu in selected:
            if gpu["lost"]:
                sys.stdout.write("".join(line + "\n" for line in [*out, lost_message(gpu)]))
                return EXIT_GPU_LOST
            util, clocks = gpu["utilization_pct"], gpu["clocks_mhz"]
            values = [round(gpu["power_w"]["draw"]), gpu["temperature_c"], "-", util["gpu"], util["memory"]]
            values += [0, 0, 0, 0, clocks["mem"], clocks["sm"]]
            out.append(f"{index:>5} " + "".join(f"{value:>6} " for value in values))
        sys.stdout.write("".join(line + "\n" for line in out))
        sys.stdout.flush()
        out = []
        sample += 1
    return 0


def main(argv: List[str]) -> int:
    try:
        scenario = load(os.environ.get("FAKEGPU_SCENARIO", ""))
    except ScenarioError as exc:
        sys.stderr.write(f"fake nvidia-smi: invalid scenario: {exc}\n")
        return 255
    if scenario["driver"]["library"] == "absent":
        sys.stderr.write("nvidia-smi: command not found\n")
        return EXIT_COMMAND_NOT_FOUND
    if not scenario["driver"]["loaded"]:
        sys.stdout.write(DRIVER_NOT_LOADED)
        return EXIT_DRIVER_NOT_LOADED
    try:
        opts = parse_args(argv)
    except (UsageError, ValueError) as exc:
        sys.stdout.write(f"{exc}\n")
        return EXIT_INVALID_ARGUMENT
    now = time.time()
    state = state_at(scenario, elapsed_for(os.getppid()))
    selected = select_gpus(state["gpus"], opts["ids"])
    if not selected and (opts["ids"] is not None or not state["gpus"]):
        sys.stdout.write("No devices were found\n")
        return EXIT_NOT_FOUND
    out: List[str] = []
    mode = opts["mode"]
    if mode == "list":
        code = list_gpus(selected, out)
    elif mode == "query-gpu":
        code = query_gpu(state, selected, opts, now, out)
    elif mode == "query-apps":
        code = query_apps(selected, opts, now, out)
    elif mode == "query":
        code = query_log(state, selected, opts, now, out)
    elif mode == "nvlink":
        code = nvlink_status(selected, state["driver"]["version"], out)
    elif mode == "dmon":
        return dmon(scenario, selected, opts)  # writes each sample itself, as it is taken
    else:
        code = table(state, selected, _timestamp_text(now), out)
    sys.stdout.write("".join(line + "\n" for line in out))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
