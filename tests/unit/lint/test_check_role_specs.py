from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "lint" / "check_role_specs.py"
spec = importlib.util.spec_from_file_location("check_role_specs", SCRIPT)
assert spec and spec.loader
check_role_specs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_role_specs)


def _role(tmp_path: Path, defaults: str, specs: str) -> Path:
    role = tmp_path / "r"
    (role / "defaults").mkdir(parents=True)
    (role / "meta").mkdir()
    (role / "defaults" / "main.yml").write_text(defaults)
    (role / "meta" / "argument_specs.yml").write_text(specs)
    return role


SPECS = """
argument_specs:
  main:
    options:
      a: {type: int, default: 1, description: the a}
"""


def test_agreeing_role_passes(tmp_path: Path) -> None:
    assert check_role_specs.check_role(_role(tmp_path, "a: 1\n", SPECS)) == []


@pytest.mark.parametrize(
    ("defaults", "expected"),
    [
        ("a: 2\n", "defaults to 2"),
        ("a: 1\nb: 3\n", "'b' is not declared"),
        ("{}\n", "lacks"),
    ],
)
def test_disagreement_is_reported(tmp_path: Path, defaults: str, expected: str) -> None:
    problems = check_role_specs.check_role(_role(tmp_path, defaults, SPECS))
    assert len(problems) == 1
    assert expected in problems[0]


TYPED = """
argument_specs:
  main:
    options:
      n: {type: int, description: the n, DEFAULT}
      s: {type: str, description: the s, default: "{{ s_var | default('') }}"}
"""
TEMPLATED = 'n: "{{ n_var | default(0) }}"\ns: "{{ s_var | default(\'\') }}"\n'


def test_a_templated_default_of_a_typed_option_stays_out_of_the_spec(tmp_path: Path) -> None:
    assert check_role_specs.check_role(_role(tmp_path, TEMPLATED, TYPED.replace(", DEFAULT", ""))) == []


def test_a_templated_default_declared_on_a_typed_option_is_reported(tmp_path: Path) -> None:
    specs = TYPED.replace("DEFAULT", 'default: "{{ n_var | default(0) }}"')
    (problem,) = check_role_specs.check_role(_role(tmp_path, TEMPLATED, specs))
    assert "'n' is a int computed by a template" in problem


def test_private_roles_are_checked_like_the_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roles = tmp_path / "roles"
    _role(roles, "a: 2\n", SPECS).rename(roles / "_private")
    assert check_role_specs.main(["check_role_specs.py", str(roles)]) == 1
    assert "_private: 'a' defaults to 2" in capsys.readouterr().err
