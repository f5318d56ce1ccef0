#!/usr/bin/python
# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stage_report
short_description: Write a stage's fleet report and print one line per box, for every host of the play
version_added: "0.1.0"
description:
  - An action plugin, run with C(run_once) after a stage's per-box task. It reads each box's record from
    O(result_var) for every host of the play (C(ansible_play_hosts_all), failed and unreachable ones too), so a
    C(--limit) run still reports. A host without a record failed before its stage ran (role argument validation).
  - Writes C(<report_dir>/<stage>-<UTC>.json) (mode 0600; a second report in the same second gets C(-1), C(-2)...)
    and C(<stage>-latest.json); fails (exit code 2) when it cannot, after printing every line.
  - For stage C(patrol) it also writes the fleet page beside the report (C(<report minus .json>.html), mode 0600)
    and C(patrol-latest.html), one self-contained HTML file (inline CSS and SVG, no JavaScript, no URL) with a card
    per box, a progress bar per live cell and the runs' plots. A page that cannot be written is a line, never a
    failure; the JSON report stands.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
options:
  stage:
    description: The stage whose records these are.
    type: str
    required: true
    choices: [teardown, patrol, launch]
  result_var:
    description: The variable the stage's task registered on each host.
    type: str
    required: true
  report_dir:
    description: Controller directory for the report, relative to the working directory.
    type: str
    default: reports
  notify:
    description:
      - Patrol only. After the lines, one notification per new problem and per cleared box is POSTed to the webhook
        (all in parallel, under one deadline), and the notified problems are kept in the state file, locked so that
        two ticks at once notify each problem once. A box or run this tick did not examine keeps its state.
      - In check mode nothing is sent and the state is not written; the lines say what would be sent.
    type: dict
    suboptions:
      webhook_url:
        description: Webhook for the notifications (JSON with a Slack-compatible C(text)); empty sends none, the
          state still moves on. A secret, never logged.
        type: str
        default: ""
      timeout_s:
        description: Deadline in seconds for all of a tick's notifications together.
        type: float
        default: 10
      state_file:
        description: Controller file holding each box's notified problems; empty is C(<report_dir>/patrol-state.json).
        type: str
        default: ""
extends_documentation_fragment:
  - remote_gpu.trainer.attributes
attributes:
  check_mode:
    support: full
    details: The report is written in check mode too; it is the stage's output, not state.
  action:
    description: Runs on the controller.
    support: full
"""

EXAMPLES = r"""
- name: Write the fleet's teardown report
  remote_gpu.trainer.stage_report:
    stage: teardown
    result_var: teardown_box
  run_once: true
"""

RETURN = r"""
msg:
  description: One line per box (and its warnings), the summary line, and where the report went.
  returned: always
  type: list
  elements: str
report:
  description: The report's path.
  returned: success
  type: str
page:
  description: The fleet page's path (beside the report; C(patrol-latest.html) is the same page).
  returned: stage patrol, when the page was written
  type: str
"""
