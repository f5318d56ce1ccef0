"""teardown_gate judges the instance a meter-stop ends: every run on the box, live markers, the box's own id and
whether durable_dir shares data_dir's filesystem (issue 19, items 1, 5 and 6). Real runs, real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._archive import archive_runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import list_archived, list_runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_instance
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._run_scratch import run_scratch
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_gate import teardown_gate
from ansible_collections.remote_gpu.trainer.tests.workload.harness import kill_session, make_run, start_runner, train

CELL = [{"name": "a", "command": train("--ckpt-kib", "8")}]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One box (data, durable) holding two finished runs, r1 and r2, each with one synced checkpoint."""
    root = tmp_path_factory.mktemp("two_runs")
    for name in ("r1", "r2"):
        run_dir = make_run(root, CELL, name=name, artifacts=["best.pth"])
        assert start_runner(run_dir).wait(timeout=60) == 0
        assert (run_dir / "DONE").exists()
    return root


@pytest.fixture
def box(two_runs: Path, tmp_path: Path) -> Path:
    shutil.copytree(two_runs, tmp_path / "box", symlinks=True)
    # The copy's runs name its own dirs: archiving follows run.json's durable_dir, never into the shared original.
    for record in (tmp_path / "box" / "data" / "runs").glob("*/*.json"):
        record.write_text(record.read_text().replace(str(two_runs), str(tmp_path / "box")))
    return tmp_path / "box"


def gate(root: Path, **more: Any) -> Dict[str, Any]:
    params: Dict[str, Any] = {"data_dir": str(root / "data"), "durable_dir": str(root / "durable"), "runs": ["r1"]}
    params.update(more)
    return teardown_gate(params, environ_path=str(root / "no-pid1-environ"))


