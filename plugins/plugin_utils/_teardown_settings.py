# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown's options: the action's argument spec and every check made before the box is touched.

Each problem is one line naming the role variable (``teardown_<option>``) and what it accepts; all of them are
reported at once, and the box is refused at step ``validate``.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _meter_stop as meter

ALL_RUNS = "all"
NO_VERB = "none"
LOAD_ON = ("box", "controller")
# An instance id goes into an argv or a URL path: one plain token, never empty (an empty id in Lambda's URL
# names the instance list, not an instance).
INSTANCE_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
# Variables the role itself sets or registers: not typos.
_TEMPLATE_BLOCK = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_MASKED = re.compile(r"\0(\d+)\0")
ROLE_VARIABLES = ("teardown_load_verify_cmd", "teardown_box", "teardown_hosts", "teardown_report_dir")

ARGUMENT_SPEC: Dict[str, Any] = {
    "runs": {"type": "raw", "required": True},
    "stop_meter": {"type": "bool", "default": True},
    "abandon_runs": {"type": "list", "elements": "str", "default": []},
    "abandon_gpu_users": {"type": "bool", "default": False},
    "data_dir": {"type": "str", "required": True},
    "durable_dir": {"type": "str", "default": ""},
    "confirm": {"type": "raw", "default": ""},
    "stop_running": {"type": "bool", "default": False},
    "stop_grace_s": {"type": "float", "default": 30},
    "accept_incomplete_cells": {"type": "list", "elements": "str", "default": []},
    "accept_no_artifacts": {"type": "bool", "default": False},
    "verify_timeout_s": {"type": "float", "default": 1800},
    "pull_to": {"type": "str", "default": ""},
    "pull_timeout_s": {"type": "float", "default": 7200},
    "load_verify_artifacts": {"type": "list", "elements": "str", "default": []},
    "load_verify_on": {"type": "str", "default": "box"},
    "load_verify_timeout_s": {"type": "float", "default": 300},
    "scratch_extra_paths": {"type": "list", "elements": "str", "default": []},
    "scratch_timeout_s": {"type": "float", "default": 600},
    "meter_stop_verb": {"type": "str", "default": NO_VERB},
    "meter_stop_verbs": {"type": "dict", "default": {}},
    "instance_id": {"type": "str", "default": ""},
    "instance_id_env": {"type": "list", "elements": "str", "default": []},
    "meter_stop_timeout_s": {"type": "float", "default": 300},
    "meter_stop_poll_interval_s": {"type": "float", "default": 5},
    "data_loss_clocks": {"type": "list", "elements": "str", "default": []},
    "platform": {"type": "str", "default": ""},
    "lock_wait_s": {"type": "float", "default": 10},
}
BOUNDS = {
    "stop_grace_s": (0, 3600),
    "verify_timeout_s": (1, 86400),
    "pull_timeout_s": (1, 604800),
    "load_verify_timeout_s": (1, 86400),
    "scratch_timeout_s": (1, 86400),
    "meter_stop_timeout_s": (0, 86400),
    "meter_stop_poll_interval_s": (0.1, 3600),
    "lock_wait_s": (0, 86400),
}
# The profile keys of before issue 19: a profile that still sets them would lose its meter-stop silently.
OLD_PROFILE_KEYS = (
    "meter_stop_cmd", "meter_stop_status_cmd", "meter_stop_status_key", "meter_stop_final_states",
    "meter_stop_gone_pattern", "meter_stop_irreversible", "meter_stop_manual_steps", "durable_survives",
)  # fmt: skip
# The command line's short names (role defaults read them).
SHORT_NAMES = (
    "confirm_teardown", "pull_to", "stop_running", "abandon_runs", "accept_incomplete_cells", "abandon_gpu_users",
)  # fmt: skip
KNOWN_VARIABLES = (
    *tuple(f"teardown_{name}" for name in ARGUMENT_SPEC if name != "runs"),
    "teardown_run",
    "teardown_confirm",
    *ROLE_VARIABLES,
)


@dataclass(frozen=True)
class Settings:
    """The validated options; ``runs`` empty means every run on the box."""

    args: Mapping[str, Any]
    runs: Tuple[str, ...]
    confirm: Tuple[str, ...]
    verb: Optional[Any]  # a _meter_stop.Verb; None for verb none
    instance: bool  # the meter is stopped: every run on the box must be secured

    def __getitem__(self, key: str) -> Any:
        return self.args[key]


def names(value: Any) -> Optional[List[str]]:
    """Names from a list, or one string of names separated by commas or spaces; None for anything else."""
    if value is None:
        return []
    if isinstance(value, str):
        return [name for name in re.split(r"[\s,]+", value) if name]
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return [name.strip() for name in value if name.strip()]
    return None


def confirmation(confirm: Sequence[str], host: str) -> Tuple[bool, str]:
    """Whether ``confirm`` names ``host`` (or is ``all``), and why (``true`` or a number approves nothing)."""
    if ALL_RUNS in confirm:
        return True, "confirm_teardown=all"
    if host in confirm:
        return True, f"confirm_teardown names {host}"
    if confirm:
        listed = ", ".join(confirm[:5]) + (f" (+{len(confirm) - 5} more)" if len(confirm) > 5 else "")
        return False, f"confirm_teardown names {listed}, not {host}"
    return False, f"not confirmed: set confirm_teardown={host} (or all)"


