# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Launch's settings: the action's argument spec and every check made on the controller before a box is touched.

``settings_of(args, task_vars, templar, loader=None) -> (settings, problems)`` makes all of them at once: each
problem is one line naming the ``launch_*`` variable and what it accepts in plain words (never a secret's value).
``settings`` is None exactly when ``problems`` is not empty. It also finds typo'd variables (``launch_alow_concurrent``,
or ``allow_concurrent`` without the prefix): the action needs no other check. ``args`` are the action's options
(``ARGUMENT_SPEC``: each role variable minus ``launch_``), validated again here, so raw and validated options give the
same answer. ``launch_command`` (the argv template, a list) and ``launch_checkpoint_dir`` are read RAW from
``task_vars`` (Ansible would render them before a cell exists) and rendered per planned cell with ``templar`` plus
``cell``, ``run``, ``run_dir``, ``cell_dir``, ``data_dir``, ``durable_dir``. ``loader`` (the action's ``_loader``)
decrypts a vault-encrypted secret file.

``settings`` (plain Python types, no Ansible tags):

- ``host`` (``inventory_hostname``), ``run``, ``run_dir`` (``<data_dir>/runs/<run>``), ``data_dir``, ``durable_dir``
  ("" for none), ``workdir``.
- ``code``: ``{kind: none}`` | ``{kind: rsync, source, dest, excludes, delete}`` (``source``: an absolute controller
  directory) | ``{kind: git, repo, ref, depth, dest, environment}``.
- ``module_args``: the exact options of ``remote_gpu.trainer.training_run``, options at the module's default left
  out (``?``): ``run, state (started), data_dir, durable_dir?, env_hook?, conda_env?, gpus?, gpus_per_cell?,
  max_parallel?, launch_id?, secrets?, verify_cmd?, verify_artifacts?, shard?, workdir, cells, env, prune, artifacts,
  optional_artifacts, verify_timeout_s, check_finite, apply_changes, stop_on_failure, detach, allow_concurrent,
  stop_grace_s, monitor_interval_s, monitor_max_bytes, start_timeout_s, new_attempt``. ``cells``: this host's planned
  cells, ``{name, command: [argv], checkpoint_dir?, timeout_s?, retries?, artifacts?, optional_artifacts?, prune?}``.
  ``secrets`` (``{NAME: value}``) is the one place a secret's value appears: ``redacted(settings)`` hides it.
- ``cells``: the planned cells' names (empty for a shard with no cell); ``shard``: ``{index, count}`` or None;
  ``secret_names`` (sorted); ``launch_id`` (``launch_id`` as given; "" means the role's own id).
- ``preflight``: ``{skip, require, max_age_s, report_dir}``; ``runtime_python``; ``base_python``;
  ``probe_timeout_s`` (float); ``task_timeout_s``, ``sync_timeout_s`` (int); ``report_dir``.
- ``autostop``: training_run's ``autostop`` option (also in ``module_args``, there only when not None), see
  ``_launch_autostop``; ``hourly_usd``: the host's rate (float) or None; ``hourly_usd_warning``: why a bad one was
  left out (one line naming hourly_usd, or None): a warning as in every stage, never a refusal.

``plain_message(message)`` tells an argument-spec message in the same plain words (for ``StageAction.in_variables``).
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import posixpath
import re
import shlex
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_autostop as autostop
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_cells as cells
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import hourly_rate
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._launch_cells import PREFIX, kind_of, plain
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import closest, one_line

ARGUMENT_SPEC: Dict[str, Any] = {
    "run": {"type": "str", "required": True},
    # Any element: each cell is checked by _launch_cells, in plain words naming the cell.
    "cells": {"type": "list", "elements": "raw", "required": True},
    # None (not given): the platform profile's variable of the same name, as the role's defaults were.
    "data_dir": {"type": "str"},
    "durable_dir": {"type": "str"},
    "code_dir": {"type": "str", "default": ""},
    "code_excludes": {"type": "list", "elements": "str", "default": [".git", ".venv", "__pycache__", "*.pyc", "wandb"]},
    "code_delete": {"type": "bool", "default": False},
    "git_repo": {"type": "str", "default": ""},
    "git_ref": {"type": "str", "default": "HEAD"},
    "git_depth": {"type": "int", "default": 0},
    "git_environment": {"type": "dict", "default": {}},
    "code_dest": {"type": "str", "default": ""},
    "workdir": {"type": "str", "default": ""},
    "env": {"type": "dict", "default": {}},
    "env_hook": {"type": "str"},
    "conda_env": {"type": "str", "default": ""},
    "secrets": {"type": "dict", "default": {}, "no_log": True},
    "gpus": {"type": "list", "elements": "int", "default": []},
    "gpus_per_cell": {"type": "int", "default": 0},
    "max_parallel": {"type": "int", "default": 0},
    "prune": {"type": "list", "elements": "str", "default": []},
    "artifacts": {"type": "list", "elements": "str", "default": []},
    "optional_artifacts": {"type": "list", "elements": "str", "default": []},
    "verify_cmd": {"type": "raw"},
    "verify_artifacts": {"type": "list", "elements": "str", "default": []},
    "verify_timeout_s": {"type": "float", "default": 300},
    "check_finite": {"type": "bool", "default": False},
    "apply_changes": {"type": "bool", "default": False},
    "stop_on_failure": {"type": "bool", "default": False},
    "detach": {"type": "str"},
    "allow_concurrent": {"type": "bool", "default": False},
    "stop_grace_s": {"type": "float", "default": 30},
    "monitor_interval_s": {"type": "float", "default": 30},
    "monitor_max_bytes": {"type": "int", "default": 8388608},
    "start_timeout_s": {"type": "float", "default": 20},
    "shard": {"type": "bool", "default": False},
    "shard_hosts": {"type": "list", "elements": "str"},
    "hosts": {"type": "str", "default": "all"},
    "new_attempt": {"type": "bool", "default": False},
    "id": {"type": "str", "default": ""},
    "skip_preflight": {"type": "bool", "default": False},
    "require_preflight": {"type": "bool", "default": False},
    "preflight_max_age_s": {"type": "float", "default": 3600},
    "preflight_report_dir": {"type": "str"},
    "base_python": {"type": "str", "default": ""},
    "runtime_python": {"type": "str", "default": ""},
    "probe_timeout_s": {"type": "float", "default": 5},
    "task_timeout_s": {"type": "int", "default": 120},
    "sync_timeout_s": {"type": "int", "default": 1800},
    "report_dir": {"type": "str", "default": "reports"},
    **autostop.ARGUMENT_SPEC,
}
# Read raw from the play's variables (templates per cell), or set by the role itself: not typos.
ROLE_VARIABLES = ("launch_command", "launch_checkpoint_dir", "launch_box", "launch_effective_id")
KNOWN_VARIABLES = frozenset((*(f"{PREFIX}{name}" for name in ARGUMENT_SPEC), *ROLE_VARIABLES))
# Options a user types without the prefix (-e allow_concurrent=true): the role never reads these names, so such a
# variable is a typo of launch_<name>. The profile's own names (data_dir, durable_dir, env_hook, detach,
# preflight_report_dir) are read as defaults and are not here.
SHORT_NAMES = (
    "allow_concurrent", "apply_changes", "new_attempt", "skip_preflight", "require_preflight", "stop_on_failure",
    "gpus_per_cell", "max_parallel", "code_dir", "code_dest", "git_repo", "git_ref", "shard_hosts",
    "optional_artifacts", "verify_cmd", "verify_artifacts", "check_finite", "checkpoint_dir", "autostop",
    "autostop_disarm",
)  # fmt: skip
# Options that, not given, take the platform profile's variable of the same name (as the role's defaults did).
PROFILE = ("data_dir", "durable_dir", "env_hook", "detach", "preflight_report_dir")
# training_run options passed as they are (the others are shaped, or left out at the module's default).
MODULE_OPTIONS = (
    "env", "prune", "artifacts", "optional_artifacts", "verify_timeout_s", "check_finite", "apply_changes",
    "stop_on_failure", "detach", "allow_concurrent", "stop_grace_s", "monitor_interval_s", "monitor_max_bytes",
    "start_timeout_s", "new_attempt",
)  # fmt: skip
DETACH = ("auto", "tmux", "setsid")
RUNTIME_VENV_PYTHON = ".remote_gpu_trainer/venv/bin/python"
HIDDEN = "<hidden>"
# (option, low, high, low excluded): the module's own bounds, said before a box is asked.
BOUNDS = (
    ("gpus_per_cell", 0, 1024, False), ("max_parallel", 0, 1024, False), ("stop_grace_s", 0, 3600, False),
    ("monitor_interval_s", 0.1, 86400, False), ("monitor_max_bytes", 4096, 1 << 40, False),
    ("start_timeout_s", 0, 600, True), ("verify_timeout_s", 1, 86400, False), ("git_depth", 0, 1 << 31, False),
    ("preflight_max_age_s", 0, 1 << 31, False), ("probe_timeout_s", 0, 600, True),
    ("task_timeout_s", 1, 86400, False), ("sync_timeout_s", 1, 604800, False),
)  # fmt: skip
# An environment variable's name that says it holds a credential: its value belongs in launch_secrets.
CREDENTIAL = re.compile(r"(?:^|_)API_KEY$|(?:^|_)TOKEN$|SECRET|PASSWORD", re.IGNORECASE)
ENV_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
SECRET_SOURCES = ("env", "file")

# Argument-spec messages, told in plain words about the role variable (never its value: it may be a secret).
_CONVERT = re.compile(r"argument '?([\w.]+)'? is of type (\w+) and we were unable to convert to (\w+)")
_ELEMENTS = re.compile(
    r"Elements value for option '?([\w.]+)'? is of type (\w+) and we were unable to convert to (\w+)"
)
_MISSING = re.compile(r"missing required arguments: (.*)")
_CHOICES = re.compile(r"value of '?([\w.]+)'? must be one of: (.*?), got: ", re.S)
WANTED = {"str": "text", "path": "a path (text)", "int": "a whole number", "float": "a number", "bool": "true or false",
          "list": "a list", "dict": "a mapping (name: value)", "raw": "a value"}  # fmt: skip
ELEMENTS = {"str": "texts", "int": "whole numbers", "float": "numbers", "dict": "mappings (name: value)"}


def plain_message(message: str) -> str:
    """An ``ArgumentSpecValidator`` message told about ``launch_<option>`` in plain words, without the value."""
    found = _MISSING.match(message)
    if found:
        return "; ".join(f"{PREFIX}{name.strip()} is required" for name in found.group(1).split(",") if name.strip())
    found = _CONVERT.match(message)
    if found:
        option, given, wanted = found.groups()
        return f"{PREFIX}{option} must be {WANTED.get(wanted, wanted)}, not {kind_of(type_name=given)}"
    found = _ELEMENTS.match(message)
    if found:
        option, given, wanted = found.groups()
        return f"{PREFIX}{option} must be a list of {ELEMENTS.get(wanted, wanted)}, not of {kind_of(type_name=given)}"
    found = _CHOICES.match(message)
    if found:
        return f"{PREFIX}{found.group(1)} must be one of {found.group(2)}"
    words = re.sub(
        r"'([a-z_]+)'", lambda m: PREFIX + m.group(1) if m.group(1) in ARGUMENT_SPEC else m.group(0), message
    )
    return one_line(words.split(": <class", 1)[0])


def typo_problems(variables: Mapping[str, Any]) -> List[str]:
    """``launch_*`` variables the stage does not know, and its short names set without the prefix."""
    problems = [
        f"{name} is not a variable of launch{closest(name, KNOWN_VARIABLES)}"
        for name in sorted(variables)
        if name.startswith(PREFIX) and name not in KNOWN_VARIABLES
    ]
    for name in sorted(variables):
        match = difflib.get_close_matches(name, SHORT_NAMES, n=1, cutoff=0.85)
        if match:
            problems.append(f"{name} is not a variable of launch (did you mean {PREFIX}{match[0]}?)")
    return problems


def _rendered(value: Any, templar: Any) -> Any:
    """A variable read from ``task_vars`` (raw there): rendered when it holds a template."""
    return plain(templar.template(value)) if isinstance(value, str) and "{{" in value else plain(value)


def _profile(options: Dict[str, Any], task_vars: Mapping[str, Any], templar: Any) -> None:
    """Options not given take the profile's variable, as the role's defaults did (an empty data_dir too)."""
    for option in PROFILE:
        if options[option] is None or (option == "data_dir" and not options[option]):
            options[option] = _rendered(task_vars.get(option), templar)
    options["detach"] = options["detach"] or "auto"
    options["preflight_report_dir"] = options["preflight_report_dir"] or "reports"
    for option in ("data_dir", "durable_dir", "env_hook"):
        options[option] = options[option] or ""


def _path_problems(options: Mapping[str, Any]) -> List[str]:
    problems = []
    if not options["data_dir"]:
        problems.append(f"{PREFIX}data_dir is required (an absolute path on the box; default: the profile's data_dir)")
    elif not (isinstance(options["data_dir"], str) and posixpath.isabs(options["data_dir"])):
        problems.append(f"{PREFIX}data_dir must be an absolute path on the box, not {options['data_dir']!r}")
    for option in ("durable_dir", "env_hook", "code_dest", "workdir"):
        value = options[option]
        if value and not (isinstance(value, str) and posixpath.isabs(value)):
            problems.append(f"{PREFIX}{option} must be empty or an absolute path on the box, not {value!r}")
    if options["detach"] not in DETACH:
        problems.append(f"{PREFIX}detach must be one of {', '.join(DETACH)}, not {options['detach']!r}")
    if not NAME_PATTERN.match(options["run"]):
        problems.append(
            f"{PREFIX}run must match {NAME_PATTERN.pattern} (letters, digits, _ . -), not {options['run']!r}"
        )
    if options["id"] and not NAME_PATTERN.match(options["id"]):
        problems.append(f"{PREFIX}id must be empty or match {NAME_PATTERN.pattern}, not {options['id']!r}")
    return problems


def _bound_problems(options: Mapping[str, Any]) -> List[str]:
    problems = []
    for option, low, high, above in BOUNDS:
        value = options[option]
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            floor = "above" if above else "at least"
            problems.append(f"{PREFIX}{option} must be a number {floor} {low:g} and at most {high:g}, not {value!r}")
    bad = [gpu for gpu in options["gpus"] if not 0 <= gpu <= 1023]
    if bad:
        problems.append(f"{PREFIX}gpus must be GPU indices between 0 and 1023, not {bad}")
    if options["gpus"] and options["gpus_per_cell"] > len(options["gpus"]):
        problems.append(f"{PREFIX}gpus_per_cell is more than the {len(options['gpus'])} GPUs of {PREFIX}gpus")
    return problems


def _code(options: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """Where the code comes from; fills ``code_dest`` and ``workdir`` when not given (the role's old defaults)."""
    if options["code_dir"] and options["git_repo"]:
        return {"kind": "none"}, [f"give one code source, {PREFIX}code_dir or {PREFIX}git_repo, not both"]
    if not (options["code_dir"] or options["git_repo"]):
        if options["workdir"]:
            return {"kind": "none"}, []
        return {"kind": "none"}, [f"{PREFIX}workdir is required when no {PREFIX}code_dir or {PREFIX}git_repo is given"]
    options["code_dest"] = options["code_dest"] or posixpath.join(options["data_dir"], "code", options["run"])
    options["workdir"] = options["workdir"] or options["code_dest"]
    if options["git_repo"]:
        code = {key: options[f"git_{key}"] for key in ("repo", "ref", "depth", "environment")}
        return {"kind": "git", "dest": options["code_dest"], **code}, []
    source = os.path.abspath(os.path.expanduser(options["code_dir"]))
    code = {"kind": "rsync", "source": source, "dest": options["code_dest"], "excludes": options["code_excludes"]}
    code["delete"] = options["code_delete"]
    if not os.path.isdir(source):
        return code, [f"{PREFIX}code_dir must be a directory on the controller, and {source} is not one"]
    return code, []


def _env(env: Mapping[str, Any], secrets: Mapping[str, Any]) -> Tuple[Dict[str, str], List[str]]:
    """The cells' environment as texts; a credential-looking name is refused, and its value never shown."""
    out: Dict[str, str] = {}
    problems = []
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            problems.append(f"{PREFIX}env: {name!r} is not an environment variable name (letters, digits, _)")
        elif CREDENTIAL.search(name):
            problems.append(
                f"{PREFIX}env.{name} looks like a credential (its value is not shown): move it to {PREFIX}secrets as "
                f"{name}: {{env: VARIABLE}} or {{file: PATH}}, which reaches only the cells' environment"
            )
        elif name in secrets:
            problems.append(f"{PREFIX}env.{name} is in {PREFIX}secrets too: give it once, in {PREFIX}secrets")
        elif isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[name] = str(plain(value))
        else:
            problems.append(f"{PREFIX}env.{name} must be text or a number, not {kind_of(value)}")
    if str(env.get("WANDB_MODE", "")).lower() == "online" and "WANDB_API_KEY" not in secrets:
        problems.append(
            f"{PREFIX}env WANDB_MODE=online needs WANDB_API_KEY in {PREFIX}secrets "
            "(WANDB_API_KEY: {env: WANDB_API_KEY}): without a key W&B cannot log online"
        )
    return out, problems


def _read_file(path: str, loader: Any) -> str:
    if loader is not None:  # Ansible's loader decrypts a vault-encrypted file, as the file lookup did
        return str(loader.get_text_file_contents(path))
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if text.startswith("$ANSIBLE_VAULT;"):
        raise ValueError("vault-encrypted, and no loader was given to decrypt it")
    return text


def _secret(name: str, source: Any, loader: Any) -> Tuple[str, str]:
    """One secret's value and its problem (naming the secret and its source, never a value)."""
    where = f"{PREFIX}secrets.{name}"
    keys = sorted(source) if isinstance(source, Mapping) else []
    if len(keys) != 1 or keys[0] not in SECRET_SOURCES or not isinstance(source[keys[0]], str) or not source[keys[0]]:
        return "", f"{where} must be {{env: VARIABLE}} or {{file: PATH}} (exactly one, not empty)"
    if keys[0] == "env":
        value = os.environ.get(source["env"], "")
        return (
            value,
            "" if value else f"{where}: the controller's environment variable {source['env']} is unset or empty",
        )
    path = os.path.abspath(os.path.expanduser(source["file"]))
    if not os.path.isfile(path):
        return "", f"{where}: the controller file {path} does not exist (or is no file)"
    try:
        value = _read_file(path, loader).rstrip()
    except Exception as error:  # unreadable, or a vault file without its password: the reason, never content
        reason = error.strerror if isinstance(error, OSError) and error.strerror else one_line(error, 120)
        return "", f"{where}: the controller file {path} cannot be read ({reason})"
    return value, "" if value else f"{where}: the controller file {path} is empty"


def _secrets(secrets: Mapping[str, Any], loader: Any) -> Tuple[Dict[str, str], List[str]]:
    values: Dict[str, str] = {}
    problems = []
    for name, source in secrets.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            problems.append(f"{PREFIX}secrets: {name!r} is not an environment variable name (letters, digits, _)")
            continue
        values[str(name)], problem = _secret(str(name), source, loader)
        problems += [problem] if problem else []
    return values, problems


def _verify_cmd(raw: Any) -> Tuple[Optional[List[str]], List[str]]:
    """The per-artifact load check as an argv: a list, or one command line split like a shell would."""
    if raw is None or raw in ("", []):
        return None, []
    if isinstance(raw, str):
        try:
            argv = shlex.split(raw)
        except ValueError as error:
            return None, [f"{PREFIX}verify_cmd cannot be split like a shell command line: {error}"]
        return argv or None, []
    if not isinstance(raw, (list, tuple)) or not all(isinstance(part, (str, int, float)) for part in raw):
        return None, [f"{PREFIX}verify_cmd must be an argv list or one command line (text), not {kind_of(raw)}"]
    argv = [str(plain(part)) for part in raw]
    return (argv, []) if argv[0] else (None, [f"{PREFIX}verify_cmd: its program (first element) is empty"])


def _inventory_hosts(pattern: str, task_vars: Mapping[str, Any]) -> List[str]:
    """The inventory's hosts matching ``pattern``, as the inventory_hostnames lookup finds them: from ``groups``
    (the whole inventory), never the play's hosts, so ``--limit`` cannot change a box's shard."""
    from ansible.inventory.manager import InventoryManager  # noqa: PLC0415 (the controller only, when sharding)

    manager = InventoryManager(None, parse=False)  # nothing to parse: the hosts come from groups
    for group, hosts in (task_vars.get("groups") or {}).items():
        manager.add_group(str(group))
        for host in hosts:
            manager.add_host(str(host), group=str(group))
    return [str(host.name) for host in manager.get_hosts(pattern=pattern)]


def _shard(options: Mapping[str, Any], task_vars: Mapping[str, Any], host: str) -> Tuple[Any, List]:
    """``{index, count}`` of this host among the sorted shard hosts (the same hosts always split alike), or None."""
    if not options["shard"]:
        return None, []
    given = options["shard_hosts"]
    hosts = sorted(set(given if given is not None else _inventory_hosts(options["hosts"], task_vars)))
    if host not in hosts:
        shown = ", ".join(hosts[:10]) + (f" (+{len(hosts) - 10} more)" if len(hosts) > 10 else "")
        return None, [f"{PREFIX}shard: this host {host} is not among {PREFIX}shard_hosts ({shown or 'none'})"]
    return {"index": hosts.index(host), "count": len(hosts)}, []


def _module_args(options: Mapping[str, Any], planned: List[Dict[str, Any]], extra: Mapping[str, Any]) -> Dict:
    """training_run's options; the ones at the module's default (empty, 0, none) left out, as the role did."""
    module: Dict[str, Any] = {"run": options["run"], "state": "started", "data_dir": options["data_dir"]}
    given = {key: options[key] for key in ("durable_dir", "env_hook", "conda_env", "gpus", "gpus_per_cell")}
    given.update(max_parallel=options["max_parallel"], launch_id=options["id"], **extra)
    module.update({key: value for key, value in given.items() if value not in (None, "", 0, [], {})})
    module.update(workdir=options["workdir"], cells=planned)
    module.update({key: options[key] for key in MODULE_OPTIONS})
    return module


def redacted(settings: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``settings`` for a record: every secret's value replaced by ``<hidden>``."""
    copied = copy.deepcopy(dict(settings))
    module = copied.get("module_args") or {}
    if module.get("secrets"):
        module["secrets"] = dict.fromkeys(module["secrets"], HIDDEN)
    return copied


def _base_python(options: Mapping[str, Any], task_vars: Mapping[str, Any], templar: Any) -> str:
    """The box's Python for the runtime probe: the inventory's interpreter unless it is discovered (auto*)."""
    configured = _rendered(task_vars.get("ansible_python_interpreter"), templar)
    if options["base_python"]:
        return str(options["base_python"])
    return configured if isinstance(configured, str) and configured and not configured.startswith("auto") else "python3"


def _verify_artifacts_problems(patterns: List[str], verify_cmd: Optional[List[str]], cmd_refused: bool) -> List[str]:
    """The globs choosing what verify_cmd runs on: relative, and only with a verify_cmd to run."""
    problems = cells.glob_problems(patterns, f"{PREFIX}verify_artifacts")
    if patterns and verify_cmd is None and not cmd_refused:
        problems.append(f"{PREFIX}verify_artifacts chooses what {PREFIX}verify_cmd runs on, but it is not set")
    return problems


def settings_of(
    args: Mapping[str, Any], task_vars: Mapping[str, Any], templar: Any, loader: Any = None
) -> Tuple[Optional[Dict], List[str]]:
    """This host's launch settings, or every problem found (one line each); see the module's docstring.

    ``loader``: the action's ``self._loader``, which decrypts a vault-encrypted secret file (without it such a file
    is refused, naming the secret).
    """
    problems = typo_problems(task_vars)
    validated = ArgumentSpecValidator(ARGUMENT_SPEC).validate(dict(args))
    _command, _checkpoint, template_problems = cells.templates(task_vars)
    if validated.error_messages:
        return None, problems + [plain_message(message) for message in validated.error_messages] + template_problems
    options: Dict[str, Any] = plain(validated.validated_parameters)
    _profile(options, task_vars, templar)
    problems += template_problems + _path_problems(options) + _bound_problems(options)
    problems += cells.cell_problems(validated.validated_parameters["cells"], options)
    code, more = _code(options)
    secret_values, secret_problems = _secrets(options["secrets"], loader)
    env, env_problems = _env(options["env"], options["secrets"])
    verify_cmd, verify_problems = _verify_cmd(options["verify_cmd"])
    verify_problems += _verify_artifacts_problems(options["verify_artifacts"], verify_cmd, bool(verify_problems))
    host = str(task_vars.get("inventory_hostname") or "")
    shard, shard_problems = _shard(options, task_vars, host)
    stop, stop_problems = autostop.autostop_of(options, task_vars, templar, host)
    rate, rate_problem = hourly_rate(task_vars, templar)  # a bad rate only loses the cost: a warning, as everywhere
    problems += more + secret_problems + env_problems + verify_problems + shard_problems + stop_problems
    if problems:
        return None, problems
    index, count = (shard["index"], shard["count"]) if shard else (0, 1)
    mine = [cell for position, cell in enumerate(validated.validated_parameters["cells"]) if position % count == index]
    run_dir = posixpath.join(options["data_dir"], "runs", options["run"])
    scope = {"run": options["run"], "run_dir": run_dir, "data_dir": options["data_dir"]}
    planned, problems = cells.render(mine, task_vars, templar, dict(scope, durable_dir=options["durable_dir"]))
    if problems:
        return None, problems
    extra = {
        "secrets": secret_values, "verify_cmd": verify_cmd, "verify_artifacts": options["verify_artifacts"],
        "shard": shard, "autostop": stop,
    }  # fmt: skip
    return {
        "host": host,
        **scope,
        "durable_dir": options["durable_dir"],
        "workdir": options["workdir"],
        "code": code,
        "module_args": _module_args(dict(options, env=env), planned, extra),
        "cells": [cell["name"] for cell in planned],
        "shard": shard,
        "secret_names": sorted(secret_values),
        "launch_id": options["id"],
        "preflight": {
            "skip": options["skip_preflight"],
            "require": options["require_preflight"],
            "max_age_s": options["preflight_max_age_s"],
            "report_dir": options["preflight_report_dir"],
        },
        "runtime_python": options["runtime_python"] or posixpath.join(options["data_dir"], RUNTIME_VENV_PYTHON),
        "base_python": _base_python(options, task_vars, templar),
        "probe_timeout_s": options["probe_timeout_s"],
        "task_timeout_s": options["task_timeout_s"],
        "sync_timeout_s": options["sync_timeout_s"],
        "report_dir": options["report_dir"],
        "autostop": stop,
        "hourly_usd": rate,
        "hourly_usd_warning": rate_problem,
    }, []
