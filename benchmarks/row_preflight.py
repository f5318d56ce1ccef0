"""Issue 9 rows 3 and 5: the preflight playbook over 1, 10 and 50 simulated boxes, first and second run.

What runs: ``ansible-playbook playbooks/preflight.yml`` exactly as a user runs it, with the ansible.cfg the
collection ships (``inventories/ansible.cfg``: forks 50, pipelining, ControlPersist; given as ``ANSIBLE_CONFIG``, every
other ``ANSIBLE_*`` variable of the caller removed), against boxes of one 50-box simulated fleet (tests/fleet,
scenario ``healthy-h100.yml``: one idle H100), all role defaults (3 s GPU sampling window). N boxes are the first N
of the fleet, picked with ``-e preflight_hosts=fleet[0:N-1]``; every run must end with exit code 0 and N PASS.

- **First run** (bootstrap), one rep each, for the row's time budget: the box has no runtime venv yet and the
  controller holds no SSH connection to it. The 10-box first run is on boxes fresh from ``up``; the 1-box first run
  comes after removing what bootstrap installed (``<data_dir>/.remote_gpu_trainer``) from box 1 and closing the
  controller's SSH master to it (``ssh -O exit``), which is all the playbook sees of a box it never met. The 50-box
  first run takes about 2.5 min here and is left out unless ``RGT_BENCH_PREFLIGHT_FIRST_50=1``; boxes 11-50 are then
  bootstrapped over plain ssh by the same controller-built installer, run the same way (not timed). The controller's
  cache (wheel download, installer build) is built once before and timed on its own: it is paid once per controller
  and box Python version, not per box or run. First runs load a small callback that times the bootstrap tasks.
- **Second run**: the same boxes again, the venv in place and the SSH masters of an earlier run still open (within
  ControlPersist, as when preflight is rerun before a launch). 1 box against 50, ``bench.reps`` reps alternating;
  10 boxes one rep (``RGT_BENCH_PREFLIGHT_FAR_REPS``).
- **100 ms RTT** (row 5): boxes 1-10 of the same fleet through the fleet's own delay relay (tests/fleet/delay_relay.py,
  the ProxyCommand ``Fleet.up(delay_ms=100)`` writes into an inventory), with a ControlPath of their own so no
  undelayed master is reused, masters opened before (as a second run finds them). The relay stands in for
  ``tc qdisc ... netem``, which this machine's kernel lacks: every SSH connection pays 100 ms of round trip, one RTT
  to connect; bandwidth is not limited and the boxes' own commands are not delayed. 1 and 10 boxes, one rep each.

Controller CPU is the ansible-playbook process tree's user+sys (``os.wait4``: the playbook, its forks and the ssh
clients they wait for) plus the CPU the SSH ControlPersist masters used during the run (they detach from the tree, so
they are read from /proc). Peak controller memory is sampled every 0.25 s over the same processes: the sum of RSS
(shared pages counted once per process: an overcount) and, at that peak, the sum of PSS (shared pages split);
``ru_maxrss`` from wait4 is only the largest single process of the tree. Box CPU is what the boxes' own processes
used (modules, the GPU simulator, sshd), summed over their cgroups' processes with their reaped children. Here the
boxes run on the controller's 2 cores, which on a real fleet they do not: so the CPU line says how much wall time
the CPU alone accounts for on this machine.

Left out: a real network (bandwidth, loss), boxes with their own CPUs, a controller doing nothing else (other work
on the machine shows up in the wall times), the first ever run on a controller (the wheel download and the installer
build, printed apart), and whether Ansible's own files are in the page cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fleet"))
from _harness import REPO, Bench, Phases, Sample, Stats
from collection_path import collection_root
from fleet import Fleet
from fleet_host import Host

ROW = "preflight fan-out (1 / 10 / 50 boxes, first and second run)"
SCENARIO = REPO / "tests" / "scenarios" / "healthy-h100.yml"
CONFIG = REPO / "inventories" / "ansible.cfg"
PLAYBOOK = REPO / "playbooks" / "preflight.yml"
BIG, MID = 50, 10
DELAY_MS = 100
# The 10-box and 100 ms RTT runs: one rep each by default, for the row's time budget (RGT_BENCH_PREFLIGHT_FAR_REPS).
FAR_REPS = int(os.environ.get("RGT_BENCH_PREFLIGHT_FAR_REPS", "1"))
# The 50-box first run costs about 2.5 min here; off by default for the row's budget.
FIRST_50 = os.environ.get("RGT_BENCH_PREFLIGHT_FIRST_50", "") == "1"
REMOTE_RUNTIME = "/data/.remote_gpu_trainer"  # preflight_runtime_dir with the fleet's data_dir
CONTROL_PERSIST = "15m"  # as inventories/ansible.cfg has it
CORES = os.cpu_count() or 1
COMMAND_REPS = 5
SAMPLE_EVERY_S = 0.25
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
# The figures on the landed code (same machine class): the baseline the fix is measured against.
BASELINE = (
    "10 boxes second run 21.7 s (5 forks; 17.0 s with -f 10), first run 43.8 s of which 12.6 s the wheelhouse copy"
)
PACKAGES = ["nvidia-ml-py>=12.535", "psutil>=5.9"]  # the preflight role's default preflight_packages
UNIT_KEYS = [
    ("controller_cpu_s", "CPU-s"),
    ("ssh_master_cpu_s", "CPU-s"),
    ("box_cpu_s", "CPU-s"),
    ("peak_rss_sum_mib", "MiB"),
    ("peak_pss_sum_mib", "MiB"),
    ("max_single_rss_mib", "MiB"),
]

# Times the bootstrap tasks of a first run (their names start with these) and writes {name: seconds} as JSON.
CALLBACK = '''
from __future__ import annotations
import json, os, time
from ansible.plugins.callback import CallbackBase
DOCUMENTATION = """
name: rgt_task_times
type: aggregate
short_description: wall seconds per task, for the preflight benchmark
description: wall seconds from one task's start to the next's
"""
class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "rgt_task_times"
    CALLBACK_NEEDS_ENABLED = True
    def __init__(self):
        super().__init__()
        self.current, self.started, self.times = None, time.monotonic(), {}
    def _close(self, name):
        now = time.monotonic()
        if self.current:
            self.times[self.current] = self.times.get(self.current, 0.0) + now - self.started
        self.current, self.started = name, now
    def v2_playbook_on_task_start(self, task, is_conditional):
        self._close(task.get_name())
    def v2_playbook_on_play_start(self, play):
        self._close(None)
    def v2_playbook_on_stats(self, stats):
        self._close(None)
        with open(os.environ["RGT_TASK_TIMES"], "w") as out:
            json.dump(self.times, out)
'''


def _stat_fields(pid: int) -> Optional[Tuple[str, List[str]]]:
    """(comm, the fields after it) of /proc/PID/stat; field N of proc(5) is index N - 3."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    end = raw.rfind(")")
    return raw[raw.find("(") + 1 : end], raw[end + 2 :].split()


