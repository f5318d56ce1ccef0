"""A run stopped on purpose says who stopped it: teardown's stop_running used to leave its killed cells reading
``hang (failed, exit None)`` in the gate's refusal and ``run stopped`` in result.json, as if something broke."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, cell_facts
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import judge_cell
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_run import stopped_by
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import marker_entry, members
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate
from ansible_collections.remote_gpu.trainer.plugins.modules import training_run
from ansible_collections.remote_gpu.trainer.tests.workload.harness import train, wait_for


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    """A data dir; whatever a test left running under it is killed after."""
    (tmp_path / "data" / "code" / "r1").mkdir(parents=True)
    yield tmp_path / "data"
    for pid in members(None, marker_entry("RGT_RUN_DIR", str(tmp_path / "data" / "runs" / "r1"))):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def args(data: Path, **more: Any) -> Dict[str, Any]:
    cells = [{"name": "hang", "command": train("--forever", "--step-s", "0.1")}]
    base = {"run": "r1", "data_dir": str(data), "cells": cells, "gpus": [], "detach": "setsid", "stop_grace_s": 1}
    return dict(base, monitor_interval_s=1, **more)


def started(data: Path, run_module: Any) -> Path:
    code, result = run_module(training_run, args(data))
    assert code == 0, result
    run_dir = data / "runs" / "r1"
    log = run_dir / "cells" / "hang" / "log"
    wait_for(lambda: log.exists() and "epoch 1/" in log.read_text(), timeout_s=60, what="the cell trains")
    return run_dir


def read(path: Path) -> Dict[str, Any]:
    return json.loads(path.read_text())


def test_a_cell_teardown_stops_says_stopped_by_teardown_at_its_time_to_every_reader(data, run_module):
    run_dir = started(data, run_module)
    code, stopped = run_module(training_run, dict(args(data), state="stopped", stopped_by="teardown"))
    assert code == 0 and stopped["state"] == "stopped", stopped
    record = read(run_dir / "stop.json")
    said = f"stopped by teardown at {datetime.fromisoformat(record['at']).strftime('%H:%M')} UTC"
    result, ended = read(run_dir / "cells" / "hang" / "result.json"), read(run_dir / "cells" / "hang" / "exit.json")
    assert (result["status"], result["reason"], ended["reason"]) == ("failed", said, said)
    assert result["stopped_by"] == ended["stopped_by"] == {"by": "teardown", "at": record["at"]}
    assert said in (run_dir / "cells" / "hang" / "log").read_text()
    # The gate's refusal (teardown's line), patrol's cell facts and its judgement read the same.
    gate = teardown_gate({"data_dir": str(data), "runs": ["r1"]})
    assert gate["step"] == "cells" and f"hang ({said})" in gate["reason"] and "exit None" not in gate["reason"]
    cell = cell_facts(None, str(data), "r1", OnDisk(str(data), "r1"))[0]
    assert cell["reason"] == said
    judge_cell(cell, {}, {}, ())
    assert (cell["state"], cell["exception"]) == ("failed", said)


def test_a_stop_record_older_than_the_cell_is_an_earlier_stop_s_and_says_nothing(data, run_module):
    run_dir = started(data, run_module)
    long_ago = (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat(timespec="microseconds")
    (run_dir / "stop.json").write_text(json.dumps({"by": "teardown", "at": long_ago}))
    assert stopped_by(str(run_dir), time.time() - 60) is None
    code, stopped = run_module(training_run, dict(args(data), state="stopped"))  # no stopped_by: no new record
    assert code == 0, stopped
    result = read(run_dir / "cells" / "hang" / "result.json")
    assert (result["reason"], result["stopped_by"]) == ("run stopped", None)


def test_stopped_by_must_be_one_word(data, run_module):
    code, result = run_module(training_run, dict(args(data), state="stopped", stopped_by="tear down"))
    assert code == 1 and result["msg"] == (
        "stopped_by must be one word of letters, digits, _ . or - (at most 32), not 'tear down'"
    )
