"""The whole box for patrol_facts: the tick file, the box's idle time over every run, the autostop facts."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_state import hold_watch_lock
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _ledger
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _box_idle

NOW = float(int(time.time()))  # whole seconds: the facts are ISO times to the second


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


# Above any pid_max (2**22): a launcher that can never be alive.
GONE = 2**22 + 7


def add_run(data: Path, name: str, *, leader: int = GONE, done: bool = False, at: float = NOW - 600) -> Path:
    """A registered run whose run.json, cells and DONE all carry the mtime ``at`` (its last activity); a live
    ``leader`` registered just now, a gone one an hour before ``at``."""
    run = data / "runs" / name
    (run / "cells" / "a").mkdir(parents=True)
    started = iso(at - 3600) if leader == GONE else datetime.now(timezone.utc).isoformat()
    record = {"schema": 1, "run": name, "started_at": started, "pgid": leader, "sid": leader, "pids": [leader]}
    (run / "run.json").write_text(json.dumps(record))
    files = [run / "run.json"]
    if done:
        for name_ in ("exit.json", "result.json"):
            (run / "cells" / "a" / name_).write_text("{}")
            files.append(run / "cells" / "a" / name_)
        (run / "DONE").write_text("")
        files.append(run / "DONE")
    for path in files:
        os.utime(path, (at, at))
    return run


def box_of(data: Path, examined=()) -> Dict[str, Any]:
    facts, notes = _box_idle.box_idle_facts(_box_idle.scan_box(str(data)), time.time(), list(examined))
    return dict(facts, notes=notes)


# --- the tick file ---------------------------------------------------------------------------------------------


def test_each_tick_counts_up_in_the_tick_file(tmp_path):
    (tmp_path / "runs").mkdir()
    answers = [_box_idle.write_tick(str(tmp_path), NOW + n) for n in range(3)]
    assert [a["tick"] for a in answers] == [1, 2, 3] and all(a["note"] is None for a in answers)
    written = json.loads((tmp_path / "runs" / ".patrol-tick.json").read_text())
    assert written == {"at": iso(NOW + 2), "tick": 3}


def test_no_tick_file_and_no_directory_made_on_a_box_without_runs(tmp_path):
    assert _box_idle.write_tick(str(tmp_path / "typo"), NOW) == {"tick": None, "note": None}
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2]", '{"tick": "seven"}', '{"tick": -3}', '{"tick": true}'])
def test_a_garbage_tick_file_counts_again_from_one_with_a_note(tmp_path, garbage):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".patrol-tick.json").write_text(garbage)
    answer = _box_idle.write_tick(str(tmp_path), NOW)
    assert answer["tick"] == 1 and "counting again from 1" in answer["note"] and "\n" not in answer["note"]
    assert json.loads((tmp_path / "runs" / ".patrol-tick.json").read_text())["tick"] == 1


def test_a_tick_file_that_cannot_be_written_is_a_note(tmp_path):
    (tmp_path / "runs" / ".patrol-tick.json").mkdir(parents=True)  # a directory in its place
    answer = _box_idle.write_tick(str(tmp_path), NOW)
    assert answer["tick"] is None and "not written" in answer["note"]


# --- the box ---------------------------------------------------------------------------------------------------


def test_two_runs_one_live_the_box_is_not_idle(tmp_path, live_session, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 86400)
    add_run(tmp_path, "finished", done=True)
    add_run(tmp_path, "training", leader=live_session)
    box = box_of(tmp_path)
    assert (box["live_runs"], box["runs_done"], box["idle"], box["idle_since"]) == (
        ["training"],
        ["finished"],
        False,
        None,
    )
    assert box["since"] == iso(NOW - 86400)  # the ledger's first_seen: the container's start, before every run
    assert box["container_started_at"] == iso(NOW - 86400) and box["notes"] == []
    assert box["ledger"]["running_s"] >= 86400 and box["box_now"].endswith("Z")


def test_all_done_idles_since_the_newest_activity_of_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 86400)
    older = add_run(tmp_path, "older", done=True, at=NOW - 7200)
    add_run(tmp_path, "newer", done=True, at=NOW - 3600)
    os.utime(older / "cells" / "a" / "result.json", (NOW - 60, NOW - 60))  # a late re-sync of the older run
    box = box_of(tmp_path)
    assert (box["live_runs"], box["runs_done"], box["idle"]) == ([], ["newer", "older"], True)
    assert box["idle_since"] == iso(NOW - 60)


def test_a_box_restarted_after_its_runs_idles_since_the_container_started(tmp_path, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 30)
    add_run(tmp_path, "old", done=True, at=NOW - 7200)
    assert box_of(tmp_path)["idle_since"] == iso(NOW - 30)


def test_runs_started_before_the_container_bill_from_the_container_start(tmp_path, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 30)
    add_run(tmp_path, "before-a-restart", done=True, at=NOW - 7200)
    box = box_of(tmp_path)
    assert box["since"] == iso(NOW - 7200 - 3600)  # first seen with that run; its boot is not billed
    assert 30 <= box["ledger"]["running_s"] < 600 and box["ledger"]["segments_total"] == 1


def test_a_box_without_runs_bills_and_idles_since_the_container_started(tmp_path, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 30)
    (tmp_path / "runs").mkdir()
    box = box_of(tmp_path)
    assert (box["since"], box["idle"], box["idle_since"], box["live_runs"]) == (iso(NOW - 30), True, iso(NOW - 30), [])


def test_activity_stamped_in_the_future_idles_since_now_at_most(tmp_path, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": None)
    add_run(tmp_path, "skewed", done=True, at=time.time() + 86400)
    since = datetime.fromisoformat(box_of(tmp_path)["idle_since"]).timestamp()
    assert since <= time.time()


def test_a_garbage_run_json_is_a_note_for_a_run_the_runs_probe_did_not_examine(tmp_path, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW)
    (tmp_path / "runs" / "broken").mkdir(parents=True)
    (tmp_path / "runs" / "broken" / "run.json").write_text("{oops")
    assert box_of(tmp_path)["notes"][0].startswith("box: run.json of broken cannot be read")
    assert box_of(tmp_path, examined=["broken"])["notes"] == []  # noted by the runs probe already


def test_runs_that_cannot_be_listed_leave_idle_unknown():
    facts, notes = _box_idle.box_idle_facts({"runs": [], "problem": "runs cannot be listed: EIO"}, NOW, [])
    assert facts["idle"] is None and facts["idle_since"] is None and "whether it idles is unknown" in notes[0]


# --- autostop --------------------------------------------------------------------------------------------------

ARMED = {
    "version": 1,
    "generation": "0123456789ab",
    "armed_at": iso(NOW - 3600),
    "armed_by": {"run": "sweep", "launch_id": "L1"},
    "idle_minutes": 30,
    "controller_silence_hours": None,
    "check_interval_s": 60.0,
}
DECISION = {
    "version": 1,
    "generation": "0123456789ab",
    "watcher_pid": 4242,
    "watcher_started_at": iso(NOW - 3500),
    "updated_at": iso(NOW - 10),
    "state": "idle_wait",
    "reason": "every run DONE and secured",
    "next_check_at": iso(NOW + 50),
    "due_at": iso(NOW + 1080),
    "idle_s": 720.0,
    "idle_needed_s": 1800.0,
    "silence_s": None,
    "silence_needed_s": None,
    "trigger": "idle",
    "runs": [{"run": "sweep", "state": "done", "reason": "DONE"}],
    "gate": {"passed": True, "step": None, "reason": "secured", "checked_at": iso(NOW - 700)},
    "stop": None,
    "history": [{"at": iso(NOW - 720), "state": "idle_wait", "reason": "every run DONE and secured"}],
}


def write_autostop(data: Path, armed: Any = None, decision: Any = None) -> None:
    (data / "runs" / ".autostop").mkdir(parents=True, exist_ok=True)
    for path, document in (
        (data / "runs" / ".autostop" / "armed.json", armed),
        (data / "runs" / ".autostop.json", decision),
    ):
        if document is not None:
            path.write_text(document if isinstance(document, str) else json.dumps(document))


def autostop_of(data: Path) -> Dict[str, Any]:
    facts, notes = _box_idle.autostop_facts(_box_idle.read_autostop(str(data)), str(data))
    assert set(facts) == set(_box_idle.AUTOSTOP_KEYS)
    return dict(facts, notes=notes)


def test_without_armed_json_autostop_is_not_armed_and_the_rest_null(tmp_path):
    (tmp_path / "runs").mkdir()
    facts = autostop_of(tmp_path)
    assert facts.pop("armed") is False and facts.pop("notes") == [] and set(facts.values()) == {None}


def test_armed_json_and_the_watchers_decision_are_read(tmp_path):
    write_autostop(tmp_path, ARMED, DECISION)
    facts = autostop_of(tmp_path)
    assert (facts["armed"], facts["state"], facts["trigger"], facts["notes"]) == (True, "idle_wait", "idle", [])
    assert (facts["due_at"], facts["next_check_at"]) == (iso(NOW + 1080), iso(NOW + 50))
    assert (facts["idle_s"], facts["idle_needed_s"], facts["silence_s"]) == (720.0, 1800.0, None)
    assert facts["gate"] == {"passed": True, "step": None, "reason": "secured", "checked_at": iso(NOW - 700)}
    assert (facts["generation"], facts["generation_current"], facts["stop"]) == ("0123456789ab", True, None)
    assert facts["armed_by"] == {"run": "sweep", "launch_id": "L1"}
    assert (facts["idle_minutes"], facts["controller_silence_hours"]) == (30.0, None)
    assert facts["watcher_alive"] is False  # no watcher holds watch.lock here
    assert facts["watcher_pid"] in (None, 4242)


def test_a_watcher_holding_its_lock_is_alive_with_its_pid(tmp_path):
    write_autostop(tmp_path, ARMED, DECISION)
    held = hold_watch_lock(str(tmp_path))
    try:
        facts = autostop_of(tmp_path)
    finally:
        os.close(held)
    assert (facts["watcher_alive"], facts["watcher_pid"]) == (True, os.getpid())


def test_a_decision_about_an_older_configuration_is_not_current(tmp_path):
    write_autostop(tmp_path, dict(ARMED, generation="ba9876543210"), DECISION)
    facts = autostop_of(tmp_path)
    assert (facts["generation"], facts["generation_current"], facts["state"]) == ("ba9876543210", False, "idle_wait")


def test_armed_before_the_watcher_wrote_anything(tmp_path):
    write_autostop(tmp_path, ARMED)
    facts = autostop_of(tmp_path)
    assert (facts["armed"], facts["state"], facts["generation_current"], facts["notes"]) == (True, None, False, [])


def test_a_disarmed_config_is_not_armed_but_still_reported(tmp_path):
    write_autostop(tmp_path, dict(ARMED, disarmed=True), dict(DECISION, state="disarmed"))
    facts = autostop_of(tmp_path)
    assert (facts["armed"], facts["state"], facts["generation"]) == (False, "disarmed", "0123456789ab")


def test_a_stop_is_reported_with_its_outcome(tmp_path):
    stop = {"issued_at": iso(NOW), "command": ["runpodctl", "pod", "stop", "p1"], "outcome": "stopped",
            "final_state": "EXITED", "msg": "stopped", "attempts": 1, "result": {"changed": True}}  # fmt: skip
    write_autostop(tmp_path, ARMED, dict(DECISION, state="stopped", stop=stop))
    assert autostop_of(tmp_path)["stop"] == stop


@pytest.mark.parametrize("garbage", ["{not json", "[]", "\xff\xfe", "x" * (70 * 1024)])
def test_a_garbage_armed_json_is_a_note_and_not_armed(tmp_path, garbage):
    write_autostop(tmp_path, garbage, DECISION)
    facts = autostop_of(tmp_path)
    assert facts["armed"] is False and facts["state"] is None
    assert (
        len(facts["notes"]) == 1 and "armed.json: " in facts["notes"][0] and "taken as not armed" in facts["notes"][0]
    )


@pytest.mark.parametrize("garbage", ["{torn", "[]", json.dumps(dict(DECISION, state="sleeping"))])
def test_a_garbage_decision_is_unreadable_with_a_note(tmp_path, garbage):
    write_autostop(tmp_path, ARMED, garbage)
    facts = autostop_of(tmp_path)
    assert (facts["armed"], facts["state"], facts["generation_current"]) == (True, "unreadable", False)
    assert len(facts["notes"]) == 1 and facts["notes"][0].startswith(f"autostop: {tmp_path}/runs/.autostop.json: ")


def test_fields_of_the_wrong_type_read_as_null(tmp_path):
    odd = dict(DECISION, idle_s="soon", due_at=5, gate="passed", stop=[1], watcher_pid=True, trigger=["idle"])
    write_autostop(tmp_path, dict(ARMED, idle_minutes="30", armed_by="me"), odd)
    facts = autostop_of(tmp_path)
    assert (facts["idle_s"], facts["due_at"], facts["gate"], facts["stop"], facts["trigger"]) == (None,) * 5
    assert (facts["idle_minutes"], facts["armed_by"], facts["watcher_pid"]) == (None, None, None)
    assert facts["state"] == "idle_wait" and facts["notes"] == []


def test_a_stop_command_with_a_non_text_part_is_not_shown(tmp_path):
    stop = {"issued_at": iso(NOW), "command": ["runpodctl", 7], "outcome": "failed", "attempts": "1"}
    write_autostop(tmp_path, ARMED, dict(DECISION, state="failed", stop=stop))
    shown = autostop_of(tmp_path)["stop"]
    assert (shown["command"], shown["attempts"], shown["outcome"], shown["result"]) == (None, None, "failed", None)


# --- the probe's answer ----------------------------------------------------------------------------------------


def test_a_probe_that_hung_leaves_box_and_autostop_unknown_with_one_note():
    box, autostop, notes = _box_idle.whole_box({"timed_out": True}, "/data", 2.0, NOW, [])
    assert box["idle"] is None and set(autostop.values()) == {None}
    assert notes == [
        "box: reading /data/runs for the box's idle time and autostop did not finish within 2 s (a hung mount?)"
    ]


def test_the_probe_records_the_ledger_like_the_tick_never_in_check_mode(tmp_path, instance_dir, monkeypatch):
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 7200)
    (tmp_path / "runs").mkdir()
    checked = _box_idle.box_probe(str(tmp_path), False, NOW)["box"]
    assert not (instance_dir / "ledger.json").exists() and not (tmp_path / "runs" / ".instance").exists()
    real = _box_idle.box_probe(str(tmp_path), True, NOW)["box"]
    assert checked["ledger"] == real["ledger"] and real["ledger"]["running_s"] == 7200.0
    assert (real["box_now"], real["since"]) == (iso(NOW), iso(NOW - 7200))
    assert json.loads((tmp_path / "runs" / ".instance" / "ledger.json").read_text())["first_seen"] == iso(NOW - 7200)
