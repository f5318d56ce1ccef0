"""`make demo` judges its own outcome: a box whose verdict is not the expected one fails the demo, by name."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import demo

AS_EXPECTED: dict[str, Any] = {
    "hosts": [
        {"host": "box-healthy", "status": "PASS", "findings": []},
        {"host": "box-xid79", "status": "FAIL", "findings": [{"code": "gpu_lost"}, {"code": "xid_hardware"}]},
        {"host": "box-container", "status": "WARN", "findings": [{"code": "vram_zombies"}]},
    ]
}


def test_the_expected_verdicts_pass() -> None:
    assert demo.verdict_differences(AS_EXPECTED, demo.DEMO_BOXES) == []


def test_every_box_failing_for_want_of_a_gpu_is_named() -> None:
    no_gpu = {"status": "FAIL", "findings": [{"code": "no_driver"}]}
    report = {"hosts": [dict(no_gpu, host=name) for name in demo.DEMO_BOXES]}
    assert demo.verdict_differences(report, demo.DEMO_BOXES) == [
        "box-healthy: expected PASS, got FAIL (findings: ['no_driver'])",
        "box-xid79: expected findings ['gpu_lost'] missing (findings: ['no_driver'])",
        "box-container: expected WARN, got FAIL (findings: ['no_driver'])",
    ]


def test_a_missing_box_or_report_is_a_difference() -> None:
    report = {"hosts": AS_EXPECTED["hosts"][:2]}
    assert demo.verdict_differences(report, demo.DEMO_BOXES) == ["box-container: not in the report"]
    assert demo.verdict_differences(None, demo.DEMO_BOXES) == ["no preflight report was written"]


def test_only_a_report_of_this_run_counts(tmp_path: Path) -> None:
    (tmp_path / "preflight-20000101T000000Z.json").write_text(json.dumps({"hosts": []}))
    assert demo.newest_report(tmp_path, since=time.time() + 5) is None
    assert demo.newest_report(tmp_path, since=0) == {"hosts": []}


def teardown_outcomes(tmp_path: Path) -> tuple[demo.TeardownSetup, dict[str, dict[str, Any]]]:
    """What a demo whose two teardowns went as they should leaves: the refused one touched nothing."""
    setup = demo.TeardownSetup(overlay=tmp_path, pulled=tmp_path / "pulled", calls=tmp_path / "calls", env={})
    copy = setup.pulled / demo.LAUNCH_BOX / demo.DEMO_RUN / "cells" / "a"
    copy.mkdir(parents=True)
    (copy / "best.pth").write_bytes(b"x")
    get = f"runpodctl pod get {demo.DEMO_POD}"
    refused = {"rc": 2, "entry": {"status": "UNCONFIRMED"}, "calls": [], "scratch": True, "durable": True}
    accepted = {
        "rc": 0,
        "entry": {"status": "TORN_DOWN", "meter_stop": {"final_state": "EXITED"}},
        "calls": [get, f"runpodctl pod stop {demo.DEMO_POD}", get],
        "scratch": False,
        "durable": True,
    }
    return setup, {"refused": refused, "accepted": accepted}


def test_two_teardowns_as_expected_pass(tmp_path: Path) -> None:
    setup, outcomes = teardown_outcomes(tmp_path)
    assert demo.teardown_differences(outcomes, setup) == []


def test_a_refused_teardown_that_deleted_or_called_anything_is_a_difference(tmp_path: Path) -> None:
    setup, outcomes = teardown_outcomes(tmp_path)
    outcomes["refused"].update(scratch=False, calls=[f"runpodctl pod stop {demo.DEMO_POD}"])
    assert demo.teardown_differences(outcomes, setup) == [
        f"teardown (refused): scratch kept False, provider calls ['runpodctl pod stop {demo.DEMO_POD}']"
    ]


def test_an_accepted_teardown_that_stopped_twice_or_lost_the_durable_copy_is_a_difference(tmp_path: Path) -> None:
    setup, outcomes = teardown_outcomes(tmp_path)
    accepted = outcomes["accepted"]
    accepted["calls"] = accepted["calls"] + [f"runpodctl pod stop {demo.DEMO_POD}"]
    accepted["durable"] = False
    differences = demo.teardown_differences(outcomes, setup)
    assert "teardown (accepted): the durable copy's MANIFEST.sha256 is gone" in differences
    assert any(line.startswith("teardown (accepted): 2 `runpodctl pod stop") for line in differences)


def test_a_teardown_that_never_ran_is_a_difference() -> None:
    assert demo.teardown_differences({}, None) == [f"teardown: not run (run {demo.DEMO_RUN} did not finish)"]
