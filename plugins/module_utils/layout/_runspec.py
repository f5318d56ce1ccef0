# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a run executes: the spec ``training_run`` writes to ``<run>/spec.json`` and the on-box runner reads.

The spec is the only input of the runner, so a runner started again from the same directory (a resume, a box
that rebooted) does the same work. It never holds a secret: those live in ``<run>/.secrets.json`` (mode 0600)
and reach only the cells' environment. Pure standard library, Python 3.8+.

Beside the contract's files (run-layout.md), a run directory holds::

    spec.json          this spec (schema 1)
    .secrets.json      {"NAME": "value"} for the cells' environment, 0600, absent when there are none
    runner/            the runner's code, installed at every start (run.py + ansible_collections/...)
    runner.log         the runner's own events, one line each (never an environment value)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    NAME_PATTERN,
    durable_run_dir,
    run_dir,
)

SPEC_SCHEMA = 1
MAX_SPEC_BYTES = 4 * 1024 * 1024
DEFAULT_STOP_GRACE_S = 30.0
DEFAULT_MONITOR_INTERVAL_S = 30.0
DEFAULT_MONITOR_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_VERIFY_TIMEOUT_S = 300.0
# The artifact lists a cell may set for itself; absent (None), the run's list of the same name applies.
ARTIFACT_KEYS = ("artifacts", "optional_artifacts", "prune")
# Environment names a run may set; a secret or variable with another name is refused before anything starts.
ENV_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


@dataclass(frozen=True)
class CellSpec:
    """One cell: its argv (already rendered from the run's template), its limits and where its outputs are."""

    name: str
    command: Tuple[str, ...]
    timeout_s: Optional[float] = None
    retries: int = 0
    # Where the cell writes checkpoints, absolute; None: the cell directory. Prune and artifact globs are relative
    # to it.
    checkpoint_dir: Optional[str] = None
    # The cell's own lists (ARTIFACT_KEYS); None: the run's. An empty tuple is the cell's own "none".
    artifacts: Optional[Tuple[str, ...]] = None
    optional_artifacts: Optional[Tuple[str, ...]] = None
    prune: Optional[Tuple[str, ...]] = None


