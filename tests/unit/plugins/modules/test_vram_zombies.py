"""The vram_zombies module end to end on real processes: a crashed registered run, a live one, kill and check mode."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _procs
from ansible_collections.remote_gpu.trainer.plugins.modules import vram_zombies

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "zombies"))
import harness


def run_module(args, check_mode=False):
    args = dict(args, _ansible_check_mode=check_mode)
    with patch_module_args(args), pytest.raises(SystemExit) as exit_info:
        vram_zombies.main()
    return exit_info.value.code


def result_of(capsys, args, check_mode=False):
    code = run_module(args, check_mode)
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A crashed registered run (launcher killed, workers and dataloaders left) and a live registered run."""
    node = tmp_path / "nvidia0"
    node.write_bytes(b"")
    monkeypatch.setattr(_procs, "DEVICE_PATTERN", re.compile("^" + re.escape(str(node)) + "$"))
    data_dir = tmp_path / "data"
    crashed = harness.start_job(
        tmp_path / "crashed.json", node, "--workers", "2", "--dataloaders", "--register", str(data_dir), "--run", "old"
    )
    live = harness.start_job(
        tmp_path / "live.json", node, "--workers", "1", "--dataloaders", "--register", str(data_dir), "--run", "now"
    )
    harness.kill_launcher(crashed)
    args = {"data_dir": str(data_dir), "min_age_s": 0, "observe_s": 0, "grace_s": 2}
    yield {"crashed": crashed, "live": live, "args": args, "data_dir": data_dir}
    harness.stop_all()


def test_report_only_lists_the_crashed_runs_holders(box, capsys):
    code, result = result_of(capsys, box["args"])
    assert code == 0
    assert result["changed"] is False
    assert result["status"] == "candidates"
    assert sorted(c["pid"] for c in result["candidates"]) == box["crashed"]["holders"]
    assert all("run_dead" in c["rules"] for c in result["candidates"])
    live_holders = {h["pid"]: h for h in result["holders"] if h["pid"] in box["live"]["holders"]}
    assert sorted(live_holders) == box["live"]["holders"]
    assert all(h["protected_by"].startswith("live registered run 'now'") for h in live_holders.values())
    assert {r["run"]: r["live"] for r in result["runs"]} == {"old": False, "now": True}
    assert result["killed"] == [] and result["would_kill"] == []
    (warning,) = result["findings"]
    assert (warning["code"], warning["level"], warning["action"]) == ("vram_zombies", "WARN", "reap_zombies")
    assert sorted(warning["pids"]) == box["crashed"]["holders"]
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])


def test_check_mode_says_what_would_be_killed_and_kills_nothing(box, capsys):
    _code, result = result_of(capsys, dict(box["args"], kill=True), check_mode=True)
    assert result["changed"] is True
    assert result["would_kill"] == box["crashed"]["holders"]
    assert result["killed"] == [] and result["status"] == "candidates"
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])


def test_a_corrupt_registry_refuses_to_kill_but_still_reports(box, capsys, monkeypatch):
    torn = box["data_dir"] / "runs" / "torn" / "run.json"
    torn.parent.mkdir()
    torn.write_text('{"pgid": ')
    # Where ansible-core delivers module warnings depends on what the process imported before (controller code
    # routes them to its display), so watch the module's own warn() calls.
    warned = []
    monkeypatch.setattr(vram_zombies.AnsibleModule, "warn", lambda _module, text: warned.append(text))
    _code, result = result_of(capsys, dict(box["args"], kill=True))
    assert result["changed"] is False
    assert "nothing was signalled" in result["kill_refused"] and str(torn) in result["kill_refused"]
    assert result["registry_problems"][0].startswith(str(torn))
    assert any(str(torn) in text for text in warned)
    assert sorted(c["pid"] for c in result["candidates"]) == box["crashed"]["holders"]
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])


def test_kill_reaps_only_the_crashed_run_and_a_second_run_is_clean(box, capsys):
    _code, result = result_of(capsys, dict(box["args"], kill=True, protect_pids=[4194304 + 17]))
    assert result["changed"] is True
    assert result["status"] == "reaped"
    assert sorted(k["pid"] for k in result["killed"]) == box["crashed"]["holders"]
    assert {k["signal"] for k in result["killed"]} == {"SIGTERM"}
    assert result["failed"] == [] and result["findings"] == []
    assert result["verification"]["holders_gone"] is True
    assert not any(harness.alive(pid) for pid in box["crashed"]["holders"])
    assert all(harness.alive(pid) for pid in box["live"]["holders"])
    _code, again = result_of(capsys, dict(box["args"], kill=True))
    assert (again["changed"], again["status"], again["candidates"], again["killed"]) == (False, "clean", [], [])
    assert sorted(h["pid"] for h in again["holders"]) == box["live"]["holders"]


def test_protect_patterns_spare_matching_processes(box, capsys):
    _code, result = result_of(capsys, dict(box["args"], protect_patterns=["fake_job[.]py worker"]))
    assert result["candidates"] == [] and result["status"] == "clean"


def test_invalid_pattern_is_a_clear_error(capsys):
    code, result = result_of(capsys, {"protect_patterns": ["ok", "(unclosed"]})
    assert code == 1
    assert result["failed"] is True
    assert result["msg"].startswith("protect_patterns: invalid regular expression '(unclosed'")


def test_negative_durations_are_rejected(capsys):
    code, result = result_of(capsys, {"grace_s": -1})
    assert code == 1
    assert result["msg"] == "grace_s must be 0 or more, not -1.0"
