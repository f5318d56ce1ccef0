"""Seconds to bring N simulated boxes up (every one answering SSH) and down, and the memory the boxes use.

    .venv/bin/python benchmarks/fleet_up.py [N ...]        # default: 3 20 50

Memory is what the idle boxes' own memory cgroups charge (sshd, init, tmpfs contents) and the summed RSS of
their processes; the controller-side ssh masters are not counted. Needs root, like the fleet itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fleet"))

from fleet import Fleet  # noqa: E402

SCENARIO = REPO / "tests" / "scenarios" / "healthy-h100.yml"


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_memory(fleet: Fleet) -> tuple[int, int]:
    """(bytes charged to the boxes' cgroups, summed RSS of their processes); 0 where no cgroup exists."""
    charged = rss = 0
    for host in fleet.hosts:
        if not host["cgroup"]:
            continue
        cgroup = Path(host["cgroup"])
        charged += int((cgroup / "memory.usage_in_bytes").read_text())
        rss += sum(_rss_bytes(int(pid)) for pid in (cgroup / "cgroup.procs").read_text().split())
    return charged, rss


def measure(fleet: Fleet, count: int) -> str:
    started = time.monotonic()
    fleet.up([str(SCENARIO)] * count)
    up_s = time.monotonic() - started
    charged, rss = host_memory(fleet)
    started = time.monotonic()
    fleet.down()
    down_s = time.monotonic() - started
    mib = 1024 * 1024
    return (
        f"{count:>4} hosts  up {up_s:6.2f} s  down {down_s:5.2f} s  "
        f"cgroups {charged / mib:7.1f} MiB ({charged / mib / count:5.1f}/host)  "
        f"RSS {rss / mib:7.1f} MiB ({rss / mib / count:5.1f}/host)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("counts", nargs="*", type=int, default=[3, 20, 50])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rgt-bench-") as workdir:
        fleet = Fleet(Path(workdir) / "bench")
        fleet.up([str(SCENARIO)])  # warm-up: builds the simulator into the state dir, not part of the timing
        fleet.down()
        for count in args.counts:
            print(measure(fleet, count), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
