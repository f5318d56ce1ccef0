# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet page: a patrol report as one self-contained HTML file that opens from disk.

One card per box (escalated first, then worst state first, then by name) with its state, reasons and cost; per run
a header line, a progress bar per live cell and plots of the run's GPUs, its container's memory and its cells' loss.
Inline CSS and SVG only: no JavaScript and no URL of any kind, and a Content-Security-Policy that would block both.
Everything a box said is escaped by the template (autoescape) and checked here first: a record of the wrong shape
still gets its card, with what could be read.
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jinja2

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import STATE_ORDER
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import cost_text, parse_since
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._fleet_page_plots import (
    loss_plot,
    monitor_plots,
    num,
)
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line

UNREACHABLE = "unreachable"
# box_state of a box that did not answer, shown instead of "unreachable" (what the provider said of it).
DOWN = ("STOPPED", "INTERRUPTED", "GONE")
LATEST = "patrol-latest.html"
MAX_REASONS = 20
MAX_RUNS = 8
MAX_LIVE_CELLS = 32
MAX_LOSS_PLOTS = 8
LIVE = ("running", "stalled")

TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Fleet {{ page.generated_at }}</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2126; }
header { padding: 12px 20px; background: #1d2126; color: #fff; }
header h1 { font-size: 18px; margin: 0 0 4px; }
.check { background: #f0ad4e; color: #1d2126; padding: 1px 6px; border-radius: 3px; margin-left: 8px; }
main { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 14px; padding: 14px;
  align-items: start; }
.box { background: #fff; border-radius: 6px; padding: 10px 14px; border-left: 6px solid #8a939c; }
.box[data-escalate="true"] { border-left-color: #c9302c; }
.box-head { display: flex; gap: 10px; align-items: baseline; flex-wrap: wrap; }
.box-name { font-size: 16px; margin: 0; overflow-wrap: anywhere; }
.box-state { font-weight: 700; text-transform: uppercase; font-size: 12px; padding: 1px 6px; border-radius: 3px;
  background: #e3e6e9; }
.box[data-escalate="true"] .box-state { background: #c9302c; color: #fff; }
.cost { margin-left: auto; color: #3a4550; }
.reasons { margin: 6px 0; padding-left: 20px; color: #6b2020; }
.headline, .run-head { margin: 6px 0; overflow-wrap: anywhere; }
.run { border-top: 1px solid #e3e6e9; padding-top: 6px; margin-top: 8px; }
.run-head { font-weight: 600; font-size: 14px; }
.cell-row { display: flex; gap: 8px; align-items: center; margin: 3px 0; }
.cell-name { width: 120px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; font-size: 12px; }
.progress { position: relative; flex: 1; height: 18px; background: #e3e6e9; border-radius: 3px; overflow: hidden; }
.bar { height: 100%; background: #5cb85c; }
.progress-text { position: absolute; left: 6px; top: 0; font-size: 12px; line-height: 18px; white-space: nowrap; }
.plots { display: flex; flex-wrap: wrap; gap: 8px; }
figure { margin: 0; width: 260px; }
figcaption { font-size: 12px; color: #3a4550; overflow-wrap: anywhere; }
.plot { width: 260px; height: auto; background: #fafbfc; }
.plot text { font-size: 10px; fill: #6b7580; }
.plot .frame { fill: none; stroke: #c5cad0; }
.plot .series { fill: none; stroke-width: 1.5; }
.key { font-size: 11px; margin-right: 6px; }
.empty { color: #6b7580; font-style: italic; }
</style>
</head>
<body>
<header id="summary">
<h1>Fleet: {{ page.stage }}
{%- if page.check_mode %}<span class="check">check mode: nothing was changed</span>{% endif %}</h1>
<p class="summary-line">{{ page.summary_line }}</p>
<p>generated at <time class="generated-at">{{ page.generated_at }}</time></p>
</header>
<main id="boxes">
{%- for box in page.boxes %}
<section class="box" data-host="{{ box.host }}" data-state="{{ box.state }}" data-escalate="{{ box.escalate }}">
<div class="box-head"><h2 class="box-name">{{ box.host }}</h2><span class="box-state">{{ box.state }}</span>
{%- if box.cost %}<span class="cost">{{ box.cost }}</span>{% endif %}
{%- if box.cost_warning %}<span class="cost-warning">cost unknown: {{ box.cost_warning }}</span>{% endif %}</div>
{%- if box.headline %}<p class="headline">{{ box.headline }}</p>{% endif %}
<ul class="reasons">{% for reason in box.reasons %}<li>{{ reason }}</li>{% endfor %}</ul>
{%- for run in box.runs %}
<div class="run" data-run="{{ run.name }}">
<h3 class="run-head">{{ run.head }}</h3>
{%- for cell in run.cells %}
<div class="cell-row"><span class="cell-name">{{ cell.name }}</span>
<div class="progress" data-run="{{ run.name }}" data-cell="{{ cell.name }}" data-fraction="{{ cell.fraction }}">
<div class="bar" style="width: {{ cell.width }}"></div><span class="progress-text">{{ cell.text }}</span></div></div>
{%- endfor %}
{%- if run.cells_more %}<p class="empty">+{{ run.cells_more }} more live cells</p>{% endif %}
<div class="plots">
{%- for plot in run.plots %}
<figure><figcaption>{{ plot.title }}</figcaption>
<svg class="plot" data-kind="{{ plot.kind }}" data-run="{{ run.name }}"
{%- if plot.cell is not none %} data-cell="{{ plot.cell }}"{% endif %}
 data-points="{{ plot.points }}" viewBox="{{ plot.view }}" role="img">
<rect class="frame" x="{{ plot.box.x }}" y="{{ plot.box.y }}" width="{{ plot.box.w }}" height="{{ plot.box.h }}"></rect>
{%- if plot.points < 2 %}
<text class="empty" x="{{ plot.box.x + 8 }}" y="{{ plot.box.y + 20 }}">no samples yet</text>
{%- else %}
{%- for line in plot.series %}
<polyline class="series"{% if line.gpu is not none %} data-gpu="{{ line.gpu }}"{% endif %}
 stroke="{{ line.color }}" points="{{ line.points }}"></polyline>
{%- endfor %}
{%- for dot in plot.dots %}
<circle class="dot"{% if dot.gpu is not none %} data-gpu="{{ dot.gpu }}"{% endif %}
 fill="{{ dot.color }}" r="1.5" cx="{{ dot.cx }}" cy="{{ dot.cy }}"></circle>
{%- endfor %}
<text x="2" y="{{ plot.box.y + 8 }}">{{ plot.y_max }}</text>
<text x="2" y="{{ plot.box.y + plot.box.h }}">{{ plot.y_min }}</text>
<text x="{{ plot.box.x }}" y="{{ plot.box.bottom }}">{{ plot.x_min }}</text>
<text x="{{ plot.box.right }}" y="{{ plot.box.bottom }}" text-anchor="end">{{ plot.x_max }}</text>
{%- endif %}
</svg>
{%- if plot.legend|length > 1 %}<div>
{%- for gpu, color in plot.legend %}<span class="key" style="color: {{ color }}">GPU {{ gpu }}</span>{% endfor %}
</div>{% endif %}
</figure>
{%- endfor %}
</div>
</div>
{%- else %}
<p class="empty">{{ box.no_runs }}</p>
{%- endfor %}
{%- if box.runs_more %}<p class="empty">+{{ box.runs_more }} more runs in the JSON report</p>{% endif %}
</section>
{%- else %}
<p class="empty">no boxes in this report</p>
{%- endfor %}
</main>
</body>
</html>
"""
_ENVIRONMENT = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
_PAGE = _ENVIRONMENT.from_string(TEMPLATE)


def _text(value: Any, limit: int = 300) -> str:
    """A box's text as one bounded line; anything that is not a string is empty."""
    return one_line(value, limit) if isinstance(value, str) else ""


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _mappings(value: Any, limit: int) -> List[Mapping[str, Any]]:
    return [item for item in value[:limit] if isinstance(item, Mapping)] if isinstance(value, list) else []


def _count(value: Any) -> Optional[int]:
    found = num(value)
    return int(found) if found is not None and 0 <= found < 1e15 else None


def eta_text(seconds: Any) -> str:
    """``2 d 3 h``, ``1 h 2 min``, ``12 min``, ``40 s``; empty when unknown."""
    found = num(seconds)
    if found is None or found < 0 or found > 1e9:
        return ""
    days, rest = divmod(int(found), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min" if minutes else f"{secs} s"


def _state(record: Mapping[str, Any]) -> str:
    state = record.get("state")
    if record.get("box_state") in DOWN and record.get("reachable") is False:
        return str(record["box_state"]).lower()
    if state == UNREACHABLE or record.get("reachable") is False:
        return UNREACHABLE
    return state if isinstance(state, str) and state in STATE_ORDER else "unknown"


def _order(box: Mapping[str, Any]) -> Tuple[bool, int, str]:
    rank = STATE_ORDER.index(box["state"]) if box["state"] in STATE_ORDER else -1
    return (box["escalate"] != "true", rank, box["host"])


def _progress_text(cell: Mapping[str, Any], fraction: Optional[float]) -> str:
    progress = _mapping(cell.get("progress"))
    parts = ["stalled"] if cell.get("state") == "stalled" else []
    for name, total in (("epoch", "epochs_total"), ("step", "steps_total")):
        done, whole = _count(progress.get(name)), _count(progress.get(total))
        if done is not None:
            parts.append(f"{name} {done}/{whole}" if whole else f"{name} {done}")
    parts.append(f"{fraction * 100:.0f}%" if fraction is not None else "progress unknown")
    eta = eta_text(cell.get("eta_s"))
    return " · ".join([*parts, f"ETA {eta}"] if eta else parts)


def _live_cell(cell: Mapping[str, Any]) -> Dict[str, Any]:
    fraction = num(cell.get("progress_fraction"))
    fraction = None if fraction is None else min(max(fraction, 0.0), 1.0)
    return {
        "name": _text(cell.get("name"), 80) or "?",
        "fraction": "" if fraction is None else str(round(fraction, 4)),
        "width": f"{(fraction or 0.0) * 100:.1f}%",
        "text": _progress_text(cell, fraction),
    }


def _run_head(run: Mapping[str, Any], name: str) -> str:
    parts = [f"run {name}", _text(run.get("state"), 40) or "unknown"]
    done, total = _count(run.get("cells_done")), _count(run.get("cells_total"))
    if total:
        parts.append(f"{done or 0}/{total} cells done")
    started = parse_since(run.get("started_at"))
    if started is not None:
        parts.append(f"started {started:%Y-%m-%d %H:%M} UTC")
    eta = eta_text(run.get("eta_s"))
    return " · ".join([*parts, f"ETA {eta}"] if eta else parts)


def _run(run: Mapping[str, Any]) -> Dict[str, Any]:
    name = _text(run.get("run"), 120) or "?"
    cells = _mappings(run.get("cells"), 1000)
    live = [cell for cell in cells if cell.get("state") in LIVE]
    titles = ("GPU utilization (UTC)", "GPU memory (UTC)", "container memory (UTC)")
    plots = [
        dict(found, title=title, cell=None) for found, title in zip(monitor_plots(run.get("monitor_series")), titles)
    ]
    ordered = live + [cell for cell in cells if cell.get("state") not in LIVE]  # the live cells' curves first
    with_loss = [cell for cell in ordered if isinstance(cell.get("loss_series"), Mapping)]
    for cell in with_loss[:MAX_LOSS_PLOTS]:
        series = _mapping(cell.get("loss_series"))
        cell_name = _text(cell.get("name"), 80) or "?"
        axis = series.get("x_label") if series.get("x_label") in ("step", "line") else "step"
        plots.append(dict(loss_plot(series), title=f"loss · {cell_name} (by {axis})", cell=cell_name))
    return {
        "name": name,
        "head": _run_head(run, name),
        "cells": [_live_cell(cell) for cell in live[:MAX_LIVE_CELLS]],
        "cells_more": max(len(live) - MAX_LIVE_CELLS, 0),
        "plots": plots,
    }


def _box(record: Any) -> Dict[str, Any]:
    record = _mapping(record)
    state = _state(record)
    runs = _mappings(record.get("runs"), 1000)
    given = record.get("reasons") if isinstance(record.get("reasons"), list) else []
    reasons = [one_line(item) for item in given[:MAX_REASONS] if isinstance(item, str)]
    if len(given) > MAX_REASONS:
        reasons.append(f"+{len(given) - MAX_REASONS} more reasons in the JSON report")
    cost = _mapping(record.get("cost"))
    # A stopped box bills its storage from the stop on: that rate, not the GPU's, with the cost so far.
    rate = num(cost.get("hourly_usd")) if cost.get("stopped_at") is None else num(cost.get("hourly_usd_stopped"))
    shown = cost_text({"hourly_usd": rate, "usd": num(cost.get("usd"))})
    if cost.get("stopped_at") is not None:
        shown = f"stopped, storage {shown or 'rate unknown'}"
    headline = _text(record.get("headline")) or _text(record.get("msg"))
    return {
        "host": _text(record.get("host"), 120) or "?",
        "state": state,
        "escalate": "true" if record.get("escalate") is True or state in (UNREACHABLE, "gone", "unknown") else "false",
        "headline": "" if reasons and headline.endswith(reasons[0]) else headline,  # said once
        "reasons": reasons,
        "cost": shown,
        "cost_warning": _text(record.get("cost_warning"), 160),
        "runs": [_run(run) for run in runs[:MAX_RUNS]],
        "runs_more": max(len(runs) - MAX_RUNS, 0),
        "no_runs": "no data: the box did not answer" if record.get("reachable") is False else "no runs on this box",
    }


def render_page(document: Mapping[str, Any]) -> str:
    """The page of a patrol report (``generated_at``, ``stage``, ``check_mode``, ``summary.line``, ``hosts``)."""
    document = _mapping(document)
    hosts = document.get("hosts") if isinstance(document.get("hosts"), list) else []
    page = {
        "generated_at": _text(document.get("generated_at"), 40) or f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
        "stage": _text(document.get("stage"), 40) or "patrol",
        "check_mode": document.get("check_mode") is True,
        "summary_line": _text(_mapping(document.get("summary")).get("line"), 2000),
        "boxes": sorted((_box(record) for record in hosts), key=_order),
    }
    return _PAGE.render(page=page)


def _replace(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (mode 0600): a browser reloading it never sees half a page."""
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def write_page(json_path: str, document: Mapping[str, Any]) -> Tuple[str, str]:
    """Write the page beside its report (``<report minus .json>.html``) and ``patrol-latest.html`` in the same
    directory, both 0600; return both paths. Raises OSError."""
    base = json_path[: -len(".json")] if json_path.endswith(".json") else json_path
    page = os.path.abspath(base + ".html")
    latest = os.path.join(os.path.dirname(page), LATEST)
    text = render_page(document)
    _replace(page, text)
    _replace(latest, text)
    return page, latest
