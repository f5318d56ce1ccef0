"""Reading the kernel log through dmesg / journalctl with a fake runner, and splitting its records."""

from __future__ import annotations

import os
import random
import time
from datetime import datetime, timezone

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import subprocess_runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _kernel_log as kl
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _xid
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _stream_tail as st
from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES

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


# --- the tail of a long log ------------------------------------------------------------------------------------
def numbered(count, start=0):
    return "".join(f"[ {i}.0] line {i}\n" for i in range(start, start + count))


def fake_dmesg(tmp_path, monkeypatch, script):
    """A ``dmesg`` on PATH running ``script`` (sh), for the streamed path of the module's own runner."""
    tool = tmp_path / "bin" / "dmesg"
    tool.parent.mkdir(exist_ok=True)
    tool.write_text("#!/bin/sh\n" + script + "\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")


def test_a_log_bigger_than_the_cap_keeps_exactly_its_last_lines_and_says_so():
    run = FakeRun({"dmesg --time-format=iso": (0, numbered(1000), "")})
    result = kl.read_kernel_log(run, timeout_s=5, max_lines=7)
    assert result["lines"] == [f"[ {i}.0] line {i}" for i in range(993, 1000)]
    assert result["truncated"] is True
    assert result["bytes_read"] == len(numbered(1000))
    assert result["bytes_decoded"] == len(numbered(7, start=993))


def test_a_log_within_the_cap_is_not_truncated():
    result = kl.read_kernel_log(FakeRun({"dmesg --time-format=iso": (0, numbered(7), "")}), timeout_s=5, max_lines=7)
    assert len(result["lines"]) == 7
    assert (result["truncated"], result["bytes_read"], result["bytes_decoded"]) == (False, 98, 98)


def test_a_last_line_without_newline_is_kept_and_counts_as_a_line():
    text = numbered(5) + "[ 5.0] no newline"
    result = kl.read_kernel_log(FakeRun({"dmesg --time-format=iso": (0, text, "")}), timeout_s=5, max_lines=2)
    assert result["lines"] == ["[ 4.0] line 4", "[ 5.0] no newline"]
    assert result["truncated"] is True


def test_a_line_split_across_blocks_comes_out_whole_wherever_the_split_falls():
    data = numbered(6).encode()
    for block in (1, 3, 7, 16, 64):
        for first in range(len(data) + 1):  # fed in two pieces, cut at every byte
            tail = st.TailBuffer(max_lines=4, block=block)
            tail.feed(data[:first])
            tail.feed(data[first:])
            text, decoded, truncated = tail.text()
            assert text == numbered(4, start=2), (block, first)
            assert (decoded, truncated) == (len(numbered(4, start=2)), True)


def test_the_buffer_holds_about_its_byte_cap_not_the_whole_stream():
    tail = st.TailBuffer(max_lines=10, max_bytes=512, block=64)
    for i in range(10000):
        tail.feed(f"[ {i}.0] line {i}\n".encode())
        assert sum(len(piece) for piece in tail._blocks) <= 512 + 64
    assert tail.text()[0] == numbered(10, start=9990)


def test_lines_cut_by_dropped_blocks_or_the_byte_cap_never_come_out_as_fragments():
    data = numbered(300).encode()
    for block in (5, 14, 16, 64):
        for max_bytes in (13, 14, 15, 28, 100, 112, 1000):
            for max_lines in (1, 3, 50, 500):
                tail = st.TailBuffer(max_lines=max_lines, max_bytes=max_bytes, block=block)
                tail.feed(data)
                text, decoded, truncated = tail.text()
                kept = data[-max_bytes:].split(b"\n", 1)[1] if len(data) > max_bytes else data
                expected = b"".join(kept.splitlines(keepends=True)[-max_lines:]).decode()
                assert (text, decoded, truncated) == (expected, len(expected), True), (block, max_bytes, max_lines)


