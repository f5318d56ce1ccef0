"""The run registry (contracts/run-layout.md): paths, run.json and result.json validation, the atomic writer."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    parse_result,
    parse_run,
    read_run_registry,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc, run_is_live


def test_paths_follow_the_contract():
    assert _runs.run_dir("/data", "sweep") == "/data/runs/sweep"
    assert _runs.run_json("/data", "sweep") == "/data/runs/sweep/run.json"
    assert _runs.cell_dir("/data", "sweep", "lr-3e-4") == "/data/runs/sweep/cells/lr-3e-4"
    assert _runs.cell_log("/data", "sweep", "a") == "/data/runs/sweep/cells/a/log"
    assert _runs.result_json("/data", "sweep", "a") == "/data/runs/sweep/cells/a/result.json"
    assert _runs.monitor_jsonl("/data", "sweep") == "/data/runs/sweep/monitor.jsonl"
    assert _runs.patrol_dir("/data", "sweep") == "/data/runs/sweep/.patrol"
    assert _runs.done_marker("/data", "sweep") == "/data/runs/sweep/DONE"


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "", "x" * 65, "-dash", "sp ace"])
def test_names_that_could_leave_the_run_directory_are_refused(name):
    with pytest.raises(ValueError, match="does not match"):
        _runs.run_dir("/data", name)
    with pytest.raises(ValueError, match="cell name"):
        _runs.cell_dir("/data", "ok", name)


def test_write_json_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "run.json"
    target.write_text('{"old": true}')
    _runs.write_json_atomic(str(target), {"run": "sweep", "pgid": 42})
    assert json.loads(target.read_text()) == {"run": "sweep", "pgid": 42}
    assert os.listdir(tmp_path) == ["run.json"]


def test_write_json_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "run.json"
    target.write_text('{"old": true}')
    with pytest.raises(TypeError):
        _runs.write_json_atomic(str(target), {"not json": object()})
    assert json.loads(target.read_text()) == {"old": True}  # readers never see a torn or half-new file
    assert os.listdir(tmp_path) == ["run.json"]


def test_write_json_atomic_renames_over_the_target(tmp_path, monkeypatch):
    # The new content arrives by one rename from a temporary in the same directory, never by rewriting in place.
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: renames.append((src, dst)) or real_replace(src, dst))
    target = tmp_path / "result.json"
    _runs.write_json_atomic(str(target), {"status": "failed"})
    ((source, destination),) = renames
    assert os.path.dirname(source) == str(tmp_path) and destination == str(target)


SUCCEEDED = {
    "status": "succeeded",
    "exit_code": 0,
    "signal": None,
    "started_at": "2024-06-01T10:00:00Z",
    "ended_at": "2024-06-01T11:00:00Z",
    "sync": "verified",
    "artifacts": [{"path": "ckpt/last.pt", "size": 12, "sha256": "ab" * 32}],
}


def test_parse_result_reads_the_contracts_fields():
    result = parse_result(SUCCEEDED)
    assert (result.status, result.exit_code, result.signal, result.sync) == ("succeeded", 0, None, "verified")
    assert result.ended_at - result.started_at == 3600.0
    assert [(a.path, a.size, a.sha256) for a in result.artifacts] == [("ckpt/last.pt", 12, "ab" * 32)]
    killed = parse_result(dict(SUCCEEDED, status="failed", exit_code=None, signal=9, sync="skipped", artifacts=[]))
    assert (killed.exit_code, killed.signal, killed.artifacts) == (None, 9, ())


def test_a_cell_is_done_only_when_it_succeeded_and_its_sync_verified():
    assert parse_result(SUCCEEDED).counts_as_done()
    assert not parse_result(dict(SUCCEEDED, sync="failed")).counts_as_done()
    skipped = parse_result(dict(SUCCEEDED, sync="skipped"))
    assert not skipped.counts_as_done() and skipped.counts_as_done(declares_artifacts=False)
    assert not parse_result(dict(SUCCEEDED, status="failed", exit_code=1)).counts_as_done(declares_artifacts=False)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"status": "done"}, "status must be one of succeeded, failed"),
        ({"exit_code": 1}, "status succeeded contradicts exit_code 1"),
        ({"status": "failed"}, "status failed contradicts exit_code 0"),
        ({"exit_code": True}, "exit_code must be an integer or null"),
        ({"signal": "KILL"}, "signal must be an integer or null"),
        ({"ended_at": None}, "ended_at must be an ISO 8601 time"),
        ({"started_at": "yesterday"}, "Invalid isoformat"),
        ({"sync": "copied"}, "sync must be one of verified, failed, skipped"),
        ({"artifacts": {"path": "x"}}, "artifacts must be a list"),
        ({"artifacts": [{"path": "../escape", "size": 1, "sha256": "ab" * 32}]}, "relative to the cell directory"),
        ({"artifacts": [{"path": "/abs", "size": 1, "sha256": "ab" * 32}]}, "relative to the cell directory"),
        ({"artifacts": [{"path": "x", "size": -1, "sha256": "ab" * 32}]}, "size must be an integer of at least 0"),
        ({"artifacts": [{"path": "x", "size": 1, "sha256": "AB" * 32}]}, "sha256 must be 64 lowercase hex"),
    ],
)
def test_parse_result_rejects_bad_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_result(dict(SUCCEEDED, **changes))
    with pytest.raises(ValueError, match="must hold a JSON object"):
        parse_result([SUCCEEDED])


def test_parse_run_accepts_the_launch_roles_fields():
    run = parse_run(
        "d", "p", {"run": "sweep", "pgid": 321, "sid": 321, "pids": [321], "started_at": "1970-01-02T00:00:00Z"}
    )
    assert (run.name, run.pgid, run.sid, run.pids, run.started_at) == ("sweep", 321, 321, (321,), 86400.0)
    assert parse_run("dir-name", "p", {"pgid": 5, "started_at": 12.5}).name == "dir-name"
    assert parse_run("d", "p", {"sid": 5, "started_at": "1970-01-01T01:00:00+01:00"}).started_at == 0.0


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"pgid": 1}, "pgid must be an integer above 1"),
        ({"sid": "12"}, "sid must be an integer above 1"),
        ({"pgid": True}, "pgid must be an integer above 1"),
        ({"pids": [0]}, "pids must be a list of integers above 1"),
        ({"run": "x"}, "names no pgid, sid or pids"),
        ({"pgid": 5, "started_at": "yesterday"}, "Invalid isoformat"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_parse_run_rejects_bad_fields(document, message):
    with pytest.raises(ValueError, match=message):
        parse_run("d", "p", document)


def test_read_run_registry_reports_bad_files_and_keeps_good_ones(tmp_path):
    assert read_run_registry(None) == ([], [])
    for name, text in {"good": json.dumps({"pgid": 77}), "torn": '{"pgid": 7', "bad": '{"pgid": 1}'}.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "run.json").write_text(text)
    runs, problems = read_run_registry(str(tmp_path))
    assert [(r.name, r.pgid) for r in runs] == [("good", 77)]
    assert len(problems) == 2
    assert problems[0].startswith(str(tmp_path / "runs" / "bad" / "run.json") + ": pgid must be")
    assert problems[1].startswith(str(tmp_path / "runs" / "torn" / "run.json") + ": ")


# Issue 7 item 2: a run.json started_at without an offset is the box's local time.


@pytest.fixture
def west_of_utc():
    before = os.environ.get("TZ")
    os.environ["TZ"] = "America/Los_Angeles"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_naive_started_at_is_local_time(west_of_utc):
    assert parse_run("d", "p", {"pgid": 5, "started_at": "1970-01-02T00:00:00"}).started_at == 86400.0 + 8 * 3600
    assert parse_run("d", "p", {"pgid": 5, "started_at": "1970-01-02T00:00:00Z"}).started_at == 86400.0
    # A launcher born when the run started (local wall clock 2024-06-01 10:00, UTC-7) keeps the run live.
    born = datetime(2024, 6, 1, 17, 0, tzinfo=timezone.utc).timestamp()
    launcher = Proc(pid=300, ppid=1, pgid=300, sid=300, uid=0, name="bash", cmdline=("bash",), create_time=born)
    run = parse_run("live", "p", {"pgid": 300, "started_at": "2024-06-01T10:00:00"})
    assert run_is_live(run, {300: launcher}) is True


# Issue 7 item 11: a data_dir that is missing or not a directory is a registry problem, not an empty registry.


def test_read_run_registry_reports_a_missing_or_non_directory_data_dir(tmp_path):
    runs, problems = read_run_registry(str(tmp_path / "absent"))
    assert runs == []
    assert problems == [f"data_dir {tmp_path / 'absent'}: not found, so the run registry could not be read"]
    (tmp_path / "file").write_text("")
    assert read_run_registry(str(tmp_path / "file"))[1] == [
        f"data_dir {tmp_path / 'file'}: not a directory, so the run registry could not be read"
    ]
    (tmp_path / "empty").mkdir()
    assert read_run_registry(str(tmp_path / "empty")) == ([], [])
    (tmp_path / "flat" / "runs").parent.mkdir()
    (tmp_path / "flat" / "runs").write_text("")
    assert read_run_registry(str(tmp_path / "flat"))[1] == [
        f"{tmp_path / 'flat' / 'runs'}: not a directory, so the run registry could not be read"
    ]


def test_a_hung_data_dir_is_a_registry_problem_within_the_deadline(tmp_path, monkeypatch):
    # A dead network mount blocks listdir in the kernel; the registry read must give up, not hang with it.
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(os, "listdir", lambda path: time.sleep(60))  # inherited by the forked reader
    started = time.monotonic()
    runs, problems = read_run_registry(str(tmp_path), timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert runs == []
    assert problems == [
        f"data_dir {tmp_path}: did not answer within 0.5 s (a hung mount?), so the run registry could not be read"
    ]


def test_a_private_json_file_is_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        _runs.write_json_atomic(str(tmp_path / "secret.json"), {"K": "v"}, private=True)
        _runs.write_json_atomic(str(tmp_path / "open.json"), {"K": "v"})
    finally:
        os.umask(old)
    assert oct((tmp_path / "secret.json").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "open.json").stat().st_mode & 0o777) == "0o666"
    assert json.loads((tmp_path / "secret.json").read_text()) == {"K": "v"}
