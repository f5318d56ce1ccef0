"""`make bench`: every row of benchmarks/row_*.py in one run, one line per figure, then the summary tables.

    .venv/bin/python benchmarks/bench.py [--only NAME ...] [--reps N] [--keep]

NAME is a row module's suffix (``row_kernel_log.py`` -> ``kernel_log``). Needs root, like the simulated fleet.
The figures of one full run, and the machine it ran on, are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import DEFAULT_REPS, REPO, Bench

ROWS = sorted(path.stem[len("row_") :] for path in (REPO / "benchmarks").glob("row_*.py"))


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return f"{os.cpu_count()} CPUs ({model}), {memory_kib / 1024 / 1024:.0f} GiB, {platform.platform()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=ROWS, default=ROWS, metavar="NAME", help=", ".join(ROWS))
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS, help="repetitions per side (at least 5 counts)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("make bench needs root: the simulated fleet uses namespaces and sshd", file=sys.stderr)
        return 1
    bench = Bench(reps=args.reps)
    print(f"machine: {machine()}", flush=True)
    started = time.monotonic()
    try:
        for name in args.only:
            row = importlib.import_module(f"row_{name}")
            bench.row = name
            print(f"\n== {name}: {row.ROW}", flush=True)
            row_started = time.monotonic()
            row.run(bench)
            bench.figure("row wall", f"{time.monotonic() - row_started:.1f} s")
    finally:
        if not args.keep:
            bench.cleanup()
    print(bench.summary())
    print(f"\nmake bench: {len(args.only)} rows in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
