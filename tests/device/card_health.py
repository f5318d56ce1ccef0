"""card_check.sh's Python steps (stdlib only, Python 3.8+):

card_health.py health STATE FILE          gpu_health on each backend, both results and their comparison
card_health.py alias CAPTURES SHARED DEST STEPS_TSV
                                          DEST = SHARED + the real captures under names the fidelity test globs
card_health.py summary WORK OUT           OUT/summary.json and OUT/health.json from the steps' files
card_health.py unpack WHEELS DEST         the wheels that fit this Python, unzipped (when pip cannot install)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Tuple

MODULE = "ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health"
BACKENDS = ("nvml", "nvidia-smi")
# Readings that move between the two runs (seconds apart): listed apart from the differences that matter.
VOLATILE = ("temperature_c", "sm_clock_mhz", "power_draw_w", "memory_used_mib", "window", "clocks_event_reasons")
MODULE_TIMEOUT_S = 60


def run_module(backend: str) -> Dict[str, Any]:
    """The module as Ansible runs it (arguments file, JSON on stdout), with its defaults but ``backend``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"ANSIBLE_MODULE_ARGS": {"backend": backend}}, handle)
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", MODULE, handle.name],
            check=False,
            capture_output=True,
            text=True,
            timeout=MODULE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "error": f"timed out after {MODULE_TIMEOUT_S} s"}
    finally:
        os.unlink(handle.name)
    run: Dict[str, Any] = {"rc": done.returncode, "seconds": round(time.monotonic() - start, 2)}
    try:
        run["result"] = json.loads(done.stdout)
        run["result"].pop("invocation", None)
    except ValueError:
        run["stdout"] = done.stdout[-4000:]
    if done.stderr:
        run["stderr"] = done.stderr[-4000:]
    return run


def flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts as dotted paths (lists stay whole values)."""
    if isinstance(value, dict) and value:
        flat: Dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def compare(nvml: Dict[str, Any], smi: Dict[str, Any]) -> Dict[str, Any]:
    """What the two backends' results agree on, and each per-GPU field where they differ."""

    def findings(result: Dict[str, Any]) -> List[Tuple[str, Any]]:
        return sorted((item.get("code"), item.get("gpu")) for item in result.get("findings", []))

    gpus: Dict[str, Any] = {}
    ours = {gpu["index"]: gpu for gpu in nvml.get("gpus", [])}
    theirs = {gpu["index"]: gpu for gpu in smi.get("gpus", [])}
    for index in sorted(set(ours) | set(theirs)):
        left, right = flatten(ours.get(index, {})), flatten(theirs.get(index, {}))
        stable, volatile = [], []
        for field in sorted(set(left) | set(right)):
            if left.get(field, "<absent>") != right.get(field, "<absent>"):
                diff = {"field": field, "nvml": left.get(field, "<absent>"), "nvidia-smi": right.get(field, "<absent>")}
                (volatile if field.split(".")[0] in VOLATILE else stable).append(diff)
        gpus[str(index)] = {"stable_differences": stable, "volatile_differences": volatile}
    return {
        "same_status": nvml.get("status") == smi.get("status"),
        "status": {"nvml": nvml.get("status"), "nvidia-smi": smi.get("status")},
        "same_findings": findings(nvml) == findings(smi),
        "findings": {"nvml": findings(nvml), "nvidia-smi": findings(smi)},
        "same_versions": all(nvml.get(key) == smi.get(key) for key in ("driver_version", "cuda_version")),
        "stable_difference_count": sum(len(gpu["stable_differences"]) for gpu in gpus.values()),
        "gpus": gpus,
    }


def health(state: str, path: str) -> int:
    runs = {backend: run_module(backend) for backend in BACKENDS}
    report: Dict[str, Any] = {"state": state, "runs": runs}
    if all("result" in run for run in runs.values()):
        report["comparison"] = compare(runs["nvml"]["result"], runs["nvidia-smi"]["result"])
    Path(path).write_text(json.dumps(report, indent=1, default=str))
    return 0 if "comparison" in report else 1


