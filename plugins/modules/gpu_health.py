#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_health
short_description: Judge a rented box's NVIDIA GPUs before paying for a run
version_added: "0.1.0"
description:
  - Reads every GPU through NVML (the C(pynvml) binding of package C(nvidia-ml-py)) or by parsing
    C(nvidia-smi), samples temperature, SM clock, power and clock event reasons over a short window,
    reads static health state (ECC, row remapper, retired pages, PCIe link, NVLink, MIG, power limit),
    and scans the kernel log for Xid errors.
  - Returns one finding per problem with a stable code, a level (WARN or FAIL), the measured values
    and the renter's action, and an overall RV(status) of PASS, WARN or FAIL.
  - Throttling and heat are judged over the whole window, so a throttle that starts mid-window is
    caught and a single idle reading does not hide a loaded one.
  - Works inside ordinary rental containers, where NVML reports host PIDs; each process says whether
    its PID exists in this PID namespace.
  - Read-only; C(changed) is always false.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
requirements:
  - An NVIDIA driver, with C(libnvidia-ml.so.1) or C(nvidia-smi).
  - The C(nvidia-ml-py) Python package for O(backend=nvml) (the preflight role bootstraps it).
options:
  backend:
    description:
      - How to read the GPUs. V(auto) uses NVML and falls back to C(nvidia-smi) when the C(pynvml) module
        or C(libnvidia-ml.so.1) is missing.
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
  gpus:
    description:
      - GPU indexes to check (default all), each between 0 and 255. A requested index the box does not have is a
        C(gpu_missing) finding.
    type: list
    elements: int
  sample_seconds:
    description: Length of the sampling window in seconds, between 0 and 600; V(0) takes a single sample.
    type: float
    default: 3
  sample_interval_s:
    description:
      - Seconds between samples, between 0.05 and 60. 0.5 catches a throttle episode of a second or more in a
        3 s window at half the cost of 0.25, and leaves room for a C(nvidia-smi) call between samples.
    type: float
    default: 0.5
  temp_hot_c:
    description:
      - Temperature (C) at or above which a GPU is hot (C(running_hot), C(thermal_throttle)), between 0 and 150.
    type: int
    default: 83
  sm_clock_floor_pct:
    description:
      - A busy, hot GPU whose SM clock is below this percentage of its maximum is C(thermal_throttle).
      - A percentage between 0 and 100.
    type: int
    default: 70
  power_cap_pct:
    description:
      - An enforced power limit below this percentage of the default limit is C(power_capped).
      - A percentage between 0 and 100.
    type: int
    default: 90
  occupied_mib_threshold:
    description:
      - GPU memory in use (MiB) that no listed process accounts for, above which C(memory_occupied) is raised.
        Allows for the driver's own context memory. An integer between 0 and 1048576 (1 TiB).
    type: int
    default: 1024
  expected_gpu_count:
    description:
      - Fewer GPUs than this is C(gpu_count_mismatch), between 1 and 256. When unset, only a box with no GPU at all is.
    type: int
  expected_gpu_model:
    description: Regular expression (searched) every GPU name must match, else C(gpu_model_mismatch).
    type: str
  min_driver_version:
    description:
      - Driver version below which the box is C(driver_too_old).
      - Must be dotted numbers such as 535.104.05; anything else is an error, never a skipped check.
    type: str
  min_cuda_version:
    description:
      - CUDA driver version below which the box is C(driver_too_old).
      - Must be dotted numbers such as 12.2; anything else is an error, never a skipped check.
    type: str
  expected_nvlinks:
    description:
      - Active NVLinks each GPU must have, between 1 and 36; fewer is C(nvlink_down). When unset, only a link
        down while others of the same GPU are active is C(nvlink_down).
      - A card without NVLink, or with every link inactive because no bridge or peer is fitted (PCIe cards,
        single-GPU boxes), is normal unless this is set. Set it to require an NVLink box (18 on H100 SXM).
    type: int
  allow_mig:
    description: Whether MIG mode on (or pending) is acceptable; when false it is C(mig_enabled).
    type: bool
    default: false
  xid_since:
    description:
      - Which kernel log entries count. V(boot) (the whole log since boot), a duration back from now such as
        V(24h), V(30m) or V(7d) (units s, m, h, d, w; at most 3650d), or an ISO-8601 time (UTC unless it carries
        an offset).
    type: str
    default: boot
  kernel_log_timeout_s:
    description: Timeout in seconds for each kernel log command (C(dmesg), C(journalctl)), above 0 and at most 3600.
    type: float
    default: 10
  command_timeout_s:
    description: Timeout in seconds for each C(nvidia-smi) call, above 0 and at most 3600.
    type: float
    default: 10
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
  - remote_gpu.trainer.findings
attributes:
  check_mode:
    support: full
    details: The module never changes anything; check mode runs every check.
notes:
  - Thresholds and finding codes follow the project's findings contract; codes are stable.
  - A check that could not be performed is a finding (for example C(kernel_log_unreadable)), never a silent pass.
