"""`make demo`: bring up three simulated rented boxes, run the collection's lifecycle against them, tear them down.

Each step is a real ansible-playbook run over SSH against the simulated fleet (tests/fleet). The fleet is torn down
whatever happens; the reports stay under --reports. The demo checks its own outcome: each box's verdict in the
preflight report must be the one its scenario was written for; then a short run (tests/demo_sweep.yml) launched
on the healthy box must finish on its own, every cell succeeded and its durable copy verified, and the copy's
files must match MANIFEST.sha256 when hashed again; then one patrol tick must report that run done, the container
box idle and the box whose GPU fell off the bus escalated (re_rent); then a teardown of that finished run without
confirmation must be refused (UNCONFIRMED, nothing removed, the provider never called) and one with
``confirm_teardown`` accepted (TORN_DOWN: the copy pulled to the controller and verified, the box's scratch removed,
the durable copy kept, the pod stopped). For the teardown the healthy box is a RunPod pod: an inventory overlay
gives it the repo's platform profiles (inventories/group_vars) and a pod id, and a fake ``runpodctl``
(tests/workload/fake_provider.py) is first on the playbook's PATH. Else it names what differed and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fleet"))

import fleet_procs  # noqa: E402
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
TEARDOWN_EXIT = {"refused": 2, "accepted": 0}  # UNCONFIRMED counts as refused; TORN_DOWN is exit 0
TEARDOWN_STATUS = {"refused": "UNCONFIRMED", "accepted": "TORN_DOWN"}
DEMO_POD = "dm4h100healthy"  # the fake RunPod pod id of the launch box
FAKE_PROVIDER = REPO / "tests" / "workload" / "fake_provider.py"
# Run on the controller copy of each artifact: a real run would torch.load(path, weights_only=True) here.
LOAD_CHECK = [
    "python3",
    "-c",
    "import sys; data = open(sys.argv[1], 'rb').read(); sys.exit(0 if data else 'empty checkpoint')",
    "{{ artifact }}",
]


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


@dataclass(frozen=True)
class TeardownSetup:
    overlay: Path  # the second inventory: platform groups, the repo's profiles, the pod id
    pulled: Path  # teardown_pull_to: the controller copy lands in pulled/<host>/<run>/
    calls: Path  # every call of the fake provider CLI, one JSON line each
    env: dict[str, str]  # the playbook's environment: the fake CLI first on PATH


def teardown_setup(state_dir: Path) -> TeardownSetup:
    """The launch box as a RunPod pod (an inventory overlay) and a fake runpodctl that has it running."""
    root = state_dir.resolve() / "teardown"  # absolute: the fake CLI's bin dir goes on PATH
    shutil.rmtree(root, ignore_errors=True)
    overlay, pulled, provider = root / "inventory", root / "pulled", root / "provider"
    for directory in (overlay / "group_vars", overlay / "host_vars", pulled):
        directory.mkdir(parents=True)
    for profile in sorted((REPO / "inventories" / "group_vars").glob("*.yml")):
        shutil.copy(profile, overlay / "group_vars" / profile.name)
    # JSON is YAML: the fleet inventory's data_dir and durable_dir (host vars) win over the profile's directories.
    (overlay / "hosts.yml").write_text(json.dumps({"all": {"children": {"runpod": {"hosts": {LAUNCH_BOX: None}}}}}))
    host_vars = {
        "instance_id": DEMO_POD,
        "teardown_pull_to": str(pulled),
        "teardown_load_verify_on": "controller",
        "teardown_load_verify_cmd": LOAD_CHECK,
        "teardown_meter_stop_poll_interval_s": 1,
    }
    (overlay / "host_vars" / f"{LAUNCH_BOX}.yml").write_text(json.dumps(host_vars, indent=2) + "\n")
    state, calls = provider / "state.json", provider / "calls.jsonl"
    subprocess.run([sys.executable, str(FAKE_PROVIDER), "install", str(provider / "bin")], check=True)
    subprocess.run([sys.executable, str(FAKE_PROVIDER), "add", "--state", str(state), DEMO_POD], check=True)
    env = dict(os.environ, FAKE_PROVIDER_STATE=str(state), FAKE_PROVIDER_CALLS=str(calls))
    env["PATH"] = f"{provider / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return TeardownSetup(overlay, pulled, calls, env)


def provider_calls(setup: TeardownSetup) -> list[str]:
    """Every call the fake provider CLI got so far, each as a command line."""
    if not setup.calls.exists():
        return []
    return [shlex.join(json.loads(line)["argv"]) for line in setup.calls.read_text().splitlines() if line.strip()]


def teardown(fleet: Fleet, setup: TeardownSetup, reports: Path, confirm: bool) -> dict[str, Any]:
    """playbooks/teardown.yml of the demo run on the launch box; its exit code, report entry and what it left."""
    extra = [f"teardown_run={DEMO_RUN}", f"teardown_hosts={LAUNCH_BOX}", f"teardown_report_dir={reports}"]
    extra += [f"confirm_teardown={LAUNCH_BOX}"] if confirm else []
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(fleet.inventory_path)]
    argv += ["-i", str(setup.overlay), str(REPO / "playbooks" / "teardown.yml")]
    shown = " ".join(f"-e {value}" for value in extra if not value.startswith("teardown_report_dir="))
    overlay = setup.overlay.relative_to(REPO) if setup.overlay.is_relative_to(REPO) else setup.overlay
    print(f"\n$ ansible-playbook -i {fleet.inventory_path.name} -i {overlay} playbooks/teardown.yml {shown}")
    fleet_procs.stop_ssh_clients(str(fleet.control_dir))  # the earlier steps' SSH masters expire mid-run otherwise
    before = {path: path.stat().st_mtime for path in reports.glob("teardown-*.json")}
    for value in extra:
        argv += ["-e", value]
    sys.stdout.flush()
    rc = subprocess.run(argv, cwd=REPO, env=setup.env, check=False).returncode
    fresh = [path for path in reports.glob("teardown-*.json") if before.get(path) != path.stat().st_mtime]
    report = json.loads(max(fresh, key=lambda path: path.stat().st_mtime).read_text()) if fresh else {}
    entry = next((host for host in report.get("hosts", []) if host.get("host") == LAUNCH_BOX), None)
    kept = {"scratch": f"{DATA_DIR}/runs/{DEMO_RUN}", "durable": f"{DURABLE_DIR}/runs/{DEMO_RUN}/MANIFEST.sha256"}
    outcome: dict[str, Any] = {"rc": rc, "entry": entry, "calls": provider_calls(setup)}
    for name, path in kept.items():  # whether the path is still on the box
        outcome[name] = fleet.ssh(LAUNCH_BOX, ["test", "-e", path]).returncode == 0
    return outcome


def run_teardowns(fleet: Fleet, state_dir: Path, reports: Path) -> tuple[TeardownSetup, dict[str, dict[str, Any]]]:
    """The demo run's teardown without confirmation (refused), then with it (accepted)."""
    setup = teardown_setup(state_dir)
    return setup, {step: teardown(fleet, setup, reports, confirm=step == "accepted") for step in TEARDOWN_EXIT}


