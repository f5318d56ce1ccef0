# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Fleet-level filters: the worst status, every targeted host's result, the fleet summary and its exit code.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import (
    worst_status as _worst_of_levels,
)

UNREACHABLE = "UNREACHABLE"
STATUSES = ("PASS", "WARN", "FAIL", UNREACHABLE)
# A renter cannot fix these on a rented box: the only remedy is another box.
RE_RENT_ACTIONS = ("re_rent", "reset_gpu")
EXIT_OK = 0
EXIT_FAILED = 2
EXIT_UNREACHABLE = 4
# Not an exit code ansible-playbook uses itself (0, 1, 2, 4, 5, 99, 250), so it cannot be mistaken for a verdict.
EXIT_REPORT_NOT_WRITTEN = 3


def hosts_or_exit(hosts: str, exit_code: Any, *, playbook: str, nothing_worse: str) -> str:
    """``hosts`` unchanged when the exit code is 0 or 2 (the last play then fails the boxes that set 2), else end
    ansible-playbook at once: 4 (unreachable boxes, ``nothing_worse``) or 3 (the report was not written; also for
    a code that is not a number). For a last play's ``hosts:``, which ansible-playbook templates in its own process.
    """
    try:
        code = int(exit_code)
    except (TypeError, ValueError):
        code = EXIT_REPORT_NOT_WRITTEN
    if code in (EXIT_OK, EXIT_FAILED):
        return hosts
    if code == EXIT_UNREACHABLE:
        Display().warning(f"{playbook}: unreachable boxes and {nothing_worse}; exit code {EXIT_UNREACHABLE}")
        sys.exit(EXIT_UNREACHABLE)
    Display().error(f"the {playbook} report could not be written; exit code {EXIT_REPORT_NOT_WRITTEN}")
    sys.exit(EXIT_REPORT_NOT_WRITTEN)


def worst_status(items: Iterable[Any]) -> str:
    """Worst of PASS / WARN / FAIL among levels, findings (``level``) or results (``status``); others raise."""
    if isinstance(items, (str, Mapping)):
        raise AnsibleFilterError("worst_status expects a list of levels, findings or results")
    levels = []
    for item in items:
        if isinstance(item, Mapping):
            levels.append(item.get("level", item.get("status", "PASS")))
        else:
            levels.append(str(item))
    try:
        return _worst_of_levels(levels)
    except ValueError as error:
        raise AnsibleFilterError(f"worst_status: {error}") from None


def unreachable_result(host: str, reason: str = "host unreachable") -> Dict[str, Any]:
    """The result recorded for a host that never answered."""
    return {"host": host, "reachable": False, "status": UNREACHABLE, "error": reason, "findings": []}


def fleet_results(
    hostnames: Iterable[str],
    hostvars: Mapping[str, Any],
    key: str = "preflight_result",
    reason: str = "unreachable, or stopped before its checks ran",
) -> List[Any]:
    """Every host's result in ``hostvars``; a host without one never answered (or stopped before its checks).

    Such a host gets ``unreachable_result(host, reason)``. Shared by the preflight and the launch reports.
    """
    return [
        hostvars.get(host, {})[key] if key in hostvars.get(host, {}) else unreachable_result(host, reason)
        for host in hostnames
    ]


def _needs_new_box(result: Mapping[str, Any]) -> bool:
    return any(f.get("level") == "FAIL" and f.get("action") in RE_RENT_ACTIONS for f in result.get("findings", []))


def _status_of(record: Mapping[str, Any], default: str) -> str:
    return record.get("status", default) if record.get("reachable", True) else UNREACHABLE


def tally_statuses(
    records: Sequence[Mapping[str, Any]], statuses: Sequence[str], filter_name: str, default: str = ""
) -> Tuple[Dict[str, int], Dict[str, List[Any]]]:
    """Count the records per status (an unreachable one as ``UNREACHABLE``) and list each status's hosts.

    A status outside ``statuses`` raises, naming ``filter_name`` and the host. Shared by the fleet summaries of
    preflight and launch.
    """
    counts = dict.fromkeys(statuses, 0)
    by_status: Dict[str, List[Any]] = {status: [] for status in statuses}
    for record in records:
        status = _status_of(record, default)
        if status not in counts:
            raise AnsibleFilterError(f"{filter_name}: host {record.get('host')!r} has unknown status {status!r}")
        counts[status] += 1
        by_status[status].append(record.get("host"))
    return counts, by_status


def summary_exit_code(counts: Mapping[str, int], failed: Sequence[str], report_error: str = "") -> int:
    """The wrapper's exit code: report not written, else a host in a ``failed`` status, else unreachable, else 0."""
    if report_error:
        return EXIT_REPORT_NOT_WRITTEN
    if any(counts.get(status) for status in failed):
        return EXIT_FAILED
    if counts.get(UNREACHABLE):
        return EXIT_UNREACHABLE
    return EXIT_OK


def with_report_error(summary: Dict[str, Any], report_error: str) -> Dict[str, Any]:
    """``summary`` with ``report_error`` (why the report could not be written) added when there is one."""
    if report_error:
        summary["report_error"] = report_error
    return summary


def fleet_summary(results: Iterable[Mapping[str, Any]], report_error: str = "") -> Dict[str, Any]:
    """Counts per status, hosts to re-rent, unreachable hosts, the wrapper's exit code and one summary line.

    With ``report_error`` (why the report could not be written) the exit code is ``EXIT_REPORT_NOT_WRITTEN``.
    """
    results = list(results)
    counts, by_status = tally_statuses(results, STATUSES, "fleet_summary", default="PASS")
    re_rent = [
        result.get("host") for result in results if _status_of(result, "PASS") == "FAIL" and _needs_new_box(result)
    ]
    exit_code = summary_exit_code(counts, ("FAIL",), report_error)
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
    return with_report_error(summary, report_error)


class FilterModule:
    """Fleet-level report filters."""

    def filters(self) -> Dict[str, Any]:
        return {
            "worst_status": worst_status,
            "unreachable_result": unreachable_result,
            "fleet_results": fleet_results,
            "fleet_summary": fleet_summary,
        }