def test_the_byte_cap_keeps_only_whole_lines_within_it():
    tail = st.TailBuffer(max_lines=1000, max_bytes=40, block=8)
    tail.feed(numbered(10).encode())  # 14 bytes a line: the last 40 bytes hold 2 whole lines and part of one
    text, decoded, truncated = tail.text()
    assert (text, decoded, truncated) == ("[ 8.0] line 8\n[ 9.0] line 9\n", 28, True)


def test_the_byte_cap_drops_a_cut_line_even_when_the_blocks_kept_are_exactly_the_cap():
    tail = st.TailBuffer(max_lines=100, max_bytes=8, block=4)
    tail.feed(b"ab\ncd\nef\ngh\n")  # three full blocks; the last 8 bytes start inside "cd"
    assert tail.text() == ("ef\ngh\n", 6, True)


def test_crlf_and_invalid_utf8_are_read_leniently():
    tail = st.TailBuffer(max_lines=10)
    tail.feed(b"[ 1.0] caf\xe9 \xff\xfe\r\n\r\n[ 2.0] ok\r\n")
    lines = st.LogLines(tail.text()[0])
    assert list(lines) == ["[ 1.0] caf\ufffd \ufffd\ufffd", "[ 2.0] ok"]


def test_a_multibyte_character_cut_by_a_block_is_decoded_whole():
    data = "[ 1.0] name=caf\u00e9\u2603\n".encode()
    for cut in range(len(data)):
        tail = st.TailBuffer(max_lines=10, block=max(1, cut))
        tail.feed(data[:cut])
        tail.feed(data[cut:])
        assert tail.text()[0] == "[ 1.0] name=caf\u00e9\u2603\n"


def test_an_empty_tail():
    assert st.TailBuffer(max_lines=3).text() == ("", 0, False)
    assert list(st.LogLines("")) == [] and len(st.LogLines("\n \n")) == 0


def test_log_lines_behave_like_the_list_of_lines():
    lines = st.LogLines("a\r\n\n  \nb\nc")
    assert lines == ["a", "b", "c"] and len(lines) == 3 and lines[-1] == "c" and lines[1:] == ["b", "c"]
    assert lines != ["a", "b"] and lines == st.LogLines("a\nb\nc\n")


def test_an_xid_only_in_the_dropped_part_leaves_a_truncated_log_not_a_clean_one():
    text = LOG + numbered(50)
    result = kl.read_kernel_log(FakeRun({"dmesg --time-format=iso": (0, text, "")}), timeout_s=5, max_lines=50)
    assert "Xid" not in "".join(result["lines"])
    assert result["truncated"] is True
    assert _xid.parse_kernel_log(result["lines"]) == []


def test_journal_that_printed_the_full_cap_may_have_left_older_lines_out():
    run = FakeRun({"dmesg --time-format=iso": DENIED, "journalctl": (0, JOURNAL * 3, "")})
    assert kl.read_kernel_log(run, timeout_s=5, max_lines=3)["truncated"] is True
    assert kl.read_kernel_log(run, timeout_s=5, max_lines=4)["truncated"] is False


def test_streamed_dmesg_keeps_the_tail_of_a_long_output(tmp_path, monkeypatch):
    log = tmp_path / "kern.log"
    log.write_bytes(numbered(300000).encode())
    fake_dmesg(tmp_path, monkeypatch, f"exec cat {log}")
    result = kl.read_kernel_log(subprocess_runner, timeout_s=30, max_lines=1000)
    assert result["source"] == "dmesg" and result["attempts"][0]["error"] is None
    assert result["lines"] == [f"[ {i}.0] line {i}" for i in range(299000, 300000)]
    assert result["bytes_read"] == log.stat().st_size
    assert (result["bytes_decoded"], result["truncated"]) == (len(numbered(1000, start=299000)), True)


