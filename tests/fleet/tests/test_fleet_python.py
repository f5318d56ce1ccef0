"""A fleet host given its Python (issue 23): the inventory names it, fleet.json records it, the box runs it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict

import fleet_procs
import pytest
from fleet import Fleet, FleetError

pytestmark = pytest.mark.fleet

FLEET_PY = Path(__file__).resolve().parents[1] / "fleet.py"
PYTHONS_PY = Path(__file__).resolve().parents[2] / "compat" / "pythons.py"
VERSION_PROBE = "import sys; print(tuple(sys.version_info[:2]))"


def scenario(tmp_path: Path) -> str:
    path = tmp_path / "plain.yml"
    path.write_text("gpus: [{name: NVIDIA H100 80GB HBM3}]\n")
    return str(path)


def inventory_values(fleet: Fleet) -> Dict[str, Dict[str, str]]:
    """host -> its inventory line's key=value pairs."""
    lines = fleet.inventory_path.read_text().splitlines()[1:]
    return {
        line.split()[0]: dict(pair.split("=", 1) for pair in shlex.split(line)[1:] if "=" in pair) for line in lines
    }


def test_a_host_given_a_version_or_a_path_runs_that_python(fresh_fleet: Fleet, tmp_path: Path) -> None:
    newest = subprocess.run(
        [sys.executable, str(PYTHONS_PY), "find", "3.13"], check=True, capture_output=True, text=True
    ).stdout.strip()
    plain = scenario(tmp_path)
    fresh_fleet.up([plain] * 3, names=["old", "new", "image"], python={"old": "3.8", "new": newest})
    interpreters = {
        name: values["ansible_python_interpreter"] for name, values in inventory_values(fresh_fleet).items()
    }
    assert interpreters["new"] == newest and interpreters["image"] == "/usr/bin/python3"
    assert re.fullmatch(r"/.*/python3\.8", interpreters["old"]), interpreters
    for name, wanted in (("old", "(3, 8)"), ("new", "(3, 13)")):
        answer = fresh_fleet.ssh(name, f"{interpreters[name]} -c {shlex.quote(VERSION_PROBE)}")
        assert (answer.returncode, answer.stdout.strip()) == (0, wanted), answer.stderr
    record = {host["name"]: host for host in json.loads(fresh_fleet.fleet_json.read_text())["hosts"]}
    assert (record["old"]["python"], record["old"]["python_version"]) == (interpreters["old"], "3.8")
    assert (record["new"]["python"], record["new"]["python_version"]) == (newest, "3.13")
    assert (record["image"]["python"], record["image"]["python_version"]) == ("/usr/bin/python3", None)


def test_the_cli_takes_python_per_host(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = [sys.executable, str(FLEET_PY), "up", "--state-dir", str(state), "--scenario", scenario(tmp_path)]
    try:
        done = subprocess.run(
            [*up, "--name", "one", "--python", "one:3.8"], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "\tpython 3.8" in done.stdout
        assert Fleet(state).host("one")["python_version"] == "3.8"
    finally:
        Fleet(state).down()
    refused = subprocess.run([*up, "--python", "3.8"], capture_output=True, text=True, check=False)
    assert refused.returncode == 1
    assert (
        refused.stderr.strip() == "fleet: --python '3.8': NAME:SPEC, once per host (SPEC: a version like 3.8 or a path)"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("3.99", "host one: python '3.99': Python 3.99 not found: "),
        ("3.99", "install it with `pyenv install 3.99`"),
        ("python3", "host one: python 'python3': Python version 'python3': expected 3.N, like 3.8"),
        ("/nonexistent/python3", "host one: python '/nonexistent/python3': /nonexistent/python3 does not run"),
    ],
)
def test_a_python_the_host_cannot_have_is_refused_before_anything_starts(
    fresh_fleet: Fleet, tmp_path: Path, spec: str, message: str
) -> None:
    with pytest.raises(FleetError, match=re.escape(message)):
        fresh_fleet.up([scenario(tmp_path)], names=["one"], python={"one": spec})
    assert fleet_procs.marked_processes(str(fresh_fleet.state_dir)) == {}
    assert not fresh_fleet.fleet_json.exists()


def test_a_python_for_no_host_of_the_fleet_is_refused(fresh_fleet: Fleet, tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="python names no host of the fleet: nobody"):
        fresh_fleet.up([scenario(tmp_path)], names=["one"], python={"nobody": "3.8"})