seealso:
  - module: remote_gpu.trainer.vram_zombies
"""

EXAMPLES = r"""
- name: Check every GPU before launch
  remote_gpu.trainer.gpu_health:
    expected_gpu_count: 8
    expected_gpu_model: "H100"
    min_driver_version: "535.104.05"
  register: health

- name: Stop on a failing box
  ansible.builtin.fail:
    msg: "{{ health.findings | map(attribute='message') | join('; ') }}"
  when: health.status == 'FAIL'

- name: Only GPUs 0 and 1, nvidia-smi parsing, Xids from the last day, MIG allowed
  remote_gpu.trainer.gpu_health:
    gpus: [0, 1]
    backend: nvidia-smi
    xid_since: 24h
    allow_mig: true
    sample_seconds: 5
"""

RETURN = r"""
status:
  description: Worst level among the findings; PASS when there are none.
  returned: always
  type: str
  sample: WARN
findings:
  description:
    - One entry per problem found. Besides the keys below, a finding carries the measured values behind it.
    - "Codes: no_driver, gpu_missing, gpu_count_mismatch, gpu_model_mismatch, gpu_lost, xid_hardware,
      xid_application, xid_unknown, kernel_log_unreadable, throttle_active, thermal_throttle, running_hot,
      ecc_uncorrectable, row_remap_failure, row_remap_pending, retired_pages_pending, pcie_degraded,
      nvlink_down, power_capped, driver_too_old, mig_enabled, foreign_processes, memory_occupied,
      gpu_query_failed, xid_other_gpu, version_unknown."
    - C(xid_other_gpu) (WARN) is an Xid or GPU loss in the kernel log on a PCI address that is not one of this
      box's GPUs (a container on a shared host reading the host's log); the host has a failing GPU.
    - C(version_unknown) (WARN) is a O(min_driver_version) or O(min_cuda_version) that could not be checked because
      the box did not report a readable version.
  returned: always
  type: list
  elements: dict
  contains:
    code:
      description: Stable snake_case identifier of the check.
      type: str
      sample: thermal_throttle
    level:
      description: WARN or FAIL.
      type: str
    gpu:
      description: GPU index, or null for a box-level finding.
      type: int
    message:
      description: One line with the measured values.
      type: str
    action:
      description: What a renter should do (re_rent, reset_gpu, reap_zombies, free_disk, restart_job, investigate,
        none).
      type: str
backend:
  description: The backend that read the GPUs (nvml or nvidia-smi); the one that failed last when none could start.
  returned: always
  type: str
  sample: nvml
driver_version:
  description: NVIDIA driver version, or null when unknown.
  returned: always
  type: str
  sample: "550.54.15"
cuda_version:
  description: Highest CUDA version the driver supports (for example C(12.4)), or null when unknown.
  returned: always
  type: str
  sample: "12.4"
sample_seconds:
  description: Length of the sampling window used.
  returned: always
  type: float
  sample: 3.0
kernel_log:
  description: Where the kernel log was read from.
  returned: always
  type: dict
  contains:
    source:
      description: dmesg, journalctl, or null when neither could be read.
      type: str
    readable:
      description: Whether a kernel log was read (false means Xids could not be ruled out).
      type: bool
    truncated:
      description:
        - Whether older lines were left out because the log is longer than the 200,000 lines read from its end
          (or, for C(journalctl), it printed that many), so an Xid in them went unseen.
        - Only that tail is decoded and parsed, whatever the log's length.
      type: bool
gpus:
  description: One dict per checked GPU. Readings are the last sample; C(window) holds the window's range.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: NVML / nvidia-smi index.
      type: int
    name:
      description: Product name.
      type: str
    uuid:
      description: GPU UUID.
      type: str
    pci_bus_id:
      description: PCI bus id, for example C(00000000:18:00.0).
      type: str
    lost:
      description: Whether the driver reports the GPU lost (no further readings).
      type: bool
    temperature_c:
      description: GPU temperature in C.
      type: int
    sm_clock_mhz:
      description: Current SM clock.
      type: int
    sm_clock_max_mhz:
      description: Maximum SM clock.
      type: int
    power_draw_w:
      description: Power draw in W.
      type: float
    memory_used_mib:
      description: Framebuffer memory in use.
      type: int
    memory_total_mib:
      description: Framebuffer memory size.
      type: int
    power_limit_w:
      description: Enforced power limit in W.
      type: float
    power_default_limit_w:
      description: Default power limit in W.
      type: float
    clocks_event_reasons:
      description:
        - Clock event reasons active in any sample of the window, among gpu_idle, applications_clocks_setting,
          sw_power_cap, hw_slowdown, sync_boost, sw_thermal_slowdown, hw_thermal_slowdown,
          hw_power_brake_slowdown, display_clock_setting.
      type: list
      elements: str
    persistence_mode:
      description: Whether persistence mode is on (null when unknown).
      type: bool
    pcie:
      description: PCIe link C(gen), C(gen_max), C(width), C(width_max) and C(replay_counter).
      type: dict
    processes:
      description:
        - Compute processes on the GPU, each C(pid), C(used_memory_mib) and C(visible) (whether the PID exists
          in this PID namespace; NVML reports host PIDs, so inside a container a PID may be absent or another process).
        - C(used_memory_mib) is null when the driver cannot tell (nvidia-smi C([N/A]), as under Windows WDDM).
      type: list
      elements: dict
    ecc:
      description:
        - C(enabled), C(volatile_uncorrected), C(volatile_corrected), C(aggregate_uncorrected),
          C(aggregate_corrected); or the string C(not_supported).
      type: raw
    remapped_rows:
      description: C(correctable), C(uncorrectable), C(pending), C(failure); or the string C(not_supported).
      type: raw
    retired_pages:
      description: C(single_bit), C(double_bit), C(pending); or the string C(not_supported).
      type: raw
    nvlinks:
      description: Each reported NVLink as C(link) number and C(active).
      type: list
      elements: dict
    mig_mode:
      description: MIG mode C(current) and C(pending) (null when the GPU has no MIG).
      type: dict
    window:
      description:
        - "C(temperature_c), C(sm_clock_mhz), C(power_draw_w) as C({min, max}) over the window, and C(samples),
          the number of samples taken."
      type: dict
