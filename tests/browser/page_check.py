"""Open a fleet page in headless Chromium and check what it renders, not its HTML.

A library for tests/browser and a command for Molecule verify:

    python tests/browser/page_check.py --page reports/patrol-latest.html \
        --expect running=running --expect gone=unreachable --screenshot page.png

exits 0 when the page loaded without a console error, fetched nothing from the network, shows exactly the expected
boxes with their states, escalated cards first on screen, progress bars as wide as their fractions and plots with a
size; otherwise 1 with one line per problem. Chromium and ChromeDriver are Debian's (`make system-deps`): Selenium is
given both paths, so its Selenium Manager never looks for (or downloads) a browser or a driver.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Selenium Manager only runs when a path is missing; offline it could not download anything anyway.
os.environ.setdefault("SE_OFFLINE", "true")

from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("RGT_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("RGT_CHROMEDRIVER", "/usr/bin/chromedriver")
WIDTH = 1280
# A bar's rendered width may differ from its fraction by this much of its track (subpixel rounding, borders).
BAR_TOLERANCE = 0.02
# Schemes a self-contained page may load from.
LOCAL_SCHEMES = ("file:", "data:", "about:", "blob:")
# The network stays closed: every host name resolves to nothing, so a stray URL fails loudly (a console error).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--hide-scrollbars",
)

# One round trip reads the whole rendered page: positions and sizes as laid out, text as shown.
READ_DOM = r"""
const rect = (el) => { const r = el.getBoundingClientRect();
  return {x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height}; };
const attr = (el, name) => el.getAttribute(name);
const summary = document.querySelector('header#summary');
const cards = [...document.querySelectorAll('main#boxes section.box')].map((card, index) => ({
  index: index, host: attr(card, 'data-host'), state: attr(card, 'data-state'), escalate: attr(card, 'data-escalate'),
  rect: rect(card), text: card.innerText,
  name: (card.querySelector('.box-name') || {}).innerText ?? null,
  shown_state: (card.querySelector('.box-state') || {}).innerText ?? null,
  reasons: [...card.querySelectorAll('ul.reasons > li')].map((li) => li.innerText),
  cost: (card.querySelector('.cost') || {}).innerText ?? null,
  scripts: card.querySelectorAll('script').length,
  bars: [...card.querySelectorAll('.progress')].map((track) => {
    const bar = track.querySelector('.bar');
    return {run: attr(track, 'data-run'), cell: attr(track, 'data-cell'), fraction: attr(track, 'data-fraction'),
            track: rect(track), bar: bar ? rect(bar) : null,
            text: (track.querySelector('.progress-text') || {}).innerText ?? null};
  }),
  plots: [...card.querySelectorAll('svg.plot')].map((svg) => ({
    kind: attr(svg, 'data-kind'), run: attr(svg, 'data-run'), cell: attr(svg, 'data-cell'),
    points: attr(svg, 'data-points'), rect: rect(svg),
    series: [...svg.querySelectorAll('polyline.series')].map((line) => ({
      gpu: attr(line, 'data-gpu'), points: line.points.numberOfItems,
      width: line.getBBox().width, height: line.getBBox().height})),
    dots: svg.querySelectorAll('circle.dot').length,
  })),
}));
const urls = [...document.querySelectorAll('[src], [href]')]
  .map((el) => attr(el, 'src') || attr(el, 'href') || attr(el, 'xlink:href'))
  .filter((url) => /^[a-z][a-z0-9+.-]*:|^\/\//i.test(url));
return {
  title: document.title, summary: summary ? summary.innerText : null,
  scroll_height: document.documentElement.scrollHeight, inner_height: window.innerHeight,
  cards: cards,
  resources: performance.getEntriesByType('resource').map((entry) => entry.name),
  urls: urls,
};
"""


@dataclass
class Bar:
    """One progress bar: its data-fraction (as written, and as a number; empty when unknown) and the share of its
    track it covers on screen."""

    run: str | None
    cell: str | None
    declared: str | None
    fraction: float | None
    rendered: float | None
    text: str | None


@dataclass
class Plot:
    """One SVG plot as laid out: its box, per polyline how many points it draws, and its lone samples (dots)."""

    kind: str | None
    run: str | None
    cell: str | None
    points: int | None
    width: float
    height: float
    series: list[dict[str, Any]]
    dots: int


@dataclass
class Card:
    """One box's card; ``index`` is its place in the DOM, ``x``/``y`` where it was laid out."""

    index: int
    host: str | None
    state: str | None
    escalate: bool
    x: float
    y: float
    width: float
    height: float
    text: str
    name: str | None
    shown_state: str | None
    reasons: list[str]
    cost: str | None
    scripts: int
    bars: list[Bar] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)


