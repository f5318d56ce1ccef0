# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The instance's own files on a box, outside every data dir: what the box as a whole knows about itself.

A box holds runs in any number of data dirs; a stage or watcher armed for one of them must still see the others.
So the instance keeps a directory of its own, ``~/.remote_gpu_trainer/instance/`` of the user the stages run as
(``RGT_INSTANCE_DIR`` in the environment moves it, for a box whose home is read-only):

``data_dirs.json``   every data dir a launch used on this box (path, durable_dir, first and last use): the registry
``box-lease.json``   the stage that holds the box right now (teardown's pull and load-verify): a stop waits for it
``ledger.json``      the rental's cost ledger (first seen, stops, restarts): never shrinks with archive or cleanup
``stops.json``       the stops we issued (autostop, teardown): told apart from a box that died on its own

Beside the registry, the data dirs of live runs are read from their processes' ``RGT_RUN_DIR`` marker, so a run
launched before the registry existed, or whose entry was lost, is still seen. Pure standard library, Linux /proc.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    RUN_MARKER,
    runs_root,
    write_json_atomic,
)

INSTANCE_DIR_ENV = "RGT_INSTANCE_DIR"
DATA_DIRS, LEASE, LEDGER, STOPS, STATE_LOCK = (
    "data_dirs.json", "box-lease.json", "ledger.json", "stops.json", ".state.lock",
)  # fmt: skip
MAX_DATA_DIRS = 64
MAX_DOC_BYTES = 1024 * 1024
MAX_ENVIRON_BYTES = 1024 * 1024
LOCK_WAIT_S = 5.0
MAX_LEASE_S = 4 * 3600.0


def instance_dir(environ: Optional[Dict[str, str]] = None) -> str:
    """Where the instance's files live: ``$RGT_INSTANCE_DIR``, else ``<home of this uid>/.remote_gpu_trainer/instance``
    (the password database's home, not ``$HOME``: a watcher started with ``env -i`` finds the same place)."""
    env = os.environ if environ is None else environ
    chosen = env.get(INSTANCE_DIR_ENV, "").strip()
    if chosen and os.path.isabs(chosen):
        return os.path.normpath(chosen)
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        home = os.path.expanduser("~")
    return os.path.join(home or "/", ".remote_gpu_trainer", "instance")


def state_path(name: str, directory: Optional[str] = None) -> str:
    """One of the instance's files (``DATA_DIRS``, ``LEASE``, ``LEDGER``, ``STOPS``)."""
    return os.path.join(directory or instance_dir(), name)


