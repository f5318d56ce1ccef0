"""Make the repository importable as ansible_collections.remote_gpu.trainer for plain pytest runs."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collection_root() -> Path:
    root = REPO / ".build" / "collections"
    link = root / "ansible_collections" / "remote_gpu" / "trainer"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(REPO, target_is_directory=True)
    return root


sys.path.insert(0, str(_collection_root()))
