"""launch_allow_concurrent: a run never hands a cell a GPU that a live cell of another run on the box holds."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import register_data_dir
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import utc_iso
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._gpu_claims import (
    GpuClaims,
    held_by_others,
    held_gpus,
    runner_alive,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._runner import Runner
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    make_run,
    records,
    results,
    start_runner,
    train,
    wait_for,
)


def test_the_gpus_a_run_json_holds():
    record = {
        "gpus": [0, 1, 2, 3],
        "cells": [
            {"name": "a", "state": "started", "gpus": [0], "gpus_held": True},
            {"name": "b", "state": "started", "gpus": [1], "gpus_held": False},  # given back
            {"name": "c", "state": "pending", "gpus": None},
            {"name": "d", "state": "started", "gpus": [2]},  # an older runner: no gpus_held, still held
        ],
    }
    assert held_gpus(record) == {0, 2}
    whole_box = {"gpus": [0, 1], "cells": [{"name": "a", "state": "started", "gpus": None, "gpus_held": True}]}
    assert held_gpus(whole_box) == {0, 1}


def test_a_runner_is_alive_only_as_the_process_that_started_the_run():
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        now = time.time()
        assert runner_alive(Run("r", "p", pids=(sleeper.pid,), started_at=now))
        assert runner_alive(Run("r", "p", sid=sleeper.pid, started_at=now))
        # born long after the run started: a reused pid, no launcher of it
        assert not runner_alive(Run("r", "p", pids=(sleeper.pid,), started_at=now - 3600))
        assert not runner_alive(Run("r", "p", pgid=os.getpid(), started_at=now))  # not a group leader's pid
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not runner_alive(Run("r", "p", pids=(sleeper.pid,), started_at=now))


def write_run(root: Path, name: str, pid: int, cells: list) -> Path:
    run_dir = root / "runs" / name
    run_dir.mkdir(parents=True)
    record = {"run": name, "pids": [pid], "started_at": utc_iso(time.time()), "gpus": [0, 1, 2, 3], "cells": cells}
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def test_only_live_other_runs_count(tmp_path, instance_dir):
    own = write_run(tmp_path, "own", os.getpid(), [{"name": "a", "state": "started", "gpus": [3]}])
    write_run(tmp_path, "live", os.getpid(), [{"name": "a", "state": "started", "gpus": [1]}])
    write_run(tmp_path, "dead", 2**22 + 7, [{"name": "a", "state": "started", "gpus": [2]}])
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "run.json").write_text("{not json")
    assert held_by_others(str(tmp_path), str(own)) == {1}
    claims = GpuClaims(str(tmp_path), str(own), recheck_s=3600)
    assert claims.held() == {1}
    write_run(tmp_path, "later", os.getpid(), [{"name": "a", "state": "started", "gpus": [0]}])
    assert claims.held() == {1} and claims.held(fresh=True) == {0, 1}  # read again when a slot opened
    with claims.claiming():  # one lock for the box, whatever the data dir
        assert (instance_dir / ".gpu-claims.lock").exists() and not (tmp_path / "runs" / ".gpu-claims.lock").exists()


def test_live_runs_of_the_box_s_other_data_dirs_hold_their_gpus_too(tmp_path):
    # Issue 29 item 1: r2 launched with launch_data_dir=/root/scratch held GPU 1; r1 in /data was given it.
    data, scratch = tmp_path / "data", tmp_path / "scratch"
    own = write_run(data, "r1", os.getpid(), [{"name": "a", "state": "pending", "gpus": None}])
    write_run(scratch, "r2", os.getpid(), [{"name": "a", "state": "started", "gpus": [1]}])
    write_run(tmp_path / "unknown", "r3", os.getpid(), [{"name": "a", "state": "started", "gpus": [2]}])
    assert held_by_others(str(data), str(own)) == set()  # a data dir the box does not know is not read
    register_data_dir(str(scratch), None)  # as training_run does when it starts r2
    assert held_by_others(str(data), str(own)) == {1}
    assert GpuClaims(str(data), str(own)).held() == {1}


def spans(log: Path):
    """Per cell: (first event time, last event time, its CUDA_VISIBLE_DEVICES)."""
    found = {}
    for event in records(log):
        start, end, _gpus = found.get(event["cell"], (event["ts"], event["ts"], event["gpus"]))
        found[event["cell"]] = (min(start, event["ts"]), max(end, event["ts"]), event["gpus"])
    return found


def test_a_second_run_never_gets_the_gpus_the_first_runs_live_cells_hold(tmp_path):
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    long = ("--epochs", 1, "--steps-per-epoch", 6, "--step-s", 0.25, "--record", first_log)
    first = make_run(tmp_path, [{"name": f"f{i}", "command": train(*long)} for i in range(2)], name="first",
                     gpus=[0, 1, 2, 3], gpus_per_cell=1)  # fmt: skip
    runner = start_runner(first)
    wait_for(lambda: len({e["cell"] for e in records(first_log)}) == 2, what="the first run's cells start")
    short = ("--epochs", 1, "--step-s", 0.05, "--record", second_log)
    second = make_run(tmp_path, [{"name": f"s{i}", "command": train(*short)} for i in range(6)], name="second",
                      gpus=[0, 1, 2, 3], gpus_per_cell=1)  # fmt: skip
    assert Runner(str(second), dict(os.environ)).run() == 0
    assert runner.wait(timeout=30) == 0
    held = {gpus: (start, end) for start, end, gpus in spans(first_log).values()}
    assert sorted(held) == ["0", "1"]
    for cell, (start, _end, gpus) in spans(second_log).items():
        if gpus in held:
            assert start > held[gpus][1], (cell, gpus)  # only once the first run's cell had ended
    assert "gpus_wait" in (second / "runner.log").read_text()
    assert all(r["status"] == "succeeded" for r in results(second).values())


def test_a_whole_box_cell_gets_the_gpus_no_other_run_holds_and_waits_while_none_is_free(tmp_path):
    first_log = tmp_path / "first.jsonl"
    long = ("--epochs", 1, "--steps-per-epoch", 6, "--step-s", 0.25, "--record", first_log)
    first = make_run(tmp_path, [{"name": "f", "command": train(*long)}], name="first", gpus=[0, 1], gpus_per_cell=1)
    runner = start_runner(first)
    wait_for(lambda: records(first_log), what="the first run's cell starts")
    show = ("--show-env", "CUDA_VISIBLE_DEVICES")
    second = make_run(tmp_path, [{"name": "s", "command": train(*show)}], name="second", gpus=[0, 1])
    assert Runner(str(second), dict(os.environ)).run() == 0
    assert "env CUDA_VISIBLE_DEVICES=1\n" in (second / "cells" / "s" / "log").read_text()
    assert json.loads((second / "run.json").read_text())["cells"][0]["gpus"] == [1]
    assert runner.wait(timeout=30) == 0

    # Every GPU held by the first run: the whole-box cell waits, then gets the box.
    all_log = tmp_path / "first-all.jsonl"
    longer = (*long[:-1], all_log)
    first_all = make_run(tmp_path, [{"name": "f", "command": train(*longer)}], name="first-all", gpus=[0, 1])
    runner = start_runner(first_all)
    wait_for(lambda: records(all_log), what="the first run's whole-box cell starts")
    third = make_run(tmp_path, [{"name": "s", "command": train(*show)}], name="third", gpus=[0, 1])
    assert Runner(str(third), dict(os.environ)).run() == 0
    assert runner.wait(timeout=30) == 0
    log = (third / "runner.log").read_text()
    assert log.count("gpus_wait") == 1 and "held_by_other_runs=0,1" in log
    assert "env CUDA_VISIBLE_DEVICES=<unset>" in (third / "cells" / "s" / "log").read_text()
    assert results(third)["s"]["started_at"] > results(first_all)["f"]["ended_at"]
