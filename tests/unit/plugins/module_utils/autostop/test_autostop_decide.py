"""The autostop decision, pure (issue 22): the idle and silence clocks, the gate held before any stop, at most one
stop per generation. Times are plain numbers standing for time.monotonic."""

from __future__ import annotations

from typing import List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_decide import (
    MAX_STOP_ATTEMPTS,
    Decision,
    Memory,
    Observation,
    RunSeen,
    Timers,
    backoff,
    decide,
    expect_run,
    gate_checked,
    new_memory,
    stop_ended,
    stop_issued,
)

IDLE = Timers(idle_s=60.0, silence_s=None, check_interval_s=5.0, gate_retry_max_s=40.0)
DEAD_MAN = Timers(idle_s=None, silence_s=3600.0, check_interval_s=5.0, gate_retry_max_s=40.0)
PASSED = {"passed": True, "step": None, "reason": "", "checked_at": "2030-01-01T00:00:00+00:00"}
CORRUPT = {"passed": False, "step": "durable", "reason": "durable copy does not match: cells/a/best.pth: size"}


def done(*names: str, started: str = "t0") -> Observation:
    return Observation(runs=tuple(RunSeen(name, "done", "", started) for name in names))


def run(memory: Memory, timers: Timers, obs: Observation, now: float, verdict: Optional[dict] = None) -> Decision:
    """One watcher look: a wanted gate is answered with ``verdict`` (passed by default), as the loop does."""
    decision = decide(obs, memory, timers, now)
    if decision.action in ("gate", "stop"):
        gate_checked(memory, verdict or PASSED, timers, now)
        decision = decide(obs, memory, timers, now) if decision.action == "gate" else decision
    return decision


def test_a_run_done_waits_the_idle_time_then_stops_after_the_gate():
    memory = new_memory("g1", 0.0)
    first = decide(done("r1"), memory, IDLE, 0.0)
    assert (first.state, first.action) == ("waiting", "gate")  # the gate runs once all are DONE
    gate_checked(memory, PASSED, IDLE, 0.0)
    waiting = decide(done("r1"), memory, IDLE, 30.0)
    assert (waiting.state, waiting.action, waiting.idle_s, waiting.due_in_s) == ("idle_wait", "wait", 30.0, 30.0)
    assert waiting.sleep_s == IDLE.check_interval_s and "stops in 30 s" in waiting.reason
    fired = decide(done("r1"), memory, IDLE, 60.0)
    assert (fired.action, fired.trigger) == ("stop", "idle")


def test_a_new_run_started_during_the_idle_wait_never_stops_and_restarts_the_clock():
    memory = new_memory("g1", 0.0)
    run(memory, IDLE, done("r1"), 0.0)
    starting = Observation(runs=(RunSeen("r1", "done", "", "t0"), RunSeen("r2", "not_done", "no run.json yet")))
    assert decide(starting, memory, IDLE, 50.0).state == "waiting"
    live = Observation(runs=(RunSeen("r1", "done", "", "t0"), RunSeen("r2", "live", "its runner runs", "t1")))
    for now in (55.0, 70.0, 500.0):
        decision = decide(live, memory, IDLE, now)
        assert (decision.state, decision.action) == ("waiting", "wait")
        assert decision.reason == "run r2 is live (its runner runs)"
    # r2 done at 600: a fresh idle wait, a fresh gate (what was verified was another set of runs).
    both = done("r1", "r2")
    assert decide(both, memory, IDLE, 600.0).action == "gate"
    gate_checked(memory, PASSED, IDLE, 600.0)
    assert decide(both, memory, IDLE, 659.0).state == "idle_wait"
    assert decide(both, memory, IDLE, 660.0).action == "stop"


def test_a_run_started_again_under_the_same_name_restarts_the_idle_clock():
    memory = new_memory("g1", 0.0)
    run(memory, IDLE, done("r1", started="t0"), 0.0)
    assert decide(done("r1", started="t9"), memory, IDLE, 59.0).action == "gate"
    gate_checked(memory, PASSED, IDLE, 59.0)
    assert decide(done("r1", started="t9"), memory, IDLE, 100.0).state == "idle_wait"


