"""The fleet page as headless Chromium renders it: cards, states, order, bars, plots, escaping, console, screenshot.

Pages are written by _fleet_page.write_page from patrol-like reports; every assertion reads the rendered DOM through
page_check, never the HTML string.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import page_check
import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._fleet_page import render_page, write_page

HOSTILE = "<script>alert(1)</script>"
T0 = 1_780_000_000.0


def monitor(points: int, gpus: int) -> dict[str, Any]:
    """A run's monitor series: ``gpus`` busy GPUs and a growing container, aligned over ``points`` samples."""
    return {
        "t": [T0 + 30 * n for n in range(points)],
        "gpus": [
            {
                "index": index,
                "util_pct": [50 + 40 * math.sin(n / 5 + index) for n in range(points)],
                "mem_used_mib": [20000.0 + 100 * n for n in range(points)],
                "mem_total_mib": 81559.0,
            }
            for index in range(gpus)
        ],
        "container_mem_bytes": [2_000_000_000 + 10_000_000 * n for n in range(points)],
        "container_max_bytes": 8_000_000_000,
        "points": points,
    }


def loss(points: int) -> dict[str, Any]:
    losses = [2.5 * math.exp(-n / 30) + 0.1 for n in range(points)]
    return {
        "x": [10 * n for n in range(points)],
        "loss": losses,
        "x_label": "step",
        "last": losses[-1],
        "points": points,
    }


def cell(name: str, state: str, fraction: float | None, series: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "state": state,
        "progress_fraction": fraction,
        "progress": {"epoch": 3, "epochs_total": 10, "step": 37, "steps_total": 100},
        "eta_s": 5400 if state == "running" else None,
        "loss_series": series,
    }


def report(*records: dict[str, Any]) -> dict[str, Any]:
    return {
        "generated_at": "2026-11-01T12:00:00Z",
        "stage": "patrol",
        "check_mode": False,
        "summary": {"line": f"{len(records)} boxes: patrol test fleet", "hosts": len(records)},
        "hosts": list(records),
    }


PACKED = {
    "host": "packed",
    "state": "running",
    "escalate": False,
    "reachable": True,
    "headline": "RUNNING run train-packed: 1/4 cells done",
    "reasons": [],
    "cost": {"hourly_usd": 2.0, "usd": 4.2},
    "runs": [
        {
            "run": "train-packed",
            "state": "running",
            "cells_done": 1,
            "cells_total": 4,
            "started_at": "2026-11-01T10:00:00Z",
            "eta_s": 7200,
            "monitor_series": monitor(60, 2),
            "cells": [
                cell("lr-small", "running", 0.37, loss(80)),
                cell("lr-large", "running", 0.8),
                cell("lr-tiny", "stalled", 0.1),
                cell("lr-base", "done", None),
            ],
        }
    ],
}
CRASHED = {
    "host": "crashed",
    "state": "crashed",
    "escalate": True,
    "reachable": True,
    "headline": "CRASHED run train-crashed: 0/2 cells done",
    "reasons": ["train-crashed/tb: python_traceback (RuntimeError: fake_train: crashed at epoch 1 as asked)"],
    "runs": [
        {
            "run": "train-crashed",
            "state": "crashed",
            "cells_done": 0,
            "cells_total": 2,
            "monitor_series": None,
            "cells": [cell("tb", "failed", None), cell("oom", "failed", None)],
        }
    ],
}
GONE = {
    "host": "gone",
    "state": "unreachable",
    "escalate": False,
    "reachable": False,
    "reasons": ["no answer on port 22: only the box's owner can see its console"],
    "runs": [],
}
DONE = {"host": "done", "state": "done", "escalate": False, "reachable": True, "reasons": [], "runs": []}
GARBAGE = {
    "host": "garbage",
    "state": 42,
    "escalate": "yes",
    "reasons": "not a list",
    "cost": {"hourly_usd": "free"},
    "runs": [
        {"run": 7, "cells": "nope", "monitor_series": {"t": ["a", None], "gpus": "x", "points": -3}},
        "junk",
        {"run": "train-odd", "cells": [{"name": "c", "state": "running", "progress_fraction": "abc"}]},
    ],
}
HOSTILE_BOX = {
    "host": HOSTILE,
    "state": "running",
    "escalate": False,
    "reachable": True,
    "reasons": ['<img src="x" onerror="alert(2)">'],
    "runs": [],
}


