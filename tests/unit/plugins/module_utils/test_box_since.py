"""Since when a box bills: its runs' earliest start, never before the container's (PID 1's) start, and garbage in
either read as unknown, never as a time; a data_dir that hangs leaves the container's start. The proc tree is a fake
one where the real one cannot be set."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box import _box_since
from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._box_since import (
    box_started_at,
    container_started_at,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import CLOCK_TICKS
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate

BOOT = 1_700_000_000  # 2023-11-14T22:13:20Z
CONTAINER = "2023-11-14T22:15:00Z"  # the default fake PID 1: 100 s after BOOT


def run_on_box(data_dir: Path, name: str, started_at: Any) -> None:
    (data_dir / "runs" / name).mkdir(parents=True)
    (data_dir / "runs" / name / "run.json").write_text(
        json.dumps({"run": name, "pgid": 4242, "started_at": started_at})
    )


def fake_proc(root: Path, start_ticks: Any = 100 * CLOCK_TICKS, stat: str = f"cpu 1 2 3\nbtime {BOOT}\n") -> str:
    """A proc tree whose PID 1 started ``start_ticks`` (stat field 22) after a boot at BOOT."""
    (root / "1").mkdir(parents=True)
    fields = ["S", "0", "1", "1"] + ["0"] * 15 + [str(start_ticks)] + ["0"] * 10
    (root / "1" / "stat").write_text(f"1 (my init) {' '.join(fields)}\n")
    (root / "stat").write_text(stat)
    return str(root)


@pytest.fixture
def local_tz(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def use(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield use
    monkeypatch.undo()
    time.tzset()


def test_the_container_start_is_btime_plus_pid_1s_start_ticks(tmp_path: Path) -> None:
    assert container_started_at(fake_proc(tmp_path / "proc", 3600 * CLOCK_TICKS)) == BOOT + 3600


def test_the_earliest_given_run_start_counts_when_the_container_started_before_it(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", 60 * CLOCK_TICKS)
    runs = [Run("b", "/x/b", started_at=BOOT + 7200.0), Run("a", "/x/a", started_at=BOOT + 3600.0), Run("c", "/x/c")]
    assert box_started_at("/x", runs, proc) == "2023-11-14T23:13:20Z"


def test_a_box_started_again_bills_from_the_containers_start_not_its_old_runs(tmp_path: Path) -> None:
    """Runs from before a stop keep their started_at on the volume; the stopped hours were not billed."""
    proc = fake_proc(tmp_path / "proc", 10 * 3600 * CLOCK_TICKS)
    assert box_started_at("/x", [Run("old", "/x/old", started_at=BOOT + 60.0)], proc) == "2023-11-15T08:13:20Z"


def test_without_runs_the_container_start_without_either_none(tmp_path: Path) -> None:
    assert box_started_at("/x", [], fake_proc(tmp_path / "proc")) == CONTAINER
    assert box_started_at("/x", [], str(tmp_path / "no-proc")) is None


@pytest.mark.parametrize("garbage", [1e300, float("nan"), float("inf"), 12.0, time.time() + 3 * 86400])
def test_a_given_run_s_garbage_start_is_skipped(tmp_path: Path, garbage: float) -> None:
    runs = [Run("bad", "/x/bad", started_at=garbage), Run("good", "/x/good", started_at=1_740_823_200.0)]
    assert box_started_at("/x", runs, str(tmp_path / "no-proc")) == "2025-03-01T10:00:00Z"


def test_the_earliest_run_start_on_the_box_wins_and_offsets_are_honoured(tmp_path: Path) -> None:
    data = tmp_path / "data"
    run_on_box(data, "r1", "2025-03-01T10:00:00.123456+00:00")
    run_on_box(data, "r2", "2025-03-01T09:00:00+01:00")  # 08:00 UTC: the earliest
    run_on_box(data, "r3", "2025-03-01T09:30:00Z")
    assert box_started_at(str(data), proc=fake_proc(tmp_path / "proc")) == "2025-03-01T08:00:00Z"


def test_a_start_without_an_offset_is_the_box_s_local_time(tmp_path: Path, local_tz: Any) -> None:
    local_tz("Etc/GMT-2")  # POSIX sign: two hours east of UTC
    run_on_box(tmp_path / "data", "r1", "2025-03-01T10:00:00")
    assert box_started_at(str(tmp_path / "data"), proc=str(tmp_path / "no-proc")) == "2025-03-01T08:00:00Z"


def test_epoch_seconds_are_a_start_too(tmp_path: Path) -> None:
    run_on_box(tmp_path / "data", "r1", 1_740_816_000)
    assert box_started_at(str(tmp_path / "data"), proc=str(tmp_path / "no-proc")) == "2025-03-01T08:00:00Z"


@pytest.mark.parametrize(
    "garbage", ["yesterday", "", "9" * 200, True, None, [2025], {"at": 1}, 1e300, float("nan"), "1970-01-02T00:00:00Z"]
)
def test_a_garbage_start_on_the_box_is_skipped_for_the_next_run_s(tmp_path: Path, garbage: Any) -> None:
    data = tmp_path / "data"
    run_on_box(data, "bad", garbage)
    run_on_box(data, "good", "2025-03-01T10:00:00Z")
    assert box_started_at(str(data), proc=str(tmp_path / "no-proc")) == "2025-03-01T10:00:00Z"


def test_a_start_far_in_the_future_is_garbage(tmp_path: Path) -> None:
    run_on_box(tmp_path / "data", "r1", "2999-01-01T00:00:00Z")
    assert box_started_at(str(tmp_path / "data"), proc=fake_proc(tmp_path / "proc")) == CONTAINER


def test_no_run_and_an_unreadable_run_json_fall_back_to_the_container_start(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc")
    assert box_started_at(str(tmp_path / "nowhere"), proc=proc) == CONTAINER
    (tmp_path / "data" / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "data" / "runs" / "r1" / "run.json").write_bytes(b"\xff{not json")
    (tmp_path / "data" / "runs" / ".autostop").mkdir()  # never a run
    assert box_started_at(str(tmp_path / "data"), proc=proc) == CONTAINER


def test_a_date_past_year_9999_in_local_time_is_no_traceback(tmp_path: Path, local_tz: Any) -> None:
    local_tz("Etc/GMT+2")  # two hours west: 9999-12-31T23:59:59 local is past datetime's range in UTC
    run_on_box(tmp_path / "data", "r1", "9999-12-31T23:59:59")
    assert box_started_at(str(tmp_path / "data"), proc=fake_proc(tmp_path / "proc")) == CONTAINER


def test_a_run_json_nested_past_the_stack_is_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "data" / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "data" / "runs" / "r1" / "run.json").write_text("[" * 200_000 + "]" * 200_000)
    assert box_started_at(str(tmp_path / "data"), proc=fake_proc(tmp_path / "proc")) == CONTAINER


def test_a_data_dir_that_hangs_falls_back_to_the_container_start(tmp_path: Path, monkeypatch) -> None:
    run_on_box(tmp_path / "data", "r1", "2025-03-01T10:00:00Z")
    monkeypatch.setattr(
        _runs, "_registry_files", lambda data_dir: time.sleep(60)
    )  # the child blocks, as on a dead mount
    monkeypatch.setattr(_box_since, "START_TIMEOUT_S", 0.5)
    began = time.monotonic()
    assert box_started_at(str(tmp_path / "data"), proc=fake_proc(tmp_path / "proc")) == CONTAINER
    assert time.monotonic() - began < 10


@pytest.mark.parametrize(
    ("ticks", "stat"),
    [
        (100, "cpu 1 2 3\n"),  # no btime
        (100, "btime soon\n"),
        (100, "btime 1 2\n"),
        ("x", f"btime {BOOT}\n"),
        (-5, f"btime {BOOT}\n"),
        (10**30, f"btime {BOOT}\n"),  # far beyond now
        (100, "btime 12\n"),  # 1970: a broken clock
    ],
)
def test_a_garbage_proc_tree_is_no_container_start(tmp_path: Path, ticks: Any, stat: str) -> None:
    proc = fake_proc(tmp_path / "proc", ticks, stat)
    assert container_started_at(proc) is None
    assert box_started_at(str(tmp_path / "nowhere"), proc=proc) is None


def test_a_missing_proc_tree_is_no_container_start(tmp_path: Path) -> None:
    assert container_started_at(str(tmp_path / "no-proc")) is None


def test_this_machine_s_pid_1_started_in_the_past() -> None:
    started = container_started_at()
    assert started is not None and started <= time.time()


def gate_params(data_dir: Path) -> dict:
    return {
        "data_dir": str(data_dir),
        "runs": ["r1"],
        "instance": True,
        "instance_id": "this-box",
        "instance_id_env": ["RGT_TEST_BOX_ID"],
    }


def test_the_gate_tells_the_box_start_even_when_it_refuses_early(tmp_path: Path, monkeypatch) -> None:
    run_on_box(tmp_path / "data", "r1", "2025-03-01T10:00:00Z")
    monkeypatch.setenv("RGT_TEST_BOX_ID", "another-box")
    params = gate_params(tmp_path / "data")
    result = teardown_gate(params, environ_path=str(tmp_path / "no-environ"), proc=str(tmp_path / "no-proc"))
    assert (result["passed"], result["step"]) == (False, "instance_id")
    assert result["instance"]["box_started_at"] == "2025-03-01T10:00:00Z"
    started = datetime.fromisoformat(result["instance"]["box_started_at"].replace("Z", "+00:00"))
    assert started == datetime(2025, 3, 1, 10, tzinfo=timezone.utc)


def test_the_gate_bills_a_box_started_again_from_its_container_not_its_old_runs(tmp_path: Path, monkeypatch) -> None:
    run_on_box(tmp_path / "data", "r1", "2025-03-01T10:00:00Z")
    monkeypatch.setenv("RGT_TEST_BOX_ID", "another-box")
    proc = fake_proc(tmp_path / "proc", 0, "btime 1745000000\n")  # the container started after the run
    result = teardown_gate(gate_params(tmp_path / "data"), environ_path=str(tmp_path / "no-environ"), proc=proc)
    assert result["instance"]["box_started_at"] == "2025-04-18T18:13:20Z"
