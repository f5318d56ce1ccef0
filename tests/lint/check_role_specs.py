"""Fail when a role's defaults/main.yml and meta/argument_specs.yml disagree.

Every default must be declared in the main entry point's argument spec with the same default value, and every
spec option that declares a default must appear in defaults/main.yml. A default computed by a template (an inventory
variable's value) cannot be the documented default of a typed option (int, bool, list, dict: antsibull-docs rejects
the string): such an option leaves `default` out and says it in its description. Usage: check_role_specs.py ROLES_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

_MISSING = object()
_STRING_TYPES = ("str", "raw", "path")


def check_role(role: Path) -> list[str]:
    problems: list[str] = []
    defaults_file = role / "defaults" / "main.yml"
    specs_file = role / "meta" / "argument_specs.yml"
    if not specs_file.is_file():
        return [f"{role.name}: meta/argument_specs.yml is missing"]
    defaults: dict[str, Any] = (yaml.safe_load(defaults_file.read_text()) or {}) if defaults_file.is_file() else {}
    specs = yaml.safe_load(specs_file.read_text()) or {}
    entry = (specs.get("argument_specs") or {}).get("main")
    if entry is None:
        return [f"{role.name}: argument_specs has no 'main' entry point"]
    options: dict[str, dict[str, Any]] = entry.get("options") or {}
    for name, value in defaults.items():
        if name not in options:
            problems.append(f"{role.name}: default '{name}' is not declared in meta/argument_specs.yml")
            continue
        declared = options[name].get("default", _MISSING)
        typed = options[name].get("type", "str") not in _STRING_TYPES
        if typed and isinstance(value, str) and "{{" in value:
            if declared is not _MISSING:
                problems.append(
                    f"{role.name}: '{name}' is a {options[name]['type']} computed by a template in defaults/main.yml: "
                    "leave default out of argument_specs and say it in the description"
                )
        elif declared is _MISSING:
            problems.append(f"{role.name}: '{name}' has a default in defaults/main.yml but none in argument_specs")
        elif declared != value:
            problems.append(
                f"{role.name}: '{name}' defaults to {value!r} in defaults/main.yml but {declared!r} in argument_specs"
            )
    for name, spec in options.items():
        if "default" in spec and name not in defaults:
            problems.append(f"{role.name}: argument_specs gives '{name}' a default that defaults/main.yml lacks")
        if not spec.get("description"):
            problems.append(f"{role.name}: option '{name}' has no description")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: check_role_specs.py ROLES_DIR", file=sys.stderr)
        return 2
    roles = sorted(path for path in Path(argv[1]).iterdir() if path.is_dir())
    problems = [problem for role in roles for problem in check_role(role)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"role specs: {len(roles)} roles checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
