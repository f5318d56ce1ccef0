"""Teardown filters: the settings, the confirmation, the survival check, each step's verdict, the pull, the
load-verify, the host's record, its lines, the fleet summary and the exit code."""

from __future__ import annotations

import shlex

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter import (
    teardown,
    teardown_copy,
    teardown_fleet,
    teardown_report,
)

SHA_A = "a" * 64
SHA_B = "b" * 64


def settings(**overrides):
    """A RunPod host's settings as the role passes them to teardown_problems."""
    base = {
        "run": "sweep",
        "data_dir": "/workspace",
        "durable_dir": "/workspace/durable",
        "confirm": "",
        "pull_to": "",
        "load_cmd": "none",
        "load_on": "box",
        "extra_paths": [],
        "verb": "stop",
        "command": ["runpodctl", "pod", "stop", "pod1"],
        "status_command": ["runpodctl", "pod", "get", "pod1"],
        "status_key": "desiredStatus",
        "final_states": ["EXITED", "TERMINATED"],
        "gone_pattern": "(?i)pod.*not found",
        "pull_timeout_s": 7200,
        "load_timeout_s": 300,
        "verify_timeout_s": 1800,
        "meter_timeout_s": 300,
        "poll_interval_s": 5,
        "stop_grace_s": 30,
        "scratch_timeout_s": 600,
    }
    base.update(overrides)
    return base


def gate(**overrides):
    """What teardown_gate returns for a finished run whose durable copy verifies (its RETURN's shape)."""
    answer = {
        "changed": False,
        "passed": True,
        "step": None,
        "reason": "",
        "msg": "gate passed",
        "run": {"name": "sweep", "state": "done", "pgid": 812, "sid": 812, "started_at": "2026-12-01T00:00:00Z"},
        "cells": [
            {"name": "a", "status": "succeeded", "sync": "verified", "done": True, "accepted": False},
            {"name": "b", "status": "succeeded", "sync": "verified", "done": True, "accepted": False},
        ],
        "missing_cells": [],
        "durable": {
            "dir": "/workspace/durable/runs/sweep",
            "exists": True,
            "files": 2,
            "bytes": 8192,
            "mismatches": [],
            "manifest": {"path": "/workspace/durable/runs/sweep/MANIFEST.sha256", "sha256": SHA_A, "lines": 2},
            "extra": [],
        },
        "artifacts": [
            {"path": "cells/a/best.pth", "size": 4096, "sha256": SHA_A},
            {"path": "cells/b/best.pth", "size": 4096, "sha256": SHA_B},
        ],
        "scratch": {"dir": "/workspace/runs/sweep", "exists": True},
        "torn_down": None,
        "notes": [],
        "invocation": {"module_args": {"run": "sweep"}},
    }
    answer.update(overrides)
    return answer


def refused_gate(step, reason, **overrides):
    return gate(passed=False, step=step, reason=reason, artifacts=[], **overrides)


SCRATCH = {
    "changed": True,
    "removed": [{"path": "/workspace/runs/sweep", "files": 41, "bytes": 291092}],
    "would_remove": [],
    "tombstone": "/workspace/runs/.torn_down/sweep.json",
    "refused": False,
    "problems": [],
    "msg": "removed 1 path(s), 41 file(s), 291092 bytes of run sweep",
}
METER = {
    "changed": True,
    "command": ["runpodctl", "pod", "stop", "pod1"],
    "final_state": "EXITED",
    "gone": False,
    "already": False,
    "polls": 2,
    "states": ["RUNNING", "EXITED"],
    "command_rc": 0,
    "command_output_tail": "pod pod1 stopped",
    "status_output_tail": '{"desiredStatus": "EXITED"}',
    "msg": "ran runpodctl pod stop pod1; the instance is EXITED after 2 polls in 5.0 s",
}
CONFIRMED = {"confirmed": True, "by": "name", "reason": "confirm_teardown names box1"}
UNCONFIRMED = {"confirmed": False, "by": None, "reason": "not confirmed: set confirm_teardown=box1 (or all)"}


def record(**overrides):
    """A confirmed, torn-down box's record with ``overrides`` of teardown_result's arguments."""
    arguments = {
        "gate": gate(),
        "survival": teardown.teardown_survival("stop", ["stop"], "/workspace/durable", "runpod"),
        "pull": teardown_copy.teardown_pull(None, skip="no pull (teardown_pull_to is not set)"),
        "load_verify": teardown_copy.teardown_load(None),
        "confirmation": CONFIRMED,
        "scratch": SCRATCH,
        "meter": METER,
        "verb": "stop",
        "platform": "runpod",
        "data_loss_clocks": ["A stopped pod's volume is still billed as storage until the pod is deleted."],
    }
    arguments.update(overrides)
    return teardown_report.teardown_result("box1", "sweep", **arguments)


# ---- the settings ------------------------------------------------------------------------------------------------


