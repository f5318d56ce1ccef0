"""Issue 9 row 4: reading and parsing a long kernel log, against ``grep -iE 'NVRM: Xid'`` on the same file.

The log: 1 M lines (~97 MB) in ``dmesg --time-format=iso`` form, 1% of them Xid lines, the shapes of the real lines
in ../shared/captures/kmsg (ISO stamps, pci / network / filesystem noise, Xids with pid, name and detail).
The module side is a fresh Python process doing what gpu_health does: ``read_kernel_log`` with the module's
runner, ``dmesg`` being a stand-in that prints the file, then ``parse_kernel_log`` on the kept lines. Each side's
peak RSS is its child's ``ru_maxrss`` from ``os.wait4``.

The target compares the read and parse themselves, timed inside that process, with grep's whole run: gpu_health
starts its interpreter and imports once per call whatever it reads (row gpu_health counts that cost), so it is not
the kernel log's. The fresh process's wall is printed beside it. The "pipe floor" side is the least any reader of
``dmesg`` pays, timed the same way: the file drained through a pipe into 1 MiB reads, nothing kept. grep reads the
file itself; a kernel log only reaches the module through dmesg's (or journalctl's) pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _harness import Bench, Sample, Stats
from collection_path import collection_root

ROW = "kernel log read+parse"
LINES = 1_000_000
XID_EVERY = 100  # 1% Xid lines
# Seen in the captures: dmesg --time-format=iso stamps, then the message.
STAMP = "2025-01-{day:02d}T{hour:02d}:{minute:02d}:{second:02d},{micro:06d}+00:00 "
NOISE = (
    "pci 0000:{b:02x}:00.{f}: [8086:09a{f}] type 00 class 0x088000",
    "IPv6: ADDRCONF(NETDEV_CHANGE): cali{n:08x}: link becomes ready",
    "EXT4-fs (nvme{f}n1p1): mounted filesystem, ordered data mode",
    'audit: type=1400 audit({n}.{b:03d}:{f}): apparmor="STATUS" name="runc"',
    "nvidia-peermem nv_get_p2p_free_callback:{b} ERROR invalid context",
)
XID = (
    "NVRM: Xid (PCI:0000:{b:02x}:00): {code}, pid={pid}, name=pt_main_thread, Ch 00000008, intr 00000000. "
    "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_{f} faulted @ 0x7f2f_{n:08x}"
)
CODES = (13, 31, 43, 48, 79, 94, 119)
MAX_LINES = 200_000  # the module's default cap (DEFAULT_MAX_LINES)

# The module side: exactly gpu_health's read and parse; prints what it kept and found.
CHILD = """
import json, sys
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import subprocess_runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._kernel_log import read_kernel_log
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid import parse_kernel_log
import time
start = time.perf_counter()
log = read_kernel_log(subprocess_runner, 60.0)
events = parse_kernel_log(log["lines"])
seconds = time.perf_counter() - start
xids = sum(e["count"] for e in events if e["event"] == "xid")
print(json.dumps({"seconds": seconds, "source": log["source"], "bytes_read": log["bytes_read"],
                  "bytes_decoded": log["bytes_decoded"], "truncated": log["truncated"], "xids": xids}))
"""
# The part of the module side no parser can avoid: start, import, and drain dmesg's 1 MiB pipe to its end.
PIPE_FLOOR = """
import fcntl, json, os, subprocess, time
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common import _command, _kernel_log, _xid
start = time.perf_counter()
proc = subprocess.Popen(["dmesg"], stdout=subprocess.PIPE)
fcntl.fcntl(proc.stdout.fileno(), 1031, 1 << 20)
while os.read(proc.stdout.fileno(), 1 << 20):
    pass
