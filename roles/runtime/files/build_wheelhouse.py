# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Download wheels for a box's Python version and architecture into a wheelhouse, atomically.

Runs on the controller (the runtime role calls it). pip's own wheel is included so the box can install
without ensurepip. The directory appears complete (with a ``.complete`` marker) or not at all, so parallel
runs and interrupted downloads never leave a half wheelhouse behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def parse_tag(tag: str) -> tuple:
    """'py3.11-x86_64' -> ('3.11', 'x86_64')."""
    version, _sep, machine = tag.removeprefix("py").partition("-")
    if not version or not machine:
        raise SystemExit(f"bad wheel tag {tag!r}: expected py<major>.<minor>-<machine>")
    return version, machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dest", required=True)
    parser.add_argument("--tag", required=True, help="py<major>.<minor>-<machine>, as the role's probe prints it")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    version, machine = parse_tag(args.tag)
    if os.path.exists(os.path.join(args.dest, ".complete")):
        return 0
    parent = os.path.dirname(os.path.abspath(args.dest))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    platforms = [f"manylinux2014_{machine}", f"manylinux_2_17_{machine}", f"manylinux2010_{machine}", "any"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        version,
        "--implementation",
        "cp",
        "--dest",
        staging,
    ]
    command += [arg for platform in platforms for arg in ("--platform", platform)]
    command += ["pip", *args.packages]
    try:
        subprocess.run(command, check=True, timeout=args.timeout)
        with open(os.path.join(staging, ".complete"), "w") as marker:
            marker.write(args.tag + "\n")
        os.chmod(staging, 0o755)
        os.rename(staging, args.dest)
    except OSError:
        if not os.path.exists(os.path.join(args.dest, ".complete")):  # another run may have won the rename
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
