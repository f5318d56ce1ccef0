"""Teardown's settings are checked before the box is touched: one line per problem, naming the variable."""

from __future__ import annotations

from typing import Any, Dict

import pytest
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _teardown_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import misspelt_short_names, unknown_variables
from ansible_collections.remote_gpu.trainer.tests.workload.harness import runpod_stop_verb

RUNPOD_VERBS = {"stop": runpod_stop_verb("pod-1")}


def validated(**args: Any) -> Dict[str, Any]:
    given = {"runs": "r1", "data_dir": "/data", "durable_dir": "/durable", **args}
    result = ArgumentSpecValidator(options.ARGUMENT_SPEC).validate(given)
    assert not result.error_messages, result.error_messages
    return result.validated_parameters


def problems_of(variables: Dict[str, Any] | None = None, **args: Any) -> list:
    settings, problems = options.settings_of(validated(**args), variables or {})
    assert (settings is None) == bool(problems)
    return problems


def test_good_settings_pass_and_name_the_runs() -> None:
    settings, problems = options.settings_of(validated(runs="r1, r2"), {})
    assert problems == [] and settings is not None
    assert settings.runs == ("r1", "r2") and settings.instance is False


def test_all_means_every_run_on_the_box() -> None:
    settings, _problems = options.settings_of(validated(runs="all"), {})
    assert settings is not None and settings.runs == ()


@pytest.mark.parametrize("runs", ["", "../etc", ["ok", "bad/name"], 5])
def test_bad_run_names_are_refused_naming_teardown_run(runs: Any) -> None:
    assert any(problem.startswith("teardown_run") for problem in problems_of(runs=runs))


def test_a_run_both_torn_down_and_abandoned_is_refused() -> None:
    assert problems_of(runs="r1,r2", abandon_runs=["r2"]) == ["teardown_abandon_runs names runs being torn down: r2"]


def test_relative_directories_are_refused() -> None:
    problems = problems_of(data_dir="data", durable_dir="durable")
    assert len(problems) == 2 and "teardown_data_dir" in problems[0] and "teardown_durable_dir" in problems[1]


def test_a_verb_that_runs_a_command_needs_a_plain_instance_id() -> None:
    # Lambda embeds the id in a URL: an empty one would name the instance list, not an instance.
    for bad in ("", "a b", "../x"):
        problems = problems_of(meter_stop_verb="stop", meter_stop_verbs=RUNPOD_VERBS, instance_id=bad)
        assert problems and problems[0].startswith("instance_id is"), problems
    assert problems_of(meter_stop_verb="stop", meter_stop_verbs=RUNPOD_VERBS, instance_id="pod-1") == []


def test_an_unknown_verb_is_refused_before_the_box_is_touched() -> None:
    problems = problems_of(meter_stop_verb="stpo", meter_stop_verbs=RUNPOD_VERBS, instance_id="pod-1")
    assert len(problems) == 1 and "stop" in problems[0]


def test_a_meter_stop_judges_the_whole_instance_unless_stop_meter_is_false() -> None:
    args = {"meter_stop_verb": "stop", "meter_stop_verbs": RUNPOD_VERBS, "instance_id": "pod-1"}
    settings, _problems = options.settings_of(validated(**args), {})
    assert settings is not None and settings.instance is True
    settings, _problems = options.settings_of(validated(stop_meter=False, **args), {})
    assert settings is not None and settings.instance is False and settings.verb is None


def test_a_load_verify_command_given_as_one_string_is_split_not_ignored() -> None:
    # Item 10: a string used to be treated as unset, and the gate passed with "no load-verify command".
    command, problem = options.load_command("python3 -c 'import sys; open(sys.argv[1])' {{ artifact }}")
    assert problem == "" and command == ["python3", "-c", "import sys; open(sys.argv[1])", "{{ artifact }}"]
    command, _problem = options.load_command("python3 -c 'print(1)' {{ artifact | quote }}  {{ [1, 2] }}")
    assert command == ["python3", "-c", "print(1)", "{{ artifact | quote }}", "{{ [1, 2] }}"]
    # Rendered, a path with a space stays one argument, a list is spliced in, scalars become strings.
    assert options.argv_of(["python3", "/d/my run/best.pth", [1, True]]) == [
        "python3",
        "/d/my run/best.pth",
        "1",
        "true",
    ]


def test_a_load_verify_string_that_cannot_be_split_is_refused() -> None:
    problems = problems_of({"teardown_load_verify_cmd": "python3 -c 'unclosed"})
    assert len(problems) == 1 and problems[0].startswith("teardown_load_verify_cmd cannot be split")


def test_a_load_verify_of_another_shape_is_refused() -> None:
    problems = problems_of({"teardown_load_verify_cmd": {"python": "x"}})
    assert problems and problems[0].startswith("teardown_load_verify_cmd must be")


def test_load_verify_on_the_controller_needs_a_pull() -> None:
    problems = problems_of({"teardown_load_verify_cmd": ["true"]}, load_verify_on="controller")
    assert problems == ["teardown_load_verify_on=controller needs teardown_pull_to (pull_to): there is no copy to load"]


@pytest.mark.parametrize("key,value", [("verify_timeout_s", 0), ("meter_stop_poll_interval_s", float("nan"))])
def test_numbers_out_of_bounds_are_named(key: str, value: float) -> None:
    problems = problems_of(**{key: value})
    assert len(problems) == 1 and problems[0].startswith(f"teardown_{key} must be a number between")


def test_confirmation_names_hosts_and_true_approves_nothing() -> None:
    assert options.confirmation(("b1", "b2"), "b2")[0] is True
    assert options.confirmation(("all",), "b9")[0] is True
    confirmed, why = options.confirmation((), "b1")
    assert confirmed is False and why == "not confirmed: set confirm_teardown=b1 (or all)"
    assert options.names(True) is None  # confirm_teardown=true names no host: a validation problem
    assert any("confirm_teardown" in p for p in problems_of(confirm=True))


def test_a_typo_in_a_teardown_variable_is_named_with_the_closest_valid_one() -> None:
    found = unknown_variables(["teardown_pul_to", "teardown_run", "other"], "teardown_", options.KNOWN_VARIABLES)
    assert found == ["teardown_pul_to is not a variable of this stage (did you mean teardown_pull_to?)"]


def test_a_typo_in_a_command_line_name_is_named_too() -> None:
    variables = ["pul_to", "confirm_teardwon", "pull_to", "data_dir", "inventory_hostname", "stop_running"]
    assert misspelt_short_names(variables, options.SHORT_NAMES) == [
        "confirm_teardwon is not a variable of this stage (did you mean confirm_teardown?)",
        "pul_to is not a variable of this stage (did you mean pull_to?)",
    ]


def test_a_profile_in_the_old_flat_format_is_refused_not_ignored() -> None:
    problems = problems_of({"meter_stop_cmd": ["runpodctl", "pod", "delete", "x"], "durable_survives": ["stop"]})
    assert [problem.split(" ", 1)[0] for problem in problems] == ["meter_stop_cmd", "durable_survives"]
    assert "meter_stop_verbs.<verb>" in problems[0]
