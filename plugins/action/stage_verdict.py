# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action of remote_gpu.trainer.stage_verdict: turn a box's stage record into ansible-playbook's own outcome."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.plugins.action import ActionBase

SPEC = {
    "result": {"type": "raw", "required": True},
    "failing": {"type": "list", "elements": "str", "default": ["UNCONFIRMED", "STOP_BY_HAND", "REFUSED", "FAILED"]},
}


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
        if record["status"] == "UNREACHABLE":
            return dict(result, unreachable=True, msg=line)
        if record["status"] in validated.validated_parameters["failing"]:
            return dict(result, failed=True, msg=line)
        return dict(result, changed=False, msg=line)
