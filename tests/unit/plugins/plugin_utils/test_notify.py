"""A patrol tick's notifications: plan and settle, sending to a real local webhook, and the locked state file."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _notify as notify
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._webhook import send_all

NOW = "2025-01-02T03:04:05Z"
LATER = "2025-01-02T03:34:05Z"
CRASHED = {
    "state": "crashed",
    "escalate": True,
    "reasons": [
        "sweep: the runner is gone with 1 of 3 cells not done (c)",
        "sweep/c: cuda_oom (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)",
    ],
    "problems": ["crashed:sweep"],
    "actions": ["restart_job"],
}


def record(host: str = "box-1", **overrides: Any) -> Dict[str, Any]:
    """A box's patrol record as the patrol action makes it: a healthy running box, with ``overrides``."""
    answer: Dict[str, Any] = {
        "host": host,
        "reachable": True,
        "state": "running",
        "escalate": False,
        "reasons": [],
        "problems": [],
        "actions": [],
        "headline": "RUNNING run sweep: 1/3 cells done",
        "examined_runs": ["sweep"],
        "run_filter": None,
        "msg": "running: run sweep, 1/3 cells done",
    }
    answer.update(overrides)
    return answer


def unreachable(host: str) -> Dict[str, Any]:
    return record(
        host,
        reachable=False,
        state="unreachable",
        error="unreachable, or stopped before patrol ran",
        problems=["unreachable"],
    )


def tick(
    previous: Any, records: List[Any], now: str = NOW, mode: str = "send", delivered: Any = None
) -> Dict[str, Any]:
    planned = notify.plan(previous, records, now, mode)
    settled = notify.settle(planned, delivered)
    return {"messages": planned.messages, "state": settled.state, "failed": settled.failed, "lines": settled.lines}


def one_tick(path: str, records: List[Any], mode: str = "send", url: str = "", wait_s: float = 20) -> Dict[str, Any]:
    """A whole tick as the patrol action runs it: lock, read, plan, send, settle, write (not in check mode)."""
    with notify.locked_state(path, wait_s) as held:
        planned = notify.plan(held.state, records, NOW, mode)
        delivered = send_all(url, planned.messages, deadline_s=5, timeout_s=3) if mode == "send" else {}
        settled = notify.settle(planned, delivered)
        if mode != "check":
            held.write(settled.state)
        return {"messages": planned.messages, "state": settled.state, "failed": settled.failed,
                "lines": [*held.notes, *settled.lines]}  # fmt: skip


# ---- plan and settle (ported from the patrol filter) ----------------------------------------------------------


def test_a_new_problem_sends_one_message_and_the_same_problem_next_tick_none() -> None:
    first = tick("", [record("a"), record("b", **CRASHED)], delivered={"b": None})
    assert len(first["messages"]) == 1
    message = first["messages"][0]
    assert (message["host"], message["event"], message["problems"]) == ("b", "escalated", ["crashed:sweep"])
    assert message["text"] == (
        ":rotating_light: *b* escalated, crashed: sweep: the runner is gone with 1 of 3 cells not done (c) "
        "(+1 more) | new: crashed:sweep | actions: restart_job"
    )
    assert message["report"]["state"] == "crashed"
    assert set(message) == {"text", "host", "event", "problems", "report"}
    assert first["state"] == {
        "version": 1,
        "updated_at": NOW,
        "hosts": {"b": {"problems": ["crashed:sweep"], "state": "crashed", "since": NOW, "updated_at": NOW}},
    }
    second = tick(json.dumps(first["state"]), [record("a"), record("b", **CRASHED)], now=LATER)
    assert second["messages"] == []
    assert second["lines"] == ["notifications: none due (no new problem, nothing cleared)"]
    assert second["state"]["hosts"]["b"]["since"] == NOW
    assert second["state"]["hosts"]["b"]["updated_at"] == LATER


def test_another_problem_on_an_escalated_host_sends_only_the_new_id() -> None:
    state = tick("", [record("b", **CRASHED)], mode="off")["state"]
    worse = {**CRASHED, "problems": ["crashed:sweep", "disk_pressure:data"], "actions": ["restart_job", "free_disk"]}
    messages = tick(state, [record("b", **worse)])["messages"]
    assert [(m["event"], m["problems"]) for m in messages] == [("escalated", ["disk_pressure:data"])]