@dataclass
class PageView:
    """What the browser made of a page: cards in rendered order (top to bottom, then left to right), console
    messages, every URL it used."""

    title: str
    summary: str | None
    cards: list[Card]
    console: list[dict[str, Any]]
    resources: list[str]
    urls: list[str]
    scroll_height: int

    @property
    def console_errors(self) -> list[str]:
        return [str(entry.get("message")) for entry in self.console if entry.get("level") == "SEVERE"]

    @property
    def network(self) -> list[str]:
        return [url for url in self.resources + self.urls if not url.lower().startswith(LOCAL_SCHEMES)]

    def card(self, host: str) -> Card:
        found = [card for card in self.cards if card.host == host]
        if len(found) != 1:
            raise LookupError(f"{len(found)} cards for host {host!r}")
        return found[0]


class BrowserMissing(RuntimeError):
    """Chromium or ChromeDriver is not installed where the check looks."""


@contextmanager
def browser(width: int = WIDTH, height: int = 900) -> Iterator[webdriver.Chrome]:
    """Headless Debian Chromium with a fresh profile, always quit and the profile removed."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            raise BrowserMissing(f"{path} not found: install Debian's {package} (make system-deps)")
    profile = tempfile.mkdtemp(prefix="rgt-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
        try:
            driver.set_page_load_timeout(30)
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _bar(raw: Mapping[str, Any]) -> Bar:
    track, fill = raw["track"], raw["bar"]
    rendered = fill["width"] / track["width"] if fill and track["width"] > 0 else None
    return Bar(raw["run"], raw["cell"], raw["fraction"], _num(raw["fraction"]), rendered, raw["text"])


def _plot(raw: Mapping[str, Any]) -> Plot:
    points = _num(raw["points"])
    return Plot(
        raw["kind"],
        raw["run"],
        raw["cell"],
        None if points is None else int(points),
        raw["rect"]["width"],
        raw["rect"]["height"],
        list(raw["series"]),
        int(raw["dots"]),
    )


def _card(raw: Mapping[str, Any]) -> Card:
    box = raw["rect"]
    return Card(
        index=int(raw["index"]),
        host=raw["host"],
        state=raw["state"],
        escalate=raw["escalate"] == "true",
        x=box["x"],
        y=box["y"],
        width=box["width"],
        height=box["height"],
        text=raw["text"],
        name=raw["name"],
        shown_state=raw["shown_state"],
        reasons=list(raw["reasons"]),
        cost=raw["cost"],
        scripts=raw["scripts"],
        bars=[_bar(item) for item in raw["bars"]],
        plots=[_plot(plot) for plot in raw["plots"]],
    )


def load(driver: webdriver.Chrome, page: str | Path) -> PageView:
    """Open the page from disk, wait until it has loaded, and read its rendered DOM and console."""
    path = Path(page).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"--page {page}: no such file")
    driver.get_log("browser")  # drop what an earlier page left
    driver.get(path.as_uri())
    WebDriverWait(driver, 30).until(lambda drv: drv.execute_script("return document.readyState") == "complete")
    raw = driver.execute_script(READ_DOM)
    cards = sorted((_card(card) for card in raw["cards"]), key=lambda card: (round(card.y), round(card.x)))
    return PageView(
        title=raw["title"],
        summary=raw["summary"],
        cards=cards,
        console=driver.get_log("browser"),
        resources=list(raw["resources"]),
        urls=list(raw["urls"]),
        scroll_height=int(raw["scroll_height"]),
    )


def screenshot(driver: webdriver.Chrome, out: str | Path) -> Path:
    """The whole page in one PNG: the window is grown to the document's height first."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    width = driver.get_window_size()["width"]
    driver.set_window_size(width, height)
    # The window's frame may take some of its height: grow it by what the viewport still lacks.
    lack = height - int(driver.execute_script("return window.innerHeight"))
    if lack > 0:
        driver.set_window_size(width, height + lack)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not driver.save_screenshot(str(target)):
        raise OSError(f"could not write the screenshot {target}")
    return target


