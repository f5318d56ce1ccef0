# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Launch's cells on the controller: each sweep cell checked, then rendered into one ``training_run`` cell.

Part of ``_launch_settings`` (which calls it); split out to keep each file readable. The command template
(``launch_command``) and ``launch_checkpoint_dir`` arrive raw from the play's variables and are rendered here once per
cell with the action's templar, so nothing on a box evaluates a template or a shell string.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections import ChainMap
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line

try:
    from ansible.template import is_trusted_as_template
except ImportError:  # ansible-core before 2.19 renders every string

    def is_trusted_as_template(value: Any) -> bool:
        return True


PREFIX = "launch_"
# A cell's own keys that training_run reads (the run's key of the same name when absent); the others are the
# user's values for the command template.
CELL_GLOBS = ("artifacts", "optional_artifacts", "prune")
CELL_MODULE_KEYS = ("checkpoint_dir", "timeout_s", "retries", *CELL_GLOBS)
KINDS = {"str": "text", "int": "a whole number", "float": "a number", "bool": "true/false", "list": "a list",
         "dict": "a mapping", "NoneType": "null"}  # fmt: skip
_NO_KEY = re.compile(r"has no attribute '([^']+)'")
_UNDEFINED = re.compile(r"'([^']+)' is undefined")


def kind_of(value: Any = None, type_name: str = "") -> str:
    """A value's kind in plain words; Ansible's tagged types (``_AnsibleTaggedStr``) read as their base type."""
    name = type_name or type(value).__name__
    name = name[len("_AnsibleTagged") :].lower() if name.startswith("_AnsibleTagged") else name
    return KINDS.get(name, "another kind of value")


def plain(value: Any) -> Any:
    """A copy without Ansible's tags (its tagged str, int, dict ... types), for module options and records."""
    if isinstance(value, bool) or value is None:
        return value
    for kind in (int, float, str):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def glob_problems(value: Any, what: str) -> List[str]:
    """Globs relative to the checkpoint directory that stay inside it (``dir/`` names a directory)."""
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        return [f"{what} must be a list of relative glob patterns (texts, none empty)"]
    outside = [item for item in value if item.startswith("/") or ".." in item.split("/")]
    if outside:
        return [f"{what}: {', '.join(outside)} must be relative and stay inside the checkpoint directory"]
    return []


def _own_key_problems(cell: Mapping[str, Any], where: str) -> List[str]:
    problems = []
    timeout = cell.get("timeout_s")
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if timeout is not None and not (number and math.isfinite(timeout) and timeout >= 1):
        problems.append(f"{where}: timeout_s must be a number of seconds, at least 1, not {timeout!r}")
    retries = cell.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        problems.append(f"{where}: retries must be a whole number, at least 0, not {retries!r}")
    checkpoint = cell.get("checkpoint_dir")
    if checkpoint is not None and not (isinstance(checkpoint, str) and posixpath.isabs(checkpoint)):
        problems.append(f"{where}: checkpoint_dir must be an absolute path on the box, not {checkpoint!r}")
    for key in CELL_GLOBS:
        if key in cell:
            problems += glob_problems(cell[key], f"{where}: {key}")
    return problems


def cell_problems(cells: Any, run_keys: Mapping[str, Any]) -> List[str]:
    """Each cell a mapping with a unique ``name`` and valid own keys; the run's globs; a durable dir if needed."""
    if not isinstance(cells, list) or not cells:
        return [f"{PREFIX}cells must be a non-empty list of cells (mappings with a name)"]
    problems: List[str] = []
    names: List[str] = []
    declares = bool(run_keys["artifacts"] or run_keys["optional_artifacts"])
    for index, cell in enumerate(cells):
        if not isinstance(cell, Mapping):
            problems.append(f"{PREFIX}cells[{index}] must be a mapping with a name, not {kind_of(cell)}")
            continue
        name = cell.get("name")
        if name is None:
            problems.append(f"{PREFIX}cells[{index}] has no name (each cell needs one matching {NAME_PATTERN.pattern})")
            continue
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            problems.append(f"{PREFIX}cells[{index}].name {name!r} must match {NAME_PATTERN.pattern}")
            continue
        names.append(name)
        problems += _own_key_problems(cell, f"{PREFIX}cells {name}")
        declares = declares or any(isinstance(cell.get(key), list) and cell[key] for key in CELL_GLOBS[:2])
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"{PREFIX}cells: names must be unique, and these repeat: {', '.join(duplicates)}")
    for key in CELL_GLOBS:
        problems += glob_problems(run_keys[key], f"{PREFIX}{key}")
    if declares and not run_keys["durable_dir"]:
        problems.append(f"artifacts are declared but {PREFIX}durable_dir is empty: copies need a durable directory")
    return problems


