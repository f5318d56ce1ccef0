# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Launch's autostop on the controller: the ``launch_autostop*`` variables checked, and the host's ``self_stop``
read from its platform profile, before a box is touched.

Part of ``_launch_settings`` (which calls it). ``autostop_of(options, task_vars, templar, host)`` returns the
``autostop`` option of ``training_run`` (None when launch neither arms nor disarms) and the problems, one line each.
A box stops itself only where its platform gives it the means: its own id and a key scoped to it in the container's
environment and a command that stops, never deletes. A profile without them (``self_stop: {unsupported: reason}``)
refuses autostop with that reason, pointing at what covers such a box instead (patrol's idle_billing, teardown).
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop_verbs import parse_verb, shown
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import number_of
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._launch_cells import PREFIX, kind_of, plain
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import closest, one_line

ARGUMENT_SPEC: Dict[str, Any] = {
    "autostop": {"type": "bool", "default": False},
    # raw, not float: null means no such timer, which a float option with a default refuses.
    "autostop_idle_minutes": {"type": "raw", "default": 30},
    "autostop_controller_silence_hours": {"type": "raw"},
    "autostop_check_interval_s": {"type": "float", "default": 60},
    "autostop_disarm": {"type": "bool", "default": False},
}
# (option, unit, low, high, low excluded), training_run's own bounds: idle 0 stops as soon as every run is secured;
# the dead-man needs a time.
TIMERS = (
    ("autostop_idle_minutes", "minutes", 0, 14400, False),
    ("autostop_controller_silence_hours", "hours", 0, 8760, True),
)
CHECK_INTERVAL_S = (1, 3600)
NULL_WORDS = ("", "null", "none", "~")  # -e key=value gives text: "null" there means null
SELF_STOP_KEYS = ("id_env", "env", "verb")
INSTANCE_ID = "{instance_id}"
ENV_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
VERB_WHERE = "meter_stop_verbs.stop"  # what parse_verb calls the verb it is handed


def _number_or_null(value: Any, option: str, unit: str) -> Tuple[Optional[float], List[str]]:
    """A timer's value: a number (a number in text too, as ``-e`` gives it), or null for no such timer."""
    if value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS):
        return None, []
    number = number_of(value)  # the one rule for a number given as text, as hourly_usd's
    if number is not None:
        return number, []
    return None, [f"{PREFIX}{option} must be a number of {unit}, or null for no such timer, not {kind_of(value)}"]


def _timers(options: Mapping[str, Any]) -> Tuple[Dict[str, Optional[float]], List[str]]:
    """The two timers (None: no such timer) and their problems."""
    values: Dict[str, Optional[float]] = {}
    problems = []
    for option, unit, low, high, above in TIMERS:
        value, wrong = _number_or_null(options[option], option, unit)
        values[option] = value
        if wrong:
            problems += wrong
        elif value is not None and not (math.isfinite(value) and (value > low if above else value >= low)):
            floor = "above" if above else "at least"
            problems.append(f"{PREFIX}{option} must be {floor} {low:g} {unit} (or null), not {value:g}")
        elif value is not None and value > high:
            problems.append(f"{PREFIX}{option} must be at most {high:g} {unit} (or null), not {value:g}")
    return values, problems


def _interval_problems(interval: float) -> List[str]:
    low, high = CHECK_INTERVAL_S
    if math.isfinite(interval) and low <= interval <= high:
        return []
    return [f"{PREFIX}autostop_check_interval_s must be a number between {low} and {high}, not {interval:g}"]


def _names(value: Any, where: str, allow_empty: bool) -> List[str]:
    """Problems of a list of environment variable names."""
    if not isinstance(value, list) or (not value and not allow_empty):
        return [f"{where} must be a {'' if allow_empty else 'non-empty '}list of environment variable names"]
    bad = [name for name in value if not isinstance(name, str) or not ENV_NAME.match(name)]
    return [f"{where}: {bad[0]!r} is not an environment variable name (letters, digits, _)"] if bad else []


def _verb_problems(verb: Any, who: str) -> List[str]:
    """The verb as teardown's meter-stop declares one, with ``{instance_id}`` left for the box to fill in; only a
    command that can be undone, since nobody is there to confirm anything. ``who``: ``launch_autostop: h1's ``."""
    where = f"{who}self_stop"
    try:
        parsed = parse_verb({"stop": verb}, "stop")
    except ValueError as error:
        said = one_line(str(error).replace(VERB_WHERE, "self_stop.verb"))
        return [f"{who}{said}"]
    if parsed.command is None:
        return [f"{where}.verb must run a command (console steps cannot stop a box by itself)"]
    if parsed.irreversible:
        return [
            f"{where}.verb is irreversible ({shown(parsed.command)}): autostop only stops; never "
            "delete/destroy/terminate"
        ]
    if not any(INSTANCE_ID in part for part in parsed.command):
        return [f"{where}.verb.command must name the box by {INSTANCE_ID} (read on the box from self_stop.id_env)"]
    return []


