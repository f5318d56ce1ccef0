"""Launch filters: the sweep's checks, the shard split, argv shaping, the rsync command, the gate and the report."""

from __future__ import annotations

import shlex
import time

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter import launch, launch_report

CELLS = [{"name": f"c{i}", "config": f"cfg{i}.yaml"} for i in range(7)]
HOSTS = ["box-b", "box-a", "box-c"]


# ---- the sweep ------------------------------------------------------------------------------------------------


def test_cell_problems_accepts_a_good_sweep():
    assert launch.launch_cell_problems([{"name": "a", "timeout_s": 60, "retries": 2}, {"name": "b.2_x-y"}]) == []


@pytest.mark.parametrize(
    ("cells", "expected"),
    [
        ([], "non-empty list"),
        ("a", "non-empty list"),
        (["a"], "cells[0] must be a mapping"),
        ([{"config": "x"}], "cells[0].name None"),
        ([{"name": "../escape"}], "does not match"),
        ([{"name": "a b"}], "does not match"),
        ([{"name": "-a"}], "does not match"),
        ([{"name": "a" * 65}], "does not match"),
        ([{"name": "a"}, {"name": "a"}], "unique: a"),
        ([{"name": "a", "timeout_s": 0}], "timeout_s"),
        ([{"name": "a", "timeout_s": "10"}], "timeout_s"),
        ([{"name": "a", "retries": -1}], "retries"),
        ([{"name": "a", "retries": True}], "retries"),
    ],
)
def test_cell_problems_names_what_is_wrong(cells, expected):
    problems = launch.launch_cell_problems(cells)
    assert problems
    assert expected in " ".join(problems)


def test_secret_problems_read_sources_never_values():
    assert launch.launch_secret_problems({"WANDB_API_KEY": {"env": "WANDB_API_KEY"}, "HF": {"file": "~/.hf"}}) == []
    problems = launch.launch_secret_problems(
        {"1BAD": {"env": "X"}, "TWO": {"env": "X", "file": "y"}, "LITERAL": "hunter2", "EMPTY": {"file": ""}}
    )
    joined = " ".join(problems)
    assert "'1BAD' is not an environment variable name" in joined
    assert "TWO: give exactly one" in joined and "LITERAL: give exactly one" in joined
    assert "EMPTY: its file is empty" in joined
    assert "hunter2" not in joined
    assert launch.launch_secret_problems(["x"]) != []


# ---- sharding -------------------------------------------------------------------------------------------------


def test_shard_splits_every_cell_exactly_once_in_sorted_host_order():
    shares = {host: launch.launch_shard(CELLS, HOSTS, host) for host in HOSTS}
    assert [shares[h]["index"] for h in ("box-a", "box-b", "box-c")] == [0, 1, 2]
    assert {share["count"] for share in shares.values()} == {3}
    assert [c["name"] for c in shares["box-a"]["cells"]] == ["c0", "c3", "c6"]
    assert [c["name"] for c in shares["box-b"]["cells"]] == ["c1", "c4"]
    names = sorted(c["name"] for share in shares.values() for c in share["cells"])
    assert names == sorted(c["name"] for c in CELLS)


def test_shard_is_stable_whatever_order_the_hosts_come_in():
    first = launch.launch_shard(CELLS, HOSTS, "box-c")
    again = launch.launch_shard(CELLS, [*reversed(HOSTS), "box-a"], "box-c")
    assert first == again


def test_shard_off_gives_every_host_every_cell_and_unknown_hosts_are_refused():
    assert launch.launch_shard(CELLS, HOSTS, "box-z", enabled=False)["cells"] == CELLS
    with pytest.raises(AnsibleFilterError, match="box-z"):
        launch.launch_shard(CELLS, HOSTS, "box-z")
    # More hosts than cells: the last hosts get nothing (the role reports them IDLE).
    assert launch.launch_shard(CELLS[:2], HOSTS, "box-c")["cells"] == []


# ---- argv -----------------------------------------------------------------------------------------------------


