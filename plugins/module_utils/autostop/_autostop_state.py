# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The autostop watcher's files on a box: ``armed.json`` (its configuration, written by arming), ``.autostop.json``
(its decision and the stop's outcome, written only by the watcher), ``watch.log`` and the ``watch.lock`` it holds
for life.

Readers without a process of their own (arming, patrol_facts) use :func:`read_decision` and :func:`watcher_alive`;
every touch of data_dir runs in a forked child under a deadline (a hung mount answers "unreadable", never hangs).
No secret value is ever read or written here: ``armed.json`` names environment variables, never their values.
Pure standard library.
"""

from __future__ import annotations

import fcntl
import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    MAX_RUN_JSON_BYTES,
    NAME_PATTERN,
    autostop_armed_path,
    autostop_dir,
    autostop_path,
    write_json_atomic,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop import Plan, parse_verb, plan_for

VERSION = 1
STATES = (
    "waiting", "idle_wait", "silence_wait", "gate_failed", "stopping", "stopped", "failed", "unconfirmed", "disarmed",
)  # fmt: skip
# After one of these for a generation, that generation never runs the stop command again (at most once).
ISSUED = ("stopping", "stopped", "unconfirmed")
MAX_HISTORY = 20
WATCH_LOG, WATCH_LOCK, ARM_LOCK = "watch.log", "watch.lock", "arm.lock"
PROBE_TIMEOUT_S = 10.0
DEFAULT_GATE_RETRY_MAX_S = 1800.0
MAX_INTERVAL_S = 86400.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def watch_log_path(data_dir: str) -> str:
    return os.path.join(autostop_dir(data_dir), WATCH_LOG)


def watch_lock_path(data_dir: str) -> str:
    return os.path.join(autostop_dir(data_dir), WATCH_LOCK)


def arm_lock_path(data_dir: str) -> str:
    return os.path.join(autostop_dir(data_dir), ARM_LOCK)


def keeps_disk(survives: Any) -> bool:
    """The stop verb keeps both data_dir and durable_dir (``survives``): a stop then loses no file, only processes."""
    return isinstance(survives, (list, tuple)) and {"data_dir", "durable_dir"} <= set(survives)


def utc_iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")


def one_line(text: str, limit: int = 400) -> str:
    return " ".join(str(text).split())[:limit]


# --- armed.json ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Armed:
    """A parsed ``armed.json``. ``plan`` (the stop verb with its timeouts) is None only when disarmed."""

    generation: str
    disarmed: bool = False
    idle_s: Optional[float] = None
    silence_s: Optional[float] = None
    check_interval_s: float = 60.0
    gate_retry_max_s: float = DEFAULT_GATE_RETRY_MAX_S
    data_dir: str = ""
    durable_dir: Optional[str] = None
    instance_id: str = ""
    id_env: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()  # (the command's variable, the box's variable it is read from)
    platform: str = ""
    plan: Optional[Plan] = None
    armed_by_run: Optional[str] = None  # the run whose launch armed it (it may not have started yet)


def _number(doc: Mapping[str, Any], key: str, default: Any, low: float, high: float, *, above_low: bool = False) -> Any:
    value = doc.get(key, default)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value > high or (value <= low if above_low else value < low):
        bound = f"above {low:g}" if above_low else f"at least {low:g}"
        raise ValueError(f"{key} must be a number {bound} and at most {high:g}, not {value!r}")
    return float(value)


def _names(value: Any, key: str) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(name, str) and _ENV_NAME.match(name) for name in value):
        raise ValueError(f"{key} must be a list of environment variable names, not {value!r}")
    return tuple(value)


def _with_id(node: Any, instance_id: str) -> Any:
    """The verb with any ``{instance_id}`` left in it filled in (arming fills it; a leftover must not be run)."""
    if isinstance(node, str):
        return node.replace("{instance_id}", instance_id)
    if isinstance(node, list):
        return [_with_id(item, instance_id) for item in node]
    if isinstance(node, dict):
        return {key: _with_id(item, instance_id) for key, item in node.items()}
    return node


def parse_armed(doc: Any, data_dir: str) -> Armed:
    """Validate an ``armed.json`` document for the watcher of ``data_dir``; ValueError names the bad key."""
    if not isinstance(doc, dict):
        raise ValueError("armed.json must hold a JSON object")
    if doc.get("version") != VERSION:
        raise ValueError(f"version must be {VERSION}, not {doc.get('version')!r}")
    generation = doc.get("generation")
    if not isinstance(generation, str) or not generation.strip():
        raise ValueError(f"generation must be a non-empty string, not {generation!r}")
    if doc.get("disarmed") is True:
        return Armed(generation=generation, disarmed=True, data_dir=data_dir)
    if not isinstance(doc.get("data_dir"), str) or os.path.normpath(doc["data_dir"]) != os.path.normpath(data_dir):
        raise ValueError(f"data_dir is {doc.get('data_dir')!r}, not this watcher's {data_dir}")
    durable_dir = doc.get("durable_dir")
    if durable_dir is not None and not (isinstance(durable_dir, str) and os.path.isabs(durable_dir)):
        raise ValueError(f"durable_dir must be an absolute path or null, not {durable_dir!r}")
    idle_minutes = _number(doc, "idle_minutes", None, 0, 10 * 24 * 60)
    silence_hours = _number(doc, "controller_silence_hours", None, 0, 24 * 365)
    if idle_minutes is None and silence_hours is None:
        raise ValueError("idle_minutes and controller_silence_hours are both null: nothing would ever stop the box")
    instance_id = doc.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id.strip():
        raise ValueError(f"instance_id must be a non-empty string, not {instance_id!r}")
    env = doc.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) and _ENV_NAME.match(v) for k, v in env.items()
    ):
        raise ValueError("env must map the command's environment variable names to the box's variable names")
    verb = parse_verb({"stop": _with_id(doc.get("verb"), instance_id)}, "stop")
    if verb.irreversible:
        raise ValueError("verb is irreversible: autostop only stops; never delete/destroy/terminate")
    plan = plan_for(
        verb,
        _number(doc, "timeout_s", 300.0, 0, MAX_INTERVAL_S),
        _number(doc, "poll_interval_s", 5.0, 0, 3600, above_low=True),
        _number(doc, "command_timeout_s", 60.0, 0, 3600, above_low=True),
    )
    check_interval_s = _number(doc, "check_interval_s", 60.0, 0, MAX_INTERVAL_S, above_low=True)
    retry_max = _number(doc, "gate_retry_max_s", DEFAULT_GATE_RETRY_MAX_S, 0, MAX_INTERVAL_S, above_low=True)
    armed_by = doc.get("armed_by") if isinstance(doc.get("armed_by"), dict) else {}
    run = armed_by.get("run")
    return Armed(
        generation=generation,
        armed_by_run=run if isinstance(run, str) and NAME_PATTERN.match(run) else None,
        idle_s=None if idle_minutes is None else idle_minutes * 60,
        silence_s=None if silence_hours is None else silence_hours * 3600,
        check_interval_s=check_interval_s or 60.0,
        gate_retry_max_s=retry_max or DEFAULT_GATE_RETRY_MAX_S,
        data_dir=data_dir,
        durable_dir=durable_dir,
        instance_id=instance_id.strip(),
        id_env=_names(doc.get("id_env") or [], "id_env"),
        env=tuple(sorted(env.items())),
        platform=str(doc.get("platform") or ""),
        plan=plan,
    )


# --- bounded reads ---------------------------------------------------------------------------------------------------


def _read_object(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_RUN_JSON_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > MAX_RUN_JSON_BYTES:
        raise ValueError(f"larger than {MAX_RUN_JSON_BYTES} bytes")
    data = json.loads(raw.decode("utf-8", errors="replace"))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def read_bounded(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(the JSON object in ``path`` or None when there is no file, why it cannot be read), under a deadline."""
    answer = run_with_deadline({"read": functools.partial(_read_object, path)}, timeout_s)["read"]
    if "value" in answer:
        return answer["value"], None
    why = answer.get("error") or f"did not answer within {timeout_s:g} s (a hung mount?)"
    return None, f"{path}: {one_line(why, 200)}"


def read_armed(data_dir: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``armed.json`` as written (None when autostop was never armed here) and why it cannot be read."""
    return read_bounded(autostop_armed_path(data_dir))


def read_decision(data_dir: str) -> Optional[Dict[str, Any]]:
    """``.autostop.json`` (the watcher's last decision), None when there is none; a file that cannot be read or
    trusted is ``{"state": "unreadable", "reason": ...}``."""
    doc, problem = read_bounded(autostop_path(data_dir))
    if problem:
        return {"state": "unreadable", "reason": problem}
    if doc is not None and doc.get("state") not in STATES:
        return {"state": "unreadable", "reason": f"{autostop_path(data_dir)}: state {doc.get('state')!r} is unknown"}
    return doc


def _probe_lock(path: str) -> List[Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return [False, None]
    try:
        try:  # shared, released at once: a watcher starting now retries its exclusive lock for LOCK_RETRY_S
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 64).decode("ascii", errors="replace").strip()
            return [True, int(text) if text.isdigit() else None]
        return [False, None]
    finally:
        os.close(fd)


def watcher_alive(data_dir: str) -> Tuple[bool, Optional[int]]:
    """(a watcher holds ``watch.lock``, its pid as it wrote it); never takes the lock from it. A lock file that does
    not answer within PROBE_TIMEOUT_S counts as no watcher (a second one only finds the lock taken)."""
    answer = run_with_deadline({"lock": functools.partial(_probe_lock, watch_lock_path(data_dir))}, PROBE_TIMEOUT_S)
    value = answer["lock"].get("value")
    if not isinstance(value, list) or len(value) != 2:
        return False, None
    return bool(value[0]), value[1] if isinstance(value[1], int) else None


# --- the watcher's writes ------------------------------------------------------------------------------------------

LOCK_RETRY_S = 2.0


def hold_watch_lock(data_dir: str, retry_s: float = LOCK_RETRY_S) -> Optional[int]:
    """The descriptor holding ``watch.lock`` (exclusive, held until the process ends, the pid written into it), or
    None when another watcher holds it for ``retry_s`` (a reader's probe holds it only for an instant)."""
    path = watch_lock_path(data_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    until = time.monotonic() + retry_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= until:
                os.close(fd)
                return None
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def with_history(history: List[Dict[str, Any]], at: str, state: str, reason: str) -> List[Dict[str, Any]]:
    """``history`` with one more state change, keeping the last MAX_HISTORY."""
    return [*history, {"at": at, "state": state, "reason": reason}][-MAX_HISTORY:]


def _publish(data_dir: str, doc: Optional[Dict[str, Any]], log_line: Optional[str]) -> bool:
    if doc is not None:
        write_json_atomic(autostop_path(data_dir), doc, private=True)
    if log_line:
        fd = os.open(watch_log_path(data_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (one_line(log_line, 1000) + "\n").encode("utf-8", errors="replace"))
        finally:
            os.close(fd)
    return True


def publish(data_dir: str, doc: Optional[Dict[str, Any]], log_line: Optional[str]) -> Optional[str]:
    """Write ``doc`` as ``.autostop.json`` (0600, atomically) and append ``log_line`` to watch.log (either may be
    None); why not, if it failed."""
    answer = run_with_deadline({"write": functools.partial(_publish, data_dir, doc, log_line)}, PROBE_TIMEOUT_S)
    if "value" in answer["write"]:
        return None
    return answer["write"].get("error") or f"data_dir did not answer within {PROBE_TIMEOUT_S:g} s"
