"""Find the Pythons of the version matrix: a controller's, and the oldest and newest box Python of an ansible-core.

    python tests/compat/pythons.py find 3.13 3.12        the first of these found (its path); exit 1 otherwise
    python tests/compat/pythons.py box oldest|newest     the box Python for the ansible-core this Python imports
    python tests/compat/pythons.py box oldest --version  its X.Y instead of its path

A Python X.Y is ``pythonX.Y`` on PATH, else ``$PYENV_ROOT/versions/X.Y.*/bin/pythonX.Y`` (default ~/.pyenv), newest
patch first. Each candidate is run once: a pyenv shim for a version that is not selected fails and is passed over,
and the path returned is the interpreter's own ``sys.executable`` (a shim needs pyenv's state; the box has none).
A missing Python is an error naming it and how to get it, never a skip.
From Python: ``find_python("3.8")``, ``box_version("oldest")``, ``box_python("newest")``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

VERSION = re.compile(r"^3\.\d+$")
PROBE = "import sys; print(sys.executable); print('%d.%d' % sys.version_info[:2])"
PROBE_TIMEOUT_S = 30
# The box (target) Pythons each ansible-core accepts, from its support matrix ("Target Python" column of
# https://docs.ansible.com/ansible/latest/reference_appendices/release_and_maintenance.html#ansible-core-support-matrix):
# 2.19 runs modules on 3.8-3.13, 2.20 and 2.21 on 3.9-3.14.
TARGET_PYTHONS = {
    "2.19": ("3.8", "3.13"),
    "2.20": ("3.9", "3.14"),
    "2.21": ("3.9", "3.14"),
}
# 3.14 is not on this machine's image (pyenv has up to 3.13): the newest box Python tested is capped here.
# Raise it when the image (and CI's) has a newer one.
NEWEST_AVAILABLE = "3.13"


class PythonNotFound(LookupError):
    """No interpreter of that version here; the message names it and how to install it."""


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _probe(path: str) -> tuple[str, str] | None:
    """(sys.executable, "X.Y") of the interpreter at ``path``, or None when it does not run."""
    try:
        done = subprocess.run(
            [path, "-c", PROBE],
            check=False,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2:
        return None
    return lines[0], lines[1]


def interpreter_version(path: str) -> str:
    """ "X.Y" of the interpreter at ``path``; PythonNotFound when it does not run."""
    found = _probe(path)
    if found is None:
        raise PythonNotFound(f"{path} does not run as a Python interpreter")
    return found[1]


def pyenv_candidates(version: str) -> list[str]:
    """``$PYENV_ROOT/versions/X.Y[.N]/bin/pythonX.Y``, newest patch first."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    pattern = re.compile(rf"^{re.escape(version)}(\.\d+)?$")
    try:
        names = [entry.name for entry in root.iterdir() if pattern.match(entry.name)]
    except OSError:
        return []
    names.sort(key=_key, reverse=True)
    return [str(root / name / "bin" / f"python{version}") for name in names]


def find_python(version: str) -> str:
    """The path of a Python ``version`` ("3.8") that runs here; PythonNotFound naming it and how to get it."""
    if not VERSION.match(version):
        raise ValueError(f"Python version {version!r}: expected 3.N, like 3.8")
    on_path = shutil.which(f"python{version}")
    for candidate in ([on_path] if on_path else []) + pyenv_candidates(version):
        found = _probe(candidate)
        if found is not None and found[1] == version:
            return found[0]
    raise PythonNotFound(
        f"Python {version} not found: no python{version} on PATH that runs, nor"
        f" $PYENV_ROOT/versions/{version}.*/bin/python{version}; install it with `pyenv install {version}`"
        f" (or the distribution's python{version} package)"
    )


def ansible_core_version() -> str:
    """ "2.19" for the ansible-core installed for this Python (the controller's, run by ansible_playbook_python)."""
    try:
        version = importlib.metadata.version("ansible-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise PythonNotFound(f"{sys.executable} has no ansible-core: run this with the controller's Python") from exc
    return ".".join(version.split(".")[:2])


def box_version(which: str, core: str | None = None) -> str:
    """ "X.Y" of the oldest or newest box Python tested with ansible-core ``core`` (default: the running one)."""
    core = core or ansible_core_version()
    if core not in TARGET_PYTHONS:
        raise PythonNotFound(f"ansible-core {core} is not in TARGET_PYTHONS of {__file__}: add its target Pythons")
    oldest, newest = TARGET_PYTHONS[core]
    if which == "oldest":
        return oldest
    if which == "newest":
        return min(newest, NEWEST_AVAILABLE, key=_key)
    raise ValueError(f"box Python {which!r}: expected oldest or newest")


def box_python(which: str, core: str | None = None) -> str:
    return find_python(box_version(which, core))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    find = commands.add_parser("find", help="print the path of the first of these Python versions found")
    find.add_argument("versions", nargs="+", metavar="X.Y")
    box = commands.add_parser("box", help="the oldest or newest box Python of the running ansible-core")
    box.add_argument("which", choices=["oldest", "newest"])
    box.add_argument("--version", action="store_true", help="print its X.Y, not its path")
    args = parser.parse_args(argv)
    try:
        if args.command == "find":
            for version in args.versions:
                try:
                    print(find_python(version))
                    return 0
                except PythonNotFound:
                    continue
            wanted = " or ".join(args.versions)
            print(
                f"pythons: no Python {wanted} found; install one with `pyenv install {args.versions[0]}`",
                file=sys.stderr,
            )
            return 1
        print(box_version(args.which) if args.version else box_python(args.which))
    except (PythonNotFound, ValueError) as exc:
        print(f"pythons: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
