"""Preflight filters: one host's result from its checks, the compact host line, the runtime probe, findings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter import fleet, preflight
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding

H100 = "NVIDIA H100 80GB HBM3"
# The checks as the preflight role declares them (which module, how its failure counts, which facts it keeps).
ROLE_VARS = Path(__file__).resolve().parents[4] / "roles" / "preflight" / "vars" / "main.yml"
ROLE_CHECKS = yaml.safe_load(ROLE_VARS.read_text())["preflight_checks"]


def host_result(host, gpu=None, box=None, zombies=None, errors=None):
    """preflight_result with the role's check list, given the registered results of its three modules."""
    registered = {"gpu_health": gpu, "box_health": box, "vram_zombies": zombies}
    checks = [dict(check, result=registered[check["check"]]) for check in ROLE_CHECKS]
    return preflight.preflight_result(host, checks, errors)


def gpu_health(findings=(), count=1, name=H100):
    return {
        "status": "PASS",
        "findings": list(findings),
        "backend": "nvml",
        "driver_version": "550.54.15",
        "cuda_version": "12.4",
        "gpus": [{"index": i, "name": name} for i in range(count)],
    }


def box_health(findings=()):
    return {
        "status": "PASS",
        "findings": list(findings),
        "facts": {"disk": {"data": {"path": "/data", "bytes_used_pct": 3.0}}, "memory": {"host_total_mib": 1024}},
    }


XID79 = finding("xid_hardware", "FAIL", "Xid 79 on GPU 0: fallen off the bus", "re_rent", gpu=0, xid=79)
NO_KLOG = finding("kernel_log_unreadable", "WARN", "dmesg: Operation not permitted", "investigate")
DISK_FULL = finding("disk_low", "FAIL", "data fs /data: bytes 99% used", "free_disk", path="/data")


def test_preflight_result_merges_findings_and_facts():
    result = host_result("box1", gpu_health([XID79, NO_KLOG], count=2), box_health([DISK_FULL]))
    assert result["host"] == "box1"
    assert result["status"] == "FAIL"
    assert result["gpu_model"] == H100
    assert result["gpu_count"] == 2
    assert [f["code"] for f in result["findings"]] == ["xid_hardware", "kernel_log_unreadable", "disk_low"]
    assert result["facts"]["gpu"]["backend"] == "nvml"
    assert result["facts"]["disk"]["data"]["path"] == "/data"
    assert result["facts"]["memory"] == {"host_total_mib": 1024}


def test_vram_zombies_findings_and_facts_are_kept():
    warn = finding("vram_zombies", "WARN", "1 zombie VRAM holder: pid 4242", "reap_zombies", pids=[4242])
    zombies = {"status": "candidates", "candidates": [{"pid": 4242}], "killed": [], "failed": [], "findings": [warn]}
    result = host_result("box2", gpu_health(), box_health(), zombies)
    assert result["findings"] == [warn]
    assert result["status"] == "WARN"
    assert result["facts"]["vram_zombies"]["candidates"] == [{"pid": 4242}]
    reaped = {"status": "reaped", "killed": [{"pid": 4242, "signal": "SIGTERM"}], "findings": []}
    assert host_result("box2", gpu_health(), box_health(), reaped)["status"] == "PASS"


def test_preflight_result_with_errors_and_no_gpu_data():
    error = finding("preflight_error", "FAIL", "task 'Bootstrap' failed: no python3", "investigate")
    result = host_result("h", errors=[error])
    assert result["status"] == "FAIL"
    assert result["gpu_count"] == 0
    assert result["gpu_model"] is None


def test_failed_or_skipped_checks():
    crashed = {"failed": True, "msg": "Failed to import the required Python library (pynvml)\nmore"}
    result = host_result("h", crashed, box_health(), {"failed": True, "msg": "psutil missing"})
    assert [(f["code"], f["level"], f["check"]) for f in result["findings"]] == [
        ("check_failed", "FAIL", "gpu_health"),
        ("check_failed", "WARN", "vram_zombies"),
    ]
    assert (
        result["findings"][0]["message"]
        == "gpu_health could not run: Failed to import the required Python library (pynvml)"
    )
    assert result["gpu_count"] == 0
    assert host_result("h", {"skipped": True}, box_health())["status"] == "PASS"


