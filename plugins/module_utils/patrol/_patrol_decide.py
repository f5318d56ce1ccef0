# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The decision table of ``patrol_facts``: what one run's observations and the box's probes mean.

Pure functions over plain dicts (what ``_patrol`` gathered), so every row is a unit test. Each verdict carries
``reasons`` (one line each, for people), ``problems`` (stable ids that stay the same while the condition lasts, for
notifying once) and ``actions`` (the findings vocabulary: re_rent, free_disk, restart_job, investigate).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._cells import (
    finite,
    gpus_idle,
    judge_cell,
    no_space,
    run_eta,
    run_summary,
)

# Worst first: the box reports the worst state among its runs and its own probes.
STATE_ORDER = (
    "unknown", "crashed", "incomplete", "stalled", "runner_gone", "sync_failed", "disk_pressure", "running", "done",
    "idle",
)  # fmt: skip
GPU_KEYS = ("index", "utilization_pct", "memory_used_mib", "memory_total_mib")
RUN_KEYS = (
    "run", "state", "escalate", "reasons", "problems", "actions", "alive", "started_at",
    "cells_done", "cells_total", "progress", "eta_s", "log_idle_s", "current_cell", "summary", "monitor_series",
)  # fmt: skip
CELL_KEYS = (
    "name", "state", "status", "exit_code", "signal", "sync", "sync_error", "done", "attempts", "retries_left",
    "gpus", "alive", "log_bytes", "log_error", "log_idle_s", "silent_gpus_busy", "progress", "progress_fraction",
    "eta_s", "lost", "crash_signatures", "exception", "nan_seen", "loss_series",
)  # fmt: skip
# What explains a run that ended with cells missing (any other signature is only reported).
CRASH_SIGNATURES = (
    "python_traceback",
    "cuda_oom",
    "killed",
    "disk_full",
    "nccl_timeout",
    "nccl_error",
    "cuda_illegal_memory_access",
    "ecc_uncorrectable",
    "segfault",
)
KILLED_SIGNALS = (9,)
KILLED_EXIT_CODES = (137,)