def test_a_second_run_still_live_never_stops():
    memory = new_memory("g1", 0.0)
    obs = Observation(runs=(RunSeen("r1", "done"), RunSeen("r2", "live", "its runner runs")))
    actions = {decide(obs, memory, IDLE, float(now)).action for now in range(0, 100_000, 500)}
    assert actions == {"wait"} and memory.gate is None


def test_a_corrupt_durable_copy_fails_the_gate_which_is_retried_with_backoff_and_never_bypassed():
    memory = new_memory("g1", 0.0)
    obs = done("r1")
    decide(obs, memory, IDLE, 0.0)
    gate_checked(memory, CORRUPT, IDLE, 0.0)
    now, retries = 0.0, []
    while now < 1000.0:
        decision = decide(obs, memory, IDLE, now)
        assert decision.action != "stop" and decision.state == "gate_failed"
        assert decision.reason.startswith("gate failed at durable: durable copy does not match")
        if decision.action == "gate":
            retries.append(now)
            gate_checked(memory, CORRUPT, IDLE, now)
        now += 1.0
    gaps = [later - earlier for earlier, later in zip([0.0, *retries], retries)]
    assert gaps[:5] == [5.0, 10.0, 20.0, 40.0, 40.0]  # check_interval_s * 2^n, at most gate_retry_max_s
    # Repaired: the next retry passes; the idle time already spent counts (the runs did not change).
    gate_checked(memory, PASSED, IDLE, now)
    assert decide(obs, memory, IDLE, now).action == "stop"


def test_the_dead_man_alone_waits_for_the_controller_silence():
    memory = new_memory("g1", 0.0)
    obs = Observation(runs=done("r1").runs, tick='{"tick": 1}')
    run(memory, DEAD_MAN, obs, 0.0)
    waiting = decide(obs, memory, DEAD_MAN, 3000.0)
    assert (waiting.state, waiting.idle_needed_s, waiting.silence_s) == ("silence_wait", None, 3000.0)
    assert "without a patrol tick" in waiting.reason
    # A patrol tick restarts the silence clock; only silence stops the box.
    ticked = Observation(runs=obs.runs, tick='{"tick": 2}')
    assert decide(ticked, memory, DEAD_MAN, 3500.0).state == "silence_wait"
    assert decide(ticked, memory, DEAD_MAN, 3500.0 + 3599.0).action == "wait"
    fired = decide(ticked, memory, DEAD_MAN, 3500.0 + 3600.0)
    assert (fired.action, fired.trigger) == ("stop", "controller_silence")


def test_the_dead_man_never_stops_a_box_whose_runs_are_not_secured():
    memory = new_memory("g1", 0.0)
    obs = Observation(runs=(RunSeen("r1", "not_done", "its runner ended without DONE"),))
    assert {decide(obs, memory, DEAD_MAN, float(now)).action for now in range(0, 50_000, 100)} == {"wait"}


def test_no_run_and_unreadable_runs_wait():
    memory = new_memory("g1", 0.0)
    assert decide(Observation(), memory, IDLE, 0.0).reason == "no run on this box yet"
    run(memory, IDLE, done("r1"), 10.0)
    hung = decide(Observation(problem="data_dir /d did not answer within 30 s"), memory, IDLE, 69.0)
    assert (hung.state, hung.action) == ("waiting", "wait") and "did not answer" in hung.reason
    # Readable again: the idle clock and the gate start over.
    assert decide(done("r1"), memory, IDLE, 80.0).action == "gate"


def test_a_stop_is_issued_at_most_once_then_only_the_status_is_polled():
    memory = new_memory("g1", 0.0)
    run(memory, IDLE, done("r1"), 0.0)
    assert decide(done("r1"), memory, IDLE, 60.0).action == "stop"
    stop_issued(memory, "idle 60 s: running runpodctl pod stop p1")
    assert (memory.stop_outcome, memory.stop_attempts) == ("stopping", 1)
    stop_ended(memory, "unconfirmed", "still RUNNING", IDLE, 70.0)
    seen: List[str] = []
    for now in range(70, 2000):
        decision = decide(done("r1"), memory, IDLE, float(now))
        seen.append(decision.action)
        if decision.action == "poll":
            stop_ended(memory, "unconfirmed", "still RUNNING", IDLE, float(now))
    assert "stop" not in seen and seen.count("poll") >= 3
    stop_ended(memory, "stopped", "the instance is EXITED", IDLE, 2000.0)
    assert decide(done("r1"), memory, IDLE, 2001.0).action == "exit"


