# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stdout callback remote_gpu.trainer.stage_lines: a stage's report lines and its unexpected failures, nothing else."""

from __future__ import annotations

DOCUMENTATION = r"""
name: stage_lines
type: stdout
short_description: Print only each stage's report lines and one line per unexpected failure (all of it with -v)
version_added: "0.1.0"
description:
  - Without C(-v), prints only the lines of each P(remote_gpu.trainer.stage_report#module) task (one line per box,
    its indented reasons, the SUMMARY line and the report's path), verbatim, and one line per failed or
    unreachable task that was not expected to fail, made of the host, the task's name and its message.
  - A task of another stage that prints its own report (an C(ansible.builtin.debug) task whose C(msg) is the
    report's lines) opts in with the task variable C(stage_lines_show) set to a literal C(true); its C(msg) lines are
    printed verbatim too.
  - A failure is expected when the task has C(ignore_errors) (or C(ignore_unreachable) for an unreachable host),
    and for P(remote_gpu.trainer.stage_verdict#module), whose outcome the report has already told.
  - No play or task banners, no ok/changed/skipped lines, no recap; ansible-playbook's exit code tells the outcome.
    Warnings and deprecations are still shown.
  - With C(-v) or more it prints exactly what P(ansible.builtin.default#callback) prints.
author:
  - remote_gpu.trainer contributors (@remote-gpu-trainer)
extends_documentation_fragment:
  - ansible.builtin.default_callback
  - ansible.builtin.result_format_callback
requirements:
  - set as the stdout callback (C(stdout_callback = remote_gpu.trainer.stage_lines) in ansible.cfg, or
    C(ANSIBLE_STDOUT_CALLBACK=remote_gpu.trainer.stage_lines))
"""

import json
from typing import Any, Iterable, List, Mapping

from ansible import constants as C
from ansible.executor.task_result import CallbackTaskResult
from ansible.playbook.task import Task
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

REPORT_ACTION = "remote_gpu.trainer.stage_report"
VERDICT_ACTION = "remote_gpu.trainer.stage_verdict"
# Set to true on a task (a debug task printing a report's lines), its msg lines are printed like a stage_report's.
SHOW_VAR = "stage_lines_show"
# A failure line stays one readable line whatever a module put in its message.
LINE_CHARS = 700


def action_of(task: Task) -> str:
    """The task's action as written, or its resolved FQCN when it may be one of ours under a short name."""
    action = str(task.action or "")
    if action in (REPORT_ACTION, VERDICT_ACTION) or action.rsplit(".", 1)[-1] not in ("stage_report", "stage_verdict"):
        return action
    # Resolved only for our short names: ansible-core warns when asked to resolve one it cannot (a templated one).
    return str(task.resolved_action or action)


def prints_lines(task: Task) -> bool:
    """A stage_report task, or a task that asked for its msg lines to be shown."""
    return action_of(task) == REPORT_ACTION or (task.vars or {}).get(SHOW_VAR) is True


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "; ".join(_text(item) for item in value)
    return json.dumps(value, default=str, sort_keys=True)


def _message(data: Mapping[str, Any]) -> str:
    """What went wrong, from a result: its msg (or why it is hidden), the failed items of a loop, stderr's last line."""
    text = _text(data.get("msg") or data.get("censored") or data.get("reason") or "failed")
    items = [item for item in data.get("results") or [] if isinstance(item, Mapping) and item.get("failed")]
    if items:
        text += ": " + "; ".join(
            f"({_text(item.get('_ansible_item_label', item.get('item')))}) {_message(item)}" for item in items
        )
    stderr = [line for line in str(data.get("stderr") or "").splitlines() if line.strip()]
    if stderr and stderr[-1].strip() not in text:
        text += f" (stderr: {stderr[-1].strip()})"
    return text


def failure_line(host: str, task_name: str, data: Mapping[str, Any]) -> str:
    """``HOST: task name: message`` on one line."""
    return " ".join(f"{host}: {task_name}: {_message(data)}".split())[:LINE_CHARS]


def report_lines(msg: Any) -> List[str]:
    """A stage_report's msg (a list of lines; a single string when it failed its own validation), as lines."""
    return [str(line) for line in msg] if isinstance(msg, list) else str(msg or "").splitlines()


