# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The instance side of teardown's gate: what a meter-stop takes with it beyond the runs torn down.

A meter-stop acts on the whole box, so before one the gate asks: is this the box the controller means (its own
id, read on the box), which other runs live on it and what would each lose, which processes still carry a run's
marker, and do data_dir and durable_dir share a filesystem (an irreversible verb then destroys both). An archived
run (``run_archive``, under ``<data_dir>/runs/.archive/``) is a run on the box too: it may hold the only results, and
the meter-stop takes it with the rest. Every read of data_dir or durable_dir happens in a forked child under a
deadline (a hung mount fails, not hangs). Pure standard library, Linux ``/proc``.
"""

from __future__ import annotations

import functools
import os
import stat
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._gpu_users import GPU_DEVICE, gpu_users
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _archive_durable as archived_durable
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, read_json_quietly
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MANIFEST_NAME,
    NAME_PATTERN,
    durable_run_dir,
    list_archived,
    run_dir,
    tombstone_path,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _teardown_box as whole

# Containers keep the platform's variables in PID 1's environment; an sshd session often does not inherit them.
PID1_ENVIRON = "/proc/1/environ"
MAX_ENVIRON_BYTES = 1024 * 1024
PROBE_TIMEOUT_S = 20.0
MAX_WALKED = 200_000  # entries counted per run's scratch; beyond, the size is a lower bound
MAX_PIDS_LISTED = 10


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _environ_values(raw: bytes) -> Dict[str, str]:
    values = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            values[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return values


def _read_environ(path: str) -> Dict[str, str]:
    with open(path, "rb") as handle:
        return _environ_values(handle.read(MAX_ENVIRON_BYTES))


def box_ids(names: Sequence[str], environ_path: str) -> Tuple[List[Tuple[str, str, str]], Optional[str]]:
    """``(name, value, source)`` for each of ``names`` the box sets (non-empty), from this process's environment
    first, then from PID 1's; and why PID 1's environment could not be read, if it could not."""
    found = [(name, os.environ[name].strip(), "environment") for name in names if os.environ.get(name, "").strip()]
    missing = [name for name in names if name not in {entry[0] for entry in found}]
    if not missing:
        return found, None
    answer = run_with_deadline({"environ": functools.partial(_read_environ, environ_path)}, PROBE_TIMEOUT_S)
    if "value" not in answer["environ"]:
        return found, answer["environ"].get("error") or f"{environ_path} did not answer"
    pid1 = answer["environ"]["value"]
    found += [(name, pid1[name].strip(), environ_path) for name in missing if pid1.get(name, "").strip()]
    return found, None


def check_instance_id(
    expected: str, names: Sequence[str], environ_path: str = ""
) -> Tuple[Dict[str, Any], Optional[str], Optional[str]]:
    """The id facts, the refusal when the box says it is another instance, and the note when it cannot say.

    Vast.ai's label reads ``C.<id>``: a value equal to the id or to ``C.`` + the id is this box.
    """
    found, unreadable = box_ids(names, environ_path or PID1_ENVIRON)
    facts: Dict[str, Any] = {"id_checked": False, "id_expected": expected, "id_found": None, "id_source": None}
    for name, value, source in found:
        facts.update(id_checked=True, id_found=value, id_source=f"{name} ({source})")
        if value not in (expected, f"C.{expected}"):
            return facts, f"instance_id {expected} is not this box: its {name} ({source}) says {value}", None
    if found:
        return facts, None, None
    variables = ", ".join(names) or "no instance_id_env named"
    note = f"instance_id {expected} was not cross-checked: the box does not tell its own id ({variables})"
    return facts, None, note + (f"; {unreadable}" if unreadable else "")


def _scratch_size(path: str) -> Tuple[int, int]:
    """(cell directories, bytes) of a run's scratch, never following a link; bounded by MAX_WALKED entries."""
    cells_dir = os.path.join(path, "cells")
    cells = 0
    if os.path.isdir(cells_dir) and not os.path.islink(cells_dir):
        with os.scandir(cells_dir) as entries:
            cells = sum(1 for entry in entries if entry.is_dir(follow_symlinks=False))
    size, walked, pending = 0, 0, [path]
    while pending and walked < MAX_WALKED:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    walked += 1
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(entry.path)
                    elif stat.S_ISREG(info.st_mode):
                        size += info.st_size
        except OSError:
            continue  # an unreadable corner: the size stays a lower bound
    return cells, size


