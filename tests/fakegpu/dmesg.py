"""A fake ``dmesg`` and ``journalctl`` that print the scenario's kernel log ($FAKEGPU_SCENARIO).

    dmesg [flags]          the lines, or exit 1 "read kernel buffer failed" when kernel_log.readable is false
    journalctl -k [flags]  the lines, or "-- No entries --" and exit 0 (an unprivileged container)

Flags that select or format output (-T, --time-format=iso, -k, --no-pager, -o short-iso, --since ...) are
accepted and ignored: the lines are printed exactly as the scenario holds them.
"""

from __future__ import annotations

import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenario import ScenarioError, load

DMESG_DENIED = "dmesg: read kernel buffer failed: Operation not permitted\n"
NO_ENTRIES = "-- No entries --\n"


def main(argv: List[str], program: str = "dmesg") -> int:
    try:
        kernel_log = load(os.environ.get("FAKEGPU_SCENARIO", ""))["kernel_log"]
    except ScenarioError as exc:
        sys.stderr.write(f"fake {program}: invalid scenario: {exc}\n")
        return 1
    lines = "".join(line + "\n" for line in kernel_log["lines"])
    if program == "journalctl":
        sys.stdout.write(lines if kernel_log["readable"] and lines else NO_ENTRIES)
        return 0
    if not kernel_log["readable"]:
        sys.stderr.write(DMESG_DENIED)
        return 1
    sys.stdout.write(lines)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-journalctl"]:
        sys.exit(main(sys.argv[2:], "journalctl"))
    sys.exit(main(sys.argv[1:]))