def test_a_cleared_host_sends_one_message_then_none() -> None:
    state = tick("", [record("b", **CRASHED)], mode="off")["state"]
    cleared = tick(state, [record("b", state="done")], now=LATER, delivered={"b": None})
    assert [(m["host"], m["event"], m["problems"]) for m in cleared["messages"]] == [
        ("b", "cleared", ["crashed:sweep"])
    ]
    assert cleared["messages"][0]["text"] == ":white_check_mark: *b* cleared, now done: was crashed:sweep"
    assert cleared["state"]["hosts"] == {}
    assert tick(cleared["state"], [record("b", state="done")])["messages"] == []


def test_an_unreachable_host_is_the_problem_unreachable() -> None:
    first = tick("", [unreachable("d")], mode="off")
    message = first["messages"][0]
    assert (message["event"], message["problems"]) == ("escalated", ["unreachable"])
    assert message["text"] == (
        ":warning: *d* unreachable: unreachable, or stopped before patrol ran; only the box's owner can see its "
        "console: check the balance, power and preemption"
    )
    assert tick(first["state"], [unreachable("d")])["messages"] == []
    back = tick(first["state"], [record("d")])["messages"]
    assert [(m["event"], m["problems"]) for m in back] == [("cleared", ["unreachable"])]


def test_an_unreachable_host_keeps_the_problems_it_had_so_they_are_not_sent_again() -> None:
    state = tick("", [record("b", **CRASHED)], mode="off")["state"]
    away = tick(state, [unreachable("b")], mode="off")
    assert [m["problems"] for m in away["messages"]] == [["unreachable"]]
    assert away["state"]["hosts"]["b"]["problems"] == ["crashed:sweep", "unreachable"]
    assert away["state"]["hosts"]["b"]["since"] == NOW
    # Back with the same crash: nothing new, nothing cleared.
    assert tick(away["state"], [record("b", **CRASHED)])["messages"] == []


def test_hosts_outside_this_tick_keep_their_state() -> None:
    state = tick("", [record("b", **CRASHED)], mode="off")["state"]
    other = tick(state, [record("a")])
    assert other["messages"] == []
    assert other["state"]["hosts"] == state["hosts"]


def test_a_failed_delivery_keeps_that_hosts_previous_state_only() -> None:
    previous = tick("", [record("c", **CRASHED)], mode="off")["state"]
    records = [record("a", **CRASHED), record("b", **CRASHED), record("c", state="done")]
    planned = notify.plan(previous, records, NOW, "send")
    assert [(m["host"], m["event"]) for m in planned.messages] == [
        ("a", "escalated"),
        ("b", "escalated"),
        ("c", "cleared"),
    ]
    delivered = {"a": None, "b": "no answer: [Errno 111] Connection refused https://hooks.example/T0/SECRET"}
    final = tick(previous, records, delivered=delivered)  # c has no answer at all: not sent
    assert sorted(final["state"]["hosts"]) == ["a", "c"]
    assert final["state"]["hosts"]["c"] == previous["hosts"]["c"]
    assert [f["host"] for f in final["failed"]] == ["b", "c"]
    assert "SECRET" not in json.dumps(final)
    assert final["lines"][1] == (
        "webhook FAILED for b (escalated): no answer: [Errno 111] Connection refused <webhook>; sent again next tick"
    )
    assert final["lines"][-1] == "notifications: 1 sent, 2 FAILED (b, c)"
    again = tick(final["state"], records)
    assert [(m["host"], m["event"]) for m in again["messages"]] == [("b", "escalated"), ("c", "cleared")]


