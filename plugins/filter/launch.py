# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Launch filters for the sweep: its cells and secrets checked, its split across the fleet, each cell's argv and the
rsync command that ships the code with the host's own SSH settings.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
The filters never evaluate a template or build a shell string: the role renders the command template, these only
check and shape what came out.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common import _rsync_argv as rsync
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import NAME_PATTERN

ENV_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
SECRET_SOURCES = ("env", "file")
# Keys of a sweep cell the module reads; every other key is for the command template only.
CELL_MODULE_KEYS = ("timeout_s", "retries")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _cell_problems(index: int, cell: Any) -> List[str]:
    if not isinstance(cell, Mapping):
        return [f"cells[{index}] must be a mapping with a name, not {type(cell).__name__}"]
    name = cell.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        return [f"cells[{index}].name {name!r} does not match {NAME_PATTERN.pattern}"]
    problems = []
    timeout = cell.get("timeout_s")
    if timeout is not None and (not _is_number(timeout) or timeout < 1):
        problems.append(f"cell {name}: timeout_s must be a number of at least 1, not {timeout!r}")
    retries = cell.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        problems.append(f"cell {name}: retries must be a non-negative integer, not {retries!r}")
    return problems


def launch_cell_problems(cells: Any) -> List[str]:
    """What is wrong with the sweep's cells (empty when nothing): names, uniqueness, timeout_s, retries."""
    if not isinstance(cells, list) or not cells:
        return ["launch_cells must be a non-empty list of cells (mappings with a name)"]
    problems = [problem for index, cell in enumerate(cells) for problem in _cell_problems(index, cell)]
    names = [cell.get("name") for cell in cells if isinstance(cell, Mapping)]
    duplicates = sorted({str(name) for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"cell names must be unique: {', '.join(duplicates)}")
    return problems


def launch_secret_problems(secrets: Any) -> List[str]:
    """What is wrong with the secrets' *sources* (empty when nothing). Reads names and sources, never a value."""
    if not isinstance(secrets, Mapping):
        return ["launch_secrets must map environment variable names to {env: NAME} or {file: PATH}"]
    problems = []
    for name, source in secrets.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            problems.append(f"secret {name!r} is not an environment variable name")
            continue
        keys = sorted(source) if isinstance(source, Mapping) else []
        if len(keys) != 1 or keys[0] not in SECRET_SOURCES or not isinstance(source[keys[0]], str):
            problems.append(f"secret {name}: give exactly one of {{env: VARIABLE}} or {{file: PATH}} (got {keys})")
        elif not source[keys[0]]:
            problems.append(f"secret {name}: its {keys[0]} is empty")
    return problems


def launch_shard(cells: List[Mapping[str, Any]], hosts: Iterable[str], host: str, enabled: bool = True) -> Dict:
    """This host's share of the sweep: ``{index, count, hosts, cells}``.

    Hosts are sorted by name and cell ``i`` (in sweep order) goes to host ``i % count``: the same hosts and the same
    sweep always give the same split, so a relaunch never moves a cell. Without sharding every host runs every cell
    (``index`` 0, ``count`` 1).
    """
    if not enabled:
        return {"index": 0, "count": 1, "hosts": [host], "cells": list(cells)}
    ordered = sorted({str(name) for name in hosts})
    if host not in ordered:
        raise AnsibleFilterError(f"launch_shard: host {host!r} is not among the hosts to shard across {ordered}")
    index, count = ordered.index(host), len(ordered)
    mine = [cell for position, cell in enumerate(cells) if position % count == index]
    return {"index": index, "count": count, "hosts": ordered, "cells": mine}


def _argv_part(value: Any, cell: str, position: int, nested: bool = False) -> List[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, str):
        return [value]
    if _is_number(value):
        return [str(value)]
    if isinstance(value, (list, tuple)) and not nested:
        return [part for item in value for part in _argv_part(item, cell, position, nested=True)]
    raise AnsibleFilterError(
        f"cell {cell}: command element {position} rendered to {type(value).__name__} {str(value)[:60]!r}; "
        "each element must render to a string, a number or a flat list of them"
    )


def launch_argv(rendered: Any, cell: str = "?") -> List[str]:
    """The argv of a cell from its rendered command template: scalars as strings, a list element spliced in."""
    if not isinstance(rendered, (list, tuple)) or not rendered:
        raise AnsibleFilterError(f"cell {cell}: launch_command must be a non-empty list (an argv), not {rendered!r}")
    argv = [part for position, value in enumerate(rendered) for part in _argv_part(value, cell, position)]
    if not argv or not argv[0]:
        raise AnsibleFilterError(f"cell {cell}: the command's first element (the program) rendered empty")
    return argv


def launch_module_cell(cell: Mapping[str, Any], argv: List[str], checkpoint_dir: str = "") -> Dict[str, Any]:
    """One entry of training_run's ``cells``: the name, the rendered argv and the module's own per-cell keys."""
    entry: Dict[str, Any] = {"name": cell["name"], "command": list(argv)}
    for key in CELL_MODULE_KEYS:
        if cell.get(key) is not None:
            entry[key] = cell[key]
    if checkpoint_dir:
        if not str(checkpoint_dir).startswith("/"):
            raise AnsibleFilterError(f"cell {cell['name']}: checkpoint_dir {checkpoint_dir!r} must be absolute")
        entry["checkpoint_dir"] = str(checkpoint_dir)
    return entry


def launch_rsync_argv(
    connection: Mapping[str, Any],
    src: str,
    dest: str,
    *,
    excludes: Optional[List[str]] = None,
    delete: bool = False,
    dry_run: bool = False,
) -> List[str]:
    """rsync's argv to push the controller directory ``src`` into ``dest`` on the box, over the host's SSH settings.

    ``connection``: ``connection`` (the host's ansible_connection), ``host``, ``port``, ``user``,
    ``private_key_file``, ``common_args``, ``extra_args``. Delta transfers and rsync's size-and-mtime check (no
    ``--checksum``); ``--itemize-changes`` lists what was (or, with ``dry_run``, would be) sent.
    """
    argv = ["rsync", "--recursive", "--links", "--perms", "--times", "--compress", "--itemize-changes"]
    argv += [f"--exclude={pattern}" for pattern in excludes or []]
    if delete:
        argv.append("--delete")
    if dry_run:
        argv.append("--dry-run")
    source = str(src).rstrip("/") + "/"
    try:
        if not rsync.SAFE_REMOTE_PATH.match(str(dest)):
            raise rsync.RsyncArgvError(f"the code destination {dest!r} must be an absolute, plain path")
        if rsync.is_local(connection):
            return [*argv, source, f"{dest}/"]
        return [*argv, "-e", rsync.ssh_command(connection), source, rsync.remote_spec(connection, f"{dest}/")]
    except rsync.RsyncArgvError as error:
        raise AnsibleFilterError(f"launch_rsync_argv: {error}") from None


def launch_rsync_changes(output: Any) -> Dict[str, Any]:
    """What an ``--itemize-changes`` run sent: ``{changed, files, deleted}`` (paths, in rsync's order)."""
    # Every line is something rsync changed (or would): a file sent, a directory made, a time set, a deletion.
    lines = [line for line in str(output or "").splitlines() if line.strip()]
    files, deleted = [], []
    for line in lines:
        if line.startswith("*deleting"):
            deleted.append(line.split(None, 1)[-1])
        elif len(line) > 12 and line[1] == "f":
            files.append(line[12:])
    return {"changed": bool(lines), "files": files, "deleted": deleted}


class FilterModule:
    """Launch filters for the sweep and the code sync."""

    def filters(self) -> Dict[str, Any]:
        return {
            "launch_cell_problems": launch_cell_problems,
            "launch_secret_problems": launch_secret_problems,
            "launch_shard": launch_shard,
            "launch_argv": launch_argv,
            "launch_module_cell": launch_module_cell,
            "launch_rsync_argv": launch_rsync_argv,
            "launch_rsync_changes": launch_rsync_changes,
        }
