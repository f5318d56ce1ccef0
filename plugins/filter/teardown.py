# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown filters for the gate's controller-side steps: the settings checked, the confirmation, the survival of
the durable directory, the pull (its rsync argv and what it did), the load-verify checks and each step's verdict.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
The role renders the templates (the load-verify command); these filters only check and shape what came out.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, List, Mapping, Optional

from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.module_utils._runs import NAME_PATTERN

# The steps of a box's teardown, in order. The gate's steps refuse (REFUSED), the confirmation leaves the box
# UNCONFIRMED, the actions fail (FAILED).
GATE_STEPS = (
    "validate",
    "run_alive",
    "stop_running",
    "cells",
    "durable",
    "survival",
    "pull",
    "pull_verify",
    "load_verify",
)
CONFIRM_STEP = "confirm"
ACTION_STEPS = ("scratch", "meter_stop")
STEPS = (*GATE_STEPS, CONFIRM_STEP, *ACTION_STEPS)
# The verb of a platform whose meter-stop does nothing (generic SSH boxes): every directory stays.
NO_VERB = "none"
VERB = re.compile(r"\A[a-z][a-z0-9_-]{0,31}\Z")
# Verbs that destroy the instance and its disks whatever the profile's meter_stop_irreversible says.
IRREVERSIBLE_VERBS = ("delete", "destroy", "terminate", "release", "remove")
LOAD_ON = ("box", "controller")
REASON_CHARS = 300


