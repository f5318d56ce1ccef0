"""Issue 21, "Shape and figures": a launch of 1, 10 and 50 simulated boxes, and the relaunch of the live run, the
collection as it was before the issue (commit b5fe8b0: the launch role's task chain) against the current tree (one
action plugin a box).

What runs: ``ansible-playbook playbooks/launch.yml`` exactly as a user runs it, with the ansible.cfg the collection
ships (``inventories/ansible.cfg`` as ``ANSIBLE_CONFIG``; every other ``ANSIBLE_*`` variable of the caller removed),
``-e @sweep.yml -e launch_hosts=fleet[0:N-1]``, against the first N boxes of one 50-box simulated fleet
(tests/fleet, scenario ``healthy-h100.yml``), then the same command again while the run lives:

- **launch**: every box fresh (no run, no durable copy, no code of the run), no SSH master open: the code directory
  (``fake_train.py``) synced with rsync, the sweep (two cells, ``fake_train.py --forever --step-s 0.5``, one at a
  time: the first one trains for the whole repetition) started detached with ``setsid``. Every box must end
  ``STARTED``.
- **relaunch**: the same command, the SSH masters closed first (a relaunch comes later than ControlPersist keeps
  them): every box must report the live run (``ALREADY_RUNNING``; ``RUNNING`` before the issue) and change nothing.

Before each repetition (untimed) every box's run is ended through its stop file, its runner awaited (run.json's
pids), and its scratch, durable copy and code removed. The preflight gate reads a fresh report (written by the row)
in which every box PASSed. A run that does not end with every box in the expected status is printed as a WARNING
and listed at the end.

Figures per side, box count and phase: controller CPU-s per box (user+sys of the ansible-playbook process tree, its
forks, the ssh clients and rsync, by ``os.wait4``, plus the SSH ControlPersist masters it opened, read from /proc
before they are closed), wall seconds, box CPU (the boxes' cgroups) and the tasks run on the worst box (an aggregate
callback, as in row ``teardown``). The boxes share the controller's 2 cores here, which on a real fleet they do not.

Repetitions: ``RGT_BENCH_LAUNCH_REPS`` (``3,2,1``: 1, 10 and 50 boxes), both sides alternating, capped by
``--reps``; ``RGT_BENCH_LAUNCH_BOXES=1,2,3`` shrinks the fleet for a trial; ``RGT_BENCH_LAUNCH_BEFORE=0`` measures
this tree alone.

Left out: a real network, a big code directory or a git checkout (the code is one file), the runtime venv (the
launch finds none and uses the box's python3 on both sides), boxes with their own CPUs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fleet"))
import fleet_procs
from _harness import REPO, Bench, Phases, Sample, Stats
from collection_path import collection_root
from fleet import Fleet
from row_preflight import _boxes, box_pids, cpu_ticks, ssh_masters
from row_teardown import CALLBACK, runs_of

ROW = "launch and relaunch of a live run (1 / 10 / 50 boxes): before (b5fe8b0) vs after (this tree)"
BEFORE = "b5fe8b0"
SCENARIO = REPO / "tests" / "scenarios" / "healthy-h100.yml"
CONFIG = REPO / "inventories" / "ansible.cfg"
BOXES = tuple(int(n) for n in os.environ.get("RGT_BENCH_LAUNCH_BOXES", "1,10,50").split(","))
REPS = tuple(int(n) for n in os.environ.get("RGT_BENCH_LAUNCH_REPS", "3,2,1").split(","))
WITH_BEFORE = os.environ.get("RGT_BENCH_LAUNCH_BEFORE", "1") != "0"
RUN = "launchbench"
STOP_FILE = f"/data/stop-{RUN}"
TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
UNIT_KEYS = [("cpu_per_box_s", "CPU-s"), ("box_cpu_s", "CPU-s"), ("tasks_per_box", "tasks")]
# What each side's report must say of every box: after a launch, after a relaunch of the live run.
EXPECTED = {"before": ("STARTED", "RUNNING"), "after": ("STARTED", "ALREADY_RUNNING")}
SWEEP = {
    "launch_run": RUN,
    "launch_cells": [{"name": "a"}, {"name": "b"}],
    "launch_command": [
        "python3", "fake_train.py", "--forever", "--step-s", "0.5", "--stop-file", STOP_FILE, "--out", "{{ cell_dir }}",
    ],
    "launch_detach": "setsid",
    "launch_monitor_interval_s": 5,
    "launch_stop_grace_s": 2,
}  # fmt: skip

# On a box: end the run through its stop file, wait for its runner (run.json's pids), remove what it left.
RESET = r"""
import json, os, shutil, sys, time
run, stop = sys.argv[1], sys.argv[2]
run_json = f"/data/runs/{run}/run.json"
if os.path.exists(run_json):
    with open(stop, "w"):
        pass
    with open(run_json) as handle:
        pids = json.load(handle)["pids"]
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        if time.monotonic() > deadline:
            sys.exit(f"the runner {pids} of {run} still runs")
        time.sleep(0.1)