def test_check_mode_and_no_webhook_say_what_would_be_sent() -> None:
    checked = tick("", [record("b", **CRASHED)], mode="check")
    assert checked["lines"][0].startswith("would notify: :rotating_light: *b* escalated")
    assert checked["lines"][-1] == "notifications: 1 would be sent (check mode: none sent, state not updated)"
    off = tick("", [record("b", **CRASHED)], mode="off")
    assert off["lines"][0].startswith("not sent (patrol_notify_webhook_url is not set): ")
    assert off["state"]["hosts"]["b"]["problems"] == ["crashed:sweep"]
    with pytest.raises(ValueError, match="mode must be one of send, check, off, not 'loud'"):
        notify.plan("", [], NOW, "loud")
    with pytest.raises(ValueError, match="records"):
        notify.plan("", {"host": "a"}, NOW, "send")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("previous", "note"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "no hosts mapping"),
        ({"hosts": {"b": {"problems": "crashed:sweep"}}}, "ignored unreadable entries of the notification state: b"),
    ],
)
def test_an_unreadable_state_starts_afresh_with_a_note(previous: Any, note: str) -> None:
    out = tick(previous, [record("b", **CRASHED)], mode="off")
    assert note in out["lines"][0]
    assert [m["host"] for m in out["messages"]] == ["b"]


def test_records_that_are_not_records_are_skipped_and_slack_controls_escaped() -> None:
    crashed = {**CRASHED, "reasons": ["a <b> & c"]}
    out = tick(None, ["garbage", {"host": None}, record("b", **crashed), record("b")], mode="off")
    assert len(out["messages"]) == 1
    assert out["messages"][0]["text"].startswith(":rotating_light: *b* escalated, crashed: a &lt;b&gt; &amp; c |")
    assert out["state"]["version"] == 1


# ---- filtered ticks ------------------------------------------------------------------------------------------

BOTH = {
    "state": "crashed",
    "escalate": True,
    "reasons": ["a: the runner is gone", "b/c2: stalled 40m"],
    "problems": ["crashed:a", "stalled:b/c2", "disk_pressure:data"],
    "actions": ["restart_job"],
    "examined_runs": ["a", "b"],
}


def test_a_tick_filtered_by_run_keeps_the_problems_of_runs_it_did_not_examine() -> None:
    state = tick("", [record("box", **BOTH)], mode="off")["state"]
    # patrol_run=a: a recovered, the disk is fine; b was not looked at.
    only_a = record("box", state="running", run_filter="a", examined_runs=["a"])
    filtered = tick(state, [only_a], now=LATER, delivered={})
    assert filtered["messages"] == []
    assert filtered["state"]["hosts"]["box"]["problems"] == ["stalled:b/c2"]
    assert filtered["state"]["hosts"]["box"]["since"] == NOW
    # A filtered tick that finds a new problem of its run sends only that one.
    worse_a = record("box", **{**CRASHED, "problems": ["cell_failed:a/c1"], "run_filter": "a", "examined_runs": ["a"]})
    assert [m["problems"] for m in tick(filtered["state"], [worse_a])["messages"]] == [["cell_failed:a/c1"]]
    # The next whole tick examines b: now it can clear.
    whole = tick(filtered["state"], [record("box", examined_runs=["a", "b"])], mode="off")
    assert [(m["event"], m["problems"]) for m in whole["messages"]] == [("cleared", ["stalled:b/c2"])]


def test_a_filtered_tick_whose_patrol_failed_keeps_every_run_problem() -> None:
    state = tick("", [record("box", **BOTH)], mode="off")["state"]
    failed = record(
        "box", state="unknown", escalate=True, problems=["patrol_failed"], reasons=["patrol_facts failed"],
        run_filter="a", examined_runs=[],
    )  # fmt: skip
    out = tick(state, [failed], mode="off")
    assert [m["problems"] for m in out["messages"]] == [["patrol_failed"]]
    assert out["state"]["hosts"]["box"]["problems"] == ["crashed:a", "patrol_failed", "stalled:b/c2"]


def test_an_unfiltered_tick_clears_the_problems_of_a_run_that_is_gone() -> None:
    # An archived run is not examined any more, and no filter asked for less: its problem clears.
    state = tick("", [record("box", **{**CRASHED, "problems": ["crashed:old"]})], mode="off")["state"]
    out = tick(state, [record("box", examined_runs=["sweep"])], mode="off")
    assert [(m["event"], m["problems"]) for m in out["messages"]] == [("cleared", ["crashed:old"])]


# ---- a real local webhook ------------------------------------------------------------------------------------


