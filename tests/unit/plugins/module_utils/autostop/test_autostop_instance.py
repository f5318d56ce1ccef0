"""The autostop watcher judges the whole instance (issue 29): a run in another data dir (registered by a launch, or
named only by its processes' marker), a GPU job started by hand, a teardown holding the box (also one that took it
between the gate and the stop), an archived run the stop keeps, and a failed cell under the dead-man. Real runs,
real processes, the fake provider CLI; the watcher's loop in-process with fake clocks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Pattern

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_watch as watch
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state as box_state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import GPU_DEVICE
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._stops import read_stops
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._archive import archive_runs
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.module_utils.autostop.test_autostop_watch import (
    POD,
    VERB,
    Clocks,
    arm,
    decision,
    environment,
    stops,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    Provider,
    kill_session,
    make_run,
    start_runner,
    train,
    wait_for,
)

HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(120)"
KEEPS_NOTHING = dict(VERB, survives=[])
MakeWatcher = Callable[..., watch.Watcher]


def done_run(root: Path, name: str, cells: Optional[List[Dict[str, Any]]] = None, rc: int = 0) -> Path:
    """``<root>/data/runs/<name>`` run to its end (a checkpoint per succeeded cell, synced to ``<root>/durable``):
    DONE, or with ``rc`` 1 a cell failed and the runner ended without DONE."""
    run_dir = make_run(
        root, cells or [{"name": "a", "command": train("--ckpt-kib", "8")}], name=name, artifacts=["best.pth"]
    )
    assert start_runner(run_dir).wait(timeout=60) == rc
    assert (run_dir / "DONE").exists() is (rc == 0)
    return run_dir


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A box (data, durable) whose run r1 is DONE, its checkpoint synced and in the manifest."""
    root = tmp_path_factory.mktemp("finished")
    done_run(root, "r1")
    return root