def test_a_failed_stop_is_tried_three_times_in_all_then_given_up():
    memory = new_memory("g1", 0.0)
    run(memory, IDLE, done("r1"), 0.0)
    attempts = []
    for now in range(60, 5000):
        decision = run(memory, IDLE, done("r1"), float(now))
        if decision.action == "stop":
            attempts.append(now)
            stop_issued(memory, "stopping")
            stop_ended(memory, "failed", "exited 1: internal server error", IDLE, float(now))
    assert len(attempts) == MAX_STOP_ATTEMPTS and attempts[1] - attempts[0] == 5 and attempts[2] - attempts[1] == 10
    last = decide(done("r1"), memory, IDLE, 5000.0)
    assert (last.state, last.action) == ("failed", "wait") and last.reason.startswith("gave up after 3 attempts")


def test_backoff_doubles_up_to_the_retry_maximum():
    assert [backoff(IDLE, n) for n in range(1, 6)] == [5.0, 10.0, 20.0, 40.0, 40.0]
    assert backoff(Timers(0.5, None, 0.5, 1800.0), 100) == 1800.0


def test_the_run_that_armed_autostop_holds_it_until_it_shows_up():
    # Arming comes before the run starts: a box whose older runs are all DONE must not stop in between.
    memory = new_memory("g1", 0.0)
    now_idle = Timers(idle_s=0.0, silence_s=None, check_interval_s=5.0, gate_retry_max_s=40.0)
    before = decide(expect_run(done("old"), "new"), memory, now_idle, 0.0)
    assert (before.state, before.action) == ("waiting", "wait")
    assert before.reason == "run new is not DONE (it armed autostop and has not started yet)"
    assert expect_run(done("old", "new"), "new") == done("old", "new")
    assert expect_run(Observation(problem="hung"), "new").runs == ()


# --- issue 29: the whole instance (every data dir, GPU users outside runs, a stage holding the box, the dead-man) --

BOTH = Timers(idle_s=60.0, silence_s=3600.0, check_interval_s=5.0, gate_retry_max_s=40.0)
# The gate failed only at cells: with the failed cells accepted, every other copy verified (the box side says so).
FAILED_CELL = {
    "passed": False,
    "step": "cells",
    "reason": "run r1: cells not done: b (failed, exit 1)",
    "kept": "run r1 has a failed cell (b), kept on the disk the stop keeps",
}


def test_a_run_in_another_data_dir_holds_the_stop_and_is_named_with_its_data_dir():
    memory = new_memory("g1", 0.0)
    obs = Observation(runs=(RunSeen("r1", "done"), RunSeen("r2", "live", "its runner runs", "t1", "/root/scratch")))
    decisions = [decide(obs, memory, IDLE, float(now)) for now in range(0, 5000, 50)]
    assert {(d.state, d.action) for d in decisions} == {("waiting", "wait")}
    assert decisions[-1].reason == "run r2 in /root/scratch is live (its runner runs)"
    assert decisions[-1].runs[1] == {
        "run": "r2",
        "state": "live",
        "reason": "its runner runs",
        "data_dir": "/root/scratch",
    }
    # The same name in two data dirs is two runs: the other one's change restarts the clock.
    both = Observation(runs=(RunSeen("r1", "done"), RunSeen("r1", "done", "", None, "/root/scratch")))
    assert decide(both, memory, IDLE, 5000.0).action == "gate"
    gate_checked(memory, PASSED, IDLE, 5000.0)
    assert decide(both, memory, IDLE, 5059.0).state == "idle_wait"
    again = Observation(runs=(RunSeen("r1", "done"), RunSeen("r1", "done", "", "t9", "/root/scratch")))
    assert decide(again, memory, IDLE, 5060.0).action == "gate"


