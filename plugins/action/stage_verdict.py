# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action of remote_gpu.trainer.stage_verdict: turn a box's stage record into ansible-playbook's own outcome."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.plugins.action import ActionBase

SPEC = {
    "result": {"type": "raw", "required": True},
    "failing": {"type": "list", "elements": "str", "default": ["UNCONFIRMED", "STOP_BY_HAND", "REFUSED", "FAILED"]},
    "fleet_var": {"type": "str"},
    "escalated_fails": {"type": "bool", "default": False},
}


def _fails(record: Any, failing: List[str], escalated_fails: bool) -> bool:
    if not isinstance(record, Mapping) or record.get("status") == "UNREACHABLE":
        return False
    return record.get("status") in failing or (escalated_fails and record.get("escalate") is True)


def _fleet_failing(task_vars: Dict[str, Any], fleet_var: str, failing: List[str], escalated_fails: bool) -> bool:
    hostvars = task_vars.get("hostvars") or {}
    return any(
        _fails((hostvars.get(host) or {}).get(fleet_var), failing, escalated_fails)
        for host in task_vars.get("ansible_play_hosts_all") or []
    )


class ActionModule(ActionBase):
    _requires_connection = False
    _supports_check_mode = True

    def run(self, tmp: Optional[str] = None, task_vars: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        result = super().run(tmp, task_vars)
        validated = ArgumentSpecValidator(SPEC).validate(self._task.args)
        if validated.error_messages:
            return dict(result, failed=True, msg="stage_verdict: " + "; ".join(validated.error_messages))
        record = validated.validated_parameters["result"]
        if not isinstance(record, dict) or not isinstance(record.get("status"), str):
            return dict(result, failed=True, msg="stage_verdict: result holds no stage record (the stage did not run)")
        line = str(record.get("line") or record["status"])
        failing = validated.validated_parameters["failing"]
        escalated_fails = validated.validated_parameters["escalated_fails"]
        if record["status"] == "UNREACHABLE":
            # ansible-playbook reports 4 over 2: when another box failed, this one fails too, so the exit code is 2.
            fleet_var = validated.validated_parameters["fleet_var"]
            if fleet_var and _fleet_failing(task_vars or {}, fleet_var, failing, escalated_fails):
                return dict(result, failed=True, msg=line)
            return dict(result, unreachable=True, msg=line)
        if _fails(record, failing, escalated_fails):
            return dict(result, failed=True, msg=line)
        return dict(result, changed=False, msg=line)
