# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The decision table of ``patrol_facts``: what one run's observations and the box's probes mean.

Pure functions over plain dicts (what ``_patrol`` gathered), so every row is a unit test. Each verdict carries
``reasons`` (one line each, for people), ``problems`` (stable ids that stay the same while the condition lasts, for
notifying once) and ``actions`` (the findings vocabulary: re_rent, free_disk, restart_job, investigate).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

# Worst first: the box reports the worst state among its runs and its own probes.
STATE_ORDER = ("unknown", "crashed", "incomplete", "stalled", "disk_pressure", "running", "done", "idle")
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


def finite(value: Any) -> Optional[float]:
    """A finite number, or None: the box's files are untrusted (NaN, inf, strings, booleans)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _explaining(cells: Sequence[Dict[str, Any]]) -> List[str]:
    """'cell: signature (first line)' for each unfinished cell whose log or exit explains its end."""
    found = []
    for cell in cells:
        if cell.get("done"):
            continue
        names = [s["signature"] for s in cell.get("crash_signatures") or [] if s.get("signature") in CRASH_SIGNATURES]
        if names:
            first = next(s for s in cell["crash_signatures"] if s["signature"] == names[0])
            found.append(f"{cell['name']}: {names[0]} ({first.get('first_line') or ''})")
    return found


def gpu_idle(samples: Sequence[Dict[str, Any]], idle_pct: float, needed: int) -> bool:
    """Whether the newest ``needed`` monitor samples all saw every GPU at or below ``idle_pct`` utilization.

    Samples without a GPU reading do not count either way; fewer than ``needed`` readings is no evidence.
    """
    if needed <= 0:
        return False
    readings = [s["gpus"] for s in samples if isinstance(s.get("gpus"), list) and s["gpus"]][-needed:]
    if len(readings) < needed:
        return False
    for gpus in readings:
        for gpu in gpus:
            util = finite(gpu.get("util_pct")) if isinstance(gpu, dict) else None
            if util is None or util > idle_pct:
                return False
    return True


def decide_run(run: Dict[str, Any], options: Dict[str, Any]) -> Verdict:
    """One run's row of the table (see the module's documentation for the table itself)."""
    name = run["run"]
    if run.get("problem"):
        verdict = Verdict("unknown")
        verdict.add(f"{name}: {run['problem']}", f"unreadable:{name}", "investigate")
        return verdict
    cells = run.get("cells") or []
    done = sum(1 for cell in cells if cell.get("done"))
    nan_cells = [c for c in cells if any(s.get("signature") == "nan_loss" for s in c.get("crash_signatures") or [])]
    if run.get("alive"):
        verdict = Verdict("running")
        idle_s = finite(run.get("log_idle_s"))
        if idle_s is not None and idle_s >= options["stall_after_s"]:
            verdict.worsen("stalled")
            verdict.add(
                f"{name}: alive but its logs have not grown for {idle_s:.0f} s "
                f"(stall_after_s {options['stall_after_s']})",
                f"stalled:{name}",
                "investigate",
            )
        elif gpu_idle(run.get("monitor_samples") or [], options["gpu_idle_pct"], options["gpu_idle_samples"]):
            verdict.worsen("stalled")
            verdict.add(
                f"{name}: alive but every GPU at or below {options['gpu_idle_pct']:g}% utilization over the "
                f"last {options['gpu_idle_samples']} monitor samples",
                f"stalled:{name}",
                "investigate",
            )
        for cell in nan_cells:
            first = next(s for s in cell["crash_signatures"] if s["signature"] == "nan_loss")
            verdict.add(
                f"{name}/{cell['name']}: NaN or Inf loss ({first.get('first_line') or ''})",
                f"nan_loss:{name}",
                "investigate",
            )
        for cell in cells:
            if cell.get("status") == "failed":
                verdict.add(f"{name}/{cell['name']}: failed ({_ending(cell)}); the run goes on with its other cells")
        return verdict
    if run.get("done_marker") and cells and done == len(cells):
        return Verdict("done")
    missing = [cell["name"] for cell in cells if not cell.get("done")]
    explained = _explaining(cells)
    verdict = Verdict("crashed" if explained else "incomplete")
    what = f"{name}: the runner is gone with {len(missing)} of {len(cells)} cells not done ({', '.join(missing[:5])})"
    verdict.add(what, f"{verdict.state}:{name}", "restart_job")
    for line in explained[:5]:
        verdict.add(f"{name}/{line}")
    for cell in cells:
        if not cell.get("done") and cell.get("status") == "succeeded":
            verdict.add(f"{name}/{cell['name']}: succeeded but its sync is {cell.get('sync')}: {cell.get('reason')}")
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
