"""`make demo`: bring up three simulated rented boxes, run the collection's lifecycle against them, tear them down.

Each step is a real ansible-playbook run over SSH against the simulated fleet (tests/fleet). The fleet is torn down
whatever happens; the reports stay under --reports. The demo checks its own outcome: each box's verdict in the
preflight report must be the one its scenario was written for, else it names what differed and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fleet"))

from fleet import Fleet  # noqa: E402  (tests/fleet is not a package)


@dataclass(frozen=True)
class DemoBox:
    scenario: str
    status: str  # the verdict preflight must give this box
    codes: tuple[str, ...] = ()  # finding codes its report entry must hold


DEMO_BOXES = {
    "box-healthy": DemoBox("healthy-h100.yml", "PASS"),
    "box-xid79": DemoBox("xid79-fallen-off-bus.yml", "FAIL", ("gpu_lost",)),
    "box-container": DemoBox("container-no-dmesg-orphan-vram.yml", "WARN"),
}
PREFLIGHT_EXIT = 2  # preflight's "a host FAILed": box-xid79 has a dead GPU by design


def run_playbook(playbook: str, inventory: Path, reports: Path) -> int:
    argv = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inventory),
        str(REPO / "playbooks" / playbook),
        "-e",
        f"preflight_report_dir={reports}",
    ]
    print(f"\n$ ansible-playbook -i {inventory.name} playbooks/{playbook}", flush=True)
    return subprocess.run(argv, cwd=REPO, check=False).returncode


def ping(inventory: Path) -> int:
    argv = [str(Path(sys.executable).parent / "ansible"), "-i", str(inventory), "fleet", "-m", "ansible.builtin.ping"]
    print(f"\n$ ansible -i {inventory.name} fleet -m ping", flush=True)
    return subprocess.run(argv, cwd=REPO, check=False).returncode


def newest_report(reports: Path, since: float) -> dict[str, Any] | None:
    """The preflight report this run wrote (the newest one written since ``since``), or None."""
    fresh = [path for path in reports.glob("preflight-*.json") if path.stat().st_mtime >= since]
    if not fresh:
        return None
    return json.loads(max(fresh, key=lambda path: path.stat().st_mtime).read_text())


def verdict_differences(report: Mapping[str, Any] | None, boxes: Mapping[str, DemoBox]) -> list[str]:
    """One line per box whose verdict in ``report`` is not the expected one (empty when all match)."""
    if report is None:
        return ["no preflight report was written"]
    results = {result.get("host"): result for result in report.get("hosts", [])}
    differences = []
    for name, box in boxes.items():
        result = results.get(name)
        if result is None:
            differences.append(f"{name}: not in the report")
            continue
        codes = [finding.get("code") for finding in result.get("findings", [])]
        if result.get("status") != box.status:
            differences.append(f"{name}: expected {box.status}, got {result.get('status')} (findings: {codes})")
        missing = [code for code in box.codes if code not in codes]
        if missing:
            differences.append(f"{name}: expected findings {missing} missing (findings: {codes})")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=REPO / ".build" / "demo-fleet")
    parser.add_argument("--reports", type=Path, default=REPO / "reports")
    args = parser.parse_args()
    args.reports.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ANSIBLE_COLLECTIONS_PATH", str(REPO / ".build" / "collections"))

    fleet = Fleet(args.state_dir)
    scenarios = [REPO / "tests" / "scenarios" / box.scenario for box in DEMO_BOXES.values()]
    print(f"bringing up {len(scenarios)} simulated boxes: {', '.join(DEMO_BOXES)}", flush=True)
    started = time.time() - 1  # report names and mtimes have whole seconds
    try:
        fleet.up(scenarios, names=list(DEMO_BOXES))
        results = {"ping": ping(fleet.inventory_path)}
        results["preflight"] = run_playbook("preflight.yml", fleet.inventory_path, args.reports)
    finally:
        print("\ntearing the fleet down", flush=True)
        fleet.down()
    print("\n== demo finished ==")
    for step, rc in results.items():
        print(f"  {step}: exit {rc}")
    print(f"reports: {args.reports}")
    differences = verdict_differences(newest_report(args.reports, started), DEMO_BOXES)
    if results["ping"] != 0:
        differences.append(f"ping: expected exit 0, got {results['ping']}")
    if results["preflight"] != PREFLIGHT_EXIT:
        differences.append(f"preflight: expected exit {PREFLIGHT_EXIT}, got {results['preflight']}")
    if differences:
        print("\nDEMO FAILED: the outcome is not the one the demo boxes were written for:")
        for line in differences:
            print(f"  {line}")
        return 1
    expected = ", ".join(f"{name} {box.status}" for name, box in DEMO_BOXES.items())
    print(f"every box got its expected verdict: {expected}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
