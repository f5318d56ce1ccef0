# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The on-box runner of one training run: ``python3 <run>/runner/run.py <run>``, detached by ``training_run``.

It reads ``spec.json`` (and the 0600 ``.secrets.json``) and runs the cells with no controller attached, keeping the
layout of contracts/run-layout.md: ``run.json`` before the first cell starts (rewritten when a cell is handed its
GPUs), each cell's ``log`` and ``result.json``, ``monitor.jsonl``, and ``DONE`` last, only when every cell
succeeded and its sync verified. What it guarantees:

- One runner per run (an flock on ``<run>/.runner.lock``), and no cell left running by an earlier, dead runner of
  the same run (processes carrying the run's marker are stopped first): never two copies of one cell.
- Resume: a cell whose result says succeeded and verified (or skipped, without artifacts) is skipped; the rest run.
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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    RUN_MARKER,
    durable_run_dir,
    parse_result,
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
    MARKER_VARIABLE,
    Attempt,
    Outcome,
    append_line,
    build_env,
    command_argv,
    marker_entry,
    members,
    own_ids,
    run_attempt,
    stop_processes,
    ticks_now,
    utc_iso,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import (
    SyncOutcome,
    durable_owner,
    launch_conflict,
    sync_cell,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import Monitor, open_nvml

RUNNER_VERSION = "1"
PACKAGE = "ansible_collections.remote_gpu.trainer.plugins.module_utils"
# Every module_utils file the runner imports, directly or not: training_run installs exactly these under
# <run>/runner/ansible_collections/... (a test runs the runner from a tree holding only them).
RUNNER_MODULES = (
    "runner/_runner.py", "runner/_cell_exec.py", "runner/_cell_sync.py", "runner/_monitor.py", "layout/_runspec.py",
    "layout/_runs.py", "box/_disk.py", "common/_deadline.py", "box/_cgroup.py", "common/_files.py",
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
        """The contract's rule, read back from the cell's result.json as patrol and teardown read it."""
        try:
            with open(self._path("cells", cell.name, "result.json"), encoding="utf-8") as handle:
                return parse_result(json.load(handle)).counts_as_done(bool(self.spec.artifacts))
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
        skipped = [cell.name for cell in spec.cells if self._done(cell)]
        pending = [cell for cell in spec.cells if cell.name not in skipped]
        if pending and os.path.exists(self._path("DONE")):
            os.unlink(self._path("DONE"))
        self.free_gpus = sorted(set(spec.gpus))
        states = {c.name: "skipped" if c.name in skipped else "pending" for c in spec.cells}
        self.cells_view = [
            {"name": c.name, "command": list(c.command), "gpus": None, "state": states[c.name]} for c in spec.cells
        ]
        with open(self._path("spec.json"), "rb") as handle:
            spec_sha256 = hashlib.sha256(handle.read()).hexdigest()
        detach = "tmux" if self.environ.get("RGT_DETACH") == "tmux" else "setsid"
        pgid, sid = own_ids()
        self.run_record = {
            "schema": 1, "run": spec.run, "started_at": utc_iso(time.time()), "pgid": pgid,
            "sid": sid, "pids": [os.getpid()], "detach": detach, "data_dir": spec.data_dir,
            "durable_dir": spec.durable_dir, "workdir": spec.workdir, "cells": self.cells_view,
            "gpus": list(spec.gpus), "gpus_per_cell": spec.gpus_per_cell, "shard": spec.shard, "resumed": resumed,
            "skipped_cells": skipped, "runner_version": RUNNER_VERSION, "spec_sha256": spec_sha256,
            "launch_id": spec.launch_id,
        }  # fmt: skip
        self._write_run_json()
        self.log.event("runner_started", pid=os.getpid(), version=RUNNER_VERSION, resumed=resumed, slots=spec.slots())
        # A dead runner's cells may live on (they are not in its process group): stop them before any cell reruns.
        earlier = stop_processes(None, marker_entry(RUN_MARKER, self.run_dir), spec.stop_grace_s)
        if earlier.found:
            self.log.event("earlier_processes_stopped", count=earlier.found, left=earlier.left)
        for name in skipped:
            self.log.event("cell_skipped", cell=name, why="already succeeded and synced")
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
        try:
            self._schedule(pending)
        finally:
            monitor.stop()
        missing = [cell.name for cell in spec.cells if not self._done(cell)]
        if not missing:
            write_json_atomic(self._path("DONE"), {"run": spec.run, "done_at": utc_iso(time.time())})
            self.log.event("run_done", cells=len(spec.cells))
            return EXIT_DONE
        self.log.event("run_ended", stopped=self.stop_event.is_set(), not_done=missing)
        return EXIT_STOPPED if self.stop_signal is not None else EXIT_NOT_DONE

    def _write_run_json(self) -> None:
        write_json_atomic(self._path("run.json"), self.run_record)

    def _take_gpus(self) -> Tuple[bool, Optional[Tuple[int, ...]]]:
        """(a slot could be had, the GPUs it brings: None for the whole box)."""
        per_cell = self.spec.gpus_per_cell
        if per_cell is None or not self.spec.gpus:
            return True, None
        if len(self.free_gpus) < per_cell:
            return False, None
        taken, self.free_gpus = tuple(self.free_gpus[:per_cell]), self.free_gpus[per_cell:]
        return True, taken

    def _schedule(self, queue: List[CellSpec]) -> None:
        slots = self.spec.slots()
        stop_logged = False
        with self.cond:
            while True:
                if self.stop_signal is not None and not stop_logged:
                    self.log.event("stop_requested", signal=self.stop_signal, running=sorted(self.active))
                    stop_logged = True
                blocked = self.stop_event.is_set() or (self.spec.stop_on_failure and self.failed)
                while not blocked and queue and len(self.holding) < slots:
                    ok, gpus = self._take_gpus()
                    if not ok:
                        break
                    self._start(queue.pop(0), gpus)
                if not self.active:
                    if queue and not blocked:  # nothing runs, yet nothing can start: GPUs that were never freed
                        self.log.event("cells_blocked", cells=[c.name for c in queue], free_gpus=self.free_gpus)
                    break
                self.cond.wait(0.1)
        if queue and self.failed and self.spec.stop_on_failure:
            self.log.event("stop_on_failure", not_started=[c.name for c in queue])

    def _start(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]]) -> None:
        self.active.add(cell.name)
        self.holding.add(cell.name)
        views = {view["name"]: view for view in self.cells_view}
        views[cell.name].update(gpus=list(gpus) if gpus is not None else None, state="started")
        self._write_run_json()
        threading.Thread(target=self._cell_main, args=(cell, gpus), name=f"rgt-cell-{cell.name}", daemon=True).start()

    def _release(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]], failed: bool) -> None:
        with self.cond:
            self.failed = self.failed or failed  # before the slot frees: stop_on_failure starts nothing more
            self.pids.pop(cell.name, None)
            if cell.name in self.holding:
                self.holding.discard(cell.name)
                if gpus:
                    self.free_gpus = sorted(self.free_gpus + list(gpus))
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
        until = time.monotonic() + QUARANTINE_S
        while time.monotonic() < until and not self.stop_event.is_set():
            if not members(outcome.pgid, marker, since_ticks=outcome.since_ticks):
                return True
            time.sleep(1.0)
        return not members(outcome.pgid, marker, since_ticks=outcome.since_ticks)

    def _execute(self, cell: CellSpec, gpus: Optional[Tuple[int, ...]]) -> None:
        directory = self._path("cells", cell.name)
        base = cell.checkpoint_dir or directory
        os.makedirs(base, exist_ok=True)
        os.makedirs(directory, exist_ok=True)
        result_path = os.path.join(directory, "result.json")
        if os.path.exists(result_path):  # stale: patrol must not read an old failure while the cell reruns
            os.replace(result_path, os.path.join(directory, "result.prev.json"))
        log_path = os.path.join(directory, "log")
        allowed = 1 + cell.retries
        where = f"GPUs {','.join(map(str, gpus))}" if gpus is not None else "every GPU"
        argv = command_argv(cell.command, self.spec.env_hook, self.spec.conda_env)
        first_start: Optional[float] = None
        outcome: Optional[Outcome] = None
        freed = True
        for attempt in range(1, allowed + 1):
            token = f"{self.spec.run}.{cell.name}.{attempt}.{os.urandom(6).hex()}"
            marker = marker_entry(MARKER_VARIABLE, token)
            append_line(log_path, f"[rgt {utc_iso(time.time())}] attempt {attempt}/{allowed} starting on {where}")

            def started(pid: int, attempt: int = attempt) -> None:
                self.pids[cell.name] = pid
                self.log.event("cell_started", cell=cell.name, attempt=f"{attempt}/{allowed}", gpus=gpus, pid=pid)

            attempt_spec = Attempt(
                argv, self.spec.workdir, self._env(cell, gpus, attempt, token), log_path, cell.timeout_s,
                self.spec.stop_grace_s, marker,
            )  # fmt: skip
            outcome = run_attempt(attempt_spec, self.stop_event, started)
            first_start = first_start if first_start is not None else outcome.started_at
            described = outcome.describe()
            append_line(log_path, f"[rgt {utc_iso(time.time())}] attempt {attempt}/{allowed} {described}")
            self.log.event(
                "cell_ended", cell=cell.name, attempt=f"{attempt}/{allowed}", exit=outcome.exit_code,
                signal=outcome.signal, reason=outcome.reason, leftovers=outcome.leftovers,
            )  # fmt: skip
            freed = not outcome.left or self._quarantine(outcome, marker, cell)
            if not freed:
                self.log.event("gpus_held", cell=cell.name, gpus=gpus, why="processes survived SIGKILL")
            if outcome.succeeded or self.stop_event.is_set() or not freed or attempt == allowed:
                break
            self.log.event("cell_retry", cell=cell.name, next_attempt=f"{attempt + 1}/{allowed}")
        if outcome is None or first_start is None:
            raise RuntimeError("no attempt ran")
        if freed:
            self._release(cell, gpus, failed=not outcome.succeeded)
        else:
            with self.cond:
                self.failed = self.failed or not outcome.succeeded
                self.pids.pop(cell.name, None)
        sync = SyncOutcome("skipped")
        if outcome.succeeded:
            sync = sync_cell(
                base, prune_patterns=self.spec.prune, artifact_patterns=self.spec.artifacts,
                durable_dir=self.spec.durable_dir, run=self.spec.run, cell=cell.name, stopped=self.stop_event.is_set,
                launch_id=self.spec.launch_id,
            )  # fmt: skip
            self._log_sync(cell, sync, log_path)
        reason = outcome.reason or (None if outcome.succeeded else described)
        result = {
            "schema": 1, "cell": cell.name, "status": "succeeded" if outcome.succeeded else "failed",
            "exit_code": outcome.exit_code, "signal": outcome.signal, "started_at": utc_iso(first_start),
            "ended_at": utc_iso(outcome.ended_at), "attempts": attempt, "reason": reason,
            "gpus": list(gpus) if gpus is not None else None, "sync": sync.sync, "sync_error": sync.error,
            "sync_reason": sync.error,  # the same text under the name Molecule's launch scenario reads
            "artifacts": list(sync.artifacts), "pruned": list(sync.pruned),
            "synced_at": utc_iso(time.time()) if sync.sync == "verified" else None, "runner_version": RUNNER_VERSION,
        }  # fmt: skip
        write_json_atomic(result_path, result)
        self.log.event("cell_result", cell=cell.name, status=result["status"], sync=sync.sync, attempts=attempt)

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
    previous = {signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_IGN)}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, runner.request_stop)
    try:
        return runner.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
