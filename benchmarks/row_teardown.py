"""Issue 19, "Figures": a confirmed teardown (pull and load-verify included) of 1, 10 and 50 simulated boxes, the
collection as it was before the issue (commit a85d649) against the current tree.

What runs: ``ansible-playbook playbooks/teardown.yml`` exactly as a user runs it, with the ansible.cfg the collection
ships (``inventories/ansible.cfg`` as ``ANSIBLE_CONFIG``; every other ``ANSIBLE_*`` variable of the caller removed),
``-e teardown_run=tdbench -e confirm_teardown=all -e pull_to=DIR -e teardown_hosts=fleet[0:N-1]``, against the
first N boxes of one 50-box simulated fleet (tests/fleet, scenario ``healthy-h100.yml``). Every run must exit 0 with
every box ``TORN_DOWN``, one meter-stop call per box and every artifact pulled; a run that does not is printed as a
WARNING and listed at the end.

- **Before**: commit a85d649 (``git archive``, linked as ``ansible_collections/remote_gpu/trainer`` of a collection
  path of its own), its own playbook, role (about 27 tasks a box, their filters and ``set_fact`` chains), platform
  profiles (the old format: ``meter_stop_cmd``, ``meter_stop_status_cmd``, ``meter_stop_gone_pattern``,
  ``durable_survives``, ...) and its own fake provider CLI. **After**: this tree (one action plugin a box).
- **The platform**: RunPod, through an inventory overlay as Molecule ``teardown`` builds one: the fleet inventory
  plus a directory with ``hosts.yml`` (every box in group ``runpod`` with an ``instance_id`` of its own) and the
  side's own ``inventories/group_vars/*.yml``; meter-stop verb ``stop`` (``runpodctl pod stop ID``, then status
  polls). The fleet's host variables (``data_dir=/data``, ``durable_dir=/durable``, two separate tmpfs) win over the
  profile's directories. The box's PID 1 has no ``RUNPOD_POD_ID``, so the current tree notes that the id was not
  cross-checked (as on a box that does not tell its id). The side's fake provider CLI
  (``tests/workload/fake_provider.py install``) is first on PATH with one running pod per box (``add``).
- **Each box's run**: written on the box before every teardown (untimed) exactly as contracts/run-layout.md has it,
  as a finished launch leaves it: run.json (its runner's process group already gone), spec.json, two cells each with
  a log and a ``result.json`` (succeeded, sync verified, the artifact's size and sha256), a 256 KiB ``best.pth`` per
  cell in scratch and in ``/durable/runs/tdbench/cells/<cell>/``, ``MANIFEST.sha256``, ``monitor.jsonl`` and
  ``DONE``. Whatever an earlier teardown left on the box (tombstone, scratch, durable copy) is removed first, the
  pods are added again as running, the pull directory is emptied and the controller's SSH masters to the fleet are
  closed, so both sides start from the same state and connect to every box afresh.
- **Pull and load-verify**: ``pull_to`` a directory of the row's scratch (rsync over the host's SSH settings, then
  size and sha256 of every file), ``teardown_load_verify_on: controller`` with ``teardown_load_verify_cmd``
  ``python3 -c`` reading the pulled artifact (one run per artifact, two a box).

Figures per side and box count:
- **Controller CPU-s per box**: user+sys of the ansible-playbook process tree (``os.wait4``: the playbook, its forks,
  the ssh clients, rsync, the load-verify and provider commands they wait for) plus what the SSH ControlPersist
  masters it opened used (they leave the tree; read from /proc before they are closed), divided by N.
- **Tasks run per box**: an aggregate callback counts every task result Ansible reports for each host (ok, changed,
  failed, skipped or unreachable: a skipped task still costs a worker and its templating), a looped task counting
  once per loop item. A ``run_once`` task is counted on the one host that ran it (the first box, so that box shows
  the most); the figure is that worst box. Tasks of the localhost plays (once per run, not per box) are printed
  apart.
- Wall seconds; box CPU (the boxes' cgroups). The boxes share the controller's 2 cores here, which on a real fleet
  they do not.

Repetitions, for the row's budget: ``RGT_BENCH_TEARDOWN_REPS`` (``5,3,1``: 1, 10 and 50 boxes), both sides
alternating, capped by ``--reps``; ``RGT_BENCH_TEARDOWN_BOXES=1,2,3`` shrinks the fleet for a trial.

Left out: a real network and provider (the fake CLI answers at once), big artifacts (the pull moves 512 KiB a box),
boxes with their own CPUs, the first connection's key exchange to a box never met (masters are closed, not the
known hosts).
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
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fleet"))
import fleet_procs
from _harness import REPO, Bench, Phases, Sample, Stats
from collection_path import collection_root
from fleet import Fleet
from row_preflight import _boxes, box_pids, cpu_ticks, ssh_masters

ROW = "teardown (1 / 10 / 50 boxes, confirmed, pull + load-verify): before (a85d649) vs after (this tree)"
BEFORE = "a85d649"
SCENARIO = REPO / "tests" / "scenarios" / "healthy-h100.yml"
CONFIG = REPO / "inventories" / "ansible.cfg"
BOXES = tuple(int(n) for n in os.environ.get("RGT_BENCH_TEARDOWN_BOXES", "1,10,50").split(","))
REPS = tuple(int(n) for n in os.environ.get("RGT_BENCH_TEARDOWN_REPS", "5,3,1").split(","))
RUN = "tdbench"
CELLS = ("a", "b")
ARTIFACT_BYTES = 256 * 1024
TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
UNIT_KEYS = [
    ("cpu_per_box_s", "CPU-s"),
    ("controller_cpu_s", "CPU-s"),
    ("ssh_master_cpu_s", "CPU-s"),
    ("box_cpu_s", "CPU-s"),
    ("tasks_per_box", "tasks"),
]
# The profile-independent settings both trees take, as a user sets them in the inventory.
OVERLAY_VARS = {
    "teardown_load_verify_on": "controller",
    "teardown_load_verify_cmd": [
        "python3", "-c", "import sys; sys.exit(0 if open(sys.argv[1], 'rb').read() else 'empty')", "{{ artifact }}",
    ],
}  # fmt: skip

# On a box: the run as a finished launch leaves it (contracts/run-layout.md), after removing every earlier one.
MAKE_RUN = r"""
import hashlib, json, os, shutil, subprocess, sys
from datetime import datetime, timezone
run, cells, size = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
now = lambda: datetime.now(timezone.utc).isoformat()
for top in ("/data/runs", "/durable/runs"):
    shutil.rmtree(top, ignore_errors=True)
