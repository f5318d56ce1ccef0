"""Patrol filters: a host's result from its patrol_facts call, its lines, the fleet summary, the notifications."""

from __future__ import annotations

import json

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter import patrol

NOW = "2025-01-02T03:04:05Z"
LATER = "2025-01-02T03:34:05Z"


def facts(**overrides):
    """What patrol_facts returns for a box with a live run (its RETURN's shape), with ``overrides``."""
    answer = {
        "state": "running",
        "escalate": False,
        "reasons": [],
        "problems": [],
        "actions": [],
        "run": "sweep",
        "alive": 2,
        "cells_done": 1,
        "cells_total": 3,
        "progress": {
            "epoch": 3,
            "epochs_total": 20,
            "step": 120,
            "steps_total": 500,
            "line": "epoch 3/20 step 120/500",
        },
        "eta_s": 5400,
        "log_idle_s": 12.5,
        "crash_signatures": [],
        "disk": {"path": "/data", "bytes_used_pct": 61.2, "inodes_used_pct": 3.0},
        "disks": [
            {"name": "data", "path": "/data", "error": None, "bytes_used_pct": 61.2, "inodes_used_pct": 3.0},
            {"name": "durable", "path": "/durable", "error": None, "bytes_used_pct": 20.0, "inodes_used_pct": 1.0},
        ],
        "gpu": [{"index": 0, "utilization_pct": 97.0, "memory_used_mib": 70211.0, "memory_total_mib": 81559.0}],
        "gpu_backend": "nvml",
        "gpu_error": None,
        "memory": {"cgroup_current_bytes": 1, "cgroup_max_bytes": None, "recent_peak_bytes": 2},
        "xids": [],
        "runs": [{"run": "sweep", "state": "running", "cells": []}],
        "msg": "running: run sweep, 1/3 cells done",
    }
    answer.update(overrides)
    return answer


def registered(**overrides):
    """The registered result of the module task: plain keys, ansible_facts.patrol and Ansible's own keys."""
    answer = facts(**overrides)
    return {**answer, "ansible_facts": {"patrol": answer}, "changed": False, "failed": False, "invocation": {}}


CRASHED = {
    "state": "crashed",
    "escalate": True,
    "reasons": [
        "sweep: the runner is gone with 1 of 3 cells not done (c)",
        "sweep/c: cuda_oom (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)",
    ],
    "problems": ["crashed:sweep"],
    "actions": ["restart_job"],
    "alive": 0,
}


def result(host="box-1", **overrides):
    return patrol.patrol_result(host, registered(**overrides))


def unreachable(host="box-9"):
    return patrol.patrol_unreachable(host)


# ---- patrol_result ------------------------------------------------------------------------------------------


def test_result_keeps_the_module_facts_and_adds_the_host():
    record = patrol.patrol_result("box-1", registered(), python="/data/venv/bin/python")
    assert record["host"] == "box-1"
    assert record["reachable"] is True
    assert record["python"] == "/data/venv/bin/python"
    assert record["state"] == "running"
    assert record["escalate"] is False
    assert record["cells_done"] == 1
    assert record["cells_total"] == 3
    assert record["progress"]["epochs_total"] == 20
    assert record["gpu"][0]["utilization_pct"] == 97.0
    assert "invocation" not in record
    assert "changed" not in record


def test_result_uses_the_base_python_call_when_the_first_found_no_interpreter():
    missing = {"failed": False, "rc": 127, "msg": "The module interpreter '/data/venv/bin/python' was not found."}
    record = patrol.patrol_result("b", missing, registered(), python="/data/venv/bin/python", base_python="python3")
    assert record["state"] == "running"
    assert record["python"] == "python3"


def test_result_when_neither_python_runs():
    missing = {"failed": False, "rc": 127, "msg": "The module interpreter 'x' was not found."}
    record = patrol.patrol_result("b", missing, dict(missing), python="/v/python", base_python="/usr/bin/python3")
    assert record["state"] == "unknown"
    assert record["escalate"] is True
    assert record["problems"] == ["patrol_failed"]
    assert record["reasons"] == ["no Python on the box: neither /v/python nor /usr/bin/python3 runs"]


def test_a_skipped_fallback_means_the_first_call_counts():
    record = patrol.patrol_result("b", registered(), {"skipped": True, "changed": False})
    assert record["state"] == "running"


