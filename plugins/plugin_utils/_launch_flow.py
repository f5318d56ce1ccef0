# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One box's launch, in order, after every setting was validated; the first step that fails stops the box.

The preflight gate (this play's preflight, else the newest preflight report young enough), the runtime probe (the
box's Python finds the runtime venv; a box that does not answer is UNREACHABLE), the code (rsync pushed over the
connection's own SSH command, or a git checkout on the box), then one ``training_run`` call run by the runtime venv's
Python, which starts, resumes, adopts or refuses the run, and arms (or disarms) the box's autostop before it starts
anything. Each box call is bounded by its timeout.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from ansible.errors import AnsibleConnectionFailure

from ansible_collections.remote_gpu.trainer.plugins.filter.preflight import preflight_runtime
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._rsync_argv import URL_USERINFO
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _rsync as rsync
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import BoxUnreachable, StageError, one_line

PROBE_SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "runtime" / "files" / "runtime_probe.py"
REPORT_NAME = re.compile(r"\Apreflight-\d{8}T\d{6}Z(-\d+)?\.json\Z")
SHOWN_FAIL_CODES = 3
FILE_TIMEOUT_S = 60.0  # creating the code directory
RSYNC_IO_TIMEOUT_S = 300
# What a record keeps of training_run's answer: never its invocation (the secrets are module options).
MODULE_KEYS = ("outcome", "cells_left", "recopy_cells", "kept_cells", "changes", "attach", "pgid", "detach")
CELL_KEYS = ("name", "status", "sync", "done", "exit_code", "reason")


class StepTimeout(Exception):
    """A box call ran past its bound."""


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise StepTimeout in the block after ``seconds`` (SIGALRM, as Ansible's own task timeout). An outer alarm
    that comes first (the task's ``timeout``) is left to fire; it is re-armed with what is left of it after."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, _interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise StepTimeout()

    began = time.monotonic()
    outer_handler = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - began), 0.001))


# ---- the preflight gate ----------------------------------------------------------------------------------------


def newest_report(directory: str) -> Tuple[str, Optional[Mapping[str, Any]], str]:
    """The newest ``preflight-<UTC>.json`` in ``directory``: (file name, document or None, why it is unusable)."""
    root = os.path.realpath(os.path.expanduser(directory))
    names = sorted(name for name in map(os.path.basename, glob.glob(os.path.join(root, "preflight-*.json"))))
    names = [name for name in names if REPORT_NAME.match(name)]
    if not names:
        return "", None, ""
    try:
        with open(os.path.join(root, names[-1]), encoding="utf-8") as stream:
            document = json.load(stream)
    except (OSError, ValueError) as error:
        return names[-1], None, f"the newest preflight report {names[-1]} cannot be read ({one_line(error, 120)})"
    return names[-1], document if isinstance(document, Mapping) else None, ""


