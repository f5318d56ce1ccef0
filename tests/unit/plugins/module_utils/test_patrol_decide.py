"""patrol_facts' decision table, row by row, over the plain dicts ``_patrol`` gathers."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import (
    decide_box,
    decide_run,
    gpu_idle,
)

OPTIONS = {"stall_after_s": 1800, "gpu_idle_pct": 5.0, "gpu_idle_samples": 3, "disk_pressure_pct": 95.0}


def cell(name: str, status: Optional[str], done: bool = False, signatures: Optional[List] = None, **more: Any):
    return dict({"name": name, "status": status, "done": done, "crash_signatures": signatures or []}, **more)


def signature(name: str, line: str) -> Dict[str, Any]:
    return {"signature": name, "count": 1, "first_line": line}


def samples(*utils: Optional[float]) -> List[Dict[str, Any]]:
    return [{"t": 1000.0 + i, "gpus": [{"util_pct": u}]} for i, u in enumerate(utils)]


def a_run(**view: Any) -> Dict[str, Any]:
    base = {"run": "sweep", "problem": None, "alive": 0, "done_marker": False, "log_idle_s": 10.0, "cells": []}
    base.update(view)
    return base


def box(runs=(), disks=(), xids=(), probe_errors=None, notes=()):
    return decide_box(
        list(runs),
        disks=list(disks),
        xids=list(xids),
        probe_errors=probe_errors or {},
        notes=list(notes),
        options=OPTIONS,
    )


def live(**view: Any) -> Dict[str, Any]:
    """A run whose runner lives."""
    return a_run(runner_alive=True, alive=view.pop("alive", 1), **view)


def test_alive_and_progressing_is_running_and_not_escalated():
    verdict = decide_run(live(alive=3, cells=[cell("a", "running")], monitor_samples=samples(90, 95, 97)), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems) == ("running", False, [])


def test_alive_with_logs_idle_for_stall_after_s_is_stalled():
    verdict = decide_run(live(cells=[cell("a", "running", log_idle_s=1800.0)]), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems, verdict.actions) == (
        "stalled",
        True,
        ["stalled:sweep/a"],
        ["investigate"],
    )
    assert verdict.reasons[0].startswith("sweep/a: its log has not grown for 1800 s")


def test_alive_with_logs_idle_just_under_stall_after_s_is_running():
    assert decide_run(live(cells=[cell("a", "running", log_idle_s=1799.0)]), OPTIONS).state == "running"


def test_alive_with_every_gpu_idle_over_the_recent_samples_is_stalled():
    verdict = decide_run(live(cells=[cell("a", "running")], monitor_samples=samples(95, 0, 1, 0)), OPTIONS)
    assert (verdict.state, verdict.problems) == ("stalled", ["stalled:sweep/a"])
    assert "utilization" in verdict.reasons[0]


@pytest.mark.parametrize(
    "utils",
    [
        pytest.param((0, 0), id="fewer-samples-than-needed"),
        pytest.param((0, 50, 0), id="one-busy-sample"),
        pytest.param((0, None, 0), id="an-unread-gpu-is-no-evidence"),
        pytest.param((0, math.nan, 0), id="nan-is-no-evidence"),
    ],
)
def test_gpu_idle_needs_every_recent_sample_to_show_every_gpu_idle(utils):
    assert gpu_idle(samples(*utils), 5.0, 3) is False


def test_gpu_idle_ignores_samples_without_a_gpu_reading_and_zero_needed_is_off():
    readings = [*samples(0, 0), {"t": 2000.0, "gpus": None}, *samples(0)]
    assert gpu_idle(readings, 5.0, 3) is True
    assert gpu_idle(readings, 5.0, 0) is False


def test_gpu_idle_looks_at_every_gpu_of_a_sample():
    two = [{"t": 1.0, "gpus": [{"util_pct": 0}, {"util_pct": 80}]}] * 3
    assert gpu_idle(two, 5.0, 3) is False


def test_a_nan_loss_in_a_live_run_escalates_with_that_reason_and_keeps_the_state():
    nan = signature("nan_loss", "epoch 2/5 step 3/10 loss nan")
    verdict = decide_run(live(alive=2, cells=[cell("a", "running", signatures=[nan])]), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems) == ("running", True, ["nan_loss:sweep/a"])
    assert "loss nan" in verdict.reasons[0]


def test_a_failed_cell_in_a_live_run_escalates_with_its_exception_line_and_retries_left():
    traceback = signature("python_traceback", "ValueError: bad shape (3, 4)")
    failed = cell("a", "failed", exit_code=1, attempts=2, retries=1, signatures=[traceback])
    verdict = decide_run(live(cells=[failed, cell("b", "running")]), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems, verdict.actions) == (
        "running",
        True,
        ["cell_failed:sweep/a"],
        ["investigate"],
    )
    assert verdict.reasons == [
        "sweep/a: failed (exit 1) after 2 attempts, 0 retries left: ValueError: bad shape (3, 4); "
        "the run goes on with its other cells"
    ]


def test_not_alive_with_done_and_every_cell_done_is_done():
    cells = [cell("a", "succeeded", done=True), cell("b", "succeeded", done=True)]
    verdict = decide_run(a_run(done_marker=True, cells=cells), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.reasons) == ("done", False, [])


def test_a_cell_that_exited_0_but_whose_sync_failed_is_sync_failed_not_crashed():
    error = "rsync: write failed on /durable/runs/sweep/cells/b/best.pth: No space left on device (28)"
    cells = [cell("a", "succeeded", done=True), cell("b", "succeeded", done=False, sync="failed", sync_error=error)]
    verdict = decide_run(a_run(done_marker=False, cells=cells), OPTIONS)
    assert (verdict.state, verdict.problems, verdict.actions) == ("sync_failed", ["sync_failed:sweep/b"], ["free_disk"])
    assert verdict.reasons == [f"sweep/b: exited 0 but its sync failed: {error}"]
    assert cells[1]["state"] == "sync_failed"


def test_a_sync_failure_for_another_cause_is_investigated():
    cells = [cell("b", "succeeded", sync="failed", sync_error="manifest mismatch: best.pth")]
    verdict = decide_run(a_run(cells=cells), OPTIONS)
    assert (verdict.state, verdict.actions) == ("sync_failed", ["investigate"])


def test_not_alive_with_cells_missing_and_a_crash_signature_is_crashed():
    oom = signature("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    cells = [
        cell("a", "succeeded", done=True),
        cell("b", "failed", signatures=[oom], exit_code=1),
        cell("c", "pending"),
    ]
    verdict = decide_run(a_run(cells=cells), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems, verdict.actions) == (
        "crashed",
        True,
        ["crashed:sweep"],
        ["restart_job"],
    )
    assert "2 of 3 cells not done (b, c)" in verdict.reasons[0]
    assert verdict.reasons[1] == f"sweep/b: cuda_oom ({oom['first_line']})"


def test_a_signature_in_a_cell_that_finished_does_not_explain_the_end():
    traceback = signature("python_traceback", "ValueError: retried and recovered")
    cells = [cell("a", "succeeded", done=True, signatures=[traceback]), cell("b", "pending")]
    assert decide_run(a_run(cells=cells), OPTIONS).state == "incomplete"


def test_a_nan_loss_alone_does_not_explain_a_dead_run():
    nan = signature("nan_loss", "loss=nan")
    assert decide_run(a_run(cells=[cell("a", "failed", signatures=[nan])]), OPTIONS).state == "incomplete"


def test_not_alive_with_cells_missing_and_nothing_in_the_logs_is_incomplete():
    verdict = decide_run(a_run(cells=[cell("a", "pending"), cell("b", "pending")]), OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems, verdict.actions) == (
        "incomplete",
        True,
        ["incomplete:sweep"],
        ["restart_job"],
    )


def test_an_unreadable_run_is_unknown_and_escalated():
    verdict = decide_run(a_run(problem="run.json of sweep cannot be read (garbage)"), OPTIONS)
    assert (verdict.state, verdict.problems, verdict.actions) == ("unknown", ["unreadable:sweep"], ["investigate"])


def test_no_run_on_the_box_is_idle():
    verdict = box()
    assert (verdict.state, verdict.escalate, verdict.reasons) == ("idle", False, [])


@pytest.mark.parametrize("key", ["bytes_used_pct", "inodes_used_pct"])
def test_disk_bytes_or_inodes_at_the_threshold_is_disk_pressure(key):
    disk = {"name": "data", "path": "/data", "bytes_used_pct": 10.0, "inodes_used_pct": 10.0}
    disk[key] = 95.0
    verdict = box(runs=[live()], disks=[disk])
    assert (verdict.state, verdict.escalate, verdict.problems, verdict.actions) == (
        "disk_pressure",
        True,
        ["disk_pressure:data"],
        ["free_disk"],
    )


def test_disk_just_under_the_threshold_and_nan_readings_are_not_pressure():
    disks = [
        {"name": "data", "path": "/data", "bytes_used_pct": 94.9, "inodes_used_pct": math.nan},
        {"name": "durable", "path": "/d", "bytes_used_pct": math.inf, "inodes_used_pct": "99"},
    ]
    verdict = box(runs=[live()], disks=disks)
    assert (verdict.state, verdict.escalate) == ("running", False)


def test_a_disk_probe_that_hung_escalates_without_changing_the_state():
    hung = {"name": "durable", "path": "/mnt/nas", "error": "did not answer the usage probe within the deadline"}
    verdict = box(runs=[live()], disks=[hung])
    assert (verdict.state, verdict.problems) == ("running", ["probe_failed:durable"])


def test_a_crashed_run_outranks_disk_pressure_and_both_are_reported():
    disk = {"name": "data", "path": "/data", "bytes_used_pct": 99.0, "inodes_used_pct": 1.0}
    verdict = box(runs=[a_run(cells=[cell("a", "pending")])], disks=[disk])
    assert verdict.state == "incomplete"
    assert verdict.problems == ["incomplete:sweep", "disk_pressure:data"]
    assert verdict.actions == ["restart_job", "free_disk"]


def test_the_box_takes_the_worst_run_and_records_each_runs_verdict():
    done = a_run(run="old", done_marker=True, cells=[cell("a", "succeeded", done=True)])
    stalled = live(run="new", cells=[cell("a", "running", log_idle_s=4000.0)])
    runs = [done, stalled]
    verdict = box(runs=runs)
    assert (verdict.state, verdict.problems) == ("stalled", ["stalled:new/a"])
    assert (runs[0]["state"], runs[1]["state"], runs[1]["escalate"]) == ("done", "stalled", True)


def test_a_gpu_lost_xid_escalates_a_running_box_with_re_rent():
    lost = {
        "code": "gpu_lost",
        "level": "FAIL",
        "gpu": 0,
        "message": "GPU 0 fell off the bus (Xid 79)",
        "action": "re_rent",
    }
    app = {"code": "xid_application", "level": "WARN", "gpu": 0, "message": "Xid 13 on GPU 0", "action": "investigate"}
    verdict = box(runs=[live()], xids=[lost, app])
    assert (verdict.state, verdict.escalate, verdict.problems, verdict.actions) == (
        "running",
        True,
        ["gpu_lost:0"],
        ["re_rent"],
    )
    assert verdict.reasons == ["GPU 0 fell off the bus (Xid 79)", "Xid 13 on GPU 0"]


def test_an_xid_without_a_gpu_index_is_named_by_its_pci_address():
    lost = {
        "code": "gpu_lost",
        "level": "FAIL",
        "gpu": None,
        "pci": "0000:3b:00.0",
        "message": "m",
        "action": "re_rent",
    }
    assert box(xids=[lost]).problems == ["gpu_lost:0000:3b:00.0"]


def test_a_probe_that_failed_is_unknown_and_notes_are_only_reasons():
    verdict = box(probe_errors={"runs": "runs: timed out"}, notes=["GPU reading: nvidia-smi not found"])
    assert (verdict.state, verdict.problems) == ("unknown", ["probe_failed:runs"])
    assert verdict.reasons == ["runs: timed out", "GPU reading: nvidia-smi not found"]


@pytest.mark.parametrize("idle", [math.nan, math.inf, "3600", True, None])
def test_a_log_idle_that_is_not_a_finite_number_never_stalls(idle):
    assert decide_run(live(cells=[cell("a", "running", log_idle_s=idle)]), OPTIONS).state == "running"
