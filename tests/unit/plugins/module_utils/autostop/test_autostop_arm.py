"""Arming the box's autostop: what it checks on the box, what armed.json holds, when it changes, check mode, disarm.

The watcher's start is replaced by a stand-in that holds watch.lock as a live watcher does (the real watcher runs in
``test_autostop_arm_watcher.py``); the platform's variables come from this process's environment or from a file
standing in for PID 1's environment.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_arm
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_arm import (
    AutostopRefused,
    arm,
    disarm,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_state import watcher_alive
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state as box_state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    autostop_armed_path,
    autostop_dir,
    autostop_path,
)

KEY_VALUE = "rpa_SECRETVALUE0123456789abcdef"
POD = "pod-abc123"


def runpod_verb() -> Dict[str, Any]:
    """The runpod profile's self_stop verb, as the lead's group_vars declare it."""
    return {
        "command": ["runpodctl", "pod", "stop", "{instance_id}"],
        "status": {"command": ["runpodctl", "pod", "get", "{instance_id}"], "state_key": "desiredStatus"},
        "final_states": ["EXITED"],
        "survives": ["data_dir", "durable_dir"],
        "irreversible": False,
    }


@pytest.fixture
def box(tmp_path: Path, provider: Any, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    """A data dir, a durable dir, runpodctl on PATH, the pod's id and key in this environment, an empty stand-in
    for PID 1's environment, and a watcher stand-in: it takes watch.lock (as the real one does) and records it."""
    data, durable = tmp_path / "data", tmp_path / "durable"
    (data / "runs").mkdir(parents=True)
    durable.mkdir()
    pid1 = tmp_path / "pid1-environ"
    pid1.write_bytes(b"PATH=/usr/bin\0")
    monkeypatch.setenv("RUNPOD_POD_ID", POD)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY_VALUE)
    started: List[int] = []
    held: List[int] = []

    def fake_start(data_dir: str) -> int:
        while held:  # an earlier stand-in has ended
            os.close(held.pop())
        fd = os.open(os.path.join(autostop_dir(data_dir), "watch.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, b"424242")
        held.append(fd)
        started.append(424242)
        return 424242

    monkeypatch.setattr(_autostop_arm, "start_watcher", fake_start)
    yield {"data": str(data), "durable": str(durable), "pid1": str(pid1), "started": started}
    for fd in held:
        os.close(fd)


def params(box: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
    base = {
        "data_dir": box["data"],
        "durable_dir": box["durable"],
        "run": "r1",
        "launch_id": "20261204T101500Z-3fa9c2",
        "idle_minutes": 30.0,
        "controller_silence_hours": None,
        "platform": "runpod",
        "id_env": ["RUNPOD_POD_ID"],
        "env": {"RUNPOD_API_KEY": "RUNPOD_API_KEY"},
        "verb": runpod_verb(),
    }
    return dict(base, **extra)


def armed(box: Dict[str, Any]) -> Dict[str, Any]:
    return json.loads(Path(autostop_armed_path(box["data"])).read_text())


def test_arming_writes_armed_json_with_names_only_and_starts_one_watcher(box):
    result = arm(params(box), False, box["pid1"])

    document = armed(box)
    assert result["armed"] is True and result["changed"] is True and result["state"] == "armed"
    assert result["watcher_started"] is True and result["watcher_pid"] == 424242 and box["started"] == [424242]
    assert result["instance_id"] == POD and result["command"] == f"runpodctl pod stop {POD}"
    assert result["generation"] == document["generation"] and len(document["generation"]) == 12
    assert document["verb"]["command"] == ["runpodctl", "pod", "stop", POD]
    assert document["verb"]["status"]["command"] == ["runpodctl", "pod", "get", POD]
    assert document["env"] == {"RUNPOD_API_KEY": "RUNPOD_API_KEY"} and document["id_env"] == ["RUNPOD_POD_ID"]
    assert document["armed_by"] == {"run": "r1", "launch_id": "20261204T101500Z-3fa9c2"}
    assert document["idle_minutes"] == 30.0 and document["controller_silence_hours"] is None
    assert document["check_interval_s"] == 60.0 and document["gate_retry_max_s"] == 1800.0
    assert stat.S_IMODE(os.stat(autostop_armed_path(box["data"])).st_mode) == 0o600
    # The key's value is nowhere: not in the file, not in the result.
    assert KEY_VALUE not in Path(autostop_armed_path(box["data"])).read_text()
    assert KEY_VALUE not in json.dumps(result)
    assert watcher_alive(box["data"]) == (True, 424242)


def test_arming_twice_changes_nothing(box):
    first = arm(params(box), False, box["pid1"])
    before = Path(autostop_armed_path(box["data"])).read_bytes()

    second = arm(params(box, run="r2", launch_id="other"), False, box["pid1"])

    assert second["changed"] is False and second["armed"] is True
    assert second["generation"] == first["generation"]
    assert second["watcher_started"] is False and second["watcher_pid"] == 424242
    assert box["started"] == [424242]  # no second watcher
    assert Path(autostop_armed_path(box["data"])).read_bytes() == before
    assert second["reason"].startswith("already armed the same way")


def test_a_changed_configuration_is_a_new_generation(box):
    first = arm(params(box), False, box["pid1"])

    second = arm(params(box, idle_minutes=45.0, controller_silence_hours=6.0), False, box["pid1"])

    assert second["changed"] is True and second["generation"] != first["generation"]
    assert armed(box)["generation"] == second["generation"] and armed(box)["idle_minutes"] == 45.0
    assert "idle_minutes, controller_silence_hours changed" in second["reason"]
    assert box["started"] == [424242]  # the live watcher re-reads armed.json itself


def test_a_missing_key_is_refused_by_name_and_nothing_is_written(box, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY")

    with pytest.raises(AutostopRefused) as refused:
        arm(params(box), False, box["pid1"])

    message = str(refused.value)
    assert message.startswith("autostop: RUNPOD_API_KEY is not set on this box")
    assert box["pid1"] in message and "\n" not in message
    assert not os.path.exists(autostop_dir(box["data"])) and box["started"] == []


def test_a_key_only_pid_1_holds_is_found_and_never_written(box, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY")
    monkeypatch.delenv("RUNPOD_POD_ID")
    Path(box["pid1"]).write_bytes(f"RUNPOD_POD_ID={POD}\0RUNPOD_API_KEY={KEY_VALUE}\0".encode())

    result = arm(params(box), False, box["pid1"])

    assert result["armed"] is True and result["instance_id"] == POD
    assert KEY_VALUE not in Path(autostop_armed_path(box["data"])).read_text()


def test_a_box_without_its_own_id_is_refused(box, monkeypatch):
    monkeypatch.delenv("RUNPOD_POD_ID")

    with pytest.raises(AutostopRefused, match=r"^autostop: this box does not tell its own instance id: RUNPOD_POD_ID"):
        arm(params(box), False, box["pid1"])
    assert not os.path.exists(autostop_dir(box["data"]))


def test_a_stop_program_missing_from_path_is_refused_with_how_to_get_it(box, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")

    with pytest.raises(AutostopRefused) as refused:
        arm(params(box), False, box["pid1"])

    assert str(refused.value).startswith("autostop: runpodctl (which the stop runs) is not on this box's PATH")
    assert "github.com/runpod/runpodctl" in str(refused.value)


def test_check_mode_writes_nothing_and_says_what_it_would_do(box):
    result = arm(params(box), True, box["pid1"])

    assert not os.path.exists(autostop_dir(box["data"])) and box["started"] == []
    assert result["changed"] is True and result["armed"] is True and result["generation"] is None
    assert result["would"].startswith("write armed.json (armed), start the watcher; it stops instance pod-abc123")
    assert result["reason"] == f"would arm autostop: {result['would']}"

    arm(params(box), False, box["pid1"])
    again = arm(params(box), True, box["pid1"])
    assert again["changed"] is False and again["would"].startswith("keep armed.json, keep the watcher (pid 424242)")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"idle_minutes": math.nan}, "autostop.idle_minutes must be a finite number between 0 and 14400, got nan"),
        ({"idle_minutes": None}, "autostop needs idle_minutes (stop that long after every run is secured) or"),
        ({"check_interval_s": 0.5}, "autostop.check_interval_s must be a finite number between 1 and 3600"),
        ({"controller_silence_hours": 0.0}, "autostop.controller_silence_hours must be a finite number above 0"),
        ({"timeout_s": -1.0}, "autostop.timeout_s must be a finite number between 0 and 86400, got -1.0"),
        ({"id_env": []}, "autostop.id_env must be a non-empty list of environment variable names"),
        ({"env": {"RUNPOD_API_KEY": "not a name"}}, "autostop.env: 'RUNPOD_API_KEY': 'not a name' is not a pair"),
        ({"verb": None}, "autostop.verb is missing: the platform profile's self_stop.verb"),
        ({"verb": dict(runpod_verb(), final_state=["EXITED"])}, "autostop.verb.final_state is not a known key"),
        (
            {"verb": dict(runpod_verb(), command=["runpodctl", "pod", "delete", "{instance_id}"])},
            "autostop.verb.command runs 'delete' (runpodctl pod delete 0) but autostop.verb.irreversible is false",
        ),
        (
            {"verb": dict(runpod_verb(), irreversible=True, survives=[])},
            "autostop only stops; never delete/destroy/terminate: autostop.verb (runpodctl pod stop",
        ),
    ],
)
def test_bad_options_are_refused_with_one_line_naming_them(box, extra, expected):
    with pytest.raises(AutostopRefused) as refused:
        arm(params(box, **extra), False, box["pid1"])

    assert str(refused.value).startswith(expected)
    assert not os.path.exists(autostop_dir(box["data"]))


def test_disarm_marks_armed_json_and_a_second_disarm_changes_nothing(box):
    first = arm(params(box), False, box["pid1"])

    result = disarm(box["data"], False)

    document = armed(box)
    assert result["changed"] is True and result["armed"] is False and result["state"] == "disarmed"
    assert "the watcher (pid 424242) writes state disarmed and exits" in result["reason"]
    assert document["disarmed"] is True and document["generation"] == first["generation"]
    assert document["verb"]["command"][-1] == POD  # the rest is kept
    again = arm({"data_dir": box["data"], "disarm": True}, False)
    assert again["changed"] is False and again["state"] == "disarmed"


def test_disarm_in_check_mode_writes_nothing_and_without_arming_is_not_armed(box):
    assert disarm(box["data"], False)["state"] == "not_armed"
    arm(params(box), False, box["pid1"])
    before = Path(autostop_armed_path(box["data"])).read_bytes()

    result = disarm(box["data"], True)

    assert result["changed"] is True and result["would"].startswith("disarm autostop: the watcher (pid 424242)")
    assert Path(autostop_armed_path(box["data"])).read_bytes() == before


def test_arming_after_a_disarm_is_a_new_generation(box):
    first = arm(params(box), False, box["pid1"])
    disarm(box["data"], False)

    again = arm(params(box), False, box["pid1"])

    assert again["changed"] is True and again["generation"] != first["generation"]
    assert "disarmed" not in armed(box) and again["reason"].startswith("armed again (it was disarmed)")


def test_a_box_started_again_after_its_stop_is_armed_anew(box, monkeypatch):
    """The watcher stopped the pod and ended; the pod was started again: the same configuration must get a new
    generation, else the at-most-once rule would keep this box from ever stopping itself again."""
    first = arm(params(box), False, box["pid1"])
    monkeypatch.setattr(_autostop_arm, "watcher_alive", lambda data_dir: (False, None))
    decision = {"version": 1, "generation": first["generation"], "state": "stopped", "reason": "stopped the box"}
    Path(autostop_path(box["data"])).write_text(json.dumps(decision))

    again = arm(params(box), False, box["pid1"])

    assert again["generation"] != first["generation"] and again["changed"] is True
    assert again["reason"].startswith("armed anew (the last watcher ended stopped: this box runs again)")


def test_a_live_watcher_keeps_its_generation_whatever_its_state(box):
    first = arm(params(box), False, box["pid1"])
    decision = {"version": 1, "generation": first["generation"], "state": "stopping", "reason": "stopping"}
    Path(autostop_path(box["data"])).write_text(json.dumps(decision))

    again = arm(params(box), False, box["pid1"])

    assert again["generation"] == first["generation"] and again["changed"] is False
    assert again["decision"] == {"state": "stopping", "reason": "stopping", "due_at": None}


def test_a_vast_label_id_is_the_instance_number(box, monkeypatch):
    monkeypatch.setenv("CONTAINER_ID", "C.7654321")
    monkeypatch.setenv("CONTAINER_API_KEY", KEY_VALUE)
    verb = {
        "command": ["vastai", "stop", "instance", "{instance_id}"],
        "status": {"command": ["vastai", "show", "instance", "{instance_id}", "--raw"], "state_key": "actual_status"},
        "final_states": ["exited"],
        "survives": ["data_dir", "durable_dir"],
        "irreversible": False,
    }
    vast = params(box, platform="vastai", id_env=["CONTAINER_ID"], env={"VAST_API_KEY": "CONTAINER_API_KEY"}, verb=verb)

    result = arm(vast, False, box["pid1"])

    assert result["instance_id"] == "7654321" and result["command"] == "vastai stop instance 7654321"
    assert armed(box)["env"] == {"VAST_API_KEY": "CONTAINER_API_KEY"}


# --- issue 29: what a stop that does not keep the disk will never do, said when arming -----------------------------


def archived(data_dir: Path, run: str, stamp: str = "20300101T000000Z") -> str:
    """An archived run (run_archive's layout) with one cell's scratch: its entry's name."""
    entry = f"{run}-{stamp}"
    (data_dir / "runs" / ".archive" / entry / "cells" / "a").mkdir(parents=True)
    return entry


def test_arming_names_the_archived_runs_a_stop_would_lose_and_a_dead_man_a_failed_cell_disables(box, tmp_path):
    entry = archived(Path(box["data"]), "r0")
    scratch = tmp_path / "scratch"
    other = archived(scratch, "r9")
    box_state.register_data_dir(str(scratch), None)  # a launch with launch_data_dir=<scratch>
    durable_only = dict(runpod_verb(), survives=["durable_dir"])
    blocked = [
        f"archived run r0 (.archive/{entry}) blocks it: the stop keeps only durable_dir and would lose its scratch "
        "(teardown_run or abandon)",
        f"archived run r9 in {scratch} (.archive/{other}) blocks it: the stop keeps only durable_dir and would lose "
        "its scratch (teardown_run or abandon)",
    ]
    caveat = (
        "a failed cell disables the dead-man: the stop keeps only durable_dir, so a run that ended with a failed "
        "cell holds the box until it is torn down"
    )
    would = arm(params(box, verb=durable_only, controller_silence_hours=6.0), True, box["pid1"])
    assert (would["blocked_by"], would["caveats"]) == (blocked, [caveat])
    result = arm(params(box, verb=durable_only, controller_silence_hours=6.0), False, box["pid1"])
    assert result["armed"] is True and (result["blocked_by"], result["caveats"]) == (blocked, [caveat])
    idle_only = arm(params(box, verb=durable_only), False, box["pid1"])
    assert idle_only["blocked_by"] == blocked and idle_only["caveats"] == []  # no dead-man to disable
    # A stop that keeps data_dir and durable_dir loses nothing of an archived run or a failed cell.
    kept = arm(params(box, controller_silence_hours=6.0), False, box["pid1"])
    assert (kept["blocked_by"], kept["caveats"]) == ([], [])
