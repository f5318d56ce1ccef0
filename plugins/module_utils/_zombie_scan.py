# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One vram_zombies pass: read the box, decide, and (when asked and safe) reap and verify."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any, Dict, List, Sequence

from ansible_collections.remote_gpu.trainer.plugins.module_utils import _procs
from ansible_collections.remote_gpu.trainer.plugins.module_utils._findings import finding
from ansible_collections.remote_gpu.trainer.plugins.module_utils._gpu_nvml import read_gpu_view
from ansible_collections.remote_gpu.trainer.plugins.module_utils._proctree import Proc, run_is_live, same_process
from ansible_collections.remote_gpu.trainer.plugins.module_utils._runs import Run, read_run_registry
from ansible_collections.remote_gpu.trainer.plugins.module_utils._vram_zombies import Policy, Verdict, decide

try:
    import pynvml
except ImportError:  # optional: without NVML, decisions rest on /proc evidence only
    pynvml = None


def _holder_entry(verdict: Verdict, now: float) -> Dict[str, Any]:
    proc = verdict.proc
    return {
        "pid": proc.pid,
        "ppid": proc.ppid,
        "pgid": proc.pgid,
        "sid": proc.sid,
        "name": proc.name,
        "cmdline": proc.command,
        "age_s": int(now - proc.create_time),
        "orphaned": verdict.orphaned,
        "protected": verdict.protected_by is not None,
        "protected_by": verdict.protected_by,
        "devices": list(proc.devices),
        "gpus": verdict.gpus,
        "candidate": verdict.candidate,
        "rules": verdict.rules,
        "reason": verdict.reason,
    }


def _memory_used(gpus: Any) -> Dict[int, Any]:
    return {gpu.index: gpu.memory_used_mib for gpu in gpus or []}


def _memory_change(before: Any, after: Any) -> List[Dict[str, Any]]:
    used_after = _memory_used(after)
    return [
        {"index": index, "before_mib": used, "after_mib": used_after.get(index)}
        for index, used in _memory_used(before).items()
    ]


def _verify(killed: List[Dict[str, Any]], victims: Dict[int, Any], failed: List[Dict[str, Any]]) -> bool:
    """Move any reaped process that still holds a device (same identity) from killed to failed."""
    table, _stats = _procs.read_process_table()
    still = []
    for entry in killed:
        now = table.get(entry["pid"])
        victim = victims[entry["pid"]]
        if now is not None and now.devices and same_process(victim, now.create_time, now.cmdline):
            still.append(entry)
    for entry in still:
        killed.remove(entry)
        failed.append({"pid": entry["pid"], "name": entry["name"], "error": "still holds a device after the signal"})
    return not still


def _policy(params: Dict[str, Any], patterns: List[Any], subreapers: Sequence[Any], now: float) -> Policy:
    return Policy(
        now=now,
        self_pid=os.getpid(),
        self_uid=os.getuid(),
        min_age_s=params["min_age_s"],
        idle_util_pct=params["idle_util_pct"],
        protect_pids=params["protect_pids"],
        protect_patterns=patterns,
        all_users=params["all_users"],
        subreaper_patterns=subreapers,
    )


def _report(
    verdicts: List[Verdict],
    now: float,
    *,
    table: Dict[int, Proc],
    runs: List[Run],
    problems: List[str],
    scan: Dict[str, int],
    gpus: Any,
    nvml_error: Any,
) -> Dict[str, Any]:
    """The result of a report-only pass: every holder's verdict, NVML's view and the run registry as read."""
    entries = [_holder_entry(verdict, now) for verdict in verdicts]
    candidates = [entry for entry in entries if entry["candidate"]]
    return {
        "changed": False,
        "holders": entries,
        "candidates": candidates,
        "would_kill": [],
        "killed": [],
        "failed": [],
        "skipped": [],
        "kill_refused": None,
        "verification": None,
        "nvml": [asdict(gpu) for gpu in gpus] if gpus is not None else None,
        "nvml_error": nvml_error,
        "runs": [
            {"run": run.name, "path": run.path, "pgid": run.pgid, "sid": run.sid, "live": run_is_live(run, table)}
            for run in runs
        ],
        "registry_problems": problems,
        "scan": scan,
        "status": "candidates" if candidates else "clean",
    }


def _approve_kill(result: Dict[str, Any], victims: Dict[int, Proc], problems: List[str]) -> None:
    """Name the victims, unless an unreadable registry means a live run could be among them."""
    if problems:
        result["kill_refused"] = (
            "the run registry could not be read, so live runs cannot be told from zombies: nothing was signalled. "
            "Fix or remove: " + "; ".join(problems)
        )
    else:
        result["would_kill"] = sorted(victims)
        result["changed"] = True


def _reap_and_verify(result: Dict[str, Any], victims: Dict[int, Proc], gpus: Any, grace_s: float) -> None:
    outcome = _procs.reap([victims[pid] for pid in result["would_kill"]], grace_s)
    result.update(outcome)
    result["changed"] = bool(outcome["killed"] or outcome["failed"])
    if result["changed"]:
        holders_gone = _verify(result["killed"], victims, result["failed"])
        after, _error = read_gpu_view(pynvml, 0, _procs.psutil.pid_exists)
        result["verification"] = {
            "holders_gone": holders_gone,
            "memory_used_mib": _memory_change(gpus, after),
        }
    # Every candidate skipped (gone, or its PID reused) means nothing was reaped: they stay candidates.
    if result["failed"]:
        result["status"] = "partial"
    elif result["killed"]:
        result["status"] = "reaped"


def _zombie_findings(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One WARN naming the candidates still alive, if any are."""
    if result["status"] not in ("candidates", "partial"):
        return []
    killed = {entry["pid"] for entry in result["killed"]}
    remaining = [entry for entry in result["candidates"] if entry["pid"] not in killed]
    listed = ", ".join(f"pid {entry['pid']} ({entry['name']}: {entry['reason']})" for entry in remaining[:5])
    return [
        finding(
            "vram_zombies",
            "WARN",
            f"{len(remaining)} process(es) hold an NVIDIA device after their job died: {listed}",
            "reap_zombies",
            pids=[entry["pid"] for entry in remaining],
        )
    ]


def scan_and_reap(
    params: Dict[str, Any], patterns: List[Any], check_mode: bool, subreapers: Sequence[Any] = ()
) -> Dict[str, Any]:
    table, scan = _procs.read_process_table()
    runs, problems = read_run_registry(params["data_dir"])
    gpus, nvml_error = read_gpu_view(pynvml, params["observe_s"], _procs.psutil.pid_exists)
    now = time.time()
    holders = sorted((proc for proc in table.values() if proc.devices), key=lambda p: p.pid)
    verdicts = decide(holders, table, runs, gpus or [], _policy(params, patterns, subreapers, now))
    result = _report(
        verdicts, now, table=table, runs=runs, problems=problems, scan=scan, gpus=gpus, nvml_error=nvml_error
    )
    victims = {verdict.proc.pid: verdict.proc for verdict in verdicts if verdict.candidate}
    if params["kill"] and victims:
        _approve_kill(result, victims, problems)
    if result["would_kill"] and not check_mode:
        _reap_and_verify(result, victims, gpus, params["grace_s"])
    result["findings"] = _zombie_findings(result)
    return result
