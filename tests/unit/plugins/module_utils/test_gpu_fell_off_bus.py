"""A GPU that fell off the bus and vanished from the driver's list: WARN without expected_gpu_count, FAIL with it.

The box lists two GPUs (0000:18:00, 0000:3b:00); the kernel log says the GPU at 0000:86:00 fell off the bus.
Without a count the check cannot tell this box's third GPU from another tenant's GPU on a shared host, so it
only warns; with the inventory's expected_gpu_count it knows the box is short and fails it (docs/preflight.md).
"""

from __future__ import annotations

import pytest

from ansible_collections.remote_gpu.trainer.tests.unit.plugins.module_utils.test_gpu_health import Box, codes
from ansible_collections.remote_gpu.trainer.tests.unit.plugins.module_utils.test_gpu_nvml import (
    StubNvml,
    datacenter_gpu,
)

FELL_OFF = (
    "[ 9001.100000] NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "[ 9001.100001] NVRM: The NVIDIA GPU 0000:86:00.0",
    "[ 9001.100002] NVRM: (PCI ID: 10de:2330) installed in this system has",
    "[ 9001.100003] NVRM: fallen off the bus and is not responding to commands.",
)


def two_listed_gpus() -> StubNvml:
    return StubNvml([datacenter_gpu(procs=[]), datacenter_gpu(procs=[], bus=b"00000000:3B:00.0")])


def test_without_expected_gpu_count_a_vanished_gpu_is_only_a_warn() -> None:
    result = Box(kernel_lines=FELL_OFF).check(two_listed_gpus())
    assert (result["status"], codes(result)) == ("WARN", ["xid_other_gpu"])
    (found,) = result["findings"]
    assert (found["level"], found["pci"], found["gpu"]) == ("WARN", "0000:86:00", None)
    assert "set expected_gpu_count" in found["message"]


def test_with_expected_gpu_count_the_same_box_fails() -> None:
    result = Box(kernel_lines=FELL_OFF).check(two_listed_gpus(), expected_gpu_count=3)
    assert result["status"] == "FAIL"
    assert sorted(codes(result)) == ["gpu_count_mismatch", "gpu_lost", "xid_hardware"]  # xid_hardware: the Xid 79
    by_code = {found["code"]: found for found in result["findings"]}
    assert (by_code["gpu_count_mismatch"]["count"], by_code["gpu_count_mismatch"]["expected"]) == (2, 3)
    assert (by_code["gpu_lost"]["level"], by_code["gpu_lost"]["pci"]) == ("FAIL", "0000:86:00")


@pytest.mark.parametrize("expected", [1, 2])
def test_a_count_the_box_meets_keeps_another_tenants_lost_gpu_a_warn(expected: int) -> None:
    # On a shared host the renter's count is met: the lost GPU at another address is not this box's.
    result = Box(kernel_lines=FELL_OFF).check(two_listed_gpus(), expected_gpu_count=expected)
    assert (result["status"], codes(result)) == ("WARN", ["xid_other_gpu"])


def test_where_the_kernel_log_is_unreadable_only_the_count_sees_the_vanished_gpu() -> None:
    # Most containers cannot read dmesg: no Xid at all, two GPUs listed where three were rented.
    assert codes(Box(kernel_lines=None).check(two_listed_gpus())) == ["kernel_log_unreadable"]
    result = Box(kernel_lines=None).check(two_listed_gpus(), expected_gpu_count=3)
    assert result["status"] == "FAIL"
    assert sorted(codes(result)) == ["gpu_count_mismatch", "kernel_log_unreadable"]