scratch, durable = f"/data/runs/{run}", f"/durable/runs/{run}"
def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as out:
        out.write(data if isinstance(data, bytes) else json.dumps(data).encode())
runner = subprocess.Popen(["true"], start_new_session=True)  # a runner whose process group is gone
runner.wait()
started = now()
command = lambda cell: ["python3", "fake_train.py", "--out", f"{scratch}/cells/{cell}"]
write(f"{scratch}/spec.json", {"schema": 1, "run": run, "data_dir": "/data", "durable_dir": "/durable",
      "workdir": "/data", "artifacts": ["best.pth"], "cells": [{"name": c, "command": command(c)} for c in cells]})
write(f"{scratch}/run.json", {"schema": 1, "run": run, "started_at": started, "pgid": runner.pid,
      "sid": runner.pid, "pids": [runner.pid], "detach": "setsid", "data_dir": "/data", "durable_dir": "/durable",
      "cells": [{"name": c, "command": command(c), "gpus": None} for c in cells]})
manifest = []
for cell in cells:
    blob = os.urandom(size)
    digest = hashlib.sha256(blob).hexdigest()
    for root in (scratch, durable):
        write(f"{root}/cells/{cell}/best.pth", blob)
    write(f"{scratch}/cells/{cell}/log", b"epoch 1/1 step 2/2 loss 0.5\n")
    write(f"{scratch}/cells/{cell}/result.json", {"status": "succeeded", "exit_code": 0, "signal": None,
          "started_at": started, "ended_at": now(), "sync": "verified",
          "artifacts": [{"path": "best.pth", "size": size, "sha256": digest}]})
    manifest.append(f"{digest}  {size}  cells/{cell}/best.pth\n")
