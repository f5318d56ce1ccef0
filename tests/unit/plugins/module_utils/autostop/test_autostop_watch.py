"""The autostop watcher on a box (issue 22): a real watcher process, installed from AUTOSTOP_MODULES alone, against
a finished run and the fake provider CLI; and the watcher's loop in-process with a fake clock."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_state as state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_watch as watch
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    autostop_armed_path,
    autostop_dir,
    autostop_path,
    patrol_tick_path,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import Provider, make_run, start_runner, train

MODULE_UTILS = Path(watch.__file__).resolve().parent.parent
POD = "pod-1"
SECRET = "rgt-autostop-key-5f1c9e"
VERB = {
    "command": ["runpodctl", "pod", "stop", "{instance_id}"],
    "status": {"command": ["runpodctl", "pod", "get", "{instance_id}"], "state_key": "desiredStatus"},
    "final_states": ["EXITED"],
    "survives": ["data_dir", "durable_dir"],
    "irreversible": False,
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A box (data, durable) holding run r1, DONE, its checkpoint synced and in the manifest."""
    root = tmp_path_factory.mktemp("finished")
    run_dir = make_run(root, [{"name": "a", "command": train("--ckpt-kib", "8")}], name="r1", artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    assert (run_dir / "DONE").exists()
    return root


@pytest.fixture
def box(finished: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished, tmp_path / "box", symlinks=True)
    return tmp_path / "box"


@pytest.fixture
def fake(tmp_path: Path) -> Provider:
    provider = Provider(tmp_path)
    provider.add(POD)
    return provider


def arm(box: Path, **more: Any) -> Dict[str, Any]:
    """armed.json as arming writes it (timings in fractions: the test runs in seconds)."""
    doc = {
        "version": 1, "generation": "a1b2c3d4e5f6", "armed_at": "2030-01-01T00:00:00+00:00",
        "armed_by": {"run": "r1", "launch_id": None}, "data_dir": str(box / "data"),
        "durable_dir": str(box / "durable"), "idle_minutes": 0.02, "controller_silence_hours": None,
        "check_interval_s": 0.3, "gate_retry_max_s": 1.0, "instance_id": POD, "id_env": ["RUNPOD_POD_ID"],
        "env": {"RUNPOD_API_KEY": "BOX_RUNPOD_KEY"}, "platform": "runpod", "verb": VERB, "timeout_s": 10,
        "poll_interval_s": 0.1, "command_timeout_s": 20,
    }  # fmt: skip
    doc.update(more)
    os.makedirs(autostop_dir(str(box / "data")), exist_ok=True)
    write_json_atomic(autostop_armed_path(str(box / "data")), doc, private=True)
    return doc


def environment(fake: Provider) -> Dict[str, str]:
    return dict(
        os.environ,
        PATH=f"{fake.bin}:{os.environ['PATH']}",
        FAKE_PROVIDER_STATE=str(fake.state),
        FAKE_PROVIDER_CALLS=str(fake.calls_file),
        RUNPOD_POD_ID=POD,
        BOX_RUNPOD_KEY=SECRET,
    )


def install(box: Path) -> Path:
    return Path(_run_detach.install_runner(autostop_dir(str(box / "data")), watch.AUTOSTOP_MODULES, watch.WATCH_PY))


STARTED: List[subprocess.Popen[bytes]] = []  # every watcher a test started: none outlives its test


@pytest.fixture(autouse=True)
def no_watcher_left() -> Iterator[None]:
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def start(box: Path, fake: Provider) -> subprocess.Popen[bytes]:
    """The installed watcher: -I -S, so only its own tree and the standard library are importable."""
    argv = [sys.executable, "-I", "-S", str(install(box)), str(box / "data")]
    process = subprocess.Popen(argv, env=environment(fake), cwd=str(box), start_new_session=True)
    STARTED.append(process)
    return process


def decision(box: Path) -> Dict[str, Any]:
    return json.loads(Path(autostop_path(str(box / "data"))).read_text())


def stops(fake: Provider) -> List[List[str]]:
    return [call for call in fake.calls() if call[:3] == ["runpodctl", "pod", "stop"]]


def wait_state(box: Path, wanted: str, timeout_s: float = 30.0) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(autostop_path(str(box / "data"))).exists() and decision(box)["state"] == wanted:
            return decision(box)
        time.sleep(0.05)
    raise AssertionError(f"no {wanted} within {timeout_s} s: {decision(box)}")


def _imports(name: str, seen: set) -> set:
    if name in seen:
        return seen
    seen.add(name)
    for node in ast.walk(ast.parse((MODULE_UTILS / name).read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(watch.PACKAGE):
            module = node.module[len(watch.PACKAGE) + 1 :]
            targets = [f"{module}.{alias.name}" for alias in node.names] if "." not in module else [module]
            for target in targets:
                _imports(target.replace(".", "/") + ".py", seen)
    return seen


def test_autostop_modules_are_exactly_what_the_watcher_imports():
    assert set(watch.AUTOSTOP_MODULES) == _imports("autostop/_autostop_watch.py", set())
    assert len(set(watch.AUTOSTOP_MODULES)) == len(watch.AUTOSTOP_MODULES)


def test_the_watcher_stops_a_finished_box_exactly_once_and_a_second_watcher_only_polls(box, fake):
    arm(box)
    watcher = start(box, fake)
    waiting = wait_state(box, "idle_wait")
    assert state.watcher_alive(str(box / "data")) == (True, watcher.pid)
    assert waiting["gate"]["passed"] is True and waiting["runs"] == [{"run": "r1", "state": "done", "reason": ""}]
    assert waiting["due_at"] and waiting["idle_needed_s"] == pytest.approx(1.2)
    assert watcher.wait(timeout=60) == 0
    assert stops(fake) == [["runpodctl", "pod", "stop", POD]]
    assert fake.instances()[POD]["status"] == "exited"
    done = decision(box)
    assert (done["state"], done["trigger"], done["stop"]["outcome"], done["stop"]["final_state"]) == (
        "stopped", "idle", "stopped", "EXITED",
    )  # fmt: skip
    assert done["stop"]["command"] == ["runpodctl", "pod", "stop", POD] and done["stop"]["attempts"] == 1
    assert [h["state"] for h in done["history"]] == ["idle_wait", "stopping", "stopped"]
    log = Path(state.watch_log_path(str(box / "data"))).read_text().splitlines()
    assert [line.split(" ")[1] for line in log] == ["idle_wait", "stopping", "stopped"]
    assert os.stat(autostop_path(str(box / "data"))).st_mode & 0o777 == 0o600
    assert state.watcher_alive(str(box / "data")) == (False, None)
    # Run again (the same generation): it finds the stop, polls the status, never stops twice.
    again = start(box, fake)
    assert again.wait(timeout=60) == 0
    assert stops(fake) == [["runpodctl", "pod", "stop", POD]] and decision(box)["state"] == "stopped"
    assert fake.calls()[-1] == ["runpodctl", "pod", "get", POD]
    for path in (autostop_path(str(box / "data")), state.watch_log_path(str(box / "data"))):
        assert SECRET not in Path(path).read_text()


def test_a_durable_copy_corrupted_after_done_fails_the_gate_and_never_stops(box, fake):
    checkpoint = next((box / "durable").rglob("best.pth"))
    checkpoint.write_bytes(checkpoint.read_bytes() + b"x")
    arm(box)
    watcher = start(box, fake)
    try:
        failed = wait_state(box, "gate_failed")
        assert failed["gate"]["passed"] is False and failed["gate"]["step"] == "durable"
        assert failed["reason"].startswith(
            "gate failed at durable: run r1: durable copy does not match: cells/a/best.pth"
        )
        time.sleep(2.0)  # several retries (0.3 s, 0.6 s, then every 1 s)
        assert decision(box)["state"] == "gate_failed" and watcher.poll() is None
    finally:
        watcher.kill()
        watcher.wait()
    assert fake.calls() == []


def test_a_fresh_watcher_that_finds_stopping_polls_the_status_and_never_stops_again(box, fake):
    doc = arm(box)
    fake.add(POD, "--status", "exited")
    issued = {"issued_at": "2030-01-01T00:00:00+00:00", "command": ["runpodctl", "pod", "stop", POD], "attempts": 1}
    write_json_atomic(
        autostop_path(str(box / "data")),
        {"version": 1, "generation": doc["generation"], "state": "stopping", "reason": "running", "stop": issued},
    )
    assert start(box, fake).wait(timeout=60) == 0
    assert fake.calls() == [["runpodctl", "pod", "get", POD]]
    done = decision(box)
    assert (done["state"], done["stop"]["final_state"]) == ("stopped", "EXITED")
    assert done["reason"].startswith("the stop issued at 2030-01-01T00:00:00+00:00 took effect")


def test_a_watcher_restarted_on_a_box_running_again_never_stops_it_again(box, fake):
    # The box was stopped, then started again by hand: this arming has had its stop.
    doc = arm(box)
    write_json_atomic(
        autostop_path(str(box / "data")),
        {"version": 1, "generation": doc["generation"], "state": "stopped", "reason": "stopped", "stop": {}},
    )
    watcher = start(box, fake)
    try:
        seen = wait_state(box, "unconfirmed")
        assert "not issuing another (at most once per arming; arm again to stop it again)" in seen["reason"]
        time.sleep(1.0)
        assert stops(fake) == [] and fake.instances()[POD]["status"] == "running"
    finally:
        watcher.kill()
        watcher.wait()


def test_a_disarmed_arming_ends_the_watcher_and_says_so(box, fake):
    arm(box, disarmed=True)
    assert start(box, fake).wait(timeout=60) == 0
    assert (decision(box)["state"], decision(box)["reason"]) == ("disarmed", "disarmed: armed.json says so")
    assert fake.calls() == []


def test_a_second_watcher_leaves_the_box_to_the_first(box, fake):
    arm(box, idle_minutes=10)
    first = start(box, fake)
    try:
        wait_state(box, "idle_wait")
        assert start(box, fake).wait(timeout=30) == 0
        assert state.watcher_alive(str(box / "data")) == (True, first.pid) and first.poll() is None
    finally:
        first.kill()
        first.wait()


# --- the loop in-process: a fake monotonic clock, a wall clock that jumps ------------------------------------------


class Clocks:
    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1_900_000_000.0

    def sleep(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


@pytest.fixture
def loop(box, fake, monkeypatch):
    """A Watcher on ``box`` with fake clocks; the fake provider on PATH, the box's key in the environment."""
    for name, value in environment(fake).items():
        monkeypatch.setenv(name, value)
    clocks = Clocks()
    watcher = watch.Watcher(
        str(box / "data"), clock=lambda: clocks.mono, wall=lambda: clocks.wall, sleep=clocks.sleep,
        environ_path=str(box / "no-pid1-environ"),
    )  # fmt: skip
    return watcher, clocks


def test_a_wall_clock_jump_changes_nothing(box, loop):
    watcher, clocks = loop
    arm(box, idle_minutes=1)
    assert watcher.iteration() is False and decision(box)["state"] == "idle_wait"
    clocks.wall += 10 * 3600  # NTP steps the clock forward 10 h
    watcher.iteration()
    clocks.wall -= 20 * 3600  # and back 20 h
    watcher.iteration()
    seen = decision(box)
    assert seen["state"] == "idle_wait" and seen["idle_s"] < 5 and seen["idle_s"] == pytest.approx(0.6, abs=0.01)


def test_a_tick_restarts_the_dead_man_clock(box, loop):
    watcher = loop[0]
    arm(box, idle_minutes=None, controller_silence_hours=0.001)  # 3.6 s
    for tick in range(1, 30):
        write_json_atomic(patrol_tick_path(str(box / "data")), {"at": "2030-01-01T00:00:00Z", "tick": tick})
        watcher.iteration()
        assert decision(box)["state"] == "silence_wait"
    assert any(watcher.iteration() for _look in range(100))
    done = decision(box)
    assert (done["state"], done["trigger"]) == ("stopped", "controller_silence")


def test_a_failing_stop_command_is_tried_three_times_then_given_up(box, loop, fake):
    watcher = loop[0]
    fake.add(POD, "--behaviour", "fail")
    arm(box, idle_minutes=0)
    for _look in range(40):
        watcher.iteration()
    assert len(stops(fake)) == 3
    given_up = decision(box)
    assert given_up["state"] == "failed" and given_up["reason"].startswith("gave up after 3 attempts: ")
    assert "internal server error" in given_up["reason"] and given_up["stop"]["outcome"] == "failed"
    # A new generation (armed again) may try again.
    arm(box, idle_minutes=0, generation="0123456789ab")
    watcher.iteration()
    assert len(stops(fake)) == 4


def test_a_stop_that_never_reaches_a_final_state_is_unconfirmed_and_only_polled(box, loop, fake):
    watcher = loop[0]
    fake.add(POD, "--behaviour", "sticky")
    arm(box, idle_minutes=0, timeout_s=0.3)
    for _look in range(10):
        watcher.iteration()
    assert len(stops(fake)) == 1
    seen = decision(box)
    assert seen["state"] == "unconfirmed" and seen["stop"]["outcome"] == "unconfirmed"
    assert "not issuing another" in seen["reason"]


def test_a_box_armed_for_a_run_not_started_yet_waits_for_it(box, loop, fake):
    watcher = loop[0]
    arm(box, idle_minutes=0, armed_by={"run": "r2", "launch_id": None})
    for _look in range(5):
        watcher.iteration()
    seen = decision(box)
    assert seen["state"] == "waiting" and seen["reason"].startswith("run r2 is not DONE (it armed autostop")
    assert fake.calls() == []


def test_the_stop_command_gets_the_box_key_by_its_command_name_and_never_shows_it(tmp_path, monkeypatch):
    environ = tmp_path / "pid1-environ"
    environ.write_bytes(b"PATH=/bin\0BOX_RUNPOD_KEY=" + SECRET.encode() + b"\0")
    monkeypatch.delenv("BOX_RUNPOD_KEY", raising=False)
    armed = state.Armed(generation="g", env=(("RUNPOD_API_KEY", "BOX_RUNPOD_KEY"), ("OTHER", "UNSET_VAR")))
    env, secrets, missing = watch.stop_env(armed, str(environ))
    assert env["RUNPOD_API_KEY"] == SECRET and secrets == [SECRET] and missing == ["UNSET_VAR"]
    printer = [sys.executable, "-c", "import os; print('key=' + os.environ['RUNPOD_API_KEY'])"]
    assert watch.env_runner(env, secrets)(printer, 30) == (0, "key=***\n", "")
    assert watch.env_runner(env, secrets)([sys.executable, "-c", "import time; time.sleep(30)"], 0.3)[0] == 124
