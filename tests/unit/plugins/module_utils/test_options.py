"""The shared option checks: finite numbers within bounds, dotted versions, non-empty paths, ordered pairs."""

from __future__ import annotations

import json
import math

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._options import (
    Between,
    DottedVersion,
    NonEmpty,
    check_options,
    option_problems,
)

TIMEOUT = Between(0, 3600, above_low=True)
GRACE = Between(0, 3600)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, json.loads("1e400"), float("-nan")])
def test_non_finite_numbers_are_never_within_bounds(value):
    # json.loads gives what Ansible's JSON args give for 1e400: infinity.
    (problem,) = option_problems({"grace_s": value}, {"grace_s": GRACE})
    assert problem == f"grace_s must be a finite number between 0 and 3600, got {value}"


@pytest.mark.parametrize("value", [0, 0.0, 1e-9, 3600, 3600.0, 12])
def test_inclusive_bounds_accept_their_ends(value):
    assert option_problems({"grace_s": value}, {"grace_s": GRACE}) == []


@pytest.mark.parametrize("value", [-1e-9, -1.0, 3600.0001, 1e6])
def test_values_outside_inclusive_bounds_are_rejected(value):
    assert option_problems({"grace_s": value}, {"grace_s": GRACE}) == [
        f"grace_s must be a finite number between 0 and 3600, got {value}"
    ]


def test_exclusive_lower_bound():
    assert option_problems({"t": 0.0}, {"t": TIMEOUT}) == [
        "t must be a finite number above 0 and at most 3600, got 0.0"
    ]
    assert option_problems({"t": -1.0}, {"t": TIMEOUT}) != []
    assert option_problems({"t": 1e-6}, {"t": TIMEOUT}) == []
    assert option_problems({"t": 3600.0}, {"t": TIMEOUT}) == []


def test_integers_and_lists_of_integers():
    pct = Between(0, 100)
    assert option_problems({"pct": -5}, {"pct": pct}) == ["pct must be an integer between 0 and 100, got -5"]
    assert option_problems({"pct": 100}, {"pct": pct}) == []
    pids = Between(1, 4194304)
    assert option_problems({"pids": [5, -1, 0]}, {"pids": pids}) == [
        "pids entries must be integers between 1 and 4194304, got -1"
    ]
    assert option_problems({"pids": [1, 4194304]}, {"pids": pids}) == []
    assert option_problems({"pids": []}, {"pids": pids}) == []


def test_unset_options_are_not_checked():
    rules = {"a": GRACE, "b": DottedVersion("12.2"), "c": NonEmpty()}
    assert option_problems({"a": None, "b": None, "c": None}, rules) == []
    assert option_problems({}, rules) == []


@pytest.mark.parametrize("value", ["abc", "x.y", "535.", ".535", "535..1", "535.104.05 beta", "v12", ""])
def test_versions_must_be_dotted_numbers(value):
    (problem,) = option_problems({"min_cuda_version": value}, {"min_cuda_version": DottedVersion("12.2")})
    assert problem == f"min_cuda_version must be dotted numbers such as 12.2, got {value!r}"


@pytest.mark.parametrize("value", ["12", "12.2", "535.104.05", " 550.54.15 "])
def test_dotted_versions_are_accepted(value):
    assert option_problems({"v": value}, {"v": DottedVersion("12.2")}) == []


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_paths_are_rejected(value):
    assert option_problems({"data_dir": value}, {"data_dir": NonEmpty()}) == [
        f"data_dir must be a non-empty path, got {value!r}"
    ]


def test_ordered_pairs_are_checked_only_when_both_are_in_bounds():
    rules = {"warn": Between(0, 100, above_low=True), "fail": Between(0, 100, above_low=True)}
    assert option_problems({"warn": 95.0, "fail": 90.0}, rules, ordered=[("warn", "fail")]) == [
        "warn must be at most fail, got 95.0 > 90.0"
    ]
    assert option_problems({"warn": 90.0, "fail": 90.0}, rules, ordered=[("warn", "fail")]) == []
    # An out-of-range value is reported once, as such, not again as out of order.
    assert option_problems({"warn": math.nan, "fail": 90.0}, rules, ordered=[("warn", "fail")]) == [
        "warn must be a finite number above 0 and at most 100, got nan"
    ]


def test_every_problem_is_reported_in_rule_order():
    rules = {"a": GRACE, "b": TIMEOUT}
    assert option_problems({"b": math.inf, "a": -1.0}, rules) == [
        "a must be a finite number between 0 and 3600, got -1.0",
        "b must be a finite number above 0 and at most 3600, got inf",
    ]


class FakeModule:
    def __init__(self, params):
        self.params = params

    def fail_json(self, **kwargs):
        raise SystemExit(kwargs)


def test_check_options_fails_the_module_with_one_line():
    with pytest.raises(SystemExit) as failed:
        check_options(FakeModule({"a": math.nan, "b": 0.0}), {"a": GRACE, "b": TIMEOUT})
    (msg,) = failed.value.args[0].values()
    assert msg == (
        "a must be a finite number between 0 and 3600, got nan; b must be a finite number above 0 and at most 3600, "
        "got 0.0"
    )
    assert "\n" not in msg


def test_check_options_returns_when_all_is_well():
    assert check_options(FakeModule({"a": 1.0}), {"a": GRACE}) is None


def test_descriptions_are_what_the_docs_say():
    assert GRACE.describe() == "between 0 and 3600"
    assert TIMEOUT.describe() == "above 0 and at most 3600"
    assert Between(0.05, 60).describe() == "between 0.05 and 60"
    assert DottedVersion("535.104.05").describe() == "dotted numbers such as 535.104.05"
    assert NonEmpty().describe() == "a non-empty path"