for path in (f"/data/runs/{run}", f"/durable/runs/{run}", f"/data/code/{run}"):
    shutil.rmtree(path, ignore_errors=True)
if os.path.exists(stop):
    os.remove(stop)
"""


class Side:
    """One tree's launch playbook; ``launch`` resets the first N boxes and times a launch then a relaunch."""

    def __init__(self, bench: Bench, fleet: Fleet, name: str, collections: Path) -> None:
        self.name, self.fleet = name, fleet
        self.tree = collections / "ansible_collections" / "remote_gpu" / "trainer"
        self.scratch = bench.scratch(f"launch-{name}")
        self.reports = self.scratch / "reports"
        self.code = self.scratch / "code"
        self.code.mkdir()
        shutil.copy2(REPO / "tests" / "workload" / "fake_train.py", self.code / "fake_train.py")
        self.sweep = self.scratch / "sweep.json"
        self.sweep.write_text(json.dumps(dict(SWEEP, launch_code_dir=str(self.code))), encoding="utf-8")
        callbacks = self.scratch / "callbacks"
        callbacks.mkdir()
        (callbacks / "rgt_task_counts.py").write_text(CALLBACK, encoding="utf-8")
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
        self.env.update(
            ANSIBLE_CONFIG=str(CONFIG), ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1",
            ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default",
            ANSIBLE_CALLBACK_PLUGINS=str(callbacks), ANSIBLE_CALLBACKS_ENABLED="rgt_task_counts",
        )  # fmt: skip
        self.problems: List[str] = []
        self.summaries: Dict[Tuple[int, str], str] = {}

    def reset(self, count: int) -> None:
        """The first N boxes without the run (the others never had it since the last reset of a bigger N: box counts
        only grow), a fresh PASS preflight report, no report of an earlier launch, no SSH master."""
        code = f"python3 -c {shlex.quote(RESET)} {RUN} {STOP_FILE}"

        def one(host: Dict[str, Any]) -> None:
            argv = self.fleet.ssh_argv(host["name"], code, multiplex=False)
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
            )
            if done.returncode != 0:
                raise SystemExit(f"reset of {host['name']}: exit {done.returncode}: {done.stderr[-400:]}")

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(one, self.fleet.hosts[:count]))
        shutil.rmtree(self.reports, ignore_errors=True)
        self.reports.mkdir()
        now = datetime.now(timezone.utc)
        preflight = {
            "generated_at": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "check_mode": False,
            "hosts": [{"host": host["name"], "status": "PASS", "findings": []} for host in self.fleet.hosts],
        }  # fmt: skip
        (self.reports / f"preflight-{now.strftime('%Y%m%dT%H%M%SZ')}.json").write_text(json.dumps(preflight))
        fleet_procs.stop_ssh_clients(str(self.fleet.control_dir))

    def launch(self, count: int, phase: int) -> Sample:
        """One launch (phase 0) or relaunch (phase 1) of the first N boxes, timed, then checked."""
        if phase == 0:
            self.reset(count)
        else:
            fleet_procs.stop_ssh_clients(str(self.fleet.control_dir))
        counts_path = self.scratch / "task-counts.json"
        counts_path.unlink(missing_ok=True)
        argv = [
            str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(self.fleet.inventory_path),
            str(self.tree / "playbooks" / "launch.yml"), "-e", f"@{self.sweep}",
            "-e", f"launch_hosts=fleet[0:{count - 1}]", "-e", f"launch_report_dir={self.reports}",
            "-e", f"launch_preflight_report_dir={self.reports}",
        ]  # fmt: skip
        boxes_before = cpu_ticks(box_pids(self.fleet), children=True)
        env = dict(self.env, RGT_TASK_COUNTS=str(counts_path))
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=self.scratch)
        assert proc.stdout is not None
        out = proc.stdout.read().decode(errors="replace")
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.stdout.close()
        masters = cpu_ticks(ssh_masters(str(self.fleet.control_dir)), children=False)
        boxes_after = cpu_ticks(box_pids(self.fleet), children=True)
        box_ticks = sum(ticks - boxes_before.get(pid, 0) for pid, ticks in boxes_after.items())
        self._check(count, phase, os.waitstatus_to_exitcode(status), out)
        names = [host["name"] for host in self.fleet.hosts[:count]]
        counts = json.loads(counts_path.read_text()) if counts_path.exists() else {}
        per_box = [runs_of(counts[name]) if name in counts else 0 for name in names]
        controller = usage.ru_utime + usage.ru_stime + sum(masters.values()) / TICK
        return Sample(
            seconds,
            extra={
                "cpu_per_box_s": controller / count,
                "controller_cpu_s": controller,
                "box_cpu_s": box_ticks / TICK,
                "tasks_per_box": float(max(per_box)),
            },
        )

    def _check(self, count: int, phase: int, code: int, out: str) -> None:
        """Exit 0 and every box of the newest report in the status this side gives that phase."""
        want = EXPECTED[self.name][phase]
        summary = next((line.strip().strip('",') for line in out.splitlines() if "SUMMARY:" in line), "")
        self.summaries[(count, want)] = summary
        reports = sorted(self.reports.glob("launch-2*.json"), key=lambda path: path.stat().st_mtime_ns)
        hosts = json.loads(reports[-1].read_text())["hosts"] if reports else []
        got = [host.get("status") for host in hosts]
        if code != 0 or got != [want] * count:
            problem = f"{self.name} {_boxes(count)} {want}: exit {code}, statuses {sorted(set(map(str, got)))}, "
            problem += summary or out[-600:]
            self.problems.append(problem)
            print(f"[launch] WARNING {problem}", flush=True)


