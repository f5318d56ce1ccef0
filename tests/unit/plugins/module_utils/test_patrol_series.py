"""The run's curves patrol carries back: monitor.jsonl sampled by seeking, bounded whatever its size, and on a box."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _patrol, _series
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    compile_progress,
    compile_signatures,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._series import monitor_series
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import utc_iso
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import Monitor

SCANNING = {"signatures": compile_signatures([]), "progress": compile_progress(None), "max_bytes": 2**20}
START = 1_796_292_000.0  # 2026-12-03T10:00:00Z
GIB = 2**30
SERIES_KEYS = {"t", "gpus", "container_mem_bytes", "container_max_bytes", "points"}


def sample(t: float, utils: Sequence[Any], used: Sequence[Any] = (), memory: Any = 20 * GIB) -> Dict[str, Any]:
    """A sample as the runner's Monitor.sample writes it (8 H100s at most, two cells, the data dir's usage)."""
    gpus = [
        {"index": i, "util_pct": u, "memory_used_mib": used[i] if i < len(used) else 40000.0 + i,
         "memory_total_mib": 81559.0}
        for i, u in enumerate(utils)
    ]  # fmt: skip
    return {
        "ts": utc_iso(t), "t": round(t, 3),
        "cgroup": {"version": 2, "memory_current": memory, "memory_max": 64 * GIB},
        "cpu_pct": 41.5, "run": {"procs": 9, "rss_bytes": 12 * GIB, "cpu_s": 812.4},
        "cells": {"c0": {"pid": 4242, "rss_bytes": 6 * GIB, "threads": 31, "fds": 118},
                  "c1": {"pid": 4250, "rss_bytes": 6 * GIB, "threads": 31, "fds": 117}},
        "tracker": {"pids": [4300], "rss_bytes": 310 * 2**20},
        "disk": {"data": {"path": "/root/autodl-tmp", "exists": True, "error": None, "bytes_free": 2 * 10**11,
                          "bytes_used_pct": 61.2, "inodes_free": 10**7, "inodes_used_pct": 3.0}},
        "gpus": gpus, "gpu_error": None,
    }  # fmt: skip


def line(entry: Dict[str, Any]) -> bytes:
    return (json.dumps(entry, sort_keys=True) + "\n").encode()


def write_monitor(path: Path, samples: Sequence[Dict[str, Any]], max_bytes: int = 2**30) -> None:
    """Written by the runner's own Monitor.write, which rotates to ``.1`` past ``max_bytes``."""
    monitor = Monitor(str(path), interval_s=1.0, max_bytes=max_bytes, directories={}, marker=b"RGT_RUN=x")
    for entry in samples:
        monitor.write(entry)


def series_of(run_monitor: Path) -> Optional[Dict[str, Any]]:
    found = monitor_series([f"{run_monitor}.1", str(run_monitor)])
    json.dumps(found, allow_nan=False)  # it travels as JSON from the probe's child: no NaN, no inf
    return found


def test_every_sample_of_a_short_run_per_gpu_and_the_containers_memory(tmp_path):
    path = tmp_path / "monitor.jsonl"
    write_monitor(path, [sample(START + 10 * i, [90.0 + i, 10.0], memory=(20 + i) * GIB) for i in range(5)])
    found = series_of(path)
    assert found is not None and set(found) == SERIES_KEYS
    assert found["t"] == [START + 10 * i for i in range(5)] and found["points"] == 5
    assert found["gpus"] == [
        {"index": 0, "util_pct": [90.0, 91.0, 92.0, 93.0, 94.0], "mem_used_mib": [40000.0] * 5,
         "mem_total_mib": 81559.0},
        {"index": 1, "util_pct": [10.0] * 5, "mem_used_mib": [40001.0] * 5, "mem_total_mib": 81559.0},
    ]  # fmt: skip
    assert found["container_mem_bytes"] == [(20 + i) * GIB for i in range(5)]
    assert found["container_max_bytes"] == 64 * GIB