def self_stop_of(raw: Any, host: str, platform: str) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """``{id_env, env, verb}`` of the host's profile, or why this box cannot stop itself."""
    who = f"{PREFIX}autostop: {host}'s "
    where = f"{who}self_stop"
    if raw is None:
        return None, [
            f"{PREFIX}autostop: {host} has no self_stop in its platform profile (runpod and vastai boxes can stop "
            "themselves)"
        ]
    if not isinstance(raw, Mapping):
        return None, [f"{where} must be a mapping (id_env, env, verb, or unsupported), not {kind_of(raw)}"]
    if "unsupported" in raw:
        return None, [
            f"{PREFIX}autostop: {platform or 'this platform'}'s boxes cannot stop themselves "
            f"({one_line(raw['unsupported'], 200)}): patrol's idle_billing (patrol_idle_billing_minutes) says when "
            f"{host} bills with no live run; stop it with remote_gpu.trainer.teardown"
        ]
    problems = [
        f"{where}.{key} is not a key of self_stop{closest(str(key), SELF_STOP_KEYS)}"
        for key in raw
        if key not in SELF_STOP_KEYS
    ]
    problems += [f"{where}.{key} is missing" for key in SELF_STOP_KEYS if key not in raw]
    if problems:
        return None, problems
    problems += _names(raw["id_env"], f"{where}.id_env", allow_empty=False)
    env = raw["env"]
    pairs = list(env.items()) if isinstance(env, Mapping) else []
    bad = [pair for pair in pairs if not all(isinstance(name, str) and ENV_NAME.match(name) for name in pair)]
    if not isinstance(env, Mapping):
        problems.append(f"{where}.env must be a mapping (the command's variable: the box's), not {kind_of(env)}")
    elif bad:
        problems.append(
            f"{where}.env must map the command's environment variable names to the box's (NAME: NAME), not {bad[0]!r}"
        )
    problems += _verb_problems(raw["verb"], who)
    if problems:
        return None, problems
    return {"id_env": list(raw["id_env"]), "env": dict(env), "verb": dict(raw["verb"])}, []


def _rendered(value: Any, templar: Any, host: str) -> Tuple[Any, List[str]]:
    """The profile's ``self_stop`` as the play sees it (a template in it rendered), in plain types."""
    try:
        return plain(templar.template(value)), []
    except Exception as error:  # a template error of the profile: the reason, in one line
        return None, [f"{PREFIX}autostop: {host}'s self_stop cannot be rendered: {one_line(error, 200)}"]


def autostop_of(
    options: Mapping[str, Any], task_vars: Mapping[str, Any], templar: Any, host: str
) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """training_run's ``autostop`` option: None when launch leaves autostop alone, ``{disarm: true}`` to disarm,
    else ``{idle_minutes, controller_silence_hours, check_interval_s, disarm, id_env, env, verb, platform}``."""
    timers, timer_problems = _timers(options)
    problems = timer_problems + _interval_problems(options["autostop_check_interval_s"])
    if options["autostop"] and options["autostop_disarm"]:
        problems.append(
            f"{PREFIX}autostop and {PREFIX}autostop_disarm are both true: set one (arm the box's stop, or disarm it)"
        )
    if not options["autostop"]:
        return ({"disarm": True} if options["autostop_disarm"] and not problems else None), problems
    idle, silence = timers["autostop_idle_minutes"], timers["autostop_controller_silence_hours"]
    if idle is None and silence is None and not timer_problems:  # a refused timer is reason enough
        problems.append(
            f"{PREFIX}autostop needs a timer: {PREFIX}autostop_idle_minutes or "
            f"{PREFIX}autostop_controller_silence_hours (both are null)"
        )
    platform = str(plain(task_vars.get("platform") or ""))
    raw, render_problems = _rendered(task_vars.get("self_stop"), templar, host)
    self_stop, stop_problems = (None, render_problems) if render_problems else self_stop_of(raw, host, platform)
    problems += stop_problems
    if problems or self_stop is None:
        return None, problems
    return {
        "idle_minutes": idle,
        "controller_silence_hours": silence,
        "check_interval_s": float(options["autostop_check_interval_s"]),
        "disarm": False,
        **self_stop,
        "platform": platform,
    }, []
