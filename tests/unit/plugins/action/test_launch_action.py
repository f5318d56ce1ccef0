"""The launch action, one box at a time: validation before anything reaches the box, the preflight gate, the runtime
probe (the real probe script, run here), the code push (real rsync over the local connection) and one training_run
call, whose answers are scripted. The play's variables come from a YAML sweep loaded as Ansible loads a vars file
and the options are rendered from them through a real Templar, as the role's task does."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import yaml
from ansible.errors import AnsibleConnectionFailure
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from ansible_collections.remote_gpu.trainer.plugins.action import stage_report, stage_verdict
from ansible_collections.remote_gpu.trainer.plugins.action.launch import ActionModule
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_flow as flow
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _rsync as rsync
from ansible_collections.remote_gpu.trainer.tests.profiles import self_stop

SECRET = "s3cr3t-value-never-shown"
HOSTS = ["h1", "h2", "h3"]


class FakeTask:
    def __init__(self, args: Dict[str, Any], check_mode: bool) -> None:
        self.args, self.check_mode, self.async_val = args, check_mode, 0
        self.no_log, self.environment = False, []
        self.action = "remote_gpu.trainer.launch"
        self.delegate_to = None


class FakeConnection:
    transport = "local"

    class _shell:
        tmpdir = None


class Box:
    """The box's side of ``_execute_module``: the command module runs here for real (the runtime probe), the file
    module makes the directory, training_run answers from ``answers``; every call is recorded."""

    def __init__(self, action: ActionModule, answers: List[Any]) -> None:
        self.action, self.answers = action, answers
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, module_name: str, module_args: Dict[str, Any], task_vars: Dict[str, Any]) -> Dict[str, Any]:
        task = self.action._task
        call = {"module": module_name, "args": module_args, "check_mode": task.check_mode, "no_log": task.no_log}
        self.calls.append(dict(call, python=task_vars.get("ansible_python_interpreter"), env=task.environment))
        if module_name == "ansible.builtin.command":
            done = subprocess.run(module_args["argv"], capture_output=True, text=True, check=False)
            return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        if module_name == "ansible.builtin.file":
            existed = os.path.isdir(module_args["path"])
            if not task.check_mode:
                os.makedirs(module_args["path"], exist_ok=True)
            return {"changed": not existed}
        answer = self.answers.pop(0)
        return answer(module_args) if callable(answer) else answer

    def modules(self) -> List[str]:
        return [call["module"] for call in self.calls]


def play(tmp_path: Path, host: str = "h1", **changes: Any) -> Dict[str, Any]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    sweep: Dict[str, Any] = {
        "launch_run": "abl",
        "launch_cells": [{"name": "a", "lr": 0.1}, {"name": "b", "lr": 0.2}, {"name": "c", "lr": 0.3}],
        "launch_command": ["python", "train.py", "--lr", "{{ cell.lr }}"],
        "launch_workdir": "/work/proj",
        "launch_skip_preflight": True,
        "data_dir": str(data),
    }
    sweep.update(changes)
    path = tmp_path / f"sweep-{host}.yml"
    path.write_text(yaml.safe_dump({key: value for key, value in sweep.items() if value is not None}))
    loaded = DataLoader().load_from_file(str(path), trusted_as_template=True)
    return {"inventory_hostname": host, "groups": {"all": HOSTS, "ungrouped": HOSTS}, **loaded}


def launch(
    task_vars: Dict[str, Any], answers: Optional[List[Any]] = None, check_mode: bool = False
) -> Tuple[Dict[str, Any], Box]:
    """The action run as the role's task runs it: each option rendered from its launch_* variable."""
    templar = Templar(loader=DataLoader(), variables=task_vars)
    args = {
        name[len("launch_") :]: templar.template(trust_as_template("{{ " + name + " }}"))
        for name in task_vars
        if name.startswith("launch_") and name[len("launch_") :] in options.ARGUMENT_SPEC
    }
    action = ActionModule(
        FakeTask(args, check_mode), FakeConnection(), None, loader=DataLoader(), templar=templar, shared_loader_obj=None
    )
    box = Box(action, list(answers or []))
    action._execute_module = box  # type: ignore[method-assign]
    action._remove_tmp_path = lambda *_args, **_kwargs: None  # type: ignore[method-assign]
    return action.run(task_vars=task_vars), box


