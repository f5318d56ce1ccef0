"""The fleet page keeps its DOM contract for any report, a hostile or broken one too, and is written atomically."""

from __future__ import annotations

import math
import os
import stat
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _fleet_page as fleet_page
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._fleet_page import render_page, write_page
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._fleet_page_plots import MAX_POINTS

VOID = {"meta", "br", "img", "input", "link", "hr", "source"}
T0 = 1796380000.0  # 2026-12-04T10:26:40Z


class Node:
    def __init__(self, tag: str, attrs: Dict[str, Optional[str]], parent: Optional[Node]) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: List[Node] = []
        self.text = ""

    def all(self, tag: str, **attrs: str) -> List[Node]:
        """Every descendant with ``tag`` whose attributes hold ``attrs`` (class_ is a class among the element's)."""
        found = []
        for child in self.children:
            wanted = dict(attrs)
            classes = (child.attrs.get("class") or "").split()
            same_class = "class_" not in wanted or wanted.pop("class_") in classes
            same = all(child.attrs.get(key.replace("_", "-")) == value for key, value in wanted.items())
            if child.tag == tag and same_class and same:
                found.append(child)
            found += child.all(tag, **attrs)
        return found

    def all_nodes(self) -> List[Node]:
        return [node for child in self.children for node in (child, *child.all_nodes())]

    def one(self, tag: str, **attrs: str) -> Node:
        found = self.all(tag, **attrs)
        assert len(found) == 1, (tag, attrs, len(found))
        return found[0]

    def texts(self) -> str:
        return self.text + "".join(child.texts() for child in self.children)


class Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#document", {}, None)
        self.at = self.root
        self.tags: List[str] = []

    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        self.tags.append(tag)
        node = Node(tag, dict(attrs), self.at)
        self.at.children.append(node)
        if tag not in VOID:
            self.at = node

    def handle_endtag(self, tag: str) -> None:
        assert self.at.tag == tag, f"</{tag}> closes <{self.at.tag}>"
        self.at = self.at.parent or self.root

    def handle_data(self, data: str) -> None:
        self.at.text += data


def parse(html: str) -> Tuple[Node, List[str]]:
    tree = Tree()
    tree.feed(html)
    tree.close()
    assert tree.at is tree.root, "an element was left open"
    return tree.root, tree.tags


def document(*hosts: Any) -> Dict[str, Any]:
    summary = {"line": "3 hosts: 1 crashed", "hosts": len(hosts)}
    return {"generated_at": "2026-12-04T10:52:04Z", "stage": "patrol", "summary": summary, "hosts": list(hosts)}


def box(host: str, state: str = "running", **fields: Any) -> Dict[str, Any]:
    return dict({"host": host, "state": state, "escalate": False, "reasons": [], "runs": []}, **fields)


def monitor(points: int = 120, gpus: int = 2) -> Dict[str, Any]:
    return {
        "t": [T0 + 60 * i for i in range(points)],
        "gpus": [
            {"index": g, "util_pct": [50.0] * points, "mem_used_mib": [1000.0] * points, "mem_total_mib": 81559.0}
            for g in range(gpus)
        ],
        "container_mem_bytes": [2**30] * points,
        "container_max_bytes": 2**34,
        "points": points,
    }


def cell(name: str, state: str = "running", **fields: Any) -> Dict[str, Any]:
    return dict({"name": name, "state": state, "progress": None, "progress_fraction": None, "eta_s": None}, **fields)


def run(name: str, *cells: Dict[str, Any], **fields: Any) -> Dict[str, Any]:
    return dict({"run": name, "state": "running", "cells": list(cells), "monitor_series": monitor()}, **fields)


def test_cards_come_escalated_first_then_worst_state_then_by_name() -> None:
    hosts = [
        box("a", "done"),
        box("b", "crashed", escalate=True),
        box("c", "unreachable", reachable=False),
        box("d", "idle", escalate=True),
        box("e2", "running"),
        box("e1", "running"),
        box("f", "stalled"),
    ]
    page = parse(render_page(document(*hosts)))[0]
    cards = page.one("main", id="boxes").all("section", class_="box")
    assert [card.attrs["data-host"] for card in cards] == ["c", "b", "d", "f", "e1", "e2", "a"]
    assert [card.attrs["data-escalate"] for card in cards] == ["true"] * 3 + ["false"] * 4
    assert (
        cards[0].attrs["data-state"] == "unreachable"
        and cards[0].one("span", class_="box-state").texts() == "unreachable"
    )
    assert cards[1].one("h2", class_="box-name").texts() == "b"