def test_a_gpu_user_outside_any_run_holds_the_stop_and_is_named():
    memory = new_memory("g1", 0.0)
    by_hand = Observation(runs=done("r1").runs, outside=("pid 4242 python3 (GPU 0)",))
    for now in range(0, 3000, 10):
        decision = decide(by_hand, memory, IDLE, float(now))
        assert (decision.state, decision.action) == ("waiting", "wait")
    assert decision.reason == ("a process outside any run uses a GPU: pid 4242 python3 (GPU 0); a stop would kill it")
    assert memory.gate is None
    # It ended: the idle clock starts then, not before.
    assert decide(done("r1"), memory, IDLE, 3000.0).action == "gate"
    gate_checked(memory, PASSED, IDLE, 3000.0)
    assert decide(done("r1"), memory, IDLE, 3059.0).state == "idle_wait"
    assert decide(done("r1"), memory, IDLE, 3060.0).action == "stop"


def test_a_stage_holding_the_box_holds_the_stop_until_it_lets_go():
    memory = new_memory("g1", 0.0)
    run(memory, IDLE, done("r1"), 0.0)
    lease = ("teardown", "2030-01-01T14:02:07Z", "2030-01-01T15:02:07Z")
    held = Observation(runs=done("r1").runs, lease=lease)
    for now in range(0, 1000, 10):
        decision = decide(held, memory, IDLE, float(now))
        assert (decision.state, decision.action) == ("waiting", "wait")
    assert decision.reason == "teardown holds the box since 14:02 (until 15:02 UTC): no stop while it does"
    assert decide(done("r1"), memory, IDLE, 1000.0).action == "stop"  # released: the idle time already counted


def test_the_dead_man_stops_a_box_whose_failed_cell_the_stop_keeps_and_says_why():
    memory = new_memory("g1", 0.0)
    # A run with a failed cell never writes DONE: its runner ended without it.
    obs = Observation(runs=(RunSeen("r1", "ended", "its runner ended without DONE", "t0"),), tick='{"tick": 1}')
    assert decide(obs, memory, BOTH, 0.0).reason == "every run is over: checking the gate"
    gate_checked(memory, FAILED_CELL, BOTH, 0.0)
    for now in range(0, 3600, 5):  # the idle timer never stops it: a renter still patrols and decides
        decision = decide(obs, memory, BOTH, float(now))
        assert decision.action != "stop" and decision.state == "gate_failed"
        if decision.action == "gate":
            gate_checked(memory, FAILED_CELL, BOTH, float(now))
    assert "the dead-man stops it in " in decision.reason and decision.reason.endswith(
        "(run r1 has a failed cell (b), kept on the disk the stop keeps)"
    )
    fired = decide(obs, memory, BOTH, 3600.0)
    assert (fired.action, fired.trigger) == ("stop", "controller_silence")
    assert fired.reason == (
        "dead-man: patrol silent 60 min; run r1 has a failed cell (b), kept on the disk the stop keeps: stopping"
    )


def test_a_failed_cell_the_stop_would_not_keep_never_fires_the_dead_man():
    memory = new_memory("g1", 0.0)
    obs = done("r1")
    decide(obs, memory, DEAD_MAN, 0.0)
    lost = dict(FAILED_CELL, kept=None)
    gate_checked(memory, lost, DEAD_MAN, 0.0)
    for now in range(0, 50_000, 5):
        decision = decide(obs, memory, DEAD_MAN, float(now))
        assert decision.action != "stop"
        if decision.action == "gate":
            gate_checked(memory, lost, DEAD_MAN, float(now))


def test_a_run_ended_without_done_never_lets_the_idle_timer_stop_and_needs_no_gate_without_a_dead_man():
    memory = new_memory("g1", 0.0)
    obs = Observation(runs=(RunSeen("r1", "done"), RunSeen("r2", "ended", "its runner ended without DONE", "t0")))
    for now in range(0, 10_000, 50):
        decision = decide(obs, memory, IDLE, float(now))
        assert (decision.state, decision.action) == ("waiting", "wait")
    assert decision.reason == "run r2 is not DONE (its runner ended without DONE)"
    # A passing gate (every cell accepted by hand) still leaves the idle timer to secured runs only.
    memory = new_memory("g1", 0.0)
    decide(obs, memory, BOTH, 0.0)
    gate_checked(memory, PASSED, BOTH, 0.0)
    assert decide(obs, memory, BOTH, 3599.0).action == "wait"
    assert decide(obs, memory, BOTH, 3600.0).trigger == "controller_silence"