@pytest.mark.parametrize(
    ("tick", "reason"),
    [
        ({"failed": True, "msg": "data_dir must be a non-empty path"}, "data_dir must be a non-empty path"),
        ({"failed": True, "module_stderr": "Traceback (most recent call last):\n..."}, "Traceback (most recent"),
        ({"failed": True}, "no message"),
        # Registered under failed_when: false, a failed call has failed false: no state is what tells.
        ({"failed": False, "failed_when_result": False, "msg": "MODULE FAILURE"}, "MODULE FAILURE"),
        ({}, "no message"),
        (None, "patrol_facts did not run"),
        ({"skipped": True}, "patrol_facts did not run"),
    ],
)
def test_a_failed_or_missing_call_is_unknown_and_escalated(tick, reason):
    record = patrol.patrol_result("b", tick, python="/v/python")
    assert record["state"] == "unknown"
    assert record["escalate"] is True
    assert record["problems"] == ["patrol_failed"]
    assert record["actions"] == ["investigate"]
    assert reason in record["reasons"][0]


def test_a_task_error_is_a_patrol_error():
    record = patrol.patrol_result("b", None, error="Validate the settings: patrol needs an absolute data dir")
    assert (record["state"], record["escalate"], record["problems"]) == ("unknown", True, ["patrol_error"])
    assert record["reasons"] == ["patrol stopped: Validate the settings: patrol needs an absolute data dir"]


@pytest.mark.parametrize(
    "garbage",
    [
        {"state": "exploded", "escalate": "yes"},
        {"state": 42, "escalate": None, "reasons": "not a list", "gpu": "lots", "disk": 5, "cells_done": "many"},
        {"state": ["running"], "escalate": False, "progress": [1, 2], "runs": {"a": 1}, "eta_s": float("nan")},
        {"ansible_facts": {"patrol": "nope"}, "state": None},
    ],
)
def test_garbage_from_the_box_is_unknown_with_a_clear_reason_and_lines(garbage):
    record = patrol.patrol_result("box-x", garbage)
    assert record["state"] == "unknown"
    assert record["escalate"] is True
    assert "patrol_invalid" in record["problems"]
    assert record["reasons"][0].startswith("the box's patrol_facts answer is not usable: state ")
    lines = patrol.patrol_lines(record)
    assert 3 <= len(lines) <= 5
    assert lines[0].startswith("box-x  UNKNOWN")
    assert "ESCALATED -> investigate" in lines[0]
    assert all(isinstance(line, str) and "\n" not in line for line in lines)


def test_wrong_fields_are_ignored_and_named_without_escalating():
    record = result(gpu="lots", cells_done=-1, eta_s="soon", problems=["ok:id", "bad id with spaces"], reasons=["r", 3])
    assert record["state"] == "running"
    assert record["escalate"] is False
    assert record["gpu"] == []
    assert record["cells_done"] is None
    assert record["eta_s"] is None
    assert record["problems"] == ["ok:id"]
    assert record["reasons"] == [
        "ignored what the box answered for: reasons, problem id 'bad id with spaces', cells_done, eta_s, gpu"
    ]


def test_long_and_multi_line_reasons_are_bounded():
    record = result(reasons=["x" * 10_000, "a\nb"] + [f"r{i}" for i in range(30)])
    assert len(record["reasons"][0]) == patrol.LINE_CHARS
    assert record["reasons"][1] == "a b"
    assert len(record["reasons"]) == patrol.MAX_REASONS + 1
    assert record["reasons"][-1] == "+12 more reasons"


def test_unknown_always_escalates_and_an_escalation_has_a_problem_id():
    assert result(state="unknown", escalate=False)["escalate"] is True
    assert result(state="unknown", escalate=False)["problems"] == ["escalated:unknown"]
    assert result(state="stalled", escalate=True)["problems"] == ["escalated:stalled"]


def test_result_needs_a_host():
    with pytest.raises(AnsibleFilterError, match="non-empty string"):
        patrol.patrol_result("", registered())


# ---- patrol_results and unreachable hosts ----------------------------------------------------------------------


def test_results_fill_in_the_hosts_that_never_answered():
    ok = result("a")
    hostvars = {"a": {"patrol_result": ok}, "b": {"other": 1}, "c": {"patrol_result": "garbage"}}
    records = patrol.patrol_results(["a", "b", "c", "d"], hostvars)
    assert records[0] == ok
    assert [(r["host"], r["state"], r["reachable"]) for r in records[1:]] == [
        ("b", "unreachable", False),
        ("c", "unreachable", False),
        ("d", "unreachable", False),
    ]
    with pytest.raises(AnsibleFilterError):
        patrol.patrol_results("a", hostvars)


