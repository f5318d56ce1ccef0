"""Shared helpers of the GPU simulator's tests (paths, child processes, CSV parsing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

FAKEGPU = Path(__file__).resolve().parent.parent
REPO = FAKEGPU.parent.parent
SCENARIOS = REPO / "tests" / "scenarios"
PROBE = Path(__file__).resolve().parent / "nvml_probe.py"
TIMEOUT_S = 60
if str(FAKEGPU) not in sys.path:
    sys.path.insert(0, str(FAKEGPU))


def run(argv: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def probe(env: Dict[str, str], *args: str) -> Dict[str, Any]:
    """Run the NVML probe (real pynvml in a child with LD_LIBRARY_PATH set) and return its JSON."""
    result = run([sys.executable, str(PROBE), *args], env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def csv_rows(text: str) -> List[List[str]]:
    return [[cell.strip() for cell in line.split(", ")] for line in text.splitlines() if line]