@pytest.fixture
def r2_worker(box: Path):
    """A live process carrying r2's marker, as a worker that left the runner's session would."""
    env = dict(os.environ, RGT_RUN_DIR=str(box / "data" / "runs" / "r2"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    time.sleep(0.2)
    yield child
    child.kill()
    child.wait()


def test_the_runs_on_a_box_are_its_run_directories_and_its_tombstones(box):
    (box / "data" / "runs" / ".torn_down").mkdir()
    (box / "data" / "runs" / ".torn_down" / "old.json").write_text("{}")
    (box / "data" / "runs" / ".launch.lock").write_text("")
    (box / "data" / "runs" / "not a run").mkdir()
    assert list_runs(str(box / "data")) == ["old", "r1", "r2"]
    assert list_runs(str(box / "nowhere")) == []


def test_a_meter_stop_with_another_run_alive_refuses_naming_it(box, r2_worker):
    result = gate(box, instance=True)
    assert (result["passed"], result["step"]) == (False, "other_runs")
    assert result["reason"].startswith("run r2: running, would lose its live processes (pid ")
    assert str(r2_worker.pid) in result["reason"] and "abandon_runs" in result["reason"]
    other = result["instance"]["other_runs"]
    assert [(o["name"], o["state"], o["torn_down"], o["abandoned"]) for o in other] == [("r2", "running", False, False)]
    assert result["instance"]["live_marker_pids"] == [r2_worker.pid]
    assert result["runs"][0]["passed"] is True  # r1 itself is fine: only the instance refuses


def test_without_a_meter_stop_only_the_named_runs_are_judged(box, r2_worker):
    result = gate(box)
    assert result["passed"], result["reason"]
    assert [entry["run"]["name"] for entry in result["runs"]] == ["r1"]
    assert result["instance"]["other_runs"] == [] and result["instance"]["runs_on_box"] == []


def test_a_finished_run_not_torn_down_refuses_with_what_it_would_lose(box):
    result = gate(box, instance=True)
    assert result["step"] == "other_runs"
    assert result["reason"].startswith("run r2: finished, not torn down, would lose the scratch of 1 cell (")
    assert "1 durable file not pulled" in result["reason"]
    assert result["instance"]["runs_on_box"] == ["r1", "r2"]


def test_an_abandoned_run_never_refuses_and_is_listed_with_what_it_loses(box, r2_worker):
    result = gate(box, instance=True, abandon_runs=["r2"])
    assert result["passed"], result["reason"]
    (other,) = result["instance"]["other_runs"]
    assert (other["name"], other["abandoned"], other["state"]) == ("r2", True, "running")
    assert "1 durable file not pulled" in other["would_lose"] and str(r2_worker.pid) in other["would_lose"]
    assert any(note.startswith("run r2 is abandoned: it loses ") for note in result["notes"])


def test_a_run_torn_down_earlier_does_not_refuse(box):
    scratch = {"runs": ["r2"], "data_dir": str(box / "data"), "durable_dir": str(box / "durable")}
    assert run_scratch(scratch, check_mode=False)["changed"] is True
    result = gate(box, instance=True)
    assert result["passed"], result["reason"]
    (other,) = result["instance"]["other_runs"]
    assert (other["state"], other["torn_down"], other["would_lose"]) == ("torn_down", True, "nothing")


def test_an_archived_finished_run_not_pulled_still_blocks_a_meter_stop(box):
    # Archiving retires a run from patrol, not from the instance: its scratch and durable copy go with the meter.
    archived = archive_runs({"data_dir": str(box / "data"), "run": "r2"}, check_mode=False)
    assert archived["runs"][0]["state"] == "archived" and list_runs(str(box / "data")) == ["r1"]
    (entry,) = list_archived(str(box / "data"))
    result = gate(box, instance=True)
    assert (result["passed"], result["step"]) == (False, "other_runs")
    assert result["reason"].startswith(
        f"run r2 (as .archive/{entry.entry}): archived, would lose the scratch of 1 cell ("
    )
    assert "1 durable file not pulled" in result["reason"] and "abandon_runs" in result["reason"]
    (other,) = result["instance"]["other_runs"]
    assert (other["name"], other["state"], other["archived"], other["abandoned"]) == (
        "r2",
        "archived",
        entry.entry,
        False,
    )
    # Dropped for good only by name: the run's or the archive entry's.
    for name in ("r2", entry.entry):
        dropped = gate(box, instance=True, abandon_runs=[name])
        assert dropped["passed"], dropped["reason"]
        assert any(note.startswith(f"run r2 (as .archive/{entry.entry}) is abandoned: ") for note in dropped["notes"])
    # Without a meter-stop only the named runs are judged, as before.
    assert gate(box)["passed"]


def test_no_runs_named_judges_every_run_on_the_box(box):
    result = gate(box, runs=[], instance=True)
    assert result["passed"], result["reason"]
    assert [entry["run"]["name"] for entry in result["runs"]] == ["r1", "r2"]
    assert result["instance"]["other_runs"] == []
    os.truncate(box / "durable" / "runs" / "r2" / "cells" / "a" / "best.pth", 10)
    broken = gate(box, runs=[])
    assert (broken["step"], broken["reason"].split(":", maxsplit=1)[0]) == ("durable", "run r2")


def test_a_process_of_a_run_whose_directory_is_gone_still_refuses(box):
    env = dict(os.environ, RGT_RUN_DIR=str(box / "data" / "runs" / "ghost"))
    child = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        time.sleep(0.2)
        result = gate(box, instance=True, abandon_runs=["r2"])
        assert result["step"] == "other_runs"
        assert result["reason"].startswith(f"run ghost: running, would lose its live processes (pid {child.pid})")
    finally:
        child.kill()
        child.wait()


def test_a_run_in_both_runs_and_abandon_runs_is_a_bad_option(box):
    with pytest.raises(ValueError, match="abandon_runs names r1, which runs tears down"):
        gate(box, abandon_runs=["r1"])
    with pytest.raises(ValueError, match="abandon_runs: each entry must match"):
        gate(box, abandon_runs=["../x"])


# --- the box's own id -----------------------------------------------------------------------------------------------


def pid1_environ(tmp_path: Path, **variables: str) -> str:
    path = tmp_path / "environ"
    path.write_bytes(b"".join(f"{name}={value}".encode() + b"\0" for name, value in variables.items()))
    return str(path)


def test_a_pid1_environment_naming_another_pod_refuses_first(box, tmp_path, monkeypatch):
    monkeypatch.delenv("RUNPOD_POD_ID", raising=False)
    environ = pid1_environ(tmp_path, PATH="/bin", RUNPOD_POD_ID="sibling9")
    params = {"data_dir": str(box / "data"), "durable_dir": str(box / "durable"), "runs": ["r1"], "instance": True}
    params.update(instance_id="mine42", instance_id_env=["RUNPOD_POD_ID"])
    result = teardown_gate(params, environ_path=environ)
    assert (result["passed"], result["step"]) == (False, "instance_id")
    assert result["reason"] == f"instance_id mine42 is not this box: its RUNPOD_POD_ID ({environ}) says sibling9"
    assert result["runs"] == []  # the wrong box: nothing else is judged
    assert (result["instance"]["id_checked"], result["instance"]["id_found"]) == (True, "sibling9")


def test_the_module_s_own_environment_is_read_first(box, monkeypatch):
    monkeypatch.setenv("RUNPOD_POD_ID", "sibling9")
    result = gate(box, instance_id="mine42", instance_id_env=["RUNPOD_POD_ID"])
    assert result["step"] == "instance_id" and "RUNPOD_POD_ID (environment) says sibling9" in result["reason"]
    monkeypatch.setenv("RUNPOD_POD_ID", "mine42")
    matched = gate(box, instance_id="mine42", instance_id_env=["RUNPOD_POD_ID"])
    assert matched["passed"] and matched["instance"]["id_source"] == "RUNPOD_POD_ID (environment)"


def test_a_vast_label_is_the_id_with_its_c_prefix(box, tmp_path, monkeypatch):
    monkeypatch.delenv("CONTAINER_ID", raising=False)
    monkeypatch.delenv("VAST_CONTAINERLABEL", raising=False)
    params = {"data_dir": str(box / "data"), "durable_dir": str(box / "durable"), "runs": ["r1"]}
    params.update(instance_id="12345", instance_id_env=["CONTAINER_ID", "VAST_CONTAINERLABEL"])
    same = teardown_gate(params, environ_path=pid1_environ(tmp_path, VAST_CONTAINERLABEL="C.12345"))
    assert same["passed"] and same["instance"]["id_checked"] is True
    other = teardown_gate(params, environ_path=pid1_environ(tmp_path, VAST_CONTAINERLABEL="C.99999"))
    assert other["step"] == "instance_id"


def test_a_box_that_does_not_tell_its_id_passes_with_a_note(box, monkeypatch):
    monkeypatch.delenv("RUNPOD_POD_ID", raising=False)
    result = gate(box, instance_id="mine42", instance_id_env=["RUNPOD_POD_ID"])
    assert result["passed"] and result["instance"]["id_checked"] is False
    assert result["notes"][0].startswith(
        "instance_id mine42 was not cross-checked: the box does not tell its own id (RUNPOD_POD_ID)"
    )


# --- same filesystem ------------------------------------------------------------------------------------------------


def test_an_irreversible_verb_with_durable_dir_on_data_dir_s_filesystem_refuses(box):
    assert os.stat(box / "data").st_dev == os.stat(box / "durable").st_dev
    refused = gate(box, instance=True, irreversible=True, abandon_runs=["r2"])
    assert (refused["step"], refused["instance"]["same_device"]) == ("same_filesystem", True)
    assert "the irreversible meter-stop destroys both" in refused["reason"]
    reversible = gate(box, instance=True, abandon_runs=["r2"])
    assert reversible["passed"] and reversible["instance"]["same_device"] is True


def test_a_durable_dir_that_does_not_exist_yet_is_judged_by_its_parent(box):
    result = gate(box, runs=[], instance=True, irreversible=True, durable_dir="/x/y")
    assert result["instance"]["durable_dev"] == os.stat("/").st_dev


def test_durable_dir_on_another_device_passes_and_both_devices_are_reported(box, monkeypatch):
    real = _teardown_instance._device_of
    durable = str(box / "durable")

    def other_device(path: str) -> Dict[str, Any]:
        found = real(path)
        return dict(found, dev=found["dev"] + 1) if path == durable else found

    monkeypatch.setattr(_teardown_instance, "_device_of", other_device)
    result = gate(box, instance=True, irreversible=True, abandon_runs=["r2"])
    assert result["passed"], result["reason"]
    facts = result["instance"]
    assert facts["same_device"] is False and facts["durable_dev"] == facts["data_dev"] + 1


def test_the_gate_judges_the_real_devices(tmp_path):
    # /dev/shm is a tmpfs of its own on Linux hosts and containers; whatever it is here, the verdict follows st_dev.
    shm = Path("/dev/shm")
    durable = Path(tempfile.mkdtemp(dir=shm))
    same = os.stat(shm).st_dev == os.stat(tmp_path).st_dev
    try:
        run_dir = make_run(tmp_path, CELL, name="r1", artifacts=["best.pth"], durable_dir=str(durable))
        assert start_runner(run_dir).wait(timeout=60) == 0
        result = gate(tmp_path, durable_dir=str(durable), instance=True, irreversible=True)
        assert result["instance"]["same_device"] is same
        assert result["passed"] is not same and (result["step"] == "same_filesystem") is same, result["reason"]
    finally:
        shutil.rmtree(durable, ignore_errors=True)


def test_packed_cells_one_hung_one_failed_are_judged_per_cell(tmp_path):
    # Four cells two at a time on two GPUs: c0 hangs, c1 fails, c2 and c3 finish. A second run r2 shares the box.
    commands = [train("--hang"), train("--exit", "3"), train("--ckpt-kib", "4"), train("--ckpt-kib", "4")]
    cells = [{"name": f"c{index}", "command": command} for index, command in enumerate(commands)]
    run_dir = make_run(tmp_path, cells, name="r1", artifacts=["best.pth"], gpus=[0, 1], gpus_per_cell=1)
    r2 = make_run(tmp_path, CELL, name="r2", artifacts=["best.pth"])
    assert start_runner(r2).wait(timeout=60) == 0
    runner = start_runner(run_dir)
    try:
        deadline = time.monotonic() + 30
        while not all((run_dir / "cells" / f"c{i}" / "result.json").exists() for i in (1, 2, 3)):
            assert time.monotonic() < deadline, "the three cells that end did not end"
            time.sleep(0.1)
        alive = gate(tmp_path, runs=["r1", "r2"], instance=True)
        assert (alive["step"], alive["passed"]) == ("run_alive", False)  # c0 still holds its GPU
    finally:
        kill_session(runner.pid)  # the runner and its cells, each in a process group of its own
        runner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while gate(tmp_path, runs=["r1", "r2"], instance=True)["step"] == "run_alive":
        assert time.monotonic() < deadline, "the killed cells did not go"
        time.sleep(0.1)
    # c0 killed: not done, and c1 failed: each named; accepting both lets the box go with r2 secured too.
    refused = gate(tmp_path, runs=["r1", "r2"], instance=True)
    assert refused["step"] == "cells" and "c0 (" in refused["reason"] and "c1 (failed, exit 3)" in refused["reason"]
    accepted = gate(tmp_path, runs=["r1", "r2"], instance=True, accept_incomplete_cells=["c0", "c1"])
    assert accepted["passed"], accepted["reason"]
    done = {
        entry["run"]["name"]: sorted(cell["name"] for cell in entry["cells"] if cell["done"])
        for entry in accepted["runs"]
    }
    assert done == {"r1": ["c2", "c3"], "r2": ["a"]}


def test_the_survey_follows_an_archived_runs_durable_copy_and_checks_it_against_its_manifest(box):
    # Issue 29 (items 4, 5): the entry says where the scratch lies and where the durable copy went, and whether that
    # copy still holds what its manifest lists: what a stop gate needs to tell a kept disk from a lost only copy.
    data, durable = str(box / "data"), str(box / "durable")
    archive_runs({"data_dir": data, "run": "r2"}, check_mode=False)
    (archived,) = list_archived(data)
    copy = box / "durable" / "runs" / ".archive" / archived.entry
    (entry,) = _teardown_instance.survey_archived(data, durable)
    assert (entry["scratch_dir"], entry["data_dir"], entry["durable_dir"]) == (archived.path, data, str(copy))
    assert (entry["durable_moved"], entry["durable_files"], entry["durable_verified"]) == (True, 1, True)
    assert (entry["durable_check"], entry["durable_problem"]) == ("size", None)
    # A new run of the name writes <durable_dir>/runs/r2: the archived run's entry does not count its files.
    fresh = box / "durable" / "runs" / "r2"
    fresh.mkdir()
    (fresh / "MANIFEST.sha256").write_text("".join(f"{'0' * 64}  1  cells/x/f{n}\n" for n in range(3)))
    assert _teardown_instance.survey_archived(data, durable)[0]["durable_files"] == 1
    # The same size with other bytes passes the size check and fails the re-hash; a shorter file fails both.
    (weights,) = list(copy.rglob("best.pth"))
    weights.write_bytes(bytes(len(weights.read_bytes())))
    assert _teardown_instance.survey_archived(data, durable)[0]["durable_verified"] is True
    rehashed = _teardown_instance.survey_archived(data, durable, rehash=True)[0]
    assert (rehashed["durable_verified"], rehashed["durable_check"]) == (False, "sha256")
    assert "same size, different sha256" in rehashed["durable_problem"]
    weights.write_bytes(b"short")
    (entry,) = _teardown_instance.survey_archived(data, durable)
    assert entry["durable_verified"] is False and entry["durable_problem"].endswith(": 5 bytes, expected 8192")


def test_a_run_archived_before_copies_moved_is_found_at_its_old_place_and_said_to_be_in_reach(box):
    data = box / "data"
    archive_root = data / "runs" / ".archive"
    archive_root.mkdir()
    (data / "runs" / "r2").rename(archive_root / "r2-20261201T120000Z")  # as run_archive did before issue 29
    (entry,) = _teardown_instance.survey_archived(str(data), str(box / "durable"))
    old = box / "durable" / "runs" / "r2"
    assert (entry["durable_dir"], entry["durable_moved"], entry["durable_files"]) == (str(old), False, 1)
    assert entry["durable_problem"] == f"{old} was not moved with the run: a new run of its name writes there"
    # Moved by hand to the name run_archive now gives it, it is found there.
    (box / "durable" / "runs" / ".archive").mkdir()
    old.rename(box / "durable" / "runs" / ".archive" / "r2-20261201T120000Z")
    (entry,) = _teardown_instance.survey_archived(str(data), str(box / "durable"))
    assert (entry["durable_moved"], entry["durable_verified"], entry["durable_problem"]) == (True, True, None)
