# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The env hook and conda env around a cell's command: one constant bash wrapper, never a shell string built from
user input, that tells a failing hook apart from the command's own exit.

Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

# The one shell text the runner ever runs: a constant, never built from user input. Its arguments are the env hook
# file (trusted operator input: the platform profile's, e.g. /etc/network_turbo) or "", the conda env or "", the
# hook status file or "", "--", then the cell's argv. The argv is saved in an array before anything is sourced (a
# hook may shift or set -- the positional parameters), and the last step is exec: the exit status recorded is the
# command's own. A hook that exits the shell runs the EXIT trap, which writes "exit N" to the status file (exec
# never runs it); a hook that returns non-zero is only reported in the log and the command starts.
ENV_WRAPPER = r"""__rgt_hook=$1 __rgt_conda=$2 __rgt_status=$3
shift 3
[ "${1-}" = "--" ] && shift
__rgt_argv=("$@")
set --
__rgt_hook_failed() { if [ -n "$__rgt_status" ]; then echo "$1" >"$__rgt_status"; fi; }
if [ -n "$__rgt_hook" ]; then
  if [ ! -r "$__rgt_hook" ]; then
    echo "rgt: env_hook $__rgt_hook is not a readable file" >&2; __rgt_hook_failed unreadable; exit 126
  fi
  trap '__rgt_rc=$?; echo "rgt: env_hook $__rgt_hook exited $__rgt_rc, the command never started" >&2
    __rgt_hook_failed "exit $__rgt_rc"' EXIT
  . "$__rgt_hook" || echo "rgt: env_hook $__rgt_hook returned $?, going on" >&2
  trap - EXIT
fi
if [ -n "$__rgt_conda" ]; then
  for __rgt_base in "${CONDA_EXE:+${CONDA_EXE%/bin/conda}}" "$HOME/miniconda3" "$HOME/anaconda3" \
      /root/miniconda3 /opt/conda /usr/local/miniconda3; do
    if [ -n "$__rgt_base" ] && [ -f "$__rgt_base/etc/profile.d/conda.sh" ]; then
      . "$__rgt_base/etc/profile.d/conda.sh"; break
    fi
  done
  if ! command -v conda >/dev/null 2>&1; then
    echo "rgt: conda not found, cannot activate $__rgt_conda" >&2; exit 126
  fi
  conda activate "$__rgt_conda" || { echo "rgt: conda activate $__rgt_conda did not succeed" >&2; exit 126; }
fi
exec "${__rgt_argv[@]}"
"""


def command_argv(
    command: Sequence[str], env_hook: Optional[str], conda_env: Optional[str], hook_status: Optional[str] = None
) -> List[str]:
    """The argv to execute: the cell's own, or the fixed wrapper around it when a hook or conda env is asked for;
    ``hook_status`` is the file the wrapper writes when the hook ends the shell (see :func:`hook_failure`)."""
    if not env_hook and not conda_env:
        return list(command)
    return ["bash", "-c", ENV_WRAPPER, "rgt", env_hook or "", conda_env or "", hook_status or "", "--", *command]


def hook_failure(status_path: Optional[str], env_hook: Optional[str]) -> Optional[str]:
    """The reason when the wrapper's status file says the env hook ended the shell (the file is removed), else
    None. The command never started then: its exit status is no command's."""
    if not status_path:
        return None
    try:
        with open(status_path, encoding="utf-8", errors="replace") as handle:
            said = handle.read(200).strip()
        os.unlink(status_path)
    except OSError:
        return None
    if said == "unreadable":
        return f"env hook {env_hook} is not a readable file: the command never started"
    return f"env hook {env_hook} failed ({said or 'exit ?'}): the command never started"
