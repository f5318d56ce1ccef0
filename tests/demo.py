"""`make demo`: bring up three simulated rented boxes, run the collection's lifecycle against them, tear them down.

Each step is a real ansible-playbook run over SSH against the simulated fleet (tests/fleet). The fleet is torn down
whatever happens; the reports stay under --reports. The demo checks its own outcome: each box's verdict in the
preflight report must be the one its scenario was written for; then a short run (tests/demo_sweep.yml) launched
on the healthy box must finish on its own, every cell succeeded and its durable copy verified, and the copy's
files must match MANIFEST.sha256 when hashed again; then one patrol tick must report that run done, the container
box idle and the box whose GPU fell off the bus escalated (re_rent). Else it names what differed and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
PATROL_EXIT = 2  # patrol's "a box escalated": the same dead GPU
LAUNCH_BOX = "box-healthy"
DEMO_RUN = "demo"  # launch_run in tests/demo_sweep.yml
DATA_DIR, DURABLE_DIR = "/data", "/durable"  # what the fleet's inventory gives every box
RUN_WAIT_S = 120


def run_playbook(playbook: str, inventory: Path, *extra_vars: str) -> int:
    """ansible-playbook on the fleet, each of ``extra_vars`` passed with -e."""
    argv = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inventory),
        str(REPO / "playbooks" / playbook),
    ]
    for extra in extra_vars:
        argv += ["-e", extra]
    print(f"\n$ ansible-playbook -i {inventory.name} playbooks/{playbook}", flush=True)
    return subprocess.run(argv, cwd=REPO, check=False).returncode


def launch(inventory: Path, reports: Path) -> int:
    argv = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inventory),
        str(REPO / "playbooks" / "launch.yml"),
        "-e",
        f"@{REPO / 'tests' / 'demo_sweep.yml'}",
        "-e",
        f"launch_hosts={LAUNCH_BOX}",
        "-e",
        f"launch_code_dir={REPO / 'tests' / 'workload'}",
        "-e",
        f"launch_report_dir={reports}",
        "-e",
        f"launch_preflight_report_dir={reports}",
    ]
    print(f"\n$ ansible-playbook -i {inventory.name} playbooks/launch.yml -e @tests/demo_sweep.yml", flush=True)
    return subprocess.run(argv, cwd=REPO, check=False).returncode


# Run in the box: each cell's result, and every MANIFEST.sha256 line checked against the durable file hashed now.
RUN_CHECK = """
import hashlib, json, os, sys
run, durable = sys.argv[1], sys.argv[2]
cells = {}
for cell in sorted(os.listdir(os.path.join(run, "cells"))):
    with open(os.path.join(run, "cells", cell, "result.json")) as handle:
        result = json.load(handle)
    cells[cell] = {"status": result["status"], "sync": result["sync"]}
checked = []
with open(os.path.join(durable, "MANIFEST.sha256")) as manifest:
    for line in manifest:
        digest, size, path = line.split(None, 2)
        with open(os.path.join(durable, path.strip()), "rb") as handle:
            data = handle.read()
        checked.append({"path": path.strip(), "size": int(size), "same": hashlib.sha256(data).hexdigest() == digest
                        and len(data) == int(size)})
