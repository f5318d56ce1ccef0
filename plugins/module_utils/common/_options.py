# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Option values an argument spec cannot check: numbers within bounds, dotted versions, non-empty paths.

Ansible's ``type: float`` turns ``nan``, ``inf`` and ``1e400`` into floats, and every comparison with
nan is false, so a guard such as ``if value < 0`` lets nan through: the age guard of a reaper is off,
a sampling loop never ends. Each module declares its rules next to its argument spec and calls
``check_options`` once, before any work; the rules' ``describe()`` is what the module's docs state.
"""

from __future__ import annotations

import math
import re
from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

_DOTTED = re.compile(r"\d+(?:\.\d+)*")


class Between(NamedTuple):
    """``low <= value <= high`` for a number or every entry of a list of integers; nan and inf never are.

    ``above_low`` makes the lower end exclusive: a timeout of 0 s is no time at all, not "no timeout".
    """

    low: float
    high: float
    above_low: bool = False

    def describe(self) -> str:
        if self.above_low:
            return f"above {self.low} and at most {self.high}"
        return f"between {self.low} and {self.high}"

    def _within(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return (self.low < value if self.above_low else self.low <= value) and value <= self.high

    def problem(self, value: Any) -> Optional[str]:
        if isinstance(value, list):
            bad = [item for item in value if not self._within(item)]
            return f"entries must be integers {self.describe()}, got {bad[0]}" if bad else None
        if self._within(value):
            return None
        kind = "an integer" if isinstance(value, int) else "a finite number"
        return f"must be {kind} {self.describe()}, got {value}"


class DottedVersion(NamedTuple):
    """A version of dotted numbers (``535.104.05``); anything else would compare as unknown and skip the check."""

    example: str

    def describe(self) -> str:
        return f"dotted numbers such as {self.example}"

    def problem(self, value: Any) -> Optional[str]:
        return None if _DOTTED.fullmatch(str(value).strip()) else f"must be {self.describe()}, got {value!r}"


class NonEmpty(NamedTuple):
    """A path that names something: ``''`` would probe the working directory or skip the check."""

    def describe(self) -> str:
        return "a non-empty path"

    def problem(self, value: Any) -> Optional[str]:
        return None if str(value).strip() else f"must be {self.describe()}, got {value!r}"


Rule = Union[Between, DottedVersion, NonEmpty]


def option_problems(
    params: Mapping[str, Any], rules: Mapping[str, Rule], ordered: Sequence[Tuple[str, str]] = ()
) -> List[str]:
    """One line per option that breaks its rule, in ``rules`` order; unset options are not checked.

    ``ordered`` pairs ``(a, b)`` need ``a <= b``, checked only when both are within their own rules.
    """
    problems: List[str] = []
    broken = set()
    for name, rule in rules.items():
        value = params.get(name)
        problem = None if value is None else rule.problem(value)
        if problem is not None:
            broken.add(name)
            problems.append(f"{name} {problem}")
    for low, high in ordered:
        if low in broken or high in broken or params.get(low) is None or params.get(high) is None:
            continue
        if params[low] > params[high]:
            problems.append(f"{low} must be at most {high}, got {params[low]} > {params[high]}")
    return problems


def check_options(module: Any, rules: Mapping[str, Rule], ordered: Sequence[Tuple[str, str]] = ()) -> None:
    """Fail ``module`` (an AnsibleModule) with one line naming every bad option and its accepted range."""
    problems = option_problems(module.params, rules, ordered)
    if problems:
        module.fail_json(msg="; ".join(problems))
