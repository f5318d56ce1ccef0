"""Build a run directory the way training_run does (spec.json, .secrets.json) and read back what the runner wrote.

Import as ``from ansible_collections.remote_gpu.trainer.tests.workload.harness import ...``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import parse_spec

FAKE_TRAIN = Path(__file__).resolve().parent / "fake_train.py"
COLLECTIONS = Path(__file__).resolve().parents[2] / ".build" / "collections"
RUNNER_MAIN = (
    "import sys; from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._runner import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def train(*args: Any) -> List[str]:
    """The argv of the fake training program."""
    return [sys.executable, str(FAKE_TRAIN), *(str(arg) for arg in args)]


def make_run(
    root: Path,
    cells: List[Dict[str, Any]],
    secrets: Optional[Dict[str, str]] = None,
    name: str = "sweep",
    **spec: Any,
) -> Path:
    """``<root>/data/runs/<name>`` with a validated spec.json; durable_dir defaults to ``<root>/durable`` (created)."""
    data = root / "data"
    run_dir = data / "runs" / name
    run_dir.mkdir(parents=True)
    if "durable_dir" not in spec:
        (root / "durable").mkdir(exist_ok=True)
        spec["durable_dir"] = str(root / "durable")
    document = {"run": name, "data_dir": str(data), "workdir": str(root), "cells": cells, "stop_grace_s": 1}
    document.update(spec)
    (run_dir / "spec.json").write_text(json.dumps(parse_spec(document).to_json()))
    if secrets:
        path = run_dir / ".secrets.json"
        path.write_text(json.dumps(secrets))
        path.chmod(0o644)  # the runner makes it 0600
    return run_dir


def start_runner(run_dir: Path, env: Optional[Dict[str, str]] = None) -> subprocess.Popen[bytes]:
    """The runner as a detached process of its own session, as ``setsid`` leaves it."""
    environment = dict(os.environ, PYTHONPATH=str(COLLECTIONS), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER_MAIN, str(run_dir)],
        env=environment,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def results(run_dir: Path) -> Dict[str, Dict[str, Any]]:
    found = {}
    for path in sorted((run_dir / "cells").glob("*/result.json")):
        found[path.parent.name] = json.loads(path.read_text())
    return found


def records(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout_s} s")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a runner started by ``start_runner`` and all its cells)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass  # gone already


FAKE_PROVIDER = Path(__file__).resolve().parent / "fake_provider.py"


class Provider:
    """The fake provider CLI (``fake_provider.py``) installed in ``<root>/bin``: ``add`` instances, read back
    ``calls`` (each an argv) and ``instances`` (the state file)."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.state = root / "state.json"
        self.calls_file = root / "calls.jsonl"
        subprocess.run([sys.executable, str(FAKE_PROVIDER), "install", str(self.bin)], check=True)

    def add(self, ident: str, *options: str) -> None:
        argv = [sys.executable, str(FAKE_PROVIDER), "add", "--state", str(self.state), ident, *options]
        subprocess.run(argv, check=True)

    def calls(self) -> List[List[str]]:
        if not self.calls_file.exists():
            return []
        return [json.loads(line)["argv"] for line in self.calls_file.read_text().splitlines()]

    def instances(self) -> Dict[str, Any]:
        return json.loads(self.state.read_text())["instances"]


def runpod_stop_verb(pod: str) -> Dict[str, Any]:
    """RunPod's ``stop`` verb as the shipped profile declares it, rendered for ``pod``."""
    return {
        "command": ["runpodctl", "pod", "stop", pod],
        "status": {
            "command": ["runpodctl", "pod", "list", "--all", "--output", "json"],
            "list": "",
            "id": pod,
            "state_key": "desiredStatus",
        },
        "final_states": ["EXITED"],
        "survives": ["data_dir", "durable_dir"],
        "irreversible": False,
    }
