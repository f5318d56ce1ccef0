# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run registry on a box (contracts/run-layout.md): where a run's files live, and their parsers.

Launch writes ``run.json`` and each cell's ``result.json`` through :func:`write_json_atomic`; vram_zombies,
patrol and teardown read them here, so every reader applies the same validation. Pure standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline

MAX_REGISTERED_RUNS = 1000
# Under <data_dir>/runs; a leading dot keeps it out of every run name (NAME_PATTERN).
TOMBSTONE_DIR = ".torn_down"
# Runs retired by run_archive, each moved whole to <run>-<UTC stamp> (its record beside it as <run>-<stamp>.json).
ARCHIVE_DIR = ".archive"
ARCHIVE_STAMP = "%Y%m%dT%H%M%SZ"
# The autostop watcher's directory under <data_dir>/runs (a leading dot: never a run).
AUTOSTOP_DIR = ".autostop"
ARCHIVED_PATTERN = re.compile(r"^(?P<run>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})-(?P<stamp>\d{8}T\d{6}Z)$")
# The durable copy of a run: its manifest, the lock taken while writing it, and the launch that owns it.
MANIFEST_NAME = "MANIFEST.sha256"
MANIFEST_LOCK = f".{MANIFEST_NAME}.lock"
LAUNCH_RECORD = ".launch.json"
MAX_RUN_JSON_BYTES = 1024 * 1024
# Reading the registry touches data_dir, which may be a dead network mount.
REGISTRY_TIMEOUT_S = 10.0
# A run or cell name is one path component: it can never climb out of <data_dir>/runs.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESULT_STATUSES = ("succeeded", "failed")
SYNC_STATES = ("verified", "failed", "skipped")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Run:
    """A run registered by the launch role in ``<data_dir>/runs/<run>/run.json``."""

    name: str
    path: str
    pgid: Optional[int] = None
    sid: Optional[int] = None
    pids: Tuple[int, ...] = ()
    started_at: Optional[float] = None


@dataclass(frozen=True)
class Artifact:
    """One synced file, ``path`` relative to the cell directory."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CellResult:
    """A cell's ``result.json``: how its command ended and whether its artifacts reached durable_dir."""

    status: str
    exit_code: Optional[int]
    signal: Optional[int]
    started_at: float
    ended_at: float
    sync: str
    artifacts: Tuple[Artifact, ...] = ()

    def counts_as_done(self, declares_artifacts: bool = True) -> bool:
        """The contract's rule: succeeded and verified, or skipped where the run declares no artifacts."""
        synced = self.sync == "verified" or (self.sync == "skipped" and not declares_artifacts)
        return self.status == "succeeded" and synced


def _checked_name(kind: str, name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"{kind} name {name!r} does not match {NAME_PATTERN.pattern}")
    return name


def runs_root(data_dir: str) -> str:
    """``<data_dir>/runs``: every run's scratch, and the tombstones of the runs torn down."""
    return os.path.join(data_dir, "runs")


def run_dir(data_dir: str, run: str) -> str:
    return os.path.join(runs_root(data_dir), _checked_name("run", run))


def tombstone_path(data_dir: str, run: str) -> str:
    """Where run_scratch records what it removes: ``<data_dir>/runs/.torn_down/<run>.json``."""
    return os.path.join(runs_root(data_dir), TOMBSTONE_DIR, f"{_checked_name('run', run)}.json")


def durable_run_dir(durable_dir: str, run: str) -> str:
    """``<durable_dir>/runs/<run>``: the run's synced artifacts and its MANIFEST.sha256."""
    return os.path.join(durable_dir, "runs", _checked_name("run", run))


def autostop_dir(data_dir: str) -> str:
    """``<data_dir>/runs/.autostop``: the autostop watcher's code (``runner/run.py``), ``armed.json``,
    ``watch.log``, ``watch.lock`` and ``arm.lock``."""
    return os.path.join(runs_root(data_dir), AUTOSTOP_DIR)


def autostop_armed_path(data_dir: str) -> str:
    """``<data_dir>/runs/.autostop/armed.json``: the armed configuration, written only by arming."""
    return os.path.join(autostop_dir(data_dir), "armed.json")


def autostop_path(data_dir: str) -> str:
    """``<data_dir>/runs/.autostop.json``: the watcher's decision and its stop's outcome, written only by it."""
    return os.path.join(runs_root(data_dir), ".autostop.json")


