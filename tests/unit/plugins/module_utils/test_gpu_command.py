"""The bounded command runner gpu_health and the other probes take."""

from __future__ import annotations

import sys

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import (
    RC_NOT_FOUND,
    RC_TIMEOUT,
    subprocess_runner,
)


def test_output_exit_code_timeout_and_missing_binary():
    assert subprocess_runner(["sh", "-c", "echo out; echo err >&2; exit 3"], 5) == (3, "out\n", "err\n")
    assert subprocess_runner(["sleep", "5"], 0.3)[0] == RC_TIMEOUT
    assert subprocess_runner(["/nonexistent/nvidia-smi", "-q"], 5)[0] == RC_NOT_FOUND


def test_argv_is_never_a_shell_string():
    rc, out, _err = subprocess_runner(["echo", "$(id); *"], 5)
    assert (rc, out) == (0, "$(id); *\n")


def test_subprocess_runner_ok_and_failing():
    rc, out, err = subprocess_runner([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], 30)
    assert err == ""
    assert (rc, out) == (3, "out\n")
    assert subprocess_runner(["/nonexistent/dmesg-binary"], 5)[0] == RC_NOT_FOUND


def test_subprocess_runner_timeout():
    rc, _out, err = subprocess_runner([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert rc == RC_TIMEOUT
    assert "timed out" in err
