"""stage_lines prints only the report's lines and unexpected failures without -v, and the default output with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

import pytest
import yaml
from ansible import constants as C
from ansible import context
from ansible.executor.stats import AggregateStats
from ansible.executor.task_result import CallbackTaskResult
from ansible.inventory.host import Host
from ansible.module_utils._internal._messages import Event, WarningSummary
from ansible.playbook.play import Play
from ansible.playbook.task import Task
from ansible.plugins.callback import CallbackBase
from ansible.plugins.callback import default as default_callback
from ansible.plugins.loader import fragment_loader
from ansible.utils.context_objects import CLIArgs
from ansible.utils.plugin_docs import add_fragments

from ansible_collections.remote_gpu.trainer.plugins.callback import stage_lines
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_lines as teardown_lines

ROOT = Path(__file__).resolve().parents[4]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
REPORT_LINES = [
    "b1  REFUSED  runs alpha at cells: cell c2 still running",
    "  WARNING: the durable copy is 3 days old",
    "SUMMARY: 1 hosts: 1 REFUSED; refused: b1 (cells)",
    "report: reports/teardown-20260101T000000Z.json",
]


def configured(module: ModuleType, name: str) -> CallbackBase:
    """A callback with its documented options set, as the plugin loader would hand it over.

    The loader resolves ``ansible.builtin.*`` fragments through the collection finder, which these tests do not
    install in the shared test process; the fragments' legacy names are the same files.
    """
    doc = yaml.safe_load(module.DOCUMENTATION)
    fragments = doc.get("extends_documentation_fragment") or []
    doc["extends_documentation_fragment"] = [fragment.replace("ansible.builtin.", "") for fragment in fragments]
    add_fragments(doc, module.__file__, fragment_loader=fragment_loader)
    C.config.initialize_plugin_configuration_definitions("callback", name, doc["options"])
    callback = module.CallbackModule()
    callback._load_name = name
    callback.set_options()
    return callback


@pytest.fixture
def callback() -> CallbackBase:
    return configured(stage_lines, stage_lines.CallbackModule.CALLBACK_NAME)


@pytest.fixture
def verbosity(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    def set_to(level: int) -> None:
        monkeypatch.setattr(CallbackBase()._display, "verbosity", level)

    set_to(0)
    return set_to


def task(action: str, name: str, **fields: Any) -> Task:
    made = Task()
    made.action = action
    made.name = name
    for key, value in fields.items():
        setattr(made, key, value)
    return made


def result(of: Task, data: Dict[str, Any], host: str = "b1") -> CallbackTaskResult:
    """The result as the task queue hands it to callbacks: 2.21 wraps the result dict, 2.19 takes it as is."""
    try:
        from ansible._internal._task import UnifiedTaskResult  # noqa: PLC0415  (ansible-core 2.21+)
    except ImportError:
        return CallbackTaskResult(Host(host), of, data, {"name": of.name})
    return CallbackTaskResult(Host(host), of, UnifiedTaskResult.from_action_result_dict(dict(data)))


def report_result(failed: bool = False) -> CallbackTaskResult:
    data = {"changed": False, "msg": list(REPORT_LINES), "_ansible_verbose_always": True, "failed": failed}
    return result(task(stage_lines.REPORT_ACTION, "Write the fleet's teardown report", run_once=True), data)


def a_play(callback: CallbackBase, stats: Optional[AggregateStats] = None) -> None:
    """A play's worth of events: banners, ok/changed/skipped, an ignored failure, the report, the verdict, recap."""
    callback.v2_playbook_on_play_start(Play.load({"name": "Tear down", "hosts": "all", "gather_facts": False}))
    hello = task("ansible.builtin.debug", "Say hello")
    callback.v2_playbook_on_task_start(hello, is_conditional=False)
    callback.v2_runner_on_ok(result(hello, {"msg": "hello", "_ansible_verbose_always": True}))
    callback.v2_runner_on_ok(result(hello, {"msg": "hello", "changed": True}, host="b2"))
    callback.v2_runner_on_skipped(result(hello, {"skip_reason": "Conditional result was False"}, host="b3"))
    ignored = task("ansible.builtin.fail", "Fail on purpose", ignore_errors=True)
    callback.v2_playbook_on_task_start(ignored, is_conditional=False)
    callback.v2_runner_on_failed(result(ignored, {"msg": "ignored failure"}), ignore_errors=True)
    report = report_result()
    callback.v2_playbook_on_task_start(report.task, is_conditional=False)
    callback.v2_runner_on_ok(report)
    verdict = task(stage_lines.VERDICT_ACTION, "Fail the boxes refused")
    callback.v2_playbook_on_task_start(verdict, is_conditional=False)
    callback.v2_runner_on_failed(result(verdict, {"msg": "b1  REFUSED  runs alpha at cells: cell c2 still running"}))
    callback.v2_runner_on_unreachable(result(verdict, {"msg": "b2  UNREACHABLE  ssh: timed out"}, host="b2"))
    if stats is None:
        stats = AggregateStats()
        for host, what in (("b1", "ok"), ("b1", "failures"), ("b2", "changed"), ("b3", "skipped")):
            stats.increment(what, host)
    callback.v2_playbook_on_stats(stats)


