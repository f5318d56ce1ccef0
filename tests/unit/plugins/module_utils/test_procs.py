"""Process enumeration and reaping against real processes (a temp file stands in for /dev/nvidia0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import harness
import psutil
import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs import _procs, _zombie_scan
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc


@pytest.fixture
def device(tmp_path, monkeypatch):
    node = tmp_path / "nvidia0"
    node.write_bytes(b"")
    monkeypatch.setattr(_procs, "DEVICE_PATTERN", re.compile("^" + re.escape(str(node)) + "$"))
    yield node
    harness.stop_all()


def test_default_pattern_matches_the_nvidia_nodes_only():
    matching = ["/dev/nvidia0", "/dev/nvidia15", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert all(_procs.DEVICE_PATTERN.match(path) for path in matching)
    others = ["/dev/nvidia-modeset", "/dev/nvidia", "/tmp/dev/nvidia0", "/dev/nvidia0 (deleted)", "/dev/nvidiactlx"]
    assert not any(_procs.DEVICE_PATTERN.match(path) for path in others)


def test_read_process_table_finds_holders_with_identity(device, tmp_path):
    job = harness.start_job(tmp_path / "job.json", device, "--workers", "2", "--dataloaders")
    table, stats = _procs.read_process_table()
    holders = sorted(pid for pid, proc in table.items() if proc.devices)
    assert holders == job["holders"]
    worker = table[job["workers"][0]]
    assert worker.devices == (str(device),)
    assert (worker.ppid, worker.pgid, worker.sid) == (job["launcher"], job["pgid"], job["sid"])
    assert worker.cmdline[1].endswith("fake_job.py") and "worker" in worker.cmdline
    assert worker.create_time >= table[job["launcher"]].create_time
    assert table[job["launcher"]].devices == ()
    assert stats["processes"] == len(table) and stats["processes"] > len(holders)


def test_unreadable_and_vanishing_processes_are_counted_not_fatal(device, tmp_path, monkeypatch):
    job = harness.start_job(tmp_path / "job.json", device, "--workers", "3")
    locked, gone, hidden = job["workers"]
    launcher = job["launcher"]
    real_held, real_stat, real_uid = _procs._held_devices, _procs._stat_fields, _procs._real_uid

    def held(pid, pattern):
        if pid == locked:
            raise PermissionError(13, "Permission denied")
        return real_held(pid, pattern)

    def stat(pid):
        if pid == launcher:  # exits between its fd listing and its stat
            raise FileNotFoundError(2, "No such file")
        return real_stat(pid)

    def uid(pid):
        if pid == gone:  # a holder that exits before its identity is read
            raise ProcessLookupError(3, "No such process")
        if pid == hidden:  # its identity cannot be read (hidepid)
            raise PermissionError(13, "Permission denied")
        return real_uid(pid)

    monkeypatch.setattr(_procs, "_held_devices", held)
    monkeypatch.setattr(_procs, "_stat_fields", stat)
    monkeypatch.setattr(_procs, "_real_uid", uid)
    table, stats = _procs.read_process_table()
    assert stats["fd_unreadable"] == 2
    assert stats["vanished"] >= 2  # other processes on the machine may exit during the scan too
    assert table[locked].devices == ()
    assert gone not in table and launcher not in table and hidden not in table
    assert stats["processes"] == len(table)


def test_a_process_exiting_mid_listing_is_vanished_not_fatal(monkeypatch):
    def listing_fails(path):
        if isinstance(path, int):  # a /proc/<pid>/fd listing, not /proc's own
            raise ProcessLookupError(3, "No such process")
        return real_scandir(path)

    real_scandir = _procs.os.scandir

    monkeypatch.setattr(_procs.os, "scandir", listing_fails)
    table, stats = _procs.read_process_table()
    assert table == {} and stats["processes"] == 0 and stats["vanished"] > 0


def test_only_holders_get_their_full_identity_and_no_file_is_read_twice(device, tmp_path, monkeypatch):
    job = harness.start_job(tmp_path / "job.json", device, "--workers", "2", "--dataloaders")
    reads = {"stat": [], "cmdline": [], "uid": []}

    def counted(kind, real):
        def read(pid):
            reads[kind].append(pid)
            return real(pid)

        return read

    monkeypatch.setattr(_procs, "_stat_fields", counted("stat", _procs._stat_fields))
    monkeypatch.setattr(_procs, "read_cmdline", counted("cmdline", _procs.read_cmdline))
    monkeypatch.setattr(_procs, "_real_uid", counted("uid", _procs._real_uid))
    monkeypatch.setattr(psutil, "Process", None)  # psutil's per-process objects are not used to scan
    table, _stats = _procs.read_process_table()
    holders = sorted(pid for pid, proc in table.items() if proc.devices)
    assert holders == job["holders"]
    assert sorted(reads["cmdline"]) == holders and sorted(reads["uid"]) == holders
    assert len(reads["stat"]) == len(set(reads["stat"])) and set(table) <= set(reads["stat"])
    assert all(proc.cmdline == () and proc.uid is None for proc in table.values() if not proc.devices)


def test_holders_identity_is_psutils(device, tmp_path):
    job = harness.start_job(tmp_path / "job.json", device, "--workers", "1", "--dataloaders")
    table, _stats = _procs.read_process_table()
    for pid in job["holders"]:
        proc, real = table[pid], psutil.Process(pid)
        # Exactly what reap() compares before signalling (same_process), and what the result reports.
        assert (proc.create_time, proc.cmdline) == (real.create_time(), tuple(real.cmdline()))
        assert (proc.ppid, proc.uid, proc.name, proc.defunct) == (real.ppid(), real.uids().real, real.name(), False)


def test_processes_without_devices_agree_with_psutil(device, tmp_path):
    job = harness.start_job(tmp_path / "job.json", device, "--workers", "1")
    launcher = job["launcher"]
    table, _stats = _procs.read_process_table()
    other, real = table[launcher], psutil.Process(launcher)
    assert other.devices == () and other.cmdline == () and other.uid is None
    assert other.create_time == real.create_time()  # psutil's formula: start ticks / CLK_TCK + boot time
    assert (other.ppid, other.pgid, other.sid) == (real.ppid(), job["pgid"], job["sid"])
    assert other.name == real.name() and other.defunct is False and other.kernel_thread is False
    table = _procs.with_commands(table, [launcher, 999_999_999])  # a PID that is gone is left out quietly
    assert table[launcher].cmdline == tuple(real.cmdline())


def test_read_cmdline_splits_as_psutil_does():
    code = "import time; print('ok', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code, "a b", ""], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout.readline() == b"ok\n"
        assert _procs.read_cmdline(child.pid) == tuple(psutil.Process(child.pid).cmdline())
        assert _procs.read_cmdline(child.pid)[-2:] == ("a b", "")
    finally:
        child.kill()
        child.wait()


def test_stat_fields_survive_a_command_name_with_parentheses():
    code = "import sys, time; open('/proc/self/comm', 'w').write('a) b (c'); print('ok', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout.readline() == b"ok\n"
        stat = _procs._stat_fields(child.pid)
        assert (stat.comm, stat.pgid, stat.sid, stat.ppid) == ("a) b (c", child.pid, child.pid, os.getpid())
        assert stat.state in "RS" and not stat.flags & _procs.PF_KTHREAD
    finally:
        child.kill()
        child.wait()


def test_reap_terminates_then_kills_and_never_touches_a_reused_pid(device, tmp_path):
    polite = harness.start_job(tmp_path / "polite.json", device, "--workers", "1")
    stubborn = harness.start_job(tmp_path / "stubborn.json", device, "--workers", "1", "--ignore-term")
    bystander = harness.start_job(tmp_path / "bystander.json", device, "--workers", "1")
    table, _stats = _procs.read_process_table()
    victim_polite, victim_stubborn = table[polite["workers"][0]], table[stubborn["workers"][0]]
    # Same PID, different birth: a reused PID must not be signalled.
    impostor = victim_polite.__class__(**dict(vars(table[bystander["workers"][0]]), create_time=1.0))
    result = _procs.reap([victim_polite, victim_stubborn, impostor], grace_s=0.5)
    assert result["killed"] == [
        {"pid": victim_polite.pid, "name": victim_polite.name, "signal": "SIGTERM"},
        {"pid": victim_stubborn.pid, "name": victim_stubborn.name, "signal": "SIGKILL"},
    ]
    assert result["failed"] == []
    assert [entry["pid"] for entry in result["skipped"]] == [impostor.pid]
    assert "another process" in result["skipped"][0]["why"]
    assert not harness.alive(victim_polite.pid) and not harness.alive(victim_stubborn.pid)
    assert harness.alive(bystander["workers"][0])
    again = _procs.reap([victim_polite], grace_s=0.1)
    assert again["killed"] == [] and again["skipped"][0]["pid"] == victim_polite.pid


def test_one_identity_rule_for_signalling_and_for_verifying(monkeypatch):
    victim = Proc(pid=4242, ppid=1, pgid=4240, sid=4240, uid=0, name="python", cmdline=("python", "w.py"),
                  create_time=1000.0, devices=("/dev/nvidia0",))  # fmt: skip
    # The reaped process seen again with psutil's create-time jitter still holds the device: a failure, not a kill.
    # (The rule itself, same_process, is tested in test_proctree.)
    jittered = Proc(**dict(vars(victim), create_time=1000.004))
    monkeypatch.setattr(_procs, "read_process_table", lambda: ({4242: jittered}, {}))
    killed, failed = [{"pid": 4242, "name": "python", "signal": "SIGKILL"}], []
    assert _zombie_scan._verify(killed, {4242: victim}, failed) is False
    assert killed == []
    assert failed == [{"pid": 4242, "name": "python", "error": "still holds a device after the signal"}]