@pytest.fixture(scope="module")
def fleet_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page of a fleet with every kind of box, written as a patrol tick writes it."""
    folder = tmp_path_factory.mktemp("reports")
    document = report(DONE, HOSTILE_BOX, PACKED, GONE, CRASHED, GARBAGE)
    page, latest = write_page(str(folder / "patrol-20261101T120000Z.json"), document)
    assert Path(page).read_text() == Path(latest).read_text()
    return Path(latest)


@pytest.fixture(scope="module")
def view(driver: page_check.webdriver.Chrome, fleet_page: Path) -> page_check.PageView:
    return page_check.load(driver, fleet_page)


def test_every_box_is_shown_with_its_state_and_no_problem(view: page_check.PageView) -> None:
    expect = {"packed": "running", "crashed": "crashed", "gone": "unreachable", "done": "done", HOSTILE: "running"}
    expect["garbage"] = "unknown"
    assert page_check.problems(view, expect) == []
    assert view.console == []
    assert view.network == []
    assert "6 boxes: patrol test fleet" in (view.summary or "")
    assert "2026-11-01T12:00:00Z" in (view.summary or "")


def test_escalated_cards_come_first_on_screen_then_worst_state(view: page_check.PageView) -> None:
    shown = [card.host for card in view.cards]
    flags = [card.escalate for card in view.cards]
    assert flags == sorted(flags, reverse=True)
    assert set(shown[: flags.count(True)]) == {"gone", "garbage", "crashed"}
    assert shown.index("garbage") < shown.index("crashed")  # unknown is worse than crashed
    assert shown[flags.count(True) :] == [HOSTILE, "packed", "done"]  # running before done, then by name
    # Laid out in the DOM's order (a grid: left to right, then down), each card with a size.
    assert [card.index for card in view.cards] == list(range(len(view.cards)))
    assert all(card.width > 100 and card.height > 20 for card in view.cards)


def test_card_text_reasons_and_cost_are_rendered(view: page_check.PageView) -> None:
    packed, crashed, gone = view.card("packed"), view.card("crashed"), view.card("gone")
    assert packed.cost == "$4.20 so far at $2.00/h"
    assert "train-packed" in packed.text
    assert crashed.reasons == [CRASHED["reasons"][0]]
    assert gone.reasons == GONE["reasons"] and gone.bars == [] and gone.plots == []
    assert crashed.cost is None and view.card("garbage").cost is None


def test_progress_bars_are_as_wide_as_their_fraction(view: page_check.PageView) -> None:
    bars = {meter.cell: meter for meter in view.card("packed").bars}
    assert sorted(bars) == ["lr-large", "lr-small", "lr-tiny"]  # live cells only
    for name, fraction in (("lr-small", 0.37), ("lr-large", 0.8), ("lr-tiny", 0.1)):
        assert bars[name].fraction == pytest.approx(fraction)
        assert bars[name].rendered == pytest.approx(fraction, abs=0.01)
        assert bars[name].run == "train-packed"
    assert "37%" in (bars["lr-small"].text or "")
    odd = view.card("garbage").bars
    assert [(meter.cell, meter.fraction, meter.rendered) for meter in odd] == [("c", None, 0.0)]


def test_plots_render_with_a_size_and_one_polyline_per_series(view: page_check.PageView) -> None:
    plots = {(plot.kind, plot.cell): plot for plot in view.card("packed").plots}
    assert sorted(plots) == [("container-mem", None), ("gpu-mem", None), ("gpu-util", None), ("loss", "lr-small")]
    for plot in plots.values():
        assert plot.width > 100 and plot.height > 30
        assert all(line["points"] >= 2 and line["width"] > 0 for line in plot.series)
    assert [line["gpu"] for line in plots["gpu-util", None].series] == ["0", "1"]
    assert [line["gpu"] for line in plots["gpu-mem", None].series] == ["0", "1"]
    assert len(plots["container-mem", None].series) == 1
    assert len(plots["loss", "lr-small"].series) == 1 and plots["loss", "lr-small"].points == 80
    assert plots["gpu-util", None].points == 120  # 60 samples on each of two GPUs
    # A run with no monitor series gets empty plots, drawn with a frame and no line.
    empty = view.card("crashed").plots
    assert [plot.kind for plot in empty] == ["gpu-util", "gpu-mem", "container-mem"]
    assert all(plot.series == [] and plot.points == 0 and plot.width > 0 for plot in empty)


def test_a_hostile_host_name_is_text(view: page_check.PageView) -> None:
    card = view.card(HOSTILE)
    assert card.name == HOSTILE and card.scripts == 0
    assert card.reasons == [HOSTILE_BOX["reasons"][0]]  # the img tag is text, no element
    assert HOSTILE in card.text


def test_the_screenshot_is_a_png_of_the_whole_page(
    driver: page_check.webdriver.Chrome, fleet_page: Path, tmp_path: Path
) -> None:
    view = page_check.load(driver, fleet_page)
    out = page_check.screenshot(driver, tmp_path / "shots" / "fleet.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 1000 and height >= view.scroll_height > 900


def _broken(fleet_page: Path, tmp_path: Path, extra: str) -> Path:
    """The fleet page with ``extra`` before </body> and its Content-Security-Policy removed, so it runs or loads."""
    text = fleet_page.read_text()
    csp = text[text.index('<meta http-equiv="Content-Security-Policy"') :]
    text = text.replace(csp[: csp.index(">") + 1], "").replace("</body>", extra + "</body>")
    page = tmp_path / "broken.html"
    page.write_text(text)
    return page


def test_a_console_error_fails_the_check(driver: page_check.webdriver.Chrome, fleet_page: Path, tmp_path: Path) -> None:
    page = _broken(fleet_page, tmp_path, "<script>window.notAFunction();</script>")
    found = page_check.problems(page_check.load(driver, page))
    assert any(line.startswith("console error:") and "notAFunction" in line for line in found), found


def test_a_network_url_fails_the_check(driver: page_check.webdriver.Chrome, fleet_page: Path, tmp_path: Path) -> None:
    page = _broken(fleet_page, tmp_path, '<img src="http://example.invalid/pixel.png" alt="">')
    found = page_check.problems(page_check.load(driver, page))
    assert "loaded from the network: http://example.invalid/pixel.png" in found, found


def test_a_bar_wider_than_its_fraction_fails_the_check(
    driver: page_check.webdriver.Chrome, fleet_page: Path, tmp_path: Path
) -> None:
    page = tmp_path / "wide.html"
    page.write_text(fleet_page.read_text().replace('data-fraction="0.37"', 'data-fraction="0.9"'))
    found = page_check.problems(page_check.load(driver, page))
    assert found == ["box packed: progress train-packed/lr-small: bar covers 0.370 of its track, data-fraction is 0.9"]


def test_a_plot_with_samples_and_no_line_fails_the_check(
    driver: page_check.webdriver.Chrome, fleet_page: Path, tmp_path: Path
) -> None:
    page = tmp_path / "lineless.html"
    page.write_text(fleet_page.read_text().replace('<polyline class="series"', '<polyline class="gone"'))
    found = page_check.problems(page_check.load(driver, page))
    assert "box packed: plot loss of train-packed/lr-small: 80 samples but no polyline or dot drawn" in found, found
    assert len(found) == 4  # the run's three monitor plots and the loss plot


def test_a_wrong_or_missing_state_fails_the_check(view: page_check.PageView) -> None:
    found = page_check.problems(view, {"packed": "stalled", "nowhere": "running"})
    assert "box packed is shown as running, expected stalled" in found
    assert "box nowhere is not shown" in found
    assert "box done is shown but not expected" in found


def test_the_command_line(fleet_page: Path, tmp_path: Path) -> None:
    script = str(Path(page_check.__file__))
    shot = tmp_path / "cli.png"
    expect = ["--expect=packed=running", "--expect=crashed=crashed", "--expect=gone=unreachable"]
    expect += ["--expect=done=done", "--expect=garbage=unknown", f"--expect={HOSTILE}=running"]
    good = subprocess.run(
        [sys.executable, script, "--page", str(fleet_page), *expect, "--screenshot", str(shot)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith("page_check: OK") and shot.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(
        [sys.executable, script, "--page", str(tmp_path / "none.html"), "--expect=a=b"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1 and "page_check: FAIL: --page" in bad.stdout, bad.stdout + bad.stderr


def test_an_empty_report_still_renders(driver: page_check.webdriver.Chrome, tmp_path: Path) -> None:
    page = tmp_path / "empty.html"
    page.write_text(render_page(report()))
    view = page_check.load(driver, page)
    assert view.cards == [] and view.console == []
    assert page_check.problems(view) == ["no box cards (main#boxes section.box) shown"]
