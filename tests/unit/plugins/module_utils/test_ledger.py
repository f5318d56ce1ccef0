"""The box's cost ledger (issue 29 item 6): one per box from the rental's first sight, never decreasing across
archive, cleanup and resume; a stop of ours ends a billing segment and a restart starts the next; check mode
computes what a real call records; copies in the data dirs outlive a wiped home. The stop record's API too.

PID 1's start (the boot) comes from a fake proc tree; ``now`` is given, as the box's clock."""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _ledger, _stops
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import (
    LEDGER,
    STOPS,
    register_data_dir,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._ledger import (
    container_started_at,
    cost_basis,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._stops import read_stops, record_stop
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import archive_path
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _box_idle
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import CLOCK_TICKS
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost

NOW = float(int(time.time()))  # whole seconds: the ledger's times are ISO to the second
HOUR = 3600.0
BTIME = int(NOW - 30 * 86400)  # the host's boot, a month ago


@pytest.fixture(autouse=True)
def fresh_now() -> None:
    """NOW is this test's start, not the file's import: a test that compares it with the box's real clock must not
    drift with how long the suite ran before it."""
    global NOW, BTIME  # noqa: PLW0603
    NOW = float(int(time.time()))
    BTIME = int(NOW - 30 * 86400)


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def fake_proc(root: Path, started: float, stat: str = "") -> str:
    """A proc tree whose PID 1 (the container) started at ``started`` (btime plus its start ticks)."""
    ticks = round((started - BTIME) * CLOCK_TICKS)
    (root / "1").mkdir(parents=True, exist_ok=True)
    fields = ["S", "0", "1", "1"] + ["0"] * 15 + [str(ticks)] + ["0"] * 10
    (root / "1" / "stat").write_text(f"1 (my init) {' '.join(fields)}\n")
    (root / "stat").write_text(stat or f"cpu 1 2 3\nbtime {BTIME}\n")
    return str(root)


def run_on_box(data: Path, name: str, started: Any) -> Path:
    (data / "runs" / name).mkdir(parents=True, exist_ok=True)
    record = {"schema": 1, "run": name, "pgid": 4242, "started_at": started}
    (data / "runs" / name / "run.json").write_text(json.dumps(record))
    return data / "runs" / name


def usd(basis: Dict[str, Any], rate: float = 2.0) -> float:
    cost = box_cost(rate, basis["box_started_at"], box_now=basis["box_now"], ledger=basis["ledger"])
    assert cost is not None and cost["usd"] is not None
    return cost["usd"]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "data" / "runs").mkdir(parents=True)
    return tmp_path / "data"


# --- never decreasing ------------------------------------------------------------------------------------------


def test_archiving_the_oldest_run_leaves_since_and_the_cost_so_far_where_they_were(tmp_path, data, monkeypatch):
    """Cost fell from $34.13 to $8.71 after the oldest run was archived: the start was read from the runs left."""
    monkeypatch.setattr(_ledger, "container_started_at", lambda proc="/proc": NOW - 20 * HOUR)
    oldest = run_on_box(data, "oldest", iso(NOW - 17 * HOUR))
    run_on_box(data, "newer", iso(NOW - 4 * HOUR))
    before = _box_idle.box_idle_facts(_box_idle.scan_box(str(data), True, NOW), NOW, [])[0]
    shutil.move(str(oldest), archive_path(str(data), "oldest", "20991231T000000Z"))
    after = _box_idle.box_idle_facts(_box_idle.scan_box(str(data), True, NOW + 60), NOW + 60, [])[0]
    assert before["since"] == after["since"] == iso(NOW - 20 * HOUR)
    before_usd = usd({"box_started_at": before["since"], "box_now": before["box_now"], "ledger": before["ledger"]})
    after_usd = usd({"box_started_at": after["since"], "box_now": after["box_now"], "ledger": after["ledger"]})
    assert before_usd == 40.0 and after_usd >= before_usd


def test_a_resume_that_rewrites_started_at_does_not_restart_the_cost(tmp_path, data):
    proc = fake_proc(tmp_path / "proc", NOW - 5 * HOUR)
    run_on_box(data, "r1", iso(NOW - 3 * HOUR))
    first = cost_basis([str(data)], True, NOW, proc)
    run_on_box(data, "r1", iso(NOW + 60))  # RESUMED: the runner rewrote run.json
    second = cost_basis([str(data)], True, NOW + 60, proc)
    assert first["box_started_at"] == second["box_started_at"] == iso(NOW - 5 * HOUR)
    assert (first["ledger"]["running_s"], second["ledger"]["running_s"]) == (5 * HOUR, 5 * HOUR + 60)
    assert usd(second) >= usd(first) == 10.0


def test_check_mode_computes_what_a_real_call_records_and_writes_nothing(tmp_path, data, instance_dir):
    """A check-mode launch said $0.02, the real one a minute later $0.00 (its new run's start became the since)."""
    proc = fake_proc(tmp_path / "proc", NOW - 600)
    checked = cost_basis([str(data)], False, NOW, proc)
    assert not (instance_dir / LEDGER).exists() and not (data / "runs" / ".instance").exists()
    run_on_box(data, "r1", iso(NOW))  # the real launch starts its run
    real = cost_basis([str(data)], True, NOW, proc)
    assert checked == real and real["ledger"]["running_s"] == 600.0 and real["box_started_at"] == iso(NOW - 600)
    assert json.loads((instance_dir / LEDGER).read_text())["first_seen"] == iso(NOW - 600)
    assert json.loads((data / "runs" / ".instance" / LEDGER).read_text())["first_seen"] == iso(NOW - 600)


def test_runs_older_than_the_boot_move_first_seen_but_bill_nothing_before_the_boot(tmp_path, data):
    proc = fake_proc(tmp_path / "proc", NOW - HOUR)
    run_on_box(data, "before-a-restart", iso(NOW - 10 * HOUR))
    basis = cost_basis([str(data)], True, NOW, proc)
    assert basis["box_started_at"] == iso(NOW - 10 * HOUR) and basis["ledger"]["running_s"] == HOUR
    assert basis["box_now"] == iso(NOW)


@pytest.mark.parametrize(
    "garbage", ["yesterday", "", True, [2025], 1e300, float("nan"), "1970-01-02T00:00:00Z", "2999-01-01T00:00:00Z"]
)
def test_a_run_s_garbage_start_is_no_first_seen(tmp_path, data, garbage):
    run_on_box(data, "bad", garbage)
    run_on_box(data, "good", iso(NOW - 2 * HOUR))
    basis = cost_basis([str(data)], False, NOW, fake_proc(tmp_path / "proc", NOW - HOUR))
    assert basis["box_started_at"] == iso(NOW - 2 * HOUR)


def test_runs_in_a_data_dir_that_hangs_leave_the_boot_as_first_seen(tmp_path, data, monkeypatch):
    run_on_box(data, "r1", iso(NOW - 2 * HOUR))
    monkeypatch.setattr(_runs, "_registry_files", lambda data_dir: time.sleep(60))  # a dead mount
    monkeypatch.setattr(_ledger, "RUNS_TIMEOUT_S", 0.5)
    began = time.monotonic()
    basis = cost_basis([str(data)], False, NOW, fake_proc(tmp_path / "proc", NOW - HOUR))
    assert basis["box_started_at"] == iso(NOW - HOUR) and time.monotonic() - began < 10


# --- stops and restarts ----------------------------------------------------------------------------------------


def test_a_stop_ends_the_gpu_cost_and_a_restart_starts_a_new_segment(tmp_path, data):
    cost_basis([str(data)], True, NOW - 9 * HOUR, fake_proc(tmp_path / "boot1", NOW - 10 * HOUR))
    record_stop("autostop", at=iso(NOW - 8 * HOUR), verb="stop", data_dirs=[str(data)])
    proc = fake_proc(tmp_path / "boot2", NOW - 2 * HOUR)  # started again six hours later
    basis = cost_basis([str(data)], True, NOW, proc)
    ledger = basis["ledger"]
    assert ledger["segments"] == [
        {"start": iso(NOW - 10 * HOUR), "end": iso(NOW - 8 * HOUR), "ended_by": "autostop", "running_s": 2 * HOUR},
        {"start": iso(NOW - 2 * HOUR), "end": None, "ended_by": None, "running_s": 2 * HOUR},
    ]
    assert (ledger["running_s"], ledger["segments_total"], ledger["stopped_at"]) == (4 * HOUR, 2, None)
    assert basis["box_started_at"] == iso(NOW - 10 * HOUR) and usd(basis) == 8.0  # not 20.0: 6 h stopped


def test_a_stop_issued_in_this_boot_is_told_and_the_box_that_still_answers_bills_on(tmp_path, data):
    proc = fake_proc(tmp_path / "proc", NOW - 2 * HOUR)
    record_stop("teardown", at=iso(NOW - HOUR), verb="stop", data_dirs=[str(data)])
    ledger = cost_basis([str(data)], False, NOW, proc)["ledger"]
    assert ledger["stopped_at"] == iso(NOW - HOUR) and ledger["running_s"] == 2 * HOUR


def test_a_boot_that_ended_without_a_stop_of_ours_counts_to_when_it_was_last_seen(tmp_path, data):
    boot1 = fake_proc(tmp_path / "boot1", NOW - 10 * HOUR)
    cost_basis([str(data)], True, NOW - 9 * HOUR, boot1)
    cost_basis([str(data)], True, NOW - 7 * HOUR, boot1)  # a patrol tick: seen running then
    ledger = cost_basis([str(data)], True, NOW, fake_proc(tmp_path / "boot2", NOW - HOUR))["ledger"]
    assert ledger["segments"][0] == {
        "start": iso(NOW - 10 * HOUR), "end": iso(NOW - 7 * HOUR), "ended_by": None, "running_s": 3 * HOUR,
    }  # fmt: skip
    assert ledger["running_s"] == 4 * HOUR


def test_a_wiped_home_loses_nothing_the_data_dir_copies_hold(tmp_path, data, instance_dir):
    """RunPod wipes the container disk (home, the instance dir) on every stop and keeps the volume."""
    cost_basis([str(data)], True, NOW - 9 * HOUR, fake_proc(tmp_path / "boot1", NOW - 10 * HOUR))
    record_stop("autostop", at=iso(NOW - 8 * HOUR), data_dirs=[str(data)])
    for name in os.listdir(instance_dir):
        os.unlink(instance_dir / name)
    basis = cost_basis([str(data)], True, NOW, fake_proc(tmp_path / "boot2", NOW - 2 * HOUR))
    assert basis["box_started_at"] == iso(NOW - 10 * HOUR) and basis["ledger"]["running_s"] == 4 * HOUR
    assert json.loads((instance_dir / LEDGER).read_text())["segments"][0]["ended_by"] == "autostop"


def test_copies_merge_earliest_first_seen_and_every_segment(tmp_path, data, instance_dir):
    other = tmp_path / "scratch"
    (other / "runs" / ".instance").mkdir(parents=True)
    register_data_dir(str(other))
    old = {
        "first_seen": iso(NOW - 50 * HOUR),
        "segments": [{"start": iso(NOW - 50 * HOUR), "last_seen": iso(NOW - 49 * HOUR)}],
    }
    (other / "runs" / ".instance" / LEDGER).write_text(json.dumps(old))
    mine = {
        "first_seen": iso(NOW - 3 * HOUR),
        "segments": [{"start": iso(NOW - 3 * HOUR), "last_seen": iso(NOW - HOUR)}],
    }
    (instance_dir / LEDGER).write_text(json.dumps(mine))
    ledger = cost_basis([str(data)], True, NOW, fake_proc(tmp_path / "proc", NOW - 3 * HOUR))["ledger"]
    assert ledger["first_seen"] == iso(NOW - 50 * HOUR) and ledger["running_s"] == 4 * HOUR
    assert [segment["start"] for segment in ledger["segments"]] == [iso(NOW - 50 * HOUR), iso(NOW - 3 * HOUR)]
    for copy in (instance_dir, data / "runs" / ".instance", other / "runs" / ".instance"):
        assert json.loads((copy / LEDGER).read_text())["first_seen"] == iso(NOW - 50 * HOUR)


def test_segments_past_the_bound_fold_into_the_running_time(tmp_path, data, monkeypatch):
    monkeypatch.setattr(_ledger, "MAX_SEGMENTS", 3)
    for boot in range(5):  # five boots of an hour each, an hour apart
        start = NOW - (10 - 2 * boot) * HOUR
        cost_basis([str(data)], True, start + HOUR, fake_proc(tmp_path / f"boot{boot}", start))
    ledger = cost_basis([str(data)], True, NOW - HOUR, fake_proc(tmp_path / "boot4", NOW - 2 * HOUR))["ledger"]
    assert ledger["segments_total"] == 3 and ledger["running_s"] == 5 * HOUR


# --- what cannot be read or written ----------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", ["{not json", "[1]", '{"first_seen": "yesterday", "segments": [7, {"start": 1}]}'])
def test_a_garbage_ledger_is_a_note_or_nothing_and_is_rebuilt(tmp_path, data, instance_dir, garbage):
    (instance_dir / LEDGER).write_text(garbage)
    basis = cost_basis([str(data)], True, NOW, fake_proc(tmp_path / "proc", NOW - HOUR))
    assert basis["ledger"]["running_s"] == HOUR and all("\n" not in note for note in basis["ledger"]["notes"])
    assert json.loads((instance_dir / LEDGER).read_text())["first_seen"] == iso(NOW - HOUR)


def test_a_data_dir_that_hangs_costs_a_note_within_the_deadline(tmp_path, data, monkeypatch):
    monkeypatch.setattr(_stops, "_read_mirror", lambda data_dir, name: time.sleep(60))
    monkeypatch.setattr(_stops, "MIRROR_TIMEOUT_S", 0.5)
    began = time.monotonic()
    basis = cost_basis([str(data)], False, NOW, fake_proc(tmp_path / "proc", NOW - HOUR))
    assert time.monotonic() - began < 10 and basis["ledger"]["running_s"] == HOUR
    assert any("did not answer within 0.5 s" in note for note in basis["ledger"]["notes"])


def test_an_instance_dir_that_cannot_be_made_still_writes_the_data_dir_copy(tmp_path, data, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RGT_INSTANCE_DIR", str(tmp_path / "file" / "instance"))
    basis = cost_basis([str(data)], True, NOW, fake_proc(tmp_path / "proc", NOW - HOUR))
    assert any("cannot be locked" in note for note in basis["ledger"]["notes"])
    assert json.loads((data / "runs" / ".instance" / LEDGER).read_text())["first_seen"] == iso(NOW - HOUR)


def test_no_copy_is_made_in_a_data_dir_without_runs(tmp_path):
    cost_basis([str(tmp_path / "typo")], True, NOW, fake_proc(tmp_path / "proc", NOW - HOUR))
    assert not (tmp_path / "typo").exists()


# --- the gate, and PID 1 -----------------------------------------------------------------------------------------


def test_the_gate_tells_the_ledger_even_when_it_refuses_early_and_writes_nothing(tmp_path, data, monkeypatch):
    run_on_box(data, "r1", iso(NOW - HOUR))
    monkeypatch.setenv("RGT_TEST_BOX_ID", "another-box")
    params = {"data_dir": str(data), "runs": ["r1"], "instance": True, "instance_id": "this-box",
              "instance_id_env": ["RGT_TEST_BOX_ID"]}  # fmt: skip
    result = teardown_gate(params, environ_path=str(tmp_path / "no-environ"), proc=fake_proc(tmp_path / "p", NOW - 5))
    assert (result["passed"], result["step"]) == (False, "instance_id")
    assert result["instance"]["box_started_at"] == iso(NOW - HOUR) and result["instance"]["box_now"].endswith("Z")
    assert result["instance"]["ledger"]["running_s"] < 60  # the boot is 5 s old: the run's hour was another boot
    assert not (data / "runs" / ".instance").exists()


def test_the_container_start_is_btime_plus_pid_1s_start_ticks(tmp_path):
    assert container_started_at(fake_proc(tmp_path / "proc", BTIME + 3600)) == BTIME + 3600


@pytest.mark.parametrize("stat", ["cpu 1 2 3\n", "btime soon\n", "btime 1 2\n", "btime 12\n"])
def test_a_garbage_proc_tree_is_no_container_start(tmp_path, stat):
    assert container_started_at(fake_proc(tmp_path / "proc", NOW - HOUR, stat)) is None
    assert container_started_at(str(tmp_path / "no-proc")) is None


def test_this_machine_s_pid_1_started_in_the_past():
    started = container_started_at()
    assert started is not None and started <= time.time()


# --- the stop record's API ---------------------------------------------------------------------------------------


def test_a_stop_is_recorded_in_the_instance_dir_and_every_known_data_dir(tmp_path, data, instance_dir):
    other = tmp_path / "scratch"
    (other / "runs").mkdir(parents=True)
    register_data_dir(str(other))
    entry, problems = record_stop("teardown", at="2025-03-01T10:00:00+01:00", verb="terminate", data_dirs=[str(data)])
    assert entry == {"at": "2025-03-01T09:00:00Z", "by": "teardown", "verb": "terminate"} and problems == []
    for copy in (instance_dir / STOPS, data / "runs" / ".instance" / STOPS, other / "runs" / ".instance" / STOPS):
        assert json.loads(copy.read_text())["stops"] == [entry]
    os.unlink(instance_dir / STOPS)
    record_stop("autostop", at="2025-03-02T10:00:00Z", data_dirs=[str(data)])
    stops, problems = read_stops([str(data)])
    assert [stop["by"] for stop in stops] == ["teardown", "autostop"] and problems == []


@pytest.mark.parametrize(
    ("by", "at", "verb"), [("", None, None), ("x" * 40, None, None), ("autostop", "soon", None), ("autostop", None, 3)]
)
def test_a_bad_stop_record_is_refused_naming_what(by, at, verb):
    with pytest.raises(ValueError, match=r"^record_stop: (by|at|verb) must be"):
        record_stop(by, at=at, verb=verb)


def test_garbage_stop_entries_are_left_out(instance_dir):
    entries = [
        {"at": "2025-03-01T10:00:00Z", "by": "autostop"},
        {"at": "never", "by": "x"},
        7,
        {"at": "2025-03-01T11:00:00Z"},
    ]
    (instance_dir / STOPS).write_text(json.dumps({"stops": entries}))
    assert read_stops()[0] == [{"at": "2025-03-01T10:00:00Z", "by": "autostop", "verb": None}]
