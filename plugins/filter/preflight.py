# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Preflight filters: one host's result from its checks, its report line, the runtime probe, findings.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
The filters know no module by name: the role says which checks ran, how a failure of each counts and which of
their facts the report keeps.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

from ansible_collections.remote_gpu.trainer.plugins.filter.fleet import EXIT_REPORT_NOT_WRITTEN, UNREACHABLE
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding, status_of

# The box names its Python and architecture; the controller joins this into a cache path, so nothing else passes.
WHEEL_TAG = re.compile(r"\Apy\d+\.\d+-[A-Za-z0-9_]+\Z")
MESSAGE_CHARS = 300


def finding_filter(code: str, level: str, message: str, action: str, gpu: Optional[int] = None, **measured: Any):
    """One finding built and checked by module_utils' ``finding()``; the message is made one bounded line."""
    line = " ".join(str(message).split())
    if len(line) > MESSAGE_CHARS:
        line = line[: MESSAGE_CHARS - 3] + "..."
    try:
        return finding(str(code), str(level), line, str(action), gpu=gpu, **measured)
    except ValueError as error:
        raise AnsibleFilterError(f"finding {code!r}: {error}") from None


def _ran(result: Optional[Mapping[str, Any]]) -> bool:
    """Whether the module itself ran to the end. The role registers checks under ``failed_when: false``, which
    turns ``failed`` false, so the module's own answer decides: every check module returns a ``status``."""
    return bool(result) and not result.get("failed") and "status" in result


def _usable(result: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
    """A registered result with data in it: skipped and failed tasks count as absent."""
    if not result or result.get("skipped") or not _ran(result):
        return {}
    return result


def _reason(result: Mapping[str, Any]) -> str:
    """The first line of why a task failed: its message, else what the module printed on stderr."""
    for key in ("msg", "module_stderr", "stderr"):
        lines = str(result.get(key) or "").strip().splitlines()
        if lines:
            return lines[0][:MESSAGE_CHARS]
    return "no message"


def _check(entry: Any) -> Mapping[str, Any]:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("check"), str):
        raise AnsibleFilterError(f"preflight_result: a check is {{check, level_if_failed, result}}, not {entry!r}")
    return entry