def test_the_header_holds_the_summary_generated_at_and_check_mode() -> None:
    html = render_page(dict(document(box("a")), check_mode=True))
    header = parse(html)[0].one("header", id="summary")
    assert "3 hosts: 1 crashed" in header.texts() and "2026-12-04T10:52:04Z" in header.texts()
    assert "check mode" in header.texts()
    assert "check mode" not in parse(render_page(document(box("a"))))[0].one("header", id="summary").texts()


def test_a_hostile_host_name_and_reason_stay_text() -> None:
    hostile = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    reason = "<script>alert(3)</script> see http://evil.example/x"
    html = render_page(document(box(hostile, "crashed", escalate=True, reasons=[reason], runs=[run(hostile)])))
    page, tags = parse(html)
    assert "script" not in tags and "img" not in tags
    card = page.one("section", class_="box")
    assert card.attrs["data-host"] == hostile and card.one("h2").texts() == hostile
    assert card.one("ul", class_="reasons").one("li").texts() == reason
    assert card.one("div", class_="run").attrs["data-run"] == hostile


def test_the_page_has_no_script_and_no_url() -> None:
    hosts = [box("a", runs=[run("r", cell("c", progress_fraction=0.5))], cost={"hourly_usd": 2.0, "usd": 4.2})]
    html = render_page(document(*hosts))
    page, tags = parse(html)
    assert "script" not in tags and "<script" not in html.lower()
    for needle in ("http:", "https:", "//", "url(", "src=", "href=", "@import"):
        assert needle not in html, needle
    assert not [name for node in page.all_nodes() for name in node.attrs if name.startswith("on")]


def test_a_live_cell_gets_a_progress_bar_from_its_fraction() -> None:
    progress = {"step": 120, "steps_total": 400}
    cells = [
        cell("c1", progress=progress, progress_fraction=0.37, eta_s=3720),
        cell("c2", "stalled", progress_fraction=1.7),
        cell("c3", progress_fraction=None),
        cell("c4", "done", progress_fraction=1.0),
        cell("c5", "pending"),
    ]
    page = parse(render_page(document(box("a", runs=[run("r", *cells)]))))[0]
    bars = page.all("div", class_="progress")
    assert [progress_bar.attrs["data-cell"] for progress_bar in bars] == ["c1", "c2", "c3"]
    assert [progress_bar.attrs["data-fraction"] for progress_bar in bars] == ["0.37", "1.0", ""]
    widths = [progress_bar.one("div", class_="bar").attrs["style"] for progress_bar in bars]
    assert widths == ["width: 37.0%", "width: 100.0%", "width: 0.0%"]
    assert bars[0].one("span", class_="progress-text").texts() == "step 120/400 · 37% · ETA 1 h 2 min"
    assert bars[1].one("span", class_="progress-text").texts().startswith("stalled")
    assert all(progress_bar.attrs["data-run"] == "r" for progress_bar in bars)


def test_plots_draw_each_gpu_and_break_at_gaps() -> None:
    series = monitor(120, gpus=2)
    series["gpus"][0]["util_pct"][50] = None
    series["gpus"][0]["util_pct"][90] = math.nan  # a reading that is no number is a gap too
    series["gpus"][1]["util_pct"][119] = None
    page = parse(render_page(document(box("a", runs=[run("r", monitor_series=series)]))))[0]
    util = page.one("svg", class_="plot", data_kind="gpu-util", data_run="r")
    assert util.attrs["data-points"] == str(118 + 119)
    gpu0 = util.all("polyline", class_="series", data_gpu="0")
    assert [len(line.attrs["points"].split()) for line in gpu0] == [50, 39, 29]
    assert len(util.one("polyline", class_="series", data_gpu="1").attrs["points"].split()) == 119
    labels = [text.texts() for text in util.all("text")]
    assert labels == ["100%", "0%", "10:26", "12:25"]  # min and max of each axis, the time in UTC
    memory = page.one("svg", data_kind="gpu-mem")
    assert memory.attrs["data-points"] == "240" and len(memory.all("polyline", class_="series")) == 2
    container = page.one("svg", data_kind="container-mem")
    assert container.attrs["data-points"] == "120" and "data-gpu" not in container.one("polyline").attrs