class Hook:
    """What the local webhook was sent: (path, body) per POST, and the event that ends a hanging answer."""

    def __init__(self) -> None:
        self.posts: List[Tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()

    def paths(self) -> List[str]:
        with self.lock:
            return [path for path, _body in self.posts]


class Handler(BaseHTTPRequestHandler):
    """/ok/... 200 (``?slow`` waits 0.5 s), /fail/... 500, /hang never answers, /r<code>/... redirects to /ok/after
    with that code, /loop redirects to itself, /ftp redirects to an ftp URL."""

    server: Any

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hook: Hook = self.server.hook
        with hook.lock:
            hook.posts.append((self.path, json.loads(body) if body else None))
        if self.path.startswith("/hang"):
            hook.release.wait(30)
        if self.path.endswith("?slow"):
            time.sleep(0.5)
        code, location = 200, None
        if self.path.startswith("/fail"):
            code = 500
        elif self.path.startswith("/loop"):
            code, location = 307, "/loop"
        elif self.path.startswith("/ftp"):
            code, location = 307, "ftp://files.example/SECRET"
        elif self.path.startswith("/r"):
            code, location = int(self.path[2:5]), "/ok/after"
        self.send_response(code)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def hook() -> Iterator[Tuple[Hook, str]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.hook = Hook()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.hook, f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    finally:
        server.hook.release.set()  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()


def messages(count: int) -> List[Dict[str, Any]]:
    return [{"text": f"m{index}", "host": f"h{index}"} for index in range(count)]


def test_a_2xx_is_delivered_and_the_body_is_the_message(hook: Tuple[Hook, str]) -> None:
    server, base = hook
    sent = send_all(f"{base}/ok/T0/SECRET", messages(3), deadline_s=10, timeout_s=5)
    assert sent == {0: None, 1: None, 2: None}
    assert sorted(body["text"] for _path, body in server.posts) == ["m0", "m1", "m2"]


def test_a_hung_webhook_costs_the_tick_one_deadline_not_one_per_message(hook: Tuple[Hook, str]) -> None:
    _server, base = hook
    started = time.monotonic()
    sent = send_all(f"{base}/hang/T0/SECRET", messages(40), deadline_s=1, timeout_s=20)
    elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed  # generous: 40 messages at a 20 s timeout each would be minutes
    assert set(sent) == set(range(40))
    assert all(error and "deadline" in error and "SECRET" not in error for error in sent.values()), sent


@pytest.mark.parametrize("code", [307, 308])
def test_307_and_308_are_followed_with_the_same_body(hook: Tuple[Hook, str], code: int) -> None:
    server, base = hook
    assert send_all(f"{base}/r{code}/x", [{"text": "hello"}], deadline_s=10, timeout_s=5) == {0: None}
    assert server.posts == [(f"/r{code}/x", {"text": "hello"}), ("/ok/after", {"text": "hello"})]


@pytest.mark.parametrize("code", [301, 302, 303])
def test_other_redirects_are_not_followed_for_a_post(hook: Tuple[Hook, str], code: int) -> None:
    server, base = hook
    sent = send_all(f"{base}/r{code}/x", [{"text": "hello"}], deadline_s=10, timeout_s=5)
    assert sent == {0: f"status {code}: redirect not followed for a POST (only 307 and 308 are)"}
    assert server.paths() == [f"/r{code}/x"]


def test_a_redirect_loop_and_a_redirect_to_another_scheme_are_refused(hook: Tuple[Hook, str]) -> None:
    server, base = hook
    assert send_all(f"{base}/loop", [{}], deadline_s=10, timeout_s=5) == {0: "more than 5 redirects"}
    assert server.paths() == ["/loop"] * 6
    sent = send_all(f"{base}/ftp", [{}], deadline_s=10, timeout_s=5)
    assert sent == {0: "status 307 to a ftp URL refused"}


def test_the_webhook_url_never_appears_in_an_error_a_line_or_the_state(hook: Tuple[Hook, str], tmp_path: Path) -> None:
    _server, base = hook
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/T0/SECRET"
    urls = (f"{base}/fail/T0/SECRET", refused, "ftp://hooks.example/T0/SECRET", "not a url SECRET")
    errors = []
    for index, url in enumerate(urls):
        state = tmp_path / f"state-{index}.json"
        out = one_tick(str(state), [record("b", **CRASHED)], url=url)
        assert out["lines"][-1] == "notifications: 0 sent, 1 FAILED (b)"
        assert "SECRET" not in json.dumps(out) + state.read_text()
        errors.append(out["failed"][0]["error"])
    assert errors[0] == "status 500"
    assert errors[1].startswith("no answer: ") and "refused" in errors[1].lower()
    assert errors[2:] == ["the webhook URL is not an http(s) URL"] * 2


def test_the_failures_say_why(hook: Tuple[Hook, str]) -> None:
    _server, base = hook
    assert send_all(f"{base}/fail/x", [{}], deadline_s=5, timeout_s=5) == {0: "status 500"}
    assert send_all("ftp://x/y", [{}], deadline_s=5, timeout_s=5) == {0: "the webhook URL is not an http(s) URL"}


# ---- the whole tick under the state file's lock --------------------------------------------------------------


def test_two_ticks_at_once_send_one_message_per_problem(hook: Tuple[Hook, str], tmp_path: Path) -> None:
    server, base = hook
    path = str(tmp_path / "patrol-state.json")
    records = [record("a", **CRASHED), record("b", **CRASHED), record("c")]
    outcomes: List[Dict[str, Any]] = []
    start = threading.Barrier(2)

    def each() -> None:
        start.wait()
        outcomes.append(one_tick(path, records, url=f"{base}/ok?slow"))

    ticks = [threading.Thread(target=each) for _tick in range(2)]
    for thread in ticks:
        thread.start()
    for thread in ticks:
        thread.join(60)
    assert sorted(body["host"] for _path, body in server.posts) == ["a", "b"]
    assert sorted(outcome["lines"][-1] for outcome in outcomes) == [
        "notifications: 2 sent",
        "notifications: none due (no new problem, nothing cleared)",
    ]
    assert sorted(json.loads(Path(path).read_text())["hosts"]) == ["a", "b"]
    for name in (path, f"{path}.lock"):
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o600


def test_a_tick_that_cannot_get_the_lock_in_time_raises_busy_and_writes_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    with notify.locked_state(path, 1):
        started = time.monotonic()
        with pytest.raises(notify.Busy, match=r"another patrol tick held .*state\.json\.lock for 0\.2s"):
            one_tick(path, [record("b", **CRASHED)], mode="off", wait_s=0.2)
        assert time.monotonic() - started < 5
    assert not os.path.exists(path)
    assert one_tick(path, [record("b", **CRASHED)], mode="off", wait_s=0.2)["messages"]
    assert os.path.exists(path)


def test_check_mode_writes_nothing_and_a_filtered_tick_posts_nothing_for_other_runs(
    hook: Tuple[Hook, str], tmp_path: Path
) -> None:
    server, base = hook
    path = str(tmp_path / "state.json")
    checked = one_tick(path, [record("box", **BOTH)], mode="check", url=f"{base}/ok")
    assert checked["lines"][-1] == "notifications: 1 would be sent (check mode: none sent, state not updated)"
    assert not os.path.exists(path) and server.posts == []
    first = one_tick(path, [record("box", **BOTH)], url=f"{base}/ok")
    assert first["failed"] == [] and len(server.posts) == 1
    only_a = record("box", run_filter="a", examined_runs=["a"])
    filtered = one_tick(path, [only_a], url=f"{base}/ok")
    assert filtered["messages"] == [] and len(server.posts) == 1
    assert json.loads(Path(path).read_text())["hosts"]["box"]["problems"] == ["stalled:b/c2"]


def test_a_state_file_that_cannot_be_read_starts_afresh_and_one_that_cannot_be_written_raises(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.mkdir()  # a directory where the file should be: unreadable and unwritable, even as root
    with pytest.raises(OSError), notify.locked_state(str(path), 1) as held:
        assert (held.state, held.path) == ("", str(path))
        assert held.notes[0].startswith("notification state unreadable, starting afresh: ")
        held.write({"version": 1, "hosts": {}})
    assert sorted(os.listdir(tmp_path)) == ["state.json", "state.json.lock"]  # no temporary file left behind


def test_settle_takes_send_alls_answer_keyed_by_index() -> None:
    planned = notify.plan("", [record("a", **CRASHED), record("b", **CRASHED)], NOW, "send")
    settled = notify.settle(planned, {0: None, 1: "status 500"})
    assert sorted(settled.state["hosts"]) == ["a"]
    assert settled.failed == [{"host": "b", "event": "escalated", "error": "status 500"}]
