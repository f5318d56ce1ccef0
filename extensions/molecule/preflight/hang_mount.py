# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Make a directory of one simulated box hang like an sshfs mount whose daemon is stopped.

Mounts a FUSE filesystem over PATH in the box's mount namespace and never answers it: every stat, open or
exec below PATH then waits in the kernel (state D, killable) until its caller gives up. The connection's
only file descriptor is held by a ``sleep`` in the box's PID namespace, so the mount goes with the box.

    python hang_mount.py FLEET_STATE_DIR HOST PATH

Prints "changed" when it mounted, nothing when PATH of HOST already hangs. Needs root and /dev/fuse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

WAIT_S = 10
# Mount with the fd the holder inherited (no mount.fuse helper: -i), then keep it open in the background.
HOLDER_SCRIPT = 'mount -i -t fuse -o "$1" rgt-hung "$2" && (exec sleep infinity </dev/null >/dev/null 2>&1 &)'


def is_hung_mount(init_pid: int, path: str) -> bool:
    """Read the box's mount table from outside: nothing here touches PATH itself."""
    mountinfo = Path(f"/proc/{init_pid}/mountinfo").read_text()
    return any(line.split()[4] == path and " - fuse " in line for line in mountinfo.splitlines())


def main() -> int:
    state_dir, host, path = sys.argv[1:4]
    record = json.loads((Path(state_dir) / "fleet.json").read_text())
    init_pid = next(entry["init_pid"] for entry in record["hosts"] if entry["name"] == host)
    if is_hung_mount(init_pid, path):
        return 0
    fuse_fd = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={fuse_fd},rootmode=40000,user_id=0,group_id=0"
    argv = ["nsenter", f"--target={init_pid}", "--mount", "--pid", "--", "/bin/sh", "-c", HOLDER_SCRIPT, "sh"]
    subprocess.run([*argv, options, path], pass_fds=(fuse_fd,), stdin=subprocess.DEVNULL, check=True, timeout=WAIT_S)
    os.close(fuse_fd)
    deadline = time.monotonic() + WAIT_S
    while not is_hung_mount(init_pid, path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{host}: no FUSE mount at {path} after {WAIT_S} s")
        time.sleep(0.1)
    print("changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
