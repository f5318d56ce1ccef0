# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""run_scratch's refusals: what a target must never be, checked before anything is removed.

A target is refused when it resolves to ``/``, to a home directory or a tree holding one, to a mount point or a
tree holding one, to anything not strictly inside data_dir, to durable_dir (inside, equal or holding it), or (an
extra path) when it holds the run registry or lies inside a run that is not torn down. Pure standard library.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import stat
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import run_dir, runs_root

MOUNTINFO = "/proc/self/mountinfo"
SYSTEM_HOMES = ("/root", "/home")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def inside(path: str, root: str) -> bool:
    """``path`` is strictly below ``root`` (both normalised absolute paths)."""
    return path != root and path.startswith(root.rstrip("/") + "/")


def within(path: str, root: str) -> bool:
    return path == root or inside(path, root)


def home_dirs() -> List[str]:
    """Every home directory this box knows (resolved): the password database's, /root, /home, /home/*, $HOME."""
    homes = set(SYSTEM_HOMES)
    homes.update(entry.pw_dir for entry in pwd.getpwall())
    with contextlib.suppress(OSError):
        homes.update(os.path.join("/home", name) for name in os.listdir("/home"))
    homes.add(os.environ.get("HOME") or "")
    return sorted({os.path.realpath(home) for home in homes if home and os.path.isabs(home)})


def mount_points(path: str = MOUNTINFO) -> List[str]:
    """The mount points of this process's namespace from ``/proc/self/mountinfo`` (empty when unreadable)."""
    try:
        with open(path, "rb") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        fields = line.split()
        if len(fields) > 4:
            text = os.fsdecode(fields[4])
            points.append(_OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), text))
    return points


def walk(root: str) -> Tuple[int, int, Optional[str]]:
    """(files, bytes, problem) of the tree at ``root``, never following a link; the problem is a mount point
    below it (``os.path.ismount`` or another device) or a directory that cannot be read."""
    device = os.lstat(root).st_dev
    files = size = 0
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode):
                        if info.st_dev != device or os.path.ismount(entry.path):
                            return files, size, f"holds the mount point {entry.path}"
                        pending.append(entry.path)
                        continue
                    files += 1
                    size += info.st_size if stat.S_ISREG(info.st_mode) else 0
        except OSError as exc:
            return files, size, f"cannot be read ({directory}: {exc.strerror or exc}), so it cannot be checked"
    return files, size, None


class Context:
    """What every target is checked against, resolved once."""

    def __init__(self, request: Mapping[str, Any], recorded_durable: Sequence[str]) -> None:
        self.data_real = os.path.realpath(request["data_dir"])
        self.registry_real = os.path.realpath(runs_root(request["data_dir"]))
        self.run_reals = [os.path.realpath(run_dir(request["data_dir"], run)) for run in request["runs"]]
        self.homes = home_dirs()
        self.mounts = sorted({os.path.normpath(point) for point in mount_points()})
        durables = [("durable_dir", request.get("durable_dir"))]
        durables += [("the durable_dir run.json records", path) for path in recorded_durable]
        self.durables = [(label, os.path.realpath(path)) for label, path in durables if path and os.path.isabs(path)]

    def problems(self, real: str, location: str, extra: bool) -> List[str]:
        """Each refusal for a target that resolves to ``real`` (the link itself lies at ``location``)."""
        if real == "/":
            return ["resolves to /"]
        found = []
        if real in self.homes:
            found.append(f"resolves to the home directory {real}")
        found += [f"holds the home directory {home}" for home in self.homes if inside(home, real)][:1]
        for path in dict.fromkeys((real, location)):
            if path == self.data_real:
                found.append(f"is data_dir itself ({self.data_real})")
            elif not inside(path, self.data_real):
                found.append(f"resolves to {path}, outside data_dir {self.data_real}")
        for label, durable in dict.fromkeys(self.durables):
            if within(real, durable):
                found.append(f"is {label} {durable}" if real == durable else f"is inside {label} {durable}")
            elif inside(durable, real):
                found.append(f"holds {label} {durable}")
        if extra and within(self.registry_real, real):
            found.append(f"holds the run registry {self.registry_real} (every run's files)")
        elif extra and inside(real, self.registry_real) and not any(within(real, run) for run in self.run_reals):
            found.append(f"is inside the run registry {self.registry_real} but in no torn-down run's directory")
        if real in self.mounts or os.path.ismount(real):
            found.append(f"is a mount point ({real})")
        found += [f"holds the mount point {point}" for point in self.mounts if inside(point, real)][:1]
        return found


def plan_target(named: str, context: Context, run: Optional[str]) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """The target's removal plan (None when it does not exist) and its refusals; ``run`` None: an extra path."""
    if not os.path.lexists(named):
        return None, []
    location = os.path.join(os.path.realpath(os.path.dirname(named)), os.path.basename(named))
    real = os.path.realpath(named)
    info = os.lstat(location)
    link = stat.S_ISLNK(info.st_mode)
    problems = context.problems(real, location, run is None)
    files, size = (0, 0) if stat.S_ISDIR(info.st_mode) else (1, info.st_size if stat.S_ISREG(info.st_mode) else 0)
    if not problems and stat.S_ISDIR(info.st_mode):
        files, size, problem = walk(location)
        problems += [problem] if problem else []
    target = {"path": named, "location": location, "real": real, "link": link, "dir": stat.S_ISDIR(info.st_mode)}
    target.update(device=info.st_dev, inode=info.st_ino, files=files, bytes=size, run=run)
    return target, [f"{named} {problem}" for problem in problems]


def extra_targets(request: Mapping[str, Any]) -> Tuple[List[str], List[str]]:
    """Each extra path (normalised), and those refused as written."""
    targets, problems = [], []
    for path in request.get("extra_paths") or []:
        if not isinstance(path, str) or not path.strip():
            problems.append(f"extra_paths entry {path!r} is empty")
        elif not os.path.isabs(path):
            problems.append(f"extra_paths entry {path!r} is not an absolute path")
        elif ".." in path.split("/"):
            problems.append(f"extra_paths entry {path!r} contains '..'")
        else:
            targets.append(os.path.normpath(path))
    return list(dict.fromkeys(targets)), problems
