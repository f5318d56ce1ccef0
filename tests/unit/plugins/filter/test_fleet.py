"""Fleet filters: the worst status, every host's result, the fleet summary and its exit code."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter import fleet, preflight
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding

XID79 = finding("xid_hardware", "FAIL", "Xid 79 on GPU 0: fallen off the bus", "re_rent", gpu=0, xid=79)
NO_KLOG = finding("kernel_log_unreadable", "WARN", "dmesg: Operation not permitted", "investigate")
DISK_FULL = finding("disk_low", "FAIL", "data fs /data: bytes 99% used", "free_disk", path="/data")


def host(name, *findings):
    """A reachable host's result with these findings."""
    check = {"check": "gpu_health", "level_if_failed": "FAIL", "result": {"status": "PASS", "findings": list(findings)}}
    return preflight.preflight_result(name, [check])


def test_worst_status_accepts_levels_findings_and_results():
    assert fleet.worst_status([]) == "PASS"
    assert fleet.worst_status(["PASS", "WARN"]) == "WARN"
    assert fleet.worst_status([NO_KLOG, XID79]) == "FAIL"
    assert fleet.worst_status([{"status": "WARN"}, {"status": "PASS"}]) == "WARN"
    with pytest.raises(AnsibleFilterError):
        fleet.worst_status("FAIL")


def test_fleet_results_fills_in_hosts_without_a_result():
    ok = host("a")
    hostvars = {"a": {"preflight_result": ok, "other": 1}, "b": {"other": 2}}
    results = fleet.fleet_results(["a", "b", "c"], hostvars)
    assert results[0] == ok
    assert [(r["host"], r["status"]) for r in results[1:]] == [("b", "UNREACHABLE"), ("c", "UNREACHABLE")]
    assert results[1]["error"] == "unreachable, or stopped before its checks ran"
    assert fleet.fleet_results(["b"], hostvars, "other", reason="why")[0] == 2
    assert fleet.fleet_results(["c"], hostvars, reason="why")[0]["error"] == "why"


def test_the_shared_summary_helpers():
    records = [{"host": "a", "status": "OK"}, {"host": "b", "reachable": False}, {"host": "c"}]
    counts, by_status = fleet.tally_statuses(records, ("OK", "BAD", "UNREACHABLE"), "x_summary", default="OK")
    assert counts == {"OK": 2, "BAD": 0, "UNREACHABLE": 1}
    assert by_status == {"OK": ["a", "c"], "BAD": [], "UNREACHABLE": ["b"]}
    with pytest.raises(AnsibleFilterError, match="x_summary: host 'c' has unknown status ''"):
        fleet.tally_statuses(records, ("OK", "UNREACHABLE"), "x_summary")
    assert fleet.summary_exit_code(counts, ("BAD",)) == fleet.EXIT_UNREACHABLE
    assert fleet.summary_exit_code({**counts, "BAD": 1}, ("BAD",)) == fleet.EXIT_FAILED
    assert fleet.summary_exit_code({"OK": 3}, ("BAD",)) == fleet.EXIT_OK
    assert fleet.summary_exit_code({"BAD": 1}, ("BAD",), "disk full") == fleet.EXIT_REPORT_NOT_WRITTEN
    assert fleet.with_report_error({"line": "x"}, "") == {"line": "x"}
    assert fleet.with_report_error({"line": "x"}, "disk full") == {"line": "x", "report_error": "disk full"}


def a_fleet():
    return [
        host("ok"),
        host("warm", NO_KLOG),
        host("dead", XID79),
        host("full", DISK_FULL),
        fleet.unreachable_result("gone"),
    ]


def test_fleet_summary_counts_and_exit_code():
    summary = fleet.fleet_summary(a_fleet())
    assert summary["counts"] == {"PASS": 1, "WARN": 1, "FAIL": 2, "UNREACHABLE": 1}
    assert summary["hosts"] == 5
    assert summary["re_rent"] == ["dead"]
    assert summary["failed"] == ["dead", "full"]
    assert summary["warned"] == ["warm"]
    assert summary["unreachable"] == ["gone"]
    assert summary["exit_code"] == 2
    assert summary["status"] == "FAIL"
    assert summary["line"] == (
        "5 hosts: 1 PASS, 1 WARN, 2 FAIL, 1 UNREACHABLE; re-rent: dead; fix before launch: full; unreachable: gone"
    )


def test_fleet_summary_exit_codes_follow_the_contract():
    results = a_fleet()
    assert fleet.fleet_summary(results[:2])["exit_code"] == 0
    assert fleet.fleet_summary(results[:2])["status"] == "WARN"
    only_unreachable = fleet.fleet_summary([results[0], results[4]])
    assert (only_unreachable["exit_code"], only_unreachable["status"]) == (4, "UNREACHABLE")
    assert fleet.fleet_summary([])["line"] == "0 hosts: 0 PASS, 0 WARN, 0 FAIL"


def test_fleet_summary_exit_code_when_the_report_could_not_be_written():
    unreported = fleet.fleet_summary(a_fleet()[:2], "Write the JSON report: Permission denied")
    assert unreported["exit_code"] == fleet.EXIT_REPORT_NOT_WRITTEN
    assert unreported["report_error"] == "Write the JSON report: Permission denied"
    assert unreported["counts"]["PASS"] == 1
    assert "report_error" not in fleet.fleet_summary(a_fleet()[:2])


def test_fleet_summary_rejects_unknown_status():
    with pytest.raises(AnsibleFilterError, match="bogus"):
        fleet.fleet_summary([{"host": "x", "status": "bogus"}])


def test_filters_are_registered():
    filters = {**fleet.FilterModule().filters(), **preflight.FilterModule().filters()}
    assert set(filters) == {
        "worst_status",
        "preflight_result",
        "unreachable_result",
        "fleet_results",
        "preflight_line",
        "fleet_summary",
        "preflight_runtime",
        "report_written_or_exit",
        "finding",
    }


def test_worst_status_refuses_a_status_that_is_not_a_level():
    with pytest.raises(AnsibleFilterError, match="candidates"):
        fleet.worst_status(["PASS", "candidates"])
    with pytest.raises(AnsibleFilterError, match="candidates"):
        fleet.worst_status([{"status": "candidates", "findings": []}])