# Registered results of modules that failed under the role's `failed_when: false`, as ansible-core 2.19
# records them: `failed` is false, the module's own `msg` says why, and there is no `status`.
def suppressed_failure(msg, **extra):
    return {
        "changed": False,
        "failed": False,
        "failed_when_result": False,
        "failed_when_suppressed_exception": "(traceback unavailable)",
        "msg": msg,
        **extra,
    }


NVML_MISSING = suppressed_failure(
    "Failed to import the required Python library (nvidia-ml-py) on box's Python /usr/bin/python3. This is required"
    " for backend=nvml (run the preflight role's bootstrap, or use backend=auto)."
)
PSUTIL_MISSING = suppressed_failure(
    "Failed to import the required Python library (psutil) on box's Python /usr/bin/python3."
)


def test_checks_that_failed_under_failed_when_false_are_check_failed():
    result = host_result("h", NVML_MISSING, suppressed_failure("data_dir is required"), PSUTIL_MISSING)
    assert [(f["code"], f["level"], f["check"]) for f in result["findings"]] == [
        ("check_failed", "FAIL", "gpu_health"),
        ("check_failed", "FAIL", "box_health"),
        ("check_failed", "WARN", "vram_zombies"),
    ]
    assert result["status"] == "FAIL"
    assert result["findings"][0]["message"].startswith("gpu_health could not run: Failed to import the required")
    assert preflight.preflight_line(result).startswith("h  FAIL  no GPU seen  check_failed -> investigate")


def test_a_zombie_scan_that_failed_is_not_lost_beside_a_full_disk():
    full = dict(box_health([DISK_FULL]), status="FAIL")
    result = host_result("full", dict(gpu_health(), status="PASS"), full, PSUTIL_MISSING)
    assert [(f["code"], f["level"]) for f in result["findings"]] == [("disk_low", "FAIL"), ("check_failed", "WARN")]


def test_a_check_without_status_or_message_is_check_failed_with_its_stderr():
    crashed = {"changed": False, "failed": False, "module_stderr": "Killed\n", "module_stdout": "", "rc": 137}
    found = host_result("h", gpu_health(), box_health(), crashed)["findings"]
    assert [(f["code"], f["level"], f["message"]) for f in found] == [
        ("check_failed", "WARN", "vram_zombies could not run: Killed")
    ]


def probe_answer(**changes):
    answer = {
        "python": "3.11",
        "machine": "x86_64",
        "wheel_tag": "py3.11-x86_64",
        "ready": False,
        "data_dir": {"usable": True, "problem": None},
    }
    answer.update(changes)
    return {"changed": False, "failed": False, "rc": 0, "stdout": json.dumps(answer), "stderr": ""}


def test_runtime_probe_answer_is_validated_and_kept():
    runtime = preflight.preflight_runtime(probe_answer(ready=True))
    assert runtime == {
        "ok": True,
        "wheel_tag": "py3.11-x86_64",
        "ready": True,
        "data_dir_usable": True,
        "data_dir_problem": None,
        "findings": [],
    }
    missing = preflight.preflight_runtime(probe_answer(data_dir={"usable": False, "problem": "does not exist"}))
    assert (missing["ok"], missing["data_dir_usable"], missing["data_dir_problem"]) == (True, False, "does not exist")


def test_runtime_probe_of_a_box_without_python_is_runtime_probe_failed():
    no_python = suppressed_failure(
        "The module interpreter '/usr/bin/python3' was not found.",
        module_stderr="/bin/sh: 1: /usr/bin/python3: not found\n",
        module_stdout="",
        rc=127,
    )
    runtime = preflight.preflight_runtime(no_python)
    assert runtime["ok"] is False
    assert (runtime["wheel_tag"], runtime["ready"], runtime["data_dir_usable"]) == (None, False, False)
    assert [(f["code"], f["level"], f["action"]) for f in runtime["findings"]] == [
        ("runtime_probe_failed", "FAIL", "investigate")
    ]
    assert "The module interpreter '/usr/bin/python3' was not found." in runtime["findings"][0]["message"]


