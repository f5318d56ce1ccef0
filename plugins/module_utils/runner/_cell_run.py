# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One cell's life inside the runner, once the queue (``_runner``) has handed it a slot and its GPUs.

- Its attempts (``1 + retries``), each in the cell's environment (the run's env, its secrets, ``CUDA_VISIBLE_DEVICES``
  and the run's markers), what each attempt left behind stopped and reported, and the slot given back through the
  queue's ``release`` only once no process of it is left (quarantine for those that outlived SIGKILL).
- ``exit.json`` as soon as the command has ended, BEFORE any sync: a runner killed while copying leaves the proof
  that the command succeeded, so the next start copies again instead of training again (:meth:`CellRun.recopy`).
- The sync with the cell's effective lists (its own keys, else the run's) and the run's checks, then
  ``result.json``: the contract's record that patrol and teardown read (:meth:`CellRun.done`).
- A cell the run's stop ended says who stopped it when the stopper left a record first (``stop.json`` in the run
  directory, :func:`write_stop_record`: teardown's ``stop_running``): ``reason`` ``stopped by teardown at HH:MM UTC``
  in ``exit.json`` and ``result.json``, with ``stopped_by`` ``{by, at}``; without one it stays ``run stopped``.

Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from datetime import datetime
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    RUN_MARKER,
    exit_json,
    parse_result,
    read_exit,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import CellSpec, RunSpec
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._artifact_check import Verifier
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import (
    MARKER_VARIABLE,
    Attempt,
    Outcome,
    append_line,
    build_env,
    run_attempt,
    utc_iso,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import SyncOutcome, sync_cell
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_tree import CellTree
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._env_hook import command_argv
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import (
    marker_entry,
    members,
    still_running,
)

RUNNER_VERSION = "1"
# The runner's own files in a cell directory: prune never removes them, even when it is the checkpoint directory.
OWN_CELL_FILES = ("log", "result.json", "result.prev.json", "exit.json", ".hook-status")
# How long a cell's GPUs wait for processes that outlived SIGKILL (uninterruptible sleep) before they are given up.
QUARANTINE_S = 300.0
DEFAULTS = {"PYTHONUNBUFFERED": "1", "WANDB_START_METHOD": "thread", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

# Who stopped the run and when, written by the stopper before its signal (training_run's stopped_by).
STOP_RECORD = "stop.json"
STOP_RECORD_BYTES = 4096
RUN_STOPPED = "run stopped"  # _cell_exec's reason for a cell the run's stop ended
STOPPER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")

Gpus = Optional[Tuple[int, ...]]
# The queue's side: (cell, its GPUs, it failed, its GPUs are free to hand out again).
Release = Callable[[CellSpec, Gpus, bool, bool], None]


def write_stop_record(run_dir: str, by: str, now: float) -> None:
    """Record, before the signal, that ``by`` (one word: ``teardown``) stops the run at ``now``; ValueError for a
    ``by`` that is not one."""
    if not isinstance(by, str) or not STOPPER.match(by):
        raise ValueError(f"stopped_by must be one word of letters, digits, _ . or - (at most 32), not {by!r}")
    write_json_atomic(os.path.join(run_dir, STOP_RECORD), {"by": by, "at": utc_iso(now)})


def stopped_by(run_dir: str, since: float) -> Optional[Dict[str, str]]:
    """``{by, at, reason}`` from the run's stop record when it was written at or after ``since`` (the cell's start:
    an older record is an earlier stop's), else None. The record is read bounded and checked: the box's own file."""
    try:
        with open(os.path.join(run_dir, STOP_RECORD), "rb") as handle:
            record = json.loads(handle.read(STOP_RECORD_BYTES).decode("utf-8"))
        by, at = record["by"], record["at"]
        when = datetime.fromisoformat(at)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(by, str) or not STOPPER.match(by) or when.tzinfo is None or when.timestamp() < since:
        return None
    return {"by": by, "at": at, "reason": f"stopped by {by} at {when.strftime('%H:%M')} UTC"}


class CellRun:
    """The cells of one run, each from its first attempt to its result.json (or only a re-copy)."""

    def __init__(
        self,
        run_dir: str,
        spec: RunSpec,
        *,
        environ: Mapping[str, str],
        secrets: Mapping[str, str],
        event: Callable[..., None],
        stop_event: threading.Event,
        tree: CellTree,
        started: Callable[[str, int], None],
        release: Release,
    ) -> None:
        self.run_dir = run_dir
        self.spec = spec
        self.environ = environ
        self.secrets = secrets
        self.event = event  # runner.log
        self.stop_event = stop_event
        self.tree = tree
        self.started = started  # the command of a cell got its pid (the monitor's main processes)
        self.release = release

    def _path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    def done(self, cell: CellSpec) -> bool:
        """The contract's rule, read back from the cell's result.json as patrol and teardown read it, for what this
        cell declares (its own artifact lists, else the run's)."""
        try:
            with open(self._path("cells", cell.name, "result.json"), encoding="utf-8") as handle:
                return parse_result(json.load(handle)).counts_as_done(self.spec.declares_artifacts(cell))
        except (OSError, ValueError):
            return False

    def ended(self, cell: CellSpec) -> Optional[Dict[str, Any]]:
        """How the cell's command ended, when it succeeded: exit.json, else a result.json that says succeeded (a
        runner from before exit.json)."""
        ended = read_exit(exit_json(self.run_dir, cell.name))
        if ended is None:
            ended = read_exit(self._path("cells", cell.name, "result.json"))
            if ended is not None and "command" not in ended:
                ended["command"] = list(cell.command)
        return ended if ended is not None and ended["status"] == "succeeded" else None

    def plan(self) -> Tuple[List[str], List[CellSpec], List[CellSpec], List[Dict[str, Any]]]:
        """(cells whose result is done, cells only to copy again, cells to run, run.json's view of them): a kept
        result's entry keeps the argv that produced it (``command_now`` says the spec's when it differs)."""
        skipped: List[str] = []
        recopy: List[CellSpec] = []
        pending: List[CellSpec] = []
        views: List[Dict[str, Any]] = []
        for cell in self.spec.cells:
            view: Dict[str, Any] = {"name": cell.name, "command": list(cell.command), "gpus": None}
            ended = None
            if self.done(cell):
                skipped.append(cell.name)
                view["state"] = "skipped"
                ended = read_exit(self._path("cells", cell.name, "result.json")) or read_exit(
                    exit_json(self.run_dir, cell.name)
                )
            else:
                ended = self.ended(cell)
                (recopy if ended is not None else pending).append(cell)
                view["state"] = "recopy" if ended is not None else "pending"
            if ended is not None and ended.get("command") and ended["command"] != view["command"]:
                view.update(command=list(ended["command"]), command_now=view["command"])
            views.append(view)
        return skipped, recopy, pending, views

    def _env(self, cell: CellSpec, gpus: Gpus, attempt: int, token: str) -> Dict[str, str]:
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
        self.event("cell_processes_left", cell=cell.name, count=outcome.left, waiting_s=QUARANTINE_S)

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

    def _attempts(self, cell: CellSpec, gpus: Gpus, log_path: str) -> Tuple[Outcome, float, int]:
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
                self.started(cell.name, pid)
                self.event("cell_started", cell=cell.name, attempt=f"{attempt}/{allowed}", gpus=gpus, pid=pid)

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
                self.event("gpus_held", cell=cell.name, gpus=gpus, why="processes survived SIGKILL")
            if outcome.succeeded or self.stop_event.is_set() or not freed or attempt == allowed:
                break
            self.event("cell_retry", cell=cell.name, next_attempt=f"{attempt + 1}/{allowed}")
        if outcome is None or first_start is None:
            raise RuntimeError("no attempt ran")
        outcome = dataclasses.replace(outcome, leftovers=tuple(leftovers))
        self.release(cell, gpus, not outcome.succeeded, freed)
        return outcome, first_start, attempt

    def _log_attempt(self, cell: CellSpec, attempt: str, outcome: Outcome) -> None:
        self.event(
            "cell_ended", cell=cell.name, attempt=attempt, exit=outcome.exit_code, signal=outcome.signal,
            reason=outcome.reason, leftovers=len(outcome.leftovers), hook_failed=outcome.hook_failed,
        )  # fmt: skip
        if outcome.leftovers:
            items = outcome.leftovers
            self.event(
                "cell_leftovers", cell=cell.name, attempt=attempt, pids=[item["pid"] for item in items],
                names=[item["name"] for item in items], not_stopped=[i["pid"] for i in items if not i["stopped"]],
            )  # fmt: skip

    def execute(self, cell: CellSpec, gpus: Gpus) -> None:
        """The cell's attempts, exit.json, its sync when the command succeeded, result.json."""
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
        stop = stopped_by(self.run_dir, first_start) if outcome.reason == RUN_STOPPED else None
        if stop is not None:
            append_line(log_path, f"[rgt {utc_iso(time.time())}] {stop['reason']}")
        sync = SyncOutcome("skipped")
        ended = {
            "schema": 1, "cell": cell.name, "status": "succeeded" if outcome.succeeded else "failed",
            "exit_code": outcome.exit_code, "signal": outcome.signal, "started_at": utc_iso(first_start),
            "ended_at": utc_iso(outcome.ended_at), "attempts": attempt,
            "reason": outcome.reason or (None if outcome.succeeded else described), "command": list(cell.command),
            "checkpoint_dir": base, "gpus": list(gpus) if gpus is not None else None,
            "hook_failed": outcome.hook_failed,
            "stopped_by": {"by": stop["by"], "at": stop["at"]} if stop is not None else None,
        }  # fmt: skip
        if stop is not None:
            ended["reason"] = stop["reason"]
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
        verifier = Verifier(spec.verify_cmd, spec.verify_timeout_s, spec.check_finite, spec.verify_artifacts)
        sync = sync_cell(
            base, prune_patterns=spec.prune_of(cell), artifact_patterns=spec.artifacts_of(cell),
            optional_patterns=spec.optional_artifacts_of(cell), durable_dir=spec.durable_dir, run=spec.run,
            cell=cell.name, stopped=self.stop_event.is_set, launch_id=spec.launch_id, verifier=verifier,
            keep=[os.path.join(directory, name) for name in OWN_CELL_FILES],
        )  # fmt: skip
        self._log_sync(cell, sync, log_path)
        return sync

    def _write_result(
        self, cell: CellSpec, ended: Mapping[str, Any], sync: SyncOutcome, recopied: bool, leftovers: List[Any]
    ) -> None:
        """result.json from the command's end (exit.json's fields) and the sync."""
        keys = (
            "status", "exit_code", "signal", "started_at", "ended_at", "attempts", "reason", "gpus", "command",
            "stopped_by",
        )  # fmt: skip
        result = {"schema": 1, "cell": cell.name, **{key: ended.get(key) for key in keys}}
        result.update(
            hook_failed=bool(ended.get("hook_failed")), recopied=recopied, sync=sync.sync, sync_error=sync.error,
            sync_reason=sync.error,  # the same text under the name Molecule's launch scenario reads
            artifacts=list(sync.artifacts), pruned=list(sync.pruned), verify=list(sync.verify), leftovers=leftovers,
            synced_at=utc_iso(time.time()) if sync.sync == "verified" else None, runner_version=RUNNER_VERSION,
        )  # fmt: skip
        write_json_atomic(self._path("cells", cell.name, "result.json"), result)
        self.event(
            "cell_result", cell=cell.name, status=result["status"], sync=sync.sync, attempts=result["attempts"],
            recopied=recopied,
        )  # fmt: skip

    def recopy(self, cells: Sequence[CellSpec]) -> None:
        """Copy again the artifacts of cells whose command succeeded but whose result is not done (their sync
        failed, or a runner died while copying): never their command again."""
        for cell in cells:
            if self.stop_event.is_set():
                return
            ended = self.ended(cell)
            if ended is None:  # it was there when the run started
                continue
            directory = self._path("cells", cell.name)
            written = ended.get("checkpoint_dir")
            base = written if isinstance(written, str) and os.path.isabs(written) else cell.checkpoint_dir or directory
            log_path = os.path.join(directory, "log")
            now = utc_iso(time.time())
            append_line(log_path, f"[rgt {now}] re-copy: the command succeeded at {ended['ended_at']}; not run again")
            self.event("cell_recopy", cell=cell.name, ended_at=ended["ended_at"])
            try:
                sync = self._sync(cell, base, log_path)
                self._write_result(cell, ended, sync, recopied=True, leftovers=[])
            except Exception as exc:  # one cell's fault must not end the others' re-copies
                self.event("cell_runner_error", cell=cell.name, error=f"{type(exc).__name__}: {exc}")

    def _log_sync(self, cell: CellSpec, sync: SyncOutcome, log_path: str) -> None:
        now = utc_iso(time.time())
        for line in sync.log_lines():
            append_line(log_path, f"[rgt {now}] {line}")
        if sync.sync == "verified":
            self.event("sync_verified", cell=cell.name, files=len(sync.artifacts), bytes=sync.total_bytes)
        elif sync.sync == "failed":
            self.event("sync_failed", cell=cell.name, why=sync.error)
