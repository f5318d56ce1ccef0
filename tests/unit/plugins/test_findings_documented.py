"""Every finding code the collection can emit is documented, in the findings contract or in docs/findings.md.

Codes are collected from the source, not from a list kept by hand: in plugins/**/*.py, the string constant that is
the code of a call to a finding builder (``finding``, ``_finding``, ``finding_filter``, ``kernel_log_finding``), is
assigned to a variable named ``code``, or is the value of a ``"code"`` key in a dict literal; in roles/**/*.yml, the
value of a ``code:`` key, a Jinja dict literal's ``'code': '...'`` and ``'...' | remote_gpu.trainer.finding(...)``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, Set

import yaml

from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES, REPO

CONTRACT = CAPTURES.parent / "contracts" / "findings.md"
OUR_CODES = REPO / "docs" / "findings.md"
# A builder of one finding, not a function returning several (``disk_findings(label, ...)``).
FINDING_BUILDER = re.compile(r"(^|_)finding(_|$)")
JINJA_CODES = (
    re.compile(r"""['"]code['"]\s*:\s*['"]([a-z][a-z0-9_]*)['"]"""),
    re.compile(r"""['"]([a-z][a-z0-9_]*)['"]\s*\|\s*(?:[\w.]+\.)?finding\b"""),
)
DOCUMENTED_CODE = re.compile(r"`([a-z][a-z0-9_]*)`")


def _strings(node: ast.AST) -> Iterator[str]:
    """The string constants an expression can evaluate to: a constant, or either branch of ``a if c else b``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def codes_in_python(source: str) -> Set[str]:
    codes: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and FINDING_BUILDER.search(_callee(node)):
            code_args = node.args[:1] + [kw.value for kw in node.keywords if kw.arg == "code"]
            codes.update(code for arg in code_args for code in _strings(arg))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
            codes.update(_strings(node.value))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "code":
                    codes.update(_strings(value))
    return codes


class _AnyTagLoader(yaml.SafeLoader):
    """Reads Ansible's own tags (``!unsafe``, ``!vault``) as plain values."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, _suffix, node: loader.construct_scalar(node))


def codes_in_yaml(text: str) -> Set[str]:
    codes: Set[str] = set()
    pending = list(yaml.load_all(text, Loader=_AnyTagLoader))
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            code = item.get("code")
            if isinstance(code, str) and "{" not in code:
                codes.add(code)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            codes.update(code for pattern in JINJA_CODES for code in pattern.findall(item))
    return codes


def emitted_codes(repo: Path) -> Dict[str, Set[str]]:
    """Each code the collection can emit, with the files that emit it."""
    found: Dict[str, Set[str]] = {}
    sources = [(path, codes_in_python) for path in sorted((repo / "plugins").rglob("*.py"))]
    sources += [(path, codes_in_yaml) for path in sorted((repo / "roles").rglob("*.yml"))]
    for path, scan in sources:
        for code in scan(path.read_text()):
            found.setdefault(code, set()).add(str(path.relative_to(repo)))
    return found


def undocumented(emitted: Dict[str, Set[str]], docs: str) -> Dict[str, Set[str]]:
    documented = set(DOCUMENTED_CODE.findall(docs))
    return {code: files for code, files in emitted.items() if code not in documented}


def test_every_emitted_finding_code_is_documented():
    # The shared contract is found beside the captures (tests/testpaths.py); without it nothing can be checked.
    assert CONTRACT.is_file(), f"findings contract not found at {CONTRACT}: set RGT_CAPTURES to shared/captures"
    emitted = emitted_codes(REPO)
    assert {"dir_unwritable", "xid_unknown", "check_failed", "preflight_error"} <= set(
        emitted
    )  # the scanner sees all kinds of source
    missing = undocumented(emitted, CONTRACT.read_text() + OUR_CODES.read_text())
    assert missing == {}, "finding codes documented in neither the contract nor docs/findings.md"


def test_scanner_finds_each_way_a_code_is_written_and_flags_the_undocumented():
    python = """
finding("from_call", "WARN", "m", "none")
_finding(code="from_keyword", level="FAIL")
code = "from_branch_a" if worse else "from_branch_b"
result = {"code": "from_dict", "level": "WARN"}
kernel_log_finding(log)
finding(code, "WARN", "m", "none")
finding_filter("from_filter_call", "WARN", "m", "none")
disk_findings("data", probe, 90, 97, 5)
"""
    roles = """
- name: Record a failure
  ansible.builtin.set_fact:
    errors:
      - code: from_yaml_key
        level: WARN
    expression: "{{ [{'code': 'from_jinja', 'level': 'FAIL'}] }}"
    templated:
      code: "{{ computed_code }}"
    filtered: >-
      {{ ['from_jinja_filter'
         | remote_gpu.trainer.finding('WARN', 'm', 'investigate')] }}
"""
    assert codes_in_python(python) == {
        "from_call",
        "from_keyword",
        "from_branch_a",
        "from_branch_b",
        "from_dict",
        "from_filter_call",
    }
    assert codes_in_yaml(roles) == {"from_yaml_key", "from_jinja", "from_jinja_filter"}
    emitted = {"from_call": {"a.py"}, "from_jinja": {"tasks.yml"}, "nowhere": {"b.py"}}
    docs = "| `from_call` | WARN |\n\nThe `from_jinja` code; nowhere is not quoted.\n"
    assert undocumented(emitted, docs) == {"nowhere": {"b.py"}}
