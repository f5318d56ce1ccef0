"""The on-box programs under the oldest box Python of the running ansible-core (3.8 under 2.19), as real processes:
the runner takes a run of two cells (fake_train.py, same Python) to DONE, then the autostop watcher, installed from
AUTOSTOP_MODULES alone and started -I -S, goes through its decisions to one stop of the finished box."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import parse_result
from ansible_collections.remote_gpu.trainer.tests.compat import box_guard, pythons
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.module_utils.autostop.test_autostop_watch import (
    POD,
    arm,
    decision,
    environment,
    install,
    stops,
)
from ansible_collections.remote_gpu.trainer.tests.workload.harness import (
    COLLECTIONS,
    FAKE_TRAIN,
    RUNNER_MAIN,
    Provider,
    make_run,
    results,
)


@pytest.fixture(scope="module")
def oldest() -> str:
    return pythons.find_python(box_guard.OLDEST)


@pytest.fixture(scope="module")
def finished(oldest: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A box holding run r1, two cells at once, taken to DONE by a runner of the oldest box Python."""
    root = tmp_path_factory.mktemp("oldest")
    cells = [{"name": name, "command": [oldest, str(FAKE_TRAIN), "--ckpt-kib", "8"]} for name in ("a", "b")]
    run_dir = make_run(root, cells, name="r1", artifacts=["best.pth"], max_parallel=2)
    runner = subprocess.run(
        [oldest, "-c", RUNNER_MAIN, str(run_dir)],
        env=dict(os.environ, PYTHONPATH=str(COLLECTIONS)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # as detached: a runner sharing a live process group reads as live
        check=False,
    )
    assert runner.returncode == 0, runner.stderr[-2000:]
    return root


def test_the_runner_takes_a_run_to_done_under_the_oldest_box_python(finished: Path) -> None:
    run_dir = finished / "data" / "runs" / "r1"
    assert (run_dir / "DONE").exists()
    done = results(run_dir)
    assert sorted(done) == ["a", "b"] and all(parse_result(result).counts_as_done() for result in done.values())


def test_the_autostop_watcher_stops_the_finished_box_once_under_the_oldest_box_python(
    finished: Path, oldest: str, tmp_path: Path
) -> None:
    box = tmp_path / "box"
    shutil.copytree(finished, box, symlinks=True)
    provider = Provider(tmp_path)
    provider.add(POD)
    arm(box)
    watcher = subprocess.run(
        [oldest, "-I", "-S", str(install(box)), str(box / "data")],
        env=environment(provider),
        cwd=str(box),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert watcher.returncode == 0, watcher.stderr[-2000:]
    done = decision(box)
    assert (done["state"], done["trigger"], done["stop"]["outcome"]) == ("stopped", "idle", "stopped")
    assert [h["state"] for h in done["history"]] == ["idle_wait", "stopping", "stopped"]
    assert stops(provider) == [["runpodctl", "pod", "stop", POD]]