class Verdict:
    """A state with its reasons, problems and actions; ``escalate`` when a human or automation must act."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.escalate = False
        self.reasons: List[str] = []
        self.problems: List[str] = []
        self.actions: List[str] = []

    def add(self, reason: str, problem: Optional[str] = None, action: Optional[str] = None) -> None:
        """A reason; with a ``problem`` id it also escalates."""
        self.reasons.append(reason)
        if problem is not None:
            self.escalate = True
            if problem not in self.problems:
                self.problems.append(problem)
        if action is not None and action not in self.actions:
            self.actions.append(action)

    def worsen(self, state: str) -> None:
        if STATE_ORDER.index(state) < STATE_ORDER.index(self.state):
            self.state = state

    def as_dict(self) -> Dict[str, Any]:
        return {
            "state": self.state,
            "escalate": self.escalate,
            "reasons": list(self.reasons),
            "problems": list(self.problems),
            "actions": list(self.actions),
        }


def _explaining(cells: Sequence[Dict[str, Any]]) -> List[str]:
    """'cell: signature (first line)' for each unfinished cell whose log or exit explains its end."""
    found = []
    for cell in cells:
        if cell.get("done") or cell.get("state") == "sync_failed":
            continue
        names = [s["signature"] for s in cell.get("crash_signatures") or [] if s.get("signature") in CRASH_SIGNATURES]
        if names:
            first = next(s for s in cell["crash_signatures"] if s["signature"] == names[0])
            found.append(f"{cell['name']}: {names[0]} ({first.get('first_line') or ''})")
    return found


def gpu_idle(samples: Sequence[Dict[str, Any]], idle_pct: float, needed: int) -> bool:
    """Whether the newest ``needed`` monitor samples all saw every GPU at or below ``idle_pct`` utilization."""
    return gpus_idle(samples, None, idle_pct, needed)


def _signature(cell: Dict[str, Any], name: str) -> Optional[Dict[str, Any]]:
    return next((s for s in cell.get("crash_signatures") or [] if s.get("signature") == name), None)


def _judge_cells(run: Dict[str, Any], options: Dict[str, Any]) -> List[Dict[str, Any]]:
    cells = run.get("cells") or []
    for cell in cells:
        judge_cell(cell, run, options, CRASH_SIGNATURES)
    run["cells_done"] = sum(1 for cell in cells if cell.get("done"))
    run["eta_s"] = run_eta(cells, run.get("slots") or 1, bool(run.get("runner_alive")))
    live = [c for c in cells if c.get("state") in ("running", "stalled")]
    shown = live or [c for c in cells if c.get("state") == "done"][-1:]
    run["current_cell"] = shown[0]["name"] if shown else None
    run["progress"] = shown[0].get("progress") if shown else None
    return cells


def _cell_problems(name: str, cells: Sequence[Dict[str, Any]], going: bool, verdict: Verdict) -> None:
    """What each cell says on its own: stalls, failures in a run that goes on, a full disk, NaN, a lost log, a
    failed sync; each escalates under ``<kind>:<run>/<cell>``."""
    for cell in cells:
        where, state = f"{name}/{cell['name']}", cell.get("state")
        if state == "stalled":
            verdict.add(f"{name}/{cell['stall_reason']}", f"stalled:{where}", "investigate")
        elif cell.get("silent_gpus_busy"):
            verdict.add(f"{where}: silent, GPUs busy (its log has not grown for {cell['log_idle_s']:.0f} s)")
        if state == "failed" and going:
            left = cell.get("retries_left") or 0
            why = f": {cell['exception']}" if cell.get("exception") else ""
            attempts = cell.get("attempts") or 1
            verdict.add(
                f"{where}: failed ({_ending(cell)}) after {attempts} attempt{'s' if attempts != 1 else ''}, "
                f"{left} retr{'ies' if left != 1 else 'y'} left{why}; the run goes on with its other cells",
                f"cell_failed:{where}",
                "investigate",
            )
        elif state == "running" and (cell.get("attempts") or 1) > 1 and cell.get("exception"):
            verdict.add(f"{where}: attempt {cell['attempts']} runs after a failure ({cell['exception']})")
        full = _signature(cell, "disk_full")
        if full is not None and not cell.get("done") and state != "pending":
            verdict.add(f"{where}: disk full ({full.get('first_line') or ''})", f"disk_full:{where}", "free_disk")
        nan = _signature(cell, "nan_loss")
        if nan is not None:
            verdict.add(f"{where}: NaN or Inf loss ({nan.get('first_line') or ''})", f"nan_loss:{where}", "investigate")
        if cell.get("lost"):
            verdict.add(f"{where}: {cell['lost']}; what it said before is kept", f"log_lost:{where}", "investigate")
        if state == "sync_failed":
            error = cell.get("sync_error") or cell.get("reason") or f"sync {cell.get('sync')}"
            action = "free_disk" if no_space(error) else "investigate"
            verdict.add(f"{where}: exited 0 but its sync failed: {error}", f"sync_failed:{where}", action)


def decide_run(run: Dict[str, Any], options: Dict[str, Any]) -> Verdict:
    """One run's row of the table (see the module's documentation for the table itself)."""
    name = run["run"]
    if run.get("problem"):
        verdict = Verdict("unknown")
        verdict.add(f"{name}: {run['problem']}", f"unreadable:{name}", "investigate")
        return verdict
    cells = _judge_cells(run, options)
    running = [c for c in cells if c.get("state") in ("running", "stalled")]
    if run.get("runner_alive"):
        verdict = Verdict("stalled" if any(c["state"] == "stalled" for c in running) else "running")
        _cell_problems(name, cells, True, verdict)
        return verdict
    if running:  # the runner is gone, yet cells of it still run: a relaunch would stop them
        verdict = Verdict("runner_gone")
        if any(c["state"] == "stalled" for c in running):
            verdict.worsen("stalled")
        idle = [c.get("log_idle_s") for c in running if c.get("log_idle_s") is not None]
        grew = f" (a log grew {min(idle):.0f} s ago)" if idle else ""
        verdict.add(
            f"{name}: the runner is gone but cell{'s' if len(running) > 1 else ''} "
            f"{', '.join(c['name'] for c in running[:5])} still run{'' if len(running) > 1 else 's'}{grew}: "
            "let it finish, or stop it (a relaunch stops them)",
            f"runner_gone:{name}",
            "investigate",
        )
        _cell_problems(name, cells, True, verdict)
        return verdict
    if run.get("done_marker") and cells and all(c.get("done") for c in cells):
        verdict = Verdict("done")
        _cell_problems(name, cells, False, verdict)  # NaN seen stays flagged on a run that ended DONE
        return verdict
    missing = [c["name"] for c in cells if not c.get("done") and c.get("state") != "sync_failed"]
    if not missing and any(c.get("state") == "sync_failed" for c in cells):
        verdict = Verdict("sync_failed")
        _cell_problems(name, cells, False, verdict)
        return verdict
    explained = _explaining(cells)
    verdict = Verdict("crashed" if explained else "incomplete")
    what = f"{name}: the runner is gone with {len(missing)} of {len(cells)} cells not done ({', '.join(missing[:5])})"
    verdict.add(what, f"{verdict.state}:{name}", "restart_job")
    for line in explained[:5]:
        verdict.add(f"{name}/{line}")
    _cell_problems(name, cells, False, verdict)
    return verdict


def _ending(cell: Dict[str, Any]) -> str:
    if cell.get("signal") is not None:
        return f"signal {cell['signal']}"
    return f"exit {cell.get('exit_code')}"


def decide_disks(disks: Sequence[Dict[str, Any]], pressure_pct: float, verdict: Verdict) -> None:
    """Bytes or inodes at or over ``pressure_pct`` on the data or durable filesystem; a probe that hung."""
    for disk in disks:
        name, path = disk["name"], disk["path"]
        if disk.get("error"):
            verdict.add(f"{name} dir {path}: {disk['error']}", f"probe_failed:{name}", "investigate")
            continue
        for what, key in (("bytes", "bytes_used_pct"), ("inodes", "inodes_used_pct")):
            used = finite(disk.get(key))
            if used is not None and used >= pressure_pct:
                verdict.worsen("disk_pressure")
                verdict.add(
                    f"{name} dir {path}: {what} {used:g}% used (threshold {pressure_pct:g}%)",
                    f"disk_pressure:{name}",
                    "free_disk",
                )


def decide_xids(xids: Sequence[Dict[str, Any]], verdict: Verdict) -> None:
    """The kernel log's findings since the run started: FAIL escalates with its action, WARN is a reason."""
    for found in xids:
        if found.get("level") == "FAIL":
            where = found.get("gpu") if found.get("gpu") is not None else found.get("pci")
            verdict.add(found["message"], f"{found['code']}:{where}", found.get("action") or "investigate")
        else:
            verdict.add(found["message"])


