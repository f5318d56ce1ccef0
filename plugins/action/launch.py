# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action of remote_gpu.trainer.launch: one box's launch in one controller step (see the module's docs)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines as lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import box_cost, hourly_rate
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._launch_flow import Launch
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import BoxUnreachable, StageAction, StageError


class ActionModule(StageAction):
    ARGUMENT_SPEC = options.ARGUMENT_SPEC
    PREFIX = "launch_"

    def in_variables(self, message: str) -> str:
        return options.plain_message(message)

    def refuse(self, task_vars: Dict[str, Any], args: Mapping[str, Any], problems: List[str]) -> Dict[str, Any]:
        # The base's own check of the options failed: the typo'd variables are told with it (a typo is often why).
        return self.refused(task_vars, args, options.typo_problems(task_vars) + problems)

    def refused(self, task_vars: Mapping[str, Any], args: Mapping[str, Any], problems: List[str]) -> Dict[str, Any]:
        """The box refused at validate: nothing was sent to it, and the report still lists it."""
        host = str(task_vars.get("inventory_hostname") or self._play_context.remote_addr)
        run = args.get("run") if isinstance(args.get("run"), str) else None
        record = {"host": host, "run": run, "cells": [], "check_mode": bool(self._task.check_mode), "changed": False}
        # A refused box bills all the same: its rate (a bad one is a warning, as in every stage, and shows none).
        rate, rate_problem = hourly_rate(task_vars, self._templar)
        record.update(autostop=None, cost=box_cost(rate, None), warnings=[rate_problem] if rate_problem else [])
        return self.finish(record, "REFUSED", "validate", "; ".join(problems))

    def stage(self, args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        settings, problems = options.settings_of(args, task_vars, self._templar, self._loader)
        if settings is None or problems:
            return self.refused(task_vars, args, problems)
        sweep = len(args["cells"]) if isinstance(args.get("cells"), list) else 0
        flow = Launch(self, settings, task_vars, sweep)
        try:
            status, step, reason = flow.run()
        except StageError as stop:
            status, step, reason = lines.status_of_step(stop.step), stop.step, stop.reason
        except BoxUnreachable as gone:
            status, step, reason = "UNREACHABLE", "unreachable", str(gone)
        return self.finish(flow.record, status, step, reason)

    def finish(self, record: Dict[str, Any], status: str, step: Optional[str], reason: str) -> Dict[str, Any]:
        record.update(status=status, step=step, reason=reason)
        record["line"] = lines.line(record)
        kept = {key: record[key] for key in lines.RECORD_KEYS if key in record}
        return dict(kept, changed=bool(record.get("changed")), msg=record["line"])