@dataclass(frozen=True)
class RunSpec:
    run: str
    data_dir: str
    durable_dir: Optional[str]
    workdir: str
    cells: Tuple[CellSpec, ...]
    env: Dict[str, str] = field(default_factory=dict)
    env_hook: Optional[str] = None  # a file sourced before each command (trusted operator input)
    conda_env: Optional[str] = None
    gpus: Tuple[int, ...] = ()  # the box's GPU indices the run may use
    gpus_per_cell: Optional[int] = None  # None: every GPU, one cell at a time
    max_parallel: Optional[int] = None
    prune: Tuple[str, ...] = ()
    artifacts: Tuple[str, ...] = ()
    optional_artifacts: Tuple[str, ...] = ()  # patterns that may match nothing
    # Run on each copied artifact (argv; "{path}" replaced by the copy's path, else the path is appended).
    verify_cmd: Optional[Tuple[str, ...]] = None
    verify_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S
    # Which artifacts verify_cmd runs on: fnmatch globs over the path relative to the checkpoint directory ("*"
    # matches "/" too, "**/" also none); empty: every artifact. A loader of checkpoints cannot take config.json.
    verify_artifacts: Tuple[str, ...] = ()
    check_finite: bool = False  # every *.safetensors artifact's float tensors must hold no NaN or Inf
    stop_on_failure: bool = False
    stop_grace_s: float = DEFAULT_STOP_GRACE_S
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S
    monitor_max_bytes: int = DEFAULT_MONITOR_MAX_BYTES
    shard: Optional[Dict[str, int]] = None  # {"index": i, "count": n} when the sweep was split across boxes
    # Which launch of the run name this is: recorded in run.json and in the durable copy (.launch.json).
    launch_id: Optional[str] = None

    @property
    def run_dir(self) -> str:
        return run_dir(self.data_dir, self.run)

    def artifacts_of(self, cell: CellSpec) -> Tuple[str, ...]:
        return self.artifacts if cell.artifacts is None else cell.artifacts

    def optional_artifacts_of(self, cell: CellSpec) -> Tuple[str, ...]:
        return self.optional_artifacts if cell.optional_artifacts is None else cell.optional_artifacts

    def prune_of(self, cell: CellSpec) -> Tuple[str, ...]:
        return self.prune if cell.prune is None else cell.prune

    def declares_artifacts(self, cell: CellSpec) -> bool:
        """The contract's done rule then needs ``sync: verified`` for this cell (``skipped`` is not enough)."""
        return bool(self.artifacts_of(cell) or self.optional_artifacts_of(cell))

    def slots(self) -> int:
        """How many cells may run at once."""
        whole_box = self.gpus_per_cell is None or not self.gpus
        by_gpus = 1 if whole_box else max(1, len(self.gpus) // (self.gpus_per_cell or 1))
        return min(by_gpus, self.max_parallel) if self.max_parallel else by_gpus

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["schema"] = SPEC_SCHEMA
        return data


def spec_json(run_directory: str) -> str:
    return os.path.join(run_directory, "spec.json")


def secrets_json(run_directory: str) -> str:
    return os.path.join(run_directory, ".secrets.json")


def runner_dir(run_directory: str) -> str:
    return os.path.join(run_directory, "runner")


def runner_log(run_directory: str) -> str:
    return os.path.join(run_directory, "runner.log")


def manifest_path(durable_dir: str, run: str) -> str:
    return os.path.join(durable_run_dir(durable_dir, run), "MANIFEST.sha256")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _name(value: Any, what: str) -> str:
    _require(
        isinstance(value, str) and bool(NAME_PATTERN.match(value)),
        f"{what} {value!r} does not match {NAME_PATTERN.pattern}",
    )
    return value


def _absolute(value: Any, what: str, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    _require(isinstance(value, str) and os.path.isabs(value), f"{what} must be an absolute path, not {value!r}")
    return os.path.normpath(value)


def _number(value: Any, what: str, minimum: float, optional: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum
    _require(ok, f"{what} must be a number of at least {minimum:g}, not {value!r}")
    return float(value)


def _integer(value: Any, what: str, minimum: int, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _require(ok, f"{what} must be an integer of at least {minimum}, not {value!r}")
    return int(value)


def _relative_globs(values: Any, what: str) -> Tuple[str, ...]:
    _require(
        isinstance(values, list) and all(isinstance(v, str) and v for v in values),
        f"{what} must be a list of non-empty strings",
    )
    for pattern in values:
        parts = pattern.split("/")
        _require(
            not os.path.isabs(pattern) and ".." not in parts,
            f"{what}: {pattern!r} must stay inside the cell's directory",
        )
    return tuple(values)


def _argv(value: Any, what: str) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    valid = isinstance(value, list) and bool(value) and all(isinstance(part, str) for part in value)
    _require(valid and bool(value[0]), f"{what} must be a non-empty list of strings (an argv), not {value!r}")
    _require(not any("\0" in part for part in value), f"{what} must not contain a NUL character")
    return tuple(value)


def _flag(value: Any, what: str) -> bool:
    _require(isinstance(value, bool), f"{what} must be true or false, not {value!r}")
    return value


def _environment(values: Any, what: str) -> Dict[str, str]:
    _require(isinstance(values, dict), f"{what} must be a mapping of names to strings")
    for key, value in values.items():
        valid = isinstance(key, str) and bool(key) and not key[0].isdigit() and set(key) <= ENV_NAME_CHARS
        _require(valid, f"{what}: {key!r} is not an environment variable name")
        _require(isinstance(value, str), f"{what}.{key} must be a string")
    return dict(values)


def _cell(data: Any, index: int) -> CellSpec:
    _require(isinstance(data, dict), f"cells[{index}] must be a mapping")
    name = _name(data.get("name"), f"cells[{index}].name")
    command = data.get("command")
    valid = isinstance(command, list) and bool(command) and all(isinstance(part, str) for part in command)
    _require(valid and bool(command[0]), f"cell {name}: command must be a non-empty list of strings (an argv)")
    return CellSpec(
        name=name,
        command=tuple(command),
        timeout_s=_number(data.get("timeout_s"), f"cell {name}: timeout_s", 1, optional=True),
        retries=_integer(data.get("retries", 0), f"cell {name}: retries", 0) or 0,
        checkpoint_dir=_absolute(data.get("checkpoint_dir"), f"cell {name}: checkpoint_dir", optional=True),
        **{
            key: _relative_globs(data[key], f"cell {name}: {key}") if data.get(key) is not None else None
            for key in ARTIFACT_KEYS
        },
    )


def parse_spec(data: Any) -> RunSpec:
    """Validate a spec document (spec.json, or the module's options shaped like it); ValueError names the field."""
    _require(isinstance(data, dict), "the run spec must be a mapping")
    _require(data.get("schema", SPEC_SCHEMA) == SPEC_SCHEMA, f"spec schema {data.get('schema')!r} is not {SPEC_SCHEMA}")
    cells_data = data.get("cells")
    _require(isinstance(cells_data, list) and bool(cells_data), "cells must be a non-empty list")
    cells = tuple(_cell(cell, index) for index, cell in enumerate(cells_data))
    names = [cell.name for cell in cells]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    _require(not duplicates, f"cell names must be unique: {', '.join(duplicates)}")
    gpus = data.get("gpus") or []
    _require(
        isinstance(gpus, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus),
        "gpus must be a list of GPU indices",
    )
    spec = RunSpec(
        run=_name(data.get("run"), "run"),
        data_dir=_absolute(data.get("data_dir"), "data_dir") or "",
        durable_dir=_absolute(data.get("durable_dir"), "durable_dir", optional=True),
        workdir=_absolute(data.get("workdir"), "workdir") or "",
        cells=cells,
        env=_environment(data.get("env") or {}, "env"),
        env_hook=_absolute(data.get("env_hook"), "env_hook", optional=True),
        conda_env=data.get("conda_env") or None,
        gpus=tuple(gpus),
        gpus_per_cell=_integer(data.get("gpus_per_cell"), "gpus_per_cell", 1, optional=True),
        max_parallel=_integer(data.get("max_parallel"), "max_parallel", 1, optional=True),
        prune=_relative_globs(data.get("prune") or [], "prune"),
        artifacts=_relative_globs(data.get("artifacts") or [], "artifacts"),
        optional_artifacts=_relative_globs(data.get("optional_artifacts") or [], "optional_artifacts"),
        verify_cmd=_argv(data.get("verify_cmd"), "verify_cmd"),
        verify_timeout_s=_number(data.get("verify_timeout_s", DEFAULT_VERIFY_TIMEOUT_S), "verify_timeout_s", 1)
        or DEFAULT_VERIFY_TIMEOUT_S,
        verify_artifacts=_relative_globs(data.get("verify_artifacts") or [], "verify_artifacts"),
        check_finite=_flag(data.get("check_finite", False), "check_finite"),
        stop_on_failure=bool(data.get("stop_on_failure", False)),
        stop_grace_s=_number(data.get("stop_grace_s", DEFAULT_STOP_GRACE_S), "stop_grace_s", 0) or 0.0,
        monitor_interval_s=_number(
            data.get("monitor_interval_s", DEFAULT_MONITOR_INTERVAL_S), "monitor_interval_s", 0.1
        )
        or DEFAULT_MONITOR_INTERVAL_S,
        monitor_max_bytes=_integer(data.get("monitor_max_bytes", DEFAULT_MONITOR_MAX_BYTES), "monitor_max_bytes", 4096)
        or DEFAULT_MONITOR_MAX_BYTES,
        shard=data.get("shard") or None,
        launch_id=_name(data["launch_id"], "launch_id") if data.get("launch_id") is not None else None,
    )
    if spec.gpus_per_cell is not None and spec.gpus:
        _require(
            spec.gpus_per_cell <= len(spec.gpus),
            f"gpus_per_cell {spec.gpus_per_cell} is more than the box's {len(spec.gpus)} GPUs",
        )
    _require(
        not spec.verify_artifacts or spec.verify_cmd is not None,
        "verify_artifacts chooses the artifacts verify_cmd runs on, but verify_cmd is not set",
    )
    declaring = [cell.name for cell in spec.cells if spec.declares_artifacts(cell)]
    _require(
        not declaring or spec.durable_dir is not None,
        f"artifacts are declared but durable_dir is not set (cells {', '.join(declaring)})",
    )
    _require(spec.conda_env is None or isinstance(spec.conda_env, str), "conda_env must be a string")
    return spec


def load_spec(run_directory: str) -> RunSpec:
    """Read and validate ``<run>/spec.json``; OSError or ValueError say why it cannot be used."""
    with open(spec_json(run_directory), "rb") as handle:
        raw = handle.read(MAX_SPEC_BYTES + 1)
    _require(len(raw) <= MAX_SPEC_BYTES, f"spec.json is larger than {MAX_SPEC_BYTES} bytes")
    return parse_spec(json.loads(raw.decode("utf-8")))


def read_secrets(run_directory: str) -> Dict[str, str]:
    """The cells' secret environment; {} when the run has none."""
    try:
        with open(secrets_json(run_directory), encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {}
    return _environment(data, "secrets")
