"""Where tests find the repository, the shared real captures and the scenario files.

Import as ``from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent


def _capture_candidates() -> List[Path]:
    """RGT_CAPTURES, else ``shared/captures`` beside this checkout, else beside the repository it was cloned from.

    A newcomer's clone under /tmp/x has no ``shared/`` beside it, but its origin (the project checkout) does.
    """
    if os.environ.get("RGT_CAPTURES"):
        return [Path(os.environ["RGT_CAPTURES"])]
    found = [REPO.parent / "shared" / "captures"]
    try:
        origin = subprocess.run(
            ["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        origin = ""
    if origin.startswith("file://"):
        origin = origin[len("file://") :]
    if origin.startswith("/"):
        found.append(Path(origin).resolve().parent / "shared" / "captures")
    return found


# Third-party captures of real nvidia-smi output and kernel logs: read in place, never copied into the repository.
CAPTURES = next((path for path in _capture_candidates() if path.is_dir()), _capture_candidates()[0])
SCENARIOS = REPO / "tests" / "scenarios"