def test_loss_drops_non_finite_values_and_a_long_series_is_thinned() -> None:
    losses: List[Any] = [2.0 - i / 100 for i in range(10)]
    losses[3], losses[4], losses[7] = math.nan, math.inf, True
    short = {"x": list(range(10)), "loss": losses, "x_label": "step", "last": 1.91, "points": 10}
    long = {"x": list(range(5000)), "loss": [1.0 + i % 7 for i in range(5000)], "x_label": "line"}
    cells = [cell("c1", loss_series=short), cell("c2", "done", loss_series=long)]
    page = parse(render_page(document(box("a", runs=[run("r", *cells)]))))[0]
    first = page.one("svg", data_kind="loss", data_cell="c1")
    assert first.attrs["data-points"] == "7"
    assert [len(line.attrs["points"].split()) for line in first.all("polyline", class_="series")] == [3, 2, 2]
    thinned = page.one("svg", data_kind="loss", data_cell="c2")
    assert 2 <= int(thinned.attrs["data-points"]) <= MAX_POINTS


def test_a_series_with_under_two_points_says_no_samples_yet() -> None:
    one = {"x": [1], "loss": [0.5], "x_label": "step"}
    page = parse(render_page(document(box("a", runs=[run("r", cell("c", loss_series=one), monitor_series=None)]))))[0]
    plots = page.all("svg", class_="plot")
    assert [plot.attrs["data-kind"] for plot in plots] == ["gpu-util", "gpu-mem", "container-mem", "loss"]
    for plot in plots:
        assert not plot.all("polyline") and "no samples yet" in plot.texts()
    assert [plot.attrs["data-points"] for plot in plots] == ["0", "0", "0", "1"]


def test_a_box_without_runs_says_so() -> None:
    page = parse(render_page(document(box("a", "idle"), box("b", "unreachable", reachable=False))))[0]
    for card in page.all("section", class_="box"):
        assert not card.all("div", class_="run") and card.one("p", class_="empty").texts()


def test_cost_is_shown_only_when_the_record_has_one() -> None:
    hosts = [
        box("a", cost={"hourly_usd": 2.0, "usd": 4.2, "since": "2026-12-04T08:00:00Z", "hours": 2.1}),
        box("b"),
        box("c", cost={"hourly_usd": 2.0, "usd": None}),
        box("d", cost={"hourly_usd": math.nan, "usd": 1.0}),
    ]
    cards = parse(render_page(document(*hosts)))[0].all("section", class_="box")
    costs = {card.attrs["data-host"]: [span.texts() for span in card.all("span", class_="cost")] for card in cards}
    assert costs == {"a": ["$4.20 so far at $2.00/h"], "b": [], "c": ["$2.00/h"], "d": []}


GARBAGE: List[Dict[str, Any]] = [
    {"state": 42, "escalate": "yes"},
    {"state": ["running"], "reasons": "not a list"},
    {"reasons": [1, None, {"x": 1}, "kept"]},
    {"runs": "garbage"},
    {"runs": [1, None, "x", {"cells": "x", "monitor_series": "x"}]},
    {"runs": [{"run": 5, "cells": [1, {"state": "running", "progress_fraction": True, "progress": "x"}]}]},
    {"runs": [{"cells": [{"state": "running", "name": {"a": 1}, "progress": {"step": "x", "steps_total": -1}}]}]},
    {"runs": [{"cells": [{"state": "running", "progress_fraction": math.inf, "eta_s": 10**400}]}]},
    {"runs": [{"monitor_series": {"t": "x", "gpus": [1, {"util_pct": "x"}], "container_mem_bytes": {}}}]},
    {"runs": [{"monitor_series": {"t": [10**400, -5, True, 1e300], "gpus": {"0": 1}, "container_max_bytes": "x"}}]},
    {"runs": [{"monitor_series": {"t": [T0, T0 + 60], "gpus": [{"index": 10**400, "util_pct": [1, 2, 3]}]}}]},
    {"runs": [{"cells": [{"loss_series": {"x": [10**400, 1], "loss": ["a", None]}}]}]},
    {"runs": [{"cells": [{"loss_series": {"x": "x", "loss": [1.0, 2.0]}}]}]},
    {"runs": [{"started_at": 12, "eta_s": "soon", "cells_done": -3, "cells_total": math.nan}]},
    {"runs": [{"started_at": "9999-99-99", "state": {"bad": 1}}]},
    {"cost": {"hourly_usd": "2", "usd": True}, "cost_warning": 3, "headline": 7, "msg": ["x"]},
    {"cost": "garbage", "reachable": "no"},
]