def test_problems_accept_a_complete_profile_and_the_platforms_without_a_command():
    assert teardown.teardown_problems(settings()) == []
    assert teardown.teardown_problems(settings(verb="none", command=[], status_command=[], status_key="")) == []
    manual = settings(verb="shutdown", command=[], status_command=[], status_key="", final_states=[])
    assert teardown.teardown_problems(manual) == []
    # A verb after which the instance is gone needs no final state, only the gone pattern.
    assert teardown.teardown_problems(settings(verb="delete", final_states=[])) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"run": "../etc"}, "teardown_run must match"),
        ({"run": None}, "teardown_run must match"),
        ({"data_dir": ""}, "teardown_data_dir (the profile's data_dir) must be an absolute path, not ''"),
        ({"data_dir": "data"}, "teardown_data_dir"),
        ({"durable_dir": "durable"}, "teardown_durable_dir must be an absolute path"),
        ({"confirm": True}, "teardown_confirm (confirm_teardown) must be a host name"),
        ({"confirm": {"box1": True}}, "teardown_confirm"),
        ({"load_cmd": "other"}, "teardown_load_verify_cmd must be an argv list"),
        ({"load_on": "laptop"}, "teardown_load_verify_on must be one of box, controller, not 'laptop'"),
        ({"load_cmd": "list", "load_on": "controller"}, "needs teardown_pull_to"),
        ({"extra_paths": ["relative/x"]}, "teardown_scratch_extra_paths must be a list of absolute paths"),
        ({"extra_paths": "/a"}, "teardown_scratch_extra_paths"),
        ({"verb": "Stop now"}, "teardown_meter_stop_verb must be a verb"),
        ({"command": "runpodctl pod stop x"}, "must be argv lists"),
        ({"command": ["runpodctl", "pod", "stop", ""]}, "element 3 is empty (is instance_id set for this host?)"),
        ({"status_command": ["runpodctl", "pod", "get", " "]}, "teardown_meter_stop_status_cmd element 3 is empty"),
        ({"status_command": []}, "teardown_meter_stop_status_cmd is empty while teardown_meter_stop_cmd is set"),
        ({"status_key": ""}, "teardown_meter_stop_status_key is empty"),
        ({"final_states": [], "gone_pattern": ""}, "final_states is empty and there is no"),
        ({"pull_timeout_s": 0}, "teardown_pull_timeout_s must be a number between 1 and 604800, not 0"),
        ({"load_timeout_s": float("nan")}, "teardown_load_timeout_s must be a number"),
        ({"verify_timeout_s": float("inf")}, "teardown_verify_timeout_s"),
        ({"poll_interval_s": "soon"}, "teardown_poll_interval_s"),
        ({"stop_grace_s": True}, "teardown_stop_grace_s"),
        ({"meter_timeout_s": -1}, "teardown_meter_timeout_s"),
    ],
)
def test_problems_name_the_setting_and_what_it_must_be(change, expected):
    problems = teardown.teardown_problems(settings(**change))
    assert any(expected in problem for problem in problems), problems


def test_problems_of_a_string_load_command_and_of_no_settings_at_all():
    assert (
        teardown.teardown_problems(
            {"run": "r", "data_dir": "/d", "verb": "none", "command": [], "status_command": [], "extra_paths": []}
        )
        == []
    )
    with pytest.raises(AnsibleFilterError, match="mapping"):
        teardown.teardown_problems(["run"])


# ---- confirmation, irreversibility, survival ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("confirm", "confirmed", "by"),
    [
        ("box1", True, "name"),
        ("box0,box1", True, "name"),
        ("box0 box1", True, "name"),
        (["box0", "box1"], True, "name"),
        ("all", True, "all"),
        (["all"], True, "all"),
        ("box10", False, None),
        ("", False, None),
        ([], False, None),
        (None, False, None),
        (True, False, None),
        (1, False, None),
        ("yes", False, None),
    ],
)
def test_confirmation_must_name_the_host_or_be_all(confirm, confirmed, by):
    answer = teardown.teardown_confirmed(confirm, "box1")
    assert (answer["confirmed"], answer["by"]) == (confirmed, by)
    assert answer["reason"]


def test_confirmation_reasons_say_what_to_set():
    assert teardown.teardown_confirmed("", "box1")["reason"] == "not confirmed: set confirm_teardown=box1 (or all)"
    assert teardown.teardown_confirmed("box2,box3", "box1")["reason"] == "confirm_teardown names box2, box3, not box1"
    many = teardown.teardown_confirmed([f"b{i}" for i in range(8)], "box1")["reason"]
    assert "(+3 more)" in many
    assert "names no host" in teardown.teardown_confirmed(True, "box1")["reason"]


@pytest.mark.parametrize(
    ("verb", "flag", "expected"),
    [
        ("stop", False, False),
        ("stop", True, True),
        ("stop", "false", False),
        ("stop", "yes", True),
        ("delete", False, True),
        ("destroy", False, True),
        ("terminate", "False", True),
        ("shutdown", None, False),
        ("none", False, False),
    ],
)
def test_irreversible_is_the_flag_or_a_destroying_verb(verb, flag, expected):
    assert teardown.teardown_irreversible(verb, flag) is expected


def test_survival_needs_the_verb_among_the_profiles_survivors():
    stop = teardown.teardown_survival("stop", ["stop"], "/workspace/durable", "runpod")
    assert stop["passed"] and stop["reason"] == "/workspace/durable survives stop on runpod"
    delete = teardown.teardown_survival("delete", ["stop"], "/workspace/durable", "runpod")
    assert not delete["passed"]
    assert delete["reason"].startswith("/workspace/durable does not survive delete on runpod (durable_survives: stop)")
    assert teardown.teardown_survival("delete", [], "/d")["reason"].startswith(
        "/d does not survive delete (durable_survives: none)"
    )
    none = teardown.teardown_survival("none", [], "/durable")
    assert none["passed"] and "every directory stays" in none["reason"]
    broken = teardown.teardown_survival("stop", "stop", "/d")
    assert not broken["passed"] and "must be a list" in broken["reason"]


