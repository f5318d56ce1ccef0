"""Make the repository importable as ansible_collections.remote_gpu.trainer for plain pytest runs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collection_path import collection_root

sys.path.insert(0, str(collection_root()))
