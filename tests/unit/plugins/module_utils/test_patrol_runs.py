"""Per-cell truth on real run directories: the real runner, the fake training program, real processes and files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
    COLLECTIONS,
    alive,
    kill_session,
    make_run,
    start_runner,
    train,
    wait_for,
)

SCANNING = {"signatures": compile_signatures([]), "progress": compile_progress(None), "max_bytes": 2**20}


def tick(root: Path, **more: Any) -> Dict[str, Any]:
    params = {
        "data_dir": str(root / "data"), "run": None, "durable_dir": None, "stall_after_s": 1800, "gpu_idle_pct": 5.0,
        "gpu_idle_samples": 10, "disk_pressure_pct": 100.0, "gpu_backend": "nvidia-smi", "kernel_log": False,
        "timeout_s": 10.0, "venv": None,
    }  # fmt: skip
    params.update(more)
    return _patrol.patrol(params, SCANNING, False)


def cells_of(facts: Dict[str, Any], run: str) -> Dict[str, Dict[str, Any]]:
    found = next(r for r in facts["runs"] if r["run"] == run)
    return {c["name"]: c for c in found["cells"]}


def log_of(run_dir: Path, cell: str) -> Path:
    return run_dir / "cells" / cell / "log"


def has(path: Path, text: bytes) -> bool:
    return path.exists() and text in path.read_bytes()


def stop(process: subprocess.Popen) -> None:
    kill_session(process.pid)
    process.wait(timeout=10)


def test_two_runs_packed_cells_one_hung_one_failing_beside_a_healthy_run(tmp_path):
    cells = [
        {"name": "ok", "command": train("--forever", "--step-s", 0.05)},
        {"name": "hung", "command": train("--hang")},
        {"name": "bad", "command": train("--crash")},
    ]
    alpha = make_run(tmp_path, cells, name="alpha", gpus=[0, 1, 2], gpus_per_cell=1)
    beta = make_run(tmp_path, [{"name": "one", "command": train("--forever", "--step-s", 0.05)}], name="beta")
    runners = [start_runner(alpha), start_runner(beta)]
    try:
        wait_for(lambda: has(log_of(alpha, "hung"), b"epoch 1/2"), what="the hung cell's first step")
        wait_for((alpha / "cells" / "bad" / "result.json").exists, what="the failing cell's result")
        wait_for(lambda: has(log_of(beta, "one"), b"epoch 1/"), what="beta's first step")
        time.sleep(1.5)
        facts = tick(tmp_path, stall_after_s=1)
        assert facts["state"] == "stalled" and facts["examined_runs"] == ["alpha", "beta"]
        assert set(facts["problems"]) == {"stalled:alpha/hung", "cell_failed:alpha/bad"}
        assert facts["headline"] == "STALLED run alpha: 0/3 cells done"
        alpha_cells = cells_of(facts, "alpha")
        states = {name: c["state"] for name, c in alpha_cells.items()}
        assert states == {"ok": "running", "hung": "stalled", "bad": "failed"}
        assert alpha_cells["bad"]["exception"] == "RuntimeError: fake_train: crashed at epoch 1 as asked"
        assert alpha_cells["bad"]["retries_left"] == 0 and alpha_cells["bad"]["progress_fraction"] is None
        assert sorted(c["gpus"][0] for c in alpha_cells.values()) == [0, 1, 2]
        assert all(c["alive"] for n, c in alpha_cells.items() if n != "bad") and not alpha_cells["bad"]["alive"]
        assert any(r.startswith("alpha/hung: its log has not grown") for r in facts["reasons"])
        assert any(r.startswith("alpha/bad: failed (exit 1) after 1 attempt, 0 retries left") for r in facts["reasons"])
        beta_run = next(r for r in facts["runs"] if r["run"] == "beta")
        assert (beta_run["state"], beta_run["escalate"]) == ("running", False)
        alpha_run = next(r for r in facts["runs"] if r["run"] == "alpha")
        assert alpha_run["eta_s"] is None and alpha_run["summary"].startswith("alpha: stalled, 0/3 done, 1 running")
    finally:
        for runner in runners:
            stop(runner)


def test_a_silent_cell_whose_own_gpu_is_busy_in_monitor_jsonl_is_not_stalled(tmp_path):
    cells = [{"name": n, "command": train("--hang")} for n in ("c0", "c1")]
    run_dir = make_run(tmp_path, cells, gpus=[0, 1], gpus_per_cell=1)
    runner = start_runner(run_dir)
    try:
        for name in ("c0", "c1"):
            wait_for(lambda name=name: has(log_of(run_dir, name), b"epoch 1/2"), what=f"{name}'s first step")
        gpu_of = {c["name"]: c["gpus"][0] for c in json.loads((run_dir / "run.json").read_text())["cells"]}
        busy = {gpu_of["c1"]: 96.0, gpu_of["c0"]: 0.0}
        time.sleep(1.2)
        sample = {"t": time.time(), "gpus": [{"index": i, "util_pct": u} for i, u in sorted(busy.items())]}
        with (run_dir / "monitor.jsonl").open("a") as handle:
            handle.write(json.dumps(sample) + "\n")
        facts = tick(tmp_path, stall_after_s=1)
        found = cells_of(facts, "sweep")
        assert (found["c1"]["state"], found["c1"]["silent_gpus_busy"]) == ("running", True)
        assert (found["c0"]["state"], found["c0"]["silent_gpus_busy"]) == ("stalled", False)
        assert facts["problems"] == ["stalled:sweep/c0"]
        assert any(r.startswith("sweep/c1: silent, GPUs busy") for r in facts["reasons"])
    finally:
        stop(runner)


def test_a_log_with_a_future_mtime_still_stalls_on_the_ticks_clock(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--hang")}])
    runner = start_runner(run_dir)
    try:
        log = log_of(run_dir, "a")
        wait_for(lambda: has(log, b"epoch 1/2"), what="the first step")
        assert tick(tmp_path, stall_after_s=1)["problems"] == []
        with log.open("ab") as handle:
            handle.write(b"one more line, then nothing\n")
        future = time.time() + 7200  # a clock stepped back, or a volume whose server runs ahead
        os.utime(log, (future, future))
        assert tick(tmp_path, stall_after_s=1)["problems"] == []  # it grew: seen on this tick's clock
        time.sleep(1.2)
        facts = tick(tmp_path, stall_after_s=1)
        assert facts["problems"] == ["stalled:sweep/a"] and cells_of(facts, "sweep")["a"]["log_idle_s"] >= 1
    finally:
        stop(runner)


def test_a_dead_runner_whose_cell_still_runs_says_let_it_finish_not_restart(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--forever", "--step-s", 0.05)}])
    runner = start_runner(run_dir)
    try:
        wait_for(lambda: has(log_of(run_dir, "a"), b"epoch 1/"), what="the first step")
        os.kill(runner.pid, signal.SIGKILL)  # the runner only: its cell lives on
        runner.wait(timeout=10)
        facts = tick(tmp_path)
        assert (facts["state"], facts["problems"], facts["actions"]) == (
            "runner_gone",
            ["runner_gone:sweep"],
            ["investigate"],
        )
        assert "let it finish, or stop it" in facts["reasons"][0] and "restart_job" not in facts["actions"]
        assert cells_of(facts, "sweep")["a"]["alive"] is True and facts["alive"] == 1
    finally:
        stop(runner)


def test_no_space_in_a_live_cells_log_escalates_disk_full_during_the_run(tmp_path):
    cells = [{"name": "a", "command": train("--forever", "--step-s", 0.05)}]
    run_dir = make_run(tmp_path, cells)
    runner = start_runner(run_dir)
    try:
        log = log_of(run_dir, "a")
        wait_for(lambda: has(log, b"epoch 1/"), what="the first step")
        with log.open("ab") as handle:
            handle.write(b"OSError: [Errno 28] No space left on device: '/data/ckpt/last.pt'\n")
        facts = tick(tmp_path)
        assert (facts["state"], facts["problems"], facts["actions"]) == (
            "running",
            ["disk_full:sweep/a"],
            ["free_disk"],
        )
    finally:
        stop(runner)


def test_a_nan_then_a_deleted_log_stay_flagged_after_the_run_ends_done(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--nan")}])
    assert start_runner(run_dir).wait(timeout=60) == 0
    first = tick(tmp_path)
    assert (first["state"], first["problems"]) == ("done", ["nan_loss:sweep/a"])
    assert cells_of(first, "sweep")["a"]["nan_seen"] is True
    log_of(run_dir, "a").unlink()
    second = tick(tmp_path)
    assert second["state"] == "done"
    assert second["problems"] == ["nan_loss:sweep/a", "log_lost:sweep/a"]
    assert cells_of(second, "sweep")["a"]["lost"].startswith("log deleted (was ")
    assert "cleared" not in " ".join(second["reasons"])


def test_an_exit_0_whose_sync_hit_enospc_is_sync_failed_with_free_disk_not_crashed(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train()}], artifacts=["best.pth"])
    assert start_runner(run_dir).wait(timeout=60) == 0
    result_path = run_dir / "cells" / "a" / "result.json"
    result = json.loads(result_path.read_text())
    error = "copy of best.pth failed: [Errno 28] No space left on device"
    result.update(sync="failed", sync_error=error, artifacts=[])
    result_path.write_text(json.dumps(result))
    (run_dir / "DONE").unlink()
    with log_of(run_dir, "a").open("a") as handle:
        handle.write(f"[rgt 2026-12-03T10:00:00Z] SYNC FAILED: {error} (the scratch copy is kept)\n")
    facts = tick(tmp_path)
    assert (facts["state"], facts["problems"], facts["actions"]) == (
        "sync_failed",
        ["sync_failed:sweep/a"],
        ["free_disk"],
    )
    found = cells_of(facts, "sweep")["a"]
    assert (found["state"], found["sync_error"]) == ("sync_failed", error)
    assert facts["headline"] == "SYNC_FAILED run sweep: 0/1 cells done"


def registered(root: Path, name: str, done: bool) -> None:
    run_dir = root / "data" / "runs" / name
    run_dir.mkdir(parents=True)
    record = {"schema": 1, "run": name, "started_at": "2026-12-03T10:00:00+00:00", "pgid": 2**22 + 7,
              "sid": 2**22 + 7, "pids": [2**22 + 7], "detach": "setsid", "cells": [{"name": "a"}]}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(record))
    if done:
        (run_dir / "DONE").write_text("{}")
        stamp = time.time() - 3600 + ord(name[0])  # DONE times in name order, whatever the clock's granularity
        os.utime(run_dir / "DONE", (stamp, stamp))


def test_over_max_runs_the_unfinished_ones_are_always_patrolled_and_the_skipped_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(_patrol, "MAX_RUNS", 3)
    for name, done in (("a-crashed", False), ("b-crashed", False), ("c-done", True), ("d-done", True), ("e", True)):
        registered(tmp_path, name, done)
    archived = tmp_path / "data" / "runs" / ".archive" / "old-20261203T100000Z"
    archived.mkdir(parents=True)
    (archived / "run.json").write_text("{}")
    facts = tick(tmp_path)
    assert facts["examined_runs"] == ["a-crashed", "b-crashed", "e"]  # and the newest finished one
    assert (facts["runs_skipped"], facts["runs_archived"]) == (2, 1)
    assert "2 finished runs not patrolled (over 3 runs on the box)" in facts["reasons"]
    assert {"incomplete:a-crashed", "incomplete:b-crashed"} <= set(facts["problems"])


def test_an_archived_run_asked_for_by_name_says_where_it_went(tmp_path):
    registered(tmp_path, "sweep", True)
    (tmp_path / "data" / "runs" / ".archive" / "old-20261203T100000Z").mkdir(parents=True)
    with pytest.raises(_patrol.PatrolError, match=r"^run old is not on this box: it was archived as "):
        tick(tmp_path, run="old")


def test_a_hung_data_dir_answers_within_the_rounds_with_reasons_naming_it(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()

    def hang(*_args: Any) -> None:  # a dead NFS mount under the data dir
        time.sleep(30)

    monkeypatch.setattr(_patrol, "select_runs", hang)
    monkeypatch.setattr(_patrol, "read_usage", hang)
    monkeypatch.setattr(_patrol_gpus, "add_venv", hang)
    started = time.monotonic()
    facts = tick(tmp_path, timeout_s=0.5, gpu_backend="auto", venv=str(tmp_path / "data" / "venv"))
    assert time.monotonic() - started < 10
    data = str(tmp_path / "data")
    assert facts["state"] == "unknown" and set(facts["problems"]) == {"probe_failed:runs", "probe_failed:data"}
    assert any(data in r and "did not finish within 0.5 s" in r for r in facts["reasons"])
    assert f"venv {data}/venv" in facts["gpu_error"]


FAKE_PYNVML = """
class NVMLError(Exception):
    value = 0
