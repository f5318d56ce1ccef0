# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown filters for the fleet: every targeted host's record, the fleet summary and the playbook's exit code.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter.fleet import (
    UNREACHABLE,
    hosts_or_exit,
    summary_exit_code,
    tally_statuses,
    with_report_error,
)
from ansible_collections.remote_gpu.trainer.plugins.filter.teardown_report import (
    FAILING,
    STATUSES,
    teardown_unreachable,
)


def teardown_results(hostnames: Iterable[str], hostvars: Mapping[str, Any], key: str = "teardown_result") -> List[Any]:
    """Every targeted host's record; a host without one (or with something else under ``key``) never answered."""
    if isinstance(hostnames, (str, Mapping)):
        raise AnsibleFilterError("teardown_results expects a list of host names")
    records = []
    for host in hostnames:
        record = (hostvars.get(host) or {}).get(key)
        ok = isinstance(record, Mapping) and record.get("status") in STATUSES
        records.append(dict(record) if ok else teardown_unreachable(str(host)))
    return records


def teardown_summary(records: Iterable[Mapping[str, Any]], report_error: str = "") -> Dict[str, Any]:
    """Counts per status, the hosts per outcome, the exit code and one line.

    Exit code: 3 when ``report_error`` says the report was not written, else 2 when a host was refused, left
    unconfirmed or failed, else 4 when one is unreachable, else 0.
    """
    if isinstance(records, (str, Mapping)):
        raise AnsibleFilterError("teardown_summary expects a list of teardown records")
    records = [record for record in records if isinstance(record, Mapping)]
    counts, by_status = tally_statuses(records, STATUSES, "teardown_summary")
    exit_code = summary_exit_code(counts, FAILING, report_error)
    line = f"{len(records)} hosts: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    steps = {record.get("host"): record.get("step") for record in records}
    for status in ("REFUSED", "FAILED"):
        if by_status[status]:
            line += f"; {status.lower()}: " + ", ".join(f"{host} ({steps.get(host)})" for host in by_status[status])
    for status in ("UNCONFIRMED", UNREACHABLE):
        if by_status[status]:
            line += f"; {status.lower()}: {', '.join(by_status[status])}"
    summary = {
        "hosts": len(records),
        "counts": {status: count for status, count in counts.items() if count},
        "torn_down": by_status["TORN_DOWN"],
        "checked": by_status["CHECKED"],
        "unconfirmed": by_status["UNCONFIRMED"],
        "refused": by_status["REFUSED"],
        "failed": by_status["FAILED"],
        "unreachable": by_status[UNREACHABLE],
        "changed": [record.get("host") for record in records if record.get("changed")],
        "exit_code": exit_code,
        "line": line if records else "0 hosts",
    }
    return with_report_error(summary, report_error)


def teardown_exit(hosts: str, exit_code: Any) -> str:
    """``hosts`` unchanged when the exit code is 0 or 2 (the enforce play fails the refused, unconfirmed and failed
    boxes, which gives 2), else end ansible-playbook at once with 4 (unreachable boxes, nothing worse) or 3 (the
    report was not written; also for a code that is not a number). Meant for the last play's ``hosts:``.
    """
    return hosts_or_exit(hosts, exit_code, playbook="teardown", nothing_worse="nothing refused or failed")


class FilterModule:
    """Teardown filters for the fleet summary and the exit code."""

    def filters(self) -> Dict[str, Any]:
        return {
            "teardown_results": teardown_results,
            "teardown_summary": teardown_summary,
            "teardown_exit": teardown_exit,
        }
