"""tests/compat/pythons.py: which Python X.Y is used, the box Pythons per ansible-core, and its CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.remote_gpu.trainer.tests.compat import pythons

PYTHONS_PY = Path(pythons.__file__)


def fake_python(path: Path, version: str, works: bool = True) -> Path:
    """A script that answers the probe as a Python ``version`` would (its path, then X.Y), or fails like a shim."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f'echo "$0"\necho {version}\n' if works else "echo 'pyenv: python3.8: command not found' >&2\nexit 127\n"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def pyenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty PATH directory (first) and an empty PYENV_ROOT."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    return tmp_path


def test_the_newest_patch_under_pyenv_that_runs_is_taken(pyenv: Path) -> None:
    versions = pyenv / "pyenv" / "versions"
    for name in ("3.8.9", "3.8.12", "3.8.1", "3.80.1", "3.8-dev"):
        fake_python(versions / name / "bin" / "python3.8", "3.8")
    fake_python(versions / "3.8.20" / "bin" / "python3.8", "3.8", works=False)  # a broken build
    assert pythons.pyenv_candidates("3.8")[:3] == [
        str(versions / name / "bin" / "python3.8") for name in ("3.8.20", "3.8.12", "3.8.9")
    ]
    assert pythons.find_python("3.8") == str(versions / "3.8.12" / "bin" / "python3.8")


def test_python_on_path_comes_first_and_a_failing_shim_is_passed_over(pyenv: Path) -> None:
    versions = pyenv / "pyenv" / "versions"
    fake_python(versions / "3.9.18" / "bin" / "python3.9", "3.9")
    shim = fake_python(pyenv / "bin" / "python3.9", "3.9", works=False)
    assert pythons.find_python("3.9") == str(versions / "3.9.18" / "bin" / "python3.9")
    fake_python(shim, "3.9")
    assert pythons.find_python("3.9") == str(shim)
    fake_python(shim, "3.7")  # answers another version: not taken
    assert pythons.find_python("3.9") == str(versions / "3.9.18" / "bin" / "python3.9")


def test_a_missing_python_names_itself_and_how_to_get_it(pyenv: Path) -> None:
    with pytest.raises(pythons.PythonNotFound) as missing:
        pythons.find_python("3.7")
    assert str(missing.value).startswith("Python 3.7 not found: no python3.7 on PATH that runs")
    assert "install it with `pyenv install 3.7`" in str(missing.value)
    with pytest.raises(ValueError, match=r"Python version '3\.8\.1': expected 3\.N, like 3\.8"):
        pythons.find_python("3.8.1")


def test_the_real_oldest_box_python_of_this_machine_is_found() -> None:
    path = pythons.find_python("3.8")
    assert "/shims/" not in path and pythons.interpreter_version(path) == "3.8"


@pytest.mark.parametrize(
    ("core", "oldest", "newest"), [("2.19", "3.8", "3.13"), ("2.20", "3.9", "3.13"), ("2.21", "3.9", "3.13")]
)
def test_box_pythons_per_ansible_core(core: str, oldest: str, newest: str) -> None:
    assert (pythons.box_version("oldest", core), pythons.box_version("newest", core)) == (oldest, newest)


def test_an_ansible_core_not_in_the_table_is_an_error_not_a_guess() -> None:
    with pytest.raises(pythons.PythonNotFound, match=r"ansible-core 2\.30 is not in TARGET_PYTHONS"):
        pythons.box_version("oldest", "2.30")
    with pytest.raises(ValueError, match="expected oldest or newest"):
        pythons.box_version("middle", "2.19")


def test_the_running_ansible_core_picks_the_box_python() -> None:
    core = pythons.ansible_core_version()
    assert pythons.box_version("oldest") == pythons.TARGET_PYTHONS[core][0]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PYTHONS_PY), *args], capture_output=True, text=True, check=False)


def test_cli_find_prints_the_first_found_or_one_line_and_exit_1() -> None:
    found = cli("find", "3.99", "3.8")
    assert (found.returncode, found.stdout.strip()) == (0, pythons.find_python("3.8"))
    missing = cli("find", "3.98", "3.99")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == "pythons: no Python 3.98 or 3.99 found; install one with `pyenv install 3.98`\n"


def test_cli_box_prints_the_path_or_the_version() -> None:
    oldest = pythons.box_version("oldest")
    assert cli("box", "oldest").stdout.strip() == pythons.find_python(oldest)
    assert cli("box", "newest", "--version").stdout.strip() == pythons.box_version("newest")