def _pids() -> List[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def ssh_masters(needle: str) -> List[int]:
    """The ControlPersist masters of one fleet: ssh retitles itself ``ssh: <ControlPath> [mux]``."""
    found = []
    for pid in _pids():
        stat = _stat_fields(pid)
        if stat and stat[0] == "ssh" and (needle + "/").encode() in _cmdline(pid) and b"[mux]" in _cmdline(pid):
            found.append(pid)
    return found


def cpu_ticks(pids: Sequence[int], children: bool) -> Dict[int, int]:
    """utime + stime (and the reaped children's, with ``children``) per pid, in clock ticks."""
    ticks = {}
    for pid in pids:
        stat = _stat_fields(pid)
        if stat:
            fields = stat[1]
            ticks[pid] = sum(int(value) for value in fields[11 : 15 if children else 13])
    return ticks


def box_pids(fleet: Fleet) -> List[int]:
    pids: List[int] = []
    for host in fleet.hosts:
        if host.get("cgroup"):
            with contextlib.suppress(OSError):
                pids += [int(pid) for pid in (Path(host["cgroup"]) / "cgroup.procs").read_text().split()]
    return pids


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> List[int]:
    found: List[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def _rss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError):
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    return 0


class TreeSampler(threading.Thread):
    """Peak summed RSS of a process tree plus the fleet's ssh masters open when it started, sampled every
    SAMPLE_EVERY_S; the summed PSS is read at each new RSS peak only (smaps_rollup is dear). The tree is walked
    through /proc/PID/task/*/children, not by scanning /proc, to keep the sampler's own CPU small. Masters a run
    opens itself (first runs) are not in it: the memory figures are taken from second runs."""

    def __init__(self, root: int, masters: List[int]) -> None:
        super().__init__(daemon=True)
        self.root, self.masters = root, list(masters)
        self.done = threading.Event()
        self.peak_rss = self.peak_pss = self.peak_procs = 0
        self.cpu_s = 0.0

    def run(self) -> None:
        started = time.thread_time()
        while not self.done.wait(SAMPLE_EVERY_S):
            self.sample()
        self.cpu_s = time.thread_time() - started

    def sample(self) -> None:
        tree, queue = [], [self.root]
        while queue:
            pid = queue.pop()
            tree.append(pid)
            queue += _children(pid)
        tree += [pid for pid in self.masters if pid not in tree]
        rss = sum(_rss_bytes(pid) for pid in tree)
        self.peak_procs = max(self.peak_procs, len(tree))
        if rss > self.peak_rss:
            self.peak_rss = rss
            self.peak_pss = sum(_pss_kib(pid) for pid in tree) * 1024


class Preflight:
    """Runs the playbook against the first N boxes of a fleet and returns a Sample with the figures above."""

    def __init__(self, bench: Bench, cache: Path) -> None:
        self.scratch = bench.scratch("preflight")
        self.cache = cache
        self.problems: List[str] = []
        callbacks = self.scratch / "callbacks"
        callbacks.mkdir(exist_ok=True)
        (callbacks / "rgt_task_times.py").write_text(CALLBACK, encoding="utf-8")
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
        self.env.update(
            ANSIBLE_CONFIG=str(CONFIG), ANSIBLE_COLLECTIONS_PATH=str(collection_root()), ANSIBLE_NOCOLOR="1"
        )
        self.timing_env = dict(
            self.env, ANSIBLE_CALLBACK_PLUGINS=str(callbacks), ANSIBLE_CALLBACKS_ENABLED="rgt_task_times"
        )
        self.task_times: Dict[str, Dict[str, float]] = {}

    def run(self, fleet: Fleet, count: int, label: str, time_tasks: bool = False) -> Sample:
        argv = [
            str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(fleet.inventory_path), str(PLAYBOOK),
            "-e", f"preflight_hosts=fleet[0:{count - 1}]", "-e", f"preflight_report_dir={self.scratch / 'reports'}",
            "-e", f"preflight_wheelhouse_cache={self.cache}",
        ]  # fmt: skip
        env = self.env
        if time_tasks:
            env = dict(self.timing_env, RGT_TASK_TIMES=str(self.scratch / f"tasks-{label}.json"))
        needle = str(fleet.control_dir)
        masters = ssh_masters(needle)
        masters_before = cpu_ticks(masters, children=False)
        boxes = box_pids(fleet)
        boxes_before = cpu_ticks(boxes, children=True)
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=self.scratch)
        sampler = TreeSampler(proc.pid, masters)
        sampler.start()
        assert proc.stdout is not None
        out = proc.stdout.read().decode(errors="replace")
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.stdout.close()
        sampler.done.set()
        sampler.join()
        masters_after = cpu_ticks(ssh_masters(needle), children=False)
        master_ticks = sum(ticks - masters_before.get(pid, 0) for pid, ticks in masters_after.items())
        boxes_after = cpu_ticks(box_pids(fleet), children=True)
        box_ticks = sum(ticks - boxes_before.get(pid, 0) for pid, ticks in boxes_after.items())
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or f"SUMMARY: {count} hosts: {count} PASS" not in out:
            summary = next((line.strip() for line in out.splitlines() if "SUMMARY:" in line), out[-400:])
            self.problems.append(f"{label}: exit {code}, {summary}")
            print(f"[preflight] WARNING {label}: exit {code}, {summary}", flush=True)
        if time_tasks:
            path = self.scratch / f"tasks-{label}.json"
            self.task_times[label] = json.loads(path.read_text()) if path.exists() else {}
        ansible_cpu = usage.ru_utime + usage.ru_stime
        return Sample(
            seconds,
            extra={
                "controller_cpu_s": ansible_cpu + master_ticks / TICK,
                "ssh_master_cpu_s": master_ticks / TICK,
                "box_cpu_s": box_ticks / TICK,
                "peak_rss_sum_mib": sampler.peak_rss / 2**20,
                "peak_pss_sum_mib": sampler.peak_pss / 2**20,
                "max_single_rss_mib": usage.ru_maxrss / 1024,
                "peak_processes": float(sampler.peak_procs),
                "sampler_cpu_s": sampler.cpu_s,
            },
        )


