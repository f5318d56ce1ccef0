"""Print, as JSON, ``{pid: {"state", "ppid"}}`` from /proc/PID/stat for each PID given (null when it is gone).

A killed process whose parent never waits stays in the table as state ``Z``, so "still alive" means present
and not ``Z`` (``kill -0`` succeeds on a zombie). Standard library only, for the fleet hosts' system Python.
"""

from __future__ import annotations

import json
import sys
from typing import Dict, Optional


def stat(pid: str) -> Optional[Dict[str, object]]:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    except FileNotFoundError:
        return None
    return {"state": fields[0], "ppid": int(fields[1])}


if __name__ == "__main__":
    print(json.dumps({pid: stat(pid) for pid in sys.argv[1:]}))