def load_command(raw: Any) -> Tuple[Optional[List[Any]], str]:
    """The load-verify command as an argv template, and a problem. One string is split like a shell would, with
    each ``{{ ... }}`` kept whole, so ``{{ artifact }}`` stays one argument whatever path it renders to."""
    if raw is None or raw in ("", []):
        return None, ""
    if isinstance(raw, str):
        blocks: List[str] = []

        def keep(match: re.Match[str]) -> str:
            blocks.append(match.group(0))
            return f"\0{len(blocks) - 1}\0"

        try:
            masked = shlex.split(_TEMPLATE_BLOCK.sub(keep, raw))
        except ValueError as error:
            return None, f"teardown_load_verify_cmd cannot be split like a shell command line: {error}"
        argv = [_MASKED.sub(lambda match: blocks[int(match.group(1))], part) for part in masked]
        return (argv, "") if argv else (None, "teardown_load_verify_cmd is a blank string")
    if isinstance(raw, (list, tuple)) and raw:
        return list(raw), ""
    return None, f"teardown_load_verify_cmd must be an argv list or a command line string, not {raw!r}"


def argv_of(rendered: Any) -> List[str]:
    """A rendered load-verify command as an argv: scalars become strings, a nested list is spliced in."""
    argv: List[str] = []
    for position, value in enumerate(rendered if isinstance(rendered, (list, tuple)) else [rendered]):
        parts = value if isinstance(value, (list, tuple)) else [value]
        for part in parts:
            if isinstance(part, bool):
                argv.append("true" if part else "false")
            elif isinstance(part, (str, int, float)):
                argv.append(str(part))
            else:
                raise ValueError(f"teardown_load_verify_cmd element {position} rendered to a {type(part).__name__}")
    if not argv or not argv[0]:
        raise ValueError("teardown_load_verify_cmd: the program (first element) rendered empty")
    return argv


def _run_problems(args: Mapping[str, Any]) -> Tuple[Tuple[str, ...], List[str]]:
    listed = names(args["runs"])
    if listed is None or not listed:
        return (), [f"teardown_run must name a run, several (a list or commas) or all, not {args['runs']!r}"]
    bad = [name for name in listed if name != ALL_RUNS and not NAME_PATTERN.match(name)]
    problems = [f"teardown_run {name!r} must be all or match {NAME_PATTERN.pattern}" for name in bad]
    abandoned = [name for name in args["abandon_runs"] if not NAME_PATTERN.match(name)]
    problems += [f"teardown_abandon_runs: {name!r} is no run name" for name in abandoned]
    both = sorted(set(listed) & set(args["abandon_runs"]))
    if both:
        problems.append(f"teardown_abandon_runs names runs being torn down: {', '.join(both)}")
    return (() if ALL_RUNS in listed else tuple(dict.fromkeys(listed))), problems


def _verb(args: Mapping[str, Any]) -> Tuple[Optional[Any], List[str]]:
    if args["meter_stop_verb"] == NO_VERB:
        return None, []
    try:
        verb = meter.parse_verb(args["meter_stop_verbs"], args["meter_stop_verb"])
    except ValueError as error:
        return None, [str(error)]
    if verb.command and not INSTANCE_ID.match(args["instance_id"]):
        shown = repr(args["instance_id"]) if args["instance_id"] else "empty"
        return verb, [f"instance_id is {shown}: set it per host to the provider's instance id (one plain token)"]
    return verb, []


def old_profile_keys(variables: Mapping[str, Any]) -> List[str]:
    """One problem per flat meter-stop key of the old profile format, saying where it moved."""
    return [
        f"{key} is no longer read: declare each verb once under meter_stop_verbs.<verb> (command, status, "
        "final_states, survives, irreversible; docs/teardown.md)"
        for key in OLD_PROFILE_KEYS
        if key in variables
    ]


def settings_of(args: Mapping[str, Any], variables: Mapping[str, Any]) -> Tuple[Optional[Settings], List[str]]:
    """The validated settings, or every problem (one line each)."""
    problems: List[str] = old_profile_keys(variables)
    runs, run_problems = _run_problems(args)
    problems += run_problems
    if not str(args["data_dir"]).startswith("/"):
        problems.append(
            f"teardown_data_dir (the profile's data_dir) must be an absolute path, not {args['data_dir']!r}"
        )
    if args["durable_dir"] and not args["durable_dir"].startswith("/"):
        problems.append(f"teardown_durable_dir must be an absolute path, not {args['durable_dir']!r}")
    confirm = names(args["confirm"])
    if confirm is None:
        problems.append(f"confirm_teardown must be a host name, a list of names or all, not {args['confirm']!r}")
    if args["load_verify_on"] not in LOAD_ON:
        problems.append(f"teardown_load_verify_on must be box or controller, not {args['load_verify_on']!r}")
    _command, load_problem = load_command(variables.get("teardown_load_verify_cmd"))
    problems += [load_problem] if load_problem else []
    if _command and args["load_verify_on"] == "controller" and not args["pull_to"]:
        problems.append("teardown_load_verify_on=controller needs teardown_pull_to (pull_to): there is no copy to load")
    relative = [path for path in args["scratch_extra_paths"] if not os.path.isabs(path)]
    if relative:
        problems.append(f"teardown_scratch_extra_paths must be absolute paths, not {relative!r}")
    for key, (low, high) in BOUNDS.items():
        if not (math.isfinite(args[key]) and low <= args[key] <= high):
            problems.append(f"teardown_{key} must be a number between {low:g} and {high:g}, not {args[key]!r}")
    verb, verb_problems = _verb(args) if args["stop_meter"] else (None, [])
    problems += verb_problems
    if problems:
        return None, problems
    instance = bool(args["stop_meter"] and verb is not None)
    return Settings(args=args, runs=runs, confirm=tuple(confirm or ()), verb=verb, instance=instance), []