def old_tree(scratch: Path) -> Path:
    """The collection at BEFORE, under a collection path of its own; returns that path."""
    source = scratch / f"collection-{BEFORE}"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BEFORE], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    root = scratch / f"collections-{BEFORE}"
    link = root / "ansible_collections" / "remote_gpu" / "trainer"
    link.parent.mkdir(parents=True)
    link.symlink_to(source, target_is_directory=True)
    return root


def measure(bench: Bench, sides: Dict[str, Side], count: int, reps: int) -> Dict[str, List[Stats]]:
    """Per repetition each side launches then relaunches its live run (the sides share the boxes, so a side's pair
    is never interleaved with the other's); the sides' order rotates every repetition."""
    names = list(sides)
    samples: Dict[str, List[List[Sample]]] = {name: [[], []] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            for phase in (0, 1):
                samples[name][phase].append(sides[name].launch(count, phase))
    phases = ((0, "launch"), (1, "relaunch"))
    stats = {
        name: [Stats(f"{name} {what} {_boxes(count)}", samples[name][phase]) for phase, what in phases]
        for name in names
    }
    for name in names:
        for one in stats[name]:
            bench.figure(f"{one.side} wall", one.line())
            for key, unit in UNIT_KEYS:
                bench.figure(f"{one.side} {key}", one.line(key, unit))
    return stats


def run(bench: Bench) -> None:
    phases = Phases()
    fleet = Fleet(bench.scratch("launch_fleet"))
    sides: Dict[str, Side] = {}
    results: Dict[int, Dict[str, List[Stats]]] = {}
    try:
        fleet.up([str(SCENARIO)] * max(BOXES))
        phases.done(f"fleet up ({_boxes(max(BOXES))})")
        if WITH_BEFORE:
            sides["before"] = Side(bench, fleet, "before", old_tree(bench.scratch("launch")))
        sides["after"] = Side(bench, fleet, "after", collection_root())
        for count, reps in zip(BOXES, REPS):
            results[count] = measure(bench, sides, count, min(reps, bench.reps))
            phases.done(f"{_boxes(count)} x {min(reps, bench.reps)}")
    finally:
        fleet.down()
    phases.done("fleet down")
    report(bench, sides, results)
    bench.figure("row breakdown", phases.line())


def report(bench: Bench, sides: Dict[str, Side], results: Dict[int, Dict[str, List[Stats]]]) -> None:
    for count, by_side in results.items():
        for name, (launched, relaunched) in by_side.items():
            bench.figure(
                f"{name} {_boxes(count)}, per box",
                f"launch {launched.median('cpu_per_box_s'):.2f} CPU-s, {launched.median('tasks_per_box'):.0f} tasks "
                f"on the worst box, wall {launched.median():.1f} s; relaunch (live run) "
                f"{relaunched.median('cpu_per_box_s'):.2f} CPU-s, {relaunched.median('tasks_per_box'):.0f} tasks, "
                f"wall {relaunched.median():.1f} s; boxes {launched.median('box_cpu_s') / count:.2f} / "
                f"{relaunched.median('box_cpu_s') / count:.2f} CPU-s; on {CORES} cores",
            )
        if "before" in by_side:
            for phase, what in ((0, "launch"), (1, "relaunch")):
                after, before = by_side["after"][phase], by_side["before"][phase]
                bench.ratio(f"{what} controller CPU-s per box, {_boxes(count)}", after, before, key="cpu_per_box_s")
                bench.ratio(f"{what} wall, {_boxes(count)}", after, before)
    if len(results) > 1:  # what one more box costs, the fixed cost of a run (start, inventory, plays) left out
        small, big = min(results), max(results)
        for name in sides:
            low, high = results[small][name], results[big][name]
            added = [
                (high[phase].median("controller_cpu_s") - low[phase].median("controller_cpu_s")) / (big - small)
                for phase in (0, 1)
            ]
            bench.figure(
                f"{name}, controller CPU-s per added box ({_boxes(small)} to {big})",
                f"launch {added[0]:.2f}, relaunch {added[1]:.2f}",
            )
    for side in sides.values():
        bench.figure(
            f"{side.name} summary lines", "; ".join(f"{k[0]} {k[1]}: {v}" for k, v in sorted(side.summaries.items()))
        )
    problems = [problem for side in sides.values() for problem in side.problems]
    bench.figure("launches not as expected", "; ".join(problems[:10]) or "none")
