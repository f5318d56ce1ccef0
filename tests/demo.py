"""`make demo`: bring up three simulated rented boxes, run the collection's lifecycle against them, tear them down.

Each step is a real ansible-playbook run over SSH against the simulated fleet (tests/fleet). The fleet is torn down
whatever happens; the reports stay under --reports.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fleet"))

from fleet import Fleet  # noqa: E402  (tests/fleet is not a package)

DEMO_BOXES = {
    "box-healthy": "healthy-h100.yml",
    "box-xid79": "xid79-fallen-off-bus.yml",
    "box-container": "container-no-dmesg-orphan-vram.yml",
}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=REPO / ".build" / "demo-fleet")
    parser.add_argument("--reports", type=Path, default=REPO / "reports")
    args = parser.parse_args()
    args.reports.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ANSIBLE_COLLECTIONS_PATH", str(REPO / ".build" / "collections"))

    fleet = Fleet(args.state_dir)
    scenarios = [REPO / "tests" / "scenarios" / name for name in DEMO_BOXES.values()]
    print(f"bringing up {len(scenarios)} simulated boxes: {', '.join(DEMO_BOXES)}", flush=True)
    try:
        fleet.up(scenarios, names=list(DEMO_BOXES))
        results = {"ping": ping(fleet.inventory_path)}
        if (REPO / "playbooks" / "preflight.yml").exists():
            results["preflight"] = run_playbook("preflight.yml", fleet.inventory_path, args.reports)
    finally:
        print("\ntearing the fleet down", flush=True)
        fleet.down()
    print("\n== demo finished ==")
    for step, rc in results.items():
        print(f"  {step}: exit {rc}")
    print(f"reports: {args.reports}")
    # Preflight exits 2 by design here: the demo fleet holds a box with a dead GPU.
    return 0 if results["ping"] == 0 and results.get("preflight", 0) in (0, 2) else 1


if __name__ == "__main__":
    sys.exit(main())