@pytest.mark.parametrize(
    ("probe", "reason"),
    [
        (probe_answer(wheel_tag="py3.11-x86_64/../../../../tmp/x"), "wheel_tag"),
        (probe_answer(wheel_tag="py3.11-x86_64\n"), "wheel_tag"),
        (probe_answer(wheel_tag=["py3.11-x86_64"]), "wheel_tag"),
        (probe_answer(ready="yes"), "ready"),
        (probe_answer(data_dir={"usable": 1, "problem": None}), "data_dir"),
        (probe_answer(data_dir={"usable": False, "problem": ["x"]}), "data_dir"),
        (probe_answer(data_dir="ok"), "data_dir"),
        ({"changed": False, "failed": False, "rc": 0, "stdout": "[1, 2]", "stderr": ""}, "JSON object"),
        ({"changed": False, "failed": False, "rc": 0, "stdout": "{not json", "stderr": ""}, "JSON object"),
        (
            suppressed_failure(
                "non-zero return code", rc=1, stdout="", stderr="Traceback (most recent call last):\nSyntaxError: bad"
            ),
            "SyntaxError",
        ),
    ],
)
def test_runtime_probe_answers_the_controller_cannot_trust_are_refused(probe, reason):
    runtime = preflight.preflight_runtime(probe)
    assert (runtime["ok"], runtime["wheel_tag"], runtime["ready"]) == (False, None, False)
    assert [f["code"] for f in runtime["findings"]] == ["runtime_probe_failed"]
    assert reason in runtime["findings"][0]["message"]
    assert len(runtime["findings"][0]["message"]) < 400


def test_report_written_or_exit_passes_the_pattern_through_or_exits_3():
    assert preflight.report_written_or_exit("fleet", "") == "fleet"
    with pytest.raises(SystemExit) as stopped:
        preflight.report_written_or_exit("fleet", "Write the JSON report: Destination directory /x does not exist")
    assert stopped.value.code == fleet.EXIT_REPORT_NOT_WRITTEN == 3


def test_line_shows_status_gpus_and_worst_findings_first():
    result = host_result("box1", gpu_health([NO_KLOG, XID79]), box_health())
    assert preflight.preflight_line(result) == (
        f"box1  FAIL  1x {H100}  xid_hardware@gpu0 -> re_rent; kernel_log_unreadable -> investigate"
    )


def test_line_limits_findings_and_handles_pass_and_unreachable():
    many = host_result("b", gpu_health([NO_KLOG, XID79]), box_health([DISK_FULL]))
    assert (
        preflight.preflight_line(many, max_findings=1) == f"b  FAIL  1x {H100}  xid_hardware@gpu0 -> re_rent; +2 more"
    )
    assert preflight.preflight_line(host_result("ok", gpu_health(count=8))) == f"ok  PASS  8x {H100}"
    down = fleet.unreachable_result("gone", "ssh: connect to host 10.0.0.9 port 22: No route to host")
    assert preflight.preflight_line(down) == (
        "gone  UNREACHABLE  ssh: connect to host 10.0.0.9 port 22: No route to host  -> re_rent or check the console"
    )


def test_the_finding_filter_checks_level_and_action_and_keeps_one_bounded_line():
    built = preflight.finding_filter("preflight_error", "FAIL", "Check the GPUs:\n  timed  out", "investigate")
    assert built == finding("preflight_error", "FAIL", "Check the GPUs: timed out", "investigate")
    assert len(preflight.finding_filter("x", "WARN", "word " * 200, "none")["message"]) == preflight.MESSAGE_CHARS
    with pytest.raises(AnsibleFilterError, match="PASS"):
        preflight.finding_filter("x", "PASS", "fine", "none")
    with pytest.raises(AnsibleFilterError, match="reboot"):
        preflight.finding_filter("x", "WARN", "hot", "reboot")


def test_a_check_failure_level_comes_from_the_role_and_is_checked():
    crashed = {"check": "new_check", "level_if_failed": "WARN", "result": {"failed": True, "msg": "boom"}}
    (found,) = preflight.preflight_result("h", [crashed])["findings"]
    assert (found["code"], found["level"], found["check"]) == ("check_failed", "WARN", "new_check")
    with pytest.raises(AnsibleFilterError, match="level"):
        preflight.preflight_result("h", [dict(crashed, level_if_failed="PASS")])
    with pytest.raises(AnsibleFilterError, match="list of checks"):
        preflight.preflight_result("h", {"check": "gpu_health"})
