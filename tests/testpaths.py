"""Where tests find the repository, the shared real captures and the scenario files.

Import as ``from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Third-party captures of real nvidia-smi output and kernel logs: read in place, never copied into the repository.
CAPTURES = Path(os.environ.get("RGT_CAPTURES", REPO.parent / "shared" / "captures"))
SCENARIOS = REPO / "tests" / "scenarios"
