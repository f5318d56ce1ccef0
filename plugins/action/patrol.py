# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action of remote_gpu.trainer.patrol: one box's patrol tick in one controller step (see the module's docs)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_billing as billing
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_record as records
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_states as states
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost, hourly_rate, stopped_rate
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import (
    BoxUnreachable,
    StageAction,
    unknown_variables,
)


class ActionModule(StageAction):
    ARGUMENT_SPEC = options.ARGUMENT_SPEC
    PREFIX = "patrol_"

    def refuse(self, task_vars: Dict[str, Any], args: Mapping[str, Any], problems: List[str]) -> Dict[str, Any]:
        run_filter = args.get("run") if isinstance(args.get("run"), str) else ""
        record = records.broken(self.host(task_vars), "; ".join(problems), "patrol_error", run_filter=run_filter)
        return self.finish(record, task_vars)

    def stage(self, args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        ours = [name for name in task_vars if not name.startswith(options.OTHER_PLAYBOOKS)]
        problems = unknown_variables(ours, self.PREFIX, options.KNOWN_VARIABLES) + options.problems_of(args)
        if problems:
            return self.refuse(task_vars, args, problems)
        configured = task_vars.get("ansible_python_interpreter")
        if isinstance(configured, str) and "{{" in configured and self._templar is not None:
            configured = self._templar.template(configured)
        python = options.interpreter(args, configured)
        host = self.host(task_vars)
        try:
            answer = self.box_module(
                "patrol_facts", options.module_args(args), dict(task_vars, ansible_python_interpreter=python)
            )
        except BoxUnreachable as gone:
            return self.finish(self.down(host, str(gone), task_vars), task_vars)
        record = records.from_answer(host, answer, python, args["run"])
        states.answered_state(record)
        return self.finish(record, task_vars, options.idle_billing_minutes(args["idle_billing_minutes"]))

    def host(self, task_vars: Mapping[str, Any]) -> str:
        return str(task_vars.get("inventory_hostname") or self._play_context.remote_addr)

    def profile(self, task_vars: Mapping[str, Any], name: str, default: Any = None) -> Any:
        """A host or profile variable, a template in it rendered; ``default`` when it is unset or cannot be."""
        value = task_vars.get(name, default)
        try:
            return self._templar.template(value) if self._templar is not None and value is not None else value
        except Exception:  # a broken template: what it was for is then unknown, never an error of the tick
            return default

    def down(self, host: str, reason: str, task_vars: Mapping[str, Any]) -> Dict[str, Any]:
        """The record of a box that did not answer: the provider asked with the profile's status command, and the
        previous reports read for a stop of ours (read-only, on the controller)."""
        now = datetime.now(timezone.utc)
        provider = states.ask_provider(task_vars, self._templar)
        report_dir = self.profile(task_vars, "patrol_report_dir", "reports")
        known = states.history(str(report_dir or "reports"), host, now)
        return states.down_record(host, reason, provider, known, now)

    def rate(self, task_vars: Mapping[str, Any]) -> Tuple[Optional[float], Optional[str]]:
        """The host's hourly_usd (a template in it rendered) and its problem, as _cost.hourly_rate says."""
        return hourly_rate(task_vars, self._templar)

    def finish(
        self, record: Dict[str, Any], task_vars: Mapping[str, Any], idle_minutes: Optional[float] = None
    ) -> Dict[str, Any]:
        """The record with its cost (a bad hourly_usd is a warning on the line, never a refusal), idle_billing
        judged, its status and its line."""
        now = datetime.now(timezone.utc)
        rate, problem = self.rate(task_vars)
        box = record.get("box") or {}
        # The box's ledger, counted on its own clock (box_now): a box clock off ours changes nothing.
        cost = box_cost(rate, box.get("since"), now, box_now=box.get("box_now"), ledger=box.get("ledger"))
        record.update(cost=cost, cost_warning=problem)
        storage, storage_problem = stopped_rate(task_vars, self._templar)
        states.bill(record, rate, storage, self.profile(task_vars, "stopped_bills"), now)
        if storage_problem:
            record["cost_warning"] = "; ".join(found for found in (problem, storage_problem) if found)
        billing.escalate(record, idle_minutes, rate, now)
        record["status"] = str(record["state"]).upper()
        record["check_mode"] = bool(self._task.check_mode)
        record["line"] = lines.line(record, now)
        return dict(record, changed=False, msg=record["line"])
