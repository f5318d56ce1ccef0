"""Parsing speed of the kernel-log Xid scanner on a synthetic log; prints lines/s.

Usage: .venv/bin/python benchmarks/xid_parse.py [--lines 1000000] [--xid-fraction 0.01]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from collection_path import collection_root  # noqa: E402

sys.path.insert(0, str(collection_root()))

from ansible_collections.remote_gpu.trainer.plugins.module_utils._xid import (  # noqa: E402
    parse_kernel_log,
    summarize_events,
)

NOISE = "2025-01-21T02:21:{:02d},{:06d}+00:00 IPv6: ADDRCONF(NETDEV_CHANGE): cali{:08x}: link becomes ready"
XID = "2025-01-21T02:21:{:02d},{:06d}+00:00 NVRM: Xid (PCI:0000:{:02x}:00): {}, pid={}, name=python3, Ch 00000008"
CODES = (13, 31, 43, 48, 79, 94, 119)


def synthetic_log(total: int, xid_fraction: float) -> list:
    every = max(1, round(1 / xid_fraction)) if xid_fraction > 0 else total + 1
    lines = []
    for i in range(total):
        second, micro = (i // 1000) % 60, i % 1000000
        if i % every == 0:
            lines.append(XID.format(second, micro, 0x18 + i % 8, CODES[i % len(CODES)], 1000 + i))
        else:
            lines.append(NOISE.format(second, micro, i))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--xid-fraction", type=float, default=0.01, help="share of lines that are Xid lines")
    args = parser.parse_args()
    lines = synthetic_log(args.lines, args.xid_fraction)
    start = time.perf_counter()
    events = parse_kernel_log(lines)
    groups = summarize_events(events)
    elapsed = time.perf_counter() - start
    total = sum(group["count"] for group in groups)
    print(
        f"{args.lines} lines ({args.xid_fraction:.0%} Xid) in {elapsed:.2f} s: {args.lines / elapsed:,.0f} lines/s; "
        f"{total} events in {len(groups)} groups, {len(events)} kept"
    )


if __name__ == "__main__":
    main()