def _ssh(argv: List[str]) -> None:
    result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv[-2:])[:200]}: exit {result.returncode}: {result.stderr[-400:]}")


def forget(fleet: Fleet, count: int) -> None:
    """Make the first ``count`` boxes new to the playbook: remove what bootstrap installed, close the SSH masters."""

    def one(host: dict) -> None:
        _ssh(fleet.ssh_argv(host["name"], f"rm -rf {REMOTE_RUNTIME}", multiplex=False))
        subprocess.run(
            ["ssh", *fleet.ssh_options(), "-O", "exit", "-p", str(host["port"]), f"root@{host['address']}"],
            check=False, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, fleet.hosts[:count]))


def on_boxes(fleet: Fleet, hosts: List[dict], command: str) -> None:
    """``command`` on each box over plain ssh, leaving an SSH master open (ControlPersist as the shipped ansible.cfg
    has it, so that it outlives the run as Ansible's own would)."""

    def one(host: dict) -> None:
        argv = fleet.ssh_argv(host["name"], command)
        _ssh([argv[0], "-o", f"ControlPersist={CONTROL_PERSIST}", *argv[1:]])  # ssh keeps an option's first value

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, hosts))


def bootstrap_by_ssh(fleet: Fleet, hosts: List[dict], installer: str) -> None:
    """What the role's bootstrap leaves on a box (the same controller-built installer, run the same way), over plain
    ssh, for a fraction of a playbook run's cost; it also leaves the SSH master a preflight would."""
    shipped = fleet.state_dir / Path(installer).name  # the state dir is visible inside the boxes, the scratch is not
    shutil.copyfile(installer, shipped)
    on_boxes(fleet, hosts, f"/usr/bin/python3 {shipped} {REMOTE_RUNTIME}/venv --embedded >/dev/null")


