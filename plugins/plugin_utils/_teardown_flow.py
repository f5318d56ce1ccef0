# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One box's teardown, in order; the first step that fails stops the box and nothing after it runs.

The gate (``teardown_gate`` on the box: the runs, and with a meter-stop the whole instance), the survival of the
durable directory under the verb that actually runs, the pull (rsync over the connection's own SSH command) and its
verification here, the load-verify, the confirmation, the scratch (``run_scratch`` re-hashes each cell's durable
files right before removing that cell's scratch) and the meter-stop (the provider's CLI, polled to a final state).
Three box modules at most (gate, load-verify, scratch), more only to stop live runs with ``stop_running``; beside
them, outside check mode, ``box_lease`` refreshes the box lease the gate took before each long step (a second pull,
the load-verify, the scratch) and gives it back before the meter-stop, or when the teardown stops early.
"""

from __future__ import annotations

import fnmatch
import os
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _copy_verify as copies
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _load_verify as loads
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _meter_stop as meter
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_states as states
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _rsync as rsync
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import (
    box_cost,
    hourly_rate,
    stopped_cost,
    stopped_rate,
)
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import BoxUnreachable, StageError, one_line

try:
    from ansible.template import trust_as_template
except ImportError:  # ansible-core before 2.19 renders every string

    def trust_as_template(value: Any) -> Any:
        return value


COMMAND_TIMEOUT_S = 60.0
OUTPUT_CHARS = 500  # of a failed load check's output, in the record
RSYNC_IO_TIMEOUT_S = 300
LEASE_SLACK_S = 300.0  # beyond a step's own timeout: the box calls around it
MAX_LEASE_S = 14400.0  # box_lease's and the gate's hold_box ttl_s bound


class Teardown:
    """The steps of one box; ``record`` holds each step's evidence as it is gathered."""

    def __init__(self, action: Any, settings: options.Settings, task_vars: Dict[str, Any], host: str) -> None:
        self.action, self.settings, self.task_vars, self.host = action, settings, task_vars, host
        self.check_mode = bool(action._task.check_mode)
        self.gate: Dict[str, Any] = {}
        self.pulled: Dict[str, str] = {}  # run -> controller copy
        # A bad hourly_usd only loses the cost: the teardown itself goes on, with a warning.
        self.rate, rate_problem = hourly_rate(task_vars, getattr(action, "_templar", None))
        self.since: Optional[str] = None  # the box's start, told by the gate
        # The box lease: the gate takes it, the long steps refresh it, the end gives it back (never in check mode).
        self.lease_token: Optional[str] = None if self.check_mode else f"teardown-{uuid.uuid4().hex[:16]}"
        # The gate's cost basis (its box_now and ledger) and when it answered, on the controller's monotonic clock.
        self.basis: Dict[str, Any] = {}
        self.answered_at = time.monotonic()
        verb = settings.verb
        self.record: Dict[str, Any] = {
            "host": host,
            "runs": list(settings.runs) or ["all"],
            "check_mode": self.check_mode,
            "platform": settings["platform"] or None,
            "stop_meter": bool(settings["stop_meter"]),
            "verb": verb.name if verb is not None else options.NO_VERB,
            "irreversible": bool(verb is not None and verb.irreversible),
            "instance_id": settings["instance_id"] or None,
            "confirmed": False,
            "gate": None,
            "stop_running": [],
            "pull": None,
            "load_verify": None,
            "scratch": None,
            "meter_stop": None,
            "warnings": [rate_problem] if rate_problem else [],
            "data_loss_clocks": list(settings["data_loss_clocks"]),
            "changed": False,
            "cost": box_cost(self.rate, None),
        }

    def run(self, warn: Callable[[str], None]) -> Tuple[str, Optional[str], str]:
        """Every step in order: (status, step, reason). A failed step raises StageError (or BoxUnreachable); the box
        lease is given back either way."""
        try:
            return self.steps(warn)
        finally:
            self.release_box()

    def steps(self, warn: Callable[[str], None]) -> Tuple[str, Optional[str], str]:
        self.run_gate()
        self.survival()
        self.pull()
        self.load_verify()
        confirmed, why = options.confirmation(self.settings.confirm, self.host)
        self.record["confirmed"] = confirmed
        preview = self.check_mode or not confirmed
        verb = self.settings.verb
        if verb is not None and verb.irreversible and not preview:
            warn(
                f"{self.host}: about to run meter-stop verb {verb.name}, which is IRREVERSIBLE: the instance and its "
                f"disks are destroyed, data_dir {self.settings['data_dir']} included; only the verified durable copy "
                "remains"
            )
        self.scratch(preview)
        status = self.stop_meter(preview)
        self.record["cost"] = self.cost()  # up to the meter-stop
        stopped = (self.record.get("meter_stop") or {}).get("state") in ("stopped", "already")
        if stopped and self.record["cost"] is not None:
            self.record["cost"]["meter_stopped"] = True  # no longer in the fleet's total per hour
            if self.record["meter_stop"].get("state") == "stopped":  # its time ends the GPU cost; patrol reads it
                now = datetime.now(timezone.utc)
                self.record["cost"] = stopped_cost(self.record["cost"], now.isoformat(), self.storage_rate(), now)
        if self.check_mode:
            return "CHECKED", None, "" if confirmed else why
        if not confirmed:
            return "UNCONFIRMED", "confirm", why
        if status == "STOP_BY_HAND":
            return status, "meter_stop", f"the meter of {self.host} is stopped by hand: follow the steps below"
        return status, None, ""

    def provider_state(self) -> str:
        """The box did not answer: what the provider says of its instance, read-only (a stopped pod no longer
        answers SSH, so a teardown run again after a meter-stop meets exactly this)."""
        verb = self.settings.verb
        if verb is None or not verb.command or self.check_mode:
            return ""
        plan = meter.plan_for(verb, timeout_s=0, poll_interval_s=1, command_timeout_s=COMMAND_TIMEOUT_S)
        poll = meter.poll_status(plan, meter.subprocess_runner)
        stopped = poll.final or poll.gone
        said = poll.error or (
            "nothing bills"
            if poll.gone
            else "stopped: only its storage may bill"
            if stopped
            else "not stopped: it may bill"
        )
        self.record["meter_stop"] = {"state": "box_unreachable", "provider_state": poll.label, "stopped": stopped}
        if poll.final:
            self.earlier_stop()
        return f"the provider says instance {self.settings['instance_id']} is {poll.label} ({said})"

    def earlier_stop(self) -> None:
        """A box the provider says is stopped and that did not answer: its cost ends at the stop of ours that the
        controller's reports know (patrol's record of its autostop, a teardown's meter-stop), storage after it."""
        now = datetime.now(timezone.utc)
        report_dir = str(self.task_vars.get("teardown_report_dir") or "reports")
        known = states.history(report_dir, self.host, now)
        stop = known.get("our_stop")
        if stop:
            self.record["meter_stop"].update(stopped_at=stop["at"], stopped_by=stop["by"])
            cost = box_cost(self.rate, known.get("since"), now)
            self.record["cost"] = stopped_cost(cost, stop["at"], self.storage_rate(), now)

    def storage_rate(self) -> Optional[float]:
        """What the stopped instance bills per hour (host variable hourly_usd_stopped): nothing after an
        irreversible verb; a bad value is a warning, as a bad hourly_usd is."""
        if self.settings.verb is not None and self.settings.verb.irreversible:
            return 0.0
        rate, problem = stopped_rate(self.task_vars, getattr(self.action, "_templar", None))
        if problem and problem not in self.record["warnings"]:
            self.record["warnings"].append(problem)
        return rate

    # ---- the gate --------------------------------------------------------------------------------------------

    def gate_args(self) -> Dict[str, Any]:
        settings, verb = self.settings, self.settings.verb
        args: Dict[str, Any] = {
            "runs": list(settings.runs),
            "data_dir": settings["data_dir"],
            "accept_incomplete_cells": settings["accept_incomplete_cells"],
            "accept_no_artifacts": settings["accept_no_artifacts"],
            "verify_timeout_s": settings["verify_timeout_s"],
            "instance": settings.instance,
            "abandon_runs": settings["abandon_runs"],
            "instance_id": settings["instance_id"],
            "instance_id_env": settings["instance_id_env"],
            "irreversible": bool(verb is not None and verb.irreversible),
            "scratch_extra_paths": settings["scratch_extra_paths"],
            "survives": list(verb.survives) if verb is not None else [],
            "abandon_gpu_users": settings["abandon_gpu_users"],
        }
        if settings["durable_dir"]:
            args["durable_dir"] = settings["durable_dir"]
        if self.lease_token:  # held through the first pull, the next step that may take long
            pulls = settings["pull_timeout_s"] if settings["pull_to"] else 0.0
            args["hold_box"] = {"token": self.lease_token, "ttl_s": _lease_ttl(pulls)}
        return args

    def hold(self, seconds: float) -> None:
        """Hold the box (refresh the lease) for a step that may take ``seconds``: the watcher does not stop it
        under the step."""
        if not self.lease_token:
            return
        args = {"token": self.lease_token, "ttl_s": _lease_ttl(seconds)}
        with self.action.check_mode(False):
            answer = self.action.box_module("box_lease", args, self.task_vars)
        if answer.get("failed"):
            raise StageError("box_lease", f"the box could not be held: {one_line(answer.get('msg') or 'no message')}")

    def release_box(self) -> None:
        """Give the box lease back (before the meter-stop, or when the teardown stops early); a box that does not
        answer keeps it until it expires."""
        token, self.lease_token = self.lease_token, None
        if not token:
            return
        try:
            with self.action.check_mode(False):
                answer = self.action.box_module("box_lease", {"token": token, "state": "released"}, self.task_vars)
        except BoxUnreachable:
            return
        if answer.get("failed"):
            said = one_line(answer.get("msg") or "no message")
            self.record["warnings"].append(f"the box lease was not given back (it expires by itself): {said}")

    def cost(self) -> Optional[Dict[str, Any]]:
        """The box's ledger as the gate told it (on the box's clock), plus the seconds this teardown has run since
        the gate answered (on the controller's monotonic clock: no two clocks are compared)."""
        later = time.monotonic() - self.answered_at
        return box_cost(
            self.rate, self.since, box_now=self.basis.get("box_now"), ledger=self.basis.get("ledger"), later_s=later
        )

    def run_gate(self) -> None:
        with self.action.check_mode(False):
            answer = self.action.box_module("teardown_gate", self.gate_args(), self.task_vars)
        live = [entry["run"]["name"] for entry in answer.get("runs") or [] if _state(entry) == "running"]
        if answer.get("step") == "run_alive" and live and self.settings["stop_running"]:
            self.stop_live_runs(live, answer)
            with self.action.check_mode(False):
                answer = self.action.box_module("teardown_gate", self.gate_args(), self.task_vars)
        self.gate = answer
        self.record["gate"] = _gate_record(answer)
        if "lease" in answer and (answer["lease"] or {}).get("token") != self.lease_token:
            self.lease_token = (
                None  # not taken (another holds it, or a read-only home): nothing to refresh or give back
            )
        instance = answer.get("instance")
        self.since = instance.get("box_started_at") if isinstance(instance, Mapping) else None
        self.basis = {key: instance.get(key) for key in ("box_now", "ledger")} if isinstance(instance, Mapping) else {}
        self.answered_at = time.monotonic()
        self.record["cost"] = self.cost()
        if answer.get("failed") and not answer.get("step"):
            raise StageError("run_alive", f"teardown_gate failed: {answer.get('msg') or 'no message'}")
        if answer.get("passed") is not True:
            raise StageError(str(answer.get("step") or "run_alive"), answer.get("reason") or "the gate did not pass")

    def stop_live_runs(self, live: List[str], answer: Mapping[str, Any]) -> None:
        """stop_running kills training as surely as a meter-stop: it needs this host's confirmation (item 12)."""
        confirmed, why = options.confirmation(self.settings.confirm, self.host)
        if self.check_mode:
            raise StageError("run_alive", f"{answer.get('reason')}; check mode stops nothing (stop_running)")
        if not confirmed:
            raise StageError(
                "stop_running", f"{answer.get('reason')}; stop_running kills it only when confirmed: {why}"
            )
        for run in live:
            stopped = self.action.box_module(
                "training_run",
                {
                    "run": run,
                    "data_dir": self.settings["data_dir"],
                    "state": "stopped",
                    "stop_grace_s": self.settings["stop_grace_s"],
                    "stopped_by": "teardown",  # recorded on the box before the signal: each cell says who stopped it
                },
                self.task_vars,
            )
            entry = {key: stopped.get(key) for key in ("changed", "state", "msg")}
            self.record["stop_running"].append(dict(entry, run=run))
            self.record["changed"] = self.record["changed"] or bool(stopped.get("changed"))
            if stopped.get("failed"):
                raise StageError("stop_running", f"run {run} could not be stopped: {stopped.get('msg')}")

    def survival(self) -> None:
        verb = self.settings.verb
        if verb is None or not self.settings["durable_dir"]:
            return
        if "durable_dir" not in verb.survives:
            raise StageError(
                "survival",
                f"{self.settings['durable_dir']} does not survive {verb.name} (meter_stop_verbs.{verb.name}.survives: "
                f"{', '.join(verb.survives) or 'nothing'}): use a verb it survives, or move durable_dir where it does",
            )

    # ---- the copies ------------------------------------------------------------------------------------------

    def secured_runs(self) -> List[Dict[str, Any]]:
        """The gate's runs that hold a durable copy: ``{name, dir, artifacts}``."""
        runs = []
        for entry in self.gate.get("runs") or []:
            durable = entry.get("durable") or {}
            if durable.get("exists") and durable.get("dir"):
                runs.append({"name": entry["run"]["name"], "dir": durable["dir"], "artifacts": entry["artifacts"]})
        return runs

    def pull(self) -> None:
        if not self.settings["pull_to"]:
            self.record["pull"] = {"to": None, "note": "no pull (teardown_pull_to is not set)"}
            return
        root = os.path.realpath(os.path.expanduser(self.settings["pull_to"]))
        record: Dict[str, Any] = {"to": os.path.join(root, self.host), "dry_run": self.check_mode, "runs": []}
        self.record["pull"] = record
        io_timeout = int(min(self.settings["pull_timeout_s"], RSYNC_IO_TIMEOUT_S))
        for run in self.secured_runs():
            if record["runs"]:
                self.hold(self.settings["pull_timeout_s"])
            dest = os.path.join(root, self.host, run["name"])
            if not self.check_mode:
                os.makedirs(dest, exist_ok=True)
            try:
                argv = rsync.pull_argv(
                    self.action._connection, run["dir"], dest, dry_run=self.check_mode, io_timeout_s=io_timeout
                )
            except rsync.RsyncError as error:
                raise StageError("pull", str(error)) from None
            transfer = rsync.run(argv, self.settings["pull_timeout_s"])
            entry: Dict[str, Any] = {
                "run": run["name"],
                "to": dest,
                "argv": transfer.argv,
                "received": transfer.received,
                "received_count": transfer.received_count,
            }
            record["runs"].append(entry)
            if transfer.error:
                raise StageError("pull", f"run {run['name']}: {transfer.error}")
            record["changed"] = record.get("changed", False) or bool(transfer.received_count and not self.check_mode)
            if self.check_mode:
                continue
            checked = copies.verify_copy(dest, _plain(run["artifacts"]), self.settings["verify_timeout_s"])
            entry.update(files=checked["files"], bytes=checked["bytes"], verified=checked["passed"])
            if not checked["passed"]:
                raise StageError("pull_verify", f"the controller copy does not verify: {checked['reason']}")
            self.pulled[run["name"]] = dest
        self.record["changed"] = self.record["changed"] or bool(record.get("changed"))

    def load_verify(self) -> None:
        command, _problem = options.load_command(self.task_vars.get("teardown_load_verify_cmd"))
        on = self.settings["load_verify_on"]
        if command is None:
            self.record["load_verify"] = {"on": on, "ran": False, "note": "no load-verify command"}
            return
        record: Dict[str, Any] = {"on": on, "ran": False, "checks": 0, "failed": []}
        self.record["load_verify"] = record
        checks = self.load_checks(command, on)
        if not checks:
            record["note"] = "no artifact to load"
            return
        if on == "controller" and self.check_mode:
            record["note"] = "not run: check mode makes no controller copy"
            return
        params = {"checks": checks, "timeout_s": self.settings["load_verify_timeout_s"]}
        self.hold(self.settings["load_verify_timeout_s"] * len(checks))
        if on == "box":
            with self.action.check_mode(False):
                answer = self.action.box_module("load_verify", params, self.task_vars)
        else:
            try:
                answer = loads.load_verify(params)
            except ValueError as error:
                raise StageError("load_verify", str(error)) from None
        failures = [
            {key: check.get(key) for key in ("artifact", "rc", "signal", "timed_out")}
            | {"output_tail": str(check.get("output_tail") or "")[-OUTPUT_CHARS:]}
            for check in answer.get("checks") or []
            if check.get("rc") != 0 or check.get("timed_out")
        ]
        record.update(ran=True, checks=len(answer.get("checks") or []), failed=failures)
        if answer.get("passed") is not True or failures or record["checks"] != len(checks):
            said = _last_line(failures[0]["output_tail"]) if failures else ""
            told = f" (it said: {said})" if said else ""
            raise StageError("load_verify", f"load-verify ({on}): {answer.get('reason') or answer.get('msg')}{told}")

    def load_checks(self, command: Any, on: str) -> List[Dict[str, Any]]:
        """One check per chosen artifact, the command rendered with ``artifact`` set to its absolute path."""
        wanted = [pattern.strip() for pattern in self.settings["load_verify_artifacts"] if pattern.strip()]
        # The user's own variable, split here when it was one string: its pieces are as trusted as it was.
        command = [trust_as_template(part) if isinstance(part, str) else part for part in command]
        checks, seen = [], 0
        for run in self.secured_runs():
            root = self.pulled.get(run["name"]) if on == "controller" else run["dir"]
            for artifact in run["artifacts"]:
                seen += 1
                if wanted and not any(fnmatch.fnmatchcase(artifact["path"], p) for p in wanted):
                    continue
                target = f"{str(root).rstrip('/')}/{artifact['path']}"
                templar = self.action._templar.copy_with_new_env(
                    available_variables={**self.task_vars, "artifact": target}
                )
                try:
                    argv = options.argv_of(templar.template(command))
                except Exception as error:  # a template error or a bad shape: one line naming the variable
                    raise StageError("load_verify", f"teardown_load_verify_cmd: {one_line(error)}") from None
                checks.append({"artifact": f"{run['name']}/{artifact['path']}", "argv": argv})
        if wanted and seen and not checks:
            raise StageError(
                "load_verify",
                f"teardown_load_verify_artifacts {wanted} match none of the {seen} artifacts (patterns match "
                "cells/<cell>/<path>)",
            )
        return checks

    # ---- the actions -----------------------------------------------------------------------------------------

    def scratch(self, preview: bool) -> None:
        runs = [entry["run"]["name"] for entry in self.gate.get("runs") or []]
        args: Dict[str, Any] = {
            "runs": runs,
            "data_dir": self.settings["data_dir"],
            "extra_paths": self.settings["scratch_extra_paths"],
            "timeout_s": self.settings["scratch_timeout_s"],
            "expected": {entry["run"]["name"]: _plain(entry.get("artifacts") or []) for entry in self.gate["runs"]},
        }
        if self.settings["durable_dir"]:
            args["durable_dir"] = self.settings["durable_dir"]
        if not preview:
            self.hold(self.settings["scratch_timeout_s"])
        with self.action.check_mode(preview):
            answer = self.action.box_module("run_scratch", args, self.task_vars)
        keys = ("changed", "removed", "would_remove", "runs", "durable_mismatch", "refused", "msg")
        self.record["scratch"] = dict({key: answer.get(key) for key in keys if key in answer}, preview=preview)
        if answer.get("failed"):
            raise StageError("scratch", answer.get("msg") or "run_scratch failed")
        self.record["changed"] = self.record["changed"] or bool(answer.get("changed") and not preview)

    def stop_meter(self, preview: bool) -> str:
        """The meter-stop; returns the status it earns (``TORN_DOWN``, ``STOP_BY_HAND``, ``CLEANED``). The box lease
        is given back first: a stopped box answers no call."""
        self.release_box()
        verb = self.settings.verb
        if verb is None:
            if not self.settings["stop_meter"]:
                self.record["meter_stop"] = {"state": "not_asked", "msg": "teardown_stop_meter=false: the box bills on"}
                return "CLEANED"
            self.record["meter_stop"] = {"state": "none", "msg": "no meter-stop on this platform (verb none)"}
            return "TORN_DOWN"
        if not verb.command:
            steps = list(verb.manual_steps) or ["stop the instance in the provider's console"]
            self.record["meter_stop"] = {"state": "manual", "verb": verb.name, "steps": steps}
            return "STOP_BY_HAND"
        plan = meter.plan_for(
            verb,
            timeout_s=self.settings["meter_stop_timeout_s"],
            poll_interval_s=self.settings["meter_stop_poll_interval_s"],
            command_timeout_s=COMMAND_TIMEOUT_S,
        )
        # The box answered this teardown's gate moments ago, so its instance runs: an id the provider does not list,
        # or lists as stopped, is a typo or a stale id, and the box is still billing (refused, nothing run).
        stopped = meter.stopped_states(self.settings["meter_stop_verbs"], verb)
        try:
            changed, result = meter.meter_stop(plan, check_mode=preview, box_answered=True, stopped_states=stopped)
        except meter.MeterStopError as error:
            self.record["meter_stop"] = dict(error.result, state="failed", verb=verb.name)
            raise StageError("meter_stop", str(error)) from None
        state = "would_run" if preview else ("already" if result.get("already") else "stopped")
        self.record["meter_stop"] = dict(result, state=state, verb=verb.name)
        self.record["changed"] = self.record["changed"] or bool(changed and not preview)
        return "TORN_DOWN"


def _lease_ttl(seconds: float) -> float:
    return min(max(float(seconds), 0.0) + LEASE_SLACK_S, MAX_LEASE_S)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return one_line(lines[-1], 160) if lines else ""


def _state(entry: Mapping[str, Any]) -> str:
    return str((entry.get("run") or {}).get("state") or "")


def _plain(artifacts: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    return [{key: artifact[key] for key in ("path", "size", "sha256")} for artifact in artifacts]


def _gate_record(answer: Mapping[str, Any]) -> Dict[str, Any]:
    """What the report keeps of the gate: per run its state, cells and durable copy; the instance's evidence."""
    runs = []
    for entry in answer.get("runs") or []:
        cells = entry.get("cells") or []
        durable = entry.get("durable") or {}
        runs.append(
            {
                "name": (entry.get("run") or {}).get("name"),
                "state": _state(entry),
                "passed": entry.get("passed"),
                "reason": entry.get("reason") or "",
                "cells": len(cells),
                "cells_done": sum(1 for cell in cells if cell.get("done")),
                "accepted": [cell.get("name") for cell in cells if cell.get("accepted")],
                "durable_dir": durable.get("dir"),
                "durable_files": durable.get("files") or 0,
                "durable_bytes": durable.get("bytes") or 0,
                "mismatches": durable.get("mismatches") or [],
                "known_bad": (durable.get("manifest") or {}).get("known_bad") or [],
                "notes": entry.get("notes") or [],
            }
        )
    keys = ("passed", "step", "reason", "notes")
    return dict({key: answer.get(key) for key in keys}, runs=runs, instance=answer.get("instance"))
