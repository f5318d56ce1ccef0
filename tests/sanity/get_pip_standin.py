"""Stand-in for the get-pip bootstrap script that ansible-test downloads from a host this network cannot reach.

ansible-test runs it as ``python get_pip.py [pip options] pip==X [--no-setuptools] [--no-wheel]`` inside a fresh
venv. We seed pip from the interpreter's own ensurepip, then let that pip install what was asked for from PyPI.
ensurepip runs in a child process: in-process it sets PIP_CONFIG_FILE=/dev/null and loses the machine's pip settings.
"""

from __future__ import annotations

import subprocess
import sys

SEED_ONLY_FLAGS = {"--no-setuptools", "--no-wheel"}


def main() -> int:
    subprocess.run([sys.executable, "-m", "ensurepip", "--upgrade"], check=True, stdout=subprocess.DEVNULL)
    wanted = [arg for arg in sys.argv[1:] if arg not in SEED_ONLY_FLAGS]
    return subprocess.run([sys.executable, "-m", "pip", "install", *wanted], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