def started(**facts: Any) -> Dict[str, Any]:
    answer = {
        "changed": True,
        "outcome": "started",
        "cells_left": 3,
        "recopy_cells": [],
        "kept_cells": [],
        "changes": [],
        "state": "running",
        "detach": "setsid",
        "pgid": 812,
        "attach": "tail -f /data/runs/abl/runner.log",
        "launch_id": "20261204T101500Z-3fa9c2",
        "cells": [{"name": name, "status": "pending", "done": False} for name in "abc"],
        "invocation": {"module_args": {"secrets": {"WANDB_API_KEY": SECRET}}},
    }
    answer.update(facts)
    return answer


def fake_venv(tmp_path: Path) -> str:
    """A "venv Python" that imports everything: the probe then finds the runtime ready."""
    python = tmp_path / "venv-python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return str(python)


# ---- validation first -----------------------------------------------------------------------------------------


def test_a_cell_without_a_name_is_refused_at_validate_and_the_report_is_still_written(tmp_path: Path) -> None:
    cells = [{"name": "a", "lr": 0.1}, {"lr": 0.2}]
    result, box = launch(play(tmp_path, launch_cells=cells))
    assert box.calls == []  # nothing reached the box
    assert (result["status"], result["step"]) == ("REFUSED", "validate")
    assert "launch_cells[1] has no name" in result["reason"]
    assert result["line"].startswith("h1  REFUSED  abl at validate: launch_cells[1] has no name")
    assert not result.get("failed")  # the report step sees it; the verdict fails it

    report = run_report({"h1": result, "h2": None}, tmp_path / "reports")
    assert not report.get("failed")
    document = json.loads(Path(report["report"]).read_text())
    assert document["stage"] == "launch"
    assert [(host["host"], host["status"]) for host in document["hosts"]] == [("h1", "REFUSED"), ("h2", "REFUSED")]
    assert stat.S_IMODE(os.stat(report["report"]).st_mode) == 0o600
    assert report["msg"][-2] == "SUMMARY: 2 hosts: 2 REFUSED; refused: h1 (validate), h2 (validate)"
    assert verdict(result) == {"failed": True, "msg": result["line"]}


def test_a_typod_variable_is_named_with_the_closest_valid_one_before_any_box_call(tmp_path: Path) -> None:
    task_vars = play(tmp_path, allow_concurrent=True, launch_alow_concurrent=True)
    result, box = launch(task_vars, [started()])
    assert box.calls == []
    assert result["status"] == "REFUSED" and result["step"] == "validate"
    assert "allow_concurrent is not a variable of launch (did you mean launch_allow_concurrent?)" in result["reason"]
    assert (
        "launch_alow_concurrent is not a variable of launch (did you mean launch_allow_concurrent?)"
        in (result["reason"])
    )


def test_a_wrong_type_is_told_in_plain_words_with_the_typos(tmp_path: Path) -> None:
    result, box = launch(play(tmp_path, launch_gpus_per_cell="two", launch_stop_on_falure=True))
    assert box.calls == []
    assert "launch_gpus_per_cell must be a whole number" in result["reason"]
    assert "did you mean launch_stop_on_failure?" in result["reason"]
    assert "_AnsibleTagged" not in result["reason"]


# ---- the steps ------------------------------------------------------------------------------------------------


def test_a_start_runs_the_module_with_the_runtime_venv_and_records_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RGT_TEST_KEY", SECRET)
    task_vars = play(
        tmp_path,
        launch_runtime_python=fake_venv(tmp_path),
        launch_secrets={"WANDB_API_KEY": {"env": "RGT_TEST_KEY"}},
    )
    result, box = launch(task_vars, [started()])
    assert box.modules() == ["ansible.builtin.command", "remote_gpu.trainer.training_run"]
    probe, run = box.calls
    assert probe["python"] == "python3" and probe["check_mode"] is False
    assert run["python"] == task_vars["launch_runtime_python"]  # the venv the probe found ready
    assert run["no_log"] is True and run["args"]["secrets"] == {"WANDB_API_KEY": SECRET}
    assert run["args"]["cells"][0]["command"] == ["python", "train.py", "--lr", "0.1"]
    assert result["status"] == "STARTED" and result["changed"] is True and not result.get("failed")
    assert result["launch_id"] == "20261204T101500Z-3fa9c2"
    assert result["line"].startswith("h1  STARTED  abl (3 cells left): 3 cells (3 pending); setsid pgid 812")
    assert SECRET not in json.dumps(result) and "invocation" not in result
    assert result["warnings"] == []


