"""The repository as ``ansible_collections.remote_gpu.trainer``: a symlink under .build/collections.

Tests (tests/conftest.py) and benchmarks put ``collection_root()`` on sys.path (or PYTHONPATH for child processes).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def collection_root() -> Path:
    root = REPO / ".build" / "collections"
    link = root / "ansible_collections" / "remote_gpu" / "trainer"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(REPO, target_is_directory=True)
    return root