def _line(text: Any, limit: int = REASON_CHARS) -> str:
    """One bounded line: module messages and task errors can span lines or be huge."""
    line = " ".join(str(text if text is not None else "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _command_reason(result: Mapping[str, Any], program: str = "rsync") -> str:
    """``<program> exited <rc>: <its first own error line>``, or why it did not run (a task timeout, no program)."""
    stderr = [line.strip() for line in str(result.get("stderr") or "").splitlines() if line.strip()]
    told = next((line for line in stderr if line.startswith(f"{program}:")), stderr[-1] if stderr else "")
    if result.get("rc") is None:
        return _line(result.get("msg") or told or f"{program} did not run")
    return _line(f"{program} exited {result.get('rc')}: {told or result.get('msg') or 'no message'}")


def _is_argv(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(item, (str, int, float)) for item in value)


def _names(value: Any) -> Optional[List[str]]:
    """Host names from confirm_teardown: a list, or one string of names separated by commas or spaces."""
    if value is None:
        return []
    if isinstance(value, str):
        return [name for name in re.split(r"[\s,]+", value) if name]
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return [name.strip() for name in value if name.strip()]
    return None


# ---- the settings ----------------------------------------------------------------------------------------------


def _meter_problems(settings: Mapping[str, Any]) -> List[str]:
    verb = settings.get("verb")
    if not isinstance(verb, str) or not VERB.match(verb):
        return [f"teardown_meter_stop_verb must be a verb such as stop, delete, terminate or none, not {verb!r}"]
    command, status = settings.get("command"), settings.get("status_command")
    if not _is_argv(command) or not _is_argv(status):
        return ["teardown_meter_stop_cmd and teardown_meter_stop_status_cmd must be argv lists ([] for none)"]
    if verb == NO_VERB or not command:
        return []
    problems = []
    for name, argv in (("teardown_meter_stop_cmd", command), ("teardown_meter_stop_status_cmd", status)):
        if not argv:
            problems.append(f"{name} is empty while teardown_meter_stop_cmd is set: the meter-stop cannot be proved")
        empty = [str(index) for index, item in enumerate(argv) if not str(item).strip()]
        if empty:
            problems.append(
                f"{name} element {', '.join(empty)} is empty (is instance_id set for this host?): {list(argv)}"
            )
    if not str(settings.get("status_key") or "").strip():
        problems.append("teardown_meter_stop_status_key is empty: the status command's state cannot be read")
    if not settings.get("final_states") and not str(settings.get("gone_pattern") or ""):
        problems.append("teardown_meter_stop_final_states is empty and there is no teardown_meter_stop_gone_pattern")
    return problems


def teardown_problems(settings: Mapping[str, Any]) -> List[str]:
    """What is wrong with a host's teardown settings (empty when nothing), checked before the box is touched.

    ``settings``: ``run``, ``data_dir``, ``durable_dir``, ``confirm``, ``pull_to``, ``load_cmd`` (the shape of the
    load-verify command, which renders per artifact: ``none``, ``list`` or ``other``), ``load_on``, ``extra_paths``,
    ``verb``, ``command``, ``status_command``,
    ``status_key``, ``final_states``, ``gone_pattern``, and the numbers ``pull_timeout_s``, ``load_timeout_s``,
    ``verify_timeout_s``, ``meter_timeout_s``, ``poll_interval_s``, ``stop_grace_s``, ``scratch_timeout_s``.
    """
    if not isinstance(settings, Mapping):
        raise AnsibleFilterError("teardown_problems expects a mapping of the host's settings")
    problems = []
    run = settings.get("run")
    if not isinstance(run, str) or not NAME_PATTERN.match(run):
        problems.append(f"teardown_run must match {NAME_PATTERN.pattern}, not {run!r}")
    data_dir, durable_dir = str(settings.get("data_dir") or ""), str(settings.get("durable_dir") or "")
    if not data_dir.startswith("/"):
        problems.append(f"teardown_data_dir (the profile's data_dir) must be an absolute path, not {data_dir!r}")
    if durable_dir and not durable_dir.startswith("/"):
        problems.append(f"teardown_durable_dir must be an absolute path, not {durable_dir!r}")
    if _names(settings.get("confirm")) is None:
        problems.append(
            f"teardown_confirm (confirm_teardown) must be a host name, a list of names or all, "
            f"not {settings.get('confirm')!r}"
        )
    load_cmd, load_on = settings.get("load_cmd", "none"), settings.get("load_on", "box")
    if load_cmd not in ("none", "list"):
        problems.append("teardown_load_verify_cmd must be an argv list (a template with {{ artifact }}), not a string")
    if load_on not in LOAD_ON:
        problems.append(f"teardown_load_verify_on must be one of {', '.join(LOAD_ON)}, not {load_on!r}")
    elif load_on == "controller" and load_cmd == "list" and not settings.get("pull_to"):
        problems.append("teardown_load_verify_on=controller needs teardown_pull_to (pull_to): there is no copy to load")
    extra = settings.get("extra_paths")
    if not isinstance(extra, (list, tuple)) or any(not str(path).startswith("/") for path in extra):
        problems.append(f"teardown_scratch_extra_paths must be a list of absolute paths, not {extra!r}")
    problems += _meter_problems(settings)
    bounds = {
        "pull_timeout_s": (1, 604800),
        "load_timeout_s": (1, 86400),
        "verify_timeout_s": (1, 86400),
        "meter_timeout_s": (0, 86400),
        "poll_interval_s": (0.1, 3600),
        "stop_grace_s": (0, 3600),
        "scratch_timeout_s": (1, 86400),
    }
    for key, (low, high) in bounds.items():
        if key not in settings:
            continue
        value = _number(settings.get(key))
        if value is None or not low <= value <= high:
            problems.append(f"teardown_{key} must be a number between {low:g} and {high:g}, not {settings[key]!r}")
    return problems


# ---- confirmation and survival ---------------------------------------------------------------------------------


def teardown_confirmed(confirm: Any, host: str) -> Dict[str, Any]:
    """Whether ``confirm`` (confirm_teardown) approves tearing ``host`` down: ``{confirmed, by, reason}``.

    It must name the host (a list of names, or one string of names separated by commas or spaces) or be ``all``;
    ``true``, ``yes`` or a number approve nothing (a confirmation names what it approves).
    """
    names = _names(confirm)
    if names is None:
        return {"confirmed": False, "by": None, "reason": f"confirm_teardown {confirm!r} names no host"}
    if "all" in names:
        return {"confirmed": True, "by": "all", "reason": "confirm_teardown=all"}
    if host in names:
        return {"confirmed": True, "by": "name", "reason": f"confirm_teardown names {host}"}
    if names:
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        return {"confirmed": False, "by": None, "reason": f"confirm_teardown names {shown}, not {host}"}
    return {"confirmed": False, "by": None, "reason": f"not confirmed: set confirm_teardown={host} (or all)"}


def teardown_irreversible(verb: str, flag: Any = False) -> bool:
    """Whether the meter-stop ``verb`` destroys the instance's disks: the profile's flag, or a destroying verb."""
    if isinstance(flag, str):
        flag = flag.strip().lower() in ("true", "yes", "on", "1")
    return flag is True or str(verb) in IRREVERSIBLE_VERBS


def teardown_survival(verb: str, survives: Any, durable_dir: str = "", platform: str = "") -> Dict[str, Any]:
    """Whether the durable directory outlives the meter-stop verb: ``{passed, verb, durable_survives, reason}``.

    Verb ``none`` stops nothing, so every directory stays; any other verb must be listed in the profile's
    ``durable_survives`` (RunPod: a pod volume survives ``stop``, only a network volume survives ``delete``).
    """
    where = f" on {platform}" if platform else ""
    listed = [str(item) for item in survives] if isinstance(survives, (list, tuple)) else None
    record: Dict[str, Any] = {"passed": False, "verb": verb, "durable_survives": listed, "reason": ""}
    if verb == NO_VERB:
        return dict(record, passed=True, reason=f"no meter-stop{where} (verb none): every directory stays")
    if listed is None:
        return dict(record, reason=f"durable_survives must be a list of verbs, not {survives!r}")
    durable = durable_dir or "the durable directory"
    if verb in listed:
        return dict(record, passed=True, reason=f"{durable} survives {verb}{where}")
    return dict(
        record,
        reason=(
            f"{durable} does not survive {verb}{where} (durable_survives: {', '.join(listed) or 'none'}): "
            "use a verb it survives, or put durable_dir where it does and list the verb in durable_survives"
        ),
    )


# ---- each step's verdict -----------------------------------------------------------------------------------------


# What a step's module must have said for the step to count as passed. A result without it (a module that crashed
# and left only its stderr, an answer of another shape) stops the box: no verdict is no pass.
EVIDENCE = {
    "run_alive": "teardown_gate",
    "stop_running": "training_run",
    "scratch": "run_scratch",
    "meter_stop": "meter_stop",
}


def _evidence_missing(result: Mapping[str, Any], step: str) -> bool:
    if step == "run_alive":
        return result.get("passed") is not True
    if step == "stop_running":
        return not isinstance(result.get("state"), str)
    if step == "scratch":
        return not isinstance(result.get("removed"), list)
    if step == "meter_stop":
        stopped = bool(result.get("final_state")) or result.get("gone") is True
        return not stopped and not result.get("would_run")
    return False


def teardown_problem(result: Any, step: str) -> Dict[str, Any]:
    """Why ``step`` stopped the box, from its registered ``result``: ``{}`` when it passed (or was skipped), else
    ``{step, reason, unreachable}``.

    Unreachable, a non-zero ``rc`` of a command, ``failed`` (the module's ``msg``; register such tasks with
    ``ignore_errors``, since ``failed_when: false`` overwrites the flag), ``passed: false`` (its ``reason``), and a
    module's answer without its verdict (the gate's ``passed``, run_scratch's ``removed``, meter_stop's final state)
    stop it; a ``step`` in the result (the gate's own ``run_alive``, ``cells`` or ``durable``) names the step.
    """
    if step not in STEPS:
        raise AnsibleFilterError(f"teardown_problem: unknown step {step!r} (one of {', '.join(STEPS)})")
    if not isinstance(result, Mapping) or result.get("skipped"):
        return {}
    named = result.get("step") if result.get("step") in STEPS else step
    if result.get("unreachable"):
        why = _line(re.sub(r"^Task failed: ", "", str(result.get("msg") or "host unreachable")))
        where = "unreachable" if step == "run_alive" else f"unreachable at {step}"
        return {"step": step, "reason": f"{where}: {why}", "unreachable": True}
    command = result.get("cmd") if isinstance(result.get("cmd"), list) and result.get("cmd") else None
    if command is not None and result.get("rc") not in (0, None):
        program = os.path.basename(str(command[0]))
        return {"step": named, "reason": _command_reason(result, program), "unreachable": False}
    if result.get("failed"):
        why = result.get("reason") or result.get("msg") or result.get("module_stderr") or result.get("stderr")
        return {"step": named, "reason": _line(why or f"{step} failed"), "unreachable": False}
    if result.get("passed") is False:
        why = result.get("reason") or result.get("msg") or f"{step} did not pass"
        return {"step": named, "reason": _line(why), "unreachable": False}
    if step in EVIDENCE and _evidence_missing(result, step):
        why = result.get("msg") or result.get("module_stderr") or "no message"
        return {"step": named, "reason": _line(f"{EVIDENCE[step]} gave no verdict: {why}"), "unreachable": False}
    return {}


def teardown_gate_verdict(
    first: Any, stopped: Any = None, again: Any = None, *, stop_running: bool = False, check_mode: bool = False
) -> Dict[str, Any]:
    """The gate's last answer and why it stops the box: ``{gate, problem}`` (``problem`` is ``{}`` when it passed).

    ``first`` is teardown_gate's first answer; with ``stop_running``, ``stopped`` is training_run's
    ``state=stopped`` (null when it did not run) and ``again`` the gate's answer after it. In check mode nothing is
    stopped, so a live run refuses the box, saying what a real teardown would do.
    """
    if not isinstance(first, Mapping) or first.get("skipped"):
        return {"gate": None, "problem": {"step": "run_alive", "reason": "teardown_gate did not run"}}
    stop = stopped if isinstance(stopped, Mapping) and not stopped.get("skipped") else None
    if stop is None:
        problem = teardown_problem(first, "run_alive")
        alive = (first.get("run") or {}).get("state") == "running" if isinstance(first.get("run"), Mapping) else False
        if problem.get("step") == "run_alive" and alive and stop_running and check_mode:
            problem["reason"] = _line(
                f"{problem['reason']}; check mode stops nothing (a real teardown with stop_running stops it and "
                "runs the gate again)"
            )
        return {"gate": first, "problem": problem}
    problem = teardown_problem(stop, "stop_running")
    if problem:
        problem["step"] = "stop_running"
        return {"gate": first, "problem": problem}
    if not isinstance(again, Mapping) or again.get("skipped"):
        return {"gate": first, "problem": {"step": "run_alive", "reason": "the gate did not run again after the stop"}}
    return {"gate": again, "problem": teardown_problem(again, "run_alive")}


class FilterModule:
    """Teardown filters for the gate's controller-side steps."""

    def filters(self) -> Dict[str, Any]:
        return {
            "teardown_problems": teardown_problems,
            "teardown_confirmed": teardown_confirmed,
            "teardown_irreversible": teardown_irreversible,
            "teardown_survival": teardown_survival,
            "teardown_problem": teardown_problem,
            "teardown_gate_verdict": teardown_gate_verdict,
        }