# ---- each step's verdict -----------------------------------------------------------------------------------------


def test_problem_is_empty_for_a_passed_or_skipped_step():
    assert teardown.teardown_problem(gate(), "run_alive") == {}
    assert teardown.teardown_problem({"skipped": True, "changed": False}, "scratch") == {}
    assert teardown.teardown_problem(None, "pull") == {}
    assert teardown.teardown_problem(SCRATCH, "scratch") == {}
    assert teardown.teardown_problem({"rc": 0, "cmd": ["rsync"], "stdout": ""}, "pull") == {}


def test_problem_names_the_gates_own_step_and_reason():
    answer = teardown.teardown_problem(refused_gate("durable", "durable copy does not match: x"), "run_alive")
    assert answer == {"step": "durable", "reason": "durable copy does not match: x", "unreachable": False}


def test_problem_of_an_unreachable_host():
    lost = {"unreachable": True, "changed": False, "msg": "Task failed: Failed to connect to the host via ssh"}
    assert teardown.teardown_problem(lost, "run_alive") == {
        "step": "run_alive",
        "reason": "unreachable: Failed to connect to the host via ssh",
        "unreachable": True,
    }
    assert teardown.teardown_problem(lost, "scratch")["reason"].startswith("unreachable at scratch: ")


def test_problem_of_a_failed_module_and_of_a_command():
    failed = {"failed": True, "msg": "refusing /workspace: it is data_dir itself\nmore", "refused": True}
    assert teardown.teardown_problem(failed, "scratch") == {
        "step": "scratch",
        "reason": "refusing /workspace: it is data_dir itself more",
        "unreachable": False,
    }
    command = {"rc": 2, "cmd": ["/usr/bin/curl", "x"], "stderr": "curl: (6) Could not resolve host\n", "failed": True}
    assert (
        teardown.teardown_problem(command, "meter_stop")["reason"] == "curl exited 2: curl: (6) Could not resolve host"
    )
    assert teardown.teardown_problem({"failed": True}, "meter_stop")["reason"] == "meter_stop failed"
    assert teardown.teardown_problem({"passed": False}, "load_verify")["reason"] == "load_verify did not pass"
    with pytest.raises(AnsibleFilterError, match="unknown step 'tidy'"):
        teardown.teardown_problem({}, "tidy")


def test_gate_verdict_without_a_stop():
    passed = teardown.teardown_gate_verdict(gate())
    assert passed["problem"] == {} and passed["gate"]["passed"]
    alive = refused_gate("run_alive", "run sweep is alive (runner pgid 812): stop it first (stop_running)")
    alive["run"] = dict(alive["run"], state="running")
    assert teardown.teardown_gate_verdict(alive)["problem"]["step"] == "run_alive"
    checked = teardown.teardown_gate_verdict(alive, {"skipped": True}, None, stop_running=True, check_mode=True)
    assert "check mode stops nothing" in checked["problem"]["reason"]
    assert "check mode" not in teardown.teardown_gate_verdict(alive, check_mode=True)["problem"]["reason"]
    assert teardown.teardown_gate_verdict(None)["problem"] == {
        "step": "run_alive",
        "reason": "teardown_gate did not run",
    }


def test_gate_verdict_after_a_stop():
    alive = refused_gate("run_alive", "alive")
    stopped = {"changed": True, "state": "stopped", "msg": "stopped run sweep (pgid 812)"}
    after = refused_gate("cells", "cells not done: a (failed, exit None)")
    verdict = teardown.teardown_gate_verdict(alive, stopped, after, stop_running=True)
    assert verdict["gate"] is after and verdict["problem"]["step"] == "cells"
    assert teardown.teardown_gate_verdict(alive, stopped, gate(), stop_running=True)["problem"] == {}
    failed = teardown.teardown_gate_verdict(alive, {"failed": True, "msg": "2 processes left"}, {"skipped": True})
    assert failed["problem"]["step"] == "stop_running" and failed["gate"] is alive
    lost = teardown.teardown_gate_verdict(alive, stopped, {"skipped": True})
    assert lost["problem"]["reason"] == "the gate did not run again after the stop"


# ---- the pull ----------------------------------------------------------------------------------------------------

FLEET_HOST = {
    "connection": "ssh",
    "host": "127.77.1.2",
    "port": 22,
    "user": "root",
    "private_key_file": "/state/ssh/id_ed25519",
    "common_args": '-o StrictHostKeyChecking=no -o "ProxyCommand=ip netns exec hub nc %h %p"',
    "extra_args": "",
}


