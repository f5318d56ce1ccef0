# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Secure a succeeded cell's results: prune, copy to durable_dir, re-read and compare, then the manifest.

The seed's silent-sync lesson: its ``cp ... && echo synced`` claimed success on a full durable disk. Here a file
counts as synced only after its copy was written through a temporary file, fsynced, renamed, read back from the
durable directory (with the page cache dropped where the kernel allows) and found equal in size and sha256 to
the source; only then does its line go into ``MANIFEST.sha256``. Then the run's checks of each copy
(``_artifact_check.Verifier``: the user's loader, finite safetensors weights) must pass too. Anything else is
``sync: failed`` with the reason, and the copy a check refused stays listed with a mark after its line, ``# bad
<kind>  cells/<cell>/<path>`` (two spaces apart, as the entries' fields): a comment, so readers of the entries skip
it, and the durable and pulled copies say which files are known bad. The scratch copy is never deleted (prune
removes only what the run's patterns name, inside the cell's checkpoint directory: ``_cell_files``).

A durable run directory belongs to one launch: ``.launch.json`` names it, written by the first sync of that launch
and checked before every copy, so a manifest never mixes two launches of one run name (a relaunch after teardown,
another box's launch into a shared durable_dir). Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._disk import probe_usage
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._files import fsync_directory
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    LAUNCH_RECORD,
    MANIFEST_LOCK,
    MANIFEST_NAME,
    NAME_PATTERN,
    durable_run_dir,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._artifact_check import Verifier
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_files import (
    SyncError,
    collect,
    prune,
)

CHUNK_BYTES = 4 * 1024 * 1024
# The durable directory is often a network mount: it must answer a statvfs within this before any copy starts.
PROBE_TIMEOUT_S = 20.0
# Hidden, as the lock is: teardown's gate counts only the visible files of a durable copy as results.
MAX_LAUNCH_RECORD_BYTES = 64 * 1024
_MANIFEST_LOCK = threading.Lock()  # flock orders processes; this orders the runner's own threads too
# A copy in progress is ``.<name>.rgt-tmp-<hex>`` beside its destination: hidden (teardown counts only visible
# files) and recognisable, so a runner killed mid-copy leaves nothing that the next start cannot clear.
TEMP_MARK = ".rgt-tmp-"
TEMP_NAME = re.compile(r"^\..+\.rgt-tmp-[0-9a-f]{8}$")
# Also cleared: the copies of earlier versions (``.<name>.rgt-<hex>.tmp``), the launch record's temporary and the
# manifest's of earlier versions (at the top of the durable run directory).
OLD_TEMP_NAME = re.compile(r"^\..+\.rgt-[0-9a-f]{8}\.tmp$")
TOP_TEMP_NAME = re.compile(r"^(MANIFEST\.sha256|\.\.launch\.json)\.[0-9a-f]{8}\.tmp$")
# A copy a check refused: "# bad  <kind>  cells/<cell>/<path>" after its entry (teardown/_copy_verify.known_bad).
BAD_MARK = "# bad  "


@dataclass(frozen=True)
class SyncOutcome:
    sync: str  # verified · failed · skipped (the contract's values)
    artifacts: Tuple[Dict[str, object], ...] = ()
    error: Optional[str] = None
    pruned: Tuple[str, ...] = ()
    prune_errors: Tuple[str, ...] = ()
    verify: Tuple[Dict[str, Any], ...] = ()  # {path, ok, message} per artifact checked after its copy

    @property
    def total_bytes(self) -> int:
        return sum(int(str(artifact["size"])) for artifact in self.artifacts)

    def log_lines(self) -> List[str]:
        """What the cell's log says about it: a failed sync is loud there too, not only in result.json."""
        lines = list(self.prune_errors) + ([f"pruned {', '.join(self.pruned)}"] if self.pruned else [])
        lines.extend(f"check {c['path']}: {'ok' if c['ok'] else 'FAILED'}: {c['message']}" for c in self.verify)
        if self.sync == "verified":
            lines.append(f"sync verified: {len(self.artifacts)} files, {self.total_bytes} bytes")
        elif self.sync == "failed":
            lines.append(f"SYNC FAILED: {self.error} (the scratch copy is kept)")
        return lines


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def hash_file(path: str, drop_cache: bool = False) -> Tuple[int, str]:
    """(size, sha256) of the file as read now; ``drop_cache`` first asks the kernel to forget its cached pages,
    so the read comes from the device rather than from the memory the copy was written from."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while True:
            chunk = handle.read(CHUNK_BYTES)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def copy_verified(source: str, destination: str, stopped: Callable[[], bool]) -> Tuple[int, str]:
    """Copy through a temporary file (fsync, rename, fsync the directory), then re-read the copy and compare."""
    directory = os.path.dirname(destination)
    temporary = os.path.join(directory, f".{os.path.basename(destination)}{TEMP_MARK}{os.urandom(4).hex()}")
    digest = hashlib.sha256()
    size = 0
    with open(source, "rb") as reader:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                while True:
                    if stopped():
                        raise SyncError("run stopped during sync")
                    chunk = reader.read(CHUNK_BYTES)
                    if not chunk:
                        break
                    digest.update(chunk)
                    size += len(chunk)
                    _write_all(fd, chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            if os.fstat(reader.fileno()).st_size != size:
                raise SyncError(f"{source} changed while it was copied")
            os.replace(temporary, destination)
        except BaseException:
            if os.path.lexists(temporary):
                os.unlink(temporary)
            raise
    fsync_directory(directory)
    copy_size, copy_sha256 = hash_file(destination, drop_cache=True)
    if (copy_size, copy_sha256) != (size, digest.hexdigest()):
        raise SyncError(
            f"the copy {destination} does not match its source: {copy_size} bytes, sha256 {copy_sha256[:12]}... "
            f"read back, {size} bytes, sha256 {digest.hexdigest()[:12]}... written"
        )
    return size, digest.hexdigest()


def _manifest_lines(path: str) -> List[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return [line.rstrip("\n") for line in handle if line.strip()]
    except FileNotFoundError:
        return []


def durable_owner(durable_run: str) -> Dict[str, Any]:
    """Which launch a durable run directory belongs to: ``exists``, ``launch_id`` (None without a record),
    ``problem`` (an unreadable record) and ``entries`` (how many names it holds beside the lock and the record)."""
    if not os.path.isdir(durable_run):
        return {"exists": os.path.lexists(durable_run), "launch_id": None, "problem": None, "entries": 0}
    entries = [name for name in os.listdir(durable_run) if name not in (MANIFEST_LOCK, LAUNCH_RECORD)]
    launch_id, problem = None, None
    try:
        with open(os.path.join(durable_run, LAUNCH_RECORD), "rb") as handle:
            record = json.loads(handle.read(MAX_LAUNCH_RECORD_BYTES).decode("utf-8", errors="replace"))
        launch_id = record.get("launch_id") if isinstance(record, dict) else None
        if not isinstance(launch_id, str) or not launch_id:
            launch_id, problem = None, "it names no launch_id"
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        problem = str(exc)
    return {"exists": True, "launch_id": launch_id, "problem": problem, "entries": len(entries)}


def launch_conflict(durable_run: str, owner: Mapping[str, Any], launch_id: str, resuming: bool) -> Optional[str]:
    """Why ``durable_run`` belongs to another launch than ``launch_id``, or None when this launch may write there.

    Files with no record are an earlier launch's (from before launch ids, or a record removed by hand), unless
    this box resumes the run: then they are this run's own, from before the collection recorded launches.
    """
    if owner.get("problem"):
        return f"{durable_run} has an unreadable {LAUNCH_RECORD} ({owner['problem']})"
    other = owner.get("launch_id")
    if other is not None and other != launch_id:
        return f"{durable_run} holds launch {other}"
    if other is None and owner.get("entries") and not resuming:
        return f"{durable_run} holds files of an earlier launch (no {LAUNCH_RECORD})"
    return None


def claim_durable(durable_run: str, run: str, launch_id: str) -> None:
    """Make ``durable_run`` this launch's before anything is copied into it: record the launch where there is no
    record, SyncError where another launch's record is there. Under the manifest's flock, as a sync's writes are."""
    os.makedirs(durable_run, exist_ok=True)
    with _MANIFEST_LOCK:
        lock_fd = os.open(os.path.join(durable_run, MANIFEST_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            # A sync runs only in a launch that was let start: files without a record are this run's own.
            conflict = launch_conflict(durable_run, durable_owner(durable_run), launch_id, resuming=True)
            if conflict is not None:
                raise SyncError(f"{conflict}, this run is launch {launch_id}: nothing copied")
            record = os.path.join(durable_run, LAUNCH_RECORD)
            if not os.path.exists(record):
                claimed = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                write_json_atomic(record, {"run": run, "launch_id": launch_id, "claimed_at": claimed})
        finally:
            os.close(lock_fd)


def _line_key(line: str) -> Tuple[str, bool]:
    """Where a manifest line sorts: by its path, a known-bad mark right after its file's entry."""
    return line.split("  ", 2)[-1], line.startswith(BAD_MARK)


def update_manifest(
    durable_run: str, cell: str, artifacts: Sequence[Dict[str, object]], bad: Sequence[Tuple[str, str]] = ()
) -> None:
    """Replace the cell's lines of ``MANIFEST.sha256`` (``<sha256>  <size>  cells/<cell>/<path>``, and a
    ``# bad  <kind>  cells/<cell>/<path>`` mark per ``(path, kind)`` of ``bad``), atomically, under an exclusive
    flock so that cells finishing together never lose each other's lines."""
    manifest = os.path.join(durable_run, MANIFEST_NAME)
    prefix = f"cells/{cell}/"
    with _MANIFEST_LOCK:
        lock_fd = os.open(os.path.join(durable_run, MANIFEST_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            kept = [line for line in _manifest_lines(manifest) if not line.split("  ", 2)[-1].startswith(prefix)]
            ours = [f"{a['sha256']}  {a['size']}  {prefix}{a['path']}" for a in artifacts]
            ours += [f"{BAD_MARK}{kind}  {prefix}{path}" for path, kind in bad]
            lines = sorted(kept + ours, key=_line_key)
            temporary = os.path.join(durable_run, f".{MANIFEST_NAME}{TEMP_MARK}{os.urandom(4).hex()}")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                try:
                    _write_all(fd, "".join(line + "\n" for line in lines).encode("utf-8"))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temporary, manifest)
            except BaseException:
                if os.path.lexists(temporary):
                    os.unlink(temporary)
                raise
            fsync_directory(durable_run)
            missing = set(ours) - set(_manifest_lines(manifest))
            if missing:
                raise SyncError(f"{manifest} does not hold the lines just written")
        finally:
            os.close(lock_fd)  # releases the flock


def _check_durable(durable_dir: str, needed: int) -> None:
    """durable_dir must exist (it is a mount: creating it would write onto the box's own disk) and answer."""
    answer = probe_usage([durable_dir], PROBE_TIMEOUT_S)[durable_dir]
    if answer.get("timed_out"):
        raise SyncError(f"durable_dir {durable_dir} did not answer within {PROBE_TIMEOUT_S:g} s (a hung mount?)")
    if answer.get("probe_error") or answer.get("error"):
        raise SyncError(f"durable_dir {durable_dir}: {answer.get('probe_error') or answer.get('error')}")
    free = answer.get("bytes_free")
    if isinstance(free, int) and free < needed:
        raise SyncError(f"durable_dir {durable_dir} has {free} bytes free, the artifacts need {needed}")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SyncError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        name = errno.errorcode.get(exc.errno or 0, "")
        return f"{exc.strerror or exc}{f' ({name})' if name else ''}{where}"
    return f"{type(exc).__name__}: {exc}"


def _verify(
    verifier: Verifier, root: str, artifacts: Sequence[Dict[str, object]], stopped: Callable[[], bool]
) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """Each copy's checks (``{path, ok, message}``), and the first failure's one-line reason or None."""
    checks: List[Dict[str, Any]] = []
    for artifact in artifacts:
        if stopped():
            raise SyncError("run stopped during sync")
        relative = str(artifact["path"])
        check = verifier.check(relative, os.path.join(root, relative), stopped)
        if check is not None:
            checks.append(check)
    failed = [check for check in checks if not check["ok"]]
    reason = f"{failed[0]['path']}: {failed[0]['message']}" if failed else None
    if len(failed) > 1:
        reason = f"{reason} (and {len(failed) - 1} more artifact(s) failed their check)"
    return checks, reason


def sync_cell(
    base: str,
    *,
    prune_patterns: Sequence[str],
    artifact_patterns: Sequence[str],
    durable_dir: Optional[str],
    run: str,
    cell: str,
    stopped: Callable[[], bool] = lambda: False,
    launch_id: Optional[str] = None,
    optional_patterns: Sequence[str] = (),
    verifier: Optional[Verifier] = None,
    keep: Sequence[str] = (),
) -> SyncOutcome:
    """Prune, then copy and verify the artifacts of a succeeded cell, then the ``verifier``'s checks on each copy;
    never raises.

    With ``launch_id``, the durable run directory is claimed for that launch first (:func:`claim_durable`). The
    manifest lists every faithful copy, even when a check then refuses it: it says what the durable copy holds,
    and the result's ``sync: failed`` says the cell is not done. ``keep``: paths prune never removes.
    """
    pruned, problems = prune(base, prune_patterns, keep)
    if not artifact_patterns and not optional_patterns:
        return SyncOutcome("skipped", pruned=tuple(pruned), prune_errors=tuple(problems))
    artifacts: List[Dict[str, object]] = []
    checks: List[Dict[str, Any]] = []
    try:
        if durable_dir is None:
            raise SyncError("artifacts are declared but the run has no durable_dir")
        files = collect(base, artifact_patterns, optional_patterns)
        _check_durable(durable_dir, sum(os.path.getsize(source) for _rel, source in files))
        durable_run = durable_run_dir(durable_dir, run)
        if launch_id is not None:
            claim_durable(durable_run, run, launch_id)
        destination_root = os.path.join(durable_run, "cells", cell)
        os.makedirs(destination_root, exist_ok=True)
        for relative, source in files:
            destination = os.path.join(destination_root, relative)
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            size, sha256 = copy_verified(source, destination, stopped)
            artifacts.append({"path": relative, "size": size, "sha256": sha256})
        update_manifest(durable_run, cell, artifacts)
        if verifier is not None:
            checks, refused = _verify(verifier, destination_root, artifacts, stopped)
            if refused is not None:
                # A check a stop cut short says nothing of the file: only a finished refusal marks it.
                bad = [(c["path"], str(c.get("bad") or "check")) for c in checks if not c["ok"]]
                if bad and not stopped():
                    update_manifest(durable_run, cell, artifacts, bad)
                return SyncOutcome("failed", (), refused, tuple(pruned), tuple(problems), tuple(checks))
    except Exception as exc:  # every failure is recorded as sync failed, never raised past the cell
        return SyncOutcome("failed", (), _reason(exc), tuple(pruned), tuple(problems), tuple(checks))
    return SyncOutcome("verified", tuple(artifacts), None, tuple(pruned), tuple(problems), tuple(checks))


def _is_temp(name: str, top: bool) -> bool:
    return bool(TEMP_NAME.match(name) or OLD_TEMP_NAME.match(name) or (top and TOP_TEMP_NAME.match(name)))


def clear_temp_copies(durable_run: str, cells: Sequence[str]) -> List[str]:
    """Remove the temporary copies a killed sync left in ``durable_run``: under ``cells/<cell>/`` of the given
    cells only (a shard on another box may be copying its own cells into a shared durable_dir right now), and the
    manifest's at the top under its lock. Returns what was removed, relative to ``durable_run``."""
    removed: List[str] = []
    for cell in cells:
        root = os.path.join(durable_run, "cells", cell)
        if not NAME_PATTERN.match(cell) or not os.path.isdir(root) or os.path.islink(root):
            continue
        for directory, dirs, names in os.walk(root):  # never follows a link out of the copy
            dirs.sort()
            for name in sorted(names):
                if _is_temp(name, top=False):
                    os.unlink(os.path.join(directory, name))
                    removed.append(os.path.relpath(os.path.join(directory, name), durable_run))
    if not os.path.isdir(durable_run):
        return removed
    with _MANIFEST_LOCK:
        lock_fd = os.open(os.path.join(durable_run, MANIFEST_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # no manifest is being written while its temporaries go
            for name in sorted(os.listdir(durable_run)):
                path = os.path.join(durable_run, name)
                if _is_temp(name, top=True) and os.path.isfile(path) and not os.path.islink(path):
                    os.unlink(path)
                    removed.append(name)
        finally:
            os.close(lock_fd)
    return removed
