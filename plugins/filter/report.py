# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters that turn module results into preflight reports: per-host results, one-line summaries, fleet counts.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

from ansible_collections.remote_gpu.trainer.plugins.module_utils._findings import finding, status_of
from ansible_collections.remote_gpu.trainer.plugins.module_utils._findings import worst_status as _worst_of_levels

UNREACHABLE = "UNREACHABLE"
STATUSES = ("PASS", "WARN", "FAIL", UNREACHABLE)
# A renter cannot fix these on a rented box: the only remedy is another box.
RE_RENT_ACTIONS = ("re_rent", "reset_gpu")
EXIT_OK = 0
EXIT_FAILED = 2
EXIT_UNREACHABLE = 4
# Not an exit code ansible-playbook uses itself (0, 1, 2, 4, 5, 99, 250), so it cannot be mistaken for a verdict.
EXIT_REPORT_NOT_WRITTEN = 3
# A check that could not run: not knowing the GPU or the disks is a FAIL, not knowing about zombies a WARN.
CHECK_FAILURE_LEVELS = {"gpu_health": "FAIL", "box_health": "FAIL", "vram_zombies": "WARN"}
ZOMBIE_FACTS = ("status", "holders", "candidates", "killed", "failed", "kill_refused")
# The box names its Python and architecture; the controller joins this into a cache path, so nothing else passes.
WHEEL_TAG = re.compile(r"\Apy\d+\.\d+-[A-Za-z0-9_]+\Z")
MESSAGE_CHARS = 300


def worst_status(items: Iterable[Any]) -> str:
    """Worst of PASS / WARN / FAIL among levels, findings (``level``) or results (``status``)."""
    if isinstance(items, (str, Mapping)):
        raise AnsibleFilterError("worst_status expects a list of levels, findings or results")
    levels = []
    for item in items:
        if isinstance(item, Mapping):
            levels.append(item.get("level", item.get("status", "PASS")))
        else:
            levels.append(str(item))
    return _worst_of_levels(levels)


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


def _check_findings(name: str, result: Optional[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The check's own findings, or one ``check_failed`` finding when the module itself failed."""
    if not result or result.get("skipped"):
        return []
    if not _ran(result):
        reason = _reason(result)
        return [
            finding(
                "check_failed", CHECK_FAILURE_LEVELS[name], f"{name} could not run: {reason}", "investigate", check=name
            )
        ]
    return list(result.get("findings", []))


def _gpu_model(gpus: List[Mapping[str, Any]]) -> Optional[str]:
    names = sorted({str(gpu.get("name")) for gpu in gpus if gpu.get("name")})
    return " + ".join(names) if names else None


def preflight_result(
    host: str,
    gpu_health: Optional[Mapping[str, Any]] = None,
    box_health: Optional[Mapping[str, Any]] = None,
    vram_zombies: Optional[Mapping[str, Any]] = None,
    errors: Optional[List[Mapping[str, Any]]] = None,
) -> Dict[str, Any]:
    """One host's preflight result from the registered module results (missing ones are skipped)."""
    checks = {"gpu_health": gpu_health, "box_health": box_health, "vram_zombies": vram_zombies}
    findings: List[Dict[str, Any]] = []
    for name, check in checks.items():
        findings.extend(_check_findings(name, check))
    findings.extend(errors or [])
    gpu_health = _usable(gpu_health)
    box_health = _usable(box_health)
    zombies = _usable(vram_zombies)
    gpus = list(gpu_health.get("gpus", []))
    return {
        "host": host,
        "reachable": True,
        "status": status_of(findings),
        "gpu_model": _gpu_model(gpus),
        "gpu_count": len(gpus),
        "findings": findings,
        "facts": {
            "gpu": {key: gpu_health.get(key) for key in ("backend", "driver_version", "cuda_version", "gpus")},
            "disk": box_health.get("facts", {}).get("disk", {}),
            "memory": box_health.get("facts", {}).get("memory", {}),
            "vram_zombies": {key: zombies.get(key) for key in ZOMBIE_FACTS},
        },
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


def unreachable_result(host: str, reason: str = "host unreachable") -> Dict[str, Any]:
    """The result recorded for a host that never answered."""
    return {"host": host, "reachable": False, "status": UNREACHABLE, "error": reason, "findings": []}


def fleet_results(hostnames: Iterable[str], hostvars: Mapping[str, Any], key: str = "preflight_result") -> List[Any]:
    """Every host's result in ``hostvars``; a host without one never answered (or stopped before its checks)."""
    results = []
    for host in hostnames:
        host_vars = hostvars.get(host, {})
        if key in host_vars:
            results.append(host_vars[key])
        else:
            results.append(unreachable_result(host, "unreachable, or stopped before its checks ran"))
    return results


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


def _needs_new_box(result: Mapping[str, Any]) -> bool:
    return any(f.get("level") == "FAIL" and f.get("action") in RE_RENT_ACTIONS for f in result.get("findings", []))


def fleet_summary(results: Iterable[Mapping[str, Any]], report_error: str = "") -> Dict[str, Any]:
    """Counts per status, hosts to re-rent, unreachable hosts, the wrapper's exit code and one summary line.

    With ``report_error`` (why the report could not be written) the exit code is ``EXIT_REPORT_NOT_WRITTEN``.
    """
    results = list(results)
    counts = dict.fromkeys(STATUSES, 0)
    by_status: Dict[str, List[str]] = {status: [] for status in STATUSES}
    re_rent = []
    for result in results:
        status = result.get("status", "PASS") if result.get("reachable", True) else UNREACHABLE
        if status not in counts:
            raise AnsibleFilterError(f"fleet_summary: host {result.get('host')!r} has unknown status {status!r}")
        counts[status] += 1
        by_status[status].append(result.get("host"))
        if status == "FAIL" and _needs_new_box(result):
            re_rent.append(result.get("host"))
    if counts["FAIL"]:
        exit_code = EXIT_FAILED
    elif counts[UNREACHABLE]:
        exit_code = EXIT_UNREACHABLE
    else:
        exit_code = EXIT_OK
    if report_error:
        exit_code = EXIT_REPORT_NOT_WRITTEN
    line = f"{len(results)} hosts: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s] or s != UNREACHABLE)
    if re_rent:
        line += f"; re-rent: {', '.join(re_rent)}"
    other_fail = [host for host in by_status["FAIL"] if host not in re_rent]
    if other_fail:
        line += f"; fix before launch: {', '.join(other_fail)}"
    if by_status[UNREACHABLE]:
        line += f"; unreachable: {', '.join(by_status[UNREACHABLE])}"
    summary = {
        "hosts": len(results),
        "counts": counts,
        "status": "FAIL" if counts["FAIL"] else (UNREACHABLE if counts[UNREACHABLE] else worst_status(results)),
        "exit_code": exit_code,
        "re_rent": re_rent,
        "failed": by_status["FAIL"],
        "warned": by_status["WARN"],
        "unreachable": by_status[UNREACHABLE],
        "line": line,
    }
    if report_error:
        summary["report_error"] = report_error
    return summary


class FilterModule:
    """Preflight report filters."""

    def filters(self) -> Dict[str, Any]:
        return {
            "worst_status": worst_status,
            "preflight_result": preflight_result,
            "unreachable_result": unreachable_result,
            "fleet_results": fleet_results,
            "preflight_line": preflight_line,
            "fleet_summary": fleet_summary,
            "preflight_runtime": preflight_runtime,
            "report_written_or_exit": report_written_or_exit,
        }