class _Rates:
    gpu = 42
class _Memory:
    used, total = 2**30, 80 * 2**30
class _Pci:
    busId = b"00000000:18:00.0"
def nvmlInit(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(index): return index
def nvmlDeviceGetUtilizationRates(handle): return _Rates()
def nvmlDeviceGetMemoryInfo(handle): return _Memory()
def nvmlDeviceGetPciInfo(handle): return _Pci()
"""
BASE_PYTHON_PROBE = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); "
    "from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_gpus import read_gpus; "
    "print(json.dumps(read_gpus('nvml', 5.0, sys.argv[2] or None)))"
)


def base_python() -> List[str]:
    """A Python without pynvml, as a box's base Python is: this one without its site-packages (``-S``)."""
    python = [sys.executable, "-S"]
    probe = subprocess.run([*python, "-c", "import pynvml"], capture_output=True, check=False)
    assert probe.returncode != 0, "pynvml must not be importable without site-packages"
    return python


def test_the_gpu_probe_finds_pynvml_in_the_runtime_venv_from_the_base_python(tmp_path):
    python = base_python()
    version = subprocess.run(
        [*python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    site = tmp_path / "venv" / "lib" / f"python{version}" / "site-packages"
    site.mkdir(parents=True)
    (site / "pynvml.py").write_text(FAKE_PYNVML)

    def probe(venv: str) -> Dict[str, Any]:
        done = subprocess.run(
            [*python, "-c", BASE_PYTHON_PROBE, str(COLLECTIONS), venv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    found = probe(str(tmp_path / "venv"))
    assert (found["backend"], found["error"], found["gpus"][0]["utilization_pct"]) == ("nvml", None, 42.0)
    missing = probe("")
    assert missing["gpus"] == [] and "needs nvidia-ml-py" in missing["error"]


def test_importing_the_module_loads_neither_pynvml_nor_the_runner_nor_the_kernel_log_readers():
    code = (
        "import sys; import ansible_collections.remote_gpu.trainer.plugins.modules.patrol_facts; "
        "heavy = ('pynvml', 'runner._monitor', 'launch._run_detach', 'gpu._kernel_log', 'gpu._xid'); "
        "print([m for m in sys.modules if m.endswith(heavy)])"
    )
    env = dict(os.environ, PYTHONPATH=str(COLLECTIONS))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "[]"


def test_a_live_cell_reports_its_own_progress_and_eta(tmp_path):
    run_dir = make_run(tmp_path, [{"name": "a", "command": train("--epochs", 1000, "--step-s", 0.02)}])
    runner = start_runner(run_dir)
    try:
        wait_for(lambda: has(log_of(run_dir, "a"), b"epoch 2/1000"), what="the second epoch")
        facts = tick(tmp_path)
        found = cells_of(facts, "sweep")["a"]
        assert found["state"] == "running" and 0 < found["progress_fraction"] < 1
        assert found["eta_s"] is not None and found["eta_s"] > 0 and facts["eta_s"] == found["eta_s"]
        assert alive(runner.pid)
    finally:
        stop(runner)
