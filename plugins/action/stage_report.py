# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action of remote_gpu.trainer.stage_report: the fleet's report of a stage, run once for every targeted box.

It reads each box's record from the variable the stage's task registered, for every host of the play
(``ansible_play_hosts_all``: failed and unreachable ones too), so ``--limit`` cannot skip it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.plugins.action import ActionBase

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines as launch_lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_lines as patrol_lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_lines as teardown_lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._fleet_page import write_page
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._patrol_notify import notify
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._report import write_report

SPEC = {
    "stage": {"type": "str", "required": True, "choices": ["teardown", "patrol", "launch"]},
    "result_var": {"type": "str", "required": True},
    "report_dir": {"type": "str", "default": "reports"},
    "notify": {
        "type": "dict",
        "options": {
            "webhook_url": {"type": "str", "default": "", "no_log": True},
            "timeout_s": {"type": "float", "default": 10},
            "state_file": {"type": "str", "default": ""},
        },
    },
}
# Per stage, its words (STATUSES, lines, summary, no_record) and what a report keeps of a record: never the
# module's invocation or raw provider output.
FORMATTERS = {"teardown": teardown_lines, "patrol": patrol_lines, "launch": launch_lines}


class ActionModule(ActionBase):
    _requires_connection = False
    _supports_check_mode = True

    def run(self, tmp: Optional[str] = None, task_vars: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        validated = ArgumentSpecValidator(SPEC).validate(self._task.args)
        if validated.error_messages:
            return dict(result, failed=True, msg="stage_report: " + "; ".join(validated.error_messages))
        args = validated.validated_parameters
        formatter = FORMATTERS[args["stage"]]
        hostvars = task_vars.get("hostvars") or {}
        records: List[Dict[str, Any]] = []
        for host in task_vars.get("ansible_play_hosts_all") or []:
            found = (hostvars.get(host) or {}).get(args["result_var"])
            ok = isinstance(found, Mapping) and found.get("status") in formatter.STATUSES
            kept = {key: found.get(key) for key in formatter.RECORD_KEYS if key in found} if ok else None
            records.append(kept or formatter.no_record(host))
        summary = formatter.summary(records)
        shown = [text for record in records for text in formatter.lines(record)] + [f"SUMMARY: {summary['line']}"]
        document = {
            "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "stage": args["stage"],
            "check_mode": bool(self._task.check_mode),
            "summary": summary,
            "hosts": records,
        }
        # A report that cannot be written must not cost the notifications: they are sent first.
        if args["notify"] is not None:
            when = document["generated_at"]
            shown += notify(records, args["notify"], args["report_dir"], when, self._task.check_mode)
        try:
            path = write_report(args["report_dir"], args["stage"], document)
        except OSError as error:
            shown.append(f"report NOT written: {error}")
            return dict(result, failed=True, msg=shown, _ansible_verbose_always=True)
        shown.append(f"report: {path}")
        done = dict(result, changed=False, msg=shown, report=path, _ansible_verbose_always=True)
        if args["stage"] == "patrol":
            try:
                done["page"] = write_page(path, document)[0]
                shown.append(f"page: {done['page']}")
            except Exception as error:  # the page is a view of the report: no failure of it may cost the tick
                shown.append(f"page NOT written: {' '.join(str(error).split())[:300] or type(error).__name__}")
        return done