"""

import traceback
from typing import Any, Dict

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import subprocess_runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import (
    Between,
    DottedVersion,
    check_options,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_health import BACKENDS, check_gpu_health

try:
    import pynvml

    HAS_PYNVML = True
    PYNVML_IMPORT_ERROR = None
except ImportError:
    pynvml = None
    HAS_PYNVML = False
    PYNVML_IMPORT_ERROR = traceback.format_exc()

# What the argument spec cannot check; the DOCUMENTATION of each option states its rule.
OPTION_BOUNDS = {
    "gpus": Between(0, 255),
    "sample_seconds": Between(0, 600),
    "sample_interval_s": Between(0.05, 60),
    "temp_hot_c": Between(0, 150),
    "sm_clock_floor_pct": Between(0, 100),
    "power_cap_pct": Between(0, 100),
    "occupied_mib_threshold": Between(0, 1048576),
    "expected_gpu_count": Between(1, 256),
    "expected_nvlinks": Between(1, 36),
    "min_driver_version": DottedVersion("535.104.05"),
    "min_cuda_version": DottedVersion("12.2"),
    "kernel_log_timeout_s": Between(0, 3600, above_low=True),
    "command_timeout_s": Between(0, 3600, above_low=True),
}


# The one home of the defaults (DOCUMENTATION states them; validate-modules checks that both agree).
ARGUMENT_SPEC: Dict[str, Dict[str, Any]] = {
    "backend": {"type": "str", "default": "auto", "choices": list(BACKENDS)},
    "gpus": {"type": "list", "elements": "int"},
    "sample_seconds": {"type": "float", "default": 3.0},
    # NVML refreshes clocks, temperature and event reasons several times a second; 0.5 s catches a
    # throttle episode of a second or more within a 3 s window at half the cost of 0.25 s, and a
    # nvidia-smi call (about 0.1 s on a loaded 8-GPU box) still fits between two samples.
    "sample_interval_s": {"type": "float", "default": 0.5},
    "temp_hot_c": {"type": "int", "default": 83},
    "sm_clock_floor_pct": {"type": "int", "default": 70},
    "power_cap_pct": {"type": "int", "default": 90},
    "occupied_mib_threshold": {"type": "int", "default": 1024},
    "expected_gpu_count": {"type": "int"},
    "expected_nvlinks": {"type": "int"},
    "expected_gpu_model": {"type": "str"},
    "min_driver_version": {"type": "str"},
    "min_cuda_version": {"type": "str"},
    "allow_mig": {"type": "bool", "default": False},
    "xid_since": {"type": "str", "default": "boot"},
    "kernel_log_timeout_s": {"type": "float", "default": 10.0},
    "command_timeout_s": {"type": "float", "default": 10.0},
}


def default_options() -> Dict[str, Any]:
    """Every option at its default, None where it has none: the parameters of a call without arguments."""
    return {name: spec.get("default") for name, spec in ARGUMENT_SPEC.items()}


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        supports_check_mode=True,
    )
    check_options(module, OPTION_BOUNDS)
    params = module.params
    if params["backend"] == "nvml" and not HAS_PYNVML:
        module.fail_json(
            msg=missing_required_lib(
                "nvidia-ml-py",
                reason="for backend=nvml (run the preflight role's bootstrap, or use backend=auto)",
            ),
            exception=PYNVML_IMPORT_ERROR,
        )
    try:
        result = check_gpu_health(params, subprocess_runner, pynvml)
    except ValueError as exc:  # option values only the checks can validate (xid_since, expected_gpu_model)
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
