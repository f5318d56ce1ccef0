"""Fixtures for the browser tests: page_check importable (tests/conftest.py adds the collection), one headless
Chromium per session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import page_check


@pytest.fixture(scope="session")
def driver() -> Iterator[page_check.webdriver.Chrome]:
    """Debian's Chromium, headless, always quit; a missing browser fails the tests with what to install (no skip)."""
    with page_check.browser() as chrome:
        yield chrome
