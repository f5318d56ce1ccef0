"""The controller's report files and the per-box lock of a stage."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._report import Busy, box_lock, write_report


def test_reports_are_private_and_two_in_one_second_keep_both(tmp_path: Path) -> None:
    first = write_report(str(tmp_path), "teardown", {"n": 1})
    second = write_report(str(tmp_path), "teardown", {"n": 2})
    assert first != second
    assert [json.loads(Path(path).read_text())["n"] for path in (first, second)] == [1, 2]
    for path in (first, second, str(tmp_path / "teardown-latest.json")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads((tmp_path / "teardown-latest.json").read_text()) == {"n": 2}


def test_a_report_that_cannot_be_written_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        write_report(str(blocker / "reports"), "teardown", {})


def _hold(directory: str, ready: multiprocessing.synchronize.Event, seconds: float) -> None:
    with box_lock("teardown", "pod-1", 0, directory):
        ready.set()
        time.sleep(seconds)


def test_a_second_teardown_of_the_same_box_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    ready = multiprocessing.Event()
    holder = multiprocessing.Process(target=_hold, args=(str(tmp_path), ready, 3))
    holder.start()
    try:
        assert ready.wait(10)
        with pytest.raises(Busy, match=f"pid {holder.pid}"), box_lock("teardown", "pod-1", 0.3, str(tmp_path)):
            pass
        with box_lock("teardown", "pod-2", 0, str(tmp_path)):  # another box is not locked
            pass
    finally:
        holder.join(10)
    with box_lock("teardown", "pod-1", 0, str(tmp_path)):  # released when its holder ended
        pass


def test_a_waiting_teardown_gets_the_lock_when_the_first_ends(tmp_path: Path) -> None:
    ready = multiprocessing.Event()
    holder = multiprocessing.Process(target=_hold, args=(str(tmp_path), ready, 0.5))
    holder.start()
    assert ready.wait(10)
    with box_lock("teardown", "pod-1", 10, str(tmp_path)):
        assert not holder.is_alive() or holder.join(5) is None
    holder.join(5)
