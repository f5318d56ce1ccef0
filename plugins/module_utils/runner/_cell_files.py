# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which files of a succeeded cell a sync touches: what prune removes and which artifacts it copies.

Both work only inside the cell's checkpoint directory: a glob, a symbolic link or a directory tree can never
reach out of it. Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
from typing import Dict, List, Optional, Sequence, Tuple


class SyncError(Exception):
    """Why a cell's artifacts are not safely in durable_dir."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _matches(base: str, pattern: str) -> List[str]:
    return sorted(glob.glob(os.path.join(glob.escape(base), pattern), recursive=True))


def _remove(match: str, real_base: str) -> Optional[str]:
    """Remove one prune match (a file, a link as a link, or a directory tree): its name in ``pruned``, or None
    when it is not a prunable thing. OSError when the removal failed."""
    mode = os.lstat(match).st_mode
    if stat.S_ISDIR(mode):
        if not _inside(os.path.realpath(match), real_base) or os.path.realpath(match) == real_base:
            raise SyncError("outside")
        shutil.rmtree(match)  # never follows a link inside the tree: a link is removed as a link
        return os.sep
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        if not _inside(os.path.realpath(os.path.dirname(match)), real_base):
            raise SyncError("outside")
        os.unlink(match)
        return ""
    return None


def prune(base: str, patterns: Sequence[str], keep: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """Delete what ``patterns`` match under ``base``: (relative paths deleted, a directory with a trailing ``/``;
    problems).

    Files, symbolic links (the link itself) and directory trees (HF's ``checkpoint-*/``), only where the match's
    real location is inside ``base``: a pattern can never reach out of the cell's checkpoint directory, nor remove
    ``base`` itself or a path in ``keep`` (the runner's own files, when base is the cell directory).
    """
    real_base = os.path.realpath(base)
    kept = {os.path.realpath(path) for path in keep}
    deleted: List[str] = []
    problems: List[str] = []
    for pattern in patterns:
        for found in _matches(base, pattern):
            match = found.rstrip(os.sep)  # "checkpoint-*/" yields "checkpoint-3/": lstat must not follow a link
            relative = os.path.relpath(match, base)
            if relative == "." or not os.path.lexists(match) or os.path.realpath(match) in kept:
                continue  # base itself, gone with a tree removed before it, or the runner's own file
            try:
                removed = _remove(match, real_base)
            except SyncError:
                problems.append(f"prune {pattern!r}: {relative} is outside {base}, kept")
                continue
            except OSError as exc:
                problems.append(f"prune {relative}: {exc.strerror or exc}")
                continue
            if removed is not None:
                deleted.append(relative + removed)
    return deleted, problems


def collect(base: str, patterns: Sequence[str], optional: Sequence[str] = ()) -> List[Tuple[str, str]]:
    """(path relative to ``base``, real source path) of every file the artifact patterns name.

    A directory match brings its files. A pattern of ``patterns`` matching no file, or a file whose real path
    leaves ``base``, is a SyncError: a declared artifact that is not there must never read as synced. The
    ``optional`` patterns may match nothing.
    """
    if not os.path.isdir(base):
        raise SyncError(f"{base} is not a directory")
    real_base = os.path.realpath(base)
    found: Dict[str, str] = {}
    for pattern, required in [(p, True) for p in patterns] + [(p, False) for p in optional]:
        files: List[str] = []
        for match in _matches(base, pattern):
            if os.path.isdir(match):
                for root, dirs, names in os.walk(match):
                    dirs.sort()
                    files.extend(os.path.join(root, name) for name in sorted(names))
            elif os.path.isfile(match):
                files.append(match)
        files = [path for path in files if os.path.isfile(path)]
        if not files and required:
            raise SyncError(f"artifact {pattern!r} matched no file in {base}")
        for path in files:
            relative = os.path.relpath(path, base)
            real = os.path.realpath(path)
            if not _inside(real, real_base):
                raise SyncError(f"artifact {relative} leads outside {base}")
            if "\n" in relative or "\r" in relative:
                raise SyncError(f"artifact {relative!r}: a line break in a file name cannot go into the manifest")
            found.setdefault(relative, real)
    return sorted(found.items())
