"""Reading the kernel log through dmesg / journalctl with a fake runner, and splitting its records."""

from __future__ import annotations

from datetime import datetime, timezone

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _kernel_log as kl

DENIED = (1, "", "dmesg: read kernel buffer failed: Operation not permitted\n")
LOG = "2025-01-21T02:21:33,498559+00:00 NVRM: Xid (PCI:0000:38:00): 13, pid=1, name=python, fault\n"
JOURNAL = "2025-01-21T02:21:33+0000 host kernel: NVRM: Xid (PCI:0000:38:00): 13, pid=1, name=python, fault\n"


class FakeRun:
    """Answers by command name (argv[0] plus flags); records every call."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def __call__(self, argv, timeout):
        self.calls.append((list(argv), timeout))
        key = " ".join(argv[:2]) if argv[0] == "dmesg" else argv[0]
        return self.answers.get(key, (127, "", f"{argv[0]}: command not found"))


def test_dmesg_iso_ok():
    run = FakeRun({"dmesg --time-format=iso": (0, LOG * 3, "")})
    result = kl.read_kernel_log(run, timeout_s=5)
    assert result["source"] == "dmesg"
    assert result["lines"] == [LOG.rstrip("\n")] * 3
    assert result["attempts"] == [{"command": "dmesg --time-format=iso", "rc": 0, "error": None}]
    assert run.calls == [(["dmesg", "--time-format=iso"], 5)]
    assert kl.kernel_log_finding(result) is None


def test_dmesg_denied_then_journal_ok():
    run = FakeRun({"dmesg --time-format=iso": DENIED, "journalctl": (0, JOURNAL, "")})
    result = kl.read_kernel_log(run, timeout_s=5, max_lines=1000)
    assert result["source"] == "journalctl"
    assert result["lines"] == [JOURNAL.rstrip("\n")]
    assert [a["command"] for a in result["attempts"]] == [
        "dmesg --time-format=iso",
        "journalctl -k -o short-iso --no-pager -q -n 1000",
    ]
    assert result["attempts"][0]["error"] == "dmesg: read kernel buffer failed: Operation not permitted"
    assert kl.kernel_log_finding(result) is None


def test_dmesg_denied_and_journal_empty_is_unreadable():
    run = FakeRun({"dmesg --time-format=iso": DENIED, "journalctl": (0, "-- No entries --\n", "")})
    result = kl.read_kernel_log(run, timeout_s=5)
    assert (result["lines"], result["source"]) == (None, None)
    assert [(a["rc"], a["error"]) for a in result["attempts"]] == [
        (1, "dmesg: read kernel buffer failed: Operation not permitted"),
        (0, "no entries"),
    ]
    found = kl.kernel_log_finding(result)
    assert (found["code"], found["level"], found["action"], found["gpu"]) == (
        "kernel_log_unreadable",
        "WARN",
        "investigate",
        None,
    )
    assert "Operation not permitted" in found["message"] and "journalctl" in found["message"]
    assert found["attempts"] == result["attempts"]


def test_journal_that_prints_nothing_is_unreadable_too():
    run = FakeRun({"dmesg --time-format=iso": DENIED, "journalctl": (0, "", "")})
    assert kl.read_kernel_log(run, timeout_s=5)["lines"] is None


def test_both_denied():
    journal_denied = (1, "", "No journal files were opened due to insufficient permissions.\n")
    run = FakeRun({"dmesg --time-format=iso": DENIED, "journalctl": journal_denied})
    result = kl.read_kernel_log(run, timeout_s=5)
    assert result["lines"] is None
    assert result["attempts"][1]["error"] == "No journal files were opened due to insufficient permissions."
    assert kl.kernel_log_finding(result)["level"] == "WARN"


def test_dmesg_timeout_is_not_retried_without_the_flag():
    run = FakeRun({"dmesg --time-format=iso": (124, "", ""), "journalctl": (124, "", "")})
    result = kl.read_kernel_log(run, timeout_s=2.5)
    assert [a["command"].split()[0] for a in result["attempts"]] == ["dmesg", "journalctl"]
    assert [a["error"] for a in result["attempts"]] == ["timed out after 2.5 s"] * 2
    assert "timed out" in kl.kernel_log_finding(result)["message"]


def test_binaries_missing():
    result = kl.read_kernel_log(FakeRun({}), timeout_s=5)
    assert [(a["rc"], a["error"]) for a in result["attempts"]] == [(127, "not installed"), (127, "not installed")]
    assert kl.kernel_log_finding(result)["code"] == "kernel_log_unreadable"


def test_iso_flag_unsupported_falls_back_to_plain_dmesg():
    rejected = (1, "", "dmesg: unrecognized option '--time-format=iso'\nBusyBox v1.36.1 multi-call binary.\n")
    run = FakeRun({"dmesg --time-format=iso": rejected, "dmesg": (0, "[ 1.0] hello\n[ 2.0] world\n", "")})
    result = kl.read_kernel_log(run, timeout_s=5)
    assert (result["source"], result["lines"]) == ("dmesg", ["[ 1.0] hello", "[ 2.0] world"])
    assert [a["command"] for a in result["attempts"]] == ["dmesg --time-format=iso", "dmesg"]


def test_dmesg_that_prints_nothing_falls_through_to_the_journal():
    run = FakeRun({"dmesg --time-format=iso": (0, "", ""), "journalctl": (0, JOURNAL, "")})
    result = kl.read_kernel_log(run, timeout_s=5)
    assert result["source"] == "journalctl"
    assert result["attempts"][0]["error"] == "no entries"


def test_only_the_last_max_lines_are_kept():
    text = "".join(f"[ {i}.0] line {i}\n" for i in range(10))
    result = kl.read_kernel_log(FakeRun({"dmesg --time-format=iso": (0, text, "")}), timeout_s=5, max_lines=3)
    assert result["lines"] == ["[ 7.0] line 7", "[ 8.0] line 8", "[ 9.0] line 9"]


def test_boot_time_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nintr 5\nbtime 1737426093\nprocesses 9\n")
    assert kl.boot_time(str(stat)) == datetime(2025, 1, 21, 2, 21, 33, tzinfo=timezone.utc)
    stat.write_text("cpu 1 2 3\n")
    assert kl.boot_time(str(stat)) is None
    assert kl.boot_time(str(tmp_path / "missing")) is None


def test_boot_time_of_this_machine_is_in_the_past():
    booted = kl.boot_time()
    assert booted is not None and booted < datetime.now(timezone.utc)


def test_split_record_kmsg_and_plain():
    assert kl.split_record("6,3964,206764307,-;nvidia-nvswitch2: open") == (None, 206.764307, "nvidia-nvswitch2: open")
    assert kl.split_record("no prefix at all") == (None, None, "no prefix at all")