def _argv_parts(value: Any, nested: bool = False) -> Optional[List[str]]:
    """A rendered element as argv parts: text as is, a number or a boolean as text, a flat list spliced in."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (str, int)) or (isinstance(value, float) and math.isfinite(value)):
        return [str(plain(value))]
    if isinstance(value, (list, tuple)) and not nested:
        parts = [_argv_parts(item, nested=True) for item in value]
        return None if any(part is None for part in parts) else [item for part in parts for item in part or []]
    return None


def _template_error(error: Exception, variable: str, cell: str) -> str:
    """An undefined key named plainly ("cell lr-3 has no key 'seed'"); other template errors in one line."""
    message = str(getattr(error, "message", "") or error)
    found = _NO_KEY.search(message)
    if found:
        return f"{variable}: cell {cell} has no key '{found.group(1)}'"
    found = _UNDEFINED.search(message)
    if found:
        return f"{variable}: cell {cell}: the variable '{found.group(1)}' is undefined"
    return f"{variable}: cell {cell}: {one_line(message, 200)}"


def _render_cell(
    cell: Mapping[str, Any], raw: List[Any], checkpoint: Any, templar: Any, scope: Dict
) -> Union[Dict, str]:
    """One ``training_run`` cell, or the problem (one line)."""
    name = str(cell["name"])
    local = dict(scope, cell=cell, cell_dir=posixpath.join(scope["run_dir"], "cells", name))
    scoped = templar.copy_with_new_env(available_variables=ChainMap(local, scope["task_vars"]))
    argv: List[str] = []
    for position, element in enumerate(raw):
        if isinstance(element, str) and "{{" in element and not is_trusted_as_template(element):
            return f"{PREFIX}command element {position} is not a trusted template (set it in vars, not from a result)"
        try:
            rendered = scoped.template(element)
        except Exception as error:  # an undefined key, a syntax error: one line naming the cell
            return _template_error(error, f"{PREFIX}command", name)
        parts = _argv_parts(rendered)
        if parts is None:
            return f"{PREFIX}command: cell {name}: element {position} rendered to {kind_of(rendered)}, not text"
        argv += parts
    if not argv or not argv[0]:
        return f"{PREFIX}command: cell {name}: the argv is empty or its program (first element) rendered empty"
    entry: Dict[str, Any] = {"name": name, "command": argv}
    if cell.get("checkpoint_dir") is None and checkpoint not in (None, ""):
        try:
            rendered = scoped.template(checkpoint)
        except Exception as error:
            return _template_error(error, f"{PREFIX}checkpoint_dir", name)
        if not isinstance(rendered, str) or not posixpath.isabs(rendered):
            return f"{PREFIX}checkpoint_dir: cell {name}: rendered to {plain(rendered)!r}, not an absolute path"
        entry["checkpoint_dir"] = str(rendered)
    entry.update({key: plain(cell[key]) for key in CELL_MODULE_KEYS if cell.get(key) is not None})
    return entry


def templates(task_vars: Mapping[str, Any]) -> Tuple[List[Any], Any, List[str]]:
    """The raw ``launch_command`` (a non-empty list) and ``launch_checkpoint_dir`` (text or None), and problems."""
    raw = task_vars.get(f"{PREFIX}command")
    checkpoint = task_vars.get(f"{PREFIX}checkpoint_dir")
    problems = []
    if raw is None:
        problems.append(f"{PREFIX}command is required (the argv template, a list such as [python, train.py, ...])")
    elif not isinstance(raw, (list, tuple)) or not raw:
        problems.append(f"{PREFIX}command must be a non-empty list (the argv template), not {kind_of(raw)}")
    if checkpoint is not None and not isinstance(checkpoint, str):
        problems.append(f"{PREFIX}checkpoint_dir must be text (a path template), not {kind_of(checkpoint)}")
    return (list(raw) if isinstance(raw, (list, tuple)) else []), checkpoint, problems


def render(cells: List[Mapping[str, Any]], task_vars: Mapping[str, Any], templar: Any, scope: Dict) -> Tuple:
    """``(training_run cells, problems)`` of ``cells`` from the raw templates (valid: see ``templates``).

    ``scope``: ``run``, ``run_dir``, ``data_dir``, ``durable_dir``, the variables each cell's rendering sees besides
    ``cell``, ``cell_dir`` and the play's own variables.
    """
    raw, checkpoint, _problems = templates(task_vars)
    entries, problems = [], []
    for cell in cells:
        entry = _render_cell(cell, raw, checkpoint, templar, dict(scope, task_vars=task_vars))
        if isinstance(entry, str):
            problems.append(entry)
        else:
            entries.append(entry)
    return entries, problems
