"""Wall and CPU time of one gpu_health run (3 s window) for 1 and 8 simulated GPUs, both backends.

    .venv/bin/python benchmarks/gpu_health_sample.py [--out DIR]

Each run is the module's own process as Ansible would start it on the box: a fresh Python with the JSON args
payload (``python -m ...modules.gpu_health '{"ANSIBLE_MODULE_ARGS": ...}'``), under the GPU simulator's environment
on this machine. It leaves out everything Ansible adds around that process: no Ansible controller (no inventory,
no task engine, no AnsiballZ packaging, whose zip import also compiles the module_utils without cached .pyc),
no SSH, no transfer of the module to the box, no interpreter discovery (this checkout's venv Python runs it).
benchmarks/row_gpu_health.py measures the same process inside a fleet box and the whole ``ansible -m`` call.
CPU time is the child's user + system time, nvidia-smi processes included.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fakegpu"))
sys.path.insert(0, str(REPO / "tests"))
from build import environment  # noqa: E402
from collection_path import collection_root  # noqa: E402

MODULE = "ansible_collections.remote_gpu.trainer.plugins.modules.gpu_health"
SCENARIOS = {
    1: REPO / "tests" / "scenarios" / "healthy-h100.yml",
    8: REPO / "tests" / "scenarios" / "healthy-8x-h100.yml",
}


def one_run(sim_dir: str, scenario: Path, backend: str) -> tuple:
    env = dict(os.environ, PYTHONPATH=str(collection_root()))
    env.update(environment(sim_dir, str(scenario)))
    payload = json.dumps({"ANSIBLE_MODULE_ARGS": {"backend": backend, "sample_seconds": 3}})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", MODULE, payload], env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(done.stdout)
    return wall, cpu, result["status"], result["gpus"][0]["window"]["samples"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--out", help="simulator build directory (default: a temporary one)")
    args = parser.parse_args()
    sim_dir = args.out or tempfile.mkdtemp(prefix="fakegpu-bench-")
    print(f"{'gpus':>4} {'backend':<10} {'wall_s':>7} {'cpu_s':>6} {'samples':>7} status")
    for count, scenario in SCENARIOS.items():
        for backend in ("nvml", "nvidia-smi"):
            wall, cpu, status, samples = one_run(sim_dir, scenario, backend)
            print(f"{count:>4} {backend:<10} {wall:7.2f} {cpu:6.2f} {samples:>7} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
