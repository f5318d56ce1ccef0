# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The whole box as teardown's gate sees it before a meter-stop, beyond the host's own data dir.

A box holds runs in any number of data dirs (``launch_data_dir=/root/scratch`` beside the profile's ``/workspace``):
the registry every launch writes and the live processes' run markers name them (``_box_state.known_data_dirs``).
A process that holds a GPU and belongs to no run is the renter's own job: the meter-stop would kill it. And what
the stop verb keeps (``survives``) decides whether a finished or archived run loses anything by it: a verb that
keeps both data_dir and durable_dir loses nothing of a run whose directories lie on those filesystems. Every read of
a data dir happens in a forked child under a deadline (a hung mount fails, not hangs). Pure standard library.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state as box_state
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import named, outside_runs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import RUN_MARKER, list_runs, runs_root
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import read_stat

SURVIVABLE = ("data_dir", "durable_dir")
PROBE_TIMEOUT_S = 20.0
MAX_ENVIRON_BYTES = 1024 * 1024
MAX_USERS_LISTED = 20


def _data_dirs(data_dir: str, durable_dir: Optional[str]) -> Dict[str, Any]:
    """Every data dir of the box, the host's first: ``{path, real, durable_dir, runs}`` (``runs`` listed for the
    others only: the host's are the gate's own), and the registry's problems. Two names of one directory (a link)
    are one data dir."""
    paths, problems = box_state.known_data_dirs([data_dir])
    found: List[Dict[str, Any]] = []
    seen = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        host = path == os.path.normpath(data_dir)
        durable = durable_dir if host else box_state.durable_dir_of(path)
        found.append({"path": path, "real": real, "durable_dir": durable, "runs": [] if host else list_runs(path)})
    return {"dirs": found, "problems": problems}


def data_dirs(data_dir: str, durable_dir: Optional[str]) -> Tuple[List[Dict[str, Any]], List[str], Optional[str]]:
    """The box's data dirs (see :func:`_data_dirs`), notes, and a refusal when they cannot be read in time."""
    answer = run_with_deadline({"dirs": functools.partial(_data_dirs, data_dir, durable_dir)}, PROBE_TIMEOUT_S)
    if "value" not in answer["dirs"]:
        why = answer["dirs"].get("error") or f"did not answer within {PROBE_TIMEOUT_S:g} s (a hung mount?)"
        only = [{"path": os.path.normpath(data_dir), "real": None, "durable_dir": durable_dir, "runs": []}]
        return only, [], f"the box's other data dirs cannot be listed: {why}, so their runs are unknown"
    return answer["dirs"]["value"]["dirs"], list(answer["dirs"]["value"]["problems"]), None


def marker_processes(
    data_dirs: Sequence[str], reals: Optional[Mapping[str, Optional[str]]] = None
) -> List[Dict[str, Any]]:
    """Live processes whose environment carries ``RGT_RUN_DIR=<data_dir>/runs/<run>`` for one of ``data_dirs``, each
    with that run's name and data dir (the path as given, and as resolved in ``reals`` or here: a runner may have
    been started through a link)."""
    prefixes: List[Tuple[bytes, str]] = []
    for data_dir in data_dirs:
        real = (reals or {}).get(data_dir) if reals is not None else os.path.realpath(data_dir)
        roots = {os.path.normpath(runs_root(data_dir))} | ({runs_root(real)} if real else set())
        prefixes += [(f"\0{RUN_MARKER}={root}/".encode(), data_dir) for root in sorted(roots)]
    own = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        proc = read_stat(int(name))
        if proc is None or proc.state == "Z":
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                data = b"\0" + handle.read(MAX_ENVIRON_BYTES) + b"\0"
        except OSError:
            continue  # gone, or another user's process: its marker cannot be read
        for prefix, data_dir in prefixes:
            start = data.find(prefix)
            if start >= 0:
                end = data.index(b"\0", start + len(prefix))
                value = data[start + len(prefix) : end].decode("utf-8", "replace")
                found.append({"pid": proc.pid, "run": value.split("/", 1)[0], "data_dir": data_dir})
                break
    return sorted(found, key=lambda entry: entry["pid"])


def keeps_disk(survives: Sequence[str]) -> bool:
    """The stop verb keeps both data_dir and durable_dir (a stop, not a delete)."""
    return set(SURVIVABLE) <= set(survives)


def kept_dirs(
    data_dir: str,
    durable_dir: Optional[str],
    dirs: Sequence[Mapping[str, Any]],
    device_of: Callable[[str], Dict[str, Any]],
) -> Dict[str, bool]:
    """Per data dir of ``dirs``: whether a stop that keeps data_dir and durable_dir keeps it too, with its durable
    dir (each on one of those two filesystems: ``device_of(path)["dev"]``). A path that does not answer is not kept."""
    paths = {data_dir, *(p for p in (durable_dir,) if p)}
    for entry in dirs:
        paths.update(p for p in (entry["path"], entry.get("durable_dir")) if p)
    answers = run_with_deadline({path: functools.partial(device_of, path) for path in paths}, PROBE_TIMEOUT_S)
    device = {path: answer["value"]["dev"] for path, answer in answers.items() if "value" in answer}
    kept = {device[path] for path in (data_dir, durable_dir) if path and path in device}
    found = {}
    for entry in dirs:
        durable = entry.get("durable_dir")
        on_kept = device.get(entry["path"]) in kept and (not durable or device.get(durable) in kept)
        found[entry["path"]] = bool(kept) and on_kept
    return found


def gpu_step(
    users: Sequence[Mapping[str, Any]], unreadable: int, abandon: bool
) -> Tuple[Dict[str, Any], Optional[str], List[str]]:
    """The GPU users outside every run: facts, the refusal (unless ``abandon``) and notes."""
    outside = outside_runs(list(users))
    keys = ("pid", "name", "command", "gpus")
    facts = {
        "gpu_users": [{key: user[key] for key in keys} for user in outside[:MAX_USERS_LISTED]],
        "gpu_users_unreadable": unreadable,
    }
    notes = []
    if unreadable:
        notes.append(
            f"the open files of {unreadable} process(es) could not be read (another user's): a GPU job among them "
            "is not seen"
        )
    if not outside:
        return facts, None, notes
    if abandon:
        return facts, None, [*notes, f"abandoned GPU users: {named(outside)}: the meter-stop kills them"]
    verb = "uses a GPU and belongs" if len(outside) == 1 else "use a GPU and belong"
    refusal = (
        f"{named(outside)} {verb} to no run (a job started by hand?): the meter-stop would kill it; stop it yourself, "
        "or set abandon_gpu_users to stop the box anyway"
    )
    return facts, refusal, notes
