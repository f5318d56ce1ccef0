"""The static guard of the box side: nothing that runs on a rented box may need a Python newer than the oldest box
Python (3.8 under ansible-core 2.19).

    python tests/compat/box_guard.py [--python PATH]    every finding, one a line; exit 1 when there is one

Three checks over ``box_files()``, each catching what the others cannot:
  * ``compile_errors``: the oldest box Python itself compiles every file (``match``, parenthesized context
    managers, ``except*``, any syntax it lacks);
  * ``vermin_findings``: vermin, the stdlib modules, members and keyword arguments newer than 3.8
    (``functools.cache``, ``zoneinfo``, ``zip(strict=)``), annotations left out: every file postpones them;
  * ``method_findings``: methods of builtin types that vermin cannot see on an untyped receiver
    (``name.removeprefix(...)``) and ``|`` on a dict display.
Module-level runtime use (``list[int]`` or ``X | Y`` in an alias or a default) fails the import test in
tests/unit/compat/test_box_guard.py, which imports every box module under the oldest and newest box Python.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parents[2]
# The oldest box Python of any ansible-core the collection supports (pythons.TARGET_PYTHONS), whichever ansible-core
# runs the tests: a box module must still run on it under the oldest supported controller.
OLDEST = "3.8"
# Modules whose code runs on the box; the others only carry the documentation of an action plugin (controller).
BOX_MODULES = (
    "box_health", "box_lease", "copy_verify", "gpu_health", "load_verify", "meter_stop", "patrol_facts", "run_archive",
    "run_scratch", "teardown_gate", "training_run", "vram_zombies",
)  # fmt: skip
CONTROLLER_MODULES = ("launch", "patrol", "stage_report", "stage_verdict", "teardown")
# roles/*/files scripts: sent to the box (ansible.builtin.script with the box Python), or run on the controller.
BOX_ROLE_FILES = ("roles/runtime/files/runtime_install.py", "roles/runtime/files/runtime_probe.py")
CONTROLLER_ROLE_FILES = ("roles/runtime/files/build_wheelhouse.py",)
# Test programs the Molecule scenarios run on boxes with the box Python (the job and the artifact loader): a
# failure there would read as the collection's.
BOX_TEST_FILES = ("tests/workload/fake_train.py", "tests/workload/load_check.py")
# Methods of builtin types (str, bytes, int, pathlib.Path) newer than 3.8, by name: the receiver's type is unknown
# statically, and these names mean nothing else here.
NEW_METHODS = {
    "removeprefix": "3.9",
    "removesuffix": "3.9",
    "is_relative_to": "3.9",
    "with_stem": "3.9",
    "bit_count": "3.10",
    "hardlink_to": "3.10",
}
VERMIN_MAIN = "import sys; from vermin import main; sys.argv[0] = 'vermin'; sys.exit(main())"  # no __main__
COMPILE_ALL = """
import json, sys
errors = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as handle:
            compile(handle.read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        errors[path] = "line %s: %s" % (exc.lineno, exc.msg)
print(json.dumps(errors))
"""


def box_files(repo: Path = REPO) -> list[Path]:
    """Every Python file of this checkout that runs on a box."""
    files = [repo / "plugins" / "modules" / f"{name}.py" for name in BOX_MODULES]
    files += sorted((repo / "plugins" / "module_utils").rglob("*.py"))
    files += [repo / path for path in (*BOX_ROLE_FILES, *BOX_TEST_FILES)]
    return [path for path in files if "__pycache__" not in path.parts]


def compile_errors(python: str, files: Sequence[Path]) -> list[str]:
    """Files the interpreter at ``python`` cannot compile, as 'path: line N: message'."""
    done = subprocess.run(
        [python, "-I", "-c", COMPILE_ALL, *map(str, files)], check=False, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        return [f"{python}: compiling failed: {done.stderr.strip()[-500:]}"]
    return [f"{path}: {message}" for path, message in sorted(json.loads(done.stdout).items())]


def vermin_findings(files: Sequence[Path], target: str = OLDEST) -> list[str]:
    """vermin's violations of ``target`` (none when the files need at most that version)."""
    done = subprocess.run(
        [sys.executable, "-c", VERMIN_MAIN, "--no-tips", "--violations", "--no-make-paths-absolute",
         f"--target={target}-", "--processes=1", *map(str, files)],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if "No module named 'vermin'" in done.stderr:
        return ["vermin is not installed: pip install -r requirements-dev.txt (vermin is in it)"]
    if done.returncode == 0:
        return []
    found, path = [], ""
    for line in done.stdout.splitlines():
        if line.startswith("!"):  # "!2, 3.9      path", then its violations indented
            path = line.split(maxsplit=2)[-1]
        elif line.startswith("  ") and path:
            found.append(f"{path}: {line.strip()}")
    return found or [f"vermin exited {done.returncode}: {(done.stdout + done.stderr).strip()[-500:]}"]


def _method_findings_in(path: Path) -> Iterable[str]:
    tree = ast.parse(path.read_bytes(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in NEW_METHODS:
            yield f"{path}:{node.lineno}: .{node.attr} needs Python {NEW_METHODS[node.attr]}"
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.BitOr):
            operands = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            if any(isinstance(operand, (ast.Dict, ast.DictComp)) for operand in operands):
                yield f"{path}:{node.lineno}: | on a dict needs Python 3.9"


def method_findings(files: Sequence[Path]) -> list[str]:
    return [finding for path in files for finding in _method_findings_in(path)]


def findings(python: str, files: Sequence[Path]) -> list[str]:
    return compile_errors(python, files) + vermin_findings(files) + method_findings(files)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", help=f"the oldest box Python (default: Python {OLDEST}, found by pythons.py)")
    args = parser.parse_args(argv)
    if args.python is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from pythons import PythonNotFound, find_python  # noqa: PLC0415 - the script's own folder, once

        try:
            args.python = find_python(OLDEST)
        except PythonNotFound as exc:
            print(f"box_guard: {exc}", file=sys.stderr)
            return 1
    found = findings(args.python, box_files())
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