def teardown_differences(outcomes: dict[str, dict[str, Any]], setup: TeardownSetup | None) -> list[str]:
    """The refused teardown removed and called nothing; the accepted one pulled, removed scratch, stopped the pod."""
    if not outcomes:
        return [f"teardown: not run (run {DEMO_RUN} did not finish)"]
    differences = []
    for step, outcome in outcomes.items():
        entry = outcome["entry"] or {}
        got = f"exit {outcome['rc']} and {entry.get('status')} ({entry.get('reason')})"
        if outcome["rc"] != TEARDOWN_EXIT[step] or entry.get("status") != TEARDOWN_STATUS[step]:
            differences.append(
                f"teardown ({step}): expected exit {TEARDOWN_EXIT[step]} and {TEARDOWN_STATUS[step]}, {got}"
            )
        if not outcome["durable"]:
            differences.append(f"teardown ({step}): the durable copy's MANIFEST.sha256 is gone")
    refused, accepted = outcomes.get("refused"), outcomes.get("accepted")
    if refused is not None and (not refused["scratch"] or refused["calls"]):
        differences.append(f"teardown (refused): scratch kept {refused['scratch']}, provider calls {refused['calls']}")
    if accepted is not None and setup is not None:
        stop = shlex.join(["runpodctl", "pod", "stop", DEMO_POD])
        stops = [call for call in accepted["calls"] if call == stop]
        final = ((accepted["entry"] or {}).get("meter_stop") or {}).get("final_state")
        pulled = sorted((setup.pulled / LAUNCH_BOX / DEMO_RUN).rglob("best.pth"))
        if accepted["scratch"]:
            differences.append(f"teardown (accepted): {DATA_DIR}/runs/{DEMO_RUN} is still on {LAUNCH_BOX}")
        if len(stops) != 1 or final != "EXITED":
            differences.append(f"teardown (accepted): {len(stops)} `{stop}` calls (one expected), final state {final}")
        if not pulled:
            differences.append(f"teardown (accepted): no best.pth in the controller copy {setup.pulled}")
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
    teardowns: dict[str, dict[str, Any]] = {}
    teardown_env: TeardownSetup | None = None
    try:
        fleet.up(scenarios, names=list(DEMO_BOXES))
        results = {"ping": ping(fleet.inventory_path)}
        results["preflight"] = run_playbook(
            "preflight.yml", fleet.inventory_path, f"preflight_report_dir={args.reports}"
        )
        results["launch"] = launch(fleet.inventory_path, args.reports)
        run_outcome = wait_for_run(fleet) if results["launch"] == 0 else None
        results["patrol"] = run_playbook("patrol.yml", fleet.inventory_path, f"patrol_report_dir={args.reports}")
        if run_outcome is not None and "error" not in run_outcome:
            teardown_env, teardowns = run_teardowns(fleet, args.state_dir, args.reports)
            results.update({f"teardown ({step})": outcome["rc"] for step, outcome in teardowns.items()})
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
    differences += teardown_differences(teardowns, teardown_env)
    if differences:
        print("\nDEMO FAILED: the outcome is not the one the demo boxes were written for:")
        for line in differences:
            print(f"  {line}")
        return 1
    expected = ", ".join(f"{name} {box.status}" for name, box in DEMO_BOXES.items())
    print(f"every box got its expected verdict: {expected}; run {DEMO_RUN} finished on {LAUNCH_BOX}, copy verified;")
    print("patrol reported it done and escalated box-xid79's lost GPU; the run's teardown was refused without")
    print(
        f"confirmation, then accepted: copy pulled and verified, scratch removed, durable copy kept, {DEMO_POD} stopped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