def problems(view: PageView, expect: Mapping[str, str] | None = None) -> list[str]:
    """Every way the rendered page falls short; empty when it is right. expect: host -> state, all the boxes."""
    found: list[str] = [f"console error: {message}" for message in view.console_errors]
    found += [f"loaded from the network: {url}" for url in view.network]
    if view.summary is None or not view.summary.strip():
        found.append("no summary (header#summary) shown")
    if not view.cards:
        found.append("no box cards (main#boxes section.box) shown")
    hosts = [card.host for card in view.cards]
    found += [
        f"host {host!r} has {hosts.count(host)} cards"
        for host in sorted({h for h in hosts if hosts.count(h) > 1}, key=str)
    ]
    for card in view.cards:
        found += _card_problems(card)
    seen_calm = False
    for card in view.cards:
        if not card.escalate:
            seen_calm = True
        elif seen_calm:
            found.append(f"escalated box {card.host} is shown after a box that is not escalated")
    if expect is not None:
        shown = {card.host: card.state for card in view.cards}
        for host, state in sorted(expect.items()):
            if host not in shown:
                found.append(f"box {host} is not shown")
            elif shown[host] != state:
                found.append(f"box {host} is shown as {shown[host]}, expected {state}")
        found += [f"box {host} is shown but not expected" for host in sorted(set(shown) - set(expect), key=str)]
    return found


def _card_problems(card: Card) -> list[str]:
    found: list[str] = []
    where = f"box {card.host}"
    if card.width <= 0 or card.height <= 0:
        found.append(f"{where}: its card is not rendered (size {card.width}x{card.height})")
    if card.name != card.host or card.host is None or card.host not in card.text:
        found.append(f"{where}: its name is not shown (h2 says {card.name!r})")
    # Compared as shown: a style may capitalize the state.
    shown = (card.shown_state or "").casefold()
    if card.state is None or shown != card.state.casefold() or shown not in card.text.casefold():
        found.append(f"{where}: its state {card.state} is not shown (it says {card.shown_state!r})")
    if card.scripts:
        found.append(f"{where}: holds {card.scripts} script element(s)")
    for meter in card.bars:
        name = f"{where}: progress {meter.run}/{meter.cell}"
        # An unknown fraction (empty data-fraction) is an empty meter.
        want = 0.0 if meter.declared == "" else meter.fraction
        if want is None or not 0 <= want <= 1:
            found.append(f"{name}: data-fraction {meter.declared!r} is not a fraction")
        elif meter.rendered is None:
            found.append(f"{name}: no bar rendered in its track")
        elif abs(meter.rendered - want) > BAR_TOLERANCE:
            found.append(f"{name}: bar covers {meter.rendered:.3f} of its track, data-fraction is {meter.fraction}")
    for plot in card.plots:
        name = f"{where}: plot {plot.kind} of {plot.run}{'/' + plot.cell if plot.cell else ''}"
        if plot.width <= 0 or plot.height <= 0:
            found.append(f"{name}: not rendered (size {plot.width}x{plot.height})")
        # The page draws a plot from two samples on; with fewer it says so in words.
        if (plot.points or 0) >= 2 and not plot.series and not plot.dots:
            found.append(f"{name}: {plot.points} samples but no polyline or dot drawn")
    return found


def check(page: str | Path, expect: Mapping[str, str] | None = None, shot: str | Path | None = None) -> list[str]:
    """Load the page in a fresh browser, take the screenshot if asked, and return its problems."""
    with browser() as driver:
        view = load(driver, page)
        if shot is not None:
            screenshot(driver, shot)
        return problems(view, expect)


def _expectation(text: str) -> tuple[str, str]:
    host, sep, state = text.partition("=")
    if not sep or not host or not state:
        raise argparse.ArgumentTypeError(f"--expect takes HOST=STATE, got {text!r}")
    return host, state


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a fleet page as headless Chromium renders it.")
    parser.add_argument("--page", required=True, help="the page's file (e.g. reports/patrol-latest.html)")
    parser.add_argument(
        "--expect",
        action="append",
        type=_expectation,
        default=None,
        metavar="HOST=STATE",
        help="a box and its state; given once per box, the page must show exactly these boxes",
    )
    parser.add_argument("--screenshot", help="write a full-page PNG here")
    args = parser.parse_args(argv)
    expect = dict(args.expect) if args.expect else None
    try:
        found = check(args.page, expect, args.screenshot)
    except (BrowserMissing, FileNotFoundError, OSError, WebDriverException) as exc:
        print(f"page_check: FAIL: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
        return 1
    for line in found:
        print(f"page_check: FAIL: {line}")
    if found:
        return 1
    shot = f", screenshot {args.screenshot}" if args.screenshot else ""
    print(f"page_check: OK {args.page}: {len(expect) if expect else 'all'} boxes as expected{shot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
