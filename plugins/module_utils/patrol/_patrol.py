# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What ``patrol_facts`` gathers on one box in one call, every probe under a deadline.

Three rounds of forked probes (``_deadline.run_with_deadline``), so a hung network mount or a hung driver costs a
reason, never the patrol: the run directories (run.json, results, each cell log's new bytes, monitor.jsonl's
tail and its sampled curves: ``_series``), the GPUs (NVML, else nvidia-smi), the data directory's usage and the
whole box (every run's liveness, its idle time, the autostop watcher's decision: ``_box_idle``) together; then the
durable directories the runs name; then the kernel log (dmesg / journalctl, with their own timeout) for Xids since
the run started. Only the cell-log cursors under ``<run>/.patrol/`` and the tick file ``runs/.patrol-tick.json`` are
written, nothing in check mode.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._disk import read_usage
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    NAME_PATTERN,
    cell_log,
    done_marker,
    list_archived,
    monitor_jsonl,
    patrol_dir,
    result_json,
    run_dir,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _cells
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._box_idle import box_probe, whole_box
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    load_cursor,
    save_cursor,
    scan_log,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import (
    KILLED_EXIT_CODES,
    KILLED_SIGNALS,
    box_facts,
    decide_box,
    finite,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_gpus import lost_findings, read_gpus
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._series import monitor_series

MAX_RUNS = 100
MAX_CURVE_RUNS = 8  # the fleet page shows at most 8 runs a box
BEHIND_SCAN_BYTES = 64 * 1024
MONITOR_TAIL_BYTES = 256 * 1024
MONITOR_SAMPLES = 20


class PatrolError(Exception):
    """The tick cannot answer what it was asked (a run named that is not on the box): one line for the user."""


def _registered(runs_dir: str, name: str) -> bool:
    return os.path.exists(os.path.join(runs_dir, name, "run.json"))


def _missing(data_dir: str, only: str, names: Sequence[str]) -> str:
    """One line naming the run asked for and the closest run on the box (or where it was archived)."""
    archived = [entry.entry for entry in _quietly(list_archived, data_dir, []) if entry.run == only]
    if archived:
        return f"run {only} is not on this box: it was archived as runs/.archive/{archived[-1]}"
    close = difflib.get_close_matches(only, names, n=1, cutoff=0.5)
    hint = (
        f"; the closest run there is {close[0]}"
        if close
        else (f"; runs there: {', '.join(names[:5])}" if names else "; no run there")
    )
    return f"run {only} is not on this box (no {os.path.join(data_dir, 'runs', only, 'run.json')}){hint}"


def _quietly(call: Any, data_dir: str, default: Any) -> Any:
    try:
        return call(data_dir)
    except OSError:
        return default


def select_runs(data_dir: str, only: Optional[str]) -> Dict[str, Any]:
    """The runs to patrol (directories holding a run.json, or only ``only``), those left out, the archived count,
    and a problem when ``runs/`` cannot be listed. Over MAX_RUNS, every unfinished run (no DONE) is kept and the
    finished ones are dropped first, oldest DONE first."""
    runs_dir = os.path.join(data_dir, "runs")
    chosen: Dict[str, Any] = {"names": [], "skipped": 0, "archived": 0, "missing": None, "problem": None}
    try:
        listed = sorted(entry.name for entry in os.scandir(runs_dir) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        listed = []
    except OSError as exc:
        return dict(chosen, problem=f"{runs_dir} cannot be listed: {exc.strerror or exc}")
    names = [name for name in listed if NAME_PATTERN.match(name) and _registered(runs_dir, name)]
    chosen["archived"] = len(_quietly(list_archived, data_dir, []))
    if only:
        return dict(chosen, names=[only]) if only in names else dict(chosen, missing=_missing(data_dir, only, names))
    if len(names) <= MAX_RUNS:
        return dict(chosen, names=names)
    finished = {name: _done_at(data_dir, name) for name in names}
    unfinished = [name for name in names if finished[name] is None]
    room = max(0, MAX_RUNS - len(unfinished))
    newest = sorted((n for n in names if finished[n] is not None), key=lambda n: finished[n], reverse=True)[:room]
    kept = set(unfinished) | set(newest)
    return dict(chosen, names=[n for n in names if n in kept], skipped=len(names) - len(kept))


def _done_at(data_dir: str, run: str) -> Optional[float]:
    try:
        return os.stat(done_marker(data_dir, run)).st_mtime
    except OSError:
        return None


def _monitor_tail(path: str, since: float) -> List[Dict[str, Any]]:
    """The last samples of monitor.jsonl newer than ``since`` (a bounded read of the file's end)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - MONITOR_TAIL_BYTES))
            raw = handle.read(MONITOR_TAIL_BYTES)
    except OSError:
        return []
    samples = []
    for line in raw.splitlines()[1 if size > MONITOR_TAIL_BYTES else 0 :]:
        try:
            sample = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            continue
        if isinstance(sample, dict) and (finite(sample.get("t")) or 0.0) >= since:
            samples.append(_clean_sample(sample))
    return samples[-MONITOR_SAMPLES:]


def _clean_sample(sample: Dict[str, Any]) -> Dict[str, Any]:
    cgroup = sample.get("cgroup") if isinstance(sample.get("cgroup"), dict) else {}
    gpus = sample.get("gpus") if isinstance(sample.get("gpus"), list) else None
    readings = None
    if gpus:
        readings = [
            {"index": _index(g.get("index"), position), "util_pct": finite(g.get("util_pct"))}
            for position, g in enumerate(gpus)
            if isinstance(g, dict)
        ]
    return {
        "t": finite(sample.get("t")),
        "memory_current": finite(cgroup.get("memory_current")),
        "memory_max": finite(cgroup.get("memory_max")),
        "gpus": readings,
    }


def _index(value: Any, position: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else position


def _gpu_list(value: Any) -> Optional[List[int]]:
    if not isinstance(value, list):
        return None
    return [g for g in value if isinstance(g, int) and not isinstance(g, bool)]


def _scan_cell_log(
    data_dir: str, run: str, cell: Dict[str, Any], scanning: Mapping[str, Any], *, write: bool, now: float
) -> None:
    cursor_path = os.path.join(patrol_dir(data_dir, run), f"{cell['name']}.json")
    scan, cursor = scan_log(
        cell_log(data_dir, run, cell["name"]),
        load_cursor(cursor_path),
        scanning["signatures"],
        scanning["progress"],
        max_bytes=scanning["max_bytes"] if time.monotonic() < scanning["scan_until"] else BEHIND_SCAN_BYTES,
        now=now,
    )
    if write and cursor is not None:
        try:
            save_cursor(cursor_path, cursor)
        except OSError as exc:
            scanning["notes"].append(f"{run}/{cell['name']}: scan cursor not saved ({exc.strerror or exc})")
    signatures = list(scan["signatures"])
    killed = cell.get("exit_code") in KILLED_EXIT_CODES or cell.get("signal") in KILLED_SIGNALS
    if killed and not any(s["signature"] == "killed" for s in signatures):
        ending = f"signal {cell['signal']}" if cell.get("signal") is not None else f"exit code {cell['exit_code']}"
        signatures.append({"signature": "killed", "count": 1, "first_line": f"{ending} (SIGKILL: the OOM killer?)"})
    growth = finite(scan.get("last_growth"))
    cell.update(
        log_bytes=scan.get("size"),
        log_error=scan.get("error"),
        log_exists=scan.get("exists"),
        crash_signatures=signatures,
        progress=scan.get("progress"),
        lost=scan.get("lost"),
        last_growth=growth,
        log_idle_s=round(max(0.0, now - growth), 1) if growth is not None else None,
        loss_series=scan.get("loss_series"),
    )


def _cell_view(
    cell: Dict[str, Any], record: Mapping[str, Any], living: Mapping[str, int], spec: Any, started: Optional[float]
) -> Dict[str, Any]:
    """What run.json, result.json, the spec and the process table add to ``cell_facts``' view of a cell."""
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import read_json_quietly  # noqa: PLC0415

    name = cell["name"]
    views = {v.get("name"): v for v in record.get("cells") or [] if isinstance(v, dict)}
    ended = cell.get("status") in ("succeeded", "failed")
    result = (read_json_quietly(result_json(record["data_dir"], record["run"], name)) or {}) if ended else {}
    gpus = _gpu_list((views.get(name) or {}).get("gpus"))
    retries = {c.name: c.retries for c in spec.cells} if spec is not None else {}
    sync_error = result.get("sync_error") or result.get("sync_reason")
    cell.update(
        gpus=gpus if gpus is not None else _gpu_list(result.get("gpus")),
        sync_error=str(sync_error) if sync_error else None,
        retries=retries.get(name, 0),
        alive=name in living,
        started=ended or (views.get(name) or {}).get("state") == "started",
        duration_s=None,
        elapsed_s=None,
    )
    if name in living and not ended:
        cell["attempts"] = living[name]
    begun, finished = _cells.parse_utc(result.get("started_at")), _cells.parse_utc(result.get("ended_at"))
    if begun is not None and finished is not None and finished > begun:
        cell["duration_s"] = finished - begun
    return cell


def scan_run(
    data_dir: str, run: str, scanning: Mapping[str, Any], *, write: bool, now: float, living: Mapping[str, Any]
) -> Dict[str, Any]:
    """One run: registration, liveness, cells with their logs' signatures and progress, the monitor's tail."""
    # Imported here, in the runs probe's child: the module's own import stays light.
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach  # noqa: PLC0415
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, cell_facts  # noqa: PLC0415
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import load_spec  # noqa: PLC0415

    disk = OnDisk(data_dir, run)
    view: Dict[str, Any] = {"run": run, "problem": disk.problem, "started_at": disk.record.get("started_at")}
    if disk.registered is None:
        return view
    try:
        spec = load_spec(disk.run_dir)
    except (OSError, ValueError):
        spec = None  # run.json's cells stand in: only "declares artifacts" is then assumed
    record = dict(disk.record, data_dir=data_dir, run=run)
    alive_cells = living.get(os.path.normpath(disk.run_dir), {})
    cells = cell_facts(spec, data_dir, run, disk)
    for cell in cells:
        _scan_cell_log(data_dir, run, cell, scanning, write=write, now=now)
        _cell_view(cell, record, alive_cells, spec, disk.registered.started_at)
        if cell["alive"] or cell["status"] == "running":
            begun = _cells.log_started(cell_log(data_dir, run, cell["name"])) or disk.registered.started_at
            cell["elapsed_s"] = max(0.0, now - begun) if begun is not None else None
    idle = [c["log_idle_s"] for c in cells if c.get("log_idle_s") is not None]
    gpus = _gpu_list(disk.record.get("gpus"))
    view.update(
        started_at_s=disk.registered.started_at,
        runner_alive=disk.live,
        alive=len(detach.run_members(disk.registered)) if disk.live else len(alive_cells),
        done_marker=disk.done,
        durable_dir=disk.record.get("durable_dir") if isinstance(disk.record.get("durable_dir"), str) else None,
        cells=cells,
        cells_total=len(cells),
        gpus=gpus or None,
        slots=spec.slots() if spec is not None else _slots(gpus, disk.record.get("gpus_per_cell")),
        log_idle_s=min(idle) if idle else None,
        monitor_samples=_monitor_tail(monitor_jsonl(data_dir, run), now - scanning["stall_after_s"]),
    )
    return view


def _add_curves(data_dir: str, runs: List[Dict[str, Any]], living: Mapping[str, Any]) -> None:
    """``monitor_series`` for the runs with a live cell, then the newest: at most MAX_CURVE_RUNS, so a box with a
    hundred finished runs costs no more than one with a few (the others get null)."""

    def rank(view: Dict[str, Any]) -> Tuple[bool, str]:
        live = bool(living.get(os.path.normpath(run_dir(data_dir, view["run"]))))
        started = view.get("started_at")
        return live, started if isinstance(started, str) else ""

    chosen = {id(view) for view in sorted(runs, key=rank, reverse=True)[:MAX_CURVE_RUNS]}
    for view in runs:
        view["monitor_series"] = _series_quietly(monitor_jsonl(data_dir, view["run"])) if id(view) in chosen else None


def _series_quietly(path: str) -> Optional[Dict[str, Any]]:
    """The run's monitor curves (rotated file first); a read failing midway costs the curves, not the run."""
    try:
        return monitor_series([f"{path}.1", path])
    except OSError:
        return None


def _slots(gpus: Optional[List[int]], per_cell: Any) -> int:
    if not gpus or not isinstance(per_cell, int) or isinstance(per_cell, bool) or per_cell < 1:
        return 1
    return max(1, len(gpus) // per_cell)


def scan_runs(data_dir: str, only: Optional[str], scanning: Mapping[str, Any], write: bool) -> Dict[str, Any]:
    """Every run's view; runs in a forked child, so ``scanning`` (compiled patterns) is inherited, not pickled."""
    chosen = select_runs(data_dir, only)
    now = time.time()
    # Half the round's deadline for full reads: cells scanned after it read only their tails' worth, so a first tick
    # over many long logs still answers in time (their cursors catch up over the next ticks).
    scanning = dict(scanning, scan_until=time.monotonic() + scanning["timeout_s"] / 2)
    living = _cells.live_cells(os.path.normpath(run_dir(data_dir, name)) for name in chosen["names"])
    runs = [scan_run(data_dir, name, scanning, write=write, now=now, living=living) for name in chosen["names"]]
    _add_curves(data_dir, runs, living)
    notes = list(scanning["notes"])
    if chosen["skipped"]:
        notes.append(f"{chosen['skipped']} finished runs not patrolled (over {MAX_RUNS} runs on the box)")
    return dict(chosen, runs=runs, notes=notes)


def _usage(name: str, path: str, answer: Dict[str, Any]) -> Dict[str, Any]:
    if answer.get("timed_out"):
        error = "did not answer the usage probe within the deadline (a hung mount?)"
    elif "error" in answer:
        error = f"usage probe failed: {answer['error']}"
    else:
        error = answer["value"].get("error")
    value = answer.get("value") or {}
    usage = {"name": name, "path": path, "error": error}
    for key in ("bytes_used_pct", "inodes_used_pct", "bytes_free", "inodes_free"):
        usage[key] = finite(value.get(key))
    return usage


def _xids(runs: Sequence[Dict[str, Any]], gpus: Sequence[Dict[str, Any]], timeout_s: float) -> Tuple[List, List]:
    """Kernel-log findings since the newest patrolled run started, and notes on a log that could not be read."""
    starts = [r["started_at_s"] for r in runs if finite(r.get("started_at_s")) is not None]
    if not starts:
        return [], []
    # Imported only when there is a run to read the kernel log for.
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import subprocess_runner  # noqa: PLC0415
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _kernel_log, _xid  # noqa: PLC0415
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid_findings import xid_findings  # noqa: PLC0415

    log = _kernel_log.read_kernel_log(subprocess_runner, timeout_s)
    unreadable = _kernel_log.kernel_log_finding(log)
    if unreadable is not None:
        return [], [unreadable["message"]]
    bus_ids = {g["index"]: g["pci_bus_id"] for g in gpus if g.get("pci_bus_id")}
    since = datetime.fromtimestamp(max(starts), tz=timezone.utc)
    found = xid_findings(_xid.parse_kernel_log(log["lines"]), bus_ids, since=since, boot_time=_kernel_log.boot_time())
    return [{k: f.get(k) for k in ("code", "level", "message", "action", "gpu", "pci", "xid")} for f in found], []


def patrol(params: Mapping[str, Any], scanning: Dict[str, Any], check_mode: bool) -> Dict[str, Any]:
    """The box's patrol facts (see the module's RETURN); PatrolError when ``run`` names a run not on the box."""
    data_dir, timeout_s = params["data_dir"], params["timeout_s"]
    venv = params.get("venv") or os.path.join(data_dir, ".remote_gpu_trainer", "venv")
    scanning = dict(scanning, notes=[], stall_after_s=params["stall_after_s"], timeout_s=timeout_s)
    now = time.time()
    first = run_with_deadline(
        {
            "runs": functools.partial(scan_runs, data_dir, params["run"], scanning, not check_mode),
            "gpu": functools.partial(read_gpus, params["gpu_backend"], timeout_s, venv),
            "disk": functools.partial(read_usage, data_dir),
            # Every run on the box, whatever ``run`` patrols; the tick file is written like the cursors.
            "box": functools.partial(box_probe, data_dir, not check_mode, now),
        },
        timeout_s,
    )
    probe_errors: Dict[str, str] = {}
    scanned = first["runs"].get("value") or {"runs": [], "problem": None, "notes": [], "skipped": 0, "archived": 0}
    if "value" not in first["runs"]:
        why = "timed out" if first["runs"].get("timed_out") else first["runs"].get("error")
        probe_errors["runs"] = (
            f"runs: reading {data_dir}/runs did not finish within {timeout_s:g} s ({why}; a hung mount?)"
        )
    elif scanned["problem"]:
        probe_errors["runs"] = f"runs: {scanned['problem']}"
    elif scanned.get("missing"):
        raise PatrolError(scanned["missing"])
    runs = scanned["runs"]
    hung = f"the GPU probe did not answer within {timeout_s:g} s (hung driver, or the venv {venv} on a hung mount?)"
    gpu = first["gpu"].get("value") or {"backend": None, "gpus": [], "lost": [], "error": first["gpu"].get("error")}
    gpu["error"] = gpu["error"] or (hung if first["gpu"].get("timed_out") else None)
    disks = [_usage("data", data_dir, first["disk"])]
    named = {run["durable_dir"] for run in runs if run.get("durable_dir")}
    durable = sorted({params["durable_dir"]} if params["durable_dir"] else named)
    if durable:
        answers = run_with_deadline({path: functools.partial(read_usage, path) for path in durable}, timeout_s)
        disks += [_usage("durable", path, answers[path]) for path in durable]
    box, autostop, box_notes = whole_box(first["box"], data_dir, timeout_s, now, [run["run"] for run in runs])
    notes = list(scanned["notes"]) + box_notes
    xids: List[Dict[str, Any]] = []
    if params["kernel_log"]:
        xids, unread = _xids(runs, gpu["gpus"], timeout_s)
        notes += unread
    if gpu["error"]:
        notes.append(f"GPU reading: {gpu['error']}")
    options = {key: params[key] for key in ("stall_after_s", "gpu_idle_pct", "gpu_idle_samples", "disk_pressure_pct")}
    found = xids + lost_findings(gpu["lost"], gpu["backend"])
    verdict = decide_box(runs, disks=disks, xids=found, probe_errors=probe_errors, notes=notes, options=options)
    facts = box_facts(verdict.as_dict(), runs, disks, gpu, xids)
    facts.update(
        examined_runs=[run["run"] for run in runs],
        runs_skipped=scanned.get("skipped") or 0,
        runs_archived=scanned.get("archived") or 0,
        run_filter=params["run"] or None,
        box=box,
        autostop=autostop,
    )
    return facts