def test_quiet_prints_the_report_lines_verbatim_and_nothing_else(
    callback: CallbackBase, verbosity: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    a_play(callback)
    out = capsys.readouterr().out
    assert out.splitlines() == REPORT_LINES  # no banner, no ok/changed/skipped, no verdict line, no recap


def test_quiet_prints_one_line_per_unexpected_failure(
    callback: CallbackBase, verbosity: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    broken = task("ansible.builtin.command", "Check the data dir")
    callback.v2_runner_on_failed(
        result(broken, {"msg": "non-zero return code", "rc": 2, "stderr": "ls: /data: No such file\nexit 2\n"})
    )
    multiline = task("ansible.builtin.fail", "Break on purpose")
    callback.v2_runner_on_failed(result(multiline, {"msg": "boom\n  second line"}, host="b2"))
    looped = task("ansible.builtin.fail", "Each cell", loop=["c1", "c2"])
    items = [{"item": "c1", "failed": False, "msg": "fine"}, {"item": "c2", "failed": True, "msg": "c2 hung"}]
    callback.v2_runner_on_failed(result(looped, {"msg": "One or more items failed", "results": items}))
    secret = task("ansible.builtin.uri", "Post the webhook")
    callback.v2_runner_on_failed(result(secret, {"censored": "the output has been hidden (no_log)"}))
    reach = task("ansible.builtin.ping", "Reach the box")
    callback.v2_runner_on_unreachable(result(reach, {"msg": "Failed to connect to the host via ssh"}, host="b3"))
    assert capsys.readouterr().out.splitlines() == [
        "b1: Check the data dir: non-zero return code (stderr: exit 2)",
        "b2: Break on purpose: boom second line",
        "b1: Each cell: One or more items failed: (c2) c2 hung",
        "b1: Post the webhook: the output has been hidden (no_log)",
        "b3: Reach the box: Failed to connect to the host via ssh",
    ]


def test_quiet_keeps_ignored_and_verdict_outcomes_off_the_console(
    callback: CallbackBase, verbosity: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    callback.v2_runner_on_failed(result(task("ansible.builtin.fail", "Ignored"), {"msg": "x"}), ignore_errors=True)
    tolerant = task("ansible.builtin.ping", "Maybe gone", ignore_unreachable=True)
    callback.v2_runner_on_unreachable(result(tolerant, {"msg": "gone"}))
    # Under a short name (play-level `collections:`), the action is recognised by what it resolved to.
    short = task("stage_verdict", "Verdict")
    short._resolved_action = stage_lines.VERDICT_ACTION
    callback.v2_runner_on_failed(result(short, {"msg": "b1  FAILED"}))
    item = task("ansible.builtin.fail", "Each cell", loop=["c1"])
    callback.v2_runner_item_on_failed(result(item, {"item": "c1", "msg": "c1 failed"}))
    assert capsys.readouterr().out == ""


def test_a_report_that_failed_still_prints_its_lines(
    callback: CallbackBase, verbosity: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    failed = report_result(failed=True)
    failed.result["msg"] = [*REPORT_LINES[:3], "report NOT written: [Errno 13] Permission denied: 'reports'"]
    callback.v2_runner_on_failed(failed)
    assert capsys.readouterr().out.splitlines() == failed.result["msg"]


def test_a_debug_task_that_opts_in_prints_its_lines(
    callback: CallbackBase, verbosity: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ["b1  PASS  8 GPUs", "SUMMARY: 1 hosts: 1 PASS", "report: reports/preflight-20260101T000000Z.json"]
    shown = task("ansible.builtin.debug", "Show one line per host", vars={stage_lines.SHOW_VAR: True})
    callback.v2_runner_on_ok(result(shown, {"msg": lines, "_ansible_verbose_always": True}))
    templated = task("ansible.builtin.debug", "Not asked", vars={stage_lines.SHOW_VAR: "{{ maybe }}"})
    callback.v2_runner_on_ok(result(templated, {"msg": ["not shown"], "_ansible_verbose_always": True}))
    assert capsys.readouterr().out.splitlines() == lines


def test_quiet_still_shows_a_task_warning(
    callback: CallbackBase, verbosity: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    warning = WarningSummary(event=Event(msg="stage_lines test warning 7f3a"))
    warned = result(task("ansible.builtin.debug", "Warn"), {"msg": "x", "warnings": [warning]})
    callback._current_task_result = warned  # what the task queue manager sets around each result callback
    callback.v2_runner_on_ok(warned)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[WARNING]: stage_lines test warning 7f3a" in captured.err


def test_verbose_output_is_the_default_callbacks(
    callback: CallbackBase,
    verbosity: Callable[[int], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(context, "CLIARGS", CLIArgs({"check": False}))  # the recap reads ansible-playbook's options
    default = configured(default_callback, "default")
    verbosity(1)
    stats = AggregateStats()
    stats.increment("ok", "b1")
    a_play(default, stats)
    expected = capsys.readouterr()
    a_play(callback, stats)
    shown = capsys.readouterr()
    assert (shown.out, shown.err) == (expected.out, expected.err)
    assert "PLAY [Tear down]" in shown.out and "PLAY RECAP" in shown.out and "fatal: [b1]: FAILED!" in shown.out


# A real ansible-playbook: the collection found through ANSIBLE_COLLECTIONS_PATH, the shipped ansible.cfg.

PLAYBOOK = """\
- name: Console check
  hosts: boxes
  gather_facts: false
  collections: [remote_gpu.trainer]
  tasks:
    - name: Say hello
      ansible.builtin.debug:
        msg: hello
    - name: Show a report of another stage
      ansible.builtin.debug:
        msg: ["{{ inventory_hostname }}  PASS  8 GPUs"]
      vars:
        stage_lines_show: true
    - name: Fail but ignored
      ansible.builtin.fail:
        msg: ignored failure
      ignore_errors: true
    - name: Break on purpose
      ansible.builtin.fail:
        msg: "boom\\nsecond line"
      when: inventory_hostname == 'box2'
    - name: Record the teardown
      ansible.builtin.set_fact:
        teardown_box:
          host: "{{ inventory_hostname }}"
          status: REFUSED
          step: cells
          reason: cell c2 still running
          runs: [alpha]
          line: "{{ inventory_hostname }}  REFUSED  runs alpha at cells: cell c2 still running"
          warnings: [the durable copy is 3 days old]
    - name: Write the report
      remote_gpu.trainer.stage_report:
        stage: teardown
        result_var: teardown_box
        report_dir: reports
      run_once: true
    - name: Verdict
      stage_verdict:
        result: "{{ teardown_box }}"
        fleet_var: teardown_box
"""


@pytest.fixture
def playbook(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """``run(*args, **env)``: ansible-playbook on two local boxes; box2 fails, box1's record is REFUSED."""
    collections = tmp_path / "collections" / "ansible_collections" / "remote_gpu"
    collections.mkdir(parents=True)
    (collections / "trainer").symlink_to(ROOT)
    (tmp_path / "inventory.ini").write_text(
        textwrap.dedent(f"""\
            [boxes]
            box1
            box2
            [boxes:vars]
            ansible_connection=local
            ansible_python_interpreter={sys.executable}
            """)
    )
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    base = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    base.update(
        ANSIBLE_COLLECTIONS_PATH=str(tmp_path / "collections"),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_CONFIG=str(ROOT / "inventories" / "ansible.cfg"),
    )

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        command = [str(ANSIBLE_PLAYBOOK), "-i", "inventory.ini", "play.yml", *args]
        return subprocess.run(
            command, check=False, cwd=tmp_path, env={**base, **env}, capture_output=True, text=True, timeout=120
        )

    return run


def expected_report_lines(workdir: Path, path: str) -> List[str]:
    document = json.loads((workdir / path).read_text())
    shown = [line for record in document["hosts"] for line in teardown_lines.lines(record)]
    return [*shown, f"SUMMARY: {document['summary']['line']}", f"report: {path}"]


def test_a_real_playbook_prints_only_the_report_and_the_failure(
    playbook: Callable[..., subprocess.CompletedProcess], tmp_path: Path
) -> None:
    done = playbook()  # the stdout callback comes from the shipped inventories/ansible.cfg
    assert done.returncode == 2, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(lines[:2]) == ["box1  PASS  8 GPUs", "box2  PASS  8 GPUs"]  # the boxes answer in any order
    assert lines[2] == "box2: Break on purpose: boom second line"
    assert lines[-1].startswith(f"report: {tmp_path}/reports/teardown-")
    assert lines[3:] == expected_report_lines(tmp_path, lines[-1].removeprefix("report: "))
    assert lines[3:6] == [
        "box1  REFUSED  runs alpha at cells: cell c2 still running",
        "  WARNING: the durable copy is 3 days old",
        lines[5],
    ] and lines[5].startswith("box2  REFUSED")


def test_a_real_playbook_with_v_prints_the_default_output(
    playbook: Callable[..., subprocess.CompletedProcess],
) -> None:
    ours = playbook("-v", ANSIBLE_FORKS="1")  # one fork: the boxes answer in the same order in both runs
    default = playbook("-v", ANSIBLE_FORKS="1", ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default")
    assert ours.returncode == default.returncode == 2
    assert "PLAY [Console check]" in ours.stdout and "TASK [Say hello]" in ours.stdout and "PLAY RECAP" in ours.stdout

    def same(text: str) -> str:  # each run writes its own report file
        return re.sub(r"teardown-[0-9TZ-]+\.json", "teardown-X.json", text)

    assert same(ours.stdout) == same(default.stdout)
