# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The runtime probe (roles/runtime): run by the box's base Python (3.8+, standard library only).

    python3 -c "$(cat runtime_probe.py)" DATA_DIR VENV_PYTHON TIMEOUT_S

Prints one JSON object: the Python version and architecture (to pick wheels), whether DATA_DIR is a
writable directory, and whether the runtime venv already imports nvidia-ml-py and psutil. A dead network
mount blocks stat, open and exec in the kernel, so everything that touches DATA_DIR or the venv runs in
a forked child with a deadline; a child that misses it is killed and never waited for.
"""

import json
import os
import platform
import signal
import sys
import time

POLL_S = 0.02
# Exit codes of the directory check child.
DIR_PROBLEMS = {1: "could not be checked", 2: "does not exist", 3: "is not a directory", 4: "is not writable"}


def check_dir(path):
    if not os.path.lexists(path):
        return 2
    if not os.path.isdir(path):
        return 3
    return 0 if os.access(path, os.W_OK | os.X_OK) else 4


def import_runtime(venv_python):
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.execv(venv_python, [venv_python, "-c", "import pynvml, psutil"])


def in_child(timeout_s, function, *args):
    """function(*args)'s exit code in a forked child, or None when it did not end within timeout_s."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = function(*args)
        finally:
            os._exit(code if isinstance(code, int) else 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
        time.sleep(POLL_S)
    os.kill(pid, signal.SIGKILL)
    # A killed child blocked on a mount normally dies at once; reap it if so, but never wait for it.
    for _attempt in range(25):
        if os.waitpid(pid, os.WNOHANG)[0]:
            break
        time.sleep(POLL_S)
    return None


def main(data_dir, venv_python, timeout_s):
    code = in_child(timeout_s, check_dir, data_dir)
    usable = code == 0
    problem = f"did not answer within {timeout_s:g} s" if code is None else DIR_PROBLEMS.get(code)
    ready = usable and in_child(timeout_s, import_runtime, venv_python) == 0
    python = "{}.{}".format(*sys.version_info[:2])
    return {
        "python": python,
        "machine": platform.machine(),
        "wheel_tag": f"py{python}-{platform.machine()}",
        "ready": ready,
        "data_dir": {"usable": usable, "problem": problem},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], float(sys.argv[3]))))