def read_doc(path: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """A JSON object from ``path``: ``(doc, None)``, ``(None, None)`` when absent, ``(None, problem)`` when unusable."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_DOC_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    try:
        if len(raw) > MAX_DOC_BYTES:
            raise ValueError(f"larger than {MAX_DOC_BYTES} bytes")
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as exc:
        return None, f"{path}: {type(exc).__name__ if isinstance(exc, RecursionError) else exc}"
    return doc, None


@contextlib.contextmanager
def state_lock(directory: Optional[str] = None, wait_s: float = LOCK_WAIT_S) -> Iterator[str]:
    """The instance directory (created 0700), held under its flock for a read-modify-write of one of its files.
    TimeoutError when another holder keeps it longer than ``wait_s``."""
    where = directory or instance_dir()
    os.makedirs(where, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(where, STATE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{where}: another stage held {STATE_LOCK} for over {wait_s:g} s") from exc
                time.sleep(0.05)
        yield where
    finally:
        os.close(fd)


def utc_iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


# --- the data dirs ----------------------------------------------------------------------------------------------


def _entries(doc: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    entries = (doc or {}).get("data_dirs")
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str) and os.path.isabs(e["path"])]


def register_data_dir(
    data_dir: str, durable_dir: Optional[str] = None, directory: Optional[str] = None, now: Optional[float] = None
) -> List[Dict[str, Any]]:
    """Record that a launch used ``data_dir`` (and its durable_dir) on this box; the registry after it.

    An entry is never dropped by a later launch: a data dir stays known until its runs are gone (readers skip a
    data dir that no longer exists)."""
    moment = utc_iso(time.time() if now is None else now)
    path = os.path.normpath(data_dir)
    with state_lock(directory) as where:
        target = state_path(DATA_DIRS, where)
        doc, _problem = read_doc(target)  # an unreadable registry is rebuilt from this launch on
        entries = _entries(doc)
        for entry in entries:
            if os.path.normpath(entry["path"]) == path:
                entry.update(last_used_at=moment, durable_dir=durable_dir or entry.get("durable_dir"))
                break
        else:
            entries.append({"path": path, "durable_dir": durable_dir, "first_used_at": moment, "last_used_at": moment})
        entries = entries[-MAX_DATA_DIRS:]
        write_json_atomic(target, {"version": 1, "data_dirs": entries}, private=True)
    return entries


def registered_data_dirs(directory: Optional[str] = None) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """The registry's entries ``{path, durable_dir, first_used_at, last_used_at}`` and a problem line, if any."""
    doc, problem = read_doc(state_path(DATA_DIRS, directory))
    return _entries(doc), problem


def _named_instance(data: bytes) -> Optional[str]:
    """The ``RGT_INSTANCE_DIR`` a process's environment (NUL-framed) names, or None."""
    prefix = f"\0{INSTANCE_DIR_ENV}=".encode()
    start = data.find(prefix)
    if start < 0:
        return None
    value = data[start + len(prefix) : data.index(b"\0", start + len(prefix))].decode("utf-8", "replace").strip()
    return os.path.normpath(value) if os.path.isabs(value) else None


def _mount_namespace(process: str) -> Optional[str]:
    try:
        return os.readlink(os.path.join(process, "ns", "mnt"))
    except OSError:
        return None


def marker_data_dirs(proc: str = "/proc") -> List[str]:
    """The data dirs of every live process carrying ``RGT_RUN_DIR=<data_dir>/runs/<run>`` (sorted, unique).

    A process that names an instance directory other than the one this process names (both set through
    ``RGT_INSTANCE_DIR``) belongs to another instance sharing the machine (a test's box), and one in another mount
    namespace (a container's) names a path that is not this filesystem's: neither is counted."""
    prefix = f"\0{RUN_MARKER}=".encode()
    found = set()
    own = os.getpid()
    chosen = os.environ.get(INSTANCE_DIR_ENV, "").strip()
    ours = os.path.normpath(chosen) if os.path.isabs(chosen) else None
    own_mounts = _mount_namespace(os.path.join(proc, "self"))
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(os.path.join(proc, name, "environ"), "rb") as handle:
                data = b"\0" + handle.read(MAX_ENVIRON_BYTES) + b"\0"
        except OSError:
            continue  # gone, or another user's process
        start = data.find(prefix)
        if start < 0:
            continue
        theirs = _named_instance(data) if ours else None
        if theirs is not None and theirs != ours:
            continue
        mounts = _mount_namespace(os.path.join(proc, name)) if own_mounts else None
        if mounts is not None and mounts != own_mounts:
            continue
        end = data.index(b"\0", start + len(prefix))
        value = os.path.normpath(data[start + len(prefix) : end].decode("utf-8", "replace"))
        parent = os.path.dirname(value)  # <data_dir>/runs
        if os.path.isabs(value) and os.path.basename(parent) == "runs":
            found.add(os.path.dirname(parent))
    return sorted(found)


def known_data_dirs(
    given: Sequence[Optional[str]] = (), directory: Optional[str] = None, proc: str = "/proc"
) -> Tuple[List[str], List[str]]:
    """Every data dir of the box, ``given`` first (the stage's own), then the registry's, then those only a live
    process's marker names; and a problem line per source that could not be read. A path is listed once (as
    normalised); a registered data dir that no longer has a ``runs`` directory is left out."""
    problems: List[str] = []
    ordered: List[str] = [os.path.normpath(path) for path in given if path]
    entries, problem = registered_data_dirs(directory)
    if problem:
        problems.append(f"the box's data dir registry is unreadable ({problem}): only marked processes add to it")
    for entry in entries:
        path = os.path.normpath(entry["path"])
        if path not in ordered and os.path.isdir(runs_root(path)):
            ordered.append(path)
    for path in marker_data_dirs(proc):
        if path not in ordered:
            ordered.append(path)
    return list(dict.fromkeys(ordered)), problems


def durable_dir_of(data_dir: str, directory: Optional[str] = None) -> Optional[str]:
    """The durable_dir the registry recorded for ``data_dir`` (None when it recorded none)."""
    entries, _problem = registered_data_dirs(directory)
    for entry in entries:
        if os.path.normpath(entry["path"]) == os.path.normpath(data_dir):
            durable = entry.get("durable_dir")
            return durable if isinstance(durable, str) and os.path.isabs(durable) else None
    return None


# --- the box lease: a stage holding the box ---------------------------------------------------------------------


def take_lease(
    holder: str, token: str, ttl_s: float, directory: Optional[str] = None, now: Optional[float] = None
) -> Optional[Dict[str, Any]]:
    """Hold the box for ``holder`` (``teardown``) under ``token`` for ``ttl_s`` more seconds (a refresh when the
    token already holds it). Returns the other holder's lease when another token holds an unexpired one (nothing
    is taken then), else None. A lease expires by itself: a controller that died mid-stage never pins the box."""
    moment = time.time() if now is None else now
    ttl = min(max(float(ttl_s), 1.0), MAX_LEASE_S)
    with state_lock(directory) as where:
        current = active_lease(where, moment)
        if current is not None and current.get("token") != token:
            return current
        since = current.get("since") if current is not None else utc_iso(moment)
        lease = {
            "holder": holder,
            "token": token,
            "since": since,
            "until_epoch": moment + ttl,
            "until": utc_iso(moment + ttl),
        }
        write_json_atomic(state_path(LEASE, where), lease, private=True)
    return None


def release_lease(token: str, directory: Optional[str] = None) -> bool:
    """Give the box back when ``token`` holds it; True when a lease was removed."""
    with state_lock(directory) as where:
        path = state_path(LEASE, where)
        doc, _problem = read_doc(path)
        if doc is None or doc.get("token") != token:
            return False
        os.unlink(path)
    return True


def active_lease(directory: Optional[str] = None, now: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """The lease holding the box now ``{holder, token, since, until, until_epoch}``, or None (none, or expired).
    An unreadable lease file holds the box (a stop must not guess) until its mtime is MAX_LEASE_S old."""
    moment = time.time() if now is None else now
    path = state_path(LEASE, directory)
    doc, problem = read_doc(path)
    if problem is not None:
        try:
            written = os.stat(path).st_mtime
        except OSError:
            return None
        if moment - written > MAX_LEASE_S:
            return None
        return {"holder": "unknown", "token": None, "since": utc_iso(written), "until": utc_iso(written + MAX_LEASE_S),
                "until_epoch": written + MAX_LEASE_S, "problem": problem}  # fmt: skip
    if doc is None:
        return None
    until = doc.get("until_epoch")
    if isinstance(until, bool) or not isinstance(until, (int, float)) or until <= moment:
        return None
    if until - moment > MAX_LEASE_S:  # a clock stepped back: never longer than the longest lease
        return None
    return doc
