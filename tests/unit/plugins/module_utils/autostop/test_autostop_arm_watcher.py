"""Arming starts the real watcher: installed from AUTOSTOP_MODULES into the box, detached, holding watch.lock; a
second arm finds it and starts none; a disarm ends it with state ``disarmed``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_arm import arm, disarm
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_state import (
    read_decision,
    watcher_alive,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_watch import AUTOSTOP_MODULES
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._run_detach import pid_alive
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import autostop_dir
from ansible_collections.remote_gpu.trainer.tests.profiles import self_stop

KEY_VALUE = "rpa_SECRETVALUE0123456789abcdef"


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def box(tmp_path: Path, provider: Any, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    data, durable = tmp_path / "data", tmp_path / "durable"
    (data / "runs").mkdir(parents=True)
    durable.mkdir()
    pid1 = tmp_path / "pid1-environ"
    pid1.write_bytes(b"")
    monkeypatch.setenv("RUNPOD_POD_ID", "pod-live1")
    monkeypatch.setenv("RUNPOD_API_KEY", KEY_VALUE)
    facts: Dict[str, Any] = {"data": str(data), "durable": str(durable), "pid1": str(pid1), "pids": []}
    yield facts
    for pid in facts["pids"]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def params(box: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "data_dir": box["data"],
        "durable_dir": box["durable"],
        "run": "r1",
        "launch_id": None,
        "idle_minutes": 30.0,
        "check_interval_s": 1.0,
        "platform": "runpod",
        **self_stop("runpod"),
    }


def test_arming_starts_one_real_watcher_and_disarm_ends_it(box):
    first = arm(params(box), False, box["pid1"])
    box["pids"].append(first["watcher_pid"])

    pid = first["watcher_pid"]
    assert first["watcher_started"] is True and pid_alive(pid)
    assert watcher_alive(box["data"]) == (True, pid)
    runner = Path(autostop_dir(box["data"])) / "runner"
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        assert str(runner / "run.py").encode() in handle.read()
    package = runner / "ansible_collections" / "remote_gpu" / "trainer" / "plugins" / "module_utils"
    installed = {str(path.relative_to(package)) for path in package.rglob("*.py") if path.name != "__init__.py"}
    assert installed == set(AUTOSTOP_MODULES)

    second = arm(params(box), False, box["pid1"])
    assert second["changed"] is False and second["watcher_started"] is False and second["watcher_pid"] == pid

    disarm(box["data"], False)
    wait_for(lambda: not pid_alive(pid), 15, "the disarmed watcher to end")
    assert (read_decision(box["data"]) or {}).get("state") == "disarmed"
    for name in ("watch.log", "armed.json"):
        assert KEY_VALUE not in (Path(autostop_dir(box["data"])) / name).read_text()
    assert KEY_VALUE not in json.dumps(read_decision(box["data"]))