def test_a_call_that_found_the_box_unreachable_is_an_unreachable_result():
    gone = {"unreachable": True, "changed": False, "msg": "Task failed: ssh: connect to host x port 22: No route"}
    record = patrol.patrol_result("box-9", gone, python="/v/python")
    assert (record["state"], record["reachable"], record["escalate"]) == ("unreachable", False, False)
    assert record["problems"] == ["unreachable"]
    assert record["error"] == "Task failed: ssh: connect to host x port 22: No route"
    # Also when the box went away between the two calls.
    missing = {"rc": 127, "msg": "The module interpreter '/v/python' was not found."}
    assert patrol.patrol_result("box-9", missing, gone)["state"] == "unreachable"


def test_an_unreachable_host_says_only_the_owner_sees_the_console():
    record = unreachable("box-9")
    assert record["problems"] == ["unreachable"]
    assert record["escalate"] is False
    lines = patrol.patrol_lines(record)
    assert lines == [
        "box-9  UNREACHABLE",
        "  unreachable, or stopped before patrol ran",
        "  only the box's owner can see its console: check the balance, power and preemption (re-rent when it is gone)",
    ]


# ---- patrol_lines --------------------------------------------------------------------------------------------


def test_lines_of_a_running_box():
    lines = patrol.patrol_lines(result("box-1"))
    assert lines == [
        "box-1  RUNNING  run sweep, 1/3 cells done, 2 alive",
        "  progress: epoch 3/20 step 120/500, ETA 1h30m; logs grew 12s ago",
        "  disk: /data 61% bytes / 3% inodes used; /durable 20% bytes / 1% inodes used; gpu util: 0: 97% 69/80 GiB",
    ]


def test_lines_of_an_escalated_box_show_reasons_problems_and_actions():
    lines = patrol.patrol_lines(result("box-3", **CRASHED, progress=None, eta_s=None, log_idle_s=None))
    assert lines[0] == "box-3  CRASHED  run sweep, 1/3 cells done  ESCALATED -> restart_job"
    assert lines[1] == "  progress: no epoch / step marker seen"
    assert lines[3] == (
        "  reasons: sweep: the runner is gone with 1 of 3 cells not done (c) | sweep/c: cuda_oom "
        "(torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"
    )
    assert lines[4] == "  problems: crashed:sweep"


def test_lines_of_an_idle_box_without_gpus_and_a_disk_error():
    record = result(
        state="idle",
        run=None,
        alive=0,
        cells_done=0,
        cells_total=0,
        progress=None,
        eta_s=None,
        log_idle_s=None,
        gpu=[],
        gpu_error="nvidia-smi: not found",
        disks=[{"name": "data", "path": "/data", "error": "statvfs timed out after 10 s"}],
    )
    assert patrol.patrol_lines(record) == [
        "box-1  IDLE  no run",
        "  progress: no epoch / step marker seen",
        "  disk: /data statvfs timed out after 10 s; gpu: nvidia-smi: not found",
    ]


def test_lines_show_at_most_eight_gpus_and_two_reasons():
    gpus = [{"index": i, "utilization_pct": 90} for i in range(10)]
    record = result(gpu=gpus, reasons=["a", "b", "c"])
    lines = patrol.patrol_lines(record)
    assert lines[2].endswith("gpu util: 0: 90%, 1: 90%, 2: 90%, 3: 90%, 4: 90%, 5: 90%, 6: 90%, 7: 90%, +2 more")
    assert lines[3] == "  reasons: a | b (+1 more)"


@pytest.mark.parametrize(
    "raw", [None, "text", {"host": 3, "state": None}, {"gpu": [1, {"index": "x"}], "disks": "x", "progress": 5}]
)
def test_lines_never_fail_on_raw_input(raw):
    lines = patrol.patrol_lines(raw)
    assert 3 <= len(lines) <= 5


def test_durations():
    assert [patrol._fmt_duration(s) for s in (5, 65, 3600, 3 * 3600 + 5 * 60, 2 * 86400 + 3600, -1, None)] == [
        "5s",
        "1m",
        "1h00m",
        "3h05m",
        "2d1h",
        "?",
        "?",
    ]


# ---- patrol_exit ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 2, "0", "2"])
def test_exit_leaves_the_pattern_for_the_enforce_play(code):
    assert patrol.patrol_exit("fleet:&gpu", code) == "fleet:&gpu"


