"""Issue 11, benchmark "Fan-out": one patrol tick over 1, 10 and 50 simulated boxes, each with a live training run,
against the seed's ``health_patrol.sh`` run once per box, one box after another, with 100 ms of round trip and without.

The fleet: 50 boxes of one simulated fleet (tests/fleet, scenario ``healthy-h100.yml``: one idle H100). Each box
first gets what preflight leaves there, the runtime venv (the preflight role's controller-built installer, run
over plain ssh as row ``preflight`` does for its boxes 11-50), then a live run started once: the launch code's own
``training_run`` entry point (``_training_run.training_run``, what the module's ``main`` calls, with every option
at the module's default but the run's), run by the box's venv Python over the fleet's ssh, not through the launch
playbook or an Ansible task: a few seconds for 50 boxes (8 at a time, printed), without the controller's fork and
AnsiballZ per box, and the same files on the box (spec.json, the runner's code, run.json, the detached runner,
setsid). The run has one cell, ``fake_train.py --forever --step-s 5`` (a progress line every 5 s), alive for the
whole row.

Sides:
- ``patrol N boxes``: ``ansible-playbook playbooks/patrol.yml -e patrol_hosts=fleet[0:N-1]`` exactly as cron runs it,
  with the ansible.cfg the collection ships (``inventories/ansible.cfg`` as ``ANSIBLE_CONFIG``: forks 50, pipelining,
  ControlPersist; every other ``ANSIBLE_*`` variable of the caller removed), every role default (the module with the
  box's runtime venv Python), the report in the row's scratch directory, no webhook. Every tick must exit 0 with every
  box ``running``. Before each tick the controller's SSH masters to the fleet are closed (untimed): cron ticks come
  every 30 minutes and ControlPersist keeps a master 15, so a tick connects to every box afresh.
- ``seed loop``: the seed's ``health_patrol.sh.template``, extracted unchanged, run with ``bash`` once per box, one
  after another (what a cron loop over the hosts does), with its configuration variables set per box: ``HOST`` an
  ssh alias of the box, ``RUN_GLOB=fake_train.py``, ``RUN_LOG`` and ``RESULT_DIR`` the run's cell log and directory,
  ``DATA_MOUNT=/data``, ``N_TOTAL=1``. The seed calls plain ``ssh "$HOST"``: an ``ssh`` wrapper first on PATH adds
  ``-F <ssh_config>``, a file with one ``Host`` entry per box (address, port, root, the fleet key, no host key
  checks; no ControlMaster, as the seed has none) and, for 100 ms, the fleet's delay relay as ProxyCommand. One
  loop over the 50 boxes is timed box by box: the loops over 1 and 10 boxes are its first 1 and 10 boxes (a loop's
  boxes do not overlap, so a shorter loop is exactly its prefix). Every box must report ``healthy / in progress``.
- 100 ms of round trip: every SSH connection to the boxes through the fleet's delay relay (tests/fleet/delay_relay.py,
  ``FarView`` of row ``preflight``: the same boxes, a ControlPath directory of their own), for both sides. Without
  netem on this kernel, the relay delays the connections and nothing else.

Repetitions, for the row's budget (both patrol rows together take about 6 of the 20 minutes ``make bench`` may take
on 2 cores): at 100 ms, the two patrol ticks the targets compare (1 and 50 boxes) alternate
``RGT_BENCH_PATROL_FAR_REPS`` times (3; a 50-box tick costs half a minute here). The 50-box seed loop at 100 ms runs
once, right after (``RGT_BENCH_PATROL_SEED_FAR_REPS``): it is 50 fresh SSH connections one after another, about 1.5 s
each through the relay, over a minute a loop; its 50 per-box times (min / median / max printed) show how little one
box's tick varies from the next. The other sides (no delay: 1, 10 and 50 boxes and the seed loop; 10 boxes at
100 ms) run ``RGT_BENCH_PATROL_NEAR_REPS`` times (1), alternating: they are context for the targets, not part of
them. ``RGT_BENCH_PATROL_BOXES=1,3,5`` shrinks the fleet for a trial.

Controller CPU is the ansible-playbook process tree's user+sys (``os.wait4``) plus what the SSH ControlPersist
masters it opened used (they leave the tree; read from /proc before they are closed); box CPU is what the boxes'
processes used during the tick (their cgroups; it includes the live runs' own few ms). The boxes share the
controller's 2 cores here, which on a real fleet they do not.

Left out: a real network (bandwidth, loss, a platform's jump host), boxes with their own CPUs, GPU time (the
simulator's NVML answers from a file), notifications (no webhook set: the state file is still written), and the seed's
own scheduling (its ``/loop`` or cron entry).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fleet"))
import fleet_procs
from _harness import REPO, Bench, Phases, Sample, Stats, write_seed_script
from collection_path import collection_root
from fleet import Fleet
from row_preflight import (
    REMOTE_RUNTIME,
    FarView,
    _boxes,
    bootstrap_by_ssh,
    box_pids,
    build_cache,
    cpu_ticks,
    ssh_masters,
)

sys.path.insert(0, str(collection_root()))
from ansible_collections.remote_gpu.trainer.plugins.modules import training_run

ROW = "patrol fan-out (1 / 10 / 50 boxes, with and without 100 ms RTT) vs the seed's health_patrol.sh per box"
SCENARIO = REPO / "tests" / "scenarios" / "healthy-h100.yml"
CONFIG = REPO / "inventories" / "ansible.cfg"
PLAYBOOK = REPO / "playbooks" / "patrol.yml"
FAKE_TRAIN = REPO / "tests" / "workload" / "fake_train.py"
BOXES = tuple(int(n) for n in os.environ.get("RGT_BENCH_PATROL_BOXES", "1,10,50").split(","))
ONE, MID, BIG = BOXES
DELAY_MS = 100
FAR_REPS = int(os.environ.get("RGT_BENCH_PATROL_FAR_REPS", "3"))
NEAR_REPS = int(os.environ.get("RGT_BENCH_PATROL_NEAR_REPS", "1"))
SEED_FAR_REPS = int(os.environ.get("RGT_BENCH_PATROL_SEED_FAR_REPS", "1"))
RUN = "patrolbench"
VENV_PYTHON = f"{REMOTE_RUNTIME}/venv/bin/python"
PACKAGES = ["nvidia-ml-py>=12.535", "psutil>=5.9"]  # the preflight role's default preflight_packages
TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
UNIT_KEYS = [("controller_cpu_s", "CPU-s"), ("box_cpu_s", "CPU-s")]
# On the box: the launch code's own entry point, printing its result as JSON.
LAUNCH = (
    "import json, sys\n"
    "from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch._training_run import training_run\n"
    "print(json.dumps(training_run(json.loads(sys.argv[1]), False, lambda warning: None)))\n"
)


def launch_params() -> Dict[str, Any]:
    """training_run's options as the module hands them over: every default, then this run's values."""

    def defaults(spec: Dict[str, Any]) -> Dict[str, Any]:
        return {name: option.get("default") for name, option in spec.items()}

    params = defaults(training_run.ARGUMENT_SPEC)
    cell = defaults(training_run.ARGUMENT_SPEC["cells"]["options"])
    command = ["python3", str(FAKE_TRAIN), "--forever", "--steps-per-epoch", "1000", "--step-s", "5"]
    params.update(
        run=RUN, data_dir="/data", durable_dir="/durable", workdir="/data", detach="setsid",
        cells=[dict(cell, name="train", command=command)],
    )  # fmt: skip
    return params


def launch(fleet: Fleet) -> float:
    """The run on every box, started once; seconds it took (8 boxes at a time)."""
    code = shlex.quote(LAUNCH)
    payload = shlex.quote(json.dumps(launch_params()))
    command = f"PYTHONPATH={shlex.quote(str(collection_root()))} {VENV_PYTHON} -c {code} {payload}"

    def one(host: Dict[str, Any]) -> None:
        done = subprocess.run(
            fleet.ssh_argv(host["name"], command), capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {}
        if done.returncode != 0 or result.get("changed") is not True:
            raise SystemExit(f"launch on {host['name']}: exit {done.returncode}: {(done.stdout + done.stderr)[-400:]}")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, fleet.hosts))
    return time.perf_counter() - started


class Patrol:
    """One tick of the patrol playbook over the first N boxes of a fleet (or of its delayed view)."""

    def __init__(self, bench: Bench) -> None:
        self.scratch = bench.scratch("patrol_fanout")
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
        self.env.update(
            ANSIBLE_CONFIG=str(CONFIG), ANSIBLE_COLLECTIONS_PATH=str(collection_root()), ANSIBLE_NOCOLOR="1"
        )
        self.problems: List[str] = []
        self.summaries: Dict[str, str] = {}

    def tick(self, fleet: Fleet, count: int, label: str) -> Sample:
        fleet_procs.stop_ssh_clients(str(fleet.control_dir))  # a cron tick finds no master left (see the docstring)
        argv = [
            str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(fleet.inventory_path), str(PLAYBOOK),
            "-e", f"patrol_hosts=fleet[0:{count - 1}]", "-e", f"patrol_report_dir={self.scratch / 'reports'}",
        ]  # fmt: skip
        boxes_before = cpu_ticks(box_pids(fleet), children=True)
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env, cwd=self.scratch)
        assert proc.stdout is not None
        out = proc.stdout.read().decode(errors="replace")
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.stdout.close()
        masters = cpu_ticks(ssh_masters(str(fleet.control_dir)), children=False)  # all opened by this tick
        boxes_after = cpu_ticks(box_pids(fleet), children=True)
        box_ticks = sum(ticks - boxes_before.get(pid, 0) for pid, ticks in boxes_after.items())
        code = os.waitstatus_to_exitcode(status)
        summary = next((line.strip().strip('",') for line in out.splitlines() if "SUMMARY:" in line), "")
        self.summaries[label] = summary
        if code != 0 or f"{count} hosts: {count} running" not in summary:
            self.problems.append(f"{label}: exit {code}, {summary or out[-400:]}")
            print(f"[patrol_fanout] WARNING {label}: exit {code}, {summary or out[-400:]}", flush=True)
        return Sample(
            seconds,
            extra={
                "controller_cpu_s": usage.ru_utime + usage.ru_stime + sum(masters.values()) / TICK,
                "ssh_master_cpu_s": sum(masters.values()) / TICK,
                "box_cpu_s": box_ticks / TICK,
            },
        )


class SeedLoop:
    """health_patrol.sh once per box, one box after another, through an ssh wrapper that adds ``-F ssh_config``."""

    def __init__(self, bench: Bench, fleet: Fleet, delay_ms: int) -> None:
        self.scratch = bench.scratch(f"patrol_seed_{delay_ms}ms")
        self.script = write_seed_script("health_patrol.sh.template", self.scratch)
        self.hosts = fleet.hosts[:BIG]
        config = self.scratch / "ssh_config"
        config.write_text(ssh_config(fleet, delay_ms), encoding="utf-8")
        wrapper = self.scratch / "bin" / "ssh"
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {shlex.quote(str(config))} "$@"\n', encoding="utf-8")
        wrapper.chmod(0o755)
        self.env = dict(os.environ, PATH=f"{wrapper.parent}:{os.environ['PATH']}")
        self.problems: List[str] = []
        self.last_lines: List[str] = []
        self.per_box: List[float] = []

    def loop(self) -> Sample:
        cell = f"/data/runs/{RUN}/cells/train"
        times: List[float] = []
        cpu = 0.0
        lines = []
        for host in self.hosts:
            env = dict(self.env, HOST=alias(host), RUN_GLOB="fake_train.py", RESULT_DIR=cell, RUN_LOG=f"{cell}/log",
                       DATA_MOUNT="/data", N_TOTAL="1", DISK_PCT_MAX="95")  # fmt: skip
            start = time.perf_counter()
            proc = subprocess.Popen(["bash", str(self.script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)  # fmt: skip
            assert proc.stdout is not None
            out = proc.stdout.read().decode(errors="replace")
            _pid, status, usage = os.wait4(proc.pid, 0)
            times.append(time.perf_counter() - start)
            proc.stdout.close()
            cpu += usage.ru_utime + usage.ru_stime
            code = os.waitstatus_to_exitcode(status)
            lines = out.strip().splitlines()
            if code != 0 or "healthy / in progress" not in out:
                self.problems.append(f"{host['name']}: exit {code}, {' | '.join(lines)[-300:]}")
        self.last_lines = lines
        self.per_box = times
        extra = {f"first_{n}_s": sum(times[:n]) for n in BOXES}
        extra["controller_cpu_s"] = cpu
        return Sample(sum(times), extra=extra)


def alias(host: Dict[str, Any]) -> str:
    return f"rgt-{host['name']}"


def ssh_config(fleet: Fleet, delay_ms: int) -> str:
    entries = []
    for host in fleet.hosts[:BIG]:
        lines = [
            f"Host {alias(host)}", f"  HostName {host['address']}", f"  Port {host['port']}", "  User root",
            f"  IdentityFile {fleet.key_path}", "  IdentitiesOnly yes", "  BatchMode yes",
            "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR",
            "  ControlMaster no", "  ControlPath none",
        ]  # fmt: skip
        if delay_ms:
            relay = REPO / "tests" / "fleet" / "delay_relay.py"
            lines.append(f"  ProxyCommand {sys.executable} {relay} --rtt-ms {delay_ms} %h %p")
        entries.append("\n".join(lines))
    return "\n\n".join(entries) + "\n"


def prefix(stats: Stats, count: int) -> Stats:
    """The seed loop over its first ``count`` boxes, from the same repetitions."""
    return Stats(f"{stats.side}, first {count}", [Sample(s.extra[f"first_{count}_s"]) for s in stats.samples])


def run(bench: Bench) -> None:
    phases = Phases()

    scratch = bench.scratch("patrol_fanout")
    _build_s, installer = build_cache(scratch / "wheelhouse-cache")
    phases.done("controller cache")
    fleet = Fleet(bench.scratch("patrol_fleet"))
    patrol = Patrol(bench)
    try:
        fleet.up([str(SCENARIO)] * BIG)
        phases.done(f"fleet up ({BIG} boxes)")
        bootstrap_by_ssh(fleet, fleet.hosts, installer)
        phases.done("runtime venv by ssh")
        launch_s = launch(fleet)
        bench.figure("live runs", f"{_boxes(BIG)}, one run each (fake_train.py --forever --step-s 5), started over "
                     f"the fleet's ssh by the launch code's training_run entry point in {launch_s:.1f} s")  # fmt: skip
        phases.done("launch")
        far = FarView(fleet, DELAY_MS)
        seed_near, seed_far = SeedLoop(bench, fleet, 0), SeedLoop(bench, far, DELAY_MS)
        near_sides = {
            f"patrol {_boxes(ONE)}": lambda: patrol.tick(fleet, ONE, "near-1"),
            f"patrol {_boxes(MID)}": lambda: patrol.tick(fleet, MID, "near-mid"),
            f"patrol {_boxes(BIG)}": lambda: patrol.tick(fleet, BIG, "near-big"),
            f"seed loop, {_boxes(BIG)}": seed_near.loop,
            f"patrol {_boxes(MID)}, {DELAY_MS} ms RTT": lambda: patrol.tick(far, MID, "far-mid"),
        }
        near = bench.compare(near_sides, reps=min(NEAR_REPS, bench.reps), unit_keys=UNIT_KEYS)
        phases.done(f"no delay (and {MID} boxes at {DELAY_MS} ms) x {min(NEAR_REPS, bench.reps)}")
        far_sides = {
            f"patrol {_boxes(ONE)}, {DELAY_MS} ms RTT": lambda: patrol.tick(far, ONE, "far-1"),
            f"patrol {_boxes(BIG)}, {DELAY_MS} ms RTT": lambda: patrol.tick(far, BIG, "far-big"),
        }
        far_stats = list(bench.compare(far_sides, reps=min(FAR_REPS, bench.reps), unit_keys=UNIT_KEYS).values())
        far_stats.append(bench.measure(f"seed loop, {_boxes(BIG)}, {DELAY_MS} ms RTT", seed_far.loop,
                                       reps=min(SEED_FAR_REPS, bench.reps), unit_keys=UNIT_KEYS[:1]))  # fmt: skip
        phases.done(f"{DELAY_MS} ms RTT x {min(FAR_REPS, bench.reps)} (seed loop x {SEED_FAR_REPS})")
    finally:
        fleet.down()
        fleet_procs.stop_ssh_clients(f"{fleet.control_dir}-far")
        shutil.rmtree(f"{fleet.control_dir}-far", ignore_errors=True)
    phases.done("fleet down")
    report(bench, patrol, (seed_near, seed_far), list(near.values()), far_stats)
    bench.figure("row breakdown", phases.line())


def report(
    bench: Bench, patrol: Patrol, seeds: Tuple[SeedLoop, SeedLoop], near: Sequence[Stats], far: Sequence[Stats]
) -> None:
    one, mid, big, seed, _mid_far = near
    one_far, big_far, seed_far = far
    for stats, delay in ((seed, 0), (seed_far, DELAY_MS)):
        for count in (ONE, MID):
            bench.figure(f"{stats.side}, first {_boxes(count)}", prefix(stats, count).line())
        loop = seeds[0 if delay == 0 else 1]
        per_box = loop.per_box
        bench.figure(f"{stats.side}, per box (last loop)",
                     f"min {min(per_box):.3f} / median {statistics.median(per_box):.3f} / max {max(per_box):.3f} s "
                     f"(n={len(per_box)}); its last report: {' | '.join(loop.last_lines[:1])}")  # fmt: skip
    for stats in (big, big_far):
        bench.figure(f"{stats.side}, controller CPU",
                     f"{stats.median('controller_cpu_s'):.1f} CPU-s median (ansible-playbook tree by wait4 + ssh "
                     f"masters by /proc), boxes {stats.median('box_cpu_s'):.1f} CPU-s; on {CORES} cores shared by "
                     f"both: wall >= {(stats.median('controller_cpu_s') + stats.median('box_cpu_s')) / CORES:.1f} s "
                     f"here; seed loop controller {seed.median('controller_cpu_s'):.1f} CPU-s")  # fmt: skip
    bench.figure("patrol summary lines", "; ".join(f"{k}: {v}" for k, v in sorted(patrol.summaries.items())))
    bench.ratio(f"patrol {_boxes(BIG)} vs {_boxes(ONE)}", big, one)
    near_versus = bench.ratio(f"patrol {_boxes(BIG)} vs the seed loop", big, seed)
    bench.target(f"{_boxes(BIG)} tick vs seed loop, no added RTT", f"{near_versus:.2f}x", "<= 1.5x", near_versus <= 1.5)
    per_box = big.median("controller_cpu_s") / BIG
    bench.target(f"controller CPU-s per box, {_boxes(BIG)} tick", f"{per_box:.3f}", "<= 0.2", per_box <= 0.2)
    bench.ratio(f"patrol {_boxes(MID)} vs the seed loop's first {MID}", mid, prefix(seed, MID))
    versus = bench.ratio(f"patrol {_boxes(BIG)} vs the seed loop, {DELAY_MS} ms RTT", big_far, seed_far)
    bench.target(f"{_boxes(BIG)} tick vs seed loop, {DELAY_MS} ms RTT", f"{versus:.2f}x", "<= 0.35x", versus <= 0.35)
    scaling = bench.ratio(f"patrol {_boxes(BIG)} vs {_boxes(ONE)}, {DELAY_MS} ms RTT", big_far, one_far)
    bench.target(f"{_boxes(BIG)} tick vs {_boxes(ONE)}, {DELAY_MS} ms RTT", f"{scaling:.2f}x", "<= 4x", scaling <= 4)
    bench.ratio(f"patrol {_boxes(ONE)}, {DELAY_MS} ms RTT vs none", one_far, one)
    bench.ratio(f"patrol {_boxes(BIG)}, {DELAY_MS} ms RTT vs none", big_far, big)
    problems = patrol.problems + [p for loop in seeds for p in loop.problems]
    bench.figure("ticks not all running / healthy", "; ".join(problems[:10]) or "none")
