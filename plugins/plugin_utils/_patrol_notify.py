# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Patrol's notification step, run by stage_report after the lines: read the state the previous tick kept, work out
this tick's messages, send them all under one deadline, keep the new state; the state file locked throughout, so
two ticks at once notify each problem once."""

from __future__ import annotations

import os
from typing import Any, List, Mapping, Sequence

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _notify
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._webhook import send_all

LOCK_WAIT_S = 60


def notify(
    records: Sequence[Mapping[str, Any]], options: Mapping[str, Any], report_dir: str, now: str, check_mode: bool
) -> List[str]:
    """The notification lines of this tick (what was sent, or would be, and any failure), never an exception."""
    path = os.path.abspath(os.path.expanduser(options["state_file"] or os.path.join(report_dir, "patrol-state.json")))
    url = options["webhook_url"]
    mode = "check" if check_mode else ("send" if url else "off")
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with _notify.locked_state(path, LOCK_WAIT_S) as previous:
            plan = _notify.plan(previous.state, list(records), now=now, mode=mode)
            delivered = send_all(url, plan.messages, options["timeout_s"]) if mode == "send" else {}
            settled = _notify.settle(plan, delivered)
            lines = list(previous.notes) + list(settled.lines)
            if check_mode:
                return lines
            try:
                previous.write(settled.state)
            except OSError as error:
                lines.append(f"notification state NOT written: {one_line(error)}")
            return lines
    except (OSError, _notify.Busy) as error:
        return [f"notifications NOT handled: {one_line(error)}"]