def decide_box(
    runs: Sequence[Dict[str, Any]],
    *,
    disks: Sequence[Dict[str, Any]],
    xids: Sequence[Dict[str, Any]],
    probe_errors: Dict[str, str],
    notes: Sequence[str],
    options: Dict[str, Any],
) -> Verdict:
    """The box's verdict: the worst run's state, then disks, Xids and probes that failed (``probe_errors``: probe
    name -> why; each escalates), with ``notes`` (readings that failed without needing a human) as reasons."""
    box = Verdict("idle")
    for run in runs:
        verdict = decide_run(run, options)
        run.update(verdict.as_dict())
        box.worsen(verdict.state)
        for reason in verdict.reasons:
            box.add(reason)
        box.escalate = box.escalate or verdict.escalate
        box.problems += [p for p in verdict.problems if p not in box.problems]
        box.actions += [a for a in verdict.actions if a not in box.actions]
    decide_disks(disks, options["disk_pressure_pct"], box)
    decide_xids(xids, box)
    for probe, error in sorted(probe_errors.items()):
        box.worsen("unknown")
        box.add(error, f"probe_failed:{probe}", "investigate")
    for note in notes:
        box.add(note)
    return box


def _attention(run: Dict[str, Any]) -> str:
    """What a run that needs attention has: its state, or its first problem where the state says all is well."""
    if run.get("state") in ("running", "done") and run.get("problems"):
        return run["problems"][0].split(":", 1)[0]
    return str(run.get("state"))


