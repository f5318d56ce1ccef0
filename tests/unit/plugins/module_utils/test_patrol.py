"""What patrol_facts gathers, on run directories the real runner wrote with the fake training program."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _patrol, _patrol_gpus
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    compile_progress,
    compile_signatures,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    kill_session,
    make_run,
    start_runner,
    train,
    wait_for,
)

SCANNING = {"signatures": compile_signatures([]), "progress": compile_progress(None), "max_bytes": 2**20}


def params(root: Path, **more: Any) -> Dict[str, Any]:
    base = {
        "data_dir": str(root / "data"),
        "run": None,
        "durable_dir": None,
        "stall_after_s": 1800,
        "gpu_idle_pct": 5.0,
        "gpu_idle_samples": 10,
        "disk_pressure_pct": 100.0,  # the test machine's own disk is not under test
        "gpu_backend": "nvidia-smi",
        "kernel_log": False,
        "timeout_s": 10.0,
    }
    base.update(more)
    return base


def tick(root: Path, check_mode: bool = False, **more: Any) -> Dict[str, Any]:
    return _patrol.patrol(params(root, **more), SCANNING, check_mode)


def run_to_end(run_dir: Path) -> int:
    """The runner detached in a session of its own, as launch starts it, waited for until it ends."""
    return start_runner(run_dir).wait(timeout=60)


def files_of(run_dir: Path) -> Dict[str, Any]:
    """Every file of a run dir but the patrol's own, with its size and mtime."""
    found = {}
    for path in sorted(run_dir.rglob("*")):
        if ".patrol" not in path.relative_to(run_dir).parts and path.is_file():
            stat = path.stat()
            found[str(path.relative_to(run_dir))] = (stat.st_size, stat.st_mtime_ns)
    return found


def stop(process) -> None:
    """SIGKILL the runner's whole session: its cells run in process groups of their own."""
    kill_session(process.pid)
    process.wait(timeout=10)


def signatures(facts: Dict[str, Any]) -> List[str]:
    return sorted(found["signature"] for found in facts["crash_signatures"])


def test_a_box_without_runs_is_idle(tmp_path):
    (tmp_path / "data").mkdir()
    facts = tick(tmp_path)
    assert (facts["state"], facts["escalate"], facts["run"], facts["cells_total"]) == ("idle", False, None, 0)
    assert facts["disks"][0]["name"] == "data" and facts["disks"][0]["error"] is None
    assert facts["msg"].startswith("idle: no run on this box")


def test_a_finished_run_is_done_with_its_last_progress_and_the_cursors_saved(tmp_path):
    run_dir = make_run(
        tmp_path, [{"name": n, "command": train("--epochs", 3)} for n in ("a", "b")], artifacts=["best.pth"]
    )
    assert run_to_end(run_dir) == 0
    before = files_of(run_dir)
    facts = tick(tmp_path)
    assert (facts["state"], facts["escalate"], facts["alive"]) == ("done", False, 0)
    assert (facts["cells_done"], facts["cells_total"], facts["run"]) == (2, 2, "sweep")
    assert facts["progress"]["epoch"] == 3 and facts["progress"]["epochs_total"] == 3
    assert facts["progress"]["steps_total"] == 3 and facts["progress"]["line"].startswith("epoch 3/3 step 3/3")
    assert facts["crash_signatures"] == [] and facts["eta_s"] is None
    assert sorted(p.name for p in (run_dir / ".patrol").iterdir()) == ["a.json", "b.json"]
    assert files_of(run_dir) == before  # read-only on everything but its cursors
    assert facts["runs"][0]["cells"][0]["log_bytes"] == (run_dir / "cells" / "a" / "log").stat().st_size


