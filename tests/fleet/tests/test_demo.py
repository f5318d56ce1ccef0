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
