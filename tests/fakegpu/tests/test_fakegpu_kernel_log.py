"""The fake dmesg and journalctl."""

from __future__ import annotations

import pytest
import scenario
from fakegpu_helpers import SCENARIOS, run


@pytest.mark.parametrize("flags", [[], ["-T"], ["--time-format=iso"], ["-k", "--nopager"], ["--ctime", "-l", "err"]])
def test_dmesg_prints_the_lines_exactly(sim_env, flags) -> None:
    lines = scenario.load(str(SCENARIOS / "xid79-fallen-off-bus.yml"))["kernel_log"]["lines"]
    result = run(["dmesg", *flags], sim_env(SCENARIOS / "xid79-fallen-off-bus.yml"))
    assert result.returncode == 0
    assert result.stdout.splitlines() == lines
    assert (
        "NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus." in result.stdout
    )


def test_dmesg_unreadable_like_an_unprivileged_container(sim_env) -> None:
    result = run(["dmesg", "-T"], sim_env(SCENARIOS / "container-no-dmesg-orphan-vram.yml"))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == "dmesg: read kernel buffer failed: Operation not permitted\n"


@pytest.mark.parametrize("flags", [["-k"], ["-k", "--no-pager", "-o", "short-iso", "--since", "-2h"], ["--dmesg"]])
def test_journalctl(sim_env, flags) -> None:
    readable = run(["journalctl", *flags], sim_env(SCENARIOS / "xid13-app-fault.yml"))
    assert readable.returncode == 0 and readable.stdout.count("NVRM: Xid (PCI:0000:18:00): 13,") == 3
    hidden = run(["journalctl", *flags], sim_env(SCENARIOS / "gpu-lost.yml"))
    assert (hidden.returncode, hidden.stdout) == (0, "-- No entries --\n")


def test_dmesg_stays_available_without_the_nvidia_library(sim_env) -> None:
    result = run(["dmesg"], sim_env(SCENARIOS / "library-absent.yml"))
    assert result.returncode == 1 and "Operation not permitted" in result.stderr
