# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action of remote_gpu.trainer.teardown: one box's whole teardown in one controller step (see the module's docs)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from ansible.utils.display import Display

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost, hourly_rate
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._report import Busy, box_lock
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import (
    BoxUnreachable,
    StageAction,
    StageError,
    misspelt_short_names,
    unknown_variables,
)
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._teardown_flow import Teardown
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._teardown_peers import shared_instance_id

display = Display()


class ActionModule(StageAction):
    ARGUMENT_SPEC = options.ARGUMENT_SPEC
    PREFIX = "teardown_"
    VARIABLES = {"runs": "teardown_run", "confirm": "confirm_teardown"}

    def refuse(
        self, task_vars: Dict[str, Any], args: Mapping[str, Any], problems: List[str], step: str = "validate"
    ) -> Dict[str, Any]:
        host = str(task_vars.get("inventory_hostname") or self._play_context.remote_addr)
        record = {"host": host, "runs": options.names(args.get("runs")) or ["?"], "check_mode": self._task.check_mode}
        rate, rate_problem = hourly_rate(task_vars, self._templar)  # a refused box still bills: its rate is on the line
        record.update(cost=box_cost(rate, None), warnings=[rate_problem] if rate_problem else [])
        return self.finish(record, "REFUSED", step, "; ".join(problems))

    def stage(self, args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        host = str(task_vars.get("inventory_hostname") or self._play_context.remote_addr)
        problems = unknown_variables(task_vars, "teardown_", options.KNOWN_VARIABLES)
        problems += misspelt_short_names(task_vars, options.SHORT_NAMES)
        settings, more = options.settings_of(args, task_vars)
        problems += more
        if settings is None or problems:
            return self.refuse(task_vars, args, problems)
        if settings.instance:  # a meter-stop: another host of the play must not name the same instance
            shared = shared_instance_id(task_vars, host, settings["instance_id"], settings["platform"])
            if shared:
                return self.refuse(task_vars, args, [shared], step="instance_id")
        flow = Teardown(self, settings, task_vars, host)
        key = settings["instance_id"] or str(task_vars.get("ansible_host") or host)
        try:
            with box_lock("teardown", key, settings["lock_wait_s"]):
                status, step, reason = flow.run(display.warning)
        except Busy as busy:
            status, step, reason = "REFUSED", "lock", str(busy)
        except StageError as stop:
            status, step, reason = lines.status_of_step(stop.step), stop.step, stop.reason
        except BoxUnreachable as gone:
            status, step, reason = "UNREACHABLE", "unreachable", str(gone)
            said = flow.provider_state()
            reason = f"{reason}; {said}" if said else reason
        return self.finish(flow.record, status, step, reason)

    def finish(self, record: Dict[str, Any], status: str, step: Any, reason: str) -> Dict[str, Any]:
        record.update(status=status, step=step, reason=reason)
        record["warnings"] = list(record.get("warnings") or []) + warnings_of(record)
        record["line"] = lines.line(record)
        return dict(record, changed=bool(record.get("changed")), msg=record["line"])


def warnings_of(record: Dict[str, Any]) -> list:
    warnings = []
    acting = record["status"] in ("TORN_DOWN", "CHECKED", "UNCONFIRMED", "STOP_BY_HAND")
    if record.get("irreversible") and acting:
        warnings.append(
            f"meter-stop verb {record.get('verb')} is irreversible: the instance and its disks are destroyed; only "
            "the verified durable copy remains"
        )
    cost = record.get("cost") or {}
    if cost.get("note"):
        warnings.append(f"cost: {cost['note']}")
    if record.get("check_mode") and record.get("reason") and record["status"] == "CHECKED":
        warnings.append(f"a real teardown stops before acting: {record['reason']}")
    gate = record.get("gate") or {}
    for run in gate.get("runs") or []:
        if run.get("accepted"):
            warnings.append(f"run {run['name']}: cells accepted unfinished (not secured): {', '.join(run['accepted'])}")
    # The id check's note is on the line already; the gate's notes name each abandoned run and what it loses.
    warnings += [str(note) for note in gate.get("notes") or [] if not str(note).startswith("instance_id ")]
    return warnings
