"""Shared fixtures of the unit tests, and the test helpers' folders on the import path, once for every test file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.remote_gpu.trainer.tests.workload.harness import Provider

TESTS = Path(__file__).resolve().parent.parent
# tests/zombies (fake jobs and their harness) and tests/fakegpu (the simulator's environment) are plain folders.
for helpers in (TESTS / "zombies", TESTS / "fakegpu"):
    if str(helpers) not in sys.path:
        sys.path.insert(0, str(helpers))

ModuleRun = Callable[..., Tuple[int, Dict[str, Any]]]


@pytest.fixture(autouse=True)
def instance_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own box-level instance directory (the data dir registry, the lease, the ledger, the
    stops): never this machine's home, never another test's."""
    path = tmp_path_factory.mktemp("instance")
    monkeypatch.setenv("RGT_INSTANCE_DIR", str(path))
    return path


@pytest.fixture
def run_module(capsys: pytest.CaptureFixture[str]) -> ModuleRun:
    """``run_module(module, args, check_mode=False)``: the module's main() through its argument spec.

    Returns (exit code, result dict) as Ansible would receive them.
    """

    def run(module: ModuleType, args: Dict[str, Any], check_mode: bool = False) -> Tuple[int, Dict[str, Any]]:
        args = dict(args, _ansible_check_mode=True) if check_mode else args
        with patch_module_args(args), pytest.raises(SystemExit) as exited:
            module.main()
        return exited.value.code, json.loads(capsys.readouterr().out)

    return run


@pytest.fixture
def provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Provider:
    """The fake provider CLI first on PATH (as ``runpodctl`` and ``vastai``), its state and calls files in tmp_path."""
    fake = Provider(tmp_path)
    monkeypatch.setenv("PATH", f"{fake.bin}:/usr/bin:/bin")  # the fake needs no python on PATH
    monkeypatch.setenv("FAKE_PROVIDER_STATE", str(fake.state))
    monkeypatch.setenv("FAKE_PROVIDER_CALLS", str(fake.calls_file))
    return fake


@pytest.fixture
def live_session() -> Iterator[int]:
    """A process leading a session of its own, as a detached runner does; killed after the test."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait(timeout=10)