def test_check_mode_writes_no_cursor(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    assert run_to_end(run_dir) == 0
    assert tick(tmp_path, check_mode=True)["state"] == "done"
    assert not (run_dir / ".patrol").exists()


def test_a_traceback_that_ended_the_run_is_crashed_with_the_exception_line(tmp_path):
    cells = [{"name": "a", "command": train()}, {"name": "b", "command": train("--crash")}]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"])
    run_to_end(run_dir)
    facts = tick(tmp_path)
    assert (facts["state"], facts["escalate"], facts["problems"], facts["actions"]) == (
        "crashed",
        True,
        ["crashed:sweep"],
        ["restart_job"],
    )
    found = {s["signature"]: s for s in facts["crash_signatures"]}
    assert found["python_traceback"]["first_line"] == "RuntimeError: fake_train: crashed at epoch 1 as asked"
    assert any("sweep/b: python_traceback" in reason for reason in facts["reasons"])
    assert (facts["cells_done"], facts["cells_total"]) == (1, 2)


def test_a_cell_killed_by_sigkill_is_crashed_as_killed(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--signal-self", 9)}], artifacts=["best.pth"])
    run_to_end(run_dir)
    facts = tick(tmp_path)
    assert facts["state"] == "crashed" and signatures(facts) == ["killed"]
    assert "signal 9" in facts["crash_signatures"][0]["first_line"]


def test_a_live_run_is_running_with_its_progress_and_a_second_tick_reads_only_new_bytes(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--epochs", 1000, "--step-s", 0.02)}])
    process = start_runner(run_dir)
    try:
        log = run_dir / "cells" / "a" / "log"
        wait_for(lambda: log.exists() and log.stat().st_size > 200, what="the cell's log")
        first = tick(tmp_path)
        assert (first["state"], first["escalate"]) == ("running", False)
        assert first["alive"] >= 2  # the runner and its cell
        assert first["progress"]["epochs_total"] == 1000 and first["progress"]["epoch"] >= 1
        assert first["eta_s"] is not None and first["eta_s"] > 0
        offset = json.loads((run_dir / ".patrol" / "a.json").read_text())["offset"]
        wait_for(lambda: log.stat().st_size > offset + 200, what="more log")
        second = tick(tmp_path)
        assert second["state"] == "running"
        cursor = json.loads((run_dir / ".patrol" / "a.json").read_text())
        assert cursor["offset"] > offset
    finally:
        stop(process)


def test_a_live_run_whose_log_stopped_growing_is_stalled(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--hang")}])
    process = start_runner(run_dir)
    try:
        log = run_dir / "cells" / "a" / "log"
        wait_for(lambda: log.exists() and b"epoch 1/2" in log.read_bytes(), what="the first step")
        time.sleep(1.2)
        facts = tick(tmp_path, stall_after_s=1)
        assert (facts["state"], facts["escalate"], facts["problems"]) == ("stalled", True, ["stalled:sweep/a"])
        assert facts["alive"] >= 2 and facts["log_idle_s"] >= 1
    finally:
        stop(process)


def test_a_runner_killed_with_cells_left_is_incomplete(tmp_path):
    run_dir = make_run(tmp_path, [{"name": n, "command": train("--forever")} for n in ("a", "b")])
    process = start_runner(run_dir)
    log = run_dir / "cells" / "a" / "log"
    wait_for(lambda: log.exists() and log.stat().st_size > 0, what="the cell's log")
    stop(process)  # the box restarted: no process left, no result written
    wait_for(lambda: tick(tmp_path)["alive"] == 0, what="the run's processes gone")
    facts = tick(tmp_path)
    assert (facts["state"], facts["problems"], facts["cells_done"], facts["cells_total"]) == (
        "incomplete",
        ["incomplete:sweep"],
        0,
        2,
    )


def test_a_nan_loss_in_a_live_run_escalates(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--nan", "--forever", "--step-s", 0.05)}])
    process = start_runner(run_dir)
    try:
        log = run_dir / "cells" / "a" / "log"
        wait_for(lambda: log.exists() and b"loss nan" in log.read_bytes(), what="a NaN loss")
        facts = tick(tmp_path)
        assert (facts["state"], facts["escalate"], facts["problems"]) == ("running", True, ["nan_loss:sweep/a"])
        assert facts["progress"]["epochs_total"] is None  # "epoch 1/inf" has no total
    finally:
        stop(process)


def test_garbage_run_json_is_unknown_and_other_runs_are_still_patrolled(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    run_to_end(run_dir)
    broken = tmp_path / "data" / "runs" / "broken"
    broken.mkdir()
    (broken / "run.json").write_bytes(b"\x00\xffnot json{")
    facts = tick(tmp_path)
    assert (facts["state"], facts["problems"]) == ("unknown", ["unreadable:broken"])
    assert {r["run"]: r["state"] for r in facts["runs"]} == {"broken": "unknown", "sweep": "done"}


def test_only_the_named_run_is_patrolled(tmp_path):
    done_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    run_to_end(done_dir)
    crashed = make_run(tmp_path, [{"name": "a", "command": train("--crash")}], name="other", artifacts=["best.pth"])
    run_to_end(crashed)
    named = tick(tmp_path, run="sweep")
    assert (named["state"], named["examined_runs"], named["run_filter"]) == ("done", ["sweep"], "sweep")
    assert tick(tmp_path)["state"] == "crashed"
    with pytest.raises(_patrol.PatrolError, match=r"^run swep is not on this box .*; the closest run there is sweep$"):
        tick(tmp_path, run="swep")


def test_monitor_samples_with_nan_and_strings_read_as_unknown(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    run_to_end(run_dir)
    now = time.time()
    lines = [
        json.dumps({"t": now, "cgroup": {"memory_current": 2**30, "memory_max": 2**33}, "gpus": [{"util_pct": 90}]}),
        '{"t": NaN, "cgroup": {"memory_current": "lots"}}',
        "not json at all",
        json.dumps({"t": now + 1, "cgroup": {"memory_current": 3 * 2**30, "memory_max": None}, "gpus": "x"}),
    ]
    (run_dir / "monitor.jsonl").write_text("\n".join(lines) + "\n")
    facts = tick(tmp_path)
    assert facts["memory"] == {
        "cgroup_current_bytes": 3 * 2**30,
        "cgroup_max_bytes": 2**33,
        "recent_peak_bytes": 3 * 2**30,
    }


def test_a_usage_probe_that_hangs_is_a_reason_not_a_hung_patrol(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(_patrol, "read_usage", lambda path: time.sleep(30))  # a dead NFS mount's statvfs
    facts = tick(tmp_path, timeout_s=0.5)
    assert facts["escalate"] is True and facts["problems"] == ["probe_failed:data"]
    assert "did not answer" in facts["disks"][0]["error"]


def test_disk_pressure_on_the_runs_durable_dir_names_it(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--forever")}])
    process = start_runner(run_dir)
    try:
        wait_for((run_dir / "cells" / "a" / "log").exists, what="the cell's log")
        facts = tick(tmp_path, disk_pressure_pct=0.0001)
        assert facts["state"] == "disk_pressure" and facts["actions"] == ["free_disk"]
        assert [d["name"] for d in facts["disks"]] == ["data", "durable"]
        assert facts["disks"][1]["path"] == str(tmp_path / "durable")
        assert set(facts["problems"]) == {"disk_pressure:data", "disk_pressure:durable"}
    finally:
        stop(process)


def test_nvidia_smi_missing_is_a_note_not_an_escalation(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = tick(tmp_path)
    assert (facts["state"], facts["escalate"], facts["gpu"], facts["gpu_error"]) == (
        "idle",
        False,
        [],
        "nvidia-smi not found",
    )
    assert "GPU reading: nvidia-smi not found" in facts["reasons"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "0, 97, 70211, 81559, 00000000:18:00.0\n1, [N/A], [N/A], 81559, 00000000:28:00.0\n",
            [(0, 97.0, 70211.0, "00000000:18:00.0"), (1, None, None, "00000000:28:00.0")],
            id="a-lost-gpu-reads-as-unknown",
        ),
        pytest.param("garbage\n0, nan, inf, 1, x\n, , , , \n", [(0, None, None, "x")], id="garbage"),
        pytest.param("Unable to determine the device handle for GPU0000:28:00.0: Unknown Error\n", [], id="error"),
    ],
)
def test_the_nvidia_smi_query_lines(text, expected):
    gpus = _patrol_gpus._smi_gpus(text)
    assert [(g["index"], g["utilization_pct"], g["memory_used_mib"], g["pci_bus_id"]) for g in gpus] == expected


def fake_nvidia_smi(tmp_path: Path, output: str, rc: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\nexit {rc}\n")
    script.chmod(0o755)


def test_a_gpu_nvidia_smi_cannot_get_a_handle_for_is_lost_and_escalates_with_re_rent(tmp_path, monkeypatch):
    # What nvidia-smi prints, and exits 15 with, when one of two GPUs fell off the bus.
    fake_nvidia_smi(
        tmp_path,
        "0, 91, 70211, 81559, 00000000:18:00.0\n"
        "Unable to determine the device handle for GPU0000:28:00.0: Unknown Error\n",
        15,
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    (tmp_path / "data").mkdir()
    facts = tick(tmp_path)
    assert facts["gpu_error"] is None and [g["index"] for g in facts["gpu"]] == [0]
    assert (facts["escalate"], facts["problems"], facts["actions"]) == (
        True,
        ["gpu_lost:00000000:28:00.0"],
        ["re_rent"],
    )
    assert "the GPU at 00000000:28:00.0 is lost" in facts["reasons"][0]


def test_nvidia_smi_that_fails_with_no_rows_is_a_note_naming_its_exit_code(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    (tmp_path / "data").mkdir()
    facts = tick(tmp_path)
    assert (facts["gpu_error"], facts["escalate"]) == ("nvidia-smi exited 9", False)


def test_cells_scanned_after_half_the_deadline_read_only_a_tail_and_catch_up_later(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    assert run_to_end(run_dir) == 0
    log = run_dir / "cells" / "a" / "log"
    with log.open("ab") as handle:
        handle.write(b"epoch 9/9 step 1/1 loss 0.1000\n" * 20000)  # about 600 KiB
    out_of_time = dict(SCANNING, notes=[], stall_after_s=1800, timeout_s=0.0)
    _patrol.scan_runs(str(tmp_path / "data"), None, out_of_time, True)
    cursor = json.loads((run_dir / ".patrol" / "a.json").read_text())
    assert cursor["offset"] == _patrol.BEHIND_SCAN_BYTES < log.stat().st_size
    facts = tick(tmp_path)  # in time: the cursor moves on from there
    assert facts["progress"]["epoch"] == 9
    assert json.loads((run_dir / ".patrol" / "a.json").read_text())["offset"] == log.stat().st_size
