"""The run_scratch module through its argument spec: removal, a no-op second call, check mode, refusals, options."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

import pytest
import yaml

from ansible_collections.remote_gpu.trainer.plugins.modules import run_scratch

DEAD_PID = 2**22 + 7


def write_run_json(run_dir: Path, pid: int = DEAD_PID) -> None:
    record = {"schema": 1, "run": run_dir.name, "started_at": datetime.now(timezone.utc).isoformat()}
    record.update(pgid=pid, sid=pid, pids=[pid], detach="setsid")
    (run_dir / "run.json").write_text(json.dumps(record))


@pytest.fixture
def box(tmp_path: Path) -> Dict[str, Any]:
    data, durable = tmp_path / "data", tmp_path / "durable"
    run = data / "runs" / "r1"
    (run / "cells" / "a").mkdir(parents=True)
    write_run_json(run)
    (run / "cells" / "a" / "best.pth").write_bytes(b"x" * 100)
    (durable / "runs" / "r1" / "cells" / "a").mkdir(parents=True)
    (durable / "runs" / "r1" / "cells" / "a" / "best.pth").write_bytes(b"x" * 100)
    (run / "cells" / "a" / "saved").symlink_to(durable / "runs" / "r1" / "cells" / "a" / "best.pth")
    cache = data / "cache"
    cache.mkdir()
    (cache / "blob").write_bytes(b"abc")
    args = {"run": "r1", "data_dir": str(data), "durable_dir": str(durable), "extra_paths": [str(cache)]}
    return {"args": args, "run": run, "cache": cache, "durable": durable, "data": data}


def test_removes_the_scratch_then_a_second_call_is_a_no_op(box, run_module):
    code, result = run_module(run_scratch, box["args"])
    assert code == 0 and result["changed"] is True
    assert not box["run"].exists() and not box["cache"].exists()
    assert (box["durable"] / "runs" / "r1" / "cells" / "a" / "best.pth").read_bytes() == b"x" * 100
    tombstone = box["data"] / "runs" / ".torn_down" / "r1.json"
    assert result["runs"] == [{"run": "r1", "state": "removed", "tombstone": str(tombstone), "verified": 0}]
    assert [entry["path"] for entry in result["removed"]] == [str(box["run"]), str(box["cache"])]
    assert result["would_remove"] == [] and result["refused"] is False and result["problems"] == []
    assert json.loads(tombstone.read_text())["removed"] == result["removed"]
    code, again = run_module(run_scratch, box["args"])
    assert (code, again["changed"], again["removed"]) == (0, False, [])
    assert again["runs"][0]["tombstone"] == str(tombstone)


def test_check_mode_removes_nothing(box, run_module):
    code, result = run_module(run_scratch, box["args"], check_mode=True)
    assert code == 0 and result["changed"] is True and result["removed"] == []
    assert [entry["path"] for entry in result["would_remove"]] == [str(box["run"]), str(box["cache"])]
    assert box["run"].exists() and box["cache"].exists()
    assert not (box["data"] / "runs" / ".torn_down").exists()


def test_a_refusal_fails_in_one_line_and_removes_nothing(box, run_module):
    code, result = run_module(run_scratch, dict(box["args"], extra_paths=[str(box["cache"]), "/root"]))
    assert code == 1 and result["failed"] is True and result["refused"] is True
    assert result["msg"] == (
        "run_scratch refused: /root resolves to the home directory /root (and 1 more); nothing removed"
    )
    assert len(result["problems"]) == 2 and result["removed"] == []
    assert box["run"].exists() and box["cache"].exists()


def test_an_alive_run_is_refused(box, run_module):
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        write_run_json(box["run"], child.pid)
        code, result = run_module(run_scratch, box["args"])
        assert code == 1 and f"run r1 is alive (pgid {child.pid})" in result["msg"]
        assert box["run"].exists() and child.poll() is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timeout_s": math.nan}, "timeout_s must be a finite number above 0 and at most 86400, got nan"),
        ({"timeout_s": 0}, "timeout_s must be a finite number above 0 and at most 86400, got 0"),
        ({"state": "present"}, "value of state must be one of: absent, got: present"),
        ({"run": "../etc"}, "run must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$, not '../etc'"),
        ({"data_dir": "relative"}, "data_dir must be an absolute path, not 'relative'"),
    ],
)
def test_bad_options_fail_in_one_line_naming_the_option(box, run_module, change, message):
    code, result = run_module(run_scratch, dict(box["args"], **change))
    assert code == 1 and result["msg"].startswith(message)
    assert "\n" not in result["msg"]
    assert box["run"].exists()


def test_every_returned_key_is_documented(box, run_module):
    documented = set(yaml.safe_load(run_scratch.RETURN))
    _code, done = run_module(run_scratch, box["args"], check_mode=True)
    _code, failed = run_module(run_scratch, dict(box["args"], extra_paths=["/"]))
    for result in (done, failed):
        assert set(result) - {"changed", "failed", "invocation"} <= documented
    assert documented <= set(done)
    options = yaml.safe_load(run_scratch.DOCUMENTATION)["options"]
    assert set(options) == set(run_scratch.ARGUMENT_SPEC)
    assert all(options[name].get("default") == spec.get("default") for name, spec in run_scratch.ARGUMENT_SPEC.items())


def test_expected_is_checked_against_the_durable_copy_before_the_cell_goes(box, run_module):
    saved = box["durable"] / "runs" / "r1" / "cells" / "a" / "best.pth"
    entry = {"path": "cells/a/best.pth", "size": 100, "sha256": hashlib.sha256(b"x" * 100).hexdigest()}
    saved.write_bytes(b"y" * 100)
    code, result = run_module(run_scratch, dict(box["args"], expected={"r1": [entry]}))
    assert code == 1 and result["msg"].startswith("run_scratch stopped: the durable copy changed since the gate")
    assert result["durable_mismatch"]["path"] == "cells/a/best.pth" and result["removed"] == []
    assert (box["run"] / "cells" / "a" / "best.pth").exists() and box["cache"].exists()
    saved.write_bytes(b"x" * 100)
    code, result = run_module(run_scratch, dict(box["args"], expected={"r1": [entry]}))
    assert code == 0 and result["runs"][0]["verified"] == 1 and not box["run"].exists()


def test_a_bad_expected_entry_fails_in_one_line(box, run_module):
    code, result = run_module(run_scratch, dict(box["args"], expected={"r1": [{"path": "../x", "size": 1}]}))
    assert code == 1 and result["msg"].startswith("expected.r1: expected[0].sha256 must be 64 lowercase hex digits")
    assert box["run"].exists()
