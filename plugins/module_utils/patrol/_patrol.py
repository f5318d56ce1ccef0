# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What ``patrol_facts`` gathers on one box in one call, every probe under a deadline.

Three rounds of forked probes (``_deadline.run_with_deadline``), so a hung network mount or a hung driver costs a
reason, never the patrol: the run directories (run.json, results, each cell log's new bytes, monitor.jsonl's
tail), the GPUs (NVML, else nvidia-smi) and the data directory's usage together; then the durable directories the
runs name; then the kernel log (dmesg / journalctl, with their own timeout) for Xids since the run started. Only
the cell-log cursors under ``<run>/.patrol/`` are written, and nothing in check mode.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._disk import read_usage
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import subprocess_runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _kernel_log, _xid
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid_findings import xid_findings
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._run_state import OnDisk, cell_facts
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    NAME_PATTERN,
    cell_log,
    monitor_jsonl,
    patrol_dir,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import load_spec, runner_log
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    load_cursor,
    save_cursor,
    scan_log,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import (
    KILLED_EXIT_CODES,
    KILLED_SIGNALS,
    decide_box,
    finite,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_gpus import lost_findings, read_gpus

MAX_RUNS = 100
BEHIND_SCAN_BYTES = 64 * 1024
GPU_KEYS = ("index", "utilization_pct", "memory_used_mib", "memory_total_mib")
RUN_KEYS = (
    "run", "state", "escalate", "reasons", "problems", "actions", "alive", "started_at",
    "cells_done", "cells_total", "progress", "eta_s", "log_idle_s", "current_cell",
)  # fmt: skip
CELL_KEYS = (
    "name", "status", "exit_code", "signal", "sync", "done", "log_bytes", "log_error", "crash_signatures", "progress",
)  # fmt: skip
MONITOR_TAIL_BYTES = 256 * 1024
MONITOR_SAMPLES = 20


def list_runs(data_dir: str, only: Optional[str]) -> Tuple[List[str], Optional[str]]:
    """The runs to patrol (directories holding a run.json), and a problem when ``runs/`` cannot be listed."""
    runs_dir = os.path.join(data_dir, "runs")
    if only:
        return ([only] if _registered(runs_dir, only) else []), None
    try:
        names = sorted(entry.name for entry in os.scandir(runs_dir) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        return [], f"{runs_dir} cannot be listed: {exc.strerror or exc}"
    return [name for name in names if NAME_PATTERN.match(name) and _registered(runs_dir, name)], None


def _registered(runs_dir: str, name: str) -> bool:
    return os.path.exists(os.path.join(runs_dir, name, "run.json"))


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
    return {
        "t": finite(sample.get("t")),
        "memory_current": finite(cgroup.get("memory_current")),
        "memory_max": finite(cgroup.get("memory_max")),
        "gpus": [{"util_pct": finite(g.get("util_pct"))} for g in gpus if isinstance(g, dict)] if gpus else None,
    }


def _current_cell(cells: Sequence[Dict[str, Any]]) -> Optional[str]:
    """run-layout.md: the first cell in queue order without a succeeded result, else the last cell."""
    for cell in cells:
        if cell.get("status") != "succeeded":
            return cell["name"]
    return cells[-1]["name"] if cells else None


def _scan_cell_log(data_dir: str, run: str, cell: Dict[str, Any], scanning: Mapping[str, Any], write: bool) -> None:
    cursor_path = os.path.join(patrol_dir(data_dir, run), f"{cell['name']}.json")
    scan, cursor = scan_log(
        cell_log(data_dir, run, cell["name"]),
        load_cursor(cursor_path),
        scanning["signatures"],
        scanning["progress"],
        max_bytes=scanning["max_bytes"] if time.monotonic() < scanning["scan_until"] else BEHIND_SCAN_BYTES,
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
    cell.update(
        log_bytes=scan.get("size"),
        log_error=scan.get("error"),
        crash_signatures=signatures,
        progress=scan.get("progress"),
        last_growth=finite(scan.get("last_growth")),
    )


def _eta(run: Dict[str, Any], now: float) -> Optional[int]:
    """Seconds left from the progress totals and the time the run has taken so far; None without totals."""
    progress, cells = run.get("progress") or {}, run.get("cells") or []
    epoch, epochs = progress.get("epoch"), progress.get("epochs_total")
    step, steps = progress.get("step"), progress.get("steps_total")
    fraction = None
    if epochs and epoch is not None:
        within = step / steps if steps and step is not None else 0.0
        fraction = (max(epoch - 1, 0) + min(within, 1.0)) / epochs
    elif steps and step is not None:
        fraction = step / steps
    started = finite(run.get("started_at_s"))
    if fraction is None or not cells or started is None:
        return None
    pending = [c for c in cells if not c.get("done") and c.get("status") in ("running", "pending")]
    finished = len(cells) - len(pending)
    overall = (finished + min(max(fraction, 0.0), 1.0)) / len(cells)
    if overall <= 0.0 or now <= started:
        return None
    return int((now - started) * (1.0 - overall) / overall)


def scan_run(data_dir: str, run: str, scanning: Mapping[str, Any], write: bool, now: float) -> Dict[str, Any]:
    """One run: registration, liveness, cells with their logs' signatures and progress, the monitor's tail."""
    disk = OnDisk(data_dir, run)
    view: Dict[str, Any] = {"run": run, "problem": disk.problem, "started_at": disk.record.get("started_at")}
    if disk.registered is None:
        return view
    try:
        spec = load_spec(disk.run_dir)
    except (OSError, ValueError):
        spec = None  # run.json's cells stand in: only "declares artifacts" is then assumed
    cells = cell_facts(spec, data_dir, run, disk)
    for cell in cells:
        _scan_cell_log(data_dir, run, cell, scanning, write)
    growth = [c["last_growth"] for c in cells if c.get("last_growth") is not None]
    with contextlib.suppress(OSError):
        growth.append(os.stat(runner_log(disk.run_dir)).st_mtime)
    current = _current_cell(cells)
    started = disk.registered.started_at
    view.update(
        started_at_s=started,
        alive=len(detach.run_members(disk.registered)) if disk.live else 0,
        done_marker=disk.done,
        durable_dir=disk.record.get("durable_dir") if isinstance(disk.record.get("durable_dir"), str) else None,
        cells=cells,
        cells_done=sum(1 for c in cells if c.get("done")),
        cells_total=len(cells),
        current_cell=current,
        progress=next((c.get("progress") for c in cells if c["name"] == current), None),
        log_idle_s=round(max(0.0, now - max(growth)), 1) if growth else None,
        monitor_samples=_monitor_tail(monitor_jsonl(data_dir, run), now - scanning["stall_after_s"]),
    )
    view["eta_s"] = _eta(view, now) if disk.live else None
    return view


def scan_runs(data_dir: str, only: Optional[str], scanning: Mapping[str, Any], write: bool) -> Dict[str, Any]:
    """Every run's view; runs in a forked child, so ``scanning`` (compiled patterns) is inherited, not pickled."""
    names, problem = list_runs(data_dir, only)
    now = time.time()
    # Half the round's deadline for full reads: cells scanned after it read only their tails' worth, so a first tick
    # over many long logs still answers in time (their cursors catch up over the next ticks).
    scanning = dict(scanning, scan_until=time.monotonic() + scanning["timeout_s"] / 2)
    runs = [scan_run(data_dir, name, scanning, write, now) for name in names[-MAX_RUNS:]]
    notes = list(scanning["notes"])
    if len(names) > MAX_RUNS:
        notes.append(f"{len(names)} runs on the box: only the last {MAX_RUNS} by name were patrolled")
    return {"runs": runs, "problem": problem, "notes": notes}


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
    log = _kernel_log.read_kernel_log(subprocess_runner, timeout_s)
    unreadable = _kernel_log.kernel_log_finding(log)
    if unreadable is not None:
        return [], [unreadable["message"]]
    bus_ids = {g["index"]: g["pci_bus_id"] for g in gpus if g.get("pci_bus_id")}
    since = datetime.fromtimestamp(max(starts), tz=timezone.utc)
    found = xid_findings(_xid.parse_kernel_log(log["lines"]), bus_ids, since=since, boot_time=_kernel_log.boot_time())
    return [{k: f.get(k) for k in ("code", "level", "message", "action", "gpu", "pci", "xid")} for f in found], []


def _summary(runs: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The run the box's plain keys describe: the newest live run, else the newest run."""
    live = [r for r in runs if r.get("alive")]
    ordered = sorted(live or runs, key=lambda r: finite(r.get("started_at_s")) or 0.0)
    return ordered[-1] if ordered else None


def patrol(params: Mapping[str, Any], scanning: Dict[str, Any], check_mode: bool) -> Dict[str, Any]:
    """The box's patrol facts (see the module's RETURN)."""
    data_dir, timeout_s = params["data_dir"], params["timeout_s"]
    scanning = dict(scanning, notes=[], stall_after_s=params["stall_after_s"], timeout_s=timeout_s)
    first = run_with_deadline(
        {
            "runs": functools.partial(scan_runs, data_dir, params["run"], scanning, not check_mode),
            "gpu": functools.partial(read_gpus, params["gpu_backend"], timeout_s),
            "disk": functools.partial(read_usage, data_dir),
        },
        timeout_s,
    )
    probe_errors: Dict[str, str] = {}
    scanned = first["runs"].get("value") or {"runs": [], "problem": None, "notes": []}
    if "value" not in first["runs"]:
        why = "timed out" if first["runs"].get("timed_out") else first["runs"].get("error")
        probe_errors["runs"] = (
            f"runs: reading {data_dir}/runs did not finish within {timeout_s:g} s ({why}; a hung mount?)"
        )
    elif scanned["problem"]:
        probe_errors["runs"] = f"runs: {scanned['problem']}"
    runs = scanned["runs"]
    gpu = first["gpu"].get("value") or {"backend": None, "gpus": [], "lost": [], "error": "the GPU probe hung"}
    disks = [_usage("data", data_dir, first["disk"])]
    named = {run["durable_dir"] for run in runs if run.get("durable_dir")}
    durable = sorted({params["durable_dir"]} if params["durable_dir"] else named)
    if durable:
        answers = run_with_deadline({path: functools.partial(read_usage, path) for path in durable}, timeout_s)
        disks += [_usage("durable", path, answers[path]) for path in durable]
    notes = list(scanned["notes"])
    xids: List[Dict[str, Any]] = []
    if params["kernel_log"]:
        xids, unread = _xids(runs, gpu["gpus"], timeout_s)
        notes += unread
    if gpu["error"]:
        notes.append(f"GPU reading: {gpu['error']}")
    options = {key: params[key] for key in ("stall_after_s", "gpu_idle_pct", "gpu_idle_samples", "disk_pressure_pct")}
    found = xids + lost_findings(gpu["lost"], gpu["backend"])
    verdict = decide_box(runs, disks=disks, xids=found, probe_errors=probe_errors, notes=notes, options=options)
    return _result(verdict.as_dict(), runs, disks, gpu, xids)


def _result(
    verdict: Dict[str, Any], runs: List[Dict[str, Any]], disks: List[Dict[str, Any]], gpu: Dict[str, Any], xids: List
) -> Dict[str, Any]:
    main = _summary(runs)
    fullest = max(disks, key=lambda d: max(d.get("bytes_used_pct") or 0.0, d.get("inodes_used_pct") or 0.0))
    samples = [s for r in runs for s in r.get("monitor_samples") or []]
    peaks = [s["memory_current"] for s in samples if s.get("memory_current") is not None]
    limits = [s["memory_max"] for s in samples if s.get("memory_max") is not None]
    signatures: Dict[str, Dict[str, Any]] = {}
    for run in runs:
        for cell in run.get("cells") or []:
            for found in cell.get("crash_signatures") or []:
                merged = signatures.setdefault(found["signature"], dict(found, count=0))
                merged["count"] += found["count"]
    facts = dict(
        verdict,
        run=main["run"] if main else None,
        alive=sum(r.get("alive") or 0 for r in runs),
        cells_done=sum(r.get("cells_done") or 0 for r in runs),
        cells_total=sum(r.get("cells_total") or 0 for r in runs),
        progress=main.get("progress") if main else None,
        eta_s=main.get("eta_s") if main else None,
        log_idle_s=main.get("log_idle_s") if main else None,
        crash_signatures=list(signatures.values()),
        disk={k: fullest.get(k) for k in ("path", "bytes_used_pct", "inodes_used_pct")},
        disks=disks,
        gpu=[{key: g[key] for key in GPU_KEYS} for g in gpu["gpus"]],
        gpu_backend=gpu["backend"],
        gpu_error=gpu["error"],
        memory={
            "cgroup_current_bytes": int(peaks[-1]) if peaks else None,
            "cgroup_max_bytes": int(limits[-1]) if limits else None,
            "recent_peak_bytes": int(max(peaks)) if peaks else None,
        },
        xids=xids,
        runs=[_run_detail(r) for r in runs],
    )
    facts["msg"] = _message(facts)
    return facts


def _run_detail(run: Dict[str, Any]) -> Dict[str, Any]:
    detail = {key: run.get(key) for key in RUN_KEYS}
    detail["cells"] = [{key: cell.get(key) for key in CELL_KEYS} for cell in run.get("cells") or []]
    return detail


def _message(facts: Dict[str, Any]) -> str:
    if facts["run"] is None:
        return f"{facts['state']}: no run on this box" + (f"; {facts['reasons'][0]}" if facts["reasons"] else "")
    head = f"{facts['state']}: run {facts['run']}, {facts['cells_done']}/{facts['cells_total']} cells done"
    return head + (f"; {facts['reasons'][0]}" if facts["reasons"] else "")
