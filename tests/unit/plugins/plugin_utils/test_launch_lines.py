"""Launch's words: one line per box that says what happened (or why nothing started), and the fleet's summary.
Any record reads, also one with missing or wrong-typed fields: the report step never crashes on a box."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines as lines


def record(status: str, **facts: Any) -> Dict[str, Any]:
    base: Dict[str, Any] = {
        "host": "b1",
        "status": status,
        "step": None,
        "reason": "",
        "run": "abl",
        "cells": [{"name": "a", "status": "running"}, {"name": "b", "status": "pending"}],
        "cells_left": 2,
        "recopy_cells": [],
        "kept_cells": [],
        "changes": [],
        "detach": "tmux",
        "pgid": 812,
        "attach": "tmux attach -t rgt-abl",
        "gate": {"allowed": True, "reason": "preflight PASS (this play)"},
        "check_mode": False,
    }
    base.update(facts)
    return base


def test_a_start_names_the_cells_left_how_to_attach_and_the_gate() -> None:
    assert lines.line(record("STARTED")) == (
        "b1  STARTED  abl (2 cells left): 2 cells (1 running, 1 pending); tmux pgid 812; "
        "attach: tmux attach -t rgt-abl; preflight PASS (this play)"
    )


def test_a_resume_counts_cells_left_and_re_copied_and_names_the_applied_changes() -> None:
    resumed = record(
        "RESUMED", cells_left=0, recopy_cells=["a", "b"], kept_cells=["c"], changes=["cell a: artifacts changed"]
    )
    text = lines.line(resumed)
    assert text.startswith("b1  RESUMED  abl (0 cells left; 2 re-copied): ")
    assert "1 kept; re-copies without retraining: a, b; changes applied: cell a: artifacts changed" in text


def test_check_mode_says_what_would_happen() -> None:
    assert lines.line(record("STARTED", check_mode=True)).startswith(
        "b1  STARTED  abl (check mode: would start; 2 cells left): "
    )
    would = lines.line(record("RESUMED", check_mode=True, cells_left=1, recopy_cells=["b"]))
    assert would.startswith("b1  RESUMED  abl (check mode: would resume; 1 cell left; 1 re-copied): ")
    assert "would re-copy without retraining: b" in would
    assert lines.line(record("DONE", check_mode=True, outcome="done")).startswith("b1  DONE  abl (check mode: nothing)")


def test_done_and_already_running_say_nothing_was_started() -> None:
    done = lines.line(record("DONE", outcome="done", kept_cells=["a", "b"], detach=None, attach=None))
    assert done.startswith("b1  DONE  abl: 2 cells (1 running, 1 pending); every cell done (2 kept), nothing started")
    assert "its runner is live: left alone" in lines.line(record("ALREADY_RUNNING", outcome="already_running"))


def test_a_refusal_says_where_why_and_that_nothing_started() -> None:
    refused = record("REFUSED", step="relaunch", reason="run abl on this box has another spec; changes: cell c added")
    assert lines.line(refused) == (
        "b1  REFUSED  abl at relaunch: run abl on this box has another spec; changes: cell c added; nothing started"
    )
    # A failure of training_run itself may have started something: the line does not claim otherwise.
    failed = lines.line(record("FAILED", step="training_run", reason="the runner did not register"))
    assert failed == "b1  FAILED  abl at training_run: the runner did not register"


def test_an_unreachable_box_gets_its_reason() -> None:
    gone = {"host": "b2", "status": "UNREACHABLE", "reason": "Connection timed out"}
    assert lines.line(gone) == "b2  UNREACHABLE  Connection timed out"


@pytest.mark.parametrize(
    ("code", "check_mode", "said"),
    [
        ({"kind": "rsync", "files_count": 3, "deleted": [], "changed": True}, False, "code (rsync): 3 files sent"),
        (
            {"kind": "rsync", "files_count": 0, "deleted": ["x"], "changed": True},
            True,
            "code (rsync): would send 0 files, delete 1",
        ),
        ({"kind": "rsync", "files_count": 0, "deleted": [], "changed": False}, False, "code (rsync): up to date"),
        ({"kind": "git", "version": "0123456789abcdef", "changed": False}, False, "code (git): at 0123456789ab"),
        ({"kind": "rsync", "note": "/c does not exist yet: every file would be sent"}, True, "/c does not exist yet"),
    ],
)
def test_the_code_part_says_what_was_sent(code: Dict[str, Any], check_mode: bool, said: str) -> None:
    assert said in lines.line(record("STARTED", code=code, check_mode=check_mode))


def test_a_malformed_record_still_gives_a_line() -> None:
    odd = {"host": "b3", "status": "STARTED", "cells": "garbage", "shard": [1], "code": 7, "gate": "x", "changes": 5}
    assert lines.line(odd) == "b3  STARTED  ? (0 cells left)"
    assert lines.lines({"host": "b3", "status": "FAILED", "warnings": "not a list"})[0].startswith("b3  FAILED  ?")


def test_warnings_are_indented_below_the_line() -> None:
    shown = lines.lines(dict(record("STARTED"), line="L", warnings=["the runtime venv is not ready"]))
    assert shown == ["L", "  WARNING: the runtime venv is not ready"]


def test_a_host_without_a_record_is_refused_at_validate() -> None:
    missing = lines.no_record("b4")
    assert (missing["status"], missing["step"]) == ("REFUSED", "validate")
    assert missing["line"].startswith("b4  REFUSED  ? at validate: no launch record")
    assert set(missing) <= set(lines.RECORD_KEYS)


def test_the_summary_counts_statuses_and_names_the_cells_a_sharded_box_did_not_launch() -> None:
    shard = {"index": 1, "count": 2, "cells_total": 4}
    records = [
        record("STARTED", shard={"index": 0, "count": 2, "cells_total": 4}),
        record("REFUSED", host="b2", step="preflight", shard=shard, cells=[{"name": "c"}, {"name": "d"}]),
        {"host": "b3", "status": "UNREACHABLE", "reason": "gone"},
        {"host": "b4", "status": "ALREADY_RUNNING", "changed": False},
    ]
    summary = lines.summary(records)
    assert summary["line"] == (
        "4 hosts: 1 STARTED, 1 ALREADY_RUNNING, 1 REFUSED, 1 UNREACHABLE; refused: b2 (preflight); unreachable: b3; "
        "cells not launched: c, d"
    )
    assert summary["counts"] == {"STARTED": 1, "ALREADY_RUNNING": 1, "REFUSED": 1, "UNREACHABLE": 1}
    assert summary["refused"] == ["b2"] and summary["unreachable"] == ["b3"]
    assert summary["cells_not_launched"] == ["c", "d"]


def test_the_steps_that_refuse_and_the_ones_that_fail() -> None:
    assert [lines.status_of_step(step) for step in lines.STEPS] == [
        "REFUSED", "REFUSED", "FAILED", "FAILED", "REFUSED", "REFUSED", "FAILED",
    ]  # fmt: skip
    assert set(lines.FAILING) < set(lines.STATUSES)
