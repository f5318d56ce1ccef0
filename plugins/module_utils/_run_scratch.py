# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Remove a torn-down run's scratch: ``<data_dir>/runs/<run>`` and the profile's extra paths, nothing else.

The only code of the collection that deletes a user's files. Every target is resolved (realpath) and checked
against every refusal before anything is removed: ``/``, a home directory, a mount point or a tree holding one,
anything not strictly inside data_dir, durable_dir (inside, equal or holding it), and a run that is alive. Removal
never follows a symbolic link: a target that is a link is unlinked, links inside a tree are unlinked by
``shutil.rmtree``. Checks and removal run in forked children under one deadline (a hung mount fails, not hangs).
Pure standard library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import re
import shutil
import stat
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils._run_state import OnDisk, read_json_quietly
from ansible_collections.remote_gpu.trainer.plugins.module_utils._runs import (
    NAME_PATTERN,
    Run,
    run_dir,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils._training_run import (
    RUN_MARKER,
    LaunchError,
    launch_lock,
)

TOMBSTONE_DIR = ".torn_down"
MOUNTINFO = "/proc/self/mountinfo"
SYSTEM_HOMES = ("/root", "/home")
DEFAULT_TIMEOUT_S = 600.0
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


class ScratchFailure(Exception):
    """The module's failure: a one-line message and the result keys that go with it."""

    def __init__(self, message: str, facts: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.facts = dict(facts)


def tombstone_path(data_dir: str, run: str) -> str:
    """Where run_scratch records what it removed: ``<data_dir>/runs/.torn_down/<run>.json``."""
    return os.path.join(data_dir, "runs", TOMBSTONE_DIR, f"{run}.json")


def _inside(path: str, root: str) -> bool:
    """``path`` is strictly below ``root`` (both normalised absolute paths)."""
    return path != root and path.startswith(root.rstrip("/") + "/")


def _within(path: str, root: str) -> bool:
    return path == root or _inside(path, root)


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


def _walk(root: str) -> Tuple[int, int, Optional[str]]:
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


class _Context:
    """What every target is checked against, resolved once."""

    def __init__(self, request: Mapping[str, Any], recorded_durable: Sequence[str]) -> None:
        self.run: str = request["run"]
        self.data_real = os.path.realpath(request["data_dir"])
        self.registry_real = os.path.realpath(os.path.join(request["data_dir"], "runs"))
        self.run_real = os.path.realpath(run_dir(request["data_dir"], self.run))
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
        found += [f"holds the home directory {home}" for home in self.homes if _inside(home, real)][:1]
        for path in dict.fromkeys((real, location)):
            if path == self.data_real:
                found.append(f"is data_dir itself ({self.data_real})")
            elif not _inside(path, self.data_real):
                found.append(f"resolves to {path}, outside data_dir {self.data_real}")
        for label, durable in self.durables:
            if _within(real, durable):
                found.append(f"is {label} {durable}" if real == durable else f"is inside {label} {durable}")
            elif _inside(durable, real):
                found.append(f"holds {label} {durable}")
        if extra and _within(self.registry_real, real):
            found.append(f"holds the run registry {self.registry_real} (every run's files)")
        elif extra and _inside(real, self.registry_real) and not _within(real, self.run_real):
            found.append(f"is inside the run registry {self.registry_real} but not in run {self.run}'s directory")
        if real in self.mounts or os.path.ismount(real):
            found.append(f"is a mount point ({real})")
        found += [f"holds the mount point {point}" for point in self.mounts if _inside(point, real)][:1]
        return found


def _liveness_problems(data_dir: str, run: str) -> Tuple[List[str], List[str]]:
    """Why the run may not lose its files now (it is alive, or its run.json cannot say), and the durable_dir
    paths its run.json records."""
    disk = OnDisk(data_dir, run)
    recorded = [disk.record.get("durable_dir")] if isinstance(disk.record.get("durable_dir"), str) else []
    if disk.problem:
        why = f"its run.json cannot be read, so whether it is alive is unknown (fix or remove {disk.run_dir}/run.json)"
        return [f"run {run}: {why}"], recorded
    if disk.live and disk.registered is not None:
        pgid = disk.registered.pgid
        return [f"run {run} is alive (pgid {pgid}): stop it first (training_run state=stopped)"], recorded
    directories = {disk.run_dir, os.path.normpath(disk.run_dir), os.path.realpath(disk.run_dir)}
    markers = [f"{RUN_MARKER}={directory}" for directory in sorted(directories)]
    left = detach.run_members(Run(run, disk.run_dir), markers)
    if left:
        pids = ", ".join(str(proc.pid) for proc in left[:10])
        return [f"run {run}: {len(left)} process(es) it started still run (pids {pids}): stop them first"], recorded
    return [], recorded


def _plan_target(named: str, context: _Context, extra: bool) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """The target's removal plan (None when it does not exist) and its refusals."""
    if not os.path.lexists(named):
        return None, []
    location = os.path.join(os.path.realpath(os.path.dirname(named)), os.path.basename(named))
    real = os.path.realpath(named)
    info = os.lstat(location)
    link = stat.S_ISLNK(info.st_mode)
    problems = context.problems(real, location, extra)
    files, size = (0, 0) if stat.S_ISDIR(info.st_mode) else (1, info.st_size if stat.S_ISREG(info.st_mode) else 0)
    if not problems and stat.S_ISDIR(info.st_mode):
        files, size, problem = _walk(location)
        problems += [problem] if problem else []
    target = {"path": named, "location": location, "real": real, "link": link, "dir": stat.S_ISDIR(info.st_mode)}
    target.update(device=info.st_dev, inode=info.st_ino, files=files, bytes=size)
    return target, [f"{named} {problem}" for problem in problems]


def _named_targets(request: Mapping[str, Any]) -> Tuple[List[Tuple[str, bool]], List[str]]:
    """(path, is_extra) for the run directory and each extra path, and the extra paths refused as written."""
    targets = [(os.path.normpath(run_dir(request["data_dir"], request["run"])), False)]
    problems = []
    for path in request.get("extra_paths") or []:
        if not isinstance(path, str) or not path.strip():
            problems.append(f"extra_paths entry {path!r} is empty")
        elif not os.path.isabs(path):
            problems.append(f"extra_paths entry {path!r} is not an absolute path")
        elif ".." in path.split("/"):
            problems.append(f"extra_paths entry {path!r} contains '..'")
        else:
            targets.append((os.path.normpath(path), True))
    return list(dict.fromkeys(targets)), problems


def plan(request: Mapping[str, Any]) -> Dict[str, Any]:
    """Every existing target with its size, and every refusal (runs in a child under the deadline)."""
    data_real = os.path.realpath(request["data_dir"])
    if data_real == "/":
        return {"targets": [], "problems": [f"data_dir {request['data_dir']} resolves to /"], "torn_down": None}
    named, problems = _named_targets(request)
    alive, recorded = _liveness_problems(request["data_dir"], request["run"])
    problems += alive
    context = _Context(request, recorded)
    targets = []
    for path, extra in named:
        target, refused = _plan_target(path, context, extra)
        problems += refused
        if target is not None:
            targets.append(target)
    # A target named twice is removed once; one inside another (non-link) directory target goes with it.
    targets = list({t["location"]: t for t in reversed(targets)}.values())[::-1]
    outer = [t["location"] for t in targets if t["dir"] and not t["link"]]
    targets = [t for t in targets if not any(_inside(t["location"], other) for other in outer)]
    torn_down = read_json_quietly(tombstone_path(request["data_dir"], request["run"]))
    return {"targets": targets, "problems": problems, "torn_down": torn_down}


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _entry(target: Mapping[str, Any]) -> Dict[str, Any]:
    return {"path": target["path"], "files": target["files"], "bytes": target["bytes"]}


def _remove_one(target: Mapping[str, Any]) -> None:
    info = os.lstat(target["location"])
    if (info.st_dev, info.st_ino) != (target["device"], target["inode"]):
        raise OSError(f"{target['path']} changed since it was checked; not removed")
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(target["location"])  # never a link (lstat): rmtree unlinks the links inside, never follows
    else:
        os.unlink(target["location"])


def remove(request: Mapping[str, Any], targets: Sequence[Mapping[str, Any]], lock_s: float) -> Dict[str, Any]:
    """Re-check that the run is not alive under the launch lock, remove each target, write the tombstone."""
    data_dir, run = request["data_dir"], request["run"]
    removed: List[Dict[str, Any]] = []
    registry = os.path.join(data_dir, "runs")
    try:
        with launch_lock(data_dir, lock_s) if os.path.isdir(registry) else contextlib.nullcontext():
            alive, _recorded = _liveness_problems(data_dir, run)
            if alive:
                return {"removed": [], "error": f"{alive[0]}; nothing removed"}
            for target in targets:
                _remove_one(target)
                removed.append(_entry(target))
            tombstone = tombstone_path(data_dir, run)
            earlier = read_json_quietly(tombstone) or {}
            kept = [e for e in earlier.get("removed") or [] if isinstance(e, dict)]
            os.makedirs(os.path.dirname(tombstone), exist_ok=True)
            write_json_atomic(tombstone, {"run": run, "removed_at": _utc_now(), "removed": kept + removed})
    except (OSError, LaunchError) as exc:
        return {"removed": removed, "error": str(exc)}
    return {"removed": removed, "error": None}


def _check_request(params: Mapping[str, Any]) -> Dict[str, Any]:
    run, data_dir = params.get("run") or "", params.get("data_dir") or ""
    if not NAME_PATTERN.match(run):
        raise ValueError(f"run must match {NAME_PATTERN.pattern}, not {run!r}")
    if not os.path.isabs(data_dir):
        raise ValueError(f"data_dir must be an absolute path, not {data_dir!r}")
    durable = params.get("durable_dir") or None
    if durable is not None and not os.path.isabs(durable):
        raise ValueError(f"durable_dir must be an absolute path, not {durable!r}")
    if params.get("state", "absent") != "absent":
        raise ValueError(f"state must be absent, not {params.get('state')!r}")
    extra = list(params.get("extra_paths") or [])
    return {"run": run, "data_dir": data_dir, "durable_dir": durable, "extra_paths": extra}


def _summary(entries: Sequence[Mapping[str, Any]]) -> str:
    files, size = sum(e["files"] for e in entries), sum(e["bytes"] for e in entries)
    return f"{len(entries)} path(s), {files} file(s), {size} bytes"


def run_scratch(params: Mapping[str, Any], check_mode: bool) -> Dict[str, Any]:
    """The module's work: ValueError for a bad option, ScratchFailure for a refusal or a failed removal."""
    request = _check_request(params)
    timeout_s = float(params.get("timeout_s") or DEFAULT_TIMEOUT_S)
    run, tombstone = request["run"], tombstone_path(request["data_dir"], request["run"])
    deadline = time.monotonic() + timeout_s
    facts: Dict[str, Any] = {"refused": False, "problems": [], "removed": [], "would_remove": [], "tombstone": None}
    answer = run_with_deadline({"plan": functools.partial(plan, request)}, timeout_s)["plan"]
    if "value" not in answer:
        why = answer.get("error") or f"did not answer within {timeout_s:g} s (a hung mount?)"
        raise ScratchFailure(f"run_scratch {run}: checking the targets failed: {why}; nothing removed", facts)
    problems, targets = answer["value"]["problems"], answer["value"]["targets"]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        facts.update(refused=True, problems=problems)
        raise ScratchFailure(f"run_scratch refused: {problems[0]}{more}; nothing removed", facts)
    entries = [_entry(target) for target in targets]
    torn_down = answer["value"]["torn_down"]
    existing = tombstone if torn_down is not None else None
    if not targets:
        when = f" (torn down at {torn_down.get('removed_at')})" if torn_down is not None else ""
        return dict(facts, changed=False, tombstone=existing, msg=f"nothing to remove for run {run}{when}")
    if check_mode:
        return dict(
            facts, changed=True, would_remove=entries, tombstone=tombstone, msg=f"would remove {_summary(entries)}"
        )
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ScratchFailure(f"run_scratch {run}: no time left of timeout_s {timeout_s:g}; nothing removed", facts)
    job = functools.partial(remove, request, targets, remaining / 2)  # a held lock fails before the deadline
    done = run_with_deadline({"remove": job}, remaining)["remove"]
    if "value" not in done:
        why = done.get("error") or f"did not finish within {timeout_s:g} s (a hung mount?); part of it may be gone"
        raise ScratchFailure(f"run_scratch {run}: removal failed: {why}; no tombstone written", facts)
    facts["removed"] = done["value"]["removed"]
    if done["value"]["error"]:
        gone = f" after removing {_summary(facts['removed'])}" if facts["removed"] else ""
        raise ScratchFailure(f"run_scratch {run}: {done['value']['error']}{gone}; no tombstone written", facts)
    return dict(facts, changed=True, tombstone=tombstone, msg=f"removed {_summary(facts['removed'])} of run {run}")