def test_without_a_ready_venv_the_base_python_runs_it_and_a_warning_says_so(tmp_path: Path) -> None:
    result, box = launch(play(tmp_path), [started()])
    assert box.calls[-1]["python"] == "python3"
    assert result["python"] == "python3"
    assert "is not ready (run preflight)" in result["warnings"][0]


def test_a_resume_says_how_many_cells_are_left_and_re_copied(tmp_path: Path) -> None:
    answer = started(outcome="resumed", cells_left=1, recopy_cells=["b"], kept_cells=["a"])
    answer["cells"] = [
        {"name": "a", "status": "succeeded", "sync": "verified", "done": True},
        {"name": "b", "status": "succeeded", "sync": "failed", "done": False},
        {"name": "c", "status": "pending", "done": False},
    ]
    result, _box = launch(play(tmp_path), [answer])
    assert result["status"] == "RESUMED"
    assert (result["cells_left"], result["recopy_cells"], result["kept_cells"]) == (1, ["b"], ["a"])
    assert result["line"].startswith(
        "h1  RESUMED  abl (1 cell left; 1 re-copied): 3 cells (2 succeeded, 1 pending, 1 sync failed); 1 kept; "
        "re-copies without retraining: b"
    )


@pytest.mark.parametrize(
    ("outcome", "status"), [("already_running", "ALREADY_RUNNING"), ("done", "DONE"), ("started", "STARTED")]
)
def test_the_status_is_the_modules_outcome(tmp_path: Path, outcome: str, status: str) -> None:
    result, _box = launch(play(tmp_path), [started(outcome=outcome, changed=outcome == "started")])
    assert result["status"] == status and result["outcome"] == outcome
    assert result["changed"] is (outcome == "started")


def test_check_mode_says_what_would_happen_and_runs_the_module_in_check_mode(tmp_path: Path) -> None:
    result, box = launch(play(tmp_path), [started()], check_mode=True)
    assert [call["check_mode"] for call in box.calls] == [False, True]  # the probe only reads
    assert result["line"].startswith("h1  STARTED  abl (check mode: would start; 3 cells left)")
    assert result["changed"] is False and result["check_mode"] is True


def test_the_modules_refusal_of_a_changed_spec_is_refused_not_failed(tmp_path: Path) -> None:
    refusal = {
        "failed": True,
        "msg": "run abl on this box has another spec: set launch_apply_changes: true ...; changes: cell c added",
        "changes": ["cell c added"],
        "run": "abl",
    }
    result, _box = launch(play(tmp_path), [refusal])
    assert (result["status"], result["step"]) == ("REFUSED", "relaunch")
    assert result["changes"] == ["cell c added"]
    assert result["line"].startswith("h1  REFUSED  abl at relaunch: run abl on this box has another spec")
    assert result["line"].endswith("nothing started")


def test_a_box_that_cannot_arm_its_autostop_is_refused_at_autostop_not_failed(tmp_path: Path) -> None:
    refusal = {
        "failed": True,
        "msg": "autostop: RUNPOD_API_KEY is not set on this box, neither in this environment nor in /proc/1/environ",
        "autostop_refused": True,
        "run": "abl",
    }
    result, _box = launch(runpod(tmp_path), [refusal])
    assert (result["status"], result["step"]) == ("REFUSED", "autostop")
    assert result["line"].startswith("h1  REFUSED  abl at autostop: autostop: RUNPOD_API_KEY is not set on this box")
    assert "nothing started" in result["line"]


def test_a_module_failure_without_a_refusal_fails_the_box(tmp_path: Path) -> None:
    result, _box = launch(play(tmp_path), [{"failed": True, "msg": "workdir /work/proj is not a directory"}])
    assert (result["status"], result["step"]) == ("FAILED", "training_run")
    assert verdict(result)["failed"] is True


