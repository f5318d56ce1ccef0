"""training_run's ``autostop`` option and ``box_started_at``, through the argument spec with the real runner.

The watcher's start is replaced by a stand-in that holds watch.lock as the real one does and records whether the
run had been started when it was called (the real watcher runs in the autostop unit tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_arm
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import autostop_armed_path, autostop_dir
from ansible_collections.remote_gpu.trainer.plugins.modules import training_run
from ansible_collections.remote_gpu.trainer.tests.profiles import self_stop

FAKE_TRAIN = str(Path(__file__).resolve().parents[3] / "workload" / "fake_train.py")
KEY_VALUE = "rpa_SECRETVALUE0123456789abcdef"


def autostop(**extra: Any) -> Dict[str, Any]:
    base = {"idle_minutes": 30, "platform": "runpod", **self_stop("runpod")}
    return dict(base, **extra)


def wait_for(predicate: Any, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _mentions(pid: str, needle: bytes) -> bool:
    for part in ("cmdline", "environ"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/{part}", "rb") as handle:
            if needle in handle.read():
                return True
    return False


@pytest.fixture
def box(tmp_path: Path, provider: Any, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    data, durable = tmp_path / "data", tmp_path / "durable"
    (data / "code" / "r1").mkdir(parents=True)
    durable.mkdir()
    monkeypatch.setenv("RUNPOD_POD_ID", "pod-abc123")
    monkeypatch.setenv("RUNPOD_API_KEY", KEY_VALUE)
    calls: List[bool] = []  # per watcher start: had the run been started (its run.json written) by then?
    held: List[int] = []

    def fake_start(data_dir: str) -> int:
        calls.append((data / "runs" / "r1" / "run.json").exists())
        fd = os.open(os.path.join(autostop_dir(data_dir), "watch.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"424242")
        held.append(fd)
        return 424242

    monkeypatch.setattr(_autostop_arm, "start_watcher", fake_start)
    yield {"data": data, "durable": durable, "calls": calls}
    for fd in held:
        os.close(fd)
    own = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != own and _mentions(pid, str(tmp_path).encode()):
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def args_for(box: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
    base = {
        "run": "r1",
        "data_dir": str(box["data"]),
        "durable_dir": str(box["durable"]),
        "cells": [{"name": "a", "command": [sys.executable, FAKE_TRAIN]}],
        "gpus": [],
        "detach": "setsid",
        "monitor_interval_s": 1,
        "stop_grace_s": 1,
    }
    return dict(base, **extra)


def test_autostop_is_armed_before_the_run_starts(box, run_module):
    code, result = run_module(training_run, args_for(box, autostop=autostop()))

    assert code == 0, result["msg"]
    assert result["outcome"] == "started" and result["changed"] is True
    assert box["calls"] == [False]  # the watcher was started while the run had not been
    facts = result["autostop"]
    assert facts["armed"] is True and facts["changed"] is True and facts["watcher_started"] is True
    assert facts["instance_id"] == "pod-abc123" and facts["command"] == "runpodctl pod stop pod-abc123"
    assert facts["idle_minutes"] == 30.0 and facts["check_interval_s"] == 60.0
    assert "; autostop: armed: stops instance pod-abc123" in result["msg"]
    document = json.loads(Path(autostop_armed_path(str(box["data"]))).read_text())
    assert document["armed_by"] == {"run": "r1", "launch_id": result["launch_id"]}
    assert document["generation"] == facts["generation"] and document["durable_dir"] == str(box["durable"])
    assert KEY_VALUE not in json.dumps(result) and KEY_VALUE not in json.dumps(document)


def test_a_finished_run_launched_again_with_the_same_autostop_changes_nothing(box, run_module):
    code, first = run_module(training_run, args_for(box, autostop=autostop()))
    assert code == 0, first["msg"]
    wait_for((box["data"] / "runs" / "r1" / "DONE").exists, what="DONE")

    code, again = run_module(training_run, args_for(box, autostop=autostop()))

    assert code == 0 and again["outcome"] == "done"
    assert again["changed"] is False and again["autostop"]["changed"] is False
    assert again["autostop"]["generation"] == first["autostop"]["generation"] and box["calls"] == [False]


def test_a_refused_arm_fails_with_one_line_and_starts_nothing(box, run_module, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY")

    code, result = run_module(training_run, args_for(box, autostop=autostop()))

    assert code == 1 and result["autostop_refused"] is True  # the controller reports it REFUSED at autostop
    assert result["msg"].startswith("autostop: RUNPOD_API_KEY is not set on this box, neither in this environment")
    assert "\n" not in result["msg"]
    assert not (box["data"] / "runs" / "r1").exists() and not os.path.exists(autostop_dir(str(box["data"])))
    assert box["calls"] == []


def test_check_mode_arms_nothing_and_says_what_it_would_do(box, run_module):
    code, result = run_module(training_run, args_for(box, autostop=autostop()), check_mode=True)

    assert code == 0 and result["changed"] is True
    assert result["autostop"]["would"].startswith("write armed.json (armed), start the watcher; it stops instance")
    assert not (box["data"] / "runs").exists() and box["calls"] == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"idle_minutes": "nan"}, "autostop.idle_minutes must be a finite number between 0 and 14400, got nan"),
        ({"idle_minutes": None}, "autostop needs idle_minutes (stop that long after every run is secured) or"),
        ({"verb": dict(autostop()["verb"], irreversible=True, survives=[])}, "autostop only stops; never delete"),
    ],
)
def test_bad_autostop_values_fail_naming_the_option(box, run_module, extra, expected):
    code, result = run_module(training_run, args_for(box, autostop=autostop(**extra)))

    assert code == 1 and result["msg"].startswith(expected)
    assert not (box["data"] / "runs" / "r1").exists()


def test_a_misspelt_autostop_suboption_is_named(box, run_module):
    options = autostop()
    options["idle_minute"] = options.pop("idle_minutes")

    code, result = run_module(training_run, args_for(box, autostop=options))

    assert code == 1 and "idle_minute" in result["msg"] and "autostop" in result["msg"]
    assert not (box["data"] / "runs" / "r1").exists()


def test_without_autostop_nothing_is_armed_and_check_mode_tells_the_cost_the_real_launch_records(
    box, run_module, instance_dir
):
    """A check-mode launch said $0.02 and the real one a minute later $0.00 (its own run's start became the since)."""
    code, checked = run_module(training_run, args_for(box), check_mode=True)
    assert code == 0 and not (instance_dir / "ledger.json").exists()
    code, result = run_module(training_run, args_for(box))

    assert code == 0 and result["autostop"] is None
    assert not os.path.exists(autostop_dir(str(box["data"])))
    started = datetime.fromisoformat(result["started_at"].replace("Z", "+00:00")).timestamp()
    since = datetime.fromisoformat(result["box_started_at"].replace("Z", "+00:00")).timestamp()
    assert result["box_started_at"] == checked["box_started_at"] == result["ledger"]["first_seen"]
    assert since <= started and result["ledger"]["running_s"] >= checked["ledger"]["running_s"] > 0
    recorded = json.loads((instance_dir / "ledger.json").read_text())
    assert recorded["first_seen"] == result["box_started_at"] and result["box_now"].endswith("Z")


def test_stopping_a_run_can_disarm_the_box(box, run_module):
    run_module(training_run, args_for(box, autostop=autostop()))

    code, result = run_module(training_run, args_for(box, state="stopped", autostop={"disarm": True}))

    assert code == 0 and result["autostop"]["state"] == "disarmed" and result["autostop"]["changed"] is True
    assert json.loads(Path(autostop_armed_path(str(box["data"]))).read_text())["disarmed"] is True
    assert result["box_started_at"] is not None


def test_a_stop_that_does_not_keep_the_disk_says_what_it_will_never_stop_for(box, run_module):
    """Issue 29: an archived run blocks such a stop, and a failed cell disables its dead-man; said when arming."""
    entry = box["data"] / "runs" / ".archive" / "r0-20300101T000000Z" / "cells" / "a"
    entry.mkdir(parents=True)
    durable_only = dict(autostop()["verb"], survives=["durable_dir"])

    code, result = run_module(
        training_run, args_for(box, autostop=autostop(verb=durable_only, controller_silence_hours=6))
    )

    assert code == 0, result["msg"]
    facts = result["autostop"]
    assert facts["armed"] is True and facts["blocked_by"] == [
        "archived run r0 (.archive/r0-20300101T000000Z) blocks it: the stop keeps only durable_dir and would lose "
        "its scratch (teardown_run or abandon)"
    ]
    assert facts["caveats"] == [
        "a failed cell disables the dead-man: the stop keeps only durable_dir, so a run that ended with a failed cell "
        "holds the box until it is torn down"
    ]
