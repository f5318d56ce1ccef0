"""The autostop files on a box (issue 22): where they live, armed.json's validation, the decision as readers get it,
and the watcher's lock as a reader sees it without ever taking it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_state as state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    autostop_armed_path,
    autostop_dir,
    autostop_path,
    list_runs,
    patrol_tick_path,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import COLLECTIONS

VERB = {
    "command": ["vastai", "stop", "instance", "{instance_id}"],
    "status": {"command": ["vastai", "show", "instance", "{instance_id}", "--raw"], "state_key": "actual_status"},
    "final_states": ["exited"],
    "survives": ["data_dir", "durable_dir"],
    "irreversible": False,
}


def armed(**more: Any) -> Dict[str, Any]:
    doc = {
        "version": 1, "generation": "0a1b2c3d4e5f", "data_dir": "/data", "durable_dir": "/durable",
        "idle_minutes": 30, "controller_silence_hours": None, "check_interval_s": 60, "instance_id": "4242",
        "id_env": ["CONTAINER_ID"], "env": {"VAST_API_KEY": "CONTAINER_API_KEY"}, "platform": "vastai", "verb": VERB,
    }  # fmt: skip
    doc.update(more)
    return doc


def test_the_autostop_paths_sit_under_runs_and_are_never_runs(tmp_path):
    data = str(tmp_path)
    assert autostop_dir(data) == f"{data}/runs/.autostop"
    assert autostop_armed_path(data) == f"{data}/runs/.autostop/armed.json"
    assert autostop_path(data) == f"{data}/runs/.autostop.json"
    assert patrol_tick_path(data) == f"{data}/runs/.patrol-tick.json"
    os.makedirs(autostop_dir(data))
    for path in (autostop_path(data), patrol_tick_path(data)):
        Path(path).write_text("{}")
    assert list_runs(data) == []


def test_armed_json_parses_with_defaults_and_the_instance_id_filled_in():
    parsed = state.parse_armed(armed(), "/data/")
    assert (parsed.idle_s, parsed.silence_s, parsed.check_interval_s, parsed.gate_retry_max_s) == (
        1800.0, None, 60.0, 1800.0,
    )  # fmt: skip
    assert parsed.plan is not None and parsed.plan.verb.command == ("vastai", "stop", "instance", "4242")
    assert (parsed.plan.timeout_s, parsed.plan.poll_interval_s, parsed.plan.command_timeout_s) == (300.0, 5.0, 60.0)
    assert parsed.env == (("VAST_API_KEY", "CONTAINER_API_KEY"),) and parsed.id_env == ("CONTAINER_ID",)
    fractions = state.parse_armed(armed(idle_minutes=0.05, check_interval_s=0.5), "/data")
    assert (fractions.idle_s, fractions.check_interval_s) == (3.0, 0.5)
    dead_man = state.parse_armed(armed(idle_minutes=None, controller_silence_hours=2), "/data")
    assert (dead_man.idle_s, dead_man.silence_s) == (None, 7200.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"idle_minutes": None}, "idle_minutes and controller_silence_hours are both null"),
        ({"idle_minutes": -1}, "idle_minutes must be a number at least 0"),
        ({"check_interval_s": 0}, "check_interval_s must be a number above 0"),
        ({"check_interval_s": float("nan")}, "check_interval_s must be a number above 0"),
        ({"data_dir": "/elsewhere"}, "data_dir is '/elsewhere', not this watcher's /data"),
        ({"version": 2}, "version must be 1"),
        ({"env": {"VAST_API_KEY": "not a name"}}, "env must map"),
        ({"verb": dict(VERB, irreversible=True, survives=["durable_dir"])}, "autostop only stops; never delete"),
        ({"verb": dict(VERB, command=["vastai", "destroy", "instance", "4242"])}, "irreversible is false"),
    ],
)
def test_an_unusable_armed_json_is_one_line_naming_the_key(change, message):
    with pytest.raises(ValueError) as raised:
        state.parse_armed(armed(**change), "/data")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_disarmed_armed_json_needs_only_its_generation():
    parsed = state.parse_armed({"version": 1, "generation": "0a1b2c3d4e5f", "disarmed": True}, "/data")
    assert parsed.disarmed and parsed.plan is None


def test_read_decision_says_none_unreadable_or_the_document(tmp_path):
    data = str(tmp_path)
    assert state.read_decision(data) is None
    os.makedirs(os.path.dirname(autostop_path(data)))
    Path(autostop_path(data)).write_text("{not json")
    garbage = state.read_decision(data)
    assert garbage is not None and garbage["state"] == "unreadable" and autostop_path(data) in garbage["reason"]
    Path(autostop_path(data)).write_text(json.dumps({"state": "sleeping"}))
    assert state.read_decision(data) == {
        "state": "unreadable",
        "reason": f"{autostop_path(data)}: state 'sleeping' is unknown",
    }
    Path(autostop_path(data)).write_text(json.dumps({"state": "idle_wait", "due_at": "2030-01-01T00:00:00+00:00"}))
    assert state.read_decision(data) == {"state": "idle_wait", "due_at": "2030-01-01T00:00:00+00:00"}


HOLDER = """
import sys, time
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop import _autostop_state as state
fd = state.hold_watch_lock(sys.argv[1])
print("held" if fd is not None else "busy", flush=True)
time.sleep(30)
"""


def test_watcher_alive_sees_the_holder_without_taking_the_lock(tmp_path):
    data = str(tmp_path)
    assert state.watcher_alive(data) == (False, None)
    env = dict(os.environ, PYTHONPATH=str(COLLECTIONS))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, data], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for _look in range(20):  # asking never takes it away
            assert state.watcher_alive(data) == (True, holder.pid)
        assert state.hold_watch_lock(data, retry_s=0.2) is None
    finally:
        holder.kill()
        holder.wait()
    assert state.watcher_alive(data) == (False, None)
    fd = state.hold_watch_lock(data)
    assert fd is not None and Path(state.watch_lock_path(data)).read_text() == f"{os.getpid()}\n"
    os.close(fd)


def test_a_watcher_starting_while_a_reader_looks_still_gets_the_lock(tmp_path):
    data = str(tmp_path)
    os.makedirs(autostop_dir(data))
    Path(state.watch_lock_path(data)).write_text("")
    until = time.monotonic() + 1.0
    fd = None
    while time.monotonic() < until and fd is None:
        state.watcher_alive(data)
        fd = state.hold_watch_lock(data)
    assert fd is not None
    os.close(fd)


def test_publish_writes_the_decision_private_and_one_log_line(tmp_path):
    data = str(tmp_path)
    os.makedirs(autostop_dir(data))
    assert state.publish(data, {"state": "waiting"}, "2030-01-01T00:00:00+00:00 waiting no run on this box yet") is None
    assert os.stat(autostop_path(data)).st_mode & 0o777 == 0o600
    assert Path(state.watch_log_path(data)).read_text() == "2030-01-01T00:00:00+00:00 waiting no run on this box yet\n"
    history = []
    for index in range(25):
        history = state.with_history(history, f"t{index}", "waiting", "r")
    assert len(history) == state.MAX_HISTORY and history[0]["at"] == "t5"