class CallbackModule(DefaultCallback):
    """The default callback with -v; without it, only the report's lines and the unexpected failures."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "remote_gpu.trainer.stage_lines"

    def _quiet(self) -> bool:
        return self._display.verbosity < 1

    def _show(self, lines: Iterable[str], error: bool = False) -> None:
        for line in lines:
            if error:
                self._display.display(line, color=C.COLOR_ERROR, stderr=self.get_option("display_failed_stderr"))
            else:
                self._display.display(line)

    def _unexpected(self, result: CallbackTaskResult) -> None:
        """One line for a failure nobody asked to ignore and no report already tells."""
        if action_of(result.task) == VERDICT_ACTION:
            return
        task_name = str(result.task_name or result.task.get_name()).strip()
        self._show([failure_line(self.host_label(result), task_name, result.result)], error=True)

    # The results: the report's lines, unexpected failures and, whatever the result, its warnings.

    def v2_runner_on_ok(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_on_ok(result)
            return
        self._handle_warnings(result.result)
        if prints_lines(result.task):
            self._show(report_lines(result.result.get("msg")))

    def v2_runner_on_failed(self, result: CallbackTaskResult, ignore_errors: bool = False) -> None:
        if not self._quiet():
            super().v2_runner_on_failed(result, ignore_errors=ignore_errors)
            return
        self._handle_warnings(result.result)
        if prints_lines(result.task):
            # Its lines end with why it failed (the report not written).
            self._show(report_lines(result.result.get("msg")), error=True)
        elif not ignore_errors:
            self._unexpected(result)

    def v2_runner_on_unreachable(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_on_unreachable(result)
            return
        self._handle_warnings(result.result)
        if not result.task.ignore_unreachable:
            self._unexpected(result)

    def v2_runner_on_skipped(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_on_skipped(result)
            return
        self._handle_warnings(result.result)

    def v2_runner_item_on_ok(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_item_on_ok(result)
            return
        self._handle_warnings(result.result)

    def v2_runner_item_on_failed(self, result: CallbackTaskResult) -> None:
        # The loop's own failure (v2_runner_on_failed) names the failed items on its one line.
        if not self._quiet():
            super().v2_runner_item_on_failed(result)
            return
        self._handle_warnings(result.result)

    def v2_runner_item_on_skipped(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_item_on_skipped(result)
            return
        self._handle_warnings(result.result)

    # Everything else the default callback prints (banners, recap, diffs, retries, async polls) only with -v.

    def v2_playbook_on_start(self, playbook: Any) -> None:
        if not self._quiet():
            super().v2_playbook_on_start(playbook)

    def v2_playbook_on_play_start(self, play: Any) -> None:
        if not self._quiet():
            super().v2_playbook_on_play_start(play)

    def v2_playbook_on_task_start(self, task: Task, is_conditional: bool) -> None:
        if not self._quiet():
            super().v2_playbook_on_task_start(task, is_conditional)

    def v2_playbook_on_handler_task_start(self, task: Task) -> None:
        if not self._quiet():
            super().v2_playbook_on_handler_task_start(task)

    def v2_runner_on_start(self, host: Any, task: Task) -> None:
        if not self._quiet():
            super().v2_runner_on_start(host, task)

    def v2_playbook_on_no_hosts_matched(self) -> None:
        if not self._quiet():
            super().v2_playbook_on_no_hosts_matched()

    def v2_playbook_on_no_hosts_remaining(self) -> None:
        if not self._quiet():
            super().v2_playbook_on_no_hosts_remaining()

    def v2_playbook_on_include(self, included_file: Any) -> None:
        if not self._quiet():
            super().v2_playbook_on_include(included_file)

    def v2_playbook_on_notify(self, handler: Any, host: Any) -> None:
        if not self._quiet():
            super().v2_playbook_on_notify(handler, host)

    def v2_on_file_diff(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_on_file_diff(result)

    def v2_runner_retry(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_retry(result)

    def v2_runner_on_async_poll(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_on_async_poll(result)

    def v2_runner_on_async_ok(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_on_async_ok(result)

    def v2_runner_on_async_failed(self, result: CallbackTaskResult) -> None:
        if not self._quiet():
            super().v2_runner_on_async_failed(result)

    def v2_playbook_on_stats(self, stats: Any) -> None:
        if not self._quiet():
            super().v2_playbook_on_stats(stats)