def test_rsync_argv_pulls_over_the_hosts_ssh_settings():
    argv = teardown_copy.teardown_rsync_argv(FLEET_HOST, "/durable/runs/sweep", "/backups/box1/sweep")
    assert argv[:5] == ["rsync", "--recursive", "--times", "--partial", "--itemize-changes"]
    assert "--exclude=/.MANIFEST.sha256.lock" in argv and "--timeout=300" in argv
    # No --links: a symbolic link in the durable copy is skipped, never followed; nothing deleted on the controller.
    assert not {"--links", "-L", "--copy-links", "--delete", "--dry-run"} & set(argv)
    assert argv[-2:] == ["root@127.77.1.2:/durable/runs/sweep/", "/backups/box1/sweep/"]
    ssh = shlex.split(argv[argv.index("-e") + 1])
    assert ssh[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert ssh[ssh.index("-i") + 1] == "/state/ssh/id_ed25519"
    assert "ProxyCommand=ip netns exec hub nc %h %p" in ssh


def test_rsync_argv_variants():
    dry = teardown_copy.teardown_rsync_argv(FLEET_HOST, "/d/runs/r/", "/b/", dry_run=True, io_timeout_s=60)
    assert "--dry-run" in dry and "--timeout=60" in dry and dry[-1] == "/b/"
    six = teardown_copy.teardown_rsync_argv(dict(FLEET_HOST, host="fd00::5", user=""), "/d", "/b")
    assert six[-2] == "[fd00::5]:/d/"
    local = teardown_copy.teardown_rsync_argv({"connection": "local"}, "/d/runs/r", "/b")
    assert "-e" not in local and local[-2:] == ["/d/runs/r/", "/b/"]
    assert "--timeout=1" in teardown_copy.teardown_rsync_argv({"connection": "local"}, "/d", "/b", io_timeout_s=0.2)


@pytest.mark.parametrize(
    ("connection", "src", "dest", "expected"),
    [
        (FLEET_HOST, "/d", "relative", "controller directory 'relative' must be absolute"),
        (FLEET_HOST, "/d/$(reboot)", "/b", "durable directory '/d/$(reboot)' must be an absolute, plain path"),
        (FLEET_HOST, "d", "/b", "must be an absolute, plain path"),
        (dict(FLEET_HOST, connection="docker"), "/d", "/b", "connection 'docker'"),
        (dict(FLEET_HOST, host=""), "/d", "/b", "no address"),
        (dict(FLEET_HOST, common_args="-o 'x"), "/d", "/b", "cannot be split"),
    ],
)
def test_rsync_argv_refuses_what_it_cannot_pass_on(connection, src, dest, expected):
    with pytest.raises(AnsibleFilterError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        teardown_copy.teardown_rsync_argv(connection, src, dest)


RSYNC_OUT = (
    "created directory /b/box1/sweep\ncd+++++++++ ./\n>f+++++++++ MANIFEST.sha256\ncd+++++++++ cells/\n"
    '>f+++++++++ cells/a/best.pth\n>f.st...... cells/b/best.pth\nskipping non-regular file "cells/b/link"\n'
)
VERIFIED = {"passed": True, "files": 2, "bytes": 8192, "mismatches": [], "reason": "", "msg": "2 file(s) verified"}


def test_pull_record_of_a_verified_copy():
    argv = ["rsync", "-e", "ssh -o BatchMode=yes -o SetEnv=API_TOKEN=s3cret", "root@h:/d/", "/b/"]
    pull = teardown_copy.teardown_pull({"rc": 0, "stdout": RSYNC_OUT, "stderr": ""}, argv, "/b", verify=VERIFIED)
    assert pull["passed"] and pull["verified"] is True and pull["step"] is None
    assert pull["received"] == ["MANIFEST.sha256", "cells/a/best.pth", "cells/b/best.pth"]
    assert pull["received_count"] == 3 and pull["changed"] is True
    assert (pull["files"], pull["bytes"]) == (2, 8192)
    assert "s3cret" not in " ".join(pull["argv"]) and "SetEnv=<redacted>" in pull["argv"][2]
    again = teardown_copy.teardown_pull({"rc": 0, "stdout": "", "stderr": ""}, argv, "/b", verify=VERIFIED)
    assert again["passed"] and again["changed"] is False and again["received"] == []


def test_pull_record_of_a_full_controller_disk():
    full = {
        "rc": 11,
        "failed": False,
        "stdout": ">f+++++++++ cells/a/best.pth\n",
        "stderr": (
            'rsync: [receiver] write failed on "/b/cells/a/best.pth": No space left on device (28)\n'
            "rsync error: error in file IO (code 11) at receiver.c(378) [receiver=3.2.7]\n"
        ),
    }
    pull = teardown_copy.teardown_pull(full, ["rsync"], "/b", verify={"skipped": True})
    assert not pull["passed"] and pull["step"] == "pull" and pull["verified"] is None
    assert pull["reason"] == (
        'rsync exited 11: rsync: [receiver] write failed on "/b/cells/a/best.pth": No space left on device (28)'
    )
    assert teardown.teardown_problem(pull, "pull")["step"] == "pull"
    timed_out = {"failed": True, "msg": "The command action failed to execute in the expected time frame (5)"}
    assert "expected time frame" in teardown_copy.teardown_pull(timed_out, [], "/b")["reason"]
    assert teardown_copy.teardown_pull(None, [], "/b")["reason"] == "rsync did not run"


def test_pull_record_of_a_copy_that_does_not_verify():
    bad = {
        "passed": False,
        "files": 2,
        "bytes": 8192,
        "mismatches": [{"path": "cells/a/best.pth", "problem": "sha256 differs"}],
        "reason": "cells/a/best.pth: sha256 differs",
    }
    pull = teardown_copy.teardown_pull({"rc": 0, "stdout": ""}, [], "/b", verify=bad)
    assert not pull["passed"] and pull["step"] == "pull_verify" and pull["verified"] is False
    assert pull["reason"] == "the controller copy in /b does not verify: cells/a/best.pth: sha256 differs"
    assert pull["mismatches"] == bad["mismatches"]
    assert teardown_copy.teardown_pull({"rc": 0}, [], "/b", verify=None)["step"] == "pull_verify"


def test_pull_record_in_check_mode_and_when_not_wanted():
    dry = teardown_copy.teardown_pull({"rc": 0, "stdout": RSYNC_OUT}, [], "/b", check_mode=True)
    assert dry["passed"] and dry["verified"] is None and dry["dry_run"] and dry["changed"] is False
    assert dry["note"] == "not verified: check mode (rsync --dry-run)"
    skipped = teardown_copy.teardown_pull(None, skip="no pull (teardown_pull_to is not set)")
    assert skipped["passed"] and skipped["ran"] is False and skipped["to"] is None


# ---- load-verify -------------------------------------------------------------------------------------------------


def test_load_plan_chooses_artifacts_by_pattern():
    artifacts = gate()["artifacts"] + [{"path": "cells/a/protocol/log.json", "size": 1, "sha256": SHA_A}]
    every = teardown_copy.teardown_load_plan(artifacts, [], "/d/runs/sweep/", command=True)
    assert every["paths"] == [a["path"] for a in artifacts] and every["root"] == "/d/runs/sweep"
    assert every["targets"][0] == "/d/runs/sweep/cells/a/best.pth"
    pth = teardown_copy.teardown_load_plan(artifacts, ["*.pth"], "/d", command=True)
    assert pth["paths"] == ["cells/a/best.pth", "cells/b/best.pth"] and pth["reason"] == ""
    assert teardown_copy.teardown_load_plan(artifacts, ["cells/b/*"], "/d")["paths"] == ["cells/b/best.pth"]
    # A string from the command line is a comma-separated list, not one pattern per character.
    from_cli = teardown_copy.teardown_load_plan(artifacts, "cells/b/*, *.json", "/d")
    assert from_cli["paths"] == ["cells/b/best.pth", "cells/a/protocol/log.json"]
    typo = teardown_copy.teardown_load_plan(artifacts, ["*.safetensor"], "/d", command=True)
    assert typo["paths"] == [] and "match none of the 3 artifacts (e.g. cells/a/best.pth)" in typo["reason"]
    assert teardown_copy.teardown_load_plan([], ["*.pth"], "/d", command=True)["reason"] == ""
    assert teardown_copy.teardown_load_plan(None, None, "/d")["targets"] == []


def test_load_check_shapes_the_rendered_command():
    check = teardown_copy.teardown_load_check(
        ["python3", "-c", "import torch", 1, True, ["--x", 2.5], "/d/cells/a/best.pth"], "/d/cells/a/best.pth", "/d/"
    )
    assert check == {
        "artifact": "cells/a/best.pth",
        "argv": ["python3", "-c", "import torch", "1", "true", "--x", "2.5", "/d/cells/a/best.pth"],
    }
    # A shell would run the second command; here it is one argument, passed literally.
    literal = teardown_copy.teardown_load_check(["cat", "/d/x; rm -rf /"], "/elsewhere/x", "/d")
    assert literal == {"artifact": "/elsewhere/x", "argv": ["cat", "/d/x; rm -rf /"]}


@pytest.mark.parametrize(
    ("rendered", "expected"),
    [
        ([], "non-empty argv list"),
        ("python3 -c x", "non-empty argv list"),
        (["", "x"], "the program"),
        (["python3", {"a": 1}], "element 1 rendered to dict"),
        (["python3", [["nested"]]], "element 1 rendered to list"),
        (["python3", None], "element 1 rendered to NoneType"),
        (["python3", float("nan")], "element 1 rendered to float"),
    ],
)
def test_load_check_refuses_what_is_no_argv(rendered, expected):
    with pytest.raises(AnsibleFilterError, match=expected):
        teardown_copy.teardown_load_check(rendered, "/d/x", "/d")


def check(artifact, rc=0, timed_out=False):
    return {"artifact": artifact, "argv": ["python3", artifact], "rc": rc, "timed_out": timed_out, "output_tail": ""}


PLAN = {"root": "/d", "paths": ["cells/a/best.pth", "cells/b/best.pth"], "targets": ["/d/a", "/d/b"], "reason": ""}


def test_load_record_of_passing_and_failing_checks():
    ok = {"passed": True, "checks": [check("cells/a/best.pth"), check("cells/b/best.pth")], "failed": False}
    load = teardown_copy.teardown_load(ok, PLAN, "box", command=True)
    assert load["passed"] and load["ran"] and load["failed"] == []
    # A registered result's `failed` is Ansible's flag (failed_when: false); the failed artifacts come from the checks.
    bad = {
        "passed": False,
        "failed": False,
        "checks": [check("cells/a/best.pth", rc=1), check("cells/b/best.pth", rc=None, timed_out=True)],
        "reason": "load check of cells/a/best.pth exited with 1 (2 of 2 check(s) failed)",
    }
    load = teardown_copy.teardown_load(bad, PLAN, "controller", command=True)
    assert not load["passed"] and load["failed"] == ["cells/a/best.pth", "cells/b/best.pth"]
    assert (
        load["reason"]
        == "load-verify (controller): load check of cells/a/best.pth exited with 1 (2 of 2 check(s) failed)"
    )
    assert teardown.teardown_problem(load, "load_verify")["step"] == "load_verify"
    # A box that claims success while a check says otherwise, or with a check missing, does not pass.
    liar = {"passed": True, "checks": [check("cells/a/best.pth", rc=3), check("cells/b/best.pth")]}
    assert not teardown_copy.teardown_load(liar, PLAN, command=True)["passed"]
    short = teardown_copy.teardown_load({"passed": True, "checks": [check("cells/a/best.pth")]}, PLAN, command=True)
    assert not short["passed"] and "1 checks ran for 2 artifacts" in short["reason"]


def test_load_record_when_nothing_is_to_run_or_it_could_not():
    assert teardown_copy.teardown_load(None)["passed"]
    assert "no load-verify command" in teardown_copy.teardown_load(None)["note"]
    assert teardown_copy.teardown_load(None, dict(PLAN, targets=[]), command=True)["note"] == "no artifact to load"
    in_check = teardown_copy.teardown_load(None, PLAN, "controller", command=True, check_mode=True)
    assert in_check["passed"] and "check mode" in in_check["note"]
    typo = teardown_copy.teardown_load(None, dict(PLAN, reason="patterns match none"), command=True)
    assert not typo["passed"] and typo["reason"] == "patterns match none"
    assert teardown_copy.teardown_load({"skipped": True}, PLAN, command=True)["reason"] == "load_verify did not run"
    lost = teardown_copy.teardown_load({"unreachable": True, "msg": "gone"}, PLAN, command=True)
    assert teardown.teardown_problem(lost, "load_verify")["unreachable"] is True
    broken = teardown_copy.teardown_load({"failed": True, "msg": "bad checks"}, PLAN, command=True)
    assert not broken["passed"] and "bad checks" in broken["reason"]


# ---- the host's record -------------------------------------------------------------------------------------------


def test_record_of_a_box_torn_down():
    done = record()
    assert (done["status"], done["step"], done["reason"], done["reachable"]) == ("TORN_DOWN", None, "", True)
    assert done["changed"] is True and done["confirmed"] is True
    assert done["gate"]["artifacts"] == gate()["artifacts"] and "invocation" not in done["gate"]
    assert done["meter_stop"]["state"] == "stopped" and done["meter_stop"]["final_state"] == "EXITED"
    assert done["scratch"]["removed"] == SCRATCH["removed"] and done["scratch"]["check_mode"] is False
    assert done["line"] == (
        "box1  TORN_DOWN  run sweep: gate passed (2/2 cells done; durable 2 files, 8.0 KiB verified); "
        "removed /workspace/runs/sweep (41 files, 284.3 KiB); meter-stop (stop): ran runpodctl pod stop pod1; "
        "the instance is EXITED after 2 polls in 5.0 s"
    )
    assert done["data_loss_clocks"] == ["A stopped pod's volume is still billed as storage until the pod is deleted."]


def test_record_of_a_second_teardown_changes_nothing():
    again = record(
        gate=gate(torn_down={"run": "sweep"}, run={"name": "sweep", "state": "torn_down"}),
        scratch=dict(SCRATCH, changed=False, removed=[]),
        meter=dict(METER, changed=False, already=True, command_rc=None, polls=1),
    )
    assert again["status"] == "TORN_DOWN" and again["changed"] is False
    assert "scratch already removed" in again["line"] and "already EXITED, nothing run" in again["line"]
    assert "torn down before" in again["line"]


@pytest.mark.parametrize(
    ("step", "status"),
    [
        ("validate", "REFUSED"),
        ("run_alive", "REFUSED"),
        ("stop_running", "REFUSED"),
        ("cells", "REFUSED"),
        ("durable", "REFUSED"),
        ("survival", "REFUSED"),
        ("pull", "REFUSED"),
        ("pull_verify", "REFUSED"),
        ("load_verify", "REFUSED"),
        ("confirm", "UNCONFIRMED"),
        ("scratch", "FAILED"),
        ("meter_stop", "FAILED"),
    ],
)
def test_record_status_of_each_step(step, status):
    stopped = record(problem={"step": step, "reason": f"{step} went wrong", "unreachable": False})
    assert (stopped["status"], stopped["step"], stopped["reason"]) == (status, step, f"{step} went wrong")


def test_record_of_a_refused_box_says_nothing_was_done():
    refused = record(
        gate=refused_gate("durable", "durable copy does not match: cells/a/best.pth: 1024 bytes, expected 4096"),
        scratch=None,
        meter=None,
        confirmation=None,
        problem={
            "step": "durable",
            "reason": "durable copy does not match: cells/a/best.pth: 1024 bytes, expected 4096",
        },
    )
    assert refused["status"] == "REFUSED" and refused["meter_stop"] is None and refused["scratch"] is None
    assert refused["changed"] is False
    assert refused["line"] == (
        "box1  REFUSED  run sweep at durable: durable copy does not match: cells/a/best.pth: 1024 bytes, expected "
        "4096; nothing deleted, nothing stopped"
    )
    assert refused["gate"]["step"] == "durable"


def test_record_of_an_unconfirmed_box_says_what_it_would_do():
    preview = record(
        confirmation=UNCONFIRMED,
        scratch=dict(SCRATCH, changed=True, removed=[], would_remove=SCRATCH["removed"]),
        meter={"changed": True, "command": METER["command"], "would_run": METER["command"], "polls": 0},
    )
    assert (preview["status"], preview["step"]) == ("UNCONFIRMED", "confirm")
    assert preview["reason"] == "not confirmed: set confirm_teardown=box1 (or all)"
    assert preview["changed"] is False and preview["meter_stop"]["state"] == "would_run"
    assert "would remove /workspace/runs/sweep (41 files, 284.3 KiB)" in preview["line"]
    assert "meter-stop (stop) would run: runpodctl pod stop pod1" in preview["line"]
    assert preview["line"].endswith("nothing done: not confirmed: set confirm_teardown=box1 (or all)")


def test_record_in_check_mode():
    checked = record(
        check_mode=True,
        confirmation=UNCONFIRMED,
        pull=teardown_copy.teardown_pull({"rc": 0, "stdout": RSYNC_OUT}, [], "/b/box1/sweep", check_mode=True),
        scratch=dict(SCRATCH, removed=[], would_remove=SCRATCH["removed"]),
        meter={"changed": True, "command": METER["command"], "would_run": METER["command"], "polls": 0},
    )
    assert checked["status"] == "CHECKED" and checked["step"] is None and checked["changed"] is False
    assert "would pull 3 new files to /b/box1/sweep (not verified: check mode)" in checked["line"]
    assert any("not confirmed: a real teardown stops before acting" in w for w in checked["warnings"])
    confirmed = record(check_mode=True, scratch=dict(SCRATCH, removed=[], would_remove=SCRATCH["removed"]))
    assert not any("not confirmed" in w for w in confirmed["warnings"])


def test_record_of_a_failed_meter_stop_after_the_scratch_went():
    sticky = {
        "failed": True,
        "command": ["vastai", "stop", "instance", "7"],
        "final_state": None,
        "states": ["running"],
        "msg": "the meter-stop command exited 0 but the instance 7 is still running after 3 s",
    }
    failed = record(meter=sticky, problem=teardown.teardown_problem(sticky, "meter_stop"), verb="stop")
    assert (failed["status"], failed["step"]) == ("FAILED", "meter_stop")
    assert failed["meter_stop"]["state"] == "failed"
    assert failed["line"].startswith(
        "box1  FAILED  run sweep at meter_stop: the meter-stop command exited 0 but the instance 7 is still running"
    )
    assert "removed /workspace/runs/sweep" in failed["line"]
    assert failed["changed"] is True  # the scratch did go


def test_record_of_an_unreachable_box_and_of_one_lost_mid_way():
    lost = {"unreachable": True, "msg": "Failed to connect to the host via ssh: Connection refused"}
    never = record(gate=lost, problem=teardown.teardown_problem(lost, "run_alive"), scratch=None, meter=None)
    assert never["status"] == "UNREACHABLE" and never["reachable"] is False and never["gate"] is None
    assert never["line"] == "box1  UNREACHABLE  unreachable: Failed to connect to the host via ssh: Connection refused"
    mid = record(scratch=lost, problem=teardown.teardown_problem(lost, "scratch"), meter=None)
    assert mid["status"] == "FAILED" and mid["reachable"] is True and mid["step"] == "scratch"


def test_record_of_a_task_error_counts_at_the_first_step_without_evidence():
    invalid = teardown_report.teardown_result("box1", "sweep", error="Check the settings: teardown_run must match")
    assert (invalid["status"], invalid["step"]) == ("REFUSED", "validate")
    pull = record(pull=None, load_verify=None, confirmation=None, scratch=None, meter=None, error="mkdir failed")
    assert (pull["status"], pull["step"], pull["reason"]) == ("REFUSED", "pull", "mkdir failed")
    meter = record(meter=None, error="Stop the meter: boom")
    assert (meter["status"], meter["step"]) == ("FAILED", "meter_stop")


def test_record_warnings_and_the_manual_and_none_meter_stops():
    autodl = record(
        meter=None,
        meter_mode="manual",
        verb="shutdown",
        manual_steps=["AutoDL console -> the instance -> Shut down", "Release it after copying"],
        gate=gate(
            cells=[
                {"name": "a", "status": "succeeded", "sync": "verified", "done": True, "accepted": False},
                {"name": "b", "status": "failed", "sync": None, "done": False, "accepted": True},
            ],
            notes=["accept_incomplete_cells names no cell of run sweep: c"],
        ),
    )
    assert autodl["status"] == "TORN_DOWN" and autodl["meter_stop"]["state"] == "manual"
    assert autodl["meter_stop"]["steps"] == ["AutoDL console -> the instance -> Shut down", "Release it after copying"]
    assert "the meter is still running: stop it in the provider's console (steps below)" in autodl["warnings"]
    assert "cells accepted unfinished (their results are not secured): b" in autodl["warnings"]
    assert "accept_incomplete_cells names no cell of run sweep: c" in autodl["warnings"]
    lines = teardown_report.teardown_lines(autodl)
    assert lines[0] == autodl["line"] and "meter-stop (shutdown) is manual: see the steps" in lines[0]
    assert "  step 1: AutoDL console -> the instance -> Shut down" in lines
    assert any(line.startswith("  data-loss clock: ") for line in lines)
    generic = record(meter=None, meter_mode="none", verb="none", data_loss_clocks=[])
    assert generic["meter_stop"]["state"] == "none" and "no meter-stop (verb none)" in generic["line"]
    lambda_ = record(verb="terminate", irreversible=True)
    assert any("irreversible" in warning for warning in lambda_["warnings"])
    assert "meter-stop (terminate, IRREVERSIBLE)" in lambda_["line"]


def test_record_of_a_run_without_artifacts():
    bare = record(gate=gate(artifacts=[], durable=dict(gate()["durable"], exists=False, files=0, bytes=0)))
    assert "no durable copy (accept_no_artifacts)" in bare["line"]


# ---- every host, the lines, the summary, the exit ----------------------------------------------------------------


def test_results_give_hosts_without_a_record_an_unreachable_one():
    hostvars = {"box1": {"teardown_result": record()}, "box2": {}, "box3": {"teardown_result": {"status": "?"}}}
    results = teardown_fleet.teardown_results(["box1", "box2", "box3"], hostvars)
    assert [r["status"] for r in results] == ["TORN_DOWN", "UNREACHABLE", "UNREACHABLE"]
    assert results[1]["host"] == "box2" and results[1]["reachable"] is False
    assert results[1]["line"].startswith("box2  UNREACHABLE  unreachable, or stopped before the teardown ran")
    with pytest.raises(AnsibleFilterError, match="list of host names"):
        teardown_fleet.teardown_results("box1", hostvars)


def test_lines_of_anything():
    assert teardown_report.teardown_lines("garbage")[0].startswith("?  UNKNOWN  not a teardown record")
    refused = record(problem={"step": "cells", "reason": "cells not done: b"})
    assert not any("data-loss clock" in line for line in teardown_report.teardown_lines(refused))


def test_summary_counts_and_exit_codes():
    done = record()
    refused = dict(record(problem={"step": "durable", "reason": "x"}, scratch=None, meter=None), host="box2")
    unconfirmed = dict(record(confirmation=UNCONFIRMED), host="box3")
    unreachable = {"step": "run_alive", "reason": "u", "unreachable": True}
    lost = dict(record(gate={"unreachable": True}, problem=unreachable, scratch=None, meter=None))
    lost["host"] = "box4"
    summary = teardown_fleet.teardown_summary([done, refused, unconfirmed, lost])
    assert summary["counts"] == {"TORN_DOWN": 1, "UNCONFIRMED": 1, "REFUSED": 1, "UNREACHABLE": 1}
    assert summary["exit_code"] == 2 and summary["changed"] == ["box1"]
    assert summary["line"] == (
        "4 hosts: 1 TORN_DOWN, 1 UNCONFIRMED, 1 REFUSED, 1 UNREACHABLE; refused: box2 (durable); "
        "unconfirmed: box3; unreachable: box4"
    )
    assert teardown_fleet.teardown_summary([done, lost])["exit_code"] == 4
    assert teardown_fleet.teardown_summary([done])["exit_code"] == 0
    assert teardown_fleet.teardown_summary([unconfirmed])["exit_code"] == 2
    assert teardown_fleet.teardown_summary([dict(done, status="CHECKED")])["exit_code"] == 0
    not_written = teardown_fleet.teardown_summary([done], report_error="disk full")
    assert not_written["exit_code"] == 3 and not_written["report_error"] == "disk full"
    assert teardown_fleet.teardown_summary([])["line"] == "0 hosts"
    with pytest.raises(AnsibleFilterError, match="unknown status"):
        teardown_fleet.teardown_summary([dict(done, status="GONE")])
    with pytest.raises(AnsibleFilterError, match="list of teardown records"):
        teardown_fleet.teardown_summary({"host": "x"})


def test_exit_passes_the_hosts_or_ends_the_run():
    assert teardown_fleet.teardown_exit("all", 0) == "all"
    assert teardown_fleet.teardown_exit("all", "2") == "all"
    with pytest.raises(SystemExit) as unreachable:
        teardown_fleet.teardown_exit("all", 4)
    assert unreachable.value.code == 4
    with pytest.raises(SystemExit) as not_written:
        teardown_fleet.teardown_exit("all", 3)
    assert not_written.value.code == 3
    with pytest.raises(SystemExit) as garbage:
        teardown_fleet.teardown_exit("all", "nan")
    assert garbage.value.code == 3


def test_filter_modules_expose_every_documented_filter():
    names = {
        *teardown.FilterModule().filters(),
        *teardown_copy.FilterModule().filters(),
        *teardown_report.FilterModule().filters(),
        *teardown_fleet.FilterModule().filters(),
    }
    assert len(names) == 16 and all(name.startswith("teardown_") for name in names)


@pytest.mark.parametrize(
    ("result", "step", "expected"),
    [
        # A module that crashed: only its stderr, and Ansible's failed flag (kept by ignore_errors).
        ({"failed": True, "module_stderr": "Traceback ...\nKeyError: 'x'", "msg": ""}, "run_alive", "Traceback"),
        # An answer without the gate's verdict, or with a verdict that is not a boolean, passes nothing.
        ({"changed": False, "msg": "odd"}, "run_alive", "teardown_gate gave no verdict: odd"),
        ({"passed": "yes", "msg": "odd"}, "run_alive", "teardown_gate gave no verdict"),
        ({"changed": True}, "stop_running", "training_run gave no verdict"),
        ({"changed": True, "msg": "done"}, "scratch", "run_scratch gave no verdict: done"),
        # The sticky instance once more, with the module's failed flag lost (failed_when: false overwrites it).
        (
            {"failed": False, "final_state": None, "gone": False, "msg": "exited 0 but still RUNNING after 3 s"},
            "meter_stop",
            "meter_stop gave no verdict: exited 0 but still RUNNING after 3 s",
        ),
    ],
)
def test_problem_without_a_verdict_stops_the_box(result, step, expected):
    problem = teardown.teardown_problem(result, step)
    assert problem["step"] == step and expected in problem["reason"], problem


def test_problem_accepts_each_modules_own_verdict():
    assert teardown.teardown_problem({"state": "stopped", "changed": True}, "stop_running") == {}
    assert teardown.teardown_problem({"removed": [], "would_remove": [{"path": "/d"}]}, "scratch") == {}
    assert teardown.teardown_problem({"gone": True, "final_state": None}, "meter_stop") == {}
    assert teardown.teardown_problem({"would_run": ["runpodctl", "pod", "stop", "p"]}, "meter_stop") == {}
    assert teardown.teardown_gate_verdict({"changed": False})["problem"]["reason"].startswith("teardown_gate gave")