def test_streamed_dmesg_denied_falls_through_with_its_message(tmp_path, monkeypatch):
    fake_dmesg(tmp_path, monkeypatch, "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1")
    result = kl.read_kernel_log(subprocess_runner, timeout_s=5)
    assert result["attempts"][0] == {
        "command": "dmesg --time-format=iso",
        "rc": 1,
        "error": "dmesg: read kernel buffer failed: Operation not permitted",
    }
    assert result["source"] != "dmesg"


def test_streamed_dmesg_that_prints_nothing_has_no_entries(tmp_path, monkeypatch):
    fake_dmesg(tmp_path, monkeypatch, "exit 0")
    result = kl.read_kernel_log(subprocess_runner, timeout_s=5)
    assert result["attempts"][0]["error"] == "no entries"


def test_streamed_dmesg_past_its_timeout_is_killed(tmp_path, monkeypatch):
    fake_dmesg(tmp_path, monkeypatch, "echo started; exec sleep 30")
    started = time.monotonic()
    result = kl.read_kernel_log(subprocess_runner, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert result["attempts"][0] == {"command": "dmesg --time-format=iso", "rc": 124, "error": "timed out after 0.5 s"}


def test_stream_command_missing_and_not_executable(tmp_path):
    assert st.stream_command([str(tmp_path / "nothing")], 5, st.TailBuffer(1))[0] == 127
    tool = tmp_path / "not-executable"
    tool.write_text("#!/bin/sh\n")
    assert st.stream_command([str(tool)], 5, st.TailBuffer(1))[0] == 126


# --- a LogLines (read_kernel_log's lines) is searched as one text ---------------------------------------------------
def test_log_lines_give_the_same_events_as_the_list_of_their_lines_for_every_capture():
    for path in sorted((CAPTURES / "kmsg").iterdir()):
        lines = st.LogLines(path.read_text(encoding="utf-8"))
        assert _xid.parse_kernel_log(lines, local_tz=timezone.utc) == _xid.parse_kernel_log(
            list(lines), local_tz=timezone.utc
        ), path


OPENER = "[ 7.0] NVRM: The NVIDIA GPU 0000:18:00.0"
KINDS = (
    "[ 1.0] eth0: link up",
    "",
    "   ",
    "  continued, indented",
    OPENER,
    "[ 7.1] NVRM: (PCI ID: 10de:2901) installed in this system has",
    "[ 7.2] NVRM: fallen off the bus and is not responding to commands.",
    "[ 8.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python, Graphics Exception",
    "[ 9.0] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "[ 9.5] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
)


def test_log_lines_give_the_same_events_as_their_list_on_random_mixes():
    rng = random.Random(9)
    for case in range(400):
        picked = [rng.choice(KINDS) for _pick in range(rng.randint(0, 40))]
        text = "".join(line + rng.choice(("\n", "\r\n")) for line in picked)
        if picked and rng.random() < 0.3:
            text = text.rstrip("\r\n")  # a last line without newline
        lines = st.LogLines(text)
        assert _xid.parse_kernel_log(lines) == _xid.parse_kernel_log(list(lines)), (case, text)


@pytest.mark.parametrize(("between", "joined"), [(3, True), (4, False)])
def test_a_split_block_ends_after_the_same_number_of_lines_when_searched(between, joined):
    noise = ["[ 7.5] eth0: link up"] * between
    text = "\n".join([OPENER, *noise, "[ 7.9] NVRM: fallen off the bus and is not responding."]) + "\n"
    (event,) = _xid.parse_kernel_log(st.LogLines(text))
    assert event["event"] == "fallen_off_bus"
    assert (event["pci"] == "0000:18:00") is joined


def test_only_the_lines_that_may_matter_are_visited():
    noise = "[ 1.0] eth0: link up\n" * 1000
    text = noise + "[ 8.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=p, x\n" + noise + f"{OPENER}\n" + noise
    visited = list(_xid._lines_that_may_matter(text))
    assert visited == ["[ 8.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=p, x", OPENER] + ["[ 1.0] eth0: link up"] * 4
