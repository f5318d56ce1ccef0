# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One vram_zombies pass: read the box, decide, and (when asked and safe) reap and verify."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Sequence

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_nvml import read_gpu_view
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run, read_run_registry
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs import _procs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc, run_is_live, same_process
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._vram_zombies import (
    Policy,
    Verdict,
    commands_needed,
    decide,
)

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
    observation: Dict[str, Any],
) -> Dict[str, Any]:
    """The result of a report-only pass: every holder's verdict, NVML's view and the run registry as read."""
    entries = [_holder_entry(verdict, now) for verdict in verdicts]
    candidates = [entry for entry in entries if entry["candidate"]]
    if observation["skipped"]:
        window = f"no NVML observation window ({observation['skipped']})"
    else:
        window = f"GPU utilization sampled for {observation['window_s']:g}s"
    return {
        "msg": f"{len(entries)} holder(s), {len(candidates)} candidate(s); {window}",
        "observation": observation,
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


def _observation(params: Dict[str, Any], unobserved: List[Verdict]) -> Dict[str, Any]:
    """How long to sample GPU utilization: the window only matters when a holder could be a candidate.

    ``unobserved`` were decided without utilization samples. Samples can only spare holders (a busy GPU) or
    add ``gpu_idle`` to a conviction, never make a candidate, so without a candidate here the window would
    change no decision: it is skipped, the normal case before a launch (no holder at all).
    """
    requested = params["observe_s"]
    skipped = None
    if requested <= 0:
        skipped = "observe_s is 0"
    elif not any(verdict.candidate for verdict in unobserved):
        skipped = "no holder could be a candidate, so GPU utilization could change no decision"
    return {"requested_s": requested, "window_s": 0.0 if skipped else requested, "skipped": skipped}


class _Background:
    """``action`` in a thread, so NVML's start (library load, driver handshake) overlaps the /proc scan."""

    def __init__(self, action: Callable[[], Any]) -> None:
        self._outcome: Dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(action,), daemon=True)
        self._thread.start()

    def _run(self, action: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = action()
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._outcome["error"] = exc

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def scan_and_reap(
    params: Dict[str, Any], patterns: List[Any], check_mode: bool, subreapers: Sequence[Any] = ()
) -> Dict[str, Any]:
    # The registry is read in a forked child: fork before any thread runs.
    runs, problems = read_run_registry(params["data_dir"])
    snapshot = _Background(lambda: read_gpu_view(pynvml, 0, _procs.psutil.pid_exists))
    table, scan = _procs.read_process_table()
    holders = [proc for _pid, proc in sorted(table.items()) if proc.devices]
    table = _procs.with_commands(table, commands_needed(holders, table, subreapers))
    holders = [table[proc.pid] for proc in holders]
    gpus, nvml_error = snapshot.result()
    now = time.time()
    # Decided first on NVML's view without utilization samples: whether any holder could be a candidate at all.
    verdicts = decide(holders, table, runs, gpus or [], _policy(params, patterns, subreapers, now))
    observation = _observation(params, verdicts)
    if observation["window_s"]:
        gpus, nvml_error = read_gpu_view(pynvml, observation["window_s"], _procs.psutil.pid_exists)
        now = time.time()  # ages count to the end of the window, as the decision is made then
        verdicts = decide(holders, table, runs, gpus or [], _policy(params, patterns, subreapers, now))
    result = _report(
        verdicts,
        now,
        table=table,
        runs=runs,
        problems=problems,
        scan=scan,
        gpus=gpus,
        nvml_error=nvml_error,
        observation=observation,
    )
    victims = {verdict.proc.pid: verdict.proc for verdict in verdicts if verdict.candidate}
    if params["kill"] and victims:
        _approve_kill(result, victims, problems)
    if result["would_kill"] and not check_mode:
        _reap_and_verify(result, victims, gpus, params["grace_s"])
    result["findings"] = _zombie_findings(result)
    return result