def headline(box: Dict[str, Any], runs: Sequence[Dict[str, Any]], main: Optional[Dict[str, Any]]):
    """The box's one line and the run it names (None when it names several or none): the run the box's state
    comes from, counting that run's cells, or how many runs need attention."""
    attention = [run for run in runs if run.get("escalate")]
    if len(attention) > 1:
        listed = ", ".join(f"{run['run']} {_attention(run)}" for run in attention[:4])
        return f"{len(attention)} runs need attention: {listed}{', ...' if len(attention) > 4 else ''}", None
    target = attention[0] if attention else None
    if target is None and box.get("escalate"):  # the box's own trouble: a disk, an Xid, a probe
        return f"{box['state'].upper()}: {box['reasons'][0] if box.get('reasons') else 'escalated'}", None
    if target is None:
        target = next((run for run in runs if run.get("state") == box.get("state")), main)
    if target is None:
        return "IDLE: no run on this box", None
    line = f"{str(target.get('state')).upper()} run {target['run']}: "
    line += f"{target.get('cells_done') or 0}/{target.get('cells_total') or 0} cells done"
    if target.get("escalate") and target.get("state") in ("running", "done") and target.get("problems"):
        line += f" ({target['problems'][0]})"
    return line, target


def _main_run(runs: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The run the box's plain keys describe: the newest live run, else the newest run."""
    live = [r for r in runs if r.get("alive")]
    ordered = sorted(live or runs, key=lambda r: finite(r.get("started_at_s")) or 0.0)
    return ordered[-1] if ordered else None


def box_facts(
    verdict: Dict[str, Any], runs: List[Dict[str, Any]], disks: List[Dict[str, Any]], gpu: Dict[str, Any], xids: List
) -> Dict[str, Any]:
    """The module's facts from the box's verdict and what the probes read (see the module's RETURN)."""
    main = _main_run(runs)
    fullest = max(disks, key=lambda d: max(d.get("bytes_used_pct") or 0.0, d.get("inodes_used_pct") or 0.0))
    samples = [s for r in runs for s in r.get("monitor_samples") or []]
    peaks = [s["memory_current"] for s in samples if s.get("memory_current") is not None]
    limits = [s["memory_max"] for s in samples if s.get("memory_max") is not None]
    signatures: Dict[str, Dict[str, Any]] = {}
    for run in runs:
        run["summary"] = run_summary(run) if not run.get("problem") else f"{run['run']}: {run.get('state')}"
        for cell in run.get("cells") or []:
            for found in cell.get("crash_signatures") or []:
                merged = signatures.setdefault(found["signature"], dict(found, count=0))
                merged["count"] += found["count"]
    line, named = headline(verdict, runs, main)
    facts = dict(
        verdict,
        run=main["run"] if main else None,
        headline=line,
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
    facts["msg"] = _message(facts, named, line)
    return facts


def _run_detail(run: Dict[str, Any]) -> Dict[str, Any]:
    detail = {key: run.get(key) for key in RUN_KEYS}
    detail["cells"] = [{key: cell.get(key) for key in CELL_KEYS} for cell in run.get("cells") or []]
    return detail


def _message(facts: Dict[str, Any], named: Optional[Dict[str, Any]], line: str) -> str:
    """``<state>``: the run the state comes from with its own cells (or the headline), then the first reason."""
    reason = f"; {facts['reasons'][0]}" if facts["reasons"] else ""
    if named is not None:
        cells = f"{named.get('cells_done') or 0}/{named.get('cells_total') or 0} cells done"
        return f"{facts['state']}: run {named['run']}, {cells}{reason}"
    return f"{facts['state']}: {line if facts['runs'] else 'no run on this box'}{reason}"
