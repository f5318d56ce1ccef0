"""Fixtures for the fleet's own tests: the fleet modules importable, and a fleet per module or per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet import Fleet


@pytest.fixture
def fresh_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A fleet in its own state dir, always torn down after the test."""
    fleet = Fleet(tmp_path / "fleet")
    yield fleet
    fleet.down()
