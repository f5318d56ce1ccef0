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


def test_private_roles_are_checked_like_the_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roles = tmp_path / "roles"
    _role(roles, "a: 2\n", SPECS).rename(roles / "_private")
    assert check_role_specs.main(["check_role_specs.py", str(roles)]) == 1
    assert "_private: 'a' defaults to 2" in capsys.readouterr().err
