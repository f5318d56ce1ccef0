# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The on-box runner of one training run: ``python3 <run>/runner/run.py <run>``, detached by ``training_run``.

It reads ``spec.json`` (and the 0600 ``.secrets.json``) and runs the cells with no controller attached, keeping the
layout of contracts/run-layout.md: ``run.json`` before the first cell starts (rewritten when a cell is handed its
GPUs), each cell's ``log`` and ``result.json``, ``monitor.jsonl``, and ``DONE`` last, only when every cell
succeeded and its sync verified. What it guarantees:

- One runner per run (an flock on ``<run>/.runner.lock``), and no cell left running by an earlier, dead runner of
  the same run (processes carrying the run's marker are stopped first): never two copies of one cell.
- Resume: done cells are skipped, a cell whose command succeeded but whose copy did not is only copied again
  (``_cell_run``: one cell's attempts, exit.json, sync, result.json), the rest run. Temporary copies a killed sync
  left in the durable copy are cleared first.
- One launch per durable copy: a run torn down (its tombstone) or whose durable copy holds another launch is refused
  before anything is written, and each sync claims the durable directory for this launch (``.launch.json``).
- GPUs: ``gpus_per_cell`` null is the whole box, one cell at a time; otherwise each cell gets its own GPUs
  (``CUDA_VISIBLE_DEVICES``), and a GPU goes to the next cell only once the previous cell's processes are gone.
- SIGTERM / SIGINT stop every running cell (SIGTERM to its group, SIGKILL after ``stop_grace_s``) and record it as
  failed (``reason: run stopped``); SIGHUP is ignored (the SSH session that started the run may go away).
- ``runner.log``: one line per event, never an environment value; secret values are redacted from every line.

Pure standard library (Python 3.8+), installed into the run directory (``RUNNER_MODULES``) so a run never depends
on a later version of the collection on the box.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    RUN_MARKER,
    durable_run_dir,
    tombstone_path,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import (
    CellSpec,
    RunSpec,
    load_spec,
    read_secrets,
    runner_log,
    secrets_json,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import (
    KILL_WAIT_S,
    append_line,
    stop_processes,
    utc_iso,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_run import RUNNER_VERSION, CellRun
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import (
    clear_temp_copies,
    durable_owner,
    launch_conflict,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_tree import CellTree, become_subreaper
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._gpu_claims import GpuClaims
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import Monitor, open_nvml
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import marker_entry, own_ids, ticks_now

PACKAGE = "ansible_collections.remote_gpu.trainer.plugins.module_utils"
# Every module_utils file the runner imports, directly or not: training_run installs exactly these under
# <run>/runner/ansible_collections/... (a test runs the runner from a tree holding only them).
RUNNER_MODULES = (
    "runner/_runner.py", "runner/_cell_run.py", "runner/_cell_exec.py", "runner/_cell_sync.py", "runner/_monitor.py",
    "layout/_runspec.py", "layout/_runs.py", "box/_disk.py", "common/_deadline.py", "box/_cgroup.py",
    "common/_files.py", "runner/_cell_tree.py", "runner/_gpu_claims.py", "runner/_env_hook.py", "runner/_cell_files.py",
    "runner/_artifact_check.py", "teardown/_load_verify.py", "common/_command.py", "runner/_procfs.py",
    "instance/_box_state.py",
)  # fmt: skip
RUN_PY = f'''#!/usr/bin/env python3
"""The runner of one training run, installed by remote_gpu.trainer.training_run: run.py <run_dir>."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from {PACKAGE}.runner._runner import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''
EXIT_DONE, EXIT_NOT_DONE, EXIT_USAGE, EXIT_REFUSED, EXIT_LOCKED, EXIT_STOPPED = 0, 1, 2, 3, 75, 143
# The durable directory is often a network mount: a look at its launch record must not hang the start.
DURABLE_PROBE_S = 10.0
# Clearing a killed sync's temporary copies walks the cells' durable copies: bounded too, but longer.
TEMP_CLEAR_S = 60.0


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value) or "-"
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' ="\n\t') else text


class RunnerLog:
    """``runner.log``: ``<UTC time> <event> key=value ...`` a line; any secret value is replaced by <redacted>."""

    def __init__(self, path: str, secrets: Optional[Mapping[str, str]] = None) -> None:
        self.path = path
        self._secrets = sorted((v for v in (secrets or {}).values() if len(v) >= 4), key=len, reverse=True)
        self._lock = threading.Lock()

    def event(self, name: str, **fields: Any) -> None:
        line = f"{utc_iso(time.time())} {name}" + "".join(f" {key}={_text(value)}" for key, value in fields.items())
        for secret in self._secrets:
            line = line.replace(secret, "<redacted>")
        with self._lock, contextlib.suppress(OSError):  # a full data disk must not end the runner through its log
            append_line(self.path, line)


class Runner:
    """One run's queue of cells; :meth:`run` returns the exit code, :meth:`request_stop` is the signal handler."""

    def __init__(self, run_directory: str, environ: Optional[Mapping[str, str]] = None) -> None:
        self.run_dir = os.path.abspath(run_directory)
        self.environ = dict(os.environ if environ is None else environ)
        self.log = RunnerLog(runner_log(self.run_dir))
        self.stop_event = threading.Event()
        self.stop_signal: Optional[int] = None
        self.cond = threading.Condition()
        self.active: Set[str] = set()  # cells whose thread runs
        self.holding: Set[str] = set()  # cells holding a slot (and GPUs)
        self.pids: Dict[str, int] = {}  # running cell -> its command's pid (the monitor's main processes)
        self.failed = False
        self.cells_view: List[Dict[str, Any]] = []
        self.free_gpus: List[int] = []
        self.spec: RunSpec
        self.cell_run: CellRun  # each cell's life, once the spec is read
        self.secrets: Dict[str, str] = {}
        self.run_record: Dict[str, Any] = {}
        self.started_ticks: Optional[int] = None
        # What each cell starts, also what leaves its group and marker; main() makes the runner a subreaper.
        self.tree = CellTree(self._others_busy)
        self.claims: Optional[GpuClaims] = None  # the GPUs other runs' live cells hold, once the spec is read
        self.slot_opened = True  # the claims are read again before the next cell takes GPUs
        self.gpus_waiting = False  # cells wait for GPUs other runs hold (gpus_wait is logged once a wait)

    def _others_busy(self, cell: str) -> bool:
        with self.cond:
            return bool(self.active - {cell})

    def request_stop(self, signum: int, frame: Any = None) -> None:
        # Only a flag: the handler may interrupt the main thread while it holds the log's or the queue's lock.
        self.stop_signal = signum
        self.stop_event.set()

    def _path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    def run(self) -> int:
        try:
            self.spec = load_spec(self.run_dir)
            self.secrets = read_secrets(self.run_dir)
            if os.path.realpath(self.spec.run_dir) != os.path.realpath(self.run_dir):
                raise ValueError(f"the spec's run directory is {self.spec.run_dir}, not {self.run_dir}")
        except (OSError, ValueError) as exc:
            self.log.event("runner_refused", why=f"the run spec cannot be used: {exc}")
            return EXIT_USAGE
        self.log = RunnerLog(runner_log(self.run_dir), self.secrets)
        lock_fd = os.open(self._path(".runner.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.log.event("runner_refused", why="another runner holds this run", pid=os.getpid())
                return EXIT_LOCKED
            return self._run_locked()
        except Exception as exc:  # the log must say why the runner ended, whatever happened
            self.stop_event.set()
            self.log.event("runner_crashed", error=f"{type(exc).__name__}: {exc}")
            # The cell threads see the stop and end their cells: none is left running without a runner.
            until = time.monotonic() + 2 * self.spec.stop_grace_s + KILL_WAIT_S + 5
            with self.cond:
                while self.active and time.monotonic() < until:
                    self.cond.wait(0.1)
            return EXIT_NOT_DONE
        finally:
            os.close(lock_fd)

    def _refusal(self, resumed: bool) -> Optional[str]:
        """Why this runner must not start: its run was torn down, or its durable copy is another launch's."""
        spec = self.spec
        tombstone = tombstone_path(spec.data_dir, spec.run)
        if os.path.lexists(tombstone):
            return f"run {spec.run} was torn down ({tombstone}); launch it as a new attempt"
        if spec.durable_dir is None or spec.launch_id is None:
            return None
        durable_run = durable_run_dir(spec.durable_dir, spec.run)
        answer = run_with_deadline({"owner": functools.partial(durable_owner, durable_run)}, DURABLE_PROBE_S)["owner"]
        if "value" not in answer:  # each sync claims the directory again before it copies anything
            self.log.event("durable_unchecked", why=answer.get("error") or f"no answer within {DURABLE_PROBE_S:g} s")
            return None
        conflict = launch_conflict(durable_run, answer["value"], spec.launch_id, resumed)
        return f"{conflict}, this run is launch {spec.launch_id}" if conflict else None

    def _run_locked(self) -> int:
        spec = self.spec
        self.started_ticks = ticks_now()
        resumed = os.path.exists(self._path("run.json"))
        refusal = self._refusal(resumed)
        if refusal is not None:
            self.log.event("runner_refused", why=refusal)
            return EXIT_REFUSED
        if os.path.exists(secrets_json(self.run_dir)):
            os.chmod(secrets_json(self.run_dir), 0o600)
        self.cell_run = CellRun(
            self.run_dir, spec, environ=self.environ, secrets=self.secrets, event=self.log.event,
            stop_event=self.stop_event, tree=self.tree, started=self.pids.__setitem__, release=self._release,
        )  # fmt: skip
        skipped, recopy, pending, self.cells_view = self.cell_run.plan()
        if (pending or recopy) and os.path.exists(self._path("DONE")):
            os.unlink(self._path("DONE"))
        self.free_gpus = sorted(set(spec.gpus))
        with open(self._path("spec.json"), "rb") as handle:
            spec_sha256 = hashlib.sha256(handle.read()).hexdigest()
        detach = "tmux" if self.environ.get("RGT_DETACH") == "tmux" else "setsid"
        pgid, sid = own_ids()
        self.run_record = {
            "schema": 1, "run": spec.run, "started_at": utc_iso(time.time()), "pgid": pgid,
            "sid": sid, "pids": [os.getpid()], "detach": detach, "data_dir": spec.data_dir,
            "durable_dir": spec.durable_dir, "workdir": spec.workdir, "cells": self.cells_view,
            "gpus": list(spec.gpus), "gpus_per_cell": spec.gpus_per_cell, "shard": spec.shard, "resumed": resumed,
            "skipped_cells": skipped, "recopy_cells": [cell.name for cell in recopy],
            "runner_version": RUNNER_VERSION, "spec_sha256": spec_sha256, "launch_id": spec.launch_id,
        }  # fmt: skip
        self._write_run_json()
        self.log.event("runner_started", pid=os.getpid(), version=RUNNER_VERSION, resumed=resumed, slots=spec.slots())
        # A dead runner's cells may live on (they are not in its process group): stop them before any cell reruns.
        earlier = stop_processes(None, marker_entry(RUN_MARKER, self.run_dir), spec.stop_grace_s)
        if earlier.found:
            self.log.event("earlier_processes_stopped", count=earlier.found, left=earlier.left)
        for name in skipped:
            self.log.event("cell_skipped", cell=name, why="already succeeded and synced")
        self._clear_durable_temp()  # before any copy of this start: a killed sync's leftovers go
        monitor = Monitor(
            self._path("monitor.jsonl"),
            interval_s=spec.monitor_interval_s,
            max_bytes=spec.monitor_max_bytes,
            directories={"data": spec.data_dir, "durable": spec.durable_dir},
            marker=marker_entry(RUN_MARKER, self.run_dir),
            cells=lambda: dict(self.pids),
            since_ticks=self.started_ticks,
            nvml=open_nvml(),
        )
        monitor.start()
        # Re-copies need no GPU: they run beside the queue instead of before it.
        copier = threading.Thread(target=self.cell_run.recopy, args=(recopy,), name="rgt-recopy", daemon=True)
        copier.start()
        try:
            self._schedule(pending)
        finally:
            copier.join()
            monitor.stop()
        missing = [cell.name for cell in spec.cells if not self.cell_run.done(cell)]
        if not missing:
            write_json_atomic(self._path("DONE"), {"run": spec.run, "done_at": utc_iso(time.time())})
            self.log.event("run_done", cells=len(spec.cells))
            return EXIT_DONE
        self.log.event("run_ended", stopped=self.stop_event.is_set(), not_done=missing)
        return EXIT_STOPPED if self.stop_signal is not None else EXIT_NOT_DONE

    def _clear_durable_temp(self) -> None:
        """Remove the temporary copies a killed sync of this run's cells left in its durable copy."""
        spec = self.spec
        if spec.durable_dir is None:
            return
        durable_run = durable_run_dir(spec.durable_dir, spec.run)
        clear = functools.partial(clear_temp_copies, durable_run, [cell.name for cell in spec.cells])
        answer = run_with_deadline({"clear": clear}, TEMP_CLEAR_S)["clear"]
        if "value" not in answer:
            self.log.event("durable_temp_unchecked", why=answer.get("error") or f"no answer within {TEMP_CLEAR_S:g} s")
        elif answer["value"]:
            self.log.event("durable_temp_cleared", count=len(answer["value"]), files=answer["value"][:20])

    def _write_run_json(self) -> None:
        write_json_atomic(self._path("run.json"), self.run_record)

    def _take_gpus(self) -> Tuple[bool, Optional[Tuple[int, ...]]]:
        """(a slot could be had, the GPUs it brings: None for the whole box when no other run holds one of them).

        A GPU a live cell of another run holds is never taken (``launch_allow_concurrent``); while too few are
        left, ``gpus_waiting`` is set and the claims are read again every few seconds (at once after a release).
        """
        per_cell = self.spec.gpus_per_cell
        if self.claims is None:  # no GPUs named: nothing to place
            return True, None
        if per_cell is not None and len(self.free_gpus) < per_cell:
            self.gpus_waiting = False  # this run's own cells hold them: their release wakes the queue
            return False, None
        others = self.claims.held(fresh=self.slot_opened)
        self.slot_opened = False
        box = sorted(set(self.spec.gpus))
        usable = [gpu for gpu in (box if per_cell is None else self.free_gpus) if gpu not in others]
        if len(usable) < (per_cell or 1):
            if not self.gpus_waiting:
                self.log.event("gpus_wait", held_by_other_runs=sorted(others), free=usable)
            self.gpus_waiting = True
            return False, None
        self.gpus_waiting = False
        if per_cell is None:
            return True, None if usable == box else tuple(usable)
        taken = tuple(usable[:per_cell])
        self.free_gpus = [gpu for gpu in self.free_gpus if gpu not in taken]
        return True, taken

    def _schedule(self, queue: List[CellSpec]) -> None:
        slots = self.spec.slots()
        stop_logged = False
        if self.spec.gpus:
            self.claims = GpuClaims(self.spec.data_dir, self.run_dir)
        self.log.event("cell_tracking", subreaper=self.tree.subreaper)
        self.tree.start()
        try:
            with self.cond:
                while True:
                    if self.stop_signal is not None and not stop_logged:
                        self.log.event("stop_requested", signal=self.stop_signal, running=sorted(self.active))
                        stop_logged = True
                    blocked = self.stop_event.is_set() or (self.spec.stop_on_failure and self.failed)
                    if not blocked and queue and len(self.holding) < slots:
                        with self.claims.claiming() if self.claims is not None else contextlib.nullcontext():
                            while queue and len(self.holding) < slots:
                                ok, gpus = self._take_gpus()
                                if not ok:
                                    break
                                self._start(queue.pop(0), gpus)
                    if not self.active and not (queue and not blocked and self.gpus_waiting):
                        if queue and not blocked:  # nothing runs, yet nothing can start: GPUs never freed
                            self.log.event("cells_blocked", cells=[c.name for c in queue], free_gpus=self.free_gpus)
                        break
                    self.cond.wait(0.1)
        finally:
            self.tree.stop()
        if queue and self.failed and self.spec.stop_on_failure:
            self.log.event("stop_on_failure", not_started=[c.name for c in queue])

    def _start(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]]) -> None:
        self.active.add(cell.name)
        self.holding.add(cell.name)
        views = {view["name"]: view for view in self.cells_view}
        views[cell.name].update(gpus=list(gpus) if gpus is not None else None, state="started", gpus_held=True)
        self._write_run_json()  # under the claims lock: other runs see these GPUs taken before they choose
        threading.Thread(target=self._cell_main, args=(cell, gpus), name=f"rgt-cell-{cell.name}", daemon=True).start()

    def _release(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]], failed: bool, freed: bool = True) -> None:
        """The cell's command has ended; its slot and GPUs go back unless ``freed`` is false (processes outlived
        SIGKILL: they stay held)."""
        with self.cond:
            self.failed = self.failed or failed  # before the slot frees: stop_on_failure starts nothing more
            self.pids.pop(cell.name, None)
            if not freed:
                return
            if cell.name in self.holding:
                self.holding.discard(cell.name)
                self.slot_opened = True
                for view in self.cells_view:
                    if view["name"] == cell.name:
                        view["gpus_held"] = False  # other runs may take them now
                self._write_run_json()
                if gpus:
                    self.free_gpus = sorted(set(self.free_gpus) | set(gpus))
                    self.log.event("gpus_released", cell=cell.name, gpus=gpus)
            self.cond.notify_all()

    def _cell_main(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]]) -> None:
        try:
            self.cell_run.execute(cell, gpus)
        except Exception as exc:  # a runner fault in one cell must not take the queue down, nor hold its slot
            self.log.event("cell_runner_error", cell=cell.name, error=f"{type(exc).__name__}: {exc}")
            self._release(cell, gpus, failed=True)
        finally:
            with self.cond:
                self.active.discard(cell.name)
                self.cond.notify_all()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``run.py <run_dir>``: run the run's cells; the exit code says DONE (0), not done (1), stopped (143)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: run.py <run_dir>\n")
        return EXIT_USAGE
    runner = Runner(args[0])
    runner.tree.subreaper = become_subreaper()  # a cell's orphans come back to the runner, not to init
    previous = {signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_IGN)}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, runner.request_stop)
    try:
        return runner.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
