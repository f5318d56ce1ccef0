"""Notifications by a silent box's state (issue 29, item 10): a STOPPED box sends nothing, not even a "cleared", and
forgets its box problems (an idle_billing is told again once it bills again); INTERRUPTED warns once; GONE alarms."""

from __future__ import annotations

from typing import Any, Dict

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._notify import plan

BEFORE = {"hosts": {"b1": {"problems": ["crashed:r2", "idle_billing"], "state": "done", "since": "t0"}}}


def down(box_state: str, state: str, **more: Any) -> Dict[str, Any]:
    record = {"host": "b1", "reachable": False, "state": state, "box_state": box_state, "escalate": False}
    return {**record, "reasons": ["the provider says EXITED; ssh: refused"], **more}


def test_a_stopped_box_sends_nothing_and_keeps_only_its_runs_problems() -> None:
    done = plan(BEFORE, [down("STOPPED", "stopped", problems=[])], now="t1", mode="off")
    assert done.messages == []
    assert done.hosts["b1"]["problems"] == ["crashed:r2"] and done.hosts["b1"]["state"] == "stopped"


def test_an_interrupted_box_warns_once_and_a_gone_one_alarms() -> None:
    first = plan(BEFORE, [down("INTERRUPTED", "interrupted", problems=["interrupted"])], now="t1", mode="off")
    assert [(m["event"], m["problems"]) for m in first.messages] == [("warning", ["interrupted"])]
    assert first.messages[0]["text"] == ":warning: *b1* interrupted: the provider says EXITED; ssh: refused"
    again = plan({"hosts": first.hosts}, [down("INTERRUPTED", "interrupted")], now="t2", mode="off")
    assert again.messages == []
    gone = plan({"hosts": first.hosts}, [down("GONE", "unreachable", problems=["gone"])], now="t3", mode="off")
    assert [(m["event"], m["problems"]) for m in gone.messages] == [("escalated", ["gone"])]
    assert gone.hosts["b1"]["problems"] == ["crashed:r2", "gone", "idle_billing"]