def test_a_box_that_does_not_answer_is_unreachable_and_still_reported(tmp_path: Path) -> None:
    task_vars = play(tmp_path)

    def gone(*_args: Any, **_kwargs: Any) -> Dict[str, Any]:
        raise AnsibleConnectionFailure("Failed to connect to the host via ssh: Connection timed out")

    templar = Templar(loader=DataLoader(), variables=task_vars)
    args = {"run": "abl", "cells": task_vars["launch_cells"], "workdir": "/work/proj", "skip_preflight": True}
    action = ActionModule(
        FakeTask(args, False), FakeConnection(), None, loader=DataLoader(), templar=templar, shared_loader_obj=None
    )
    action._execute_module = gone  # type: ignore[method-assign]
    action._remove_tmp_path = lambda *_args, **_kwargs: None  # type: ignore[method-assign]
    result = action.run(task_vars=task_vars)
    assert (result["status"], result["step"]) == ("UNREACHABLE", "unreachable")
    assert result["line"] == "h1  UNREACHABLE  Failed to connect to the host via ssh: Connection timed out"
    assert verdict(result) == {"unreachable": True, "msg": result["line"]}


def test_a_data_dir_the_probe_cannot_use_fails_before_the_code_and_the_module(tmp_path: Path) -> None:
    result, box = launch(play(tmp_path, data_dir=str(tmp_path / "missing")), [started()])
    assert box.modules() == ["ansible.builtin.command"]
    assert (result["status"], result["step"]) == ("FAILED", "probe")
    assert result["reason"] == f"data_dir {tmp_path / 'missing'} does not exist"


def test_a_box_call_past_its_bound_fails_the_step(tmp_path: Path) -> None:
    def slow(_args: Dict[str, Any]) -> Dict[str, Any]:
        time.sleep(5)
        return started()

    result, _box = launch(play(tmp_path, launch_task_timeout_s=1), [slow])
    assert (result["status"], result["step"]) == ("FAILED", "training_run")
    assert result["reason"] == "remote_gpu.trainer.training_run did not answer within 1 s"


# ---- the preflight gate ---------------------------------------------------------------------------------------


def preflight_report(directory: Path, age_s: float, **statuses: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    generated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - age_s))
    findings = [{"code": "gpu_lost", "level": "FAIL", "action": "re_rent"}]
    hosts = [{"host": h, "status": s, "findings": findings if s == "FAIL" else []} for h, s in statuses.items()]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() - age_s))
    (directory / f"preflight-{stamp}.json").write_text(json.dumps({"generated_at": generated, "hosts": hosts}))


def test_a_fresh_preflight_fail_refuses_the_box_before_any_box_call(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    preflight_report(reports, 7200, h1="PASS")
    preflight_report(reports, 60, h1="FAIL")
    task_vars = play(tmp_path, launch_skip_preflight=None, launch_preflight_report_dir=str(reports))
    result, box = launch(task_vars, [started()])
    assert box.calls == []
    assert (result["status"], result["step"]) == ("REFUSED", "preflight")
    assert result["reason"].startswith("preflight FAIL (preflight-") and result["reason"].endswith(
        "gpu_lost -> re_rent"
    )


def test_this_plays_preflight_decides_over_any_report(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    preflight_report(reports, 60, h1="FAIL")
    task_vars = play(tmp_path, launch_skip_preflight=None, launch_preflight_report_dir=str(reports))
    task_vars["preflight_result"] = {"status": "PASS", "findings": []}
    result, _box = launch(task_vars, [started()])
    assert result["status"] == "STARTED" and result["gate"]["reason"] == "preflight PASS (this play)"


NOW = 1_800_000_000.0
GATE = {"skip": False, "require": False, "max_age_s": 3600}


def report_of(age_s: float, **statuses: str) -> Dict[str, Any]:
    generated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - age_s))
    findings = [{"code": "gpu_lost", "level": "FAIL", "action": "re_rent"}]
    hosts = [{"host": h, "status": s, "findings": findings if s == "FAIL" else []} for h, s in statuses.items()]
    return {"generated_at": generated, "hosts": hosts}