def patrol_tick_path(data_dir: str) -> str:
    """``<data_dir>/runs/.patrol-tick.json``: patrol_facts' tick, the autostop dead-man clock's heartbeat."""
    return os.path.join(runs_root(data_dir), ".patrol-tick.json")


@dataclass(frozen=True)
class Archived:
    """A run moved aside by run_archive: ``<data_dir>/runs/.archive/<entry>``, ``entry`` = ``<run>-<stamp>``."""

    run: str
    entry: str
    path: str
    stamp: str


def archive_root(data_dir: str) -> str:
    """``<data_dir>/runs/.archive``: on the runs' filesystem, so archiving is a rename, never a copy."""
    return os.path.join(runs_root(data_dir), ARCHIVE_DIR)


def archive_path(data_dir: str, run: str, stamp: str) -> str:
    return os.path.join(archive_root(data_dir), f"{_checked_name('run', run)}-{stamp}")


def archive_record(path: str) -> str:
    """The JSON record beside an archived run (who moved it, from where, why): ``<entry>.json``."""
    return f"{path}.json"


def list_archived(data_dir: str) -> List[Archived]:
    """Every archived run, sorted by run then stamp (oldest first); OSError when the archive cannot be read."""
    root = archive_root(data_dir)
    if not os.path.isdir(root) or os.path.islink(root):
        return []
    found = []
    for entry in os.scandir(root):
        match = ARCHIVED_PATTERN.match(entry.name)
        if match and entry.is_dir():  # an archived link to a run directory is archived too
            found.append(Archived(match["run"], entry.name, entry.path, match["stamp"]))
    return sorted(found, key=lambda archived: (archived.run, archived.stamp))


def list_runs(data_dir: str) -> List[str]:
    """The runs on a box, sorted: each directory under ``<data_dir>/runs`` with a valid name, and each run known
    only by its tombstone (scratch already removed); never an archived run (:func:`list_archived`). At most
    MAX_REGISTERED_RUNS; OSError when unreadable."""
    root = runs_root(data_dir)
    if not os.path.lexists(root):
        return []
    names = {
        entry.name
        for entry in os.scandir(root)
        if NAME_PATTERN.match(entry.name) and entry.is_dir()  # a linked run directory is a run too
    }
    tombstones = os.path.join(root, TOMBSTONE_DIR)
    if os.path.isdir(tombstones):
        for entry in os.scandir(tombstones):
            name = entry.name[: -len(".json")] if entry.name.endswith(".json") else ""
            if NAME_PATTERN.match(name) and entry.is_file(follow_symlinks=False):
                names.add(name)
    return sorted(names)[:MAX_REGISTERED_RUNS]


def run_json(data_dir: str, run: str) -> str:
    return os.path.join(run_dir(data_dir, run), "run.json")


def cell_dir(data_dir: str, run: str, cell: str) -> str:
    return os.path.join(run_dir(data_dir, run), "cells", _checked_name("cell", cell))


def cell_log(data_dir: str, run: str, cell: str) -> str:
    return os.path.join(cell_dir(data_dir, run, cell), "log")


def result_json(data_dir: str, run: str, cell: str) -> str:
    return os.path.join(cell_dir(data_dir, run, cell), "result.json")


def exit_json(run_directory: str, cell: str) -> str:
    """``<run>/cells/<cell>/exit.json``: how the cell's command ended, written before any sync of its artifacts."""
    return os.path.join(run_directory, "cells", _checked_name("cell", cell), "exit.json")


