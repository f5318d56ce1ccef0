# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Arm the box's own autostop, or disarm it: what ``training_run`` writes for the watcher (``_autostop_watch``).

After ``_autostop_config.prepare`` has validated the options and checked the box (its own id, the stop command's
variables by name, its binary), arming takes ``arm.lock``, writes ``armed.json`` (0600) only when the configuration
differs from the armed one, with a new ``generation`` (the watcher stops at most once per generation), and starts
the watcher, detached, when no live one holds ``watch.lock``: two launches never start two. Check mode writes and
starts nothing and says what it would do. Where the stop verb does not keep both data_dir and durable_dir, the
result says up front what the watcher will never stop: the box while an archived run (in any data dir of the box)
would lose its scratch (``blocked_by``), and the dead-man while a run ended with a failed cell (``caveats``).
Pure standard library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_config import (
    CONFIG_KEYS,
    Arming,
    AutostopRefused,
    prepare,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_state import (
    ISSUED,
    VERSION,
    arm_lock_path,
    keeps_disk,
    parse_armed,
    read_armed,
    read_decision,
    watch_log_path,
    watcher_alive,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.autostop._autostop_watch import (
    AUTOSTOP_MODULES,
    WATCH_PY,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance._box_state import known_data_dirs
from ansible_collections.remote_gpu.trainer.plugins.module_utils.launch import _run_detach as detach
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    autostop_armed_path,
    autostop_dir,
    exclusive_lock,
    list_archived,
    write_json_atomic,
)

__all__ = ["Arming", "AutostopRefused", "apply", "arm", "disarm", "prepare", "start_watcher", "when_text"]

ARM_LOCK_WAIT_S = 30.0
WATCHER_WAIT_S = 10.0  # the new watcher takes watch.lock first thing
POLL_S = 0.1
LOG_TAIL_BYTES = 4096
# A watcher gone after one of these for its generation has had its stop: the box runs again, so arm anew.
SPENT_STATES = (*ISSUED, "failed")
ARCHIVE_TIMEOUT_S = 20.0


def when_text(idle_minutes: Optional[float], silence_hours: Optional[float]) -> str:
    parts = [f"{idle_minutes:g} min idle" if idle_minutes is not None else ""]
    parts.append(f"{silence_hours:g} h without a patrol tick" if silence_hours is not None else "")
    return "once every run is secured, after " + " or ".join(part for part in parts if part)


def _kept_text(survives: Sequence[str]) -> str:
    kept = [name for name in ("data_dir", "durable_dir") if name in survives]
    return f"only {kept[0]}" if len(kept) == 1 else "neither data_dir nor durable_dir"


def _entries(data_dir: str) -> List[List[str]]:
    return [[item.run, item.entry] for item in list_archived(data_dir)]


def _archived(data_dir: str) -> List[List[str]]:
    """[data dir, run, archive entry] of every archived run in every data dir of the box (in a child); a data dir
    that does not answer is named as one whose archive could not be read."""
    data_dirs, _problems = known_data_dirs([data_dir])
    probes = {path: functools.partial(_entries, path) for path in data_dirs}
    answers = run_with_deadline(probes, ARCHIVE_TIMEOUT_S) if probes else {}
    found = []
    for path in data_dirs:
        if "value" not in answers[path]:
            raise ValueError(f"{path}: {answers[path].get('error') or 'no answer in time (a hung mount?)'}")
        found += [[path, run, entry] for run, entry in answers[path]["value"]]
    return found


def holds(data_dir: str, survives: Sequence[str], dead_man: bool) -> Tuple[List[str], List[str]]:
    """What a stop that does not keep data_dir and durable_dir will never do: (each archived run that blocks it,
    the caveat that a failed cell disables the dead-man). Nothing when the stop keeps both."""
    if keeps_disk(list(survives)):
        return [], []
    kept = _kept_text(survives)
    data_dir = os.path.normpath(data_dir)
    answer = run_with_deadline({"archived": functools.partial(_archived, data_dir)}, 2 * ARCHIVE_TIMEOUT_S)["archived"]
    blocked = [
        f"archived run {run}{'' if path == data_dir else f' in {path}'} (.archive/{entry}) blocks it: the stop keeps "
        f"{kept} and would lose its scratch (teardown_run or abandon)"
        for path, run, entry in answer.get("value") or []
    ]
    if "value" not in answer:
        blocked.append(f"the archived runs could not be listed ({answer.get('error') or 'no answer in time'})")
    caveats = []
    if dead_man:
        caveats.append(
            f"a failed cell disables the dead-man: the stop keeps {kept}, so a run that ended with a failed cell "
            "holds the box until it is torn down"
        )
    return blocked, caveats


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _read_armed(data_dir: str) -> Tuple[Optional[Dict[str, Any]], bool]:
    """armed.json's document (None when absent or unreadable) and whether a file is there."""
    document, problem = read_armed(data_dir)
    return document, document is not None or problem is not None


def _arm_lock(data_dir: str) -> ContextManager[None]:
    path = arm_lock_path(data_dir)
    message = f"autostop: another arm held {path} for more than {ARM_LOCK_WAIT_S:g} s"
    return exclusive_lock(path, ARM_LOCK_WAIT_S, 0o600, lambda: AutostopRefused(message))


def _why_new(existing: Optional[Mapping[str, Any]], config: Mapping[str, Any], decision: Any, alive: bool) -> str:
    """Why this arm needs a new generation; "" when the armed one stands as it is."""
    if existing is None or existing.get("version") != VERSION or not isinstance(existing.get("generation"), str):
        return "armed"
    if existing.get("disarmed") is True:
        return "armed again (it was disarmed)"
    changed = [key for key in CONFIG_KEYS if existing.get(key) != config.get(key)]
    if changed:
        return f"armed anew ({', '.join(changed)} changed)"
    ours = isinstance(decision, Mapping) and decision.get("generation") == existing["generation"]
    if ours and decision.get("state") in SPENT_STATES and not alive:
        return f"armed anew (the last watcher ended {decision.get('state')}: this box runs again)"
    return ""


def _log_tail(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - LOG_TAIL_BYTES))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    last = [line.strip() for line in lines if line.strip()][-1:]
    return f"; watch.log: {last[0][:300]}" if last else ""


def start_watcher(data_dir: str) -> int:
    """Install the watcher's code and start it detached (env: this module's); its pid once it holds watch.lock."""
    directory = autostop_dir(data_dir)
    log = watch_log_path(data_dir)
    try:
        run_py = detach.install_runner(directory, AUTOSTOP_MODULES, WATCH_PY)
        pid = detach.start_setsid([sys.executable, run_py, data_dir], dict(os.environ), directory, log)
    except detach.DetachError as exc:
        raise AutostopRefused(f"autostop: {exc}") from exc
    deadline = time.monotonic() + WATCHER_WAIT_S
    while True:
        gone = not detach.pid_alive(pid)
        alive, holder = watcher_alive(data_dir)  # looked at after the pid: one that took the lock and ended at once
        if alive:
            return holder or pid
        if gone or time.monotonic() >= deadline:
            what = "ended at once" if gone else f"did not take watch.lock within {WATCHER_WAIT_S:g} s"
            raise AutostopRefused(f"autostop: the watcher (pid {pid}) {what}{_log_tail(log)}")
        time.sleep(POLL_S)


def _result(config: Mapping[str, Any], decision: Any, **facts: Any) -> Dict[str, Any]:
    """The ``autostop`` result: every key always there."""
    keys = ("idle_minutes", "controller_silence_hours", "check_interval_s", "instance_id")
    result: Dict[str, Any] = {key: config.get(key) for key in keys}
    result.update(armed=False, changed=False, state=None, reason="", watcher_pid=None, watcher_started=False)
    result.update(generation=None, command=None, would=None, decision=None, blocked_by=[], caveats=[])
    if isinstance(decision, Mapping):
        result["decision"] = {key: decision.get(key) for key in ("state", "reason", "due_at")}
    return dict(result, **facts)


def disarm(data_dir: str, check_mode: bool) -> Dict[str, Any]:
    """Mark armed.json disarmed (the rest kept): the watcher writes state ``disarmed`` and exits."""
    path = autostop_armed_path(data_dir)
    existing, present = _read_armed(data_dir)
    alive, pid = watcher_alive(data_dir)
    decision, config = read_decision(data_dir), existing or {}
    if not present or config.get("disarmed") is True:
        state = "disarmed" if present else "not_armed"
        return _result(config, decision, state=state, reason="autostop is not armed on this box")
    # An unreadable armed.json is replaced by a disarmed one: the watcher then ends instead of guessing.
    document = dict(existing or {"version": VERSION, "generation": os.urandom(6).hex()}, disarmed=True)
    watcher = f"the watcher (pid {pid}) writes state disarmed and exits" if alive else "no watcher runs"
    facts: Dict[str, Any] = {"state": "disarmed", "changed": True, "generation": document["generation"]}
    facts["watcher_pid"] = pid if alive else None
    if check_mode:
        return _result(
            config, decision, reason=f"would disarm autostop: {watcher}", would=f"disarm autostop: {watcher}", **facts
        )
    with _arm_lock(data_dir):
        write_json_atomic(path, document, private=True)
    return _result(config, decision, reason=f"disarmed: {watcher}", **facts)


def apply(arming: Arming, check_mode: bool) -> Dict[str, Any]:
    """Write armed.json when the configuration changed and start the watcher when none lives; the ``autostop``
    result. In check mode nothing is written or started and ``would`` says what would be."""
    if arming.disarm:
        return disarm(arming.data_dir, check_mode)
    config, path = arming.config, autostop_armed_path(arming.data_dir)
    timers = when_text(config["idle_minutes"], config["controller_silence_hours"])
    what = f"stops instance {config['instance_id']} ({arming.command}) {timers}"
    with contextlib.nullcontext() if check_mode else _arm_lock(arming.data_dir):
        existing, _present = _read_armed(arming.data_dir)
        alive, pid = watcher_alive(arming.data_dir)
        decision = read_decision(arming.data_dir)
        why_new = _why_new(existing, config, decision, alive)
        generation = os.urandom(6).hex() if why_new else str((existing or {}).get("generation"))
        armed_by = {"run": arming.run, "launch_id": arming.launch_id}
        document = dict(config, version=VERSION, generation=generation, armed_at=_now(), armed_by=armed_by)
        try:  # the watcher's own reading of it: what arming accepts, the watcher runs
            parse_armed(document, arming.data_dir)
        except ValueError as exc:
            raise AutostopRefused(f"autostop: the watcher would refuse armed.json: {exc}") from exc
        facts: Dict[str, Any] = {"armed": True, "state": "armed", "command": arming.command}
        facts["changed"] = bool(why_new) or not alive
        survives = (config.get("verb") or {}).get("survives") or []
        facts["blocked_by"], facts["caveats"] = holds(
            arming.data_dir, survives, config["controller_silence_hours"] is not None
        )
        if check_mode:
            steps = f"write armed.json ({why_new})" if why_new else "keep armed.json"
            steps += f", keep the watcher (pid {pid})" if alive else ", start the watcher"
            would = f"{steps}; it {what}"
            facts.update(generation=None if why_new else generation, watcher_pid=pid if alive else None)
            return _result(config, decision, reason=f"would arm autostop: {would}", would=would, **facts)
        if why_new:
            write_json_atomic(path, document, private=True)
        pid = pid if alive else start_watcher(arming.data_dir)
    watcher = f"watcher pid {pid} {'running' if alive else 'started'}"
    reason = f"{why_new or 'already armed the same way'}: {what}; {watcher}"
    facts.update(generation=generation, watcher_pid=pid, watcher_started=not alive)
    return _result(config, read_decision(arming.data_dir), reason=reason, **facts)


def arm(params: Mapping[str, Any], check_mode: bool, environ_path: Optional[str] = None) -> Dict[str, Any]:
    """Validate ``params`` (data_dir, durable_dir, run, launch_id and the ``autostop`` suboptions, flat), check
    the box and arm it (with ``disarm``: disarm it); the ``autostop`` result. AutostopRefused: one line."""
    return apply(prepare(params, environ_path), check_mode)