def gate(host: str, report: Any = None, play_result: Any = None, **settings: Any) -> Dict[str, Any]:
    return flow.preflight_gate(
        host, dict(GATE, **settings), play_result=play_result, report=report, report_file="preflight-x.json", now=NOW
    )


def test_the_gate_allows_pass_warn_and_unreachable_and_ignores_a_stale_report_unless_required() -> None:
    report = report_of(60, b="WARN", c="PASS", d="UNREACHABLE")
    assert [gate(h, report)["allowed"] for h in "bcd"] == [True, True, True]
    assert gate("c", report)["age_s"] == 60.0
    stale = gate("a", report_of(7200, a="FAIL"))
    assert stale["allowed"] and stale["status"] is None and "7200 s old" in stale["reason"]
    required = gate("a", report_of(7200, a="FAIL"), require=True)
    assert not required["allowed"] and "launch_require_preflight" in required["reason"]
    assert not gate("z", {}, require=True)["allowed"]
    assert gate("z", {"generated_at": "garbage", "hosts": []})["allowed"]
    skipped = gate("a", play_result={"status": "FAIL"}, skip=True)
    assert skipped["allowed"] and skipped["source"] == "skipped"


def test_the_newest_report_is_chosen_by_its_stamped_name_and_an_unreadable_one_is_said(tmp_path: Path) -> None:
    (tmp_path / "preflight-20261203T074000Z.json").write_text("{}")
    (tmp_path / "preflight-20261204T074000Z.json").write_text("not json")
    (tmp_path / "preflight-notes.json").write_text("{}")
    name, document, problem = flow.newest_report(str(tmp_path))
    assert name == "preflight-20261204T074000Z.json" and document is None and "cannot be read" in problem
    assert flow.newest_report(str(tmp_path / "none")) == ("", None, "")


# ---- sharding and --limit -------------------------------------------------------------------------------------


def test_the_shard_index_comes_from_the_inventory_whatever_the_play_hosts(tmp_path: Path) -> None:
    task_vars = play(tmp_path, host="h2", launch_shard=True)
    task_vars["ansible_play_hosts_all"] = task_vars["ansible_play_hosts"] = ["h2"]  # --limit h2
    result, box = launch(task_vars, [started(cells_left=1)])
    run = box.calls[-1]["args"]
    assert run["shard"] == {"index": 1, "count": 3}
    assert [cell["name"] for cell in run["cells"]] == ["b"]
    assert result["shard"] == {"index": 1, "count": 3, "cells_total": 3}
    assert "shard 2/3" in result["line"]


def test_a_shard_without_a_cell_asks_no_box(tmp_path: Path) -> None:
    task_vars = play(tmp_path, host="h3", launch_shard=True, launch_cells=[{"name": "a"}, {"name": "b"}])
    result, box = launch(task_vars)
    assert box.calls == []
    assert result["status"] == "DONE" and result["changed"] is False
    assert result["line"] == (
        "h3  DONE  abl: no cell of the sweep falls to this box, nothing to launch; shard 3/3; "
        "preflight skipped (launch_skip_preflight)"
    )


# ---- the code -------------------------------------------------------------------------------------------------


def code_play(tmp_path: Path, **changes: Any) -> Dict[str, Any]:
    source = tmp_path / "src"
    if not source.exists():  # once: a rewritten file would be sent again
        (source / "pkg").mkdir(parents=True)
        (source / "train.py").write_text("print('hi')\n")
        (source / "pkg" / "model.py").write_text("x = 1\n")
        (source / "skip.pyc").write_text("")
    dest = tmp_path / "box" / "code"
    return play(tmp_path, launch_workdir=None, launch_code_dir=str(source), launch_code_dest=str(dest), **changes)


def test_the_code_is_pushed_with_rsync_then_nothing_is_sent_again(tmp_path: Path) -> None:
    result, box = launch(code_play(tmp_path), [started()])
    assert box.modules() == ["ansible.builtin.command", "ansible.builtin.file", "remote_gpu.trainer.training_run"]
    code = result["code"]
    assert code["kind"] == "rsync" and sorted(code["files"]) == ["pkg/model.py", "train.py"]  # *.pyc excluded
    assert (tmp_path / "box" / "code" / "pkg" / "model.py").read_text() == "x = 1\n"
    assert box.calls[-1]["args"]["workdir"] == str(tmp_path / "box" / "code")
    assert "code (rsync): 2 files sent" in result["line"]

    again, _box = launch(code_play(tmp_path), [started(outcome="already_running", changed=False)])
    assert again["code"]["files_count"] == 0 and again["changed"] is False
    assert "code (rsync): up to date" in again["line"]