def read_exit(path: str) -> Optional[Dict[str, Any]]:
    """An exit.json document (or a result.json, read for the same fields), or None when there is none or it cannot
    be trusted (unreadable, not an object, a status other than succeeded/failed, a succeeded status that contradicts
    its exit code, times that do not parse): the cell then runs its command again rather than pass for a success."""
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(MAX_RUN_JSON_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("status") not in RESULT_STATUSES:
        return None
    command = data.get("command")  # absent from a result.json of a runner before exit.json
    if command is not None and not (isinstance(command, list) and all(isinstance(part, str) for part in command)):
        return None
    try:  # a result.json is made from it: its times must parse as result.json's do
        _timestamp(data, "started_at"), _timestamp(data, "ended_at")
    except ValueError:
        return None
    code = data.get("exit_code")
    succeeded = code == 0 and not isinstance(code, bool) and data.get("signal") is None
    return data if (data["status"] == "succeeded") == succeeded else None


def monitor_jsonl(data_dir: str, run: str) -> str:
    return os.path.join(run_dir(data_dir, run), "monitor.jsonl")


def patrol_dir(data_dir: str, run: str) -> str:
    return os.path.join(run_dir(data_dir, run), ".patrol")


def done_marker(data_dir: str, run: str) -> str:
    return os.path.join(run_dir(data_dir, run), "DONE")


def write_json_atomic(path: str, data: Any, private: bool = False) -> None:
    """Write ``data`` as JSON so that readers see the old file or the whole new one, never a torn one.

    The temporary file sits in the target's directory (a rename is atomic only within one filesystem);
    fsyncing the file and then the directory makes the new name survive a power cut, not just a crash.
    ``private``: mode 0600 from the first byte, whatever the umask (a secret is never readable by others).
    """
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.urandom(4).hex()}.tmp")
    # O_EXCL: never write through a file or link someone else put there; 0o666 lets the umask decide, as open() does.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600 if private else 0o666)
    try:
        if private:
            os.fchmod(handle, 0o600)
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(data, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def _iso_time(value: str) -> float:
    # A time without an offset is the box's local wall clock (TZ honoured), as a shell's `date` writes it.
    return datetime.fromisoformat(value.strip().replace("Z", "+00:00")).astimezone().timestamp()


def _parse_started_at(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        raise ValueError("started_at must be an ISO 8601 time or epoch seconds")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _iso_time(value)
    raise ValueError("started_at must be an ISO 8601 time or epoch seconds")


def _leader_id(data: Dict[str, Any], key: str) -> Optional[int]:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
        raise ValueError(f"{key} must be an integer above 1, not {value!r}")
    return value


def parse_run(name: str, path: str, data: Any) -> Run:
    """Validate one run.json document; raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError("run.json must hold a JSON object")
    pids = data.get("pids") or []
    if not isinstance(pids, list) or any(isinstance(p, bool) or not isinstance(p, int) or p <= 1 for p in pids):
        raise ValueError("pids must be a list of integers above 1")
    run = Run(
        name=str(data.get("run") or name),
        path=path,
        pgid=_leader_id(data, "pgid"),
        sid=_leader_id(data, "sid"),
        pids=tuple(pids),
        started_at=_parse_started_at(data["started_at"]) if data.get("started_at") is not None else None,
    )
    if run.pgid is None and run.sid is None and not run.pids:
        raise ValueError("run.json names no pgid, sid or pids")
    return run


def _optional_int(data: Dict[str, Any], key: str) -> Optional[int]:
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{key} must be an integer or null, not {value!r}")
    return value


def _one_of(data: Dict[str, Any], key: str, allowed: Tuple[str, ...]) -> str:
    value = data.get(key)
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def _timestamp(data: Dict[str, Any], key: str) -> float:
    value = data.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be an ISO 8601 time, not {value!r}")
    return _iso_time(value)


def _artifact(entry: Any) -> Artifact:
    if not isinstance(entry, dict):
        raise ValueError(f"each artifact must be an object, not {entry!r}")
    path, size, sha256 = entry.get("path"), entry.get("size"), entry.get("sha256")
    # Relative and inside the cell directory: teardown compares these paths under two roots.
    if not isinstance(path, str) or not path or os.path.isabs(path) or ".." in path.split("/"):
        raise ValueError(f"artifact path must be relative to the cell directory, not {path!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"artifact {path}: size must be an integer of at least 0, not {size!r}")
    if not isinstance(sha256, str) or not SHA256_PATTERN.match(sha256):
        raise ValueError(f"artifact {path}: sha256 must be 64 lowercase hex digits, not {sha256!r}")
    return Artifact(path=path, size=size, sha256=sha256)


def parse_result(data: Any) -> CellResult:
    """Validate one cell's result.json document; raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError("result.json must hold a JSON object")
    status = _one_of(data, "status", RESULT_STATUSES)
    exit_code, signal = _optional_int(data, "exit_code"), _optional_int(data, "signal")
    ended_by_exit_0 = exit_code == 0 and signal is None
    if (status == "succeeded") != ended_by_exit_0:
        raise ValueError(f"status {status} contradicts exit_code {exit_code!r} and signal {signal!r}")
    artifacts = data.get("artifacts") or []
    if not isinstance(artifacts, list):
        raise ValueError("artifacts must be a list")
    return CellResult(
        status=status,
        exit_code=exit_code,
        signal=signal,
        started_at=_timestamp(data, "started_at"),
        ended_at=_timestamp(data, "ended_at"),
        sync=_one_of(data, "sync", SYNC_STATES),
        artifacts=tuple(_artifact(entry) for entry in artifacts),
    )


def _registry_files(data_dir: str) -> Dict[str, Any]:
    """The raw run.json texts under ``data_dir``, or why there are none; runs in a child under a deadline."""
    unreadable = "so the run registry could not be read"
    if not os.path.isdir(data_dir):
        why = "not a directory" if os.path.lexists(data_dir) else "not found"
        return {"problems": [f"data_dir {data_dir}: {why}, {unreadable}"], "files": []}
    registry = os.path.join(data_dir, "runs")
    if not os.path.lexists(registry):
        return {"problems": [], "files": []}
    if not os.path.isdir(registry):
        return {"problems": [f"{registry}: not a directory, {unreadable}"], "files": []}
    problems: List[str] = []
    paths = [
        os.path.join(registry, name, "run.json") for name in sorted(os.listdir(registry)) if not name.startswith(".")
    ]
    paths = [path for path in paths if os.path.isfile(path)]
    if len(paths) > MAX_REGISTERED_RUNS:
        problems.append(f"{len(paths)} run.json files under {registry}; read only the first {MAX_REGISTERED_RUNS}")
    files = []
    for path in paths[:MAX_REGISTERED_RUNS]:
        try:
            with open(path, "rb") as handle:
                files.append([path, handle.read(MAX_RUN_JSON_BYTES + 1).decode("utf-8", errors="replace")])
        except OSError as exc:
            problems.append(f"{path}: {exc}")
    return {"problems": problems, "files": files}


def read_run_registry(data_dir: Optional[str], timeout_s: float = REGISTRY_TIMEOUT_S) -> Tuple[List[Run], List[str]]:
    """Registered runs under ``<data_dir>/runs/*/run.json`` and one problem line per unreadable file.

    A data_dir that is missing, not a directory or does not answer within ``timeout_s`` (a hung mount) is
    not an empty registry: live runs cannot be told from zombies, so it is a problem.
    """
    if not data_dir:
        return [], []
    answer = run_with_deadline({"registry": functools.partial(_registry_files, data_dir)}, timeout_s)["registry"]
    if answer.get("timed_out"):
        why = f"did not answer within {timeout_s:g} s (a hung mount?)"
        return [], [f"data_dir {data_dir}: {why}, so the run registry could not be read"]
    if "error" in answer:
        return [], [f"data_dir {data_dir}: {answer['error']}, so the run registry could not be read"]
    runs: List[Run] = []
    problems: List[str] = list(answer["value"]["problems"])
    for path, text in answer["value"]["files"]:
        try:
            if len(text) > MAX_RUN_JSON_BYTES:
                raise ValueError(f"larger than {MAX_RUN_JSON_BYTES} bytes")
            runs.append(parse_run(os.path.basename(os.path.dirname(path)), path, json.loads(text)))
        # json.JSONDecodeError is a ValueError; a date past year 9999 once made local overflows; nesting recurses.
        except (ValueError, OverflowError, RecursionError) as exc:
            problems.append(f"{path}: {type(exc).__name__ if isinstance(exc, RecursionError) else exc}")
    return runs, problems


# Every process the runner starts carries RGT_RUN_DIR=<run_dir> in its environment: the run's marker.
RUN_MARKER = "RGT_RUN_DIR"
LOCK_NAME = ".launch.lock"


class LaunchLockBusy(TimeoutError):
    """Another launch (or a teardown's removal) held the box's launch lock for longer than the caller waits."""


def launch_lock_path(data_dir: str) -> str:
    """``<data_dir>/runs/.launch.lock``: held by every decision that starts a run or removes one's scratch."""
    return os.path.join(runs_root(data_dir), LOCK_NAME)


@contextlib.contextmanager
def exclusive_lock(path: str, timeout_s: float, mode: int, busy: Callable[[], Exception]) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created with ``mode``) for the block, trying every 0.1 s; ``busy()`` is
    raised when another holder keeps it longer than ``timeout_s``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() >= deadline:
                    raise busy() from exc
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def launch_lock(data_dir: str, timeout_s: float) -> ContextManager[None]:
    """The box's launch lock (an flock); LaunchLockBusy when another holder keeps it longer than ``timeout_s``."""
    path = launch_lock_path(data_dir)
    message = f"another launch on this box held {path} for more than {timeout_s:g} s"
    return exclusive_lock(path, timeout_s, 0o644, lambda: LaunchLockBusy(message))
