"""The run_archive module through its argument spec: a move, a no-op second call, check mode, refusals, options."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.modules import run_archive

DEAD_PID = 2**22 + 7


@pytest.fixture
def data(tmp_path: Path) -> Path:
    for name in ("alpha", "beta"):
        run = tmp_path / "data" / "runs" / name
        (run / "cells" / "a").mkdir(parents=True)
        record = {"schema": 1, "run": name, "started_at": datetime.now(timezone.utc).isoformat()}
        record.update(pgid=DEAD_PID, sid=DEAD_PID, pids=[DEAD_PID], detach="setsid")
        (run / "run.json").write_text(json.dumps(record))
        (run / "cells" / "a" / "best.pth").write_bytes(b"w" * 4096)
    return tmp_path / "data"


def args(data: Path, **more: Any) -> Dict[str, Any]:
    return dict({"data_dir": str(data), "run": "alpha,beta"}, **more)


def test_archives_each_run_then_a_second_call_is_a_no_op(data, run_module):
    inode = (data / "runs" / "alpha" / "cells" / "a" / "best.pth").stat().st_ino
    code, result = run_module(run_archive, args(data, reason="pulled"))
    assert code == 0 and result["changed"] is True and result["refused"] is False
    assert [(entry["run"], entry["state"]) for entry in result["runs"]] == [("alpha", "archived"), ("beta", "archived")]
    moved = Path(result["runs"][0]["path"])
    assert moved.parent == data / "runs" / ".archive" and moved.name.startswith("alpha-")
    assert (moved / "cells" / "a" / "best.pth").stat().st_ino == inode
    assert (moved / "cells" / "a" / "best.pth").read_bytes() == b"w" * 4096
    assert result["msg"].startswith("archive: alpha -> .archive/alpha-") and result["msg"].endswith("nothing deleted")
    assert json.loads(Path(result["runs"][0]["record"]).read_text())["reason"] == "pulled"
    code, again = run_module(run_archive, args(data))
    assert (code, again["changed"]) == (0, False)
    assert [entry["state"] for entry in again["runs"]] == ["already_archived", "already_archived"]
    assert again["runs"][0]["path"] == str(moved)


def test_check_mode_moves_nothing(data, run_module):
    code, result = run_module(run_archive, args(data, run=["alpha"]), check_mode=True)
    assert code == 0 and result["changed"] is True and result["runs"][0]["state"] == "would_archive"
    assert (data / "runs" / "alpha" / "run.json").exists() and not (data / "runs" / ".archive").exists()


def test_a_live_run_fails_the_module_naming_its_process(data, run_module):
    env = dict(os.environ, RGT_RUN_DIR=str(data / "runs" / "beta"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    try:
        time.sleep(0.2)
        code, result = run_module(run_archive, args(data))
    finally:
        child.kill()
        child.wait()
    assert code == 1 and result["failed"] is True and result["refused"] is True and "\n" not in result["msg"]
    assert f"run beta is live: 1 of its processes run (pid {child.pid}" in result["msg"]
    assert [entry["state"] for entry in result["runs"]] == ["not_moved", "refused"]
    assert result["problems"] == [result["runs"][1]["refused"]]
    assert (data / "runs" / "alpha").is_dir() and (data / "runs" / "beta").is_dir()


def test_a_typo_fails_with_a_suggestion(data, run_module):
    code, result = run_module(run_archive, args(data, run=["betta"]))
    assert code == 1 and result["msg"].endswith("does not exist; did you mean beta?; nothing moved")


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"run": ["../alpha"]}, "run: '../alpha' is no run name (a name matches "),
        ({"data_dir": "relative"}, "data_dir must be an absolute path, not 'relative'"),
        ({"timeout_s": math.nan}, "timeout_s must be a finite number above 0 and at most 3600, got nan"),
        ({"timeout_s": 0}, "timeout_s must be a finite number above 0 and at most 3600, got 0.0"),
    ],
)
def test_bad_options_fail_in_one_line_naming_the_option(data, run_module, more, message):
    code, result = run_module(run_archive, args(data, **more))
    assert code == 1 and result["msg"].startswith(message) and "\n" not in result["msg"]
    assert (data / "runs" / "alpha").is_dir()


def test_every_returned_key_is_documented():
    documented = yaml.safe_load(run_archive.RETURN)
    assert set(documented) == {"msg", "runs", "refused", "problems"}
    entry_keys = {"run", "state", "from", "path", "record", "archived_at", "reason", "refused", "durable"}
    assert set(documented["runs"]["contains"]) == entry_keys
    assert set(documented["runs"]["contains"]["durable"]["contains"]) == {"state", "dir", "from", "to"}
    options = yaml.safe_load(run_archive.DOCUMENTATION)["options"]
    assert set(options) == set(run_archive.ARGUMENT_SPEC)


def test_the_durable_copy_moves_with_the_run_and_the_entry_says_where(data, run_module):
    durable = data.parent / "durable"
    record = json.loads((data / "runs" / "alpha" / "run.json").read_text())
    (data / "runs" / "alpha" / "run.json").write_text(json.dumps(dict(record, durable_dir=str(durable))))
    (durable / "runs" / "alpha" / "cells" / "a").mkdir(parents=True)
    (durable / "runs" / "alpha" / "MANIFEST.sha256").write_text("")
    code, result = run_module(run_archive, args(data, run=["alpha"]))
    assert code == 0 and result["runs"][0]["state"] == "archived"
    durable_entry = result["runs"][0]["durable"]
    moved = Path(durable_entry["to"])
    assert (durable_entry["state"], durable_entry["from"]) == ("moved", str(durable / "runs" / "alpha"))
    assert moved.parent == durable / "runs" / ".archive" and moved.name == Path(result["runs"][0]["path"]).name
    assert (moved / "MANIFEST.sha256").exists() and not (durable / "runs" / "alpha").exists()
    assert f"(durable copy -> {moved})" in result["msg"]