def _manifest_lines(path: str) -> int:
    try:
        with open(path, "rb") as handle:
            # A "#" line is a comment (a known-bad mark), not a file.
            return sum(1 for line in handle.read(64 * 1024 * 1024).splitlines() if line.strip() and line[:1] != b"#")
    except OSError:
        return 0


def survey_run(data_dir: str, durable_dir: Optional[str], run: str) -> Dict[str, Any]:
    """A run not torn down by this call: its state and what a meter-stop would cost it (run in a child)."""
    scratch = run_dir(data_dir, run)
    tombstone = read_json_quietly(tombstone_path(data_dir, run))
    exists = os.path.lexists(scratch)
    entry: Dict[str, Any] = {"name": run, "cells": 0, "bytes": 0, "durable_files": 0}
    if tombstone is not None and tombstone.get("state") == "removing":
        entry["state"] = "removing"
    elif not exists:
        entry["state"] = "torn_down" if tombstone is not None else "absent"
    else:
        disk = OnDisk(data_dir, run)
        if disk.problem or disk.registered is None:
            entry["state"] = "unknown"
        else:
            entry["state"] = "running" if disk.live else "finished" if disk.done else "stopped"
    if exists and os.path.isdir(scratch) and not os.path.islink(scratch):
        entry["cells"], entry["bytes"] = _scratch_size(scratch)
    if durable_dir and entry["state"] != "torn_down":
        entry["durable_files"] = _manifest_lines(os.path.join(durable_run_dir(durable_dir, run), MANIFEST_NAME))
    return entry


STATE_WORDS = {
    "running": "running",
    "finished": "finished, not torn down",
    "stopped": "failed or stopped, not torn down",
    "removing": "its scratch removal did not finish",
    "unknown": "it has no readable run.json",
    "absent": "only its processes are left",
    "torn_down": "torn down",
    "archived": "archived",
}


def _amount(size: int) -> str:
    value, unit = float(size), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{size} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def would_lose(entry: Dict[str, Any]) -> str:
    parts = []
    if entry["pids"]:
        parts.append(f"its live processes (pid {', '.join(str(pid) for pid in entry['pids'][:MAX_PIDS_LISTED])})")
    if entry["cells"]:
        parts.append(f"the scratch of {_count(entry['cells'], 'cell')} ({_amount(entry['bytes'])})")
    elif entry["bytes"]:
        parts.append(f"its scratch ({_amount(entry['bytes'])})")
    if entry["durable_files"]:
        parts.append(f"{_count(entry['durable_files'], 'durable file')} not pulled")
    return ", ".join(parts) or "nothing"


def other_runs(
    data_dir: str,
    durable_dir: Optional[str],
    names: Sequence[str],
    markers: Sequence[Dict[str, Any]],
    abandon: Sequence[str],
) -> List[Dict[str, Any]]:
    """Each other run's entry in ``data_dir`` (``name, state, torn_down, abandoned, would_lose, pids``, and
    ``problem`` when its survey did not answer). ``names`` are the other runs there; a marker naming a run beyond
    them (its directory gone, its process not) is one too."""
    by_run: Dict[str, List[int]] = {}
    for proc in markers:
        by_run.setdefault(proc["run"], []).append(proc["pid"])
    runs = sorted(set(names) | {run for run in by_run if NAME_PATTERN.match(run)})
    probes = {run: functools.partial(survey_run, data_dir, durable_dir, run) for run in runs}
    answers = run_with_deadline(probes, PROBE_TIMEOUT_S) if probes else {}
    entries: List[Dict[str, Any]] = []
    for run in runs:
        answer = answers[run]
        entry = answer.get("value") or {"name": run, "state": "unknown", "cells": 0, "bytes": 0, "durable_files": 0}
        if "value" not in answer:
            entry["problem"] = answer.get("error") or f"did not answer within {PROBE_TIMEOUT_S:g} s (a hung mount?)"
        entry.update(pids=by_run.get(run, []), archived=None)
        if entry["pids"]:
            entry["state"] = "running"
        entry.update(torn_down=entry["state"] == "torn_down", abandoned=run in abandon, would_lose=would_lose(entry))
        entries.append(entry)
    return entries


def _label(entry: Mapping[str, Any], elsewhere: bool = False) -> str:
    """``r2``, ``r2 in /root/scratch`` (a data dir not the host's), ``r2 (as .archive/r2-...)``."""
    where = f" in {entry['data_dir']}" if elsewhere else ""
    archived = f" (as .archive/{entry['archived']})" if entry.get("archived") else ""
    return f"{entry['name']}{where}{archived}"