print(json.dumps({"done": os.path.exists(os.path.join(run, "DONE")), "cells": cells, "manifest": checked}))
"""


def wait_for_run(fleet: Fleet) -> dict[str, Any] | None:
    """The demo run's outcome once its DONE marker or every cell's result is there, None when it never ends."""
    run_dir, durable = f"{DATA_DIR}/runs/{DEMO_RUN}", f"{DURABLE_DIR}/runs/{DEMO_RUN}"
    print(f"\nwaiting for {LAUNCH_BOX} to finish run {DEMO_RUN} on its own (no controller attached)", flush=True)
    deadline = time.monotonic() + RUN_WAIT_S
    while time.monotonic() < deadline:
        if fleet.ssh(LAUNCH_BOX, ["test", "-e", f"{run_dir}/DONE"]).returncode == 0:
            # The remote shell parses what ssh sends: one quoted string, not an argv.
            done = fleet.ssh(LAUNCH_BOX, shlex.join(["/usr/bin/python3", "-c", RUN_CHECK, run_dir, durable]))
            return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()}
        time.sleep(2)
    return None


def run_differences(outcome: dict[str, Any] | None) -> list[str]:
    if outcome is None:
        return [f"launch: run {DEMO_RUN} did not finish within {RUN_WAIT_S} s"]
    if "error" in outcome:
        return [f"launch: the run's files could not be read: {outcome['error']}"]
    for cell, result in outcome["cells"].items():
        print(f"  {LAUNCH_BOX} {DEMO_RUN}/{cell}: {result['status']}, sync {result['sync']}")
    for entry in outcome["manifest"]:
        print(f"  durable {entry['path']}: {entry['size']} bytes, sha256 {'matches' if entry['same'] else 'DIFFERS'}")
    differences = [f"launch: cell {cell} {r['status']}, sync {r['sync']}" for cell, r in outcome["cells"].items()
                   if (r["status"], r["sync"]) != ("succeeded", "verified")]  # fmt: skip
    differences += [f"launch: durable {e['path']} does not match MANIFEST.sha256" for e in outcome["manifest"]
                    if not e["same"]]  # fmt: skip
    if len(outcome["manifest"]) != len(outcome["cells"]):
        differences.append(f"launch: {len(outcome['manifest'])} files in MANIFEST.sha256, one per cell expected")
    return differences


def patrol_differences(reports: Path) -> list[str]:
    """The tick after the run: the launch box done, the box whose GPU fell off the bus escalated to re-rent."""
    latest = reports / "patrol-latest.json"
    if not latest.exists():
        return ["patrol: no patrol-latest.json was written"]
    hosts = {entry.get("host"): entry for entry in json.loads(latest.read_text()).get("hosts", [])}
    differences = []
    for name, state, escalate in ((LAUNCH_BOX, "done", False), ("box-container", "idle", False)):
        got = hosts.get(name) or {}
        if (got.get("state"), got.get("escalate")) != (state, escalate):
            differences.append(f"patrol: {name} expected {state}, got {got.get('state')} ({got.get('reasons')})")
    lost = hosts.get("box-xid79") or {}
    if not lost.get("escalate") or "re_rent" not in (lost.get("actions") or []):
        differences.append(f"patrol: box-xid79 expected escalated with re_rent, got {lost.get('reasons')}")
    return differences


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
        results["preflight"] = run_playbook(
            "preflight.yml", fleet.inventory_path, f"preflight_report_dir={args.reports}"
        )
        results["launch"] = launch(fleet.inventory_path, args.reports)
        run_outcome = wait_for_run(fleet) if results["launch"] == 0 else None
        results["patrol"] = run_playbook("patrol.yml", fleet.inventory_path, f"patrol_report_dir={args.reports}")
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
    if results.get("launch") != 0:
        differences.append(f"launch: expected exit 0, got {results.get('launch')}")
    else:
        differences += run_differences(run_outcome)
    if results["patrol"] != PATROL_EXIT:
        differences.append(f"patrol: expected exit {PATROL_EXIT}, got {results['patrol']}")
    differences += patrol_differences(args.reports)
    if differences:
        print("\nDEMO FAILED: the outcome is not the one the demo boxes were written for:")
        for line in differences:
            print(f"  {line}")
        return 1
    expected = ", ".join(f"{name} {box.status}" for name, box in DEMO_BOXES.items())
    print(f"every box got its expected verdict: {expected}; run {DEMO_RUN} finished on {LAUNCH_BOX}, copy verified;")
    print("patrol reported it done and escalated box-xid79's lost GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
