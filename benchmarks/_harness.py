"""What every row of `make bench` shares: alternating repetitions, min / median / max, ratios of medians, a summary.

A row module (``benchmarks/row_*.py``) exposes ``ROW`` (a short title) and ``run(bench: Bench) -> None``. It measures
with ``bench.compare`` (both sides on the same input, alternating order each repetition) or ``bench.measure`` (one
side), prints extra figures with ``bench.figure`` and states each target with ``bench.target``. Only ratios taken in
one run mean anything on these noisy machines, so a target compares two medians of the same run, or a median with an
absolute limit the issue names.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
SEED_DIFF = Path(
    os.environ.get("RGT_SEED_DIFF", REPO.parent / "shared" / "seed" / "remote-gpu-trainer-scripts.diff.txt")
)
DEFAULT_REPS = 5


@dataclass
class Sample:
    """One repetition of one side: its wall seconds and any other figures it produced (samples, RSS, ...)."""

    seconds: float
    extra: Dict[str, float] = field(default_factory=dict)


@dataclass
class Stats:
    side: str
    samples: List[Sample]

    def values(self, key: str = "seconds") -> List[float]:
        return [s.seconds if key == "seconds" else s.extra[key] for s in self.samples]

    def median(self, key: str = "seconds") -> float:
        return statistics.median(self.values(key))

    def line(self, key: str = "seconds", unit: str = "s") -> str:
        vals = self.values(key)
        low, middle, high = min(vals), statistics.median(vals), max(vals)
        return f"min {low:.3f} / median {middle:.3f} / max {high:.3f} {unit} (n={len(vals)})"


@dataclass
class Target:
    row: str
    what: str
    measured: str
    limit: str
    met: bool


Side = Callable[[], Sample]


def timed(action: Callable[[], object]) -> Sample:
    """Run ``action`` and time it; an action that returns a dict of figures has them kept beside the seconds."""
    start = time.perf_counter()
    produced = action()
    sample = Sample(time.perf_counter() - start)
    if isinstance(produced, dict):
        sample.extra.update({key: float(value) for key, value in produced.items()})
    return sample


class Bench:
    def __init__(self, reps: int = DEFAULT_REPS, workdir: Optional[Path] = None) -> None:
        self.reps = reps
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="rgt-bench-"))
        self.row = ""
        self.targets: List[Target] = []
        self.ratios: List[tuple] = []

    def figure(self, name: str, value: str) -> None:
        """One printed line per figure: ``[row] name: value``."""
        print(f"[{self.row}] {name}: {value}", flush=True)

    def measure(self, name: str, side: Side, reps: Optional[int] = None, unit_keys: Sequence[tuple] = ()) -> Stats:
        stats = Stats(name, [side() for _rep in range(reps or self.reps)])
        self._print(stats, unit_keys)
        return stats

    def compare(
        self, sides: Dict[str, Side], reps: Optional[int] = None, unit_keys: Sequence[tuple] = ()
    ) -> Dict[str, Stats]:
        """Every side once per repetition, the order rotated each time so no side always runs warm or first."""
        names = list(sides)
        collected: Dict[str, List[Sample]] = {name: [] for name in names}
        for rep in range(reps or self.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                collected[name].append(sides[name]())
        result = {name: Stats(name, collected[name]) for name in names}
        for stats in result.values():
            self._print(stats, unit_keys)
        return result

    def _print(self, stats: Stats, unit_keys: Sequence[tuple]) -> None:
        self.figure(f"{stats.side} wall", stats.line())
        for key, unit in unit_keys:
            if all(key in s.extra for s in stats.samples):
                self.figure(f"{stats.side} {key}", stats.line(key, unit))

    def ratio(self, label: str, numerator: Stats, denominator: Stats, key: str = "seconds") -> float:
        value = numerator.median(key) / denominator.median(key) if denominator.median(key) else float("inf")
        self.figure(f"ratio {label}", f"{value:.2f}x ({numerator.side} / {denominator.side}, medians)")
        self.ratios.append((self.row, label, value))
        return value

    def target(self, what: str, measured: str, limit: str, met: bool) -> None:
        self.targets.append(Target(self.row, what, measured, limit, met))
        self.figure(f"target {what}", f"{measured} (target {limit}): {'met' if met else 'NOT MET'}")

    def summary(self) -> str:
        lines = ["", "== summary: ratios of medians", f"{'row':<28} {'ratio':<48} {'value':>8}"]
        lines += [f"{row:<28} {label:<48} {value:>7.2f}x" for row, label, value in self.ratios]
        lines += ["", "== summary: targets", f"{'row':<28} {'target':<48} {'measured':<22} {'limit':<14} verdict"]
        for t in self.targets:
            verdict = "met" if t.met else "NOT MET"
            lines.append(f"{t.row:<28} {t.what:<48} {t.measured:<22} {t.limit:<14} {verdict}")
        return "\n".join(lines)

    def scratch(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def seed_script(name: str) -> str:
    """The text of one seed script, exactly as the seed diff adds it (``name`` like ``gpu_health.sh``)."""
    lines = SEED_DIFF.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if line.strip().endswith("/" + name):
            return "\n".join(_added_lines(lines[index + 1 :])) + "\n"
    raise SystemExit(f"{name} not found in {SEED_DIFF}: set RGT_SEED_DIFF to the seed diff")


def _added_lines(rest: List[str]) -> Iterator[str]:
    hunks = [i for i, line in enumerate(rest) if line.startswith("@@")]
    if not hunks:
        raise SystemExit(f"no hunk after the script's name in {SEED_DIFF}")
    hunk = hunks[0]
    count = int(rest[hunk].split("+")[1].split(",")[1].split()[0])
    for line in rest[hunk + 1 : hunk + 1 + count]:
        if not line.startswith("+"):
            raise SystemExit(f"unexpected line in the seed diff hunk: {line[:60]!r}")
        yield line[1:]


def write_seed_script(name: str, directory: Path) -> Path:
    """Extract ``name`` from the seed into ``directory``, unchanged, executable; returns its path."""
    path = directory / name
    path.write_text(seed_script(name), encoding="utf-8")
    path.chmod(0o755)
    return path


if __name__ == "__main__":  # quick self-check: the seed scripts extract
    for script in ("gpu_health.sh", "reap_vram_zombies.sh"):
        print(script, len(seed_script(script).splitlines()), "lines", file=sys.stderr)


class Phases:
    """The wall time of each phase of a row: ``done(name)`` closes the phase that ran since the previous one."""

    def __init__(self) -> None:
        self.mark = time.monotonic()
        self.parts: List[str] = []

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.parts.append(f"{name} {now - self.mark:.0f} s")
        self.mark = now

    def line(self) -> str:
        return ", ".join(self.parts)
