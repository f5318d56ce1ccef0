"""load_verify on real processes: pass, fail, hang (the whole process group dies), missing programs, long output."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _load_verify
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._load_verify import (
    load_verify,
    parse_checks,
    run_check,
)

PY = sys.executable


def python(code: str, *args: str) -> List[str]:
    return [PY, "-c", code, *args]


def verify(*checks: Dict[str, Any], timeout_s: float = 30.0, output_bytes: int = 4000) -> Dict[str, Any]:
    return load_verify({"checks": list(checks), "timeout_s": timeout_s, "output_bytes": output_bytes})


def alive(pid: int) -> bool:
    """The process exists and is no zombie (an orphan's zombie waits for whatever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    until = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < until:
        time.sleep(0.05)
    return not alive(pid)


def read_pid(path: Path, seconds: float = 10.0) -> Optional[int]:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    return None


def test_a_passing_check():
    result = verify({"artifact": "cells/a/best.pth", "argv": python("print('loaded 3 tensors')")})
    assert (result["passed"], result["failed_artifacts"], result["changed"]) == (True, [], False)
    assert result["reason"] == "1 load check(s) passed"
    (check,) = result["checks"]
    assert (check["rc"], check["signal"], check["timed_out"], check["leftovers"]) == (0, None, False, 0)
    assert check["output_tail"] == "loaded 3 tensors\n"
    assert check["artifact"] == "cells/a/best.pth" and check["argv"][0] == PY
    assert 0 < check["duration_s"] < 10
    assert "problem" not in check


def test_a_failing_check_keeps_its_output_tail_and_every_check_runs():
    failing = python("import sys; print('reading'); sys.stderr.write('RuntimeError: bad magic\\n'); sys.exit(3)")
    result = verify(
        {"artifact": "cells/a/best.pth", "argv": failing},
        {"artifact": "cells/b/best.pth", "argv": python("pass")},
        {"artifact": "cells/c/best.pth", "argv": python("import sys; sys.exit(1)")},
    )
    assert result["passed"] is False
    assert result["failed_artifacts"] == ["cells/a/best.pth", "cells/c/best.pth"]
    assert result["reason"] == "load check of cells/a/best.pth exited with 3 (2 of 3 check(s) failed)"
    first = result["checks"][0]
    assert first["rc"] == 3 and "reading\n" in first["output_tail"]
    assert "RuntimeError: bad magic" in first["output_tail"]
    assert [check["rc"] for check in result["checks"]] == [3, 0, 1]


GRANDCHILD = """
import subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "300"])
open(sys.argv[1], "w").write(str(grandchild.pid))
print("started", flush=True)
time.sleep(300)
"""


def test_a_hang_past_the_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    started = time.monotonic()
    # 5 s, as for every check below that must be set up before its timeout, also on a loaded 2-core machine.
    result = verify({"artifact": "cells/a/best.pth", "argv": python(GRANDCHILD, str(pid_file))}, timeout_s=5.0)
    assert time.monotonic() - started < 15
    grandchild = read_pid(pid_file)
    assert grandchild is not None
    assert wait_gone(grandchild), f"the grandchild sleep {grandchild} survived"
    (check,) = result["checks"]
    assert (check["timed_out"], check["rc"], check["signal"]) == (True, None, 15)
    assert check["output_tail"] == "started\n"
    assert result["passed"] is False
    assert result["reason"] == (
        "load check of cells/a/best.pth timed out after 5 s (its process group was killed) (1 of 1 check(s) failed)"
    )


IGNORES_TERM = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
other_group = subprocess.Popen(["sleep", "300"], preexec_fn=os.setpgrp)
open(sys.argv[1], "w").write(str(other_group.pid))
time.sleep(300)
"""


def test_a_check_ignoring_sigterm_gets_sigkill_with_a_member_that_left_its_group(tmp_path, monkeypatch):
    monkeypatch.setattr(_load_verify, "TERM_GRACE_S", 0.5)
    pid_file = tmp_path / "other.pid"
    result = verify({"artifact": "x", "argv": python(IGNORES_TERM, str(pid_file))}, timeout_s=5.0)
    (check,) = result["checks"]
    assert (check["timed_out"], check["signal"]) == (True, 9)
    member = read_pid(pid_file)
    assert member is not None and wait_gone(member)


def test_processes_left_behind_by_a_passing_check_are_stopped_without_waiting_for_the_timeout(tmp_path):
    pid_file = tmp_path / "left.pid"
    code = "import subprocess, sys; p = subprocess.Popen(['sleep', '300']); open(sys.argv[1], 'w').write(str(p.pid))"
    started = time.monotonic()
    result = verify({"artifact": "x", "argv": python(code, str(pid_file))}, timeout_s=60)
    assert time.monotonic() - started < 10
    (check,) = result["checks"]
    assert (check["rc"], check["timed_out"], check["leftovers"]) == (0, False, 1)
    assert result["passed"] is True
    left = read_pid(pid_file)
    assert left is not None and wait_gone(left)


def test_a_missing_program_is_rc_127_naming_it():
    result = verify({"artifact": "cells/a/model.safetensors", "argv": ["no-such-loader-xyz", "model.safetensors"]})
    (check,) = result["checks"]
    assert check["rc"] == 127 and check["output_tail"] == "program not found: no-such-loader-xyz"
    assert result["reason"] == (
        "load check of cells/a/model.safetensors could not start: program not found: no-such-loader-xyz (rc 127)"
        " (1 of 1 check(s) failed)"
    )


def test_a_program_that_is_not_executable_is_rc_126(tmp_path):
    script = tmp_path / "loader"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    (check,) = verify({"artifact": "x", "argv": [str(script)]})["checks"]
    assert check["rc"] == 126 and check["output_tail"].startswith(f"program not executable: {script}")


def test_output_larger_than_output_bytes_keeps_only_the_tail():
    code = "import sys; sys.stdout.write('a' * 200000 + 'THE-END'); sys.stdout.flush()"
    (check,) = verify({"artifact": "x", "argv": python(code)}, output_bytes=100)["checks"]
    assert len(check["output_tail"]) == 100
    assert check["output_tail"] == "a" * 93 + "THE-END"


def test_output_bytes_zero_keeps_nothing():
    (check,) = verify({"artifact": "x", "argv": python("print('hello')")}, output_bytes=0)["checks"]
    assert check["output_tail"] == "" and check["rc"] == 0


def test_shell_syntax_in_argv_is_passed_literally(tmp_path):
    victim = tmp_path / "x"
    victim.write_text("keep me")
    marker = tmp_path / "pwned"
    hostile = [f";rm -rf {victim}", f"$(touch {marker})", "`id`", "a b", "|", "&&"]
    code = "import sys; print(repr(sys.argv[1:]))"
    (check,) = verify({"artifact": "x", "argv": python(code, *hostile)})["checks"]
    assert check["rc"] == 0 and check["output_tail"].strip() == repr(hostile)
    assert victim.read_text() == "keep me" and not marker.exists()


def test_stdin_is_dev_null_and_the_check_has_its_own_session():
    code = "import os, sys; print(repr(sys.stdin.read()), os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid())"
    saved = os.dup(0)
    read_end, write_end = os.pipe()
    os.write(write_end, b"typed at the terminal")
    os.close(write_end)
    os.dup2(read_end, 0)  # what a check with an inherited stdin would read
    try:
        (check,) = verify({"artifact": "x", "argv": python(code)})["checks"]
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)
    assert check["output_tail"] == "'' True True\n"


TERM_EXITS_0 = """
import signal, sys, time
def stop(signum, frame):
    print("interrupted by", signum, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(300)
"""


def test_a_check_that_exits_0_on_sigterm_after_its_timeout_still_fails_and_its_last_words_are_kept():
    # The check's handler gets SIGTERM once: a second one (to the group, then to the leader again) ended it halfway,
    # and it died of the signal instead of exiting 0. 5 s: the handler is in place before the timeout, loaded or not.
    result = verify({"artifact": "x", "argv": python(TERM_EXITS_0)}, timeout_s=5.0)
    (check,) = result["checks"]
    assert (check["timed_out"], check["rc"], check["signal"]) == (True, None, None)
    assert check["output_tail"] == "interrupted by 15\n"
    assert result["passed"] is False


def test_a_check_killed_by_a_signal_fails_with_it():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    result = verify({"artifact": "x", "argv": python(code)})
    (check,) = result["checks"]
    assert (check["rc"], check["signal"], check["timed_out"]) == (None, 9, False)
    assert result["reason"].startswith("load check of x killed by signal 9")


def test_no_checks_pass_with_nothing_verified():
    result = verify()
    assert (result["passed"], result["checks"], result["reason"]) == (
        True,
        [],
        "no load checks given: nothing to verify",
    )


@pytest.mark.parametrize(
    ("checks", "message"),
    [
        ("python", "checks must be a list"),
        (["python"], "checks[0] must be a dict"),
        ([{"artifact": "a", "argv": []}], "checks[0].argv must be a non-empty list of strings, got []"),
        ([{"artifact": "a", "argv": "python x"}], "checks[0].argv must be a non-empty list of strings"),
        ([{"artifact": "a", "argv": ["", "x"]}], "checks[0].argv[0] (the program) must not be empty"),
        ([{"artifact": "a", "argv": ["python", "a\0b"]}], "checks[0].argv must not contain a NUL character"),
        ([{"artifact": " ", "argv": ["true"]}], "checks[0].artifact must be a non-empty string"),
        ([{"artifact": "a", "argv": ["true"]}, {"argv": ["true"]}], "checks[1].artifact must be a non-empty string"),
    ],
)
def test_bad_checks_raise_value_error_naming_the_entry(checks, message):
    with pytest.raises(ValueError) as failure:
        parse_checks(checks)
    assert str(failure.value).startswith(message)


def test_run_check_never_raises_for_an_unrunnable_program(tmp_path):
    directory = tmp_path / "a-directory"
    directory.mkdir()
    check = run_check("x", [str(directory)], 5.0, 100)
    assert check["rc"] == 126 and str(directory) in check["output_tail"]