def _age_s(report: Mapping[str, Any], now: float) -> Optional[float]:
    try:
        generated = datetime.strptime(str(report.get("generated_at")), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return now - generated.replace(tzinfo=timezone.utc).timestamp()


def _entry(report: Mapping[str, Any], host: str) -> Optional[Mapping[str, Any]]:
    hosts = report.get("hosts")
    for entry in hosts if isinstance(hosts, list) else []:
        if isinstance(entry, Mapping) and entry.get("host") == host:
            return entry
    return None


def _fail_codes(result: Mapping[str, Any]) -> str:
    findings = result.get("findings") if isinstance(result.get("findings"), list) else []
    failed = [f for f in findings if isinstance(f, Mapping) and f.get("level") == "FAIL"]
    shown = [f"{f.get('code')} -> {f.get('action')}" for f in failed[:SHOWN_FAIL_CODES]]
    return "; ".join(shown) or "no FAIL finding recorded"


def preflight_gate(
    host: str,
    settings: Mapping[str, Any],
    *,
    play_result: Any = None,
    report: Optional[Mapping[str, Any]] = None,
    report_file: str = "",
    now: Optional[float] = None,
) -> Dict[str, Any]:
    """Whether launch may start on ``host``: ``{allowed, status, source, age_s, reason}``.

    This play's preflight (``preflight_result``) decides; else the host's entry in the newest report when it is at
    most ``max_age_s`` old. A FAIL refuses the box; no preflight refuses it only with ``require``; ``skip`` allows
    every box.
    """
    gate: Dict[str, Any] = {"allowed": True, "status": None, "source": None, "age_s": None, "reason": ""}
    if settings["skip"]:
        return dict(gate, source="skipped", reason="preflight skipped (launch_skip_preflight)")
    now = time.time() if now is None else float(now)
    max_age_s = float(settings["max_age_s"])
    result: Optional[Mapping[str, Any]] = None
    if isinstance(play_result, Mapping) and play_result.get("status"):
        result, gate["source"], gate["age_s"] = play_result, "this play", 0.0
    elif isinstance(report, Mapping):
        age, entry = _age_s(report, now), _entry(report, host)
        if age is not None and age <= max_age_s and entry is not None:
            result, gate["source"], gate["age_s"] = entry, report_file or "report", round(max(age, 0.0), 1)
        elif age is not None and entry is not None:
            gate["reason"] = (
                f"the newest preflight report is {int(age)} s old (launch_preflight_max_age_s {max_age_s:g})"
            )
    if result is not None:
        gate["status"] = str(result.get("status"))
        if gate["status"] == "FAIL":
            return dict(gate, allowed=False, reason=f"preflight FAIL ({gate['source']}): {_fail_codes(result)}")
        return dict(gate, reason=f"preflight {gate['status']} ({gate['source']})")
    if settings["require"]:
        why = gate["reason"] or f"no preflight of {host} in this play or in a report younger than {max_age_s:g} s"
        return dict(gate, allowed=False, reason=f"{why}, and launch_require_preflight is set")
    return dict(gate, reason=gate["reason"] or "no recent preflight")


# ---- the box -----------------------------------------------------------------------------------------------------


def _redact(text: Any) -> str:
    """A git URL's ``user:token@`` never reaches a record."""
    return URL_USERINFO.sub(r"\1<redacted>@", str(text or ""))


class Launch:
    """The steps of one box; ``record`` holds each step's evidence as it is gathered."""

    def __init__(self, action: Any, settings: Mapping[str, Any], task_vars: Mapping[str, Any], sweep: int) -> None:
        self.action, self.settings, self.task_vars = action, settings, task_vars
        self.check_mode = bool(action._task.check_mode)
        module_args = settings["module_args"]
        shard = settings["shard"]
        self.record: Dict[str, Any] = {
            "host": settings["host"],
            "run": settings["run"],
            "launch_id": module_args.get("launch_id") or None,
            "cells": [{"name": name} for name in settings["cells"]],
            "shard": dict(shard, cells_total=sweep) if shard else None,
            "outcome": None,
            "cells_left": None,
            "recopy_cells": [],
            "kept_cells": [],
            "changes": [],
            "code": {"kind": settings["code"]["kind"]},
            "gate": None,
            "python": None,
            "attach": None,
            "pgid": None,
            "detach": None,
            "warnings": [settings["hourly_usd_warning"]] if settings.get("hourly_usd_warning") else [],
            "autostop": None,
            "cost": box_cost(settings["hourly_usd"], None),
            "check_mode": self.check_mode,
            "changed": False,
        }

    def run(self) -> Tuple[str, Optional[str], str]:
        """Every step in order: (status, step, reason). A failed step raises StageError (or BoxUnreachable)."""
        self.preflight()
        if not self.settings["cells"]:  # more shard boxes than cells
            return "DONE", None, "no cell of the sweep falls to this box, nothing to launch"
        python = self.probe()
        self.bring_code(python)
        return self.start(python)

    def preflight(self) -> None:
        settings = self.settings["preflight"]
        report, name = None, ""
        play_result = self.task_vars.get("preflight_result")
        if not settings["skip"] and not (isinstance(play_result, Mapping) and play_result.get("status")):
            name, report, problem = newest_report(settings["report_dir"])
            if problem:
                self.record["warnings"].append(problem)
        gate = preflight_gate(self.settings["host"], settings, play_result=play_result, report=report, report_file=name)
        self.record["gate"] = gate
        if not gate["allowed"]:
            raise StageError("preflight", gate["reason"])

    # ---- box calls -------------------------------------------------------------------------------------------

    def module(
        self, name: str, args: Mapping[str, Any], python: str, *, step: str, timeout_s: float, **task: Any
    ) -> Dict[str, Any]:
        """Run module ``name`` on the box with ``python``, under ``timeout_s``; ``task`` sets the task's
        ``check_mode``, ``no_log`` or ``environment`` for this call only. BoxUnreachable when the box is gone."""
        saved = {key: getattr(self.action._task, key) for key in task}
        for key, value in task.items():
            setattr(self.action._task, key, value)
        variables = dict(self.task_vars, ansible_python_interpreter=python)
        try:
            with bounded(timeout_s):
                answer = self.action._execute_module(module_name=name, module_args=dict(args), task_vars=variables)
        except AnsibleConnectionFailure as error:
            raise BoxUnreachable(one_line(error)) from None
        except StepTimeout:
            raise StageError(step, f"{name} did not answer within {timeout_s:g} s") from None
        finally:
            for key, value in saved.items():
                setattr(self.action._task, key, value)
        if answer.get("unreachable"):
            raise BoxUnreachable(one_line(answer.get("msg") or "host unreachable"))
        return answer

    def probe(self) -> str:
        """The box's Python finds the runtime venv; the interpreter of the modules that follow."""
        settings = self.settings
        base, venv = settings["base_python"], settings["runtime_python"]
        timeout_s = float(settings["probe_timeout_s"])
        argv = [base, "-c", PROBE_SCRIPT.read_text(encoding="utf-8"), settings["data_dir"], venv, f"{timeout_s:g}"]
        answer = self.module(
            "ansible.builtin.command",
            {"argv": argv},
            base,
            step="probe",
            timeout_s=timeout_s * 2 + 30,
            check_mode=False,  # it only reads: check mode must see the box as a real launch would
        )
        state = preflight_runtime(dict(answer, cmd=argv))
        if not state["ok"]:
            findings = state.get("findings") or [{}]
            raise StageError("probe", str(findings[0].get("message") or "the runtime probe failed"))
        if not state["data_dir_usable"]:
            problem = state.get("data_dir_problem") or "is not usable"
            raise StageError("probe", f"data_dir {settings['data_dir']} {problem}")
        python = venv if state["ready"] else base
        if not state["ready"]:
            self.record["warnings"].append(
                f"the runtime venv {venv} is not ready (run preflight): the run uses {base}, and its monitor samples "
                "less (no nvidia-ml-py, psutil)"
            )
        self.record["python"] = python
        return python

    # ---- the code --------------------------------------------------------------------------------------------

    def bring_code(self, python: str) -> None:
        code = self.settings["code"]
        if code["kind"] == "rsync":
            self.push(code, python)
        elif code["kind"] == "git":
            self.checkout(code, python)

    def push(self, code: Mapping[str, Any], python: str) -> None:
        record: Dict[str, Any] = {"kind": "rsync", "source": code["source"], "dest": code["dest"]}
        record.update(dry_run=self.check_mode, changed=False)
        self.record["code"] = record
        made = self.module(
            "ansible.builtin.file",
            {"path": code["dest"], "state": "directory", "mode": "0755"},
            python,
            step="code",
            timeout_s=FILE_TIMEOUT_S,
        )
        if made.get("failed"):
            raise StageError("code", f"cannot create {code['dest']} on the box: {one_line(made.get('msg'))}")
        if self.check_mode and made.get("changed"):
            record.update(changed=True, note=f"{code['dest']} does not exist yet: every file would be sent")
            return
        timeout_s = float(self.settings["sync_timeout_s"])
        try:
            argv = rsync.push_argv(
                self.action._connection,
                code["source"],
                code["dest"],
                excludes=code["excludes"],
                delete=code["delete"],
                dry_run=self.check_mode,
                io_timeout_s=int(min(timeout_s, RSYNC_IO_TIMEOUT_S)),
            )
        except rsync.RsyncError as error:
            raise StageError("code", str(error)) from None
        transfer = rsync.run(argv, timeout_s)
        record.update(argv=transfer.argv, files=transfer.received, files_count=transfer.received_count)
        record.update(deleted=transfer.deleted)
        if transfer.error:
            raise StageError("code", f"rsync to {code['dest']}: {transfer.error}")
        record["changed"] = bool(made.get("changed") or transfer.received_count or transfer.deleted)
        self.record["changed"] = self.record["changed"] or (record["changed"] and not self.check_mode)

    def checkout(self, code: Mapping[str, Any], python: str) -> None:
        record: Dict[str, Any] = {
            "kind": "git",
            "repo": _redact(code["repo"]),
            "ref": code["ref"],
            "dest": code["dest"],
        }
        self.record["code"] = record
        args: Dict[str, Any] = {"repo": code["repo"], "dest": code["dest"], "version": code["ref"]}
        args.update(update=True, force=False)
        if code["depth"]:
            args["depth"] = code["depth"]
        answer = self.module(
            "ansible.builtin.git",
            args,
            python,
            step="code",
            timeout_s=float(self.settings["sync_timeout_s"]),
            environment=[dict(code["environment"])] if code["environment"] else self.action._task.environment,
        )
        if answer.get("failed"):
            raise StageError("code", f"git checkout into {code['dest']}: {_redact(one_line(answer.get('msg')))}")
        record.update(changed=bool(answer.get("changed")), version=answer.get("after"), before=answer.get("before"))
        self.record["changed"] = self.record["changed"] or (record["changed"] and not self.check_mode)

    # ---- the run ---------------------------------------------------------------------------------------------

    def start(self, python: str) -> Tuple[str, Optional[str], str]:
        module_args = self.settings["module_args"]
        answer = self.module(
            "remote_gpu.trainer.training_run",
            module_args,
            python,
            step="training_run",
            timeout_s=float(self.settings["task_timeout_s"]),
            # The secrets are module options: nothing of this call may be logged when there are any.
            no_log=bool(module_args.get("secrets") or self.action._task.no_log),
        )
        record = self.record
        record.update({key: answer[key] for key in MODULE_KEYS if answer.get(key) is not None})
        self.autostop(answer)
        # The box's ledger (its running hours since the rental was first seen), counted on the box's own clock.
        record["cost"] = box_cost(
            self.settings["hourly_usd"],
            answer.get("box_started_at"),
            box_now=answer.get("box_now"),
            ledger=answer.get("ledger"),
        )
        record["launch_id"] = answer.get("launch_id") or record["launch_id"]
        record["warnings"] += [one_line(warning) for warning in answer.get("warnings") or []]
        cells = [cell for cell in answer.get("cells") or [] if isinstance(cell, Mapping)]
        if cells:
            record["cells"] = [{key: cell.get(key) for key in CELL_KEYS} for cell in cells]
        if answer.get("failed"):
            reason = _redact(one_line(answer.get("msg") or answer.get("module_stderr") or "training_run failed"))
            if answer.get("autostop_refused"):  # the box cannot stop itself as asked: nothing started
                raise StageError("autostop", reason)
            # The module's refusals (a changed spec, a reused name, a cell still training) name what differs.
            raise StageError("relaunch" if "changes" in answer else "training_run", reason)
        record["changed"] = record["changed"] or (bool(answer.get("changed")) and not self.check_mode)
        status = lines.OUTCOMES.get(str(answer.get("outcome")))
        if status is None:  # a module without outcome: what it did, from its older keys
            resumed = "RESUMED" if answer.get("resumed") else "STARTED"
            status = (
                resumed if answer.get("changed") else ("DONE" if answer.get("state") == "done" else "ALREADY_RUNNING")
            )
        return status, None, ""

    def autostop(self, answer: Mapping[str, Any]) -> None:
        """training_run's word on the box's autostop, with what launch asked of it (``asked``: arm, disarm, or None
        when launch left it alone)."""
        asked = self.settings["autostop"]
        kind = None if asked is None else ("disarm" if asked.get("disarm") else "arm")
        said = answer.get("autostop")
        if isinstance(said, Mapping):
            self.record["autostop"] = dict(said, asked=kind)
        elif kind and not answer.get("failed"):
            self.record["warnings"].append(f"launch asked training_run to {kind} autostop and it did not say it did")
