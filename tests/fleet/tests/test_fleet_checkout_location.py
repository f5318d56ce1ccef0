"""A checkout under /tmp (which every box masks with its own tmpfs) still gives boxes a working simulator."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fleet import Fleet

pytestmark = pytest.mark.fleet

REPO = Path(__file__).resolve().parents[3]
# The box's own python (no pynvml there): load the library the way pynvml does and ask for every GPU's name.
NVML_NAMES = """\
import ctypes
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInitWithFlags(0) == 0
count = ctypes.c_uint()
assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
for index in range(count.value):
    handle, name = ctypes.c_void_p(), ctypes.create_string_buffer(96)
    assert nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0
    assert nvml.nvmlDeviceGetName(handle, name, 96) == 0
    print(name.value.decode())
"""


def make_checkout(root: Path) -> Path:
    """The parts of a checkout the fleet uses, with a venv of its own inside, as a newcomer's clone has them."""
    for part in ("tests/fleet", "tests/fakegpu"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    # The simulator's one dependency, inside the checkout's venv as `make venv` would put it.
    shutil.copytree(Path(yaml.__file__).parent, next(venv.glob("lib/python*/site-packages")) / "yaml")
    return root


@pytest.fixture
def tmp_checkout_fleet(tmp_path: Path) -> Iterator[Fleet]:
    assert str(tmp_path).startswith("/tmp/"), "the point is a checkout the boxes' private /tmp would hide"
    checkout = make_checkout(tmp_path / "checkout")
    scenario = tmp_path / "two.yml"
    scenario.write_text("gpus: [{name: NVIDIA A100-SXM4-80GB}, {name: NVIDIA H100 80GB HBM3}]\n")
    state_dir = checkout / ".build" / "fleet"
    fleet = Fleet(state_dir)
    try:
        up = subprocess.run(
            [str(checkout / ".venv" / "bin" / "python"), str(checkout / "tests" / "fleet" / "fleet.py"), "up",
             "--state-dir", str(state_dir), "--scenario", str(scenario), "--name", "box"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        yield fleet
    finally:
        fleet.down()


def test_a_checkout_under_tmp_gives_boxes_nvidia_smi_and_nvml(tmp_checkout_fleet: Fleet) -> None:
    fleet = tmp_checkout_fleet
    smi = fleet.ssh("box", "nvidia-smi -L")
    assert smi.returncode == 0, smi.stdout + smi.stderr
    assert [line.split(": ", 1)[1].split(" (UUID")[0] for line in smi.stdout.splitlines()] == [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA H100 80GB HBM3",
    ]
    nvml = fleet.ssh("box", f"/usr/bin/python3 -c '{NVML_NAMES}'")
    assert nvml.returncode == 0, nvml.stdout + nvml.stderr
    assert nvml.stdout.split("\n")[:2] == ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"]
    # The box's /tmp is still its own: only the checkout is bound back into it, not its neighbours.
    checkout = fleet.state_dir.parents[1]
    seen = fleet.ssh("box", f"test -f {checkout}/tests/fleet/fleet.py && ! test -e {checkout.parent}/two.yml")
    assert seen.returncode == 0