def survey_archived(data_dir: str, durable_dir: Optional[str], rehash: bool = False) -> List[Dict[str, Any]]:
    """Each archived run and what a meter-stop would cost it (run in a child: the archive is on data_dir): where its
    scratch lies (``data_dir``, ``scratch_dir``, ``cells``, ``bytes``) and its durable copy where the archive moved it
    (``durable_dir`` the copy's directory or None, ``durable_moved``, ``durable_files``, ``durable_verified``: every
    manifest entry there at its size, or also its sha256 with ``rehash``; ``durable_check``, ``durable_problem``).
    durable_dir is read in children of its own: a hung one is a ``durable_problem``, not a failed survey."""
    archived_list = list_archived(data_dir)
    probes = {
        item.entry: functools.partial(
            archived_durable.archived_copy, item.path, item.entry, item.run, durable_dir, rehash
        )
        for item in archived_list
    }
    limit = archived_durable.REHASH_TIMEOUT_S if rehash else archived_durable.DURABLE_TIMEOUT_S
    copies = run_with_deadline(probes, limit) if probes else {}
    entries = []
    for archived in archived_list:
        entry: Dict[str, Any] = {"name": archived.run, "state": "archived", "archived": archived.entry}
        linked = os.path.islink(archived.path)  # an archived link: its target is not the archive's to count
        entry["cells"], entry["bytes"] = (0, 0) if linked else _scratch_size(archived.path)
        entry.update(data_dir=data_dir, scratch_dir=archived.path)
        answer = copies[archived.entry]
        why = answer.get("error") or f"durable_dir did not answer within {limit:g} s (a hung mount?)"
        unknown = {"durable_dir": None, "durable_moved": None, "durable_files": 0, "durable_verified": None}
        entry.update(answer.get("value") or dict(unknown, durable_check=None, durable_problem=why))
        entries.append(entry)
    return entries


def archived_runs(
    data_dir: str, durable_dir: Optional[str], abandon: Sequence[str]
) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """Like :func:`other_runs` for the archived runs: whether the run is torn down by this teardown or not, its
    archived copy stays until the meter-stop. ``abandon_runs`` takes the run's name or the archive entry's. The
    problem when the archive could not be read in time."""
    answer = run_with_deadline({"archive": functools.partial(survey_archived, data_dir, durable_dir)}, PROBE_TIMEOUT_S)
    if "value" not in answer["archive"]:
        why = answer["archive"].get("error") or f"did not answer within {PROBE_TIMEOUT_S:g} s (a hung mount?)"
        return [], f"archived runs under {data_dir}: {why}"
    entries = []
    for entry in answer["archive"]["value"]:
        abandoned = entry["name"] in abandon or entry["archived"] in abandon
        entry.update(pids=[], torn_down=False, abandoned=abandoned)
        entry["would_lose"] = would_lose(entry)
        entries.append(entry)
    return entries, None


def _device_of(path: str) -> Dict[str, Any]:
    """st_dev of ``path``, or of its nearest existing parent when it does not exist yet."""
    judged = os.path.abspath(path)
    while not os.path.exists(judged) and judged != "/":
        judged = os.path.dirname(judged)
    return {"dev": os.stat(judged).st_dev, "judged": judged}


def devices(data_dir: str, durable_dir: str) -> Dict[str, Any]:
    """``data_dev``, ``durable_dev`` and the path each was read from, or ``problem`` (under the deadline)."""
    probes = {key: functools.partial(_device_of, path) for key, path in (("data", data_dir), ("durable", durable_dir))}
    answers = run_with_deadline(probes, PROBE_TIMEOUT_S)
    for key, path in (("data", data_dir), ("durable", durable_dir)):
        if "value" not in answers[key]:
            why = answers[key].get("error") or f"did not answer within {PROBE_TIMEOUT_S:g} s (a hung mount?)"
            return {"problem": f"{key}_dir {path}: {why}"}
    return {
        "data_dev": answers["data"]["value"]["dev"],
        "durable_dev": answers["durable"]["value"]["dev"],
        "durable_judged": answers["durable"]["value"]["judged"],
    }


