# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Patrol's options: the action's argument spec and every check made before the box is asked anything.

Each problem is one line naming the role variable (``patrol_<option>``) and what it accepts; all of them are
reported at once, and the box's record says so (state ``unknown``, problem ``patrol_error``).
"""

from __future__ import annotations

import math
import posixpath
from typing import Any, Dict, List, Mapping, Optional

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import number_of

# The module's name for the runtime venv preflight installs; only its libraries are used (see the module).
VENV = ".remote_gpu_trainer/venv"
ARGUMENT_SPEC: Dict[str, Any] = {
    "data_dir": {"type": "str", "required": True},
    "run": {"type": "str", "default": ""},
    "durable_dir": {"type": "str", "default": ""},
    "stall_after_s": {"type": "int", "default": 1800},
    "gpu_idle_pct": {"type": "float", "default": 5},
    "gpu_idle_samples": {"type": "int", "default": 10},
    "disk_pressure_pct": {"type": "float", "default": 95},
    "gpu_backend": {"type": "str", "default": "auto", "choices": ["auto", "nvml", "nvidia-smi"]},
    "kernel_log": {"type": "bool", "default": True},
    "crash_patterns": {"type": "list", "elements": "dict", "default": []},
    "progress_regex": {"type": "str", "default": ""},
    "max_scan_bytes": {"type": "int", "default": 67108864},
    "timeout_s": {"type": "float", "default": 10},
    "python": {"type": "str", "default": ""},
    # A number of minutes or null (off): raw, since the argument spec's float refuses null.
    "idle_billing_minutes": {"type": "raw", "default": 60},
}
# The controller's own options: never passed to patrol_facts.
CONTROLLER_OPTIONS = ("python", "idle_billing_minutes")
IDLE_BILLING_MAX_MINUTES = 43200  # 30 days
# Variables the role and its playbook set or register: not typos.
ROLE_VARIABLES = (
    "patrol_hosts", "patrol_box", "patrol_report_dir", "patrol_state_file", "patrol_notify_webhook_url",
    "patrol_notify_timeout_s",
)  # fmt: skip
KNOWN_VARIABLES = (*tuple(f"patrol_{name}" for name in ARGUMENT_SPEC), *ROLE_VARIABLES)
# Variables of the other patrol playbooks (patrol_cron.yml), which group_vars may well hold: not typos of ours.
OTHER_PLAYBOOKS = ("patrol_cron_",)
# (option, low, high, low excluded): what the module's own bounds are, said before the box is asked.
BOUNDS = (
    ("stall_after_s", 1, 604800, False),
    ("gpu_idle_pct", 0, 100, False),
    ("gpu_idle_samples", 0, 1000, False),
    ("disk_pressure_pct", 0, 100, True),
    ("max_scan_bytes", 65536, 2**30, False),
    ("timeout_s", 0, 600, True),
)


def problems_of(args: Mapping[str, Any]) -> List[str]:
    """Every problem with the validated options, each naming its role variable."""
    problems = []
    if not posixpath.isabs(args["data_dir"]):
        problems.append(
            f"patrol_data_dir must be an absolute path on the box (or set data_dir), got {args['data_dir']!r}"
        )
    if args["durable_dir"] and not posixpath.isabs(args["durable_dir"]):
        problems.append(f"patrol_durable_dir must be empty or an absolute path, got {args['durable_dir']!r}")
    if args["run"] and not NAME_PATTERN.match(args["run"]):
        problems.append(f"patrol_run must be empty or a run name (letters, digits, _ . -), got {args['run']!r}")
    for option, low, high, above_low in BOUNDS:
        value = args[option]
        inside = math.isfinite(value) and (value > low if above_low else value >= low) and value <= high
        if not inside:
            problems.append(
                f"patrol_{option} must be {'above' if above_low else 'at least'} {low} and at most {high}, got {value}"
            )
    try:
        idle_billing_minutes(args["idle_billing_minutes"])
    except ValueError as error:
        problems.append(str(error))
    for index, pattern in enumerate(args["crash_patterns"]):
        if set(pattern) != {"name", "regex"} or not all(isinstance(v, str) for v in pattern.values()):
            problems.append(
                f"patrol_crash_patterns[{index}] must be {{name, regex}} (two strings), got {sorted(pattern)}"
            )
    return problems


def idle_billing_minutes(value: Any) -> Optional[float]:
    """The option's minutes, None when off (null, or "null" from ``-e``); ValueError naming the role variable.
    Numbers given as text (``-e``) are read by the one rule of every stage (``_cost.number_of``)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
        return None
    minutes = number_of(value)
    if minutes is None or not 0 < minutes <= IDLE_BILLING_MAX_MINUTES:
        raise ValueError(
            f"patrol_idle_billing_minutes must be a number of minutes above 0 and at most {IDLE_BILLING_MAX_MINUTES}, "
            f"or null to turn idle_billing off, got {value!r}"
        )
    return minutes


def module_args(args: Mapping[str, Any]) -> Dict[str, Any]:
    """patrol_facts' arguments: empty strings are the module's defaults."""
    module = {key: value for key, value in args.items() if key not in CONTROLLER_OPTIONS and value != ""}
    module["venv"] = posixpath.join(args["data_dir"], VENV)
    return module


def interpreter(args: Mapping[str, Any], configured: Any) -> str:
    """The Python the module runs with.

    Never the runtime venv's interpreter: it lives under the data dir, and a hung data dir would hang the exec
    itself. The inventory's ``ansible_python_interpreter`` when it names one (no discovery round trip), else
    ``python3``.
    """
    if args["python"]:
        return args["python"]
    if isinstance(configured, str) and configured and not configured.startswith("auto"):
        return configured
    return "python3"
