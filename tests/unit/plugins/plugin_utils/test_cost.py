"""What a box costs: the host's hourly_usd checked, the box's untrusted start time read, the texts the lines show."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import (
    box_cost,
    cost_text,
    fleet_hourly,
    hourly_rate,
)

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("value", [2, 2.5, 0, 0.0, 1e3])
def test_a_number_of_dollars_per_hour_is_the_rate(value: Any) -> None:
    assert hourly_rate({"hourly_usd": value}) == (float(value), None)


def test_an_unset_rate_is_no_rate_and_no_problem() -> None:
    assert hourly_rate({}) == (None, None)
    assert hourly_rate({"hourly_usd": None}) == (None, None)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "True"),
        (False, "False"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (-0.5, "-0.5"),
        ("abc", "'abc'"),
        ("2.5", "'2.5'"),
        ([2.0], "[2.0]"),
        ({"usd": 2}, "{'usd': 2}"),
    ],
)
def test_anything_but_a_finite_number_at_least_zero_is_one_line_naming_hourly_usd(value: Any, shown: str) -> None:
    rate, problem = hourly_rate({"hourly_usd": value})
    assert rate is None
    assert problem == f"hourly_usd: must be a number of US dollars per hour (>= 0), not {shown}"


def test_a_template_is_rendered_with_the_actions_templar_and_a_broken_one_is_named() -> None:
    variables = {"gpus": 2, "hourly_usd": trust_as_template("{{ gpus * 1.25 }}")}
    templar = Templar(loader=DataLoader(), variables=variables)
    assert hourly_rate(variables, templar) == (2.5, None)
    broken = {"hourly_usd": trust_as_template("{{ no_such_variable * 2 }}")}
    rate, problem = hourly_rate(broken, Templar(loader=DataLoader(), variables=broken))
    assert rate is None and problem.startswith("hourly_usd: its template failed: ")
    assert "no_such_variable" in problem and "\n" not in problem


def test_a_huge_bad_value_is_shown_short() -> None:
    _rate, problem = hourly_rate({"hourly_usd": "x" * 1000})
    assert problem is not None and "\n" not in problem and len(problem) < 120 and problem.endswith("...")


def test_no_rate_is_no_cost() -> None:
    assert box_cost(None, "2025-03-01T10:00:00Z", NOW) is None


@pytest.mark.parametrize(
    "since",
    ["2025-03-01T10:00:00Z", "2025-03-01T10:00:00+00:00", "2025-03-01T10:00:00", "2025-03-01T11:00:00+01:00"],
)
def test_naive_and_aware_starts_are_the_same_moment(since: str) -> None:
    # Naive means UTC (the run layout writes UTC); an offset is honoured.
    assert box_cost(2.1, since, NOW) == {"hourly_usd": 2.1, "since": "2025-03-01T10:00:00Z", "hours": 2.0, "usd": 4.2}


def test_the_cost_so_far_is_rounded_to_cents() -> None:
    cost = box_cost(0.333, (NOW - timedelta(minutes=100)).isoformat(), NOW)
    assert cost is not None
    assert cost["usd"] == 0.56  # 0.333 * 1.6667 h = 0.555
    assert cost["hours"] == 1.667
    assert cost_text(cost) == "$0.56 so far at $0.33/h"


@pytest.mark.parametrize("since", ["yesterday", "", "2025-13-45T99:00:00", "9" * 500, 12345, ["2025-03-01"], {}])
def test_a_garbage_start_leaves_the_cost_so_far_unknown_but_keeps_the_rate(since: Any) -> None:
    cost = box_cost(2.0, since, NOW)
    assert cost is not None
    assert (cost["hourly_usd"], cost["since"], cost["hours"], cost["usd"]) == (2.0, None, None, None)
    assert "unreadable" in cost["note"]
    assert cost_text(cost) == "$2.00/h"


def test_an_unknown_start_is_no_note() -> None:
    assert box_cost(2.0, None, NOW) == {"hourly_usd": 2.0, "since": None, "hours": None, "usd": None}


def test_a_start_in_the_future_is_zero_hours_with_a_clock_note_never_a_negative_cost() -> None:
    cost = box_cost(3.0, "2025-03-01T13:00:00Z", NOW)
    assert cost is not None
    assert (cost["hours"], cost["usd"]) == (0.0, 0.0)
    assert cost["note"].startswith("clock:")
    assert cost_text(cost) == "$0.00 so far at $3.00/h"


def test_now_defaults_to_the_controller_clock() -> None:
    started = (datetime.now(timezone.utc) - timedelta(hours=3)).isoformat()
    cost = box_cost(1.0, started)
    assert cost is not None and 2.99 <= cost["usd"] <= 3.01


def test_cost_text() -> None:
    assert cost_text(None) == ""
    assert cost_text({}) == ""
    assert cost_text({"hourly_usd": 2.0, "since": None, "hours": None, "usd": None}) == "$2.00/h"
    assert cost_text({"hourly_usd": 2.0, "since": "x", "hours": 2.1, "usd": 4.2}) == "$4.20 so far at $2.00/h"
    assert cost_text({"hourly_usd": 2.0, "usd": 1234.5}) == "$1,234.50 so far at $2.00/h"


def test_fleet_hourly_sums_the_records_that_have_a_cost() -> None:
    records = [
        {"host": "a", "cost": {"hourly_usd": 2.69, "usd": 1.0}},
        {"host": "b", "cost": None},
        {"host": "c"},
        {"host": "d", "cost": {"hourly_usd": 4.51, "usd": None}},
    ]
    assert fleet_hourly(records) == 7.2
    assert fleet_hourly([{"host": "b", "cost": None}, {"host": "c"}]) is None
    assert fleet_hourly([]) is None


def test_a_box_whose_meter_teardown_stopped_leaves_the_fleets_total() -> None:
    records = [
        {"host": "a", "cost": {"hourly_usd": 2.69, "usd": 1.0, "meter_stopped": True}},
        {"host": "d", "cost": {"hourly_usd": 4.51, "usd": None}},
    ]
    assert fleet_hourly(records) == 4.51
    assert fleet_hourly(records[:1]) == 0.0  # every box stopped: nothing bills, which is not "no cost known"