def _check_findings(check: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The check's own findings, or one ``check_failed`` finding (at its ``level_if_failed``) when it failed."""
    result = check.get("result")
    if not result or result.get("skipped"):
        return []
    if not _ran(result):
        name = check["check"]
        message = f"{name} could not run: {_reason(result)}"
        return [finding_filter("check_failed", check.get("level_if_failed"), message, "investigate", check=name)]
    return list(result.get("findings", []))


def _kept_facts(result: Mapping[str, Any], keep: Any) -> Any:
    """A list of keys keeps those keys of the result; a dotted path keeps what is there (``{}`` when absent)."""
    if isinstance(keep, str):
        value: Any = result
        for key in keep.split("."):
            value = value.get(key, {}) if isinstance(value, Mapping) else {}
        return value
    return {key: result.get(key) for key in keep}


def _gpu_model(gpus: List[Mapping[str, Any]]) -> Optional[str]:
    names = sorted({str(gpu.get("name")) for gpu in gpus if gpu.get("name")})
    return " + ".join(names) if names else None


def preflight_result(
    host: str, checks: Iterable[Any], errors: Optional[List[Mapping[str, Any]]] = None
) -> Dict[str, Any]:
    """One host's preflight result from its checks (``{check, level_if_failed, result, facts}`` each)."""
    if isinstance(checks, (str, Mapping)):
        raise AnsibleFilterError("preflight_result expects a list of checks")
    findings: List[Dict[str, Any]] = []
    facts: Dict[str, Any] = {}
    gpus: List[Mapping[str, Any]] = []
    for check in map(_check, checks):
        findings.extend(_check_findings(check))
        result = _usable(check.get("result"))
        gpus.extend(result.get("gpus") or [])
        for name, keep in (check.get("facts") or {}).items():
            facts[name] = _kept_facts(result, keep)
    findings.extend(errors or [])
    return {
        "host": host,
        "reachable": True,
        "status": status_of(findings),
        "gpu_model": _gpu_model(gpus),
        "gpu_count": len(gpus),
        "findings": findings,
        "facts": facts,
    }


def _probe_failed(message: str) -> Dict[str, Any]:
    return {
        "ok": False,
        "wheel_tag": None,
        "ready": False,
        "data_dir_usable": False,
        "data_dir_problem": None,
        "findings": [finding("runtime_probe_failed", "FAIL", message[:MESSAGE_CHARS], "investigate")],
    }


def _bad_probe_field(answer: Mapping[str, Any]) -> Optional[str]:
    """Why the probe's answer cannot be trusted, or None: every field the controller uses is checked."""
    tag = answer.get("wheel_tag")
    if not isinstance(tag, str) or not WHEEL_TAG.match(tag):
        return f"invalid wheel_tag {str(tag)[:80]!r} (expected py<major>.<minor>-<machine>)"
    if not isinstance(answer.get("ready"), bool):
        return f"invalid ready {str(answer.get('ready'))[:40]!r} (expected true or false)"
    data_dir = answer.get("data_dir")
    if (
        not isinstance(data_dir, Mapping)
        or not isinstance(data_dir.get("usable"), bool)
        or not isinstance(data_dir.get("problem"), (str, type(None)))
    ):
        return f"invalid data_dir {str(data_dir)[:80]!r} (expected usable: bool, problem: string or null)"
    return None


def preflight_runtime(probe: Mapping[str, Any]) -> Dict[str, Any]:
    """The runtime probe's answer, validated before the controller uses any of it (the box is untrusted).

    ``ok`` false (with one ``runtime_probe_failed`` finding) when the probe did not run, did not answer a JSON
    object, or answered a field the controller cannot trust; then nothing is built, copied or checked for the box.
    """
    if not isinstance(probe, Mapping) or probe.get("skipped"):
        return _probe_failed("the runtime probe did not run")
    if probe.get("rc") != 0 or "stdout" not in probe:
        # A Python that started and crashed says why on its last stderr line; one that never ran, in msg.
        stderr = str(probe.get("stderr") or "").strip().splitlines()
        reason = stderr[-1][:MESSAGE_CHARS] if stderr else _reason(probe)
        return _probe_failed(f"could not run the box's Python: {reason}")
    try:
        answer = json.loads(probe["stdout"])
    except ValueError:
        answer = None
    if not isinstance(answer, Mapping):
        return _probe_failed(f"the runtime probe did not answer a JSON object: {str(probe['stdout'])[:80]!r}")
    problem = _bad_probe_field(answer)
    if problem:
        return _probe_failed(f"the runtime probe answered {problem}")
    return {
        "ok": True,
        "wheel_tag": answer["wheel_tag"],
        "ready": answer["ready"],
        "data_dir_usable": answer["data_dir"]["usable"],
        "data_dir_problem": answer["data_dir"]["problem"],
        "findings": [],
    }


def report_written_or_exit(hosts: str, report_error: str) -> str:
    """``hosts`` unchanged, or end ansible-playbook with ``EXIT_REPORT_NOT_WRITTEN`` when the report failed.

    Meant for a play's ``hosts:`` (templated in ansible-playbook's own process): tasks can only end a run with
    ansible's own codes, 2 for a failed host, which would read as "a box FAILed" for an all-PASS fleet.
    """
    if not report_error:
        return hosts
    Display().error(f"the preflight report could not be written ({report_error}); exit code {EXIT_REPORT_NOT_WRITTEN}")
    sys.exit(EXIT_REPORT_NOT_WRITTEN)


def _ordered(findings: Iterable[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """FAIL before WARN, then in the order found (the modules report the most telling finding first)."""
    return sorted(findings, key=lambda f: 0 if f.get("level") == "FAIL" else 1)


def preflight_line(result: Mapping[str, Any], max_findings: int = 3) -> str:
    """One compact line: host, status, GPU model and count, the worst findings with their actions."""
    host = result.get("host", "?")
    status = result.get("status", "PASS")
    if status == UNREACHABLE or not result.get("reachable", True):
        return f"{host}  {UNREACHABLE}  {result.get('error') or 'host unreachable'}  -> re_rent or check the console"
    count = result.get("gpu_count") or 0
    gpus = f"{count}x {result['gpu_model']}" if result.get("gpu_model") else "no GPU seen"
    parts = []
    for item in _ordered(result.get("findings", []))[:max_findings]:
        where = f"@gpu{item['gpu']}" if item.get("gpu") is not None else ""
        parts.append(f"{item['code']}{where} -> {item['action']}")
    hidden = len(result.get("findings", [])) - len(parts)
    if hidden > 0:
        parts.append(f"+{hidden} more")
    return f"{host}  {status}  {gpus}" + (f"  {'; '.join(parts)}" if parts else "")


class FilterModule:
    """Preflight report filters."""

    def filters(self) -> Dict[str, Any]:
        return {
            "finding": finding_filter,
            "preflight_result": preflight_result,
            "preflight_line": preflight_line,
            "preflight_runtime": preflight_runtime,
            "report_written_or_exit": report_written_or_exit,
        }