def test_argv_stringifies_scalars_and_splices_lists():
    rendered = ["python", "-m", "train", "--epochs", 3, "--lr", 0.5, "--amp", True, ["-o", "a=1", 2]]
    assert launch.launch_argv(rendered, "c") == [
        "python", "-m", "train", "--epochs", "3", "--lr", "0.5", "--amp", "true", "-o", "a=1", "2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("rendered", "expected"),
    [
        ("python train.py", "non-empty list"),
        ([], "non-empty list"),
        (["", "x"], "first element"),
        (["python", {"a": 1}], "element 1 rendered to dict"),
        (["python", None], "element 1 rendered to NoneType"),
        (["python", [["nested"]]], "flat list"),
        (["python", float("nan")], "rendered to float"),
    ],
)
def test_argv_refuses_what_is_not_an_argv(rendered, expected):
    with pytest.raises(AnsibleFilterError, match=expected):
        launch.launch_argv(rendered, "c")


def test_module_cell_keeps_only_the_modules_keys():
    cell = {"name": "a", "config": "x.yaml", "timeout_s": 30, "retries": 1, "secret_note": "x"}
    assert launch.launch_module_cell(cell, ["python", "x"], "/data/ckpt/a") == {
        "name": "a",
        "command": ["python", "x"],
        "timeout_s": 30,
        "retries": 1,
        "checkpoint_dir": "/data/ckpt/a",
    }
    assert launch.launch_module_cell({"name": "b"}, ["x"]) == {"name": "b", "command": ["x"]}
    with pytest.raises(AnsibleFilterError, match="absolute"):
        launch.launch_module_cell({"name": "b"}, ["x"], "ckpt")


# ---- rsync ----------------------------------------------------------------------------------------------------

FLEET_HOST = {
    "connection": "ssh",
    "host": "127.77.1.2",
    "port": 22,
    "user": "root",
    "private_key_file": "/state/ssh/id_ed25519",
    "common_args": '-o StrictHostKeyChecking=no -o "ProxyCommand=ip netns exec hub nc %h %p" -o ControlPath=/cp/%C',
    "extra_args": "",
}


def _rsync_split(command: str):
    """How rsync splits its -e command: on spaces, honouring single and double quotes (shlex agrees for these)."""
    return shlex.split(command)


def test_rsync_argv_uses_the_hosts_ssh_settings():
    argv = launch.launch_rsync_argv(FLEET_HOST, "/src/proj/", "/data/code/run1", excludes=[".git", "*.pyc"])
    assert argv[0] == "rsync"
    assert "--checksum" not in argv and "--delete" not in argv and "--dry-run" not in argv
    assert "--exclude=.git" in argv and "--exclude=*.pyc" in argv
    assert argv[-2:] == ["/src/proj/", "root@127.77.1.2:/data/code/run1/"]
    ssh = _rsync_split(argv[argv.index("-e") + 1])
    assert ssh[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert ssh[ssh.index("-p") + 1] == "22"
    assert ssh[ssh.index("-i") + 1] == "/state/ssh/id_ed25519"
    assert "ProxyCommand=ip netns exec hub nc %h %p" in ssh
    assert "ControlPath=/cp/%C" in ssh


def test_rsync_argv_variants():
    dry = launch.launch_rsync_argv(FLEET_HOST, "/src", "/d", delete=True, dry_run=True)
    assert "--delete" in dry and "--dry-run" in dry
    assert dry[-2] == "/src/"
    six = launch.launch_rsync_argv(dict(FLEET_HOST, host="fd00::5", user="", port=""), "/src", "/d")
    assert six[-1] == "[fd00::5]:/d/"
    assert "-p" not in _rsync_split(six[six.index("-e") + 1])
    local = launch.launch_rsync_argv({"connection": "local"}, "/src", "/d")
    assert "-e" not in local and local[-1] == "/d/"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"connection": "docker"}, "connection 'docker'"),
        ({"host": ""}, "no address"),
        ({"common_args": "-o 'unbalanced"}, "cannot be split"),
        ({"common_args": '-o "a\'b c\\"d"'}, "both quote"),
    ],
)
def test_rsync_argv_refuses_what_it_cannot_pass_on(change, expected):
    with pytest.raises(AnsibleFilterError, match=expected):
        launch.launch_rsync_argv(dict(FLEET_HOST, **change), "/src", "/d")


@pytest.mark.parametrize("dest", ["relative/x", "/data/my code", "/data/$(reboot)", "/data/a;b", "/d/`x`"])
def test_rsync_argv_refuses_a_destination_a_remote_shell_would_interpret(dest):
    with pytest.raises(AnsibleFilterError, match="plain path"):
        launch.launch_rsync_argv(FLEET_HOST, "/src", dest)


