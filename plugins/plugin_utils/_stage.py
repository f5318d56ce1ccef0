# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The shared base of the stage action plugins: one controller step per box per stage.

A stage's action validates its options (a typo'd role variable is named with the closest valid one), calls the
box's modules with ``_execute_module`` and does its controller work in Python. It never lets a traceback or an
unreachable box end the play for its host: every outcome is one record, so the stage's report step (``run_once``)
always runs and sees every box, ``--limit`` or not. The verdict step (``stage_verdict``) then fails or marks
unreachable the boxes that need it, and ansible-playbook's own exit code follows.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

from ansible.errors import AnsibleConnectionFailure
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.plugins.action import ActionBase

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import cost_text, fleet_hourly

REASON_CHARS = 300
_UNCONVERTIBLE = re.compile(r"argument '?([\w.]+)'? is of type (\w+) and we were unable to convert to (\w+).*", re.S)


class StageError(Exception):
    """A one-line reason that stops this box's stage at ``step``."""

    def __init__(self, step: str, reason: str) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = one_line(reason)


class BoxUnreachable(Exception):
    """The box stopped answering during the stage."""


def one_line(text: Any, limit: int = REASON_CHARS) -> str:
    """Module messages and errors can span lines or be huge: one bounded line."""
    line = " ".join(str(text if text is not None else "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def closest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for a misspelt ``name``, or nothing."""
    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def unknown_variables(variables: Iterable[str], prefix: str, known: Iterable[str]) -> List[str]:
    """One problem per variable that starts with ``prefix`` and is no known one: a typo would otherwise be ignored."""
    known = set(known)
    return [
        f"{name} is not a variable of this stage{closest(name, known)}"
        for name in sorted(variables)
        if name.startswith(prefix) and name not in known
    ]


def misspelt_short_names(variables: Iterable[str], short_names: Iterable[str]) -> List[str]:
    """A variable one or two letters off a stage's command-line name (``pul_to``, ``confirm_teardwon``): the option
    the user meant would otherwise be silently unset."""
    short = set(short_names)
    problems = []
    for name in sorted(variables):
        match = difflib.get_close_matches(name, sorted(short), n=1, cutoff=0.85) if name not in short else []
        if match:
            problems.append(f"{name} is not a variable of this stage (did you mean {match[0]}?)")
    return problems


def status_summary(
    records: List[Mapping[str, Any]], statuses: Iterable[str], named: Iterable[str], stepped: Iterable[str]
) -> Dict[str, Any]:
    """A stage's fleet summary: hosts per status in ``statuses`` order, the ``stepped`` ones with the step that
    stopped them and the ``named`` ones by name in the line, the changed hosts, the fleet's total per hour of the
    records with a ``cost`` (None when none has one), and the line."""
    by_status: Dict[str, List[str]] = {status: [] for status in statuses}
    for record in records:
        by_status.setdefault(str(record.get("status")), []).append(str(record.get("host")))
    text = f"{len(records)} hosts: " + ", ".join(f"{len(hosts)} {s}" for s, hosts in by_status.items() if hosts)
    steps = {record.get("host"): record.get("step") for record in records}
    for status in stepped:
        if by_status[status]:
            text += f"; {status.lower()}: " + ", ".join(f"{host} ({steps.get(host)})" for host in by_status[status])
    for status in named:
        if by_status[status]:
            text += f"; {status.lower()}: {', '.join(by_status[status])}"
    hourly = fleet_hourly(records)
    if hourly is not None:
        text += f"; {cost_text({'hourly_usd': hourly})}"
    return {
        "hosts": len(records),
        "counts": {status: len(hosts) for status, hosts in by_status.items() if hosts},
        **{status.lower(): hosts for status, hosts in by_status.items()},
        "changed": [record.get("host") for record in records if record.get("changed")],
        "hourly_usd_total": hourly,
        "line": text,
    }


class StageAction(ActionBase):
    """Base of ``remote_gpu.trainer.<stage>``: validation first, module calls, no tracebacks.

    The role maps its variables onto the options (``teardown_pull_to`` -> ``pull_to``), so a problem with an option
    is told by the variable's name (``VARIABLES`` names the exceptions to ``PREFIX + option``), and it becomes the
    box's refusal at ``validate`` (``refuse``): the report still lists the box.
    """

    _requires_connection = True
    _supports_check_mode = True
    _supports_async = False
    ARGUMENT_SPEC: Dict[str, Any] = {}
    PREFIX = ""
    VARIABLES: Dict[str, str] = {}

    def run(self, tmp: Optional[str] = None, task_vars: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        result = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        validated = ArgumentSpecValidator(self.ARGUMENT_SPEC).validate(self._task.args)
        if validated.error_messages:
            unsupported = sorted(set(self._task.args) - set(self.ARGUMENT_SPEC))
            hints = [f"{name} is not an option{closest(name, self.ARGUMENT_SPEC)}" for name in unsupported]
            messages = hints or [self.in_variables(message) for message in validated.error_messages]
            return dict(result, **self.refuse(task_vars, self._task.args, messages))
        try:
            return dict(result, **self.stage(validated.validated_parameters, task_vars))
        finally:
            with contextlib.suppress(AnsibleConnectionFailure):
                self._remove_tmp_path(self._connection._shell.tmpdir)

    def in_variables(self, message: str) -> str:
        """An argument spec's message about option ``x`` told about the role variable behind it."""
        for option in sorted(self.ARGUMENT_SPEC, key=len, reverse=True):
            variable = self.VARIABLES.get(option, f"{self.PREFIX}{option}")
            message = re.sub(rf"(?<![\w'])'?{re.escape(option)}'?(?![\w'])", variable, message)
        # "argument x is of type str and we were unable to convert to float: <class ...>": the type is what matters.
        message = _UNCONVERTIBLE.sub(r"\1 must be a \3, not a \2", message)
        return one_line(message)

    def refuse(self, task_vars: Dict[str, Any], args: Mapping[str, Any], problems: List[str]) -> Dict[str, Any]:
        return {"failed": True, "msg": f"{self._task.action}: " + "; ".join(problems)}

    def stage(self, args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def box_module(self, name: str, args: Mapping[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        """Run the collection's module ``name`` on the box; BoxUnreachable when the box does not answer."""
        try:
            answer = self._execute_module(
                module_name=f"remote_gpu.trainer.{name}", module_args=dict(args), task_vars=task_vars
            )
        except AnsibleConnectionFailure as error:
            raise BoxUnreachable(one_line(error)) from None
        if answer.get("unreachable"):
            raise BoxUnreachable(one_line(answer.get("msg") or "host unreachable"))
        return answer

    @contextlib.contextmanager
    def check_mode(self, preview: bool) -> Iterator[None]:
        """Run the modules called inside in check mode when ``preview`` (a teardown not yet confirmed)."""
        saved = self._task.check_mode
        self._task.check_mode = bool(saved or preview)
        try:
            yield
        finally:
            self._task.check_mode = saved
