"""Fixtures for the GPU simulator's own tests: one build per session, per-test environments."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Dict

import pytest

# The suite runs with --import-mode=importlib: put the helpers and the simulator on sys.path here.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import build  # noqa: E402


@pytest.fixture(scope="session")
def sim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build.build(str(tmp_path_factory.mktemp("fakegpu"))))


@pytest.fixture
def sim_env(sim_dir: Path, tmp_path: Path) -> Callable[[Path], Dict[str, str]]:
    """Environment for child processes that see ``scenario``; a fresh clock directory per test."""

    def make(scenario: Path) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(build.environment(str(sim_dir), str(scenario)))
        env["FAKEGPU_STATE_DIR"] = str(tmp_path / "state")
        return env

    return make


@pytest.fixture
def write_scenario(tmp_path: Path) -> Callable[..., Path]:
    def write(text: str, name: str = "scenario.yml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write
