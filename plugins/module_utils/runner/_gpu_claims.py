# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPUs that live cells of OTHER runs on this box hold (``launch_allow_concurrent``): never handed out here.

Each runner writes, in its ``run.json``, every cell it started with its GPUs (``cells[].gpus``, null for the run's
every GPU) and ``gpus_held`` (false once the cell gave them back). A cell holds its GPUs while its state is
``started``, ``gpus_held`` is not false, and its run's runner lives (the rule of ``_proctree.run_is_live``: a
launcher of the run lives and was born before the run started, so a reused pid is no launcher). The other runs are
those of every data dir of the box (``_known_data_dirs``: the data dirs launches registered, and those a
live run's marker names), not only the runner's own. The runners of one box take their GPUs under one lock file,
in the instance directory (``<data_dir>/runs/.gpu-claims.lock`` when it cannot be written), so two runs never take
the same free GPU at once, whatever their data dirs.

Pure standard library (Python 3.8+), Linux /proc.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import time
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Set

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import (
    instance_dir,
    known_data_dirs,
    marker_data_dirs,
    registered_data_dirs,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MAX_RUN_JSON_BYTES,
    Run,
    parse_run,
    runs_root,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import CLOCK_TICKS, read_stat

CLAIMS_LOCK = ".gpu-claims.lock"
LAUNCHER_BIRTH_SLACK_S = 120.0  # as _proctree: the runner starts a moment before it writes started_at
RECHECK_S = 3.0  # while cells wait for GPUs other runs hold, their run.json files are read this often
LOCK_WAIT_S = 2.0  # a lock that cannot be had (a hung mount) is given up: the claims are read without it
OTHER_DIRS_TIMEOUT_S = 5.0  # the box's other data dirs are read in a child: a hung mount must not stall the runner


def boot_time(path: str = "/proc/stat") -> Optional[float]:
    try:
        with open(path, "rb") as handle:
            for line in handle:
                if line.startswith(b"btime"):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def runner_alive(run: Run, proc: str = "/proc") -> bool:
    """Whether a launcher of ``run`` (its group or session leader, or a registered pid) lives and is no reuse."""
    boot = boot_time(f"{proc}/stat")
    candidates = [(run.pgid, "pgid"), (run.sid, "sid")] + [(pid, "") for pid in run.pids]
    for pid, leads in candidates:
        stat = read_stat(pid, proc) if pid is not None and pid > 1 else None
        if stat is None or stat.state == "Z" or (leads and getattr(stat, leads) != pid):
            continue
        if run.started_at is None or boot is None:
            return True
        if boot + stat.start_ticks / CLOCK_TICKS <= run.started_at + LAUNCHER_BIRTH_SLACK_S:
            return True
    return False


def held_gpus(record: Dict[str, Any]) -> Set[int]:
    """The GPUs the started cells of one run.json still hold (whether its runner lives is not asked here)."""
    every = [g for g in record.get("gpus") or [] if isinstance(g, int) and not isinstance(g, bool)]
    held: Set[int] = set()
    for cell in record.get("cells") or []:
        if not isinstance(cell, dict) or cell.get("state") != "started" or cell.get("gpus_held") is False:
            continue
        gpus = cell.get("gpus")
        held.update(every if gpus is None else (g for g in gpus if isinstance(g, int) and not isinstance(g, bool)))
    return held


def _held_in(data_dir: str, own_run_dir: str, proc: str) -> Set[int]:
    """The GPUs held by live cells of the runs under ``data_dir`` other than ``own_run_dir``."""
    root = runs_root(data_dir)
    own = os.path.realpath(own_run_dir)
    held: Set[int] = set()
    try:
        with os.scandir(root) as found:
            entries = [e for e in found if not e.name.startswith(".") and e.is_dir()]
    except OSError:
        return held
    for entry in entries:
        if os.path.realpath(entry.path) == own:
            continue
        path = os.path.join(entry.path, "run.json")
        try:
            with open(path, "rb") as handle:
                record = json.loads(handle.read(MAX_RUN_JSON_BYTES + 1))
            gpus = held_gpus(record)
            if gpus and runner_alive(parse_run(entry.name, path, record), proc):
                held |= gpus
        except (OSError, ValueError):  # no run.json yet, or one being replaced: no runner has handed it GPUs
            continue
    return held


def _held_elsewhere(data_dir: str, own_run_dir: str, proc: str) -> List[int]:
    paths, _problems = known_data_dirs([data_dir], proc=proc)
    held: Set[int] = set()
    for path in paths[1:]:
        held |= _held_in(path, own_run_dir, proc)
    return sorted(held)


def held_by_others(data_dir: str, own_run_dir: str, proc: str = "/proc") -> Set[int]:
    """The GPUs held by live cells of the box's runs other than ``own_run_dir``: those under ``data_dir``, and those
    of every other data dir of the box (read in a child under a deadline, and only when the box has one)."""
    held = _held_in(data_dir, own_run_dir, proc)
    entries, _problem = registered_data_dirs()
    candidates = {os.path.normpath(entry["path"]) for entry in entries} | set(marker_data_dirs(proc))
    if candidates - {os.path.normpath(data_dir)}:
        others = functools.partial(_held_elsewhere, data_dir, own_run_dir, proc)
        answer = run_with_deadline({"others": others}, OTHER_DIRS_TIMEOUT_S)["others"]
        held.update(answer.get("value") or [])
    return held


class GpuClaims:
    """The GPUs other runs hold, read again when asked (a slot opened) or every ``RECHECK_S`` while waiting."""

    def __init__(self, data_dir: str, own_run_dir: str, recheck_s: float = RECHECK_S) -> None:
        self.data_dir = data_dir
        self.own_run_dir = own_run_dir
        self.recheck_s = recheck_s
        self._held: FrozenSet[int] = frozenset()
        self._read_at: Optional[float] = None

    def held(self, fresh: bool = False) -> FrozenSet[int]:
        now = time.monotonic()
        if fresh or self._read_at is None or now - self._read_at >= self.recheck_s:
            self._held = frozenset(held_by_others(self.data_dir, self.own_run_dir))
            self._read_at = now
        return self._held

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """The box's claims lock, held while GPUs are chosen and the choice is written to run.json: one file for the
        whole box (the runners of every data dir take it), else the data dir's own."""
        fd: Optional[int] = None
        for where in (instance_dir(), runs_root(self.data_dir)):
            with contextlib.suppress(OSError):
                os.makedirs(where, mode=0o700, exist_ok=True)
                fd = os.open(os.path.join(where, CLAIMS_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                break
        try:
            until = time.monotonic() + LOCK_WAIT_S
            while fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() >= until:
                        break
                    time.sleep(0.01)
            yield
        finally:
            if fd is not None:
                os.close(fd)
