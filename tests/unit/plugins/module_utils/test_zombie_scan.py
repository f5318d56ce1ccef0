"""One vram_zombies pass over synthetic process tables: when the NVML observation window is worth its seconds."""

from __future__ import annotations

import re
import time
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import Gpu
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs import _procs, _zombie_scan
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc

OLD = time.time() - 3600
PARAMS: Dict[str, Any] = {
    "kill": False,
    "grace_s": 10.0,
    "min_age_s": 120.0,
    "observe_s": 2.0,
    "idle_util_pct": 5,
    "protect_pids": [],
    "all_users": True,
    "data_dir": None,
}


def proc(pid: int, ppid: int, pgid: int, sid: int, *, devices=("/dev/nvidia0",), cmd="python train.py") -> Proc:
    return Proc(pid=pid, ppid=ppid, pgid=pgid, sid=sid, uid=0, name=cmd.split()[0], cmdline=tuple(cmd.split()),
                create_time=OLD, devices=tuple(devices))  # fmt: skip


INIT = proc(1, 0, 1, 1, devices=(), cmd="/sbin/init")
# Launcher 100 crashed: its worker 101 and dataloader 102 were left holding GPU 0.
ORPHANS = [proc(101, 1, 100, 100), proc(102, 101, 100, 100)]
# Launcher 200 lives: its worker holds GPU 0.
LIVE = [proc(200, 1, 200, 200, devices=(), cmd="torchrun train.py"), proc(201, 200, 200, 200)]


@pytest.fixture
def box(monkeypatch):
    """scan_and_reap over a table given by the test; records the window each NVML read was asked for."""
    windows: List[float] = []
    state: Dict[str, Any] = {"table": {}, "util": ()}

    def gpu_view(_nvml, observe_s, _pid_exists):
        windows.append(observe_s)
        util = state["util"] if observe_s else ()
        return [Gpu(index=0, minor=0, memory_used_mib=1024, memory_total_mib=81559, utilization_pct=util)], None

    monkeypatch.setattr(_procs, "read_process_table", lambda: (dict(state["table"]), {"processes": 0}))
    monkeypatch.setattr(_zombie_scan, "read_gpu_view", gpu_view)

    def scan(procs: List[Proc], util=(), **params: Any) -> Dict[str, Any]:
        state["table"], state["util"] = {p.pid: p for p in procs}, tuple(util)
        windows.clear()
        result = _zombie_scan.scan_and_reap(dict(PARAMS, **params), [], check_mode=False)
        result["windows"] = list(windows)
        return result

    return scan


def test_no_holder_means_no_observation_window(box):
    result = box([INIT, LIVE[0]])
    assert result["windows"] == [0]  # NVML is read once for its view, without sampling utilization
    assert result["observation"] == {
        "requested_s": 2.0,
        "window_s": 0.0,
        "skipped": "no holder could be a candidate, so GPU utilization could change no decision",
    }
    assert result["status"] == "clean" and result["nvml"][0]["utilization_pct"] == ()
    assert result["msg"] == (
        "0 holder(s), 0 candidate(s); no NVML observation window "
        "(no holder could be a candidate, so GPU utilization could change no decision)"
    )


def test_holders_none_of_which_could_be_a_candidate_skip_the_window_too(box):
    protected = box([INIT, *LIVE])  # the live launcher protects its worker
    young = box([INIT, *ORPHANS], min_age_s=7200)  # orphans, but younger than min_age_s
    for result in (protected, young):
        assert result["windows"] == [0] and result["observation"]["window_s"] == 0.0
        assert len(result["holders"]) >= 1 and result["candidates"] == []
    assert re.match(r"age \d+s below min_age_s 7200s", young["holders"][0]["reason"])


def test_a_possible_candidate_is_observed_and_a_busy_gpu_spares_it(box):
    idle = box([INIT, *ORPHANS], util=(0, 1, 0))
    assert idle["windows"] == [0, 2.0]  # the snapshot read during the scan, then the window
    assert idle["observation"] == {"requested_s": 2.0, "window_s": 2.0, "skipped": None}
    assert [c["pid"] for c in idle["candidates"]] == [101, 102]
    assert idle["candidates"][0]["rules"] == ["orphaned", "gpu_idle", "old"]
    assert idle["msg"] == "2 holder(s), 2 candidate(s); GPU utilization sampled for 2s"
    busy = box([INIT, *ORPHANS], util=(0, 97, 0))
    assert busy["windows"] == [0, 2.0] and busy["candidates"] == []
    assert "GPU 0 at 97% busy" in busy["holders"][0]["reason"]


def test_observe_s_zero_is_said_and_never_samples(box):
    result = box([INIT, *ORPHANS], observe_s=0)
    assert result["windows"] == [0]
    assert result["observation"]["skipped"] == "observe_s is 0"
    assert [c["pid"] for c in result["candidates"]] == [101, 102]
    assert result["candidates"][0]["rules"] == ["orphaned", "old"]  # no samples: no gpu_idle evidence


def test_an_error_while_reading_nvml_in_the_background_reaches_the_caller(box, monkeypatch):
    def broken(_nvml, _observe_s, _pid_exists):
        raise RuntimeError("binding bug")

    monkeypatch.setattr(_zombie_scan, "read_gpu_view", broken)
    with pytest.raises(RuntimeError, match="binding bug"):
        box([INIT, *LIVE])