@pytest.mark.parametrize("fields", GARBAGE)
def test_a_record_with_garbage_in_any_field_still_gets_its_card(fields: Dict[str, Any]) -> None:
    record = dict(box("weird"), **fields)
    page = parse(render_page(document(record, box("fine"))))[0]
    hosts = [card.attrs["data-host"] for card in page.all("section", class_="box")]
    assert sorted(hosts) == ["fine", "weird"]
    for plot in page.all("svg", class_="plot"):
        assert int(plot.attrs["data-points"]) >= 0


def test_records_that_are_no_records_and_a_broken_document_still_render() -> None:
    page = parse(render_page(dict(document("x", None, 3, box("fine")), summary="x", generated_at=5)))[0]
    assert [card.attrs["data-host"] for card in page.all("section", class_="box")] == ["?", "?", "?", "fine"]
    assert parse(render_page({"hosts": "x"}))[0].one("main", id="boxes").one("p", class_="empty").texts()
    assert parse(render_page([]))[0].one("header", id="summary")  # type: ignore[arg-type]


def test_two_runs_with_packed_cells_on_one_box() -> None:
    first = run("alpha", cell("a1", progress_fraction=0.25, gpus=[0]), cell("a2", progress_fraction=0.5, gpus=[0]))
    second = run("beta", cell("b1", progress_fraction=0.75, gpus=[1]), cell("b2", "done", gpus=[1]))
    card = parse(render_page(document(box("a", runs=[first, second]))))[0].one("section", class_="box")
    runs = card.all("div", class_="run")
    assert [one.attrs["data-run"] for one in runs] == ["alpha", "beta"]
    assert [progress_bar.attrs["data-cell"] for progress_bar in runs[0].all("div", class_="progress")] == ["a1", "a2"]
    assert [progress_bar.attrs["data-fraction"] for progress_bar in runs[1].all("div", class_="progress")] == ["0.75"]
    assert [len(one.all("svg", class_="plot")) for one in runs] == [3, 3]
    assert all(plot.attrs["data-run"] == "beta" for plot in runs[1].all("svg"))


def test_list_lengths_are_bounded() -> None:
    cells = [cell(f"c{i}", progress_fraction=0.1) for i in range(100)]
    record = box("a", reasons=[f"r{i}" for i in range(50)], runs=[run(f"r{i}", *cells) for i in range(20)])
    card = parse(render_page(document(record)))[0].one("section", class_="box")
    assert len(card.one("ul", class_="reasons").all("li")) == fleet_page.MAX_REASONS + 1
    assert len(card.all("div", class_="run")) == fleet_page.MAX_RUNS
    assert len(card.all("div", class_="run")[0].all("div", class_="progress")) == fleet_page.MAX_LIVE_CELLS


def test_write_page_writes_beside_the_report_and_the_latest_atomically(tmp_path: Path) -> None:
    report = tmp_path / "patrol-20261204T105204Z.json"
    report.write_text("{}")
    page, latest = write_page(str(report), document(box("first")))
    assert page == str(tmp_path / "patrol-20261204T105204Z.html") and latest == str(tmp_path / "patrol-latest.html")
    for path in (page, latest):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert 'data-host="first"' in Path(path).read_text()
    second = tmp_path / "patrol-20261204T105300Z.json"
    page2 = write_page(str(second), document(box("second")))[0]
    assert 'data-host="first"' in Path(page).read_text() and 'data-host="second"' in Path(page2).read_text()
    assert 'data-host="second"' in Path(latest).read_text()
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            "patrol-20261204T105204Z.json",
            "patrol-20261204T105204Z.html",
            "patrol-20261204T105300Z.html",
            "patrol-latest.html",
        ]
    )


def test_a_failed_write_leaves_the_old_latest_whole_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "patrol-latest.html").write_text("old page")

    def refuse(source: str, target: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fleet_page.os, "replace", refuse)
    with pytest.raises(OSError):
        write_page(str(tmp_path / "patrol-x.json"), document(box("a")))
    assert os.listdir(tmp_path) == ["patrol-latest.html"]
    assert (tmp_path / "patrol-latest.html").read_text() == "old page"