def test_check_mode_lists_what_rsync_would_send_and_deletes_only_when_asked(tmp_path: Path) -> None:
    launch(code_play(tmp_path), [started()])
    (tmp_path / "src" / "new.py").write_text("")
    (tmp_path / "box" / "code" / "box_only.txt").write_text("")
    result, _box = launch(code_play(tmp_path, launch_code_delete=True), [started()], check_mode=True)
    assert result["code"]["files"] == ["new.py"] and result["code"]["deleted"] == ["box_only.txt"]
    assert "--dry-run" in result["code"]["argv"] and "--delete" in result["code"]["argv"]
    assert not (tmp_path / "box" / "code" / "new.py").exists()
    assert (tmp_path / "box" / "code" / "box_only.txt").exists()
    assert "code (rsync): would send 1 files, delete 1" in result["line"]

    kept, _box = launch(code_play(tmp_path), [started()])
    assert kept["code"]["deleted"] == [] and (tmp_path / "box" / "code" / "box_only.txt").exists()


def test_check_mode_on_a_box_without_the_code_directory_sends_nothing(tmp_path: Path) -> None:
    result, box = launch(code_play(tmp_path), [started()], check_mode=True)
    assert not (tmp_path / "box" / "code").exists()
    assert result["code"]["note"].endswith("does not exist yet: every file would be sent")
    assert box.modules()[-1] == "remote_gpu.trainer.training_run"


def test_git_runs_on_the_box_with_its_environment_and_a_token_never_shows(tmp_path: Path) -> None:
    repo = "https://user:tok3n@git.example.com/lab/proj.git"

    def checkout(args: Dict[str, Any]) -> Dict[str, Any]:
        return {"changed": True, "after": "0123456789abcdef", "before": None}

    task_vars = play(
        tmp_path, launch_workdir=None, launch_git_repo=repo, launch_git_environment={"https_proxy": "http://p:3128"}
    )
    result, box = launch(task_vars, [checkout, started()])
    git = box.calls[1]
    assert git["module"] == "ansible.builtin.git" and git["env"] == [{"https_proxy": "http://p:3128"}]
    assert git["args"]["repo"] == repo and git["args"]["version"] == "HEAD"
    assert box.action._task.environment == []  # the task's own environment is back
    assert result["code"]["repo"] == "https://<redacted>@git.example.com/lab/proj.git"
    assert "tok3n" not in json.dumps(result)
    assert "code (git): checked out 0123456789ab" in result["line"]


def test_the_push_argv_keeps_the_connections_ssh_and_quotes_nothing_for_a_shell(tmp_path: Path) -> None:
    argv = rsync.push_argv(
        FakeConnection(), "/src/proj", "/data/code/r1", excludes=[".git"], delete=False, dry_run=False, io_timeout_s=9
    )
    assert argv[-2:] == ["/src/proj/", "/data/code/r1/"]
    assert "--exclude=.git" in argv and "--timeout=9" in argv and "--delete" not in argv
    with pytest.raises(rsync.RsyncError, match="plain path"):
        rsync.push_argv(FakeConnection(), "/src", "/data/$(reboot)", dry_run=False, io_timeout_s=9)
    with pytest.raises(rsync.RsyncError, match="absolute"):
        rsync.push_argv(FakeConnection(), "src", "/data/x", dry_run=False, io_timeout_s=9)


# ---- the report and the verdict -------------------------------------------------------------------------------


def run_report(records: Dict[str, Any], directory: Path) -> Dict[str, Any]:
    task = FakeTask({"stage": "launch", "result_var": "launch_box", "report_dir": str(directory)}, False)
    action = stage_report.ActionModule(task, FakeConnection(), None, loader=None, templar=None, shared_loader_obj=None)
    hostvars = {host: ({"launch_box": record} if record else {}) for host, record in records.items()}
    return action.run(task_vars={"ansible_play_hosts_all": list(records), "hostvars": hostvars})


