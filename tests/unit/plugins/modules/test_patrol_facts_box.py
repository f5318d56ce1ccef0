"""patrol_facts' whole-box facts through its argument spec: every run on the box, the tick file, autostop."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _patrol
from ansible_collections.remote_gpu.trainer.plugins.modules import patrol_facts


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")


def add_run(data: Path, name: str, *, leader: int = 2**22 + 7, done: bool = False, at: float = 0.0) -> Path:
    """A registered run; a finished one has DONE and a cell's result.json, all with the mtime ``at``."""
    run = data / "runs" / name
    run.mkdir(parents=True)
    record = {"schema": 1, "run": name, "started_at": datetime.now(timezone.utc).isoformat(), "pgid": leader,
              "sid": leader, "pids": [leader], "cells": [{"name": "a"}]}  # fmt: skip
    (run / "run.json").write_text(json.dumps(record))
    if done:
        (run / "cells" / "a").mkdir(parents=True)
        result = {"status": "succeeded", "exit_code": 0, "signal": None, "started_at": iso(at - 60),
                  "ended_at": iso(at), "sync": "skipped", "artifacts": []}  # fmt: skip
        (run / "cells" / "a" / "result.json").write_text(json.dumps(result))
        (run / "DONE").write_text("")
        for path in (run / "run.json", run / "DONE", run / "cells" / "a" / "result.json"):
            os.utime(path, (at, at))
    return run


def patrol(run_module, data: Path, check_mode: bool = False, **more: Any) -> Dict[str, Any]:
    args = dict({"data_dir": str(data), "kernel_log": False, "gpu_backend": "nvidia-smi"}, **more)
    code, result = run_module(patrol_facts, args, check_mode=check_mode)
    assert code == 0, result.get("msg")
    assert "Traceback" not in json.dumps(result)
    return result


def ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def test_the_box_covers_every_run_even_when_one_run_is_patrolled(tmp_path, run_module, live_session):
    now = time.time()
    add_run(tmp_path, "finished", done=True, at=now - 600)
    add_run(tmp_path, "training", leader=live_session)
    result = patrol(run_module, tmp_path, run="finished")
    assert result["examined_runs"] == ["finished"]
    box = result["box"]
    assert (box["live_runs"], box["runs_done"], box["idle"], box["idle_since"]) == (
        ["training"],
        ["finished"],
        False,
        None,
    )
    assert box["since"] is not None and box["container_started_at"] is not None
    assert result["ansible_facts"]["patrol"]["box"] == box


def test_all_done_idles_since_the_newest_activity(tmp_path, run_module):
    now = time.time()
    add_run(tmp_path, "a", done=True, at=now - 7200)
    add_run(tmp_path, "b", done=True, at=now - 120)
    box = patrol(run_module, tmp_path)["box"]
    assert (box["live_runs"], box["runs_done"], box["idle"]) == ([], ["a", "b"], True)
    container = ts(box["container_started_at"])
    assert ts(box["idle_since"]) == pytest.approx(max(container, now - 120), abs=1)


def test_each_tick_counts_up_and_check_mode_writes_no_tick(tmp_path, run_module):
    tick_file = tmp_path / "runs" / ".patrol-tick.json"
    (tmp_path / "runs").mkdir()
    patrol(run_module, tmp_path, check_mode=True)
    assert not tick_file.exists() and not (tmp_path / "runs" / ".instance").exists()  # nor the cost ledger's copy
    patrol(run_module, tmp_path)
    first = json.loads(tick_file.read_text())
    patrol(run_module, tmp_path, check_mode=True)
    assert json.loads(tick_file.read_text()) == first  # a check-mode patrol does not feed the dead-man timer
    patrol(run_module, tmp_path, run=None)
    second = json.loads(tick_file.read_text())
    assert (first["tick"], second["tick"]) == (1, 2) and ts(second["at"]) >= ts(first["at"])
    # No temp file left; beside the tick, the box's cost ledger's copy in this data dir.
    assert sorted(p.name for p in tick_file.parent.iterdir()) == [".instance", ".patrol-tick.json"]


def test_an_armed_autostop_and_its_decision_are_returned(tmp_path, run_module):
    add_run(tmp_path, "sweep", done=True, at=time.time() - 60)
    (tmp_path / "runs" / ".autostop").mkdir()
    now = iso(time.time())
    armed = {
        "version": 1,
        "generation": "0123456789ab",
        "armed_at": now,
        "armed_by": {"run": "sweep", "launch_id": None},
        "idle_minutes": 30,
        "controller_silence_hours": 6,
    }
    decision = {
        "version": 1,
        "generation": "0123456789ab",
        "watcher_pid": 4242,
        "state": "gate_failed",
        "reason": "durable: a.pth does not match its manifest",
        "updated_at": now,
        "gate": {"passed": False, "step": "durable", "reason": "a.pth mismatch", "checked_at": now},
        "trigger": None,
        "stop": None,
        "history": [],
    }
    (tmp_path / "runs" / ".autostop" / "armed.json").write_text(json.dumps(armed))
    (tmp_path / "runs" / ".autostop.json").write_text(json.dumps(decision))
    result = patrol(run_module, tmp_path)
    autostop = result["autostop"]
    assert (autostop["armed"], autostop["state"], autostop["generation_current"]) == (True, "gate_failed", True)
    assert autostop["gate"]["step"] == "durable" and autostop["gate"]["passed"] is False
    assert (autostop["idle_minutes"], autostop["controller_silence_hours"]) == (30.0, 6.0)
    assert autostop["armed_by"] == {"run": "sweep", "launch_id": None}
    assert set(autostop) == set(yaml.safe_load(patrol_facts.RETURN)["autostop"]["sample"])


def test_no_autostop_armed(tmp_path, run_module):
    (tmp_path / "runs").mkdir()
    autostop = patrol(run_module, tmp_path)["autostop"]
    assert autostop.pop("armed") is False and set(autostop.values()) == {None}


def test_garbage_autostop_and_tick_files_are_one_line_reasons(tmp_path, run_module):
    (tmp_path / "runs" / ".autostop").mkdir(parents=True)
    (tmp_path / "runs" / ".autostop" / "armed.json").write_text("{not json")
    (tmp_path / "runs" / ".autostop.json").write_text("\x00\x01")
    (tmp_path / "runs" / ".patrol-tick.json").write_text('{"tick": "x"}')
    result = patrol(run_module, tmp_path)
    assert result["autostop"]["armed"] is False and result["escalate"] is False
    notes = [r for r in result["reasons"] if "autostop" in r or "patrol tick" in r]
    assert len(notes) == 3 and all("\n" not in note for note in notes)
    assert json.loads((tmp_path / "runs" / ".patrol-tick.json").read_text())["tick"] == 1


def test_a_hung_box_probe_costs_a_reason_not_the_tick(tmp_path, run_module, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(_patrol, "box_probe", lambda *_args: time.sleep(30))  # a data_dir that never answers
    started = time.monotonic()
    result = patrol(run_module, tmp_path, timeout_s=1)
    assert time.monotonic() - started < 15
    assert result["box"]["idle"] is None and result["autostop"]["armed"] is None
    assert any("did not finish within 1 s" in reason for reason in result["reasons"])


def test_the_box_keys_are_documented(tmp_path, run_module):
    (tmp_path / "runs").mkdir()
    result = patrol(run_module, tmp_path)
    sample = yaml.safe_load(patrol_facts.RETURN)["box"]["sample"]
    assert set(result["box"]) == set(sample)