def test_a_rotated_monitor_is_read_old_file_first_and_spans_both_in_120_points(tmp_path):
    path = tmp_path / "monitor.jsonl"
    samples = [sample(START + 5 * i, [float(i % 100)] * 8) for i in range(1200)]
    write_monitor(path, samples, max_bytes=1200 * len(line(samples[0])) // 2 + 100)
    assert Path(f"{path}.1").exists() and path.stat().st_size > 0
    oldest = json.loads(Path(f"{path}.1").read_text().splitlines()[0])["t"]
    found = series_of(path)
    assert found["points"] == 120 == len(found["t"]) and len(found["gpus"]) == 8
    assert found["t"] == sorted(found["t"]) and found["t"][0] == oldest and found["t"][-1] == samples[-1]["t"]
    gaps = [b - a for a, b in zip(found["t"], found["t"][1:])]
    assert max(gaps) <= 2 * min(gaps) + 10  # spread evenly over both files, not bunched in one
    assert all(len(g["util_pct"]) == 120 == len(g["mem_used_mib"]) for g in found["gpus"])


def write_big(path: Path, size: int) -> int:
    """``size`` bytes of 8-GPU samples, one every 5 s (written at once: the content is the test, not the writer)."""
    lines, total, i = [], 0, 0
    while total < size:
        data = line(sample(START + 5 * i, [float(i % 97)] * 8))
        lines.append(data)
        total, i = total + len(data), i + 1
    path.write_bytes(b"".join(lines))
    return i


def test_a_50_mb_monitor_costs_the_reads_of_a_1_mb_one(tmp_path, monkeypatch):
    read: List[int] = []
    pread = os.pread

    def counting(fd: int, size: int, offset: int) -> bytes:
        data = pread(fd, size, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(_series.os, "pread", counting)
    costs = {}
    for name, size in (("small", 2**20), ("big", 50 * 2**20)):
        path = tmp_path / name / "monitor.jsonl"
        path.parent.mkdir()
        count = write_big(path, size)
        read.clear()
        found = series_of(path)
        costs[name] = (sum(read), len(read))
        assert found["points"] == 120 and found["t"][0] == START and found["t"][-1] == START + 5 * (count - 1)
    assert costs["big"][0] < 2**20 and costs["big"][0] <= 1.2 * costs["small"][0]  # 50x the file, same reads
    assert costs["big"][1] <= 2 * 120 + 8


def test_garbage_truncated_nan_wrong_types_and_untimed_samples_are_dropped_or_null(tmp_path):
    path = tmp_path / "monitor.jsonl"
    good = sample(START, [55.0, 60.0])
    bad_values = sample(START + 10, [float("nan"), float("inf")], used=[-1.0, "lots"], memory="much")
    bad_values["gpus"].append({"index": True, "util_pct": 150.0})  # a bool index, a reading over 100
    bad_values["gpus"].append("not a gpu")
    entries = [
        line(good),
        b"not json at all\n",
        b'{"t": NaN, "gpus": []}\n',
        b'{"t": "soon", "gpus": []}\n',
        b'{"ts": "2026-12-03T10:00:05", "gpus": []}\n',  # a naive time: which zone?
        b'{"gpus": [{"index": 0, "util_pct": 1}]}\n',  # no time at all
        b"[1, 2, 3]\n",
        b'{"t": 1' + b"0" * 400 + b', "gpus": [{"index": 0, "util_pct": 1' + b"0" * 400 + b"}]}\n",  # valid JSON
        b"\x00" * 200_000 + b"\n",  # a crash's NUL block, longer than a line may be
        line(bad_values),
        b'{"ts": "2026-12-03T10:00:20.000000+00:00", "error": "RuntimeError: boom"}\n',  # a failed sample
        line(sample(START + 30, [70.0, 80.0]))[:-40],  # the line being written
    ]
    path.write_bytes(b"".join(entries))
    found = series_of(path)
    assert found["t"] == [START, START + 10, START + 20]
    assert [g["index"] for g in found["gpus"]] == [0, 1, 2]
    assert found["gpus"][0]["util_pct"] == [55.0, None, None] and found["gpus"][1]["util_pct"] == [60.0, None, None]
    assert found["gpus"][0]["mem_used_mib"] == [40000.0, None, None]
    assert found["gpus"][2] == {"index": 2, "util_pct": [None, None, None], "mem_used_mib": [None] * 3,
                                "mem_total_mib": None}  # fmt: skip
    assert found["container_mem_bytes"] == [20 * GIB, None, None]


def test_a_clock_stepped_back_gives_points_sorted_by_time(tmp_path):
    path = tmp_path / "monitor.jsonl"
    times = [START + 100, START + 110, START + 120, START + 20, START + 30]  # NTP stepped the clock back
    write_monitor(path, [sample(t, [float(t - START) / 2]) for t in times])
    found = series_of(path)
    assert found["t"] == sorted(times) and found["gpus"][0]["util_pct"] == [10.0, 15.0, 50.0, 55.0, 60.0]


@pytest.mark.parametrize("content", [None, b"", b"garbage\nmore garbage\n", b"partial line without end"])
def test_no_sample_is_no_series(tmp_path, content):
    path = tmp_path / "monitor.jsonl"
    if content is not None:
        path.write_bytes(content)
    assert series_of(path) is None


def test_a_directory_or_a_fifo_at_the_path_is_no_series_and_no_hang(tmp_path):
    (tmp_path / "monitor.jsonl.1").mkdir()
    os.mkfifo(tmp_path / "monitor.jsonl")  # nobody writes it: a blocking open would never return
    assert series_of(tmp_path / "monitor.jsonl") is None


def test_a_sample_longer_than_the_first_read_is_still_read_whole(tmp_path):
    path = tmp_path / "monitor.jsonl"
    wide = sample(START, [50.0] * 8)
    wide["cells"] = {f"cell-{i:03d}": {"pid": 1000 + i, "rss_bytes": GIB, "threads": 8, "fds": 20} for i in range(200)}
    assert len(line(wide)) > 3 * _series.FIRST_READ
    write_monitor(path, [wide, dict(wide, t=START + 5)])
    assert series_of(path)["t"] == [START, START + 5]


# ---------------------------------------------------------------------------------------------------------------
# On a box: patrol_facts' runs[].monitor_series and runs[].cells[].loss_series
# ---------------------------------------------------------------------------------------------------------------
def tick(root: Path, check_mode: bool = False, **more: Any) -> Dict[str, Any]:
    params = {
        "data_dir": str(root / "data"), "run": None, "durable_dir": None, "stall_after_s": 1800, "gpu_idle_pct": 5.0,
        "gpu_idle_samples": 10, "disk_pressure_pct": 100.0, "gpu_backend": "nvidia-smi", "kernel_log": False,
        "timeout_s": 10.0, "venv": None,
    }  # fmt: skip
    params.update(more)
    facts = _patrol.patrol(params, SCANNING, check_mode)
    json.dumps(facts, allow_nan=False)
    return facts


def registered(root: Path, name: str, cells: Dict[str, List[int]]) -> Path:
    """A run whose runner is gone (a pgid no process has), its cells packed one per GPU."""
    run_dir = root / "data" / "runs" / name
    run_dir.mkdir(parents=True)
    record = {"schema": 1, "run": name, "started_at": utc_iso(START), "pgid": 2**22 + 7, "sid": 2**22 + 7,
              "pids": [2**22 + 7], "detach": "setsid", "gpus": sorted(g for gs in cells.values() for g in gs),
              "cells": [{"name": cell, "gpus": gpus, "state": "started"} for cell, gpus in cells.items()]}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def cell_log(run_dir: Path, cell: str, text: str) -> Path:
    log = run_dir / "cells" / cell / "log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(text)
    return log


def test_two_runs_on_one_box_each_carry_their_own_curves_and_their_cells_losses(tmp_path):
    alpha = registered(tmp_path, "alpha", {"c0": [0], "c1": [1]})
    beta = registered(tmp_path, "beta", {"one": [2]})
    write_monitor(alpha / "monitor.jsonl", [sample(START + 5 * i, [97.0, 12.0, 0.0]) for i in range(300)], 200_000)
    write_monitor(beta / "monitor.jsonl", [sample(START + 7 * i, [0.0, 0.0, 88.0]) for i in range(3)])
    cell_log(alpha, "c0", "".join(f"step {s} loss {2.0 / s:.4f}\n" for s in range(10, 101, 10)))
    cell_log(alpha, "c1", "step 10 loss nan\nstep 20 loss inf\n")
    cell_log(beta, "one", "{'loss': 0.9, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.1}\n")
    facts = tick(tmp_path)
    runs = {run["run"]: run for run in facts["runs"]}
    assert set(runs["alpha"]["monitor_series"]) == SERIES_KEYS and runs["alpha"]["monitor_series"]["points"] == 120
    assert Path(f"{alpha}/monitor.jsonl.1").exists() and runs["alpha"]["monitor_series"]["t"][0] == START
    assert [g["util_pct"][-1] for g in runs["alpha"]["monitor_series"]["gpus"]] == [97.0, 12.0, 0.0]
    assert runs["beta"]["monitor_series"]["t"] == [START, START + 7, START + 14]
    cells = {c["name"]: c["loss_series"] for run in facts["runs"] for c in run["cells"]}
    assert cells["c0"] == {"x": list(range(10, 101, 10)), "loss": [round(2.0 / s, 4) for s in range(10, 101, 10)],
                           "x_label": "step", "last": 0.02, "points": 10}  # fmt: skip
    assert cells["c1"] == {"x": [10, 20], "loss": [None, None], "x_label": "step", "last": None, "points": 2}
    assert cells["one"] == {"x": [1], "loss": [0.9], "x_label": "line", "last": 0.9, "points": 1}
    assert facts["problems"] == ["incomplete:alpha", "nan_loss:alpha/c1", "incomplete:beta"]


def test_a_run_without_monitor_or_loss_says_null(tmp_path):
    run_dir = registered(tmp_path, "quiet", {"a": [0]})
    cell_log(run_dir, "a", "loading data\nno loss printed here, eval_loss: 0.3\n")
    facts = tick(tmp_path)
    assert facts["runs"][0]["monitor_series"] is None and facts["runs"][0]["cells"][0]["loss_series"] is None


def test_the_series_grow_tick_by_tick_and_check_mode_writes_nothing(tmp_path):
    run_dir = registered(tmp_path, "sweep", {"a": [0]})
    log = cell_log(run_dir, "a", "step 1 loss 0.9\n")
    assert tick(tmp_path, check_mode=True)["runs"][0]["cells"][0]["loss_series"]["x"] == [1]
    assert not (run_dir / ".patrol").exists()
    tick(tmp_path)
    with log.open("a") as handle:
        handle.write("step 2 loss 0.8\n")
    assert tick(tmp_path)["runs"][0]["cells"][0]["loss_series"]["loss"] == [0.9, 0.8]
    cursor = json.loads((run_dir / ".patrol" / "a.json").read_text())
    assert cursor["offset"] == log.stat().st_size and cursor["loss"]["n"] == 2


def test_a_hung_monitor_read_costs_the_runs_probe_its_deadline_not_the_tick(tmp_path, monkeypatch):
    registered(tmp_path, "sweep", {"a": [0]})

    def hang(*_args: Any) -> None:  # monitor.jsonl on a dead NFS mount
        time.sleep(30)

    monkeypatch.setattr(_patrol, "monitor_series", hang)
    started = time.monotonic()
    facts = tick(tmp_path, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert facts["state"] == "unknown" and "probe_failed:runs" in facts["problems"]


def test_a_monitor_read_failing_midway_costs_the_curves_only(tmp_path, monkeypatch):
    run_dir = registered(tmp_path, "sweep", {"a": [0]})
    write_monitor(run_dir / "monitor.jsonl", [sample(START, [1.0])])

    def failing(*_args: Any) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_series.os, "pread", failing)
    facts = tick(tmp_path)
    assert facts["runs"][0]["monitor_series"] is None and facts["state"] == "incomplete"


def test_a_monitor_line_with_a_number_too_large_for_a_float_is_no_failed_probe(tmp_path):
    run_dir = registered(tmp_path, "sweep", {"a": [0]})
    huge = b"1" + b"0" * 400  # valid JSON; float() of it overflows
    now = time.time()
    (run_dir / "monitor.jsonl").write_bytes(
        b'{"t": ' + huge + b', "cgroup": {"memory_current": ' + huge + b"}}\n" + line(sample(now, [50.0]))
    )
    facts = tick(tmp_path)
    assert facts["state"] == "incomplete" and "probe_failed:runs" not in facts["problems"]
    assert facts["runs"][0]["monitor_series"]["t"] == [round(now, 3)]


def test_only_the_newest_runs_carry_curves_so_a_box_of_finished_runs_costs_no_more(tmp_path):
    for index in range(_patrol.MAX_CURVE_RUNS + 3):
        run_dir = registered(tmp_path, f"r{index:02d}", {"a": [0]})
        record = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps(dict(record, started_at=utc_iso(START + 60 * index))))
        write_monitor(run_dir / "monitor.jsonl", [sample(START + 60 * index + i, [50.0]) for i in range(3)])
    runs = {run["run"]: run["monitor_series"] for run in tick(tmp_path)["runs"]}
    assert sorted(name for name, series in runs.items() if series) == [f"r{i:02d}" for i in range(3, 11)]
