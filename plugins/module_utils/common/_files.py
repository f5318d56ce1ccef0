# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""File-system steps shared by the box modules. Pure standard library."""

from __future__ import annotations

import os


def fsync_directory(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable: a crash right after must not undo it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
