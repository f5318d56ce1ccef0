# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Bounded external commands: every call takes an argv list and a timeout.

A *runner* is any callable ``run(argv, timeout) -> (rc, stdout, stderr)``. Probes take a runner
as an argument so tests can hand in canned output and modules can choose how commands are run.
Return codes follow coreutils ``timeout``: 124 when the time ran out, 127 when the binary is missing.
The plain subprocess runner lives in ``_kernel_log`` (written first) and is re-exported here.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils._kernel_log import (
    RC_MISSING as RC_NOT_FOUND,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils._kernel_log import (
    RC_TIMEOUT,
    Runner,
    subprocess_runner,
)

__all__ = ["RC_NOT_FOUND", "RC_TIMEOUT", "Runner", "module_runner", "subprocess_runner"]

# Tool output is parsed, so keep it untranslated.
_C_LOCALE = {"LC_ALL": "C", "LANG": "C"}


def _text(data: Any) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return str(data)


def module_runner(module: Any) -> Runner:
    """A runner on top of ``AnsibleModule.run_command``.

    ``run_command`` has no timeout, so the command is wrapped in coreutils ``timeout`` (which
    exits 124 on expiry, 127 for a missing binary, instead of ``run_command`` failing the module);
    without ``timeout`` on the node this falls back to ``subprocess_runner``.
    """
    timeout_bin = module.get_bin_path("timeout")

    def run(argv: List[str], timeout: float) -> Tuple[int, str, str]:
        if timeout_bin is None:
            return subprocess_runner(argv, timeout)
        wrapped = [timeout_bin, "--kill-after=2", f"{timeout:g}", *argv]
        rc, out, err = module.run_command(wrapped, environ_update=dict(_C_LOCALE), expand_user_and_vars=False)
        return rc, _text(out), _text(err)

    return run