def verdict(record: Dict[str, Any]) -> Dict[str, Any]:
    task = FakeTask({"result": record, "failing": ["REFUSED", "FAILED"]}, False)
    action = stage_verdict.ActionModule(task, FakeConnection(), None, loader=None, templar=None, shared_loader_obj=None)
    return {key: value for key, value in action.run(task_vars={}).items() if key in ("failed", "unreachable", "msg")}


def test_the_fleet_report_names_the_cells_a_refused_shard_did_not_launch(tmp_path: Path) -> None:
    good, _box = launch(play(tmp_path, host="h1", launch_shard=True), [started(cells_left=1)])
    task_vars = play(tmp_path, host="h2", launch_shard=True)
    refused, _box = launch(task_vars, [{"failed": True, "msg": "run abl: refused", "changes": []}])
    report = run_report({"h1": good, "h2": refused}, tmp_path / "reports")
    document = json.loads(Path(report["report"]).read_text())
    assert document["summary"]["cells_not_launched"] == ["b"]
    assert document["summary"]["line"] == (
        "2 hosts: 1 STARTED, 1 REFUSED; refused: h2 (relaunch); cells not launched: b"
    )
    assert "msg" not in document["hosts"][0]  # a record keeps its own keys only


def test_the_flow_finds_the_runtime_roles_probe_in_the_collection() -> None:
    assert flow.PROBE_SCRIPT.is_file()


# ---- autostop and cost (issue 22) -----------------------------------------------------------------------------

SELF_STOP = self_stop("runpod")


def runpod(tmp_path: Path, **changes: Any) -> Dict[str, Any]:
    return play(tmp_path, launch_autostop=True, self_stop=SELF_STOP, platform="runpod", hourly_usd=2.0, **changes)


def hours_ago(hours: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - hours * 3600))


def armed_answer(changed: bool = True, **facts: Any) -> Dict[str, Any]:
    """training_run's word on the box's autostop, as helper B's module returns it."""
    autostop = {
        "armed": True, "changed": changed, "state": "waiting", "reason": "run abl is live", "watcher_pid": 4321,
        "watcher_started": changed, "generation": "0123456789ab", "idle_minutes": 30.0,
        "controller_silence_hours": None, "check_interval_s": 60.0, "instance_id": "pod-1",
        "command": "runpodctl pod stop pod-1", "would": None, "decision": None,
    }  # fmt: skip
    autostop.update(facts)
    return started(autostop=autostop, box_started_at=hours_ago(2))


def test_autostop_is_armed_through_training_run_and_the_line_says_when_the_box_stops_and_its_cost(
    tmp_path: Path,
) -> None:
    result, box = launch(runpod(tmp_path), [armed_answer()])
    asked = box.calls[-1]["args"]["autostop"]
    assert asked == {
        "idle_minutes": 30.0, "controller_silence_hours": None, "check_interval_s": 60.0, "disarm": False,
        "id_env": ["RUNPOD_POD_ID"], "env": {"RUNPOD_API_KEY": "RUNPOD_API_KEY"}, "verb": SELF_STOP["verb"],
        "platform": "runpod",
    }  # fmt: skip
    assert result["status"] == "STARTED"
    assert result["autostop"]["asked"] == "arm" and result["autostop"]["watcher_pid"] == 4321
    assert result["cost"]["hourly_usd"] == 2.0 and result["cost"]["usd"] == 4.0
    assert re.search(
        r"; autostop armed: stops the box 30 min after every run is secured; \$4\.00 so far since \d\d-\d\d \d\d:\d\d "
        r"at \$2\.00/h$",
        result["line"],
    )
    again, _box = launch(runpod(tmp_path), [armed_answer(changed=False)])
    assert "; autostop stays armed: stops the box 30 min after every run is secured;" in again["line"]


