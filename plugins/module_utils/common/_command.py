# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Bounded external commands: every call takes an argv list and a timeout.

A *runner* is any callable ``run(argv, timeout) -> (rc, stdout, stderr)``. Probes take a runner
as an argument so tests can hand in canned output and modules can choose how commands are run.
Return codes follow coreutils ``timeout``: 124 when the time ran out, 127 when the binary is missing.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable, List, Tuple

Runner = Callable[[List[str], float], Tuple[int, str, str]]

RC_TIMEOUT = 124
RC_NOT_EXECUTABLE = 126
RC_NOT_FOUND = 127
# A bound on the text kept from one command; the kernel ring buffer is itself bounded (log_buf_len).
MAX_BYTES = 64 * 1024 * 1024


def subprocess_runner(argv: List[str], timeout: float) -> Tuple[int, str, str]:
    """Run ``argv`` (no shell) with a timeout: (rc, stdout, stderr); rc 124 on timeout, 127 when missing."""
    # Tool output is parsed, so keep it untranslated.
    env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        # Not run_command: probes run without an AnsibleModule too (the runner, the unit tests).
        done = subprocess.run(  # pylint: disable=ansible-bad-function
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return RC_TIMEOUT, "", f"timed out after {timeout:g} s"
    except FileNotFoundError:
        return RC_NOT_FOUND, "", f"{argv[0]}: command not found"
    except PermissionError as exc:
        return RC_NOT_EXECUTABLE, "", f"{argv[0]}: {exc.strerror}"
    return done.returncode, _text(done.stdout), _text(done.stderr)


def _text(data: bytes) -> str:
    return data[-MAX_BYTES:].decode("utf-8", errors="replace")
