# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The on-box runner of one training run: ``python3 <run>/runner/run.py <run>``, detached by ``training_run``.

It reads ``spec.json`` (and the 0600 ``.secrets.json``) and runs the cells with no controller attached, keeping the
layout of contracts/run-layout.md: ``run.json`` before the first cell starts (rewritten when a cell is handed its
GPUs), each cell's ``log`` and ``result.json``, ``monitor.jsonl``, and ``DONE`` last, only when every cell
succeeded and its sync verified. What it guarantees:

- One runner per run (an flock on ``<run>/.runner.lock``), and no cell left running by an earlier, dead runner of
  the same run (processes carrying the run's marker are stopped first): never two copies of one cell.
- Resume: a cell whose result says succeeded and verified (or skipped, without artifacts) is skipped; a cell whose
  command succeeded (``exit.json``, written before its sync) but whose result is not done is only copied again,
  never retrained; the rest run. Temporary copies a killed sync left in the durable copy are cleared first.
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
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    RUN_MARKER,
    durable_run_dir,
    exit_json,
    parse_result,
    read_exit,
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
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._artifact_check import Verifier
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import (
    KILL_WAIT_S,
    MARKER_VARIABLE,
    Attempt,
    Outcome,
    append_line,
    build_env,
    marker_entry,
    members,
    own_ids,
    run_attempt,
    still_running,
    stop_processes,
    ticks_now,
    utc_iso,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import (
    SyncOutcome,
    clear_temp_copies,
    durable_owner,
    launch_conflict,
    sync_cell,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_tree import CellTree, become_subreaper
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._env_hook import command_argv
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._gpu_claims import GpuClaims
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import Monitor, open_nvml

RUNNER_VERSION = "1"
PACKAGE = "ansible_collections.remote_gpu.trainer.plugins.module_utils"
# Every module_utils file the runner imports, directly or not: training_run installs exactly these under
# <run>/runner/ansible_collections/... (a test runs the runner from a tree holding only them).
RUNNER_MODULES = (
    "runner/_runner.py", "runner/_cell_exec.py", "runner/_cell_sync.py", "runner/_monitor.py", "layout/_runspec.py",
    "layout/_runs.py", "box/_disk.py", "common/_deadline.py", "box/_cgroup.py", "common/_files.py",
    "runner/_cell_tree.py", "runner/_gpu_claims.py", "runner/_env_hook.py", "runner/_cell_files.py",
    "runner/_artifact_check.py", "teardown/_load_verify.py", "common/_command.py",
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
# The runner's own files in a cell directory: prune never removes them, even when it is the checkpoint directory.
OWN_CELL_FILES = ("log", "result.json", "result.prev.json", "exit.json", ".hook-status")
# How long a cell's GPUs wait for processes that outlived SIGKILL (uninterruptible sleep) before they are given up.
QUARANTINE_S = 300.0
DEFAULTS = {"PYTHONUNBUFFERED": "1", "WANDB_START_METHOD": "thread", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


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

    def _done(self, cell: CellSpec) -> bool:
        """The contract's rule, read back from the cell's result.json as patrol and teardown read it, for what this
        cell declares (its own artifact lists, else the run's)."""
        try:
            with open(self._path("cells", cell.name, "result.json"), encoding="utf-8") as handle:
                return parse_result(json.load(handle)).counts_as_done(self.spec.declares_artifacts(cell))
        except (OSError, ValueError):
            return False

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
        skipped, recopy, pending = self._plan()
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
        copier = threading.Thread(target=self._recopy, args=(recopy,), name="rgt-recopy", daemon=True)
        copier.start()
        try:
            self._schedule(pending)
        finally:
            copier.join()
            monitor.stop()
        missing = [cell.name for cell in spec.cells if not self._done(cell)]
        if not missing:
            write_json_atomic(self._path("DONE"), {"run": spec.run, "done_at": utc_iso(time.time())})
            self.log.event("run_done", cells=len(spec.cells))
            return EXIT_DONE
        self.log.event("run_ended", stopped=self.stop_event.is_set(), not_done=missing)
        return EXIT_STOPPED if self.stop_signal is not None else EXIT_NOT_DONE

    def _plan(self) -> Tuple[List[str], List[CellSpec], List[CellSpec]]:
        """(cells whose result is done, cells only to copy again, cells to run) and run.json's view of them: a kept
        result's entry keeps the argv that produced it (``command_now`` says the spec's when it differs)."""
        skipped: List[str] = []
        recopy: List[CellSpec] = []
        pending: List[CellSpec] = []
        self.cells_view = []
        for cell in self.spec.cells:
            view: Dict[str, Any] = {"name": cell.name, "command": list(cell.command), "gpus": None}
            ended = None
            if self._done(cell):
                skipped.append(cell.name)
                view["state"] = "skipped"
                ended = read_exit(self._path("cells", cell.name, "result.json")) or read_exit(
                    exit_json(self.run_dir, cell.name)
                )
            else:
                ended = self._ended(cell)
                (recopy if ended is not None else pending).append(cell)
                view["state"] = "recopy" if ended is not None else "pending"
            if ended is not None and ended.get("command") and ended["command"] != view["command"]:
                view.update(command=list(ended["command"]), command_now=view["command"])
            self.cells_view.append(view)
        return skipped, recopy, pending

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

    def _release(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]], failed: bool) -> None:
        with self.cond:
            self.failed = self.failed or failed  # before the slot frees: stop_on_failure starts nothing more
            self.pids.pop(cell.name, None)
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
            self._execute(cell, gpus)
        except Exception as exc:  # a runner fault in one cell must not take the queue down, nor hold its slot
            self.log.event("cell_runner_error", cell=cell.name, error=f"{type(exc).__name__}: {exc}")
            self._release(cell, gpus, failed=True)
        finally:
            with self.cond:
                self.active.discard(cell.name)
                self.cond.notify_all()

    def _env(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]], attempt: int, token: str) -> Dict[str, str]:
        directory = self._path("cells", cell.name)
        own = {
            "RGT_RUN": self.spec.run, RUN_MARKER: self.run_dir, "RGT_CELL": cell.name, "RGT_CELL_DIR": directory,
            "RGT_CKPT_DIR": cell.checkpoint_dir or directory, "RGT_ATTEMPT": str(attempt), MARKER_VARIABLE: token,
        }  # fmt: skip
        if gpus is not None:
            own["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in gpus)
        base = {k: v for k, v in self.environ.items() if k != "RGT_DETACH"}
        return build_env(base, DEFAULTS, self.spec.env, self.secrets, own)

    def _quarantine(self, outcome: Outcome, marker: bytes, cell: CellSpec) -> bool:
        """Wait for processes that outlived SIGKILL; False when they are still there (the GPUs stay held)."""
        self.log.event("cell_processes_left", cell=cell.name, count=outcome.left, waiting_s=QUARANTINE_S)

        def gone() -> bool:
            self.tree.reap()  # a survivor the runner adopted ends as its zombie
            found = members(outcome.pgid, marker, since_ticks=outcome.since_ticks)
            return not found and not still_running(outcome.survivors)

        until = time.monotonic() + QUARANTINE_S
        while time.monotonic() < until and not self.stop_event.is_set():
            if gone():
                return True
            time.sleep(1.0)
        return gone()

    def _attempts(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]], log_path: str) -> Tuple[Outcome, float, int]:
        """Run the cell's attempts and give back its slot; (the last outcome with every attempt's leftovers, when
        the first attempt started, attempts made)."""
        allowed = 1 + cell.retries
        where = f"GPUs {','.join(map(str, gpus))}" if gpus is not None else "every GPU"
        hook_status = os.path.join(os.path.dirname(log_path), ".hook-status")  # written when the env hook fails
        argv = command_argv(cell.command, self.spec.env_hook, self.spec.conda_env, hook_status)
        first_start: Optional[float] = None
        outcome: Optional[Outcome] = None
        leftovers: List[Dict[str, Any]] = []  # every attempt's
        freed = True
        for attempt in range(1, allowed + 1):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(hook_status)
            token = f"{self.spec.run}.{cell.name}.{attempt}.{os.urandom(6).hex()}"
            marker = marker_entry(MARKER_VARIABLE, token)
            append_line(log_path, f"[rgt {utc_iso(time.time())}] attempt {attempt}/{allowed} starting on {where}")

            def started(pid: int, attempt: int = attempt) -> None:
                self.pids[cell.name] = pid
                self.log.event("cell_started", cell=cell.name, attempt=f"{attempt}/{allowed}", gpus=gpus, pid=pid)

            attempt_spec = Attempt(
                argv, self.spec.workdir, self._env(cell, gpus, attempt, token), log_path, cell.timeout_s,
                self.spec.stop_grace_s, marker, self.spec.env_hook, hook_status,
            )  # fmt: skip
            tracker = self.tree.attempt(cell.name)
            try:
                outcome = run_attempt(attempt_spec, self.stop_event, started, tracker)
            finally:
                tracker.close()
            first_start = first_start if first_start is not None else outcome.started_at
            append_line(log_path, f"[rgt {utc_iso(time.time())}] attempt {attempt}/{allowed} {outcome.describe()}")
            self._log_attempt(cell, f"{attempt}/{allowed}", outcome)
            leftovers.extend(outcome.leftovers)
            freed = not outcome.left or self._quarantine(outcome, marker, cell)
            if not freed:
                self.log.event("gpus_held", cell=cell.name, gpus=gpus, why="processes survived SIGKILL")
            if outcome.succeeded or self.stop_event.is_set() or not freed or attempt == allowed:
                break
            self.log.event("cell_retry", cell=cell.name, next_attempt=f"{attempt + 1}/{allowed}")
        if outcome is None or first_start is None:
            raise RuntimeError("no attempt ran")
        outcome = dataclasses.replace(outcome, leftovers=tuple(leftovers))
        if freed:
            self._release(cell, gpus, failed=not outcome.succeeded)
        else:
            with self.cond:
                self.failed = self.failed or not outcome.succeeded
                self.pids.pop(cell.name, None)
        return outcome, first_start, attempt

    def _log_attempt(self, cell: CellSpec, attempt: str, outcome: Outcome) -> None:
        self.log.event(
            "cell_ended", cell=cell.name, attempt=attempt, exit=outcome.exit_code, signal=outcome.signal,
            reason=outcome.reason, leftovers=len(outcome.leftovers), hook_failed=outcome.hook_failed,
        )  # fmt: skip
        if outcome.leftovers:
            items = outcome.leftovers
            self.log.event(
                "cell_leftovers", cell=cell.name, attempt=attempt, pids=[item["pid"] for item in items],
                names=[item["name"] for item in items], not_stopped=[i["pid"] for i in items if not i["stopped"]],
            )  # fmt: skip

    def _execute(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]]) -> None:
        directory = self._path("cells", cell.name)
        base = cell.checkpoint_dir or directory
        os.makedirs(base, exist_ok=True)
        os.makedirs(directory, exist_ok=True)
        result_path = os.path.join(directory, "result.json")
        if os.path.exists(result_path):  # stale: patrol must not read an old failure while the cell reruns
            os.replace(result_path, os.path.join(directory, "result.prev.json"))
        log_path = os.path.join(directory, "log")
        outcome, first_start, attempt = self._attempts(cell, gpus, log_path)
        described = outcome.describe()
        sync = SyncOutcome("skipped")
        ended = {
            "schema": 1, "cell": cell.name, "status": "succeeded" if outcome.succeeded else "failed",
            "exit_code": outcome.exit_code, "signal": outcome.signal, "started_at": utc_iso(first_start),
            "ended_at": utc_iso(outcome.ended_at), "attempts": attempt,
            "reason": outcome.reason or (None if outcome.succeeded else described), "command": list(cell.command),
            "checkpoint_dir": base, "gpus": list(gpus) if gpus is not None else None,
            "hook_failed": outcome.hook_failed,
        }  # fmt: skip
        # Before any sync: a runner killed while copying leaves the proof that the command succeeded, so the next
        # start copies again instead of training again.
        write_json_atomic(exit_json(self.run_dir, cell.name), ended)
        if outcome.succeeded:
            sync = self._sync(cell, base, log_path)
        self._write_result(cell, ended, sync, recopied=False, leftovers=list(outcome.leftovers))

    def _sync(self, cell: CellSpec, base: str, log_path: str) -> SyncOutcome:
        """The cell's sync with its effective lists (its own keys, else the run's) and the run's checks."""
        spec = self.spec
        directory = self._path("cells", cell.name)
        sync = sync_cell(
            base, prune_patterns=spec.prune_of(cell), artifact_patterns=spec.artifacts_of(cell),
            optional_patterns=spec.optional_artifacts_of(cell), durable_dir=spec.durable_dir, run=spec.run,
            cell=cell.name, stopped=self.stop_event.is_set, launch_id=spec.launch_id,
            verifier=Verifier(spec.verify_cmd, spec.verify_timeout_s, spec.check_finite),
            keep=[os.path.join(directory, name) for name in OWN_CELL_FILES],
        )  # fmt: skip
        self._log_sync(cell, sync, log_path)
        return sync

    def _write_result(
        self, cell: CellSpec, ended: Mapping[str, Any], sync: SyncOutcome, recopied: bool, leftovers: List[Any]
    ) -> None:
        """result.json from the command's end (exit.json's fields) and the sync."""
        keys = ("status", "exit_code", "signal", "started_at", "ended_at", "attempts", "reason", "gpus", "command")
        result = {"schema": 1, "cell": cell.name, **{key: ended.get(key) for key in keys}}
        result.update(
            hook_failed=bool(ended.get("hook_failed")), recopied=recopied, sync=sync.sync, sync_error=sync.error,
            sync_reason=sync.error,  # the same text under the name Molecule's launch scenario reads
            artifacts=list(sync.artifacts), pruned=list(sync.pruned), verify=list(sync.verify), leftovers=leftovers,
            synced_at=utc_iso(time.time()) if sync.sync == "verified" else None, runner_version=RUNNER_VERSION,
        )  # fmt: skip
        write_json_atomic(self._path("cells", cell.name, "result.json"), result)
        self.log.event(
            "cell_result", cell=cell.name, status=result["status"], sync=sync.sync, attempts=result["attempts"],
            recopied=recopied,
        )  # fmt: skip

    def _recopy(self, cells: Sequence[CellSpec]) -> None:
        """Copy again the artifacts of cells whose command succeeded but whose result is not done (their sync
        failed, or a runner died while copying): never their command again."""
        for cell in cells:
            if self.stop_event.is_set():
                return
            ended = self._ended(cell)
            if ended is None:  # it was there when the run started
                continue
            directory = self._path("cells", cell.name)
            written = ended.get("checkpoint_dir")
            base = written if isinstance(written, str) and os.path.isabs(written) else cell.checkpoint_dir or directory
            log_path = os.path.join(directory, "log")
            now = utc_iso(time.time())
            append_line(log_path, f"[rgt {now}] re-copy: the command succeeded at {ended['ended_at']}; not run again")
            self.log.event("cell_recopy", cell=cell.name, ended_at=ended["ended_at"])
            try:
                sync = self._sync(cell, base, log_path)
                self._write_result(cell, ended, sync, recopied=True, leftovers=[])
            except Exception as exc:  # one cell's fault must not end the others' re-copies
                self.log.event("cell_runner_error", cell=cell.name, error=f"{type(exc).__name__}: {exc}")

    def _ended(self, cell: CellSpec) -> Optional[Dict[str, Any]]:
        """How the cell's command ended, when it succeeded: exit.json, else a result.json that says succeeded (a
        runner from before exit.json)."""
        ended = read_exit(exit_json(self.run_dir, cell.name))
        if ended is None:
            ended = read_exit(self._path("cells", cell.name, "result.json"))
            if ended is not None and "command" not in ended:
                ended["command"] = list(cell.command)
        return ended if ended is not None and ended["status"] == "succeeded" else None

    def _log_sync(self, cell: CellSpec, sync: SyncOutcome, log_path: str) -> None:
        now = utc_iso(time.time())
        for line in sync.log_lines():
            append_line(log_path, f"[rgt {now}] {line}")
        if sync.sync == "verified":
            self.log.event("sync_verified", cell=cell.name, files=len(sync.artifacts), bytes=sync.total_bytes)
        elif sync.sync == "failed":
            self.log.event("sync_failed", cell=cell.name, why=sync.error)


def install_runner(destination: str, read: Callable[[str], bytes]) -> List[str]:
    """Write ``run.py`` and every ``RUNNER_MODULES`` file (``read(name)`` gives its bytes) under ``destination``."""
    package = os.path.join(destination, *PACKAGE.split("."))
    for name in RUNNER_MODULES:
        os.makedirs(os.path.dirname(os.path.join(package, name)), exist_ok=True)
    files = [(os.path.join(package, name), read(name), 0o644) for name in RUNNER_MODULES]
    files.append((os.path.join(destination, "run.py"), RUN_PY.encode("utf-8"), 0o755))
    for path, data, mode in files:
        temporary = f"{path}.{os.urandom(4).hex()}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)  # a runner that is importing sees the old file or the new one
    return [path for path, _data, _mode in files]


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
