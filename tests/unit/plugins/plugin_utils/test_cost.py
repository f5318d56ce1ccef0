"""What a box costs: the host's hourly_usd checked (numbers as text by one rule), the box's untrusted ledger and
times read on the box's own clock (a box 3 h ahead or behind costs the same), the texts the lines show."""

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
    ledger_of,
    number_of,
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
        ("nan", "'nan'"),
        ("inf", "'inf'"),
        ("-2.5", "'-2.5'"),
        ("1_000", "'1_000'"),
        ("0x10", "'0x10'"),
        ("", "''"),
        ([2.0], "[2.0]"),
        ({"usd": 2}, "{'usd': 2}"),
    ],
)
def test_anything_but_a_finite_number_at_least_zero_is_one_line_naming_hourly_usd(value: Any, shown: str) -> None:
    rate, problem = hourly_rate({"hourly_usd": value})
    assert rate is None
    assert problem == f"hourly_usd: must be a number of US dollars per hour (>= 0), not {shown}"


@pytest.mark.parametrize(("value", "rate"), [("2.5", 2.5), (" 3 ", 3.0), ("0", 0.0), ("1e1", 10.0), ("+.5", 0.5)])
def test_numeric_text_is_a_rate_as_every_extra_var_is_text(value: str, rate: float) -> None:
    # -e hourly_usd=2.5 gives the string "2.5": one rule for numbers as text in every stage.
    assert hourly_rate({"hourly_usd": value}) == (rate, None)
    assert number_of(value) == rate


def test_the_one_rule_for_numbers_refuses_what_is_no_finite_number() -> None:
    assert [number_of(value) for value in (True, "abc", "nan", "inf", float("nan"), [1], None, "9" * 100)] == [None] * 8
    assert (number_of(3), number_of(-1.5), number_of("-1.5")) == (3.0, -1.5, -1.5)


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
    assert cost_text(cost) == "$0.56 so far since 03-01 10:20 at $0.33/h"


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
    assert cost_text(cost) == "$0.00 so far since 03-01 13:00 at $3.00/h"


def test_now_defaults_to_the_controller_clock() -> None:
    started = (datetime.now(timezone.utc) - timedelta(hours=3)).isoformat()
    cost = box_cost(1.0, started)
    assert cost is not None and 2.99 <= cost["usd"] <= 3.01


def test_cost_text() -> None:
    assert cost_text(None) == ""
    assert cost_text({}) == ""
    assert cost_text({"hourly_usd": 2.0, "since": None, "hours": None, "usd": None}) == "$2.00/h"
    assert cost_text({"hourly_usd": 2.0, "since": "x", "hours": 2.1, "usd": 4.2}) == "$4.20 so far at $2.00/h"
    since = {"hourly_usd": 2.5, "since": "2025-12-06T21:40:09Z", "hours": 13.652, "usd": 34.13}
    assert cost_text(since) == "$34.13 so far since 12-06 21:40 at $2.50/h"
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


# --- the box's ledger, on the box's clock ------------------------------------------------------------------------

LEDGER = {"first_seen": "2025-03-01T06:00:00Z", "running_s": 7200.0, "segments_total": 2, "stopped_at": None}


@pytest.mark.parametrize("skew", [timedelta(hours=3), timedelta(hours=-3), timedelta(0)])
def test_a_box_clock_hours_off_ours_costs_the_same(skew: timedelta) -> None:
    """A box 3 h ahead showed $0.00 and one 3 h behind $6.03 for 2 minutes: every duration is the box's own."""
    box_now = (NOW + skew).isoformat()
    with_ledger = box_cost(
        2.0, None, NOW, box_now=box_now, ledger=dict(LEDGER, first_seen=(NOW + skew - timedelta(hours=5)).isoformat())
    )
    assert with_ledger is not None and (with_ledger["hours"], with_ledger["usd"]) == (2.0, 4.0)
    assert "note" not in with_ledger
    older = box_cost(2.0, (NOW + skew - timedelta(minutes=2)).isoformat(), NOW, box_now=box_now)  # no ledger sent
    assert older is not None and (older["hours"], older["usd"], older.get("note")) == (0.033, 0.07, None)


def test_the_ledger_s_running_hours_are_the_cost_and_its_first_seen_the_since() -> None:
    cost = box_cost(2.5, "2025-03-01T11:00:00Z", NOW, box_now=NOW.isoformat(), ledger=LEDGER)
    assert cost == {"hourly_usd": 2.5, "since": "2025-03-01T06:00:00Z", "hours": 2.0, "usd": 5.0}
    later = box_cost(2.5, None, NOW, box_now=NOW.isoformat(), ledger=LEDGER, later_s=1800)  # a teardown's steps
    assert later is not None and later["usd"] == 6.25


def test_a_ledger_that_claims_more_than_its_span_is_cut_with_a_note() -> None:
    cost = box_cost(1.0, None, NOW, box_now=NOW.isoformat(), ledger=dict(LEDGER, running_s=1e9))
    assert cost is not None and cost["hours"] == 6.0 and cost["note"].startswith("the box's ledger counts more")


@pytest.mark.parametrize("garbage", [None, 7, "x", {}, {"running_s": -1}, {"running_s": "5"}, {"running_s": True}])
def test_a_ledger_without_usable_running_time_is_none_and_the_since_counts(garbage: Any) -> None:
    assert ledger_of(garbage) is None
    cost = box_cost(1.0, "2025-03-01T10:00:00Z", NOW, ledger=garbage)
    assert cost is not None and cost["hours"] == 2.0


def test_a_ledger_s_fields_are_checked_one_by_one() -> None:
    segments = [{"start": "2025-03-01T10:00:00Z", "ended_by": "x\ny"}, 3] * 9
    told = {"running_s": 60, "first_seen": "soon", "segments": segments, "segments_total": -1, "stopped_at": 5,
            "notes": ["a\nb", 7]}  # fmt: skip
    checked = ledger_of(told)
    assert checked is not None and (checked["first_seen"], checked["segments_total"], checked["stopped_at"]) == (
        None,
        None,
        None,
    )
    assert len(checked["segments"]) == 8 and checked["segments"][0]["ended_by"] == "x y" and checked["notes"] == ["a b"]