def test_the_dead_man_and_check_mode_are_said_on_the_line(tmp_path: Path) -> None:
    task_vars = runpod(tmp_path, launch_autostop_controller_silence_hours=6)
    answer = armed_answer(controller_silence_hours=6.0, generation=None, would="would write armed.json")
    result, box = launch(task_vars, [answer], check_mode=True)
    assert box.calls[-1]["check_mode"] is True
    assert (
        "check mode: would arm autostop: stops the box 30 min after every run is secured (dead-man: 6 h without "
        "a patrol tick)" in result["line"]
    )
    dead_man = armed_answer(idle_minutes=None, controller_silence_hours=6.0)
    result, _box = launch(runpod(tmp_path, launch_autostop_idle_minutes=None), [dead_man])
    assert (
        "autostop armed: stops the box after 6 h without a patrol tick, once every run is secured (dead-man only)"
        in result["line"]
    )


def test_a_watcher_in_trouble_is_said_when_launch_finds_it(tmp_path: Path) -> None:
    decision = {"state": "gate_failed", "reason": "durable: cells/a/best.pt differs from its manifest", "due_at": None}
    result, _box = launch(runpod(tmp_path), [armed_answer(changed=False, decision=decision)])
    assert "(its last decision: gate_failed: durable: cells/a/best.pt differs from its manifest)" in result["line"]


@pytest.mark.parametrize("platform", ["lambda", "autodl", "generic_ssh"])
def test_autostop_on_a_platform_without_self_stop_is_refused_before_any_box_call(tmp_path: Path, platform: str) -> None:
    task_vars = play(
        tmp_path, launch_autostop=True, self_stop={"unsupported": "no way to stop itself"}, platform=platform,
        hourly_usd=2.49,
    )  # fmt: skip
    result, box = launch(task_vars, [started()])
    assert box.calls == []
    assert (result["status"], result["step"]) == ("REFUSED", "validate")
    assert result["reason"].startswith(f"launch_autostop: {platform}'s boxes cannot stop themselves (no way to")
    assert "idle_billing" in result["reason"] and "remote_gpu.trainer.teardown" in result["reason"]
    assert result["line"].endswith("; nothing started; $2.49/h")  # a refused box bills all the same
    assert result["cost"] == {"hourly_usd": 2.49, "since": None, "hours": None, "usd": None}
    report = run_report({"h1": result}, tmp_path / "reports")
    summary = json.loads(Path(report["report"]).read_text())["summary"]
    assert summary["hourly_usd_total"] == 2.49 and summary["line"].endswith("; $2.49/h")


def test_a_typod_autostop_variable_refuses_the_box_and_a_bad_rate_is_a_warning_on_it(tmp_path: Path) -> None:
    result, box = launch(play(tmp_path, launch_autostop_idle_minute=10, hourly_usd="cheap"), [started()])
    assert box.calls == [] and result["status"] == "REFUSED"
    assert (
        "launch_autostop_idle_minute is not a variable of launch (did you mean launch_autostop_idle_minutes?)"
        in (result["reason"])
    )
    warning = "hourly_usd: must be a number of US dollars per hour (>= 0), not 'cheap'"
    assert warning not in result["reason"] and result["warnings"] == [warning] and result["cost"] is None
    alone, box = launch(play(tmp_path, hourly_usd="cheap"), [started()])  # a bad rate alone refuses nothing
    assert alone["status"] == "STARTED" and alone["warnings"][0] == warning and alone["cost"] is None


def test_disarm_and_a_launch_without_autostop(tmp_path: Path) -> None:
    disarmed = armed_answer(armed=False, state="disarmed", reason="disarmed by launch")
    nothing = armed_answer(armed=False, changed=False, state="not_armed", reason="nothing was armed")
    result, box = launch(play(tmp_path, launch_autostop_disarm=True), [disarmed])
    assert box.calls[-1]["args"]["autostop"] == {"disarm": True}
    assert result["autostop"]["asked"] == "disarm" and "; autostop disarmed" in result["line"]
    result, _box = launch(play(tmp_path, launch_autostop_disarm=True), [nothing])
    assert result["line"].endswith("; preflight skipped (launch_skip_preflight); autostop not armed")

    result, box = launch(play(tmp_path), [started()])
    assert "autostop" not in box.calls[-1]["args"]
    assert result["autostop"] is None and result["cost"] is None and "autostop" not in result["line"]


def test_a_training_run_that_does_not_say_it_armed_is_a_warning_not_silence(tmp_path: Path) -> None:
    result, _box = launch(runpod(tmp_path), [started()])
    assert "launch asked training_run to arm autostop and it did not say it did" in result["warnings"]
