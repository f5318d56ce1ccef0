"""Everything that runs on a box needs no Python newer than the oldest box Python (tests/compat/box_guard.py), and
imports under the oldest and the newest box Python of the running ansible-core, as AnsiballZ would import it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import List

import ansible
import pytest

from ansible_collections.remote_gpu.trainer.tests.compat import box_guard, pythons

REPO = box_guard.REPO
COLLECTIONS = REPO / ".build" / "collections"
IMPORT_ALL = """
import importlib, json, sys, traceback
sys.path[:0] = [sys.argv[1], sys.argv[2]]
failed = {}
for name in sys.argv[3:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc().strip().splitlines()[-1]
print(json.dumps(failed))
"""
PLANTS = {
    "str.removeprefix": (
        "def f(name):\n    return name.removeprefix('x')\n",
        "method",
        ".removeprefix needs Python 3.9",
    ),
    "dict |": ("def f(a):\n    return a | {'b': 1}\n", "method", "| on a dict needs Python 3.9"),
    "match": ("def f(v):\n    match v:\n        case 1:\n            return 2\n", "compile", "line 4: invalid syntax"),
    "parenthesized with": (
        "def f(a, b):\n    with (open(a) as x,\n          open(b) as y):\n        pass\n",
        "compile",
        "",
    ),
    "functools.cache": ("import functools\n\n@functools.cache\ndef f():\n    pass\n", "vermin", "functools.cache"),
    "zoneinfo": ("import zoneinfo\n", "vermin", "zoneinfo"),
    "zip strict": ("def f(a, b):\n    return zip(a, b, strict=True)\n", "vermin", "strict"),
}


@pytest.fixture(scope="module")
def oldest() -> str:
    return pythons.find_python(box_guard.OLDEST)


def test_every_module_and_role_script_is_either_box_or_controller_side() -> None:
    modules = {path.stem for path in (REPO / "plugins" / "modules").glob("*.py")}
    assert modules == set(box_guard.BOX_MODULES) | set(box_guard.CONTROLLER_MODULES)
    assert not set(box_guard.BOX_MODULES) & set(box_guard.CONTROLLER_MODULES)
    scripts = {str(path.relative_to(REPO)) for path in REPO.glob("roles/*/files/*.py")}
    assert scripts == set(box_guard.BOX_ROLE_FILES) | set(box_guard.CONTROLLER_ROLE_FILES)


def test_the_box_side_needs_nothing_newer_than_the_oldest_box_python(oldest: str) -> None:
    files = box_guard.box_files()
    assert len(files) > 80 and all(path.is_file() for path in files)
    assert box_guard.findings(oldest, files) == []


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_the_guard_fails_on_a_planted_newer_feature(plant: str, oldest: str, tmp_path: Path) -> None:
    source, check, message = PLANTS[plant]
    planted = tmp_path / "planted.py"
    planted.write_text("from __future__ import annotations\n\n" + source)
    found = {
        "compile": box_guard.compile_errors(oldest, [planted]),
        "vermin": box_guard.vermin_findings([planted]),
        "method": box_guard.method_findings([planted]),
    }
    assert any(message in line and str(planted) in line for line in found[check]), found
    assert box_guard.findings(oldest, [planted])


def module_names() -> List[str]:
    """Every box module and module_util as Ansible imports it (ansible_collections.remote_gpu.trainer...)."""
    names = []
    for path in box_guard.box_files():
        relative = path.relative_to(REPO)
        if relative.parts[0] == "plugins":
            names.append("ansible_collections.remote_gpu.trainer." + ".".join(relative.with_suffix("").parts))
    return names


@pytest.mark.parametrize("which", ["oldest", "newest"])
def test_every_box_module_imports_under_the_box_pythons(which: str, tmp_path: Path) -> None:
    """Module-level code runs (an alias ``Optional[list[int]]`` or ``int | None`` fails here, not on a box), with
    only ansible.module_utils of the running ansible-core and the standard library, as in an AnsiballZ payload."""
    python = pythons.box_python(which)
    installed = Path(ansible.__file__).parent
    (tmp_path / "ansible").mkdir()
    (tmp_path / "ansible" / "__init__.py").write_text("")
    (tmp_path / "ansible" / "module_utils").symlink_to(installed / "module_utils")
    names = module_names()
    done = subprocess.run(
        [python, "-I", "-c", IMPORT_ALL, str(tmp_path), str(COLLECTIONS), *names],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {}
    assert len(names) > 70