proc.wait()
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def write_log(path: Path) -> Tuple[int, int]:
    """The synthetic log; (Xid lines in it, Xid lines among its last MAX_LINES lines)."""
    xids = xids_in_tail = 0
    with open(path, "w", encoding="utf-8") as log:
        batch: List[str] = []
        for i in range(LINES):
            stamp = STAMP.format(
                day=1 + i // 864_000 % 28, hour=i // 36_000 % 24, minute=i // 600 % 60, second=i // 10 % 60,
                micro=(i * 7919) % 1_000_000,
            )  # fmt: skip
            fields = {"b": 0x18 + i % 8, "f": i % 8, "n": (i * 2654435761) % 2**32}
            if i % XID_EVERY == 0:
                batch.append(stamp + XID.format(code=CODES[i // XID_EVERY % len(CODES)], pid=1000 + i, **fields))
                xids += 1
                xids_in_tail += i >= LINES - MAX_LINES
            else:
                batch.append(stamp + NOISE[i % len(NOISE)].format(**fields))
            if len(batch) == 10_000:
                log.write("\n".join(batch) + "\n")
                batch = []
        log.write("\n".join(batch) + ("\n" if batch else ""))
    return xids, xids_in_tail


def _child(argv: List[str], env: Dict[str, str]) -> Tuple[float, float, bytes]:
    """(wall seconds, peak RSS MiB, stdout) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    if proc.returncode not in (0, 1):  # grep exits 1 when nothing matched
        raise SystemExit(f"{argv[0]} exited {proc.returncode}")
    return seconds, usage.ru_maxrss / 1024, out


def run(bench: Bench) -> None:
    scratch = bench.scratch("kernel_log")
    log = scratch / "kern.log"
    xids, xids_in_tail = write_log(log)
    bench.figure("log", f"{LINES:,} lines, {log.stat().st_size / 1e6:.1f} MB, {xids:,} Xid lines "
                 f"({xids_in_tail:,} in the last {MAX_LINES:,})")  # fmt: skip
    bin_dir = scratch / "bin"
    bin_dir.mkdir(exist_ok=True)
    dmesg = bin_dir / "dmesg"
    dmesg.write_text(f"#!/bin/sh\nexec cat {log}\n", encoding="utf-8")  # any flags: the file, as dmesg would
    dmesg.chmod(0o755)
    module_env = dict(os.environ, PYTHONPATH=str(collection_root()), PATH=f"{bin_dir}:{os.environ['PATH']}")
    seen: Dict[str, dict] = {}

    def module_side() -> Sample:
        seconds, rss, out = _child([sys.executable, "-c", CHILD], module_env)
        seen["module"] = json.loads(out)
        return Sample(seen["module"]["seconds"], extra={"process_wall_s": seconds, "peak_rss_mib": rss})

    def grep_side() -> Sample:
        seconds, rss, out = _child(["grep", "-iE", "NVRM: Xid", str(log)], dict(os.environ, LC_ALL="C"))
        seen["grep"] = {"xids": out.count(b"\n")}
        return Sample(seconds, extra={"peak_rss_mib": rss})

    def pipe_floor_side() -> Sample:
        seconds, rss, out = _child([sys.executable, "-c", PIPE_FLOOR], module_env)
        return Sample(json.loads(out)["seconds"], extra={"process_wall_s": seconds, "peak_rss_mib": rss})

    sides = {"module": module_side, "grep": grep_side, "pipe floor": pipe_floor_side}
    stats = bench.compare(sides, unit_keys=[("process_wall_s", "s"), ("peak_rss_mib", "MiB")])
    found = seen["module"]
    with open(log, "rb") as data:  # the lines the module kept, counted here so the child only does gpu_health's work
        data.seek(-found["bytes_decoded"], os.SEEK_END)
        lines_kept = data.read().count(b"\n")
    bench.figure("module kept", f"{lines_kept:,} lines, {found['bytes_decoded']:,} of {found['bytes_read']:,} "
                 f"bytes decoded, truncated={found['truncated']}, source={found['source']}")  # fmt: skip
    bench.figure("Xid events", f"module {found['xids']:,} (of {xids_in_tail:,} in the kept tail), "
                 f"grep {seen['grep']['xids']:,} (whole file)")  # fmt: skip
    bench.ratio("pipe floor (drain dmesg, nothing kept) vs grep", stats["pipe floor"], stats["grep"])
    bench.ratio("module process wall (start, import, read, parse) vs grep", _process(stats["module"]), stats["grep"])
    ratio = bench.ratio("kernel log read+parse vs grep", stats["module"], stats["grep"])
    bench.target("kernel log read+parse vs grep", f"{ratio:.2f}x", "<= 3x", ratio <= 3)
    rss = stats["module"].median("peak_rss_mib")
    bench.target("peak RSS", f"{rss * 1.048576:.1f} MB", "< 100 MB", rss * 1.048576 < 100)
    kept = tail_bytes(log, MAX_LINES)
    decoded = found["bytes_decoded"]
    same = lines_kept == MAX_LINES and found["xids"] == xids_in_tail
    bench.target("bytes decoded", f"{decoded:,}", f"<= {kept:,}", decoded <= kept and same)


def _process(stats: Stats) -> Stats:
    """The same repetitions by their whole process wall."""
    return Stats(f"{stats.side} process", [Sample(s.extra["process_wall_s"]) for s in stats.samples])


def tail_bytes(path: Path, lines: int) -> int:
    """Bytes of the file's last ``lines`` lines: what the cap keeps."""
    with open(path, "rb") as log:
        data = log.read()
    start = len(data)
    for _line in range(lines + 1):
        start = data.rfind(b"\n", 0, start)
    return len(data) - start - 1