def command_ms(fleet: Fleet) -> float:
    argv = fleet.ssh_argv(fleet.hosts[0]["name"], "true")
    start = time.perf_counter()
    for _rep in range(COMMAND_REPS):
        subprocess.run(argv, check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return (time.perf_counter() - start) / COMMAND_REPS * 1000


class FarView(Fleet):
    """The same boxes seen through the fleet's delay relay (what ``Fleet.up(delay_ms=...)`` puts in the inventory),
    with a ControlPath directory of their own so that no near SSH master is reused. Fleet.down ends its masters too
    (their control dir has the fleet's as a prefix)."""

    def __init__(self, fleet: Fleet, delay_ms: int) -> None:
        super().__init__(fleet.state_dir)
        self._delay_ms = float(delay_ms)
        self.control_dir = Path(f"{fleet.control_dir}-far")
        self.control_dir.mkdir(parents=True, exist_ok=True)
        self.inventory_path = fleet.state_dir / "inventory-far.ini"
        self.inventory_path.write_text(self.inventory([Host(**host) for host in fleet.hosts]))

    @property
    def delay_ms(self) -> float:
        return self._delay_ms


def box_wheel_tag() -> str:
    """The tag the runtime probe reports for the boxes (they run this machine's /usr/bin/python3)."""
    code = "import platform, sys; print('py%d.%d-%s' % (sys.version_info[0], sys.version_info[1], platform.machine()))"
    return subprocess.run(["/usr/bin/python3", "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def build_cache(cache: Path) -> Tuple[float, str]:
    """The controller's one-time wheelhouse download and installer build, as the role runs it."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(REPO / "roles" / "runtime" / "files" / "build_wheelhouse.py"), "--cache", str(cache),
         "--tag", box_wheel_tag(), *PACKAGES],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return time.perf_counter() - start, json.loads(result.stdout)["script"]


def _cpu_line(stats: Stats) -> str:
    controller, boxes = stats.median("controller_cpu_s"), stats.median("box_cpu_s")
    return (
        f"controller {controller:.1f} CPU-s (ssh masters {stats.median('ssh_master_cpu_s'):.1f}) + boxes {boxes:.1f}"
        f" CPU-s, medians; on {os.cpu_count()} cores shared by both: wall >= {(controller + boxes) / CORES:.1f} s here"
    )


def _bootstrap_line(times: Dict[str, float]) -> str:
    wanted = {"Create the venv and install": "send + run the installer",
              "Build the runtime installer": "controller build step (cached)"}  # fmt: skip
    parts = [f"{short} {seconds:.1f} s" for prefix, short in wanted.items()
             for name, seconds in times.items() if prefix in name]  # fmt: skip
    return ", ".join(parts) or "(no task times)"


def _boxes(count: int) -> str:
    return f"{count} box" + ("es" if count != 1 else "")


def run(bench: Bench) -> None:
    phases = Phases()

    scratch = bench.scratch("preflight")
    cache = scratch / "wheelhouse-cache"
    build_s, installer = build_cache(cache)
    wheels = sum(path.stat().st_size for path in cache.glob("*/*.whl"))
    bench.figure("controller cache, once per controller and box Python",
                 f"download + build {build_s:.1f} s; {wheels / 1e6:.2f} MB of wheels -> one installer with the "
                 f"packages embedded, {Path(installer).stat().st_size / 1e3:.0f} kB (the landed role sent a 2.1 MB "
                 "wheelhouse, pip's wheel included, file by file)")  # fmt: skip
    bench.figure("baseline (issue 9, landed code)", BASELINE)
    pf = Preflight(bench, cache)
    phases.done("controller cache")
    fleet = Fleet(bench.scratch("fleet"))
    try:
        fleet.up([str(SCENARIO)] * BIG)
        bench.figure(f"fleet up, {BIG} boxes", f"{time.monotonic() - phases.mark:.1f} s")
        phases.done("fleet up")
        far = FarView(fleet, DELAY_MS)
        first: Dict[int, Sample] = {}
        if FIRST_50:
            first[BIG] = pf.run(fleet, BIG, f"first-{BIG}", time_tasks=True)
            forget(fleet, MID)
        first[MID] = pf.run(fleet, MID, f"first-{MID}", time_tasks=True)
        forget(fleet, 1)
        first[1] = pf.run(fleet, 1, "first-1", time_tasks=True)
        phases.done("first runs")
        if not FIRST_50:
            bootstrap_by_ssh(fleet, fleet.hosts[MID:], installer)
            phases.done(f"bootstrap of boxes {MID + 1}-{BIG} by ssh")
        for count, sample in sorted(first.items()):
            bench.figure(f"first run, {_boxes(count)}",
                         f"{sample.seconds:.1f} s (n=1); controller {sample.extra['controller_cpu_s']:.1f} CPU-s, "
                         f"boxes {sample.extra['box_cpu_s']:.1f} CPU-s; bootstrap tasks: "
                         f"{_bootstrap_line(pf.task_times.get(f'first-{count}', {}))}")  # fmt: skip
        if not FIRST_50:
            bench.figure(f"first run, {_boxes(BIG)}", "not run (about 2.5 min here; RGT_BENCH_PREFLIGHT_FIRST_50=1 "
                         f"runs it): boxes {MID + 1}-{BIG} were bootstrapped over plain ssh instead")  # fmt: skip

        sides = {
            "second run, 1 box": lambda: pf.run(fleet, 1, "second-1"),
            f"second run, {_boxes(BIG)}": lambda: pf.run(fleet, BIG, f"second-{BIG}"),
        }
        stats = bench.compare(sides, unit_keys=UNIT_KEYS)
        one, big = (stats[name] for name in sides)
        phases.done(f"second runs 1 vs {BIG} boxes x {bench.reps}")
        on_boxes(far, far.hosts[:MID], "true")  # the SSH masters a previous run through the relay would have left
        bench.figure("one SSH command over an open master (what each task pays at least once)",
                     f"{command_ms(fleet):.0f} ms, {command_ms(far):.0f} ms with {DELAY_MS} ms RTT "
                     f"(mean of {COMMAND_REPS}, box 1)")  # fmt: skip
        far_sides = {
            f"second run, {_boxes(MID)}": lambda: pf.run(fleet, MID, f"second-{MID}"),
            f"second run, {_boxes(MID)}, {DELAY_MS} ms RTT": lambda: pf.run(far, MID, f"second-{MID}-far"),
            f"second run, 1 box, {DELAY_MS} ms RTT": lambda: pf.run(far, 1, "second-1-far"),
        }
        far_stats = bench.compare(far_sides, reps=min(FAR_REPS, bench.reps), unit_keys=UNIT_KEYS[:3])
        mid, mid_far, one_far = (far_stats[name] for name in far_sides)
        phases.done(f"second runs {MID} boxes, {MID} and 1 with {DELAY_MS} ms RTT x {min(FAR_REPS, bench.reps)}")
    finally:
        fleet.down()
        shutil.rmtree(f"{fleet.control_dir}-far", ignore_errors=True)
    phases.done("fleet down")
    report(bench, pf, first, {"1": one, "big": big, "mid": mid, "mid far": mid_far, "1 far": one_far})
    bench.figure("row breakdown", phases.line())


def report(bench: Bench, pf: Preflight, first: Dict[int, Sample], second: Dict[str, Stats]) -> None:
    one, big, mid = second["1"], second["big"], second["mid"]
    bench.figure(f"{BIG}-box second run, controller CPU",
                 f"{big.median('controller_cpu_s'):.1f} CPU-s median (ansible-playbook tree by wait4, "
                 f"{big.median('controller_cpu_s') - big.median('ssh_master_cpu_s'):.1f}, + ssh masters by /proc, "
                 f"{big.median('ssh_master_cpu_s'):.1f})")  # fmt: skip
    bench.figure(f"{BIG}-box second run, peak controller memory",
                 f"sum of RSS {big.median('peak_rss_sum_mib'):.0f} MiB (shared pages counted per process), sum of "
                 f"PSS {big.median('peak_pss_sum_mib'):.0f} MiB at that peak, largest single process "
                 f"{big.median('max_single_rss_mib'):.0f} MiB (ru_maxrss); up to "
                 f"{max(s.extra['peak_processes'] for s in big.samples):.0f} processes; medians, sampled every "
                 f"{SAMPLE_EVERY_S} s (the sampler used {big.median('sampler_cpu_s'):.2f} CPU-s per run)")  # fmt: skip
    bench.figure(f"{BIG}-box second run, CPU", _cpu_line(big))
    bench.figure("1-box second run, CPU", _cpu_line(one))
    scaling = bench.ratio(f"second run {BIG} boxes vs 1 box", big, one)
    bench.target(f"second run {BIG} boxes vs 1 box", f"{scaling:.2f}x", "<= 3x", scaling <= 3)
    for count, again in ((1, one), (MID, mid), (BIG, big)):
        if count not in first:
            continue
        ratio = first[count].seconds / again.median()
        label = f"first vs second run, {_boxes(count)}"
        bench.figure(f"ratio {label}", f"{ratio:.2f}x (first n=1 / second median n={len(again.samples)})")
        bench.ratios.append((bench.row, label, ratio))
        bench.target(label, f"{ratio:.2f}x", "<= 2x", ratio <= 2)
    bench.ratio(f"second run 1 box, {DELAY_MS} ms RTT vs none", second["1 far"], one)
    bench.ratio(f"second run {MID} boxes, {DELAY_MS} ms RTT vs none", second["mid far"], mid)
    bench.figure("runs not all PASS", "; ".join(pf.problems) or "none")