def test_rsync_changes_reads_the_itemized_output():
    out = (
        "created directory /data/code/r\ncd+++++++++ ./\n<f+++++++++ train.py\n<f.st...... sub/model.py\n"
        "*deleting   old.py\n"
    )
    changes = launch.launch_rsync_changes(out)
    assert changes == {"changed": True, "files": ["train.py", "sub/model.py"], "deleted": ["old.py"]}
    assert launch.launch_rsync_changes("") == {"changed": False, "files": [], "deleted": []}
    assert launch.launch_rsync_changes(".d..t...... ./\n")["changed"]


# ---- the preflight gate ---------------------------------------------------------------------------------------

NOW = 1_800_000_000.0


def _report(age_s: float, **statuses: str):
    generated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - age_s))
    findings = [{"code": "gpu_lost", "level": "FAIL", "action": "re_rent"}]
    hosts = [{"host": h, "status": s, "findings": findings if s == "FAIL" else []} for h, s in statuses.items()]
    return {"generated_at": generated, "hosts": hosts}


def gate(host, **kwargs):
    kwargs.setdefault("now", NOW)
    return launch_report.launch_preflight_gate(host, **kwargs)


def test_gate_refuses_a_fresh_fail_and_allows_pass_and_warn():
    report = _report(60, a="FAIL", b="WARN", c="PASS", d="UNREACHABLE")
    refused = gate("a", report=report, report_file="preflight-x.json")
    assert not refused["allowed"]
    assert refused["status"] == "FAIL"
    assert refused["reason"] == "preflight FAIL (preflight-x.json): gpu_lost -> re_rent"
    assert [gate(h, report=report)["allowed"] for h in "bcd"] == [True, True, True]
    assert gate("c", report=report)["age_s"] == 60.0


def test_gate_prefers_the_same_plays_preflight_over_any_report():
    report = _report(10, a="FAIL")
    assert gate("a", play_result={"status": "PASS"}, report=report)["allowed"]
    in_play = gate("a", play_result={"status": "FAIL", "findings": []}, report=_report(10, a="PASS"))
    assert (in_play["allowed"], in_play["source"]) == (False, "this play")


def test_gate_ignores_a_stale_report_unless_preflight_is_required():
    report = _report(7200, a="FAIL")
    stale = gate("a", report=report, max_age_s=3600)
    assert stale["allowed"] and stale["status"] is None
    assert "7200 s old" in stale["reason"]
    required = gate("a", report=report, max_age_s=3600, require=True)
    assert not required["allowed"] and "launch_require_preflight" in required["reason"]
    assert not gate("z", report={}, require=True)["allowed"]
    assert gate("z", report={"generated_at": "garbage", "hosts": []})["allowed"]


def test_gate_skip_allows_a_failed_box():
    skipped = gate("a", play_result={"status": "FAIL"}, skip=True)
    assert skipped["allowed"] and skipped["source"] == "skipped"


# ---- records, lines, summary ----------------------------------------------------------------------------------

ALLOWED = {"allowed": True, "status": "PASS", "source": "this play", "age_s": 0, "reason": "preflight PASS"}
MODULE = {
    "changed": True,
    "state": "running",
    "run": "sweep",
    "run_dir": "/data/runs/sweep",
    "detach": "tmux",
    "attach": "tmux attach -t rgt-sweep",
    "pgid": 4242,
    "sid": 4242,
    "resumed": False,
    "skipped_cells": [],
    "msg": "started run sweep",
    "cells": [
        {"name": "a", "status": "running", "sync": None, "done": False},
        {"name": "b", "status": "pending", "sync": None, "done": False},
    ],
}
PLAN = {"index": 0, "count": 1, "cells": [{"name": "a"}, {"name": "b"}]}
RSYNC = {"source": "rsync", "synced": True, "changed": True, "files": ["train.py", "x.py"], "deleted": []}


_STARTED = object()  # record()'s default: the module result MODULE (None means the module did not run)


def record(module=_STARTED, **kwargs):
    module = MODULE if module is _STARTED else module
    kwargs.setdefault("gate", ALLOWED)
    kwargs.setdefault("shard", PLAN)
    return launch_report.launch_result("box-a", "sweep", module, **kwargs)


