"""The vram_zombies module end to end on real processes: a crashed registered run, a live one, kill and check mode."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import harness
import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs import _procs
from ansible_collections.remote_gpu.trainer.plugins.modules import vram_zombies


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


def test_report_only_lists_the_crashed_runs_holders(box, run_module):
    code, result = run_module(vram_zombies, box["args"])
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


def test_check_mode_says_what_would_be_killed_and_kills_nothing(box, run_module):
    _code, result = run_module(vram_zombies, dict(box["args"], kill=True), check_mode=True)
    assert result["changed"] is True
    assert result["would_kill"] == box["crashed"]["holders"]
    assert result["killed"] == [] and result["status"] == "candidates"
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])


def test_a_corrupt_registry_refuses_to_kill_but_still_reports(box, run_module, monkeypatch):
    torn = box["data_dir"] / "runs" / "torn" / "run.json"
    torn.parent.mkdir()
    torn.write_text('{"pgid": ')
    # Where ansible-core delivers module warnings depends on what the process imported before (controller code
    # routes them to its display), so watch the module's own warn() calls.
    warned = []
    monkeypatch.setattr(vram_zombies.AnsibleModule, "warn", lambda _module, text: warned.append(text))
    _code, result = run_module(vram_zombies, dict(box["args"], kill=True))
    assert result["changed"] is False
    assert "nothing was signalled" in result["kill_refused"] and str(torn) in result["kill_refused"]
    assert result["registry_problems"][0].startswith(str(torn))
    assert any(str(torn) in text for text in warned)
    assert sorted(c["pid"] for c in result["candidates"]) == box["crashed"]["holders"]
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])


def test_kill_reaps_only_the_crashed_run_and_a_second_run_is_clean(box, run_module, tmp_path):
    # An unregistered crashed job would be reaped too, but its worker is protected: the worker, its dataloader
    # and (holding the same process group) the rest of its job stay.
    kept = harness.start_job(tmp_path / "kept.json", tmp_path / "nvidia0", "--workers", "1", "--dataloaders")
    harness.kill_launcher(kept)
    protected = kept["workers"][0]
    args = dict(box["args"], kill=True, protect_pids=[protected])
    _code, result = run_module(vram_zombies, args)
    holders = {h["pid"]: h for h in result["holders"]}
    assert holders[protected]["protected_by"] == "protect_pids"
    assert holders[kept["dataloaders"][0]]["protected_by"] == f"protect_pids (descendant of {protected})"
    assert all(harness.alive(pid) for pid in kept["holders"])
    assert result["changed"] is True
    assert result["status"] == "reaped"
    assert sorted(k["pid"] for k in result["killed"]) == box["crashed"]["holders"]
    assert {k["signal"] for k in result["killed"]} == {"SIGTERM"}
    assert result["failed"] == [] and result["findings"] == []
    assert result["verification"]["holders_gone"] is True
    assert not any(harness.alive(pid) for pid in box["crashed"]["holders"])
    assert all(harness.alive(pid) for pid in box["live"]["holders"])
    _code, again = run_module(vram_zombies, args)
    assert (again["changed"], again["status"], again["candidates"], again["killed"]) == (False, "clean", [], [])
    assert sorted(h["pid"] for h in again["holders"]) == sorted(box["live"]["holders"] + kept["holders"])


def test_protect_patterns_spare_matching_processes(box, run_module):
    _code, result = run_module(vram_zombies, dict(box["args"], protect_patterns=["fake_job[.]py worker"]))
    assert result["candidates"] == [] and result["status"] == "clean"


def test_invalid_pattern_is_a_clear_error(run_module):
    code, result = run_module(vram_zombies, {"protect_patterns": ["ok", "(unclosed"]})
    assert code == 1
    assert result["failed"] is True
    assert result["msg"].startswith("protect_patterns: invalid regular expression '(unclosed'")


def test_invalid_subreaper_pattern_is_a_clear_error(run_module):
    code, result = run_module(vram_zombies, {"subreaper_patterns": ["[z-a]"]})
    assert code == 1
    assert result["msg"].startswith("subreaper_patterns: invalid regular expression '[z-a]'")


SUBREAPER = (
    "import ctypes, signal, subprocess, sys, time; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "  # PR_SET_CHILD_SUBREAPER
    "signal.signal(signal.SIGCHLD, signal.SIG_IGN); subprocess.Popen(sys.argv[1:]); time.sleep(3600)"
)


def test_orphans_adopted_by_a_configured_subreaper_are_reaped(tmp_path, monkeypatch, run_module):
    node = tmp_path / "nvidia0"
    node.write_bytes(b"")
    monkeypatch.setattr(_procs, "DEVICE_PATTERN", re.compile("^" + re.escape(str(node)) + "$"))
    state = tmp_path / "job.json"
    job = f"{harness.FAKE_JOB} launch --device {node} --workers 2 --state {state}"
    script = f"{shlex.quote(sys.executable)} -c {shlex.quote(SUBREAPER)} {sys.executable} {job} & sleep 0"
    try:
        crashed = harness.start_shell_job(_background(script, state), state)
        subreaper = harness.parent_of(crashed["launcher"])
        os.kill(crashed["launcher"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while harness.parent_of(crashed["workers"][0]) != subreaper and time.monotonic() < deadline:
            time.sleep(0.05)
        assert harness.parent_of(crashed["workers"][0]) == subreaper
        args = {"kill": True, "min_age_s": 0, "observe_s": 0, "grace_s": 2}
        _code, spared = run_module(vram_zombies, args)
        assert spared["killed"] == [] and all(harness.alive(pid) for pid in crashed["workers"])
        ours = {h["pid"]: h for h in spared["holders"] if h["pid"] in crashed["workers"]}
        assert all(h["reason"].startswith(f"its ancestor {subreaper} (") for h in ours.values())
        _code, reaped = run_module(vram_zombies, dict(args, subreaper_patterns=[r"prctl\(36, 1, "]))
        assert sorted(k["pid"] for k in reaped["killed"]) == crashed["workers"]
        assert not any(harness.alive(pid) for pid in crashed["workers"])
    finally:
        harness.stop_all()


def test_negative_durations_are_rejected(run_module):
    code, result = run_module(vram_zombies, {"grace_s": -1})
    assert code == 1
    assert result["msg"] == "grace_s must be a finite number between 0 and 3600, got -1.0"


def _background(command: str, state: Path) -> str:
    """Shell text that starts ``command`` in the background and returns once its state file exists (<= 20 s)."""
    wait = f"i=0; while [ ! -e {shlex.quote(str(state))} ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done"
    return f"exec >/dev/null 2>&1 </dev/null; {command} & {wait}"


@pytest.fixture
def shell_jobs(tmp_path, monkeypatch):
    """Live jobs started from a shell that then exited, beside an unregistered job whose launcher crashed."""
    node = tmp_path / "nvidia0"
    node.write_bytes(b"")
    monkeypatch.setattr(_procs, "DEVICE_PATTERN", re.compile("^" + re.escape(str(node)) + "$"))
    job = f"{shlex.quote(sys.executable)} {shlex.quote(str(harness.FAKE_JOB))} launch --device {shlex.quote(str(node))}"
    nohup_state, setsid_state = tmp_path / "nohup.json", tmp_path / "setsid.json"
    nohup = harness.start_shell_job(
        _background(f"nohup {job} --keep-session --workers 2 --state {shlex.quote(str(nohup_state))}", nohup_state),
        nohup_state,
    )
    setsid = harness.start_shell_job(
        _background(
            f"cd /tmp && setsid {job} --workers 2 --dataloaders --state {shlex.quote(str(setsid_state))}", setsid_state
        ),
        setsid_state,
        shell="bash",  # bash keeps the &&-list's shell, waiting for setsid, as on a real box
    )
    crashed = harness.start_job(tmp_path / "crashed.json", node, "--workers", "2", "--dataloaders")
    harness.kill_launcher(crashed)
    yield {"nohup": nohup, "setsid": setsid, "crashed": crashed}
    harness.stop_all()


def test_live_jobs_without_a_live_group_leader_survive_a_kill(shell_jobs, run_module):
    nohup, setsid, crashed = shell_jobs["nohup"], shell_jobs["setsid"], shell_jobs["crashed"]
    # The shapes issue 7 describes: the nohup launcher leads no group, the setsid launcher's parent is the
    # &&-list's leftover shell.
    assert nohup["pgid"] != nohup["launcher"] and harness.alive(nohup["launcher"])
    leftover = harness.parent_of(setsid["launcher"])
    assert leftover != 1 and harness.alive(leftover)
    _code, result = run_module(vram_zombies, {"kill": True, "min_age_s": 0, "observe_s": 0, "grace_s": 2})
    assert sorted(k["pid"] for k in result["killed"]) == crashed["holders"]
    assert result["status"] == "reaped"
    holders = {h["pid"]: h for h in result["holders"]}
    for job in (nohup, setsid):
        assert all(harness.alive(pid) for pid in [job["launcher"], *job["holders"]])
        assert not any(holders[pid]["candidate"] for pid in job["holders"])
    assert holders[nohup["workers"][0]]["reason"].startswith(f"its ancestor {nohup['launcher']} (")
    assert holders[setsid["workers"][0]]["reason"].startswith(f"its ancestor {setsid['launcher']} (")
    # The launchers hold no device: their command lines are read because a decision names them.
    assert "fake_job.py launch" in holders[nohup["workers"][0]]["reason"]


def test_every_candidate_skipped_is_not_reaped(box, run_module, monkeypatch):
    monkeypatch.setattr(_procs, "_same_process", lambda _proc: None)  # every PID now names another process
    _code, result = run_module(vram_zombies, dict(box["args"], kill=True))
    assert sorted(s["pid"] for s in result["skipped"]) == box["crashed"]["holders"]
    assert result["killed"] == [] and result["changed"] is False and result["verification"] is None
    assert result["status"] == "candidates"
    assert result["findings"][0]["code"] == "vram_zombies"
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])


def test_a_missing_data_dir_is_reported_and_refuses_to_kill(box, run_module, tmp_path):
    missing = tmp_path / "nonexistent"
    _code, result = run_module(vram_zombies, dict(box["args"], data_dir=str(missing), kill=True))
    assert result["registry_problems"] == [f"data_dir {missing}: not found, so the run registry could not be read"]
    assert str(missing) in result["kill_refused"] and result["changed"] is False
    assert all(harness.alive(pid) for pid in box["crashed"]["holders"])
    harness.stop_all()  # with no holder left, a missing registry still says so
    _code, clean = run_module(vram_zombies, {"data_dir": str(missing), "min_age_s": 0, "observe_s": 0})
    assert clean["status"] == "clean" and clean["registry_problems"] == result["registry_problems"]