@pytest.fixture(scope="module")
def failed_cell(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A box whose run r1 ended with cell a secured and cell b failed (exit 3): no DONE."""
    root = tmp_path_factory.mktemp("failed")
    cells = [{"name": "a", "command": train("--ckpt-kib", "8")}, {"name": "b", "command": train("--exit", "3")}]
    done_run(root, "r1", cells, rc=1)
    return root


@pytest.fixture(scope="module")
def with_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A box with r1 DONE and r0 DONE, verified, then archived (run_archive)."""
    root = tmp_path_factory.mktemp("archived")
    done_run(root, "r0")
    done_run(root, "r1")
    archived = archive_runs({"data_dir": str(root / "data"), "run": "r0"}, check_mode=False)
    assert archived["runs"][0]["state"] == "archived"
    return root


@pytest.fixture
def fake(tmp_path: Path) -> Provider:
    provider = Provider(tmp_path)
    provider.add(POD)
    return provider


@pytest.fixture
def copy(tmp_path: Path) -> Callable[[Path], Path]:
    def made(source: Path) -> Path:
        subprocess.run(["cp", "-a", str(source), str(tmp_path / "box")], check=True)
        return tmp_path / "box"

    return made


@pytest.fixture
def box(finished: Path, copy: Callable[[Path], Path]) -> Path:
    return copy(finished)


@pytest.fixture
def watcher(fake: Provider, monkeypatch: pytest.MonkeyPatch) -> MakeWatcher:
    """``watcher(box, device=GPU_DEVICE)``: a Watcher of ``box/data`` with fake clocks, the fake provider on PATH."""
    for name, value in environment(fake).items():
        monkeypatch.setenv(name, value)

    def made(box: Path, device: Pattern[str] = GPU_DEVICE) -> watch.Watcher:
        clocks = Clocks()
        return watch.Watcher(
            str(box / "data"), clock=lambda: clocks.mono, wall=lambda: clocks.wall, sleep=clocks.sleep,
            environ_path=str(box / "no-pid1-environ"), gpu_device=device,
        )  # fmt: skip

    return made


@pytest.fixture
def sessions() -> Iterator[List[int]]:
    started: List[int] = []
    yield started
    for sid in started:
        kill_session(sid)


def look(watcher: watch.Watcher, times: int) -> bool:
    """``times`` iterations of the loop (fewer when it ends); True when it ended."""
    return any(watcher.iteration() for _look in range(times))


# --- 1. every data dir of the box -------------------------------------------------------------------------------


@pytest.mark.parametrize("known_by", ["registry", "marker"])
def test_a_live_run_in_another_data_dir_holds_the_stop(box, watcher, fake, sessions, known_by):
    scratch = box.parent / "scratch"
    r2 = make_run(scratch, [{"name": "a", "command": train("--forever", "--step-s", "0.05")}], name="r2")
    if known_by == "registry":  # what launch writes
        box_state.register_data_dir(str(scratch / "data"), str(scratch / "durable"))
    runner = start_runner(r2, env={"RGT_RUN_DIR": str(r2)} if known_by == "marker" else None)
    sessions.append(runner.pid)
    wait_for((r2 / "run.json").exists, 30, "r2's run.json")
    arm(box, idle_minutes=0)
    assert look(watcher(box), 5) is False
    seen = decision(box)
    assert seen["state"] == "waiting" and seen["reason"].startswith(f"run r2 in {scratch / 'data'} is live (")
    assert {"run": "r2", "state": "live", "data_dir": str(scratch / "data")}.items() <= seen["runs"][1].items()
    assert stops(fake) == [] and fake.calls() == []


def test_the_gate_judges_the_runs_of_every_data_dir(finished, copy, watcher, fake, tmp_path):
    box = copy(finished)
    scratch = tmp_path / "scratch"
    done_run(scratch, "r2")
    box_state.register_data_dir(str(scratch / "data"), str(scratch / "durable"))
    checkpoint = next((scratch / "durable").rglob("best.pth"))
    checkpoint.write_bytes(checkpoint.read_bytes() + b"x")
    arm(box, idle_minutes=0)
    assert look(watcher(box), 5) is False
    seen = decision(box)
    assert seen["state"] == "gate_failed" and seen["gate"]["step"] == "durable"
    assert seen["reason"].startswith(
        f"gate failed at durable: data_dir {scratch / 'data'}: run r2: durable copy does not match: cells/a/best.pth"
    )
    assert fake.calls() == []


# --- 2. a GPU job outside any run --------------------------------------------------------------------------------


def test_a_gpu_job_started_by_hand_holds_the_stop_and_is_named(finished, copy, watcher, fake, tmp_path):
    box = copy(finished)
    device = tmp_path / "nvidia0"
    device.write_text("")
    pattern = re.compile(rf"^{re.escape(str(tmp_path))}/nvidia(?P<index>[0-9]+)$")
    job = subprocess.Popen([sys.executable, "-c", HOLD, str(device)], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        arm(box, idle_minutes=0)
        looking = watcher(box, pattern)
        assert look(looking, 5) is False
        seen = decision(box)
        assert seen["state"] == "waiting"
        assert re.fullmatch(
            rf"a process outside any run uses a GPU: pid {job.pid} \S+ \(GPU 0\); a stop would kill it", seen["reason"]
        )
        log = Path(box / "data" / "runs" / ".autostop" / "watch.log").read_text()
        assert f"pid {job.pid} " in log and stops(fake) == []
    finally:
        job.kill()
        job.wait()
    assert look(looking, 10) is True and stops(fake) == [["runpodctl", "pod", "stop", POD]]


# --- 3. a stage holding the box ----------------------------------------------------------------------------------


def test_a_teardown_holding_the_box_holds_the_stop_and_the_stop_is_recorded(finished, copy, watcher, fake):
    box = copy(finished)
    arm(box, idle_minutes=0, armed_by={"run": "r9", "launch_id": None})  # r9 is starting
    looking = watcher(box)
    assert look(looking, 2) is False and decision(box)["reason"].startswith("run r9 is not DONE")
    assert box_state.take_lease("teardown", "td-1", 600) is None
    arm(box, idle_minutes=0)
    assert look(looking, 5) is False
    seen = decision(box)
    assert seen["state"] == "waiting" and re.fullmatch(
        r"teardown holds the box since \d\d:\d\d \(until \d\d:\d\d UTC\): no stop while it does", seen["reason"]
    )
    assert fake.calls() == []
    # Each new reason to wait is a line of watch.log, though the state stays waiting.
    log = Path(box / "data" / "runs" / ".autostop" / "watch.log").read_text().splitlines()
    assert [line.split(" ", 2)[2][:24] for line in log] == ["run r9 is not DONE (it a", "teardown holds the box s"]
    assert box_state.release_lease("td-1") is True
    assert look(looking, 10) is True and stops(fake) == [["runpodctl", "pod", "stop", POD]]
    assert decision(box)["state"] == "stopped"
    recorded, problems = read_stops([str(box / "data")])
    assert [(stop["by"], stop["verb"]) for stop in recorded] == [("autostop", "stop")] and problems == []


def test_a_lease_taken_between_the_gate_and_the_stop_holds_the_stop(finished, copy, watcher, fake, monkeypatch):
    box = copy(finished)
    real_gate = watch.run_gate

    def gate_then_teardown(*args: Any) -> Dict[str, Any]:
        verdict = real_gate(*args)
        box_state.take_lease("teardown", "td-2", 600)  # teardown starts while the gate hashed the copies
        return verdict

    monkeypatch.setattr(watch, "run_gate", gate_then_teardown)
    arm(box, idle_minutes=0)
    assert look(watcher(box), 3) is False
    seen = decision(box)
    assert seen["gate"]["passed"] is True and seen["state"] == "waiting"
    assert seen["reason"].startswith("teardown holds the box since ")
    assert fake.calls() == [] and seen["stop"] is None
    assert read_stops([str(box / "data")])[0] == []


# --- 4. what the stop keeps --------------------------------------------------------------------------------------


def test_an_archived_run_blocks_no_stop_that_keeps_the_disk(with_archive, copy, watcher, fake):
    box = copy(with_archive)
    arm(box, idle_minutes=0)
    assert look(watcher(box), 10) is True
    assert decision(box)["state"] == "stopped" and stops(fake) == [["runpodctl", "pod", "stop", POD]]


def test_an_archived_run_blocks_a_stop_that_loses_its_scratch(with_archive, copy, watcher, fake):
    box = copy(with_archive)
    arm(box, idle_minutes=0, verb=KEEPS_NOTHING)
    assert look(watcher(box), 5) is False
    seen = decision(box)
    assert seen["state"] == "gate_failed" and seen["gate"]["step"] == "other_runs"
    assert re.search(r"run r0 \(as \.archive/r0-\d{8}T\d{6}Z\): archived, would lose ", seen["reason"])
    assert fake.calls() == []


# --- 12. a failed cell under the dead-man ----------------------------------------------------------------------


def test_the_dead_man_stops_a_box_whose_failed_cell_the_stop_keeps_and_says_why(failed_cell, copy, watcher, fake):
    box = copy(failed_cell)
    arm(box, idle_minutes=None, controller_silence_hours=0.0005)  # 1.8 s
    assert look(watcher(box), 100) is True
    done = decision(box)
    assert (done["state"], done["trigger"]) == ("stopped", "controller_silence")
    assert stops(fake) == [["runpodctl", "pod", "stop", POD]]
    stopping = next(h for h in done["history"] if h["state"] == "stopping")
    assert re.fullmatch(
        r"dead-man: patrol silent \S+ s; run r1 has a failed cell \(b\), kept on the disk the stop keeps: "
        rf"running runpodctl pod stop {POD}",
        stopping["reason"],
    )


@pytest.mark.parametrize(
    "case",
    [
        ({"idle_minutes": 0}, ("waiting", "run r1 is not DONE (its runner ended without DONE)")),
        (
            {"idle_minutes": None, "controller_silence_hours": 0.0005, "verb": KEEPS_NOTHING},
            ("gate_failed", "gate failed at cells: run r1: cells not done: b (failed, exit 3)"),
        ),
    ],
    ids=["idle", "dead-man-verb-keeps-nothing"],
)
def test_a_failed_cell_holds_an_idle_stop_and_a_stop_that_loses_it(failed_cell, copy, watcher, fake, case):
    timers, held = case
    box = copy(failed_cell)
    arm(box, **timers)
    assert look(watcher(box), 60) is False
    seen = decision(box)
    assert (seen["state"], seen["reason"][: len(held[1])]) == held and fake.calls() == []
