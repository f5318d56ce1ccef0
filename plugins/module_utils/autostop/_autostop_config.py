# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What an autostop arm would write, validated and checked on the box before anything is written.

The options come from the platform profile's ``self_stop`` (``id_env``, ``env``, ``verb``) and the launch's timers.
On the box: the instance's own id (``id_env``: this process's environment, else PID 1's, where containers keep the
platform's variables), every variable the stop command needs (by name: a value is never kept, logged or returned)
and the command's binary on the PATH the watcher will inherit. A refusal is one line naming the option, variable
or binary. Pure standard library.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import Between
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import ENV_NAME_CHARS
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop import TIMEOUT_BOUNDS
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop_verbs import (
    Verb,
    parse_verb,
    shown,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._teardown_instance import (
    PID1_ENVIRON,
    box_ids,
)

ID_PLACEHOLDER = "{instance_id}"
DEFAULTS: Dict[str, float] = {
    "check_interval_s": 60.0,
    "gate_retry_max_s": 1800.0,
    "timeout_s": 300.0,
    "poll_interval_s": 5.0,
    "command_timeout_s": 60.0,
}
BOUNDS = {
    "idle_minutes": Between(0, 14400),
    "controller_silence_hours": Between(0, 8760, above_low=True),
    "check_interval_s": Between(1, 3600),
    "gate_retry_max_s": Between(1, 86400),
    **TIMEOUT_BOUNDS,
}
# A change of any of these is a new configuration: a new generation, whose watcher may stop the box once.
CONFIG_KEYS = (
    "data_dir", "durable_dir", "idle_minutes", "controller_silence_hours", "check_interval_s", "gate_retry_max_s",
    "instance_id", "id_env", "env", "platform", "verb", "timeout_s", "poll_interval_s", "command_timeout_s",
)  # fmt: skip
INSTALL_HINTS = {
    "runpodctl": "RunPod pods ship it; elsewhere install it from https://github.com/runpod/runpodctl/releases",
    "vastai": "install the Vast.ai CLI with pip install vastai",
}
_INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class AutostopRefused(ValueError):
    """Arming is refused (or the watcher would not start): one line naming the option, variable or binary."""


@dataclass(frozen=True)
class Arming:
    """What an arm would write: ``config`` holds CONFIG_KEYS (empty for a disarm); ``command`` is the shown argv."""

    data_dir: str
    run: Optional[str]
    launch_id: Optional[str]
    disarm: bool
    config: Dict[str, Any]
    command: Optional[str] = None


def _number(options: Mapping[str, Any], name: str) -> Optional[float]:
    value = options.get(name)
    value = DEFAULTS.get(name) if value is None else value
    if value is None:
        return None
    problem = BOUNDS[name].problem(value)
    if problem:
        raise AutostopRefused(f"autostop.{name} {problem}")
    return float(value)


def _is_env_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and not name[0].isdigit() and set(name) <= ENV_NAME_CHARS


def _env_names(value: Any) -> List[str]:
    if not isinstance(value, (list, tuple)) or not value or not all(_is_env_name(name) for name in value):
        raise AutostopRefused(
            f"autostop.id_env must be a non-empty list of environment variable names that hold the box's own "
            f"instance id (RUNPOD_POD_ID on RunPod, CONTAINER_ID on Vast.ai), got {value!r}"
        )
    return list(dict.fromkeys(value))


def _env_map(value: Any) -> Dict[str, str]:
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        raise AutostopRefused(
            "autostop.env must map the stop command's variables to the box's, such as {VAST_API_KEY: CONTAINER_API_KEY}"
        )
    for key, source in value.items():
        if not _is_env_name(key) or not _is_env_name(source):
            raise AutostopRefused(f"autostop.env: {key!r}: {source!r} is not a pair of environment variable names")
    return {str(key): str(source) for key, source in sorted(value.items())}


def _with_id(node: Any, instance_id: str) -> Any:
    if isinstance(node, str):
        return node.replace(ID_PLACEHOLDER, instance_id)
    if isinstance(node, Mapping):
        return {key: _with_id(item, instance_id) for key, item in node.items()}
    if isinstance(node, (list, tuple)):
        return [_with_id(item, instance_id) for item in node]
    return node


def _verb(value: Any, instance_id: str) -> Tuple[Dict[str, Any], Verb]:
    """The verb with its ``{instance_id}`` replaced, and its declaration; refuses all but a reversible command."""
    if not isinstance(value, Mapping) or not value:
        raise AutostopRefused(
            "autostop.verb is missing: the platform profile's self_stop.verb (command, status, final_states, "
            "survives, irreversible); runpod and vastai boxes can stop themselves"
        )
    rendered = _with_id(value, instance_id)
    try:
        verb = parse_verb({"stop": rendered}, "stop")
    except ValueError as exc:
        raise AutostopRefused(str(exc).replace("meter_stop_verbs.stop", "autostop.verb")) from exc
    if verb.command is None:
        raise AutostopRefused("autostop.verb runs no command (a verb done by hand cannot stop the box by itself)")
    if verb.irreversible:
        raise AutostopRefused(
            f"autostop only stops; never delete/destroy/terminate: autostop.verb ({shown(verb.command)}) is "
            "declared irreversible"
        )
    return rendered, verb


def _binaries(verb: Verb) -> None:
    """Every program the watcher will run, on the PATH it will inherit (this module's)."""
    commands = [verb.command, verb.status.command if verb.status else None]
    commands.append(verb.cli_check.command if verb.cli_check else None)
    for argv in commands:
        if argv and shutil.which(argv[0]) is None:
            hint = INSTALL_HINTS.get(os.path.basename(argv[0]), "install it or put it on the PATH the module runs with")
            raise AutostopRefused(
                f"autostop: {argv[0]} (which the stop runs) is not on this box's PATH "
                f"({os.environ.get('PATH', '')}): {hint}"
            )


def _box_facts(id_env: List[str], env: Mapping[str, str], environ_path: str) -> str:
    """The box's own instance id; refuses when it, or a variable the command needs, is not set (names only)."""
    needed = list(dict.fromkeys(env.values()))
    found, unreadable = box_ids([*id_env, *needed], environ_path)
    values = {name: value for name, value, _source in found}
    why = f" ({unreadable})" if unreadable else ""
    for target, source in env.items():
        if source not in values:
            via = "" if target == source else f" (passed to the command as {target})"
            raise AutostopRefused(
                f"autostop: {source} is not set on this box, neither in this environment nor in {environ_path}"
                f"{why}: the stop command needs it{via}"
            )
    ids = [(name, values[name]) for name in id_env if name in values]
    if not ids:
        raise AutostopRefused(
            f"autostop: this box does not tell its own instance id: {', '.join(id_env)} is set neither in this "
            f"environment nor in {environ_path}{why}"
        )
    name, value = ids[0]
    # Vast.ai's label form C.<id> names the same instance as <id>, which is what its CLI takes.
    value = value[2:] if value.startswith("C.") and value[2:].isdigit() else value
    if not _INSTANCE_ID.fullmatch(value):
        raise AutostopRefused(f"autostop: {name} holds no usable instance id ({len(value)} characters)")
    return value


def prepare(params: Mapping[str, Any], environ_path: Optional[str] = None) -> Arming:
    """Validate ``params`` (data_dir, durable_dir, run, launch_id and the ``autostop`` suboptions, flat) and read
    the box's facts; AutostopRefused with one line. Writes nothing."""
    data_dir = params["data_dir"]
    run, launch_id = params.get("run"), params.get("launch_id")
    if params.get("disarm"):
        return Arming(data_dir, run, launch_id, True, {})
    idle, silence = _number(params, "idle_minutes"), _number(params, "controller_silence_hours")
    if idle is None and silence is None:
        raise AutostopRefused(
            "autostop needs idle_minutes (stop that long after every run is secured) or controller_silence_hours "
            "(the dead-man: stop after that long without a patrol tick), or both"
        )
    numbers = {name: _number(params, name) for name in DEFAULTS}
    id_env, env = _env_names(params.get("id_env")), _env_map(params.get("env"))
    platform = params.get("platform")
    _verb(params.get("verb"), "0")  # a bad declaration is named before the box is asked anything
    instance_id = _box_facts(id_env, env, environ_path or PID1_ENVIRON)
    rendered, verb = _verb(params.get("verb"), instance_id)
    _binaries(verb)
    config = dict(
        numbers,
        data_dir=data_dir,
        durable_dir=params.get("durable_dir"),
        idle_minutes=idle,
        controller_silence_hours=silence,
        instance_id=instance_id,
        id_env=id_env,
        env=env,
        platform=str(platform) if platform else None,
        verb=rendered,
    )
    return Arming(data_dir, run, launch_id, False, config, shown(verb.command or ()))
