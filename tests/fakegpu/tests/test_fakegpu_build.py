"""build.py: idempotent builds, the environment it prints, a clear error without gcc."""

from __future__ import annotations

import os
import sys

import build
import pytest
from fakegpu_helpers import FAKEGPU, SCENARIOS, run


def test_build_is_idempotent(sim_dir) -> None:
    library = sim_dir / "lib" / "libnvidia-ml.so.1"
    before = library.stat().st_mtime_ns
    assert build.build(str(sim_dir)) == str(sim_dir)
    assert library.stat().st_mtime_ns == before
    for name in ("nvidia-smi", "dmesg", "journalctl"):
        wrapper = sim_dir / "bin" / name
        assert os.access(wrapper, os.X_OK)
        assert wrapper.read_text().splitlines()[0] == f"#!{sys.executable} -Es"
    assert sorted(os.listdir(sim_dir / "bin-nolib")) == ["dmesg", "journalctl"]
    assert os.listdir(sim_dir / "lib-absent") == []


def test_env_command_prints_the_variables(sim_dir) -> None:
    result = run(
        [
            sys.executable,
            str(FAKEGPU / "build.py"),
            "env",
            "--out",
            str(sim_dir),
            "--scenario",
            str(SCENARIOS / "healthy-h100.yml"),
        ],
        dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    values = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert sorted(values) == ["FAKEGPU_SCENARIO", "FAKEGPU_STATE_DIR", "LD_LIBRARY_PATH", "PATH"]
    assert values["FAKEGPU_SCENARIO"] == str(SCENARIOS / "healthy-h100.yml")
    assert values["LD_LIBRARY_PATH"] == str(sim_dir / "lib")
    assert values["PATH"].split(os.pathsep)[0] == str(sim_dir / "bin")


def test_environment_for_an_absent_library_hides_nvidia_smi(sim_dir) -> None:
    env = build.environment(str(sim_dir), str(SCENARIOS / "library-absent.yml"))
    first = env["PATH"].split(os.pathsep, maxsplit=1)[0]
    assert first == str(sim_dir / "bin-nolib")
    assert not os.path.exists(os.path.join(first, "nvidia-smi"))
    assert env["LD_LIBRARY_PATH"] == str(sim_dir / "lib-absent")


def test_missing_gcc_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.BuildError, match="gcc not found"):
        build.build(str(tmp_path / "out"))
    result = run(
        [sys.executable, str(FAKEGPU / "build.py"), "build", "--out", str(tmp_path / "cli")],
        {"PATH": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert result.returncode == 1 and "gcc not found" in result.stderr


def test_invalid_scenario_is_reported_by_env(sim_dir, write_scenario) -> None:
    bad = write_scenario("gpus: [{clocks_mhz: {sm: fast}}]\n")
    result = run(
        [sys.executable, str(FAKEGPU / "build.py"), "env", "--out", str(sim_dir), "--scenario", str(bad)],
        dict(os.environ),
    )
    assert result.returncode == 1 and "gpus[0].clocks_mhz.sm: expected int, got str" in result.stderr