@pytest.mark.parametrize(("code", "expected"), [(4, 4), ("4", 4), (3, 3), (None, 3), ("garbage", 3), (7, 3)])
def test_exit_ends_the_run_with_3_or_4(code, expected):
    with pytest.raises(SystemExit) as ended:
        patrol.patrol_exit("all", code)
    assert ended.value.code == expected


# ---- patrol_summary ------------------------------------------------------------------------------------------


def test_summary_of_a_healthy_fleet_is_exit_0():
    summary = patrol.patrol_summary([result("a"), result("b", state="done", alive=0)])
    assert summary["exit_code"] == 0
    assert summary["by_state"] == {"running": 1, "done": 1}
    assert summary["line"] == "2 hosts: 1 running, 1 done"
    assert summary["escalated"] == summary["unreachable"] == []


def test_summary_exit_2_when_escalated_even_with_unreachable_hosts():
    gone = result("c", state="running", escalate=True, problems=["gpu_lost:0"], actions=["re_rent"])
    records = [result("a"), result("b", **CRASHED), gone, unreachable("d")]
    summary = patrol.patrol_summary(records)
    assert summary["exit_code"] == 2
    assert summary["escalated"] == ["b", "c"]
    assert summary["unreachable"] == ["d"]
    assert summary["re_rent"] == ["c"]
    assert summary["by_state"] == {"crashed": 1, "running": 2, "unreachable": 1}
    assert summary["line"] == (
        "4 hosts: 1 crashed, 2 running, 1 unreachable; escalated: b (crashed -> restart_job), "
        "c (running -> re_rent); re-rent: c; unreachable: d"
    )


def test_summary_exit_4_when_unreachable_only_and_3_when_the_report_was_not_written():
    assert patrol.patrol_summary([result("a"), unreachable("d")])["exit_code"] == 4
    summary = patrol.patrol_summary([result("b", **CRASHED)], "Write the report: permission denied")
    assert summary["exit_code"] == 3
    assert summary["report_error"] == "Write the report: permission denied"
    assert patrol.patrol_summary([])["line"] == "0 hosts"
    with pytest.raises(AnsibleFilterError):
        patrol.patrol_summary({"host": "a"})


# ---- patrol_notifications ------------------------------------------------------------------------------------


def tick(previous, records, now=NOW, **kwargs):
    return patrol.patrol_notifications(previous, records, now=now, **kwargs)


def test_a_new_problem_sends_one_message_and_the_same_problem_next_tick_none():
    first = tick("", [result("a"), result("b", **CRASHED)])
    assert len(first["messages"]) == 1
    message = first["messages"][0]
    assert (message["host"], message["event"], message["problems"]) == ("b", "escalated", ["crashed:sweep"])
    assert message["text"] == (
        ":rotating_light: *b* escalated, crashed: sweep: the runner is gone with 1 of 3 cells not done (c) "
        "(+1 more) | new: crashed:sweep | actions: restart_job"
    )
    assert message["report"]["state"] == "crashed"
    assert set(message) == {"text", "host", "event", "problems", "report"}
    assert first["state"]["hosts"] == {
        "b": {"problems": ["crashed:sweep"], "state": "crashed", "since": NOW, "updated_at": NOW}
    }
    second = tick(json.dumps(first["state"]), [result("a"), result("b", **CRASHED)], now=LATER)
    assert second["messages"] == []
    assert second["lines"] == ["notifications: none due (no new problem, nothing cleared)"]
    assert second["state"]["hosts"]["b"]["since"] == NOW
    assert second["state"]["hosts"]["b"]["updated_at"] == LATER


def test_another_problem_on_an_escalated_host_sends_only_the_new_id():
    state = tick("", [result("b", **CRASHED)])["state"]
    worse = {**CRASHED, "problems": ["crashed:sweep", "disk_pressure:data"], "actions": ["restart_job", "free_disk"]}
    messages = tick(state, [result("b", **worse)])["messages"]
    assert [(m["event"], m["problems"]) for m in messages] == [("escalated", ["disk_pressure:data"])]


def test_a_cleared_host_sends_one_message_then_none():
    state = tick("", [result("b", **CRASHED)])["state"]
    cleared = tick(state, [result("b", state="done", alive=0)], now=LATER)
    assert [(m["host"], m["event"], m["problems"]) for m in cleared["messages"]] == [
        ("b", "cleared", ["crashed:sweep"])
    ]
    assert cleared["messages"][0]["text"] == ":white_check_mark: *b* cleared, now done: was crashed:sweep"
    assert cleared["state"]["hosts"] == {}
    assert tick(cleared["state"], [result("b", state="done", alive=0)])["messages"] == []