def test_record_and_line_of_a_started_run():
    started = record(code=RSYNC)
    assert started["status"] == "STARTED"
    assert started["counts"]["running"] == 1 and started["counts"]["pending"] == 1
    assert started["shard"] is None
    assert launch_report.launch_line(started) == (
        "box-a  STARTED  sweep: 2 cells (1 running, 1 pending); tmux pgid 4242; attach: tmux attach -t rgt-sweep; "
        "code (rsync): 2 files sent"
    )


def test_record_statuses_follow_what_the_module_said():
    done_cells = [{"name": "a", "status": "succeeded", "sync": "verified", "done": True}]
    assert record(dict(MODULE, changed=False, state="running"))["status"] == "RUNNING"
    assert record(dict(MODULE, changed=False, state="done", cells=done_cells))["status"] == "DONE"
    assert record(dict(MODULE, resumed=True))["status"] == "RESUMED"
    assert record(dict(MODULE, resumed=True), check_mode=True)["status"] == "WOULD_RESUME"
    would = record(MODULE, check_mode=True, code=dict(RSYNC, files=["a"]))
    assert would["status"] == "WOULD_START"
    assert "code (rsync): 1 files would send" in launch_report.launch_line(would)


def test_record_of_a_refused_failed_or_idle_host():
    refused = record(None, gate={"allowed": False, "reason": "preflight FAIL (x): gpu_lost -> re_rent"})
    assert refused["status"] == "REFUSED"
    assert launch_report.launch_line(refused) == "box-a  REFUSED  sweep: preflight FAIL (x): gpu_lost -> re_rent"
    failed = record({"failed": True, "msg": "WANDB_MODE=online\nneeds WANDB_API_KEY"})
    assert (failed["status"], failed["msg"]) == ("FAILED", "WANDB_MODE=online needs WANDB_API_KEY")
    errored = record(None, error="Send the code with rsync: rsync error: " + "x" * 400)
    assert errored["status"] == "FAILED" and len(errored["msg"]) == 300
    assert record({"skipped": True})["status"] == "FAILED"
    idle = record(None, shard={"index": 2, "count": 3, "cells": []})
    assert idle["status"] == "IDLE"
    assert launch_report.launch_line(idle) == "box-a  IDLE  sweep: shard 3/3; no cells in shard 3/3"


def test_record_never_copies_module_inputs():
    leaky = dict(MODULE, invocation={"module_args": {"secrets": {"K": "hunter2"}}}, env={"K": "hunter2"})
    assert "hunter2" not in repr(record(leaky))


def test_summary_counts_exit_codes_and_cells_not_launched():
    shard_a = {"index": 0, "count": 3, "cells": [{"name": "c0"}, {"name": "c3"}]}
    shard_b = {"index": 1, "count": 3, "cells": [{"name": "c1"}]}
    records = [
        launch_report.launch_result("box-a", "s", MODULE, gate=ALLOWED, shard=shard_a),
        launch_report.launch_result(
            "box-b", "s", None, gate={"allowed": False, "reason": "preflight FAIL"}, shard=shard_b
        ),
        launch_report.launch_results(["box-c"], {})[0],
    ]
    summary = launch_report.launch_summary(records, ["c0", "c1", "c2", "c3"])
    assert summary["counts"] == {"STARTED": 1, "REFUSED": 1, "UNREACHABLE": 1}
    assert summary["exit_code"] == 2
    assert summary["cells_not_launched"] == ["c1", "c2"]
    assert summary["line"] == (
        "3 hosts: 1 STARTED, 1 REFUSED, 1 UNREACHABLE; refused: box-b; unreachable: box-c; cells not launched: c1, c2"
    )
    assert launch_report.launch_line(records[2]).startswith("box-c  UNREACHABLE  unreachable, or stopped before launch")
    assert launch_report.launch_summary(records[:1] + records[2:])["exit_code"] == 4
    assert launch_report.launch_summary(records[:1])["exit_code"] == 0
    assert launch_report.launch_summary(records[:1], report_error="disk full")["exit_code"] == 3
    # Every host runs every cell without sharding: nothing is "not launched" because one box was refused.
    plain = [record(), record(None, gate={"allowed": False, "reason": "x"})]
    assert launch_report.launch_summary(plain, ["a", "b"])["cells_not_launched"] == []
    with pytest.raises(AnsibleFilterError, match="unknown status"):
        launch_report.launch_summary([{"host": "x", "status": "MAYBE"}])