def alias(captures: str, shared: str, dest: str, steps_tsv: str) -> int:
    """The fidelity test globs ``nge__linux-*`` captures only (the table: ``nvidia-h*00__590*``, compute apps:
    ``*__load``), and needs the shared sets too: copy those, then our good captures renamed to fit the globs.
    The token ``rgtcard`` marks them in the test ids; the driver in the name is the real one after it."""
    failed = {line.split("\t")[0] for line in Path(steps_tsv).read_text().splitlines() if line.split("\t")[1] != "0"}
    if Path(shared).is_dir():
        shutil.copytree(shared, dest)
    else:
        print(f"alias: no shared captures at {shared}: the fidelity test will fail to collect", file=sys.stderr)
    for kind in ("query_csv", "q_full", "list_L", "compute_apps", "smi_table"):
        for path in sorted(Path(captures, kind).glob("rgtdev__*.txt")):
            parts = path.stem.split("__")  # rgtdev, os-arch, model, driver[, state][, ours...]
            if f"{kind}/{path.name}" in failed or len(parts) > 5 or len(parts) < 4:
                continue
            if kind == "compute_apps" and (parts[4:] != ["load"] or len(path.read_text().splitlines()) < 2):
                continue
            name = "__".join(["nge", parts[1], parts[2], f"590-rgtcard-{parts[3]}", *parts[4:]])
            Path(dest, kind).mkdir(parents=True, exist_ok=True)
            for source in (path, path.with_suffix(".cmd")):
                if source.exists():
                    shutil.copyfile(source, Path(dest, kind, name + source.suffix))
            print(f"alias: {kind}/{path.name} -> {name}.txt")
    return 0


def summary(work: str, out: str) -> int:
    steps = []
    for line in Path(work, "steps.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        steps.append({"name": name, "rc": int(rc), "seconds": int(seconds)})
    states = {}
    for path in sorted(Path(work).glob("health-*.json")):
        report = json.loads(path.read_text())
        states[report["state"]] = report
    Path(out, "health.json").write_text(json.dumps(states, indent=1))
    fidelity = Path(out, "fidelity.txt")
    text = fidelity.read_text(errors="replace") if fidelity.exists() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    facts = {
        "key": os.environ.get("KEY"),
        "python": {
            "executable": sys.executable,
            "version": sys.version.split()[0],
            "install": os.environ.get("INSTALL"),
        },
        "packages": versions(("nvidia-ml-py", "psutil", "pytest", "PyYAML", "ansible-core")),
        "failed_steps": [step for step in steps if step["rc"] != 0],
        "health": {state: health_line(report) for state, report in states.items()},
        "fidelity": {
            "result": lines[-1] if lines else None,
            "real_card_cases": [line for line in lines if "rgtcard" in line and line.split()[0].isupper()],
        },
        "steps": steps,
    }
    Path(out, "summary.json").write_text(json.dumps(facts, indent=1))
    return 0


def health_line(report: Dict[str, Any]) -> Dict[str, Any]:
    """One state's verdicts per backend and what the comparison found, for summary.json."""
    line: Dict[str, Any] = {}
    for backend, run in report["runs"].items():
        result = run.get("result", {})
        line[backend] = {"rc": run.get("rc"), "status": result.get("status"), "msg": result.get("msg")}
        if not result:
            line[backend]["error"] = run.get("error") or (run.get("stderr") or run.get("stdout", ""))[-500:]
    comparison = report.get("comparison")
    if comparison:
        line["comparison"] = {key: comparison[key] for key in ("same_status", "same_findings", "same_versions")}
        line["comparison"]["findings"] = comparison["findings"]
        line["comparison"]["stable_differences"] = {
            index: [diff["field"] for diff in gpu["stable_differences"]] for index, gpu in comparison["gpus"].items()
        }
    return line


def versions(names: Tuple[str, ...]) -> Dict[str, Any]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def unpack(wheels: str, dest: str) -> int:
    """Unzip the newest wheel of each project that this interpreter can import (pure, its cpXY, or abi3)."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    best: Dict[str, Tuple[List[int], Path]] = {}
    for path in Path(wheels).glob("*.whl"):
        name, version, python, abi = path.name.split("-")[:4]
        fits = "py3" in python.split(".") or tag in python.split(".")
        fits = fits or (abi == "abi3" and int(python[2:] or 0) <= int(tag[2:]))
        number = [int(part) for part in re.findall(r"\d+", version)]
        if fits and python_fits(path) and (name.lower() not in best or number > best[name.lower()][0]):
            best[name.lower()] = (number, path)
    for _number, path in best.values():
        with zipfile.ZipFile(path) as archive:
            archive.extractall(dest)
        print(f"unpack: {path.name}")
    return 0 if best else 1


def python_fits(wheel: Path) -> bool:
    """The wheel's Requires-Python lower bound admits this interpreter (ansible-core: see card_check.sh)."""
    if wheel.name.startswith("ansible_core-"):
        return True
    with zipfile.ZipFile(wheel) as archive:
        meta = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = archive.read(meta).decode("utf-8", "replace") if meta else ""
    bound = re.search(r"^Requires-Python:\s*>=\s*(\d+)\.(\d+)", text, re.MULTILINE)
    return not bound or (int(bound.group(1)), int(bound.group(2))) <= sys.version_info[:2]


def main(argv: List[str]) -> int:
    commands = {"health": health, "alias": alias, "summary": summary, "unpack": unpack}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
