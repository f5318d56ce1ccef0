"""Per-cell truth in patrol_facts' decision table: each cell judged on its own log, GPUs and processes."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import fraction, run_eta, run_summary
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import (
    decide_box,
    decide_run,
    headline,
)

OPTIONS = {"stall_after_s": 1800, "gpu_idle_pct": 5.0, "gpu_idle_samples": 3, "disk_pressure_pct": 95.0}


def cell(name: str, status: Optional[str] = "running", **more: Any) -> Dict[str, Any]:
    base = {"name": name, "status": status, "done": status == "succeeded", "crash_signatures": [], "log_idle_s": 5.0}
    base.update(more)
    return base


def live(*cells: Dict[str, Any], **view: Any) -> Dict[str, Any]:
    base = {"run": "sweep", "problem": None, "runner_alive": True, "alive": 4, "done_marker": False}
    return dict(base, cells=list(cells), cells_total=len(cells), **view)


def dead(*cells: Dict[str, Any], **view: Any) -> Dict[str, Any]:
    return live(*cells, **dict({"runner_alive": False, "alive": 0}, **view))


def signature(name: str, line: str) -> Dict[str, Any]:
    return {"signature": name, "count": 1, "first_line": line}


def sample(**utils: float) -> Dict[str, Any]:
    return {"t": 1.0, "gpus": [{"index": int(i[1:]), "util_pct": u} for i, u in utils.items()]}


def epoch(done: int, total: int) -> Dict[str, Any]:
    return {"epoch": done, "epochs_total": total, "step": None, "steps_total": None, "line": f"epoch {done}/{total}"}


def box(*runs: Dict[str, Any]) -> Dict[str, Any]:
    verdict = decide_box(list(runs), disks=[], xids=[], probe_errors={}, notes=[], options=OPTIONS).as_dict()
    return verdict


def test_a_hung_cell_is_stalled_whatever_its_progressing_siblings_do():
    run = live(cell("a", log_idle_s=2.0, gpus=[0]), cell("b", log_idle_s=4000.0, gpus=[1]))
    verdict = decide_run(run, OPTIONS)
    assert (verdict.state, verdict.problems) == ("stalled", ["stalled:sweep/b"])
    assert verdict.reasons[0].startswith("sweep/b: its log has not grown for 4000 s")
    assert [c["state"] for c in run["cells"]] == ["running", "stalled"]


def test_a_silent_cell_whose_own_gpus_are_busy_is_running_and_one_whose_gpus_are_idle_is_stalled():
    samples = [sample(g0=0.0, g1=97.0), sample(g0=1.0, g1=95.0)]
    busy = cell("busy", log_idle_s=4000.0, gpus=[1])
    idle = cell("idle", log_idle_s=4000.0, gpus=[0])
    verdict = decide_run(live(busy, idle, monitor_samples=samples), OPTIONS)
    assert (busy["state"], busy["silent_gpus_busy"]) == ("running", True)
    assert (idle["state"], idle["silent_gpus_busy"]) == ("stalled", False)
    assert verdict.problems == ["stalled:sweep/idle"]
    assert "sweep/busy: silent, GPUs busy (its log has not grown for 4000 s)" in verdict.reasons
    assert any(r.startswith("sweep/idle: its log has not grown") and "GPU 0" in r for r in verdict.reasons)


def test_eta_counts_the_cells_running_in_parallel_and_the_slots_left():
    # 3 slots, 3 cells a quarter through after 15 s: 45 s left (the run-as-one-thing formula said 165 s).
    three = [cell(n, progress=epoch(2, 4), elapsed_s=15.0) for n in "abc"]
    run = live(*three, slots=3)
    decide_run(run, OPTIONS)
    assert [c["eta_s"] for c in three] == [45, 45, 45] and run["eta_s"] == 45
    # A fourth cell waits for the first free slot, then takes a cell's time (60 s).
    four = [cell(n, progress=epoch(2, 4), elapsed_s=15.0) for n in "abc"] + [cell("d", "pending")]
    run = live(*four, slots=3)
    decide_run(run, OPTIONS)
    assert run["eta_s"] == 105


def test_a_run_with_a_stalled_cell_has_no_eta():
    run = live(cell("a", progress=epoch(2, 4), elapsed_s=15.0), cell("b", log_idle_s=4000.0), slots=2)
    decide_run(run, OPTIONS)
    assert run["eta_s"] is None and run["cells"][0]["eta_s"] == 45


def test_progress_never_comes_from_a_failed_cells_last_line():
    failed = cell("a", "failed", exit_code=1, progress=epoch(9, 10))
    running = cell("b", progress=epoch(2, 10), elapsed_s=10.0)
    run = live(failed, running, slots=2)
    decide_run(run, OPTIONS)
    assert (run["current_cell"], run["progress"]["epoch"]) == ("b", 2)
    assert failed["progress_fraction"] is None and running["progress_fraction"] == 0.1


def test_no_space_left_in_a_live_cells_log_escalates_disk_full_with_free_disk():
    full = signature("disk_full", "OSError: [Errno 28] No space left on device: '/data/ckpt/last.pt'")
    verdict = decide_run(live(cell("a", crash_signatures=[full])), OPTIONS)
    assert (verdict.problems, verdict.actions) == (["disk_full:sweep/a"], ["free_disk"])
    ended = decide_run(dead(cell("a", "failed", exit_code=1, crash_signatures=[full])), OPTIONS)
    assert ended.state == "crashed" and "disk_full:sweep/a" in ended.problems and "free_disk" in ended.actions


def test_a_nan_seen_stays_flagged_on_a_run_that_ended_done():
    nan = signature("nan_loss", "epoch 1/2 step 1/3 loss nan")
    run = dead(cell("a", "succeeded", crash_signatures=[nan]), done_marker=True)
    verdict = decide_run(run, OPTIONS)
    assert (verdict.state, verdict.escalate, verdict.problems) == ("done", True, ["nan_loss:sweep/a"])
    assert run["cells"][0]["nan_seen"] is True


def test_a_lost_log_is_a_reason_of_its_own_and_no_stall():
    gone = cell("a", lost="log deleted (was 1234 bytes)", log_exists=False, log_idle_s=4000.0)
    verdict = decide_run(live(gone), OPTIONS)
    assert (verdict.state, verdict.problems) == ("running", ["log_lost:sweep/a"])
    assert verdict.reasons == ["sweep/a: log deleted (was 1234 bytes); what it said before is kept"]


def test_a_dead_runner_with_a_cell_still_alive_is_runner_gone_not_a_restart():
    run = dead(cell("a", "pending", alive=True, started=True, log_idle_s=3.0), cell("b", "pending"))
    verdict = decide_run(run, OPTIONS)
    assert (verdict.state, verdict.problems, verdict.actions) == ("runner_gone", ["runner_gone:sweep"], ["investigate"])
    assert "let it finish, or stop it" in verdict.reasons[0] and "cell a still runs" in verdict.reasons[0]
    assert run["cells"][0]["state"] == "running" and run["cells"][1]["state"] == "pending"


def test_a_cell_that_died_with_its_runner_is_crashed_and_one_never_started_is_pending():
    run = dead(cell("a", "pending", started=True), cell("b", "pending"))
    verdict = decide_run(run, OPTIONS)
    assert [c["state"] for c in run["cells"]] == ["crashed", "pending"] and verdict.state == "incomplete"


def runs_named(*pairs: Any) -> List[Dict[str, Any]]:
    return [dict(run, run=name) for name, run in pairs]


def test_the_headline_names_the_run_its_state_comes_from_with_that_runs_counts():
    crash = signature("python_traceback", "RuntimeError: boom")
    alpha = dead(
        cell("a", "succeeded"), cell("b", "failed", exit_code=1, crash_signatures=[crash]), cell("c", "pending")
    )
    beta = dead(cell("a", "succeeded"), done_marker=True, started_at_s=2.0)
    runs = runs_named(("alpha", alpha), ("beta", beta))
    verdict = box(*runs)
    line, named = headline(verdict, runs, runs[1])
    assert (line, named["run"]) == ("CRASHED run alpha: 1/3 cells done", "alpha")


def test_the_headline_counts_the_runs_that_need_attention():
    alpha = dead(cell("a", "pending"))
    beta = live(cell("a", log_idle_s=4000.0))
    runs = runs_named(("alpha", alpha), ("beta", beta))
    line, named = headline(box(*runs), runs, runs[1])
    assert (line, named) == ("2 runs need attention: alpha incomplete, beta stalled", None)


def test_the_summary_is_one_compact_line_per_run():
    cells = [
        cell("a", "succeeded"),
        cell("b", progress=epoch(3, 8), elapsed_s=30.0),
        cell("c", log_idle_s=4000.0),
        cell("d", "pending"),
    ]
    run = live(*cells, run="alpha", slots=2)
    run.update(decide_run(run, OPTIONS).as_dict())
    assert run_summary(run) == "alpha: stalled, 1/4 done, 1 running 25%, 1 stalled (c), 1 pending"


def test_run_eta_without_anything_to_time_a_pending_cell_is_unknown():
    assert run_eta([{"state": "pending"}], 2, True) is None


def test_a_step_within_an_epoch_of_unknown_count_is_no_progress_of_the_cell() -> None:
    # "epoch 11 step 3/10" of an endless run: 30% of an epoch, not 30% of the cell (no percentage, no ETA).
    assert fraction({"epoch": 11, "epochs_total": None, "step": 3, "steps_total": 10}) is None
    assert fraction({"epoch": None, "epochs_total": None, "step": 3, "steps_total": 10}) == 0.3
    assert fraction({"epoch": 2, "epochs_total": 4, "step": 5, "steps_total": 10}) == 0.375


def test_a_stall_reason_on_one_gpu_reads_is_not_busy() -> None:
    hung = cell("hung", gpus=[1], log_idle_s=4000.0, alive=True)
    verdict = decide_run(live(hung, gpus=[1], monitor_samples=[sample(g1=0.0)]), OPTIONS)
    assert any("hung: its log has not grown for 4000 s (stall_after_s 1800) and its GPU 1 is not busy" in r
               for r in verdict.reasons)  # fmt: skip