def test_an_unreachable_host_is_the_problem_unreachable():
    first = tick("", [unreachable("d")])
    message = first["messages"][0]
    assert (message["event"], message["problems"]) == ("escalated", ["unreachable"])
    assert message["text"] == (
        ":warning: *d* unreachable: unreachable, or stopped before patrol ran; only the box's owner can see its "
        "console: check the balance, power and preemption"
    )
    assert tick(first["state"], [unreachable("d")])["messages"] == []
    back = tick(first["state"], [result("d")])["messages"]
    assert [(m["event"], m["problems"]) for m in back] == [("cleared", ["unreachable"])]


def test_hosts_outside_this_tick_keep_their_state():
    state = tick("", [result("b", **CRASHED)])["state"]
    other = tick(state, [result("a")])
    assert other["messages"] == []
    assert other["state"]["hosts"] == state["hosts"]


def test_a_failed_delivery_keeps_that_hosts_previous_state_only():
    previous = tick("", [result("c", **CRASHED)])["state"]
    records = [result("a", **CRASHED), result("b", **CRASHED), result("c", state="done", alive=0)]
    plan = tick(previous, records)
    assert [(m["host"], m["event"]) for m in plan["messages"]] == [
        ("a", "escalated"),
        ("b", "escalated"),
        ("c", "cleared"),
    ]
    delivered = [
        {"item": plan["messages"][0], "status": 200, "failed": False},
        {
            "item": plan["messages"][1],
            "status": -1,
            "failed": False,
            "msg": "Request failed: <urlopen error [Errno 111] Connection refused> https://hooks.example/T0/SECRET",
        },
        {"item": plan["messages"][2], "status": 500, "failed": False, "msg": "Status code was 500"},
    ]
    final = tick(previous, records, delivered=delivered)
    assert sorted(final["state"]["hosts"]) == ["a", "c"]
    assert final["state"]["hosts"]["c"] == previous["hosts"]["c"]
    assert [f["host"] for f in final["failed"]] == ["b", "c"]
    assert "SECRET" not in json.dumps(final["lines"])
    assert final["lines"][1] == (
        "webhook FAILED for b (escalated): status -1: Request failed: <urlopen error [Errno 111] Connection refused> "
        "<webhook>; sent again next tick"
    )
    assert final["lines"][-1] == "notifications: 1 sent, 2 FAILED (b, c)"
    # The next tick sends the two that failed again, and nothing for the one delivered.
    again = tick(final["state"], records)
    assert [(m["host"], m["event"]) for m in again["messages"]] == [("b", "escalated"), ("c", "cleared")]


def test_check_mode_and_no_webhook_say_what_would_be_sent():
    checked = tick("", [result("b", **CRASHED)], mode="check")
    assert checked["lines"][0].startswith("would notify: :rotating_light: *b* escalated")
    assert checked["lines"][-1] == "notifications: 1 would be sent (check mode: none sent, state not updated)"
    off = tick("", [result("b", **CRASHED)], mode="off", delivered=[{"skipped": True}])
    assert off["lines"][0].startswith("not sent (patrol_notify_webhook_url is not set): ")
    assert off["state"]["hosts"]["b"]["problems"] == ["crashed:sweep"]
    with pytest.raises(AnsibleFilterError, match="mode"):
        tick("", [], mode="loud")


@pytest.mark.parametrize(
    ("previous", "note"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "no hosts mapping"),
        ({"hosts": {"b": {"problems": "crashed:sweep"}}}, "ignored unreadable entries of the notification state: b"),
    ],
)
def test_an_unreadable_state_starts_afresh_with_a_note(previous, note):
    out = tick(previous, [result("b", **CRASHED)])
    assert note in out["lines"][0]
    assert [m["host"] for m in out["messages"]] == ["b"]


def test_notifications_skip_records_that_are_not_results_and_escape_slack_controls():
    crashed = {**CRASHED, "reasons": ["a <b> & c"]}
    out = tick(None, ["garbage", {"host": None}, result("b", **crashed)])
    assert out["messages"][0]["text"].startswith(":rotating_light: *b* escalated, crashed: a &lt;b&gt; &amp; c |")
    assert out["state"]["version"] == 1