write(f"{durable}/MANIFEST.sha256", "".join(manifest).encode())
write(f"{scratch}/monitor.jsonl", b'{"cpu_pct": 1.0}\n')
write(f"{scratch}/DONE", now().encode())
"""

# Counts, per host, every task result Ansible reports, and loop items; writes {host: counts} as JSON.
CALLBACK = '''
from __future__ import annotations
import json, os
from ansible.plugins.callback import CallbackBase
DOCUMENTATION = """
name: rgt_task_counts
type: aggregate
short_description: task results per host, for the teardown benchmark
description: task results per host (ok, failed, skipped, unreachable), loop items, looped tasks, task names
"""
class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "rgt_task_counts"
    CALLBACK_NEEDS_ENABLED = True
    def __init__(self):
        super().__init__()
        self.counts = {}
    def _add(self, result, key):
        keys = ("ok", "failed", "skipped", "unreachable", "items", "looped")
        entry = self.counts.setdefault(result._host.get_name(), dict(dict.fromkeys(keys, 0), names=[]))
        entry[key] += 1
        if key != "items":
            entry["names"].append(result._task.get_name())
            entry["looped"] += isinstance(result._result.get("results"), list)
    def v2_runner_on_ok(self, result):
        self._add(result, "ok")
    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._add(result, "failed")
    def v2_runner_on_skipped(self, result):
        self._add(result, "skipped")
    def v2_runner_on_unreachable(self, result):
        self._add(result, "unreachable")
    def v2_runner_item_on_ok(self, result):
        self._add(result, "items")
    def v2_runner_item_on_failed(self, result):
        self._add(result, "items")
    def v2_runner_item_on_skipped(self, result):
        self._add(result, "items")
    def v2_playbook_on_stats(self, stats):
        with open(os.environ["RGT_TASK_COUNTS"], "w") as out:
            json.dump(self.counts, out)
'''


def instance_id(index: int) -> str:
    return f"rgtbenchpod{index:03d}"


def runs_of(counts: Dict[str, int]) -> int:
    """Task executions: one per task result, a looped task once per item instead."""
    return (
        counts["ok"] + counts["failed"] + counts["skipped"] + counts["unreachable"] + counts["items"] - counts["looped"]
    )


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


class Side:
    """One tree's teardown: its playbook, profiles and fake provider CLI; ``run`` resets the boxes and times one
    teardown of the first N."""

    def __init__(self, bench: Bench, fleet: Fleet, name: str, collections: Path) -> None:
        self.name, self.fleet = name, fleet
        self.tree = collections / "ansible_collections" / "remote_gpu" / "trainer"
        self.scratch = bench.scratch(f"teardown-{name}")
        self.provider = self.tree / "tests" / "workload" / "fake_provider.py"
        self.state = self.scratch / "provider" / "state.json"
        self.calls = self.scratch / "provider" / "calls.jsonl"
        self.pull = self.scratch / "pull"
        self.reports = self.scratch / "reports"
        self.overlay = self._overlay()
        bin_dir = self.scratch / "provider" / "bin"
        subprocess.run([sys.executable, str(self.provider), "install", str(bin_dir)], check=True, capture_output=True)
        callbacks = self.scratch / "callbacks"
        callbacks.mkdir()
        (callbacks / "rgt_task_counts.py").write_text(CALLBACK, encoding="utf-8")
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
        self.env.update(
            ANSIBLE_CONFIG=str(CONFIG), ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1",
            # The "before" collection has no stage_lines callback; both sides print the same default output.
            ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default",
            ANSIBLE_CALLBACK_PLUGINS=str(callbacks), ANSIBLE_CALLBACKS_ENABLED="rgt_task_counts",
            PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_PROVIDER_STATE=str(self.state),
            FAKE_PROVIDER_CALLS=str(self.calls),
        )  # fmt: skip
        self.problems: List[str] = []
        self.summaries: Dict[int, str] = {}
        self.controller_tasks: Dict[int, int] = {}
        self.worst: Dict[int, Dict[str, Any]] = {}  # box count -> the callback's counts of the worst box

    def _overlay(self) -> Path:
        overlay = self.scratch / "inventory"
        (overlay / "group_vars").mkdir(parents=True)
        for profile in sorted((self.tree / "inventories" / "group_vars").glob("*.yml")):
            shutil.copy2(profile, overlay / "group_vars")
        hosts = {host["name"]: {"instance_id": instance_id(i)} for i, host in enumerate(self.fleet.hosts)}
        document = {"all": {"vars": OVERLAY_VARS, "children": {"runpod": {"hosts": hosts}}}}
        (overlay / "hosts.yml").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")  # JSON is YAML
        return overlay

    def reset(self, count: int) -> None:
        """Every box's run written afresh, one running pod per box, an empty pull dir, no SSH master open."""
        code = f"python3 -c {shlex.quote(MAKE_RUN)} {RUN} {','.join(CELLS)} {ARTIFACT_BYTES}"

        def one(host: Dict[str, Any]) -> None:
            argv = self.fleet.ssh_argv(host["name"], code, multiplex=False)
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
            )
            if done.returncode != 0:
                raise SystemExit(f"run on {host['name']}: exit {done.returncode}: {done.stderr[-400:]}")

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(one, self.fleet.hosts[:count]))
        for path in (self.state, self.calls, self.state.with_name(self.state.name + ".lock")):
            path.unlink(missing_ok=True)
        for index in range(count):
            subprocess.run(
                [sys.executable, str(self.provider), "add", "--state", str(self.state), instance_id(index),
                 "--status", "running"], check=True, capture_output=True,
            )  # fmt: skip
        shutil.rmtree(self.pull, ignore_errors=True)
        self.pull.mkdir()
        shutil.rmtree(self.reports, ignore_errors=True)
        fleet_procs.stop_ssh_clients(str(self.fleet.control_dir))

    def run(self, count: int) -> Sample:
        self.reset(count)
        counts_path = self.scratch / "task-counts.json"
        counts_path.unlink(missing_ok=True)
        argv = [
            str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(self.fleet.inventory_path),
            "-i", str(self.overlay), str(self.tree / "playbooks" / "teardown.yml"),
            "-e", f"teardown_run={RUN}", "-e", "confirm_teardown=all", "-e", f"pull_to={self.pull}",
            "-e", f"teardown_hosts=fleet[0:{count - 1}]", "-e", f"teardown_report_dir={self.reports}",
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
        masters = cpu_ticks(ssh_masters(str(self.fleet.control_dir)), children=False)  # all opened by this run
        boxes_after = cpu_ticks(box_pids(self.fleet), children=True)
        box_ticks = sum(ticks - boxes_before.get(pid, 0) for pid, ticks in boxes_after.items())
        self._check(count, os.waitstatus_to_exitcode(status), out)
        names = [host["name"] for host in self.fleet.hosts[:count]]
        counts = json.loads(counts_path.read_text()) if counts_path.exists() else {}
        per_box = [runs_of(counts[name]) if name in counts else 0 for name in names]
        self.worst[count] = counts.get(names[per_box.index(max(per_box))], {})
        self.controller_tasks[count] = sum(runs_of(c) for host, c in counts.items() if host not in names)
        controller = usage.ru_utime + usage.ru_stime + sum(masters.values()) / TICK
        return Sample(
            seconds,
            extra={
                "cpu_per_box_s": controller / count,
                "controller_cpu_s": controller,
                "ssh_master_cpu_s": sum(masters.values()) / TICK,
                "ssh_masters": float(len(masters)),
                "box_cpu_s": box_ticks / TICK,
                "tasks_per_box": float(max(per_box)),
                "tasks_per_box_mean": sum(per_box) / count,
            },
        )

    def _check(self, count: int, code: int, out: str) -> None:
        """Exit 0, every box TORN_DOWN in the report with every artifact load-verified, one meter-stop call per box,
        every artifact pulled."""
        summary = next((line.strip().strip('",') for line in out.splitlines() if "SUMMARY:" in line), "")
        self.summaries[count] = summary
        calls = [json.loads(line) for line in self.calls.read_text().splitlines()] if self.calls.exists() else []
        stops = sum(1 for call in calls if call["argv"][1:3] == ["pod", "stop"])
        pulled = sum(1 for path in self.pull.rglob("best.pth") if path.is_file())
        reports = sorted(self.reports.glob("teardown-2*.json"))
        hosts = json.loads(reports[-1].read_text())["hosts"] if reports else []
        loaded = 0  # load-verify checks that passed; the report counts them (after) or lists them (before)
        for host in hosts:
            checks = host.get("load_verify", {}).get("checks")
            passed = checks if isinstance(checks, int) else sum(1 for check in checks or [] if check["rc"] == 0)
            loaded += passed if host["status"] == "TORN_DOWN" and not host["load_verify"].get("failed") else 0
        wanted = count * len(CELLS)
        if code != 0 or f"{count} TORN_DOWN" not in summary or stops != count or pulled != wanted or loaded != wanted:
            problem = f"{self.name} {_boxes(count)}: exit {code}, {stops} stop calls, {pulled} files pulled, "
            problem += f"{loaded} load-verified, "
            problem += summary or out[-600:]
            self.problems.append(problem)
            print(f"[teardown] WARNING {problem}", flush=True)


def run(bench: Bench) -> None:
    phases = Phases()

    scratch = bench.scratch("teardown")
    before_root = old_tree(scratch)
    fleet = Fleet(bench.scratch("teardown_fleet"))
    results: Dict[int, Dict[str, Stats]] = {}
    try:
        fleet.up([str(SCENARIO)] * max(BOXES))
        phases.done(f"fleet up ({max(BOXES)} boxes)")
        sides = {
            "before": Side(bench, fleet, "before", before_root),
            "after": Side(bench, fleet, "after", collection_root()),
        }
        for count, reps in zip(BOXES, REPS):
            compared = {
                f"{name} {_boxes(count)}": (lambda side=side, count=count: side.run(count))
                for name, side in sides.items()
            }
            results[count] = bench.compare(compared, reps=min(reps, bench.reps), unit_keys=UNIT_KEYS)
            phases.done(f"{_boxes(count)} x {min(reps, bench.reps)}")
    finally:
        fleet.down()
    phases.done("fleet down")
    report(bench, sides, results)
    bench.figure("row breakdown", phases.line())


def task_list(counts: Dict[str, Any]) -> str:
    """The worst box's tasks in order, a repeated name once with its count; loop items and skips after."""
    shown: List[List[Any]] = []
    for full in counts.get("names", []):
        name = full.split(" : ", 1)[-1].split(" - ", 1)[0]  # no role prefix, no argument spec's description
        if shown and shown[-1][0] == name:
            shown[-1][1] += 1
        else:
            shown.append([name, 1])
    listed = ", ".join(name if times == 1 else f"{name} x{times}" for name, times in shown)
    return f"{listed} ({counts.get('skipped', 0)} skipped; {counts.get('items', 0)} loop items)"


def report(bench: Bench, sides: Dict[str, Side], results: Dict[int, Dict[str, Stats]]) -> None:
    worst_tasks = 0.0
    for count, stats in results.items():
        before, after = stats.values()
        for side, one in zip(sides.values(), (before, after)):
            bench.figure(
                f"{one.side}, per box",
                f"controller {one.median('cpu_per_box_s'):.2f} CPU-s ({one.median('ssh_masters'):.0f} ssh masters "
                f"opened), tasks {one.median('tasks_per_box'):.0f} on the worst box "
                f"({one.median('tasks_per_box_mean'):.2f} mean), plus {side.controller_tasks.get(count, 0)} "
                f"localhost task(s) per run; boxes {one.median('box_cpu_s') / count:.2f} CPU-s; on {CORES} cores: "
                f"wall >= {(one.median('controller_cpu_s') + one.median('box_cpu_s')) / CORES:.1f} s here",
            )  # fmt: skip
        ratio = bench.ratio(f"controller CPU-s per box, {_boxes(count)}", after, before, key="cpu_per_box_s")
        bench.target(f"controller CPU-s per box, {_boxes(count)}", f"{ratio:.2f}x", "<= 0.25x", ratio <= 0.25)
        bench.ratio(f"wall, {_boxes(count)}", after, before)
        worst_tasks = max(worst_tasks, *after.values("tasks_per_box"))
    if len(results) > 1:  # what one more box costs, the fixed cost of a run (start, inventory, plays) left out
        small, big = min(results), max(results)
        marginal = {}
        for index, name in enumerate(sides):
            low, high = list(results[small].values())[index], list(results[big].values())[index]
            marginal[name] = (high.median("controller_cpu_s") - low.median("controller_cpu_s")) / (big - small)
        bench.figure(
            f"controller CPU-s per added box ({_boxes(small)} to {big})",
            ", ".join(f"{name} {value:.2f}" for name, value in marginal.items())
            + f": {marginal['after'] / marginal['before']:.2f}x",
        )
    for side in sides.values():
        last = side.worst[max(side.worst)] if side.worst else {}
        bench.figure(f"{side.name}, tasks of the worst box ({_boxes(max(side.worst, default=0))})", task_list(last))
    bench.target("tasks run per box (after, worst box)", f"{worst_tasks:.0f}", "<= 3", worst_tasks <= 3)
    for side in sides.values():
        bench.figure(f"{side.name} summary lines", "; ".join(f"{k}: {v}" for k, v in sorted(side.summaries.items())))
    problems = [problem for side in sides.values() for problem in side.problems]
    bench.figure("runs not all TORN_DOWN", "; ".join(problems[:10]) or "none")
