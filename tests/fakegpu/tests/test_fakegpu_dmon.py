"""`nvidia-smi dmon` is paced like the real tool: one sample per `-d` interval, each line out as it is taken."""

from __future__ import annotations

import subprocess
import time

from fakegpu_helpers import SCENARIOS, TIMEOUT_S

TIMELINE = """\
gpus:
  - temperature_c: 40
    timeline: [{after_s: 1.5, set: {temperature_c: 90}}]
"""


def dmon(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["nvidia-smi", "dmon", *args], env=env, stdout=subprocess.PIPE, text=True)


def test_dmon_takes_one_interval_per_sample_and_streams_each_line(sim_env) -> None:
    started = time.monotonic()
    process = dmon(sim_env(SCENARIOS / "healthy-h100.yml"), "-c", "3", "-d", "1")
    header = [process.stdout.readline(), process.stdout.readline()]
    first = process.stdout.readline()
    first_at = time.monotonic()
    assert process.poll() is None, "the first sample must be readable while dmon still runs"
    rest = process.communicate(timeout=TIMEOUT_S)[0]
    ended = time.monotonic()
    assert process.returncode == 0
    assert header[0].split()[:3] == ["#", "gpu", "pwr"] and header[1].split()[:2] == ["#", "Idx"]
    assert first.split()[0] == "0" and len(rest.splitlines()) == 2
    assert ended - started >= 1.9, "3 samples 1 s apart span 2 s"
    assert ended - first_at >= 1.8, "the first sample comes at once, the others one interval apart"


def test_a_timeline_change_shows_only_in_samples_taken_after_it(sim_env, write_scenario) -> None:
    process = dmon(sim_env(write_scenario(TIMELINE)), "-c", "4")  # samples at about 0, 1, 2, 3 s
    out = process.communicate(timeout=TIMEOUT_S)[0]
    assert process.returncode == 0
    temperatures = [line.split()[2] for line in out.splitlines() if not line.startswith("#")]
    assert temperatures == ["40", "40", "90", "90"]
