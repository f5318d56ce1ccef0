# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run's resource monitor: the seed's ``mem_monitor.sh``, as a thread of the runner writing ``monitor.jsonl``.

Every ``monitor_interval_s`` one JSON object a line: cgroup memory current and limit (v1 or v2; the seed caught
validation-phase spikes that wedge a container at its cgroup limit), the run's processes (its session, plus any
process carrying the run's marker in its environment) with their total RSS and CPU time, each running cell's
main process (RSS, threads, fds), the tracker's service process (``wandb-service`` / ``wandb-core``), the box's
CPU use, bytes and inodes free on the data and durable directories, and per-GPU utilization and memory from
NVML (pynvml, when the runner's Python has it: the runtime venv does), else ``nvidia-smi``. Every probe is
bounded: the directories are read in forked children under a deadline (a dead mount must not stop the samples),
nvidia-smi under a timeout, and a probe that timed out rests for a while instead of piling up stuck children. The
file is rotated to ``monitor.jsonl.1`` past ``monitor_max_bytes``. Standard library (Python 3.8+) and Linux /proc;
pynvml only if present.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

try:  # optional: the runtime venv has it; without it the GPUs are read with nvidia-smi
    import pynvml
except ImportError:
    pynvml = None

from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._cgroup import (
    cgroup_memory_limit,
    parse_proc_cgroup,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.box._disk import probe_usage
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_exec import utc_iso
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import (
    CLOCK_TICKS,
    ProcStat,
    environ_has,
    list_procs,
    own_ids,
)

DISK_TIMEOUT_S = 5.0
GPU_TIMEOUT_S = 10.0
# Samples a probe that timed out sits out before it is tried again.
REST_SAMPLES = 10
TRACKER_NAMES = ("wandb-service", "wandb-core")
GPU_QUERY = (
    "nvidia-smi",
    "--query-gpu=index,utilization.gpu,memory.used,memory.total",
    "--format=csv,noheader,nounits",
)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Dict[str, Any]:
    """{version, memory_current, memory_max} of this process's memory cgroup; None where unknown or unlimited."""
    version, limit = cgroup_memory_limit(proc_cgroup, root)
    current = None
    try:
        with open(proc_cgroup) as handle:
            unified, memory_v1 = parse_proc_cgroup(handle.read())
    except OSError:
        unified = memory_v1 = None
    candidates: List[str] = []
    if version == 1 and memory_v1 is not None:
        candidates = [os.path.join(root, "memory", memory_v1.lstrip("/"), "memory.usage_in_bytes")]
        candidates.append(os.path.join(root, "memory", "memory.usage_in_bytes"))
    elif version == 2 and unified is not None:
        candidates = [os.path.join(root, unified.lstrip("/"), "memory.current"), os.path.join(root, "memory.current")]
    for candidate in candidates:  # a container sees its own cgroup at the mount root
        current = _read_int(candidate)
        if current is not None:
            break
    return {"version": version, "memory_current": current, "memory_max": limit}


def cpu_times(path: str = "/proc/stat") -> Optional[Tuple[int, int]]:
    """(busy, total) jiffies of the whole box."""
    try:
        with open(path) as handle:
            fields = [int(value) for value in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _fds(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read(4096).replace(b"\0", b" ").decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_processes(marker: bytes, since_ticks: Optional[int] = None) -> List[ProcStat]:
    """The run's live processes: the runner's session, and whatever left it but carries the run's marker (only
    processes started since ``since_ticks`` are searched: none of the run's is older than its runner)."""
    own_pgid, own_sid = own_ids()
    found = []
    for stat in list_procs():
        if stat.state == "Z":
            continue
        recent = since_ticks is None or stat.start_ticks >= since_ticks
        ours = stat.sid == own_sid if own_sid is not None else own_pgid is not None and stat.pgid == own_pgid
        if ours or (recent and environ_has(stat.pid, marker)):
            found.append(stat)
    return found


def parse_gpu_csv(text: str) -> List[Dict[str, Optional[float]]]:
    """nvidia-smi's ``index, utilization.gpu, memory.used, memory.total`` lines; "[N/A]" reads as None."""

    def number(value: str) -> Optional[float]:
        try:
            return float(value.strip())
        except ValueError:
            return None

    gpus = []
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) != 4 or number(parts[0]) is None:
            continue
        index, util, used, total = (number(part) for part in parts)
        gpus.append({"index": int(index or 0), "util_pct": util, "memory_used_mib": used, "memory_total_mib": total})
    return gpus


def open_nvml() -> Any:
    """pynvml, initialised, when the runner's Python has it and the driver answers; else None (nvidia-smi then)."""
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no package, no libnvidia-ml, no driver: the nvidia-smi query stands in
        return None
    return pynvml


def nvml_gpus(nvml: Any) -> List[Dict[str, Optional[float]]]:
    """Utilization and memory (MiB) of every GPU through NVML, the fields of ``parse_gpu_csv``; a GPU that does not
    answer (lost, or the reading unsupported) reads as None where it failed."""
    gpus: List[Dict[str, Optional[float]]] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        gpu: Dict[str, Any] = {"index": index, "util_pct": None, "memory_used_mib": None, "memory_total_mib": None}
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpu["util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpu["memory_used_mib"] = round(memory.used / 2**20, 1)
            gpu["memory_total_mib"] = round(memory.total / 2**20, 1)
        except nvml.NVMLError:
            pass
        gpus.append(gpu)
    return gpus


def bounded_output(argv: Sequence[str], timeout_s: float) -> Tuple[Optional[int], str]:
    """(rc, stdout) of a command under a timeout; rc None when it timed out. A child that does not die on
    SIGKILL (stuck in the driver) is abandoned, never waited for without a bound."""
    try:
        # Not run_command: the monitor runs in the detached runner, with no AnsibleModule.
        proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
    except OSError:
        return 127, ""
    try:
        out, _err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        return None, ""
    return proc.returncode, out.decode("utf-8", errors="replace")


class Monitor:
    """Samples into ``path`` from a daemon thread until :meth:`stop`; :meth:`sample` is one sample, for tests."""

    def __init__(
        self,
        path: str,
        *,
        interval_s: float,
        max_bytes: int,
        directories: Mapping[str, Optional[str]],
        marker: bytes,
        cells: Callable[[], Dict[str, int]] = dict,
        gpu_query: Sequence[str] = GPU_QUERY,
        since_ticks: Optional[int] = None,
        nvml: Any = None,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.directories = {name: path for name, path in directories.items() if path}
        self.marker = marker
        self.cells = cells
        self.since_ticks = since_ticks
        self.gpu_query = tuple(gpu_query)
        self.nvml = nvml  # an initialised pynvml (open_nvml) is asked first; nvidia-smi when there is none
        self._gpu_missing = shutil.which(self.gpu_query[0]) is None
        self._resting: Dict[str, int] = {}
        self._cpu = cpu_times()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rgt-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.write(self.sample())
            except Exception as exc:  # a failed sample is a line saying so, never the end of the monitor
                with contextlib.suppress(OSError):
                    self.write({"ts": utc_iso(time.time()), "error": f"{type(exc).__name__}: {exc}"})
            self._stop.wait(self.interval_s)

    def _rest(self, probe: str) -> bool:
        """Whether ``probe`` timed out recently and sits this sample out."""
        left = self._resting.get(probe, 0)
        if left > 0:
            self._resting[probe] = left - 1
        return left > 0

    def _disk(self) -> Dict[str, Any]:
        wanted = {name: path for name, path in self.directories.items() if not self._rest(f"disk:{name}")}
        answers = probe_usage(sorted(set(wanted.values())), DISK_TIMEOUT_S) if wanted else {}
        disk: Dict[str, Any] = {}
        for name, path in self.directories.items():
            if name not in wanted:
                disk[name] = {"path": path, "skipped": "timed out recently"}
                continue
            answer = answers.get(path, {})
            if answer.get("timed_out"):
                self._resting[f"disk:{name}"] = REST_SAMPLES
            keys = ("path", "exists", "error", "timed_out", "probe_error", "bytes_free", "bytes_used_pct")
            keys += ("inodes_free", "inodes_used_pct")
            disk[name] = {key: answer[key] for key in keys if key in answer}
        return disk

    def _gpus(self) -> Tuple[Optional[List[Dict[str, Any]]], Optional[str]]:
        if self.nvml is not None:
            try:
                return nvml_gpus(self.nvml), None
            except Exception as exc:  # NVML failing as a whole (driver gone): say so, and keep sampling the rest
                return None, f"NVML: {type(exc).__name__}: {exc}"
        if self._gpu_missing:
            return None, f"{self.gpu_query[0]} not found"
        if self._rest("gpu"):
            return None, f"{self.gpu_query[0]} timed out recently"
        rc, out = bounded_output(self.gpu_query, GPU_TIMEOUT_S)
        if rc is None:
            self._resting["gpu"] = REST_SAMPLES
            return None, f"{self.gpu_query[0]} did not answer within {GPU_TIMEOUT_S:g} s"
        if rc != 0:
            return None, f"{self.gpu_query[0]} exited {rc}"
        return parse_gpu_csv(out), None

    def _cpu_pct(self) -> Optional[float]:
        now = cpu_times()
        before, self._cpu = self._cpu, now
        if now is None or before is None or now[1] <= before[1]:
            return None
        return round(100.0 * (now[0] - before[0]) / (now[1] - before[1]), 1)

    def sample(self) -> Dict[str, Any]:
        now = time.time()
        procs = run_processes(self.marker, self.since_ticks)
        by_pid = {p.pid: p for p in procs}
        cells = {}
        for name, pid in sorted(self.cells().items()):
            main = by_pid.get(pid)
            if main is not None:
                cells[name] = {"pid": pid, "rss_bytes": main.rss_bytes, "threads": main.threads, "fds": _fds(pid)}
        trackers = [p for p in procs if any(name in _cmdline(p.pid) for name in TRACKER_NAMES)]
        gpus, gpu_error = self._gpus()
        return {
            "ts": utc_iso(now),
            "t": round(now, 3),
            "cgroup": cgroup_memory(),
            "cpu_pct": self._cpu_pct(),
            "run": {
                "procs": len(procs),
                "rss_bytes": sum(p.rss_bytes for p in procs),
                "cpu_s": round(sum(p.cpu_ticks for p in procs) / CLOCK_TICKS, 2),
            },
            "cells": cells,
            "tracker": (
                {"pids": [p.pid for p in trackers], "rss_bytes": sum(p.rss_bytes for p in trackers)}
                if trackers
                else None
            ),
            "disk": self._disk(),
            "gpus": gpus,
            "gpu_error": gpu_error,
        }

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one line, first rotating the file to ``.1`` when the line would take it past ``max_bytes``."""
        line = (json.dumps(sample, sort_keys=True) + "\n").encode("utf-8")
        try:
            size = os.path.getsize(self.path)
        except OSError:
            size = 0
        if size and size + len(line) > self.max_bytes:
            os.replace(self.path, f"{self.path}.1")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