def _runs_of_box(
    params: Mapping[str, Any], runs: Sequence[str], on_box: Sequence[str], abandon: Sequence[str]
) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """Every run of every data dir of the box but ``runs`` (the host's, torn down now): facts, refusal lines (a run
    neither torn down, abandoned nor kept by the stop: ``survives`` names both data_dir and durable_dir and the run,
    finished or archived, lies on their filesystems) and notes."""
    data_dir, durable_dir = os.path.normpath(params["data_dir"]), params.get("durable_dir") or None
    dirs, notes, unlisted = whole.data_dirs(data_dir, durable_dir)
    refusals = [unlisted] if unlisted else []
    reals = {entry["path"]: entry["real"] for entry in dirs}
    markers = [
        proc
        for proc in whole.marker_processes([entry["path"] for entry in dirs], reals)
        if not (proc["data_dir"] == data_dir and proc["run"] in runs)
    ]
    entries: List[Dict[str, Any]] = []
    for place in dirs:
        path, host = place["path"], place["path"] == data_dir
        names = [name for name in (on_box if host else place["runs"]) if not (host and name in runs)]
        mine = [proc for proc in markers if proc["data_dir"] == path]
        found = other_runs(path, place["durable_dir"], names, mine, abandon)
        archived, problem = archived_runs(path, place["durable_dir"], abandon)
        refusals += [problem] if problem else []
        for entry in found + archived:
            entry["data_dir"] = path
            entry["label"] = _label(entry, not host)
        entries += found + archived
    survives = list(params.get("survives") or [])
    kept = whole.kept_dirs(data_dir, durable_dir, dirs, _device_of) if whole.keeps_disk(survives) else {}
    for entry in entries:
        over = entry["state"] in ("finished", "archived") and not entry["pids"] and not entry.get("problem")
        entry["kept"] = bool(over and kept.get(entry["data_dir"]))
        if entry["kept"]:
            entry["would_lose"] = "nothing: the meter-stop keeps its disk"
            state = STATE_WORDS[entry["state"]]
            notes.append(
                f"run {entry['label']} is {state}: the meter-stop keeps data_dir and durable_dir, so it loses nothing "
                "of it"
            )
        elif entry["abandoned"]:
            notes.append(f"run {entry['label']} is abandoned: it loses {entry['would_lose']}")
        elif not entry["torn_down"]:
            why = entry.get("problem") or STATE_WORDS[entry["state"]]
            refusals.append(f"run {entry['label']}: {why}, would lose {entry['would_lose']}")
    seen = {entry["name"] for entry in entries} | {entry["archived"] for entry in entries if entry.get("archived")}
    notes += [f"abandon_runs names {name}, which is not on the box" for name in abandon if name not in seen]
    facts = {
        "data_dirs": [entry["path"] for entry in dirs],
        "other_runs": entries,
        "live_marker_pids": [proc["pid"] for proc in markers],
    }
    return facts, refusals, notes


def judge_instance(
    params: Mapping[str, Any], runs: Sequence[str], on_box: Sequence[str], abandon: Sequence[str]
) -> Tuple[Dict[str, Any], List[Tuple[str, str]], List[str]]:
    """The instance facts, the failures (step, reason) of ``other_runs``, ``gpu_users`` and ``same_filesystem``, and
    notes."""
    data_dir, durable_dir = params["data_dir"], params.get("durable_dir") or None
    failures: List[Tuple[str, str]] = []
    facts, refusals, notes = _runs_of_box(params, runs, on_box, abandon)
    if refusals:
        failures.append(("other_runs", f"{'; '.join(refusals)} (tear it down too, or name it in abandon_runs)"))
    users, unreadable = gpu_users(pattern=GPU_DEVICE)
    gpu_facts, refusal, gpu_notes = whole.gpu_step(users, unreadable, bool(params.get("abandon_gpu_users")))
    facts.update(gpu_facts)
    notes += gpu_notes
    if refusal:
        failures.append(("gpu_users", refusal))
    if durable_dir is None:
        if params.get("irreversible"):
            notes.append("no durable_dir: same_filesystem not checked")
        return facts, failures, notes
    found = devices(data_dir, durable_dir)
    if "problem" in found:
        facts["same_device"] = None
        if params.get("irreversible"):
            failures.append(("same_filesystem", found["problem"]))
        return facts, failures, notes
    same = found["data_dev"] == found["durable_dev"]
    facts.update(same_device=same, data_dev=found["data_dev"], durable_dev=found["durable_dev"])
    if same and params.get("irreversible"):
        where = "" if found["durable_judged"] == durable_dir else f" (judged by {found['durable_judged']})"
        failures.append(
            (
                "same_filesystem",
                f"durable_dir {durable_dir}{where} is on data_dir {data_dir}'s filesystem (device {found['data_dev']}):"
                " the irreversible meter-stop destroys both; put durable_dir on a separately mounted volume",
            )
        )
    return facts, failures, notes
