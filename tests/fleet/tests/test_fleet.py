"""The simulated fleet over real SSH: isolation, per-box GPUs and mounts, and a teardown that leaves nothing."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fleet_procs
import pytest
from fleet import Fleet, FleetError, default_names

pytestmark = pytest.mark.fleet

FLEET_PY = Path(__file__).resolve().parents[1] / "fleet.py"

BIG = """\
box: {hostname: gpu-big-01, data_size_mib: 96, data_inodes: 3000, durable_size_mib: 48, durable_inodes: 1500,
      memory_limit_mib: 300}
gpus:
  - {name: NVIDIA H100 80GB HBM3}
  - {name: NVIDIA H100 80GB HBM3}
  - {name: NVIDIA H100 80GB HBM3}
  - {name: NVIDIA H100 80GB HBM3}
"""
CONSUMER = """\
gpus:
  - {name: NVIDIA GeForce RTX 4090, memory_mib: {total: 24564, used: 0}, ecc: not_supported}
"""
NO_DRIVER = """\
driver: {library: absent}
gpus: [{name: NVIDIA A100-SXM4-80GB}, {name: NVIDIA A100-SXM4-80GB}]
"""
EXPECTED = {
    "big": {"hostname": "gpu-big-01", "gpus": ["NVIDIA H100 80GB HBM3"] * 4},
    "consumer": {"hostname": "consumer", "gpus": ["NVIDIA GeForce RTX 4090"]},
    "nodriver": {"hostname": "nodriver", "gpus": ["NVIDIA A100-SXM4-80GB"] * 2},
}


def write_scenario(directory: Path, name: str, text: str) -> str:
    path = directory / f"{name}.yml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    scenarios = [
        write_scenario(base, "big", BIG),
        write_scenario(base, "consumer", CONSUMER),
        write_scenario(base, "nodriver", NO_DRIVER),
    ]
    fleet = Fleet(base / "state")
    fleet.up(scenarios)
    yield fleet
    fleet.down()


def run(fleet: Fleet, name: str, command: str) -> str:
    result = fleet.ssh(name, command)
    assert result.returncode == 0, f"{name}: {command!r} -> {result.returncode}: {result.stderr}"
    return result.stdout


def test_every_host_answers_and_is_in_the_inventory(fleet: Fleet) -> None:
    assert fleet.status() == {"big": True, "consumer": True, "nodriver": True}
    listed = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(fleet.inventory_path), "--list"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    inventory = json.loads(listed.stdout)
    assert inventory["fleet"]["hosts"] == ["big", "consumer", "nodriver"]
    for host in fleet.hosts:
        variables = inventory["_meta"]["hostvars"][host["name"]]
        assert variables["ansible_host"] == host["address"]
        assert variables["ansible_port"] == host["port"]
        assert variables["ansible_user"] == "root"
        assert variables["ansible_python_interpreter"] == "/usr/bin/python3"
        assert (variables["data_dir"], variables["durable_dir"]) == ("/data", "/durable")
        assert variables["fakegpu_scenario"] == host["scenario"]
        assert f"ControlPath={fleet.control_dir}/%C" in variables["ansible_ssh_common_args"]
    assert len({host["address"] for host in fleet.hosts}) == 3


def test_hostname_comes_from_the_box_or_the_host_name(fleet: Fleet) -> None:
    for name, expected in EXPECTED.items():
        assert run(fleet, name, "hostname").strip() == expected["hostname"]


def test_a_process_on_one_host_is_invisible_from_another(fleet: Fleet) -> None:
    run(fleet, "big", "nohup sleep 3117 >/dev/null 2>&1 &")
    assert "sleep 3117" in run(fleet, "big", "ps -eo args")
    assert "sleep 3117" not in run(fleet, "consumer", "ps -eo args")
    # PID 1 of every box is its own sshd, so each sees a process tree of its own.
    for name in EXPECTED:
        assert f"hosts/{name}/rgt-fleet-sshd_config" in run(fleet, name, "cat /proc/1/cmdline | tr '\\0' ' '")


def test_gpu_device_nodes_match_the_scenario(fleet: Fleet) -> None:
    for name, expected in EXPECTED.items():
        nodes = run(fleet, name, "ls /dev | grep '^nvidia'").split()
        gpu_nodes = sorted(node for node in nodes if node[len("nvidia") :].isdigit())
        assert gpu_nodes == [f"nvidia{index}" for index in range(len(expected["gpus"]))]
        assert {"nvidiactl", "nvidia-uvm"} <= set(nodes)


def test_nvidia_smi_over_ssh_lists_that_hosts_gpus(fleet: Fleet) -> None:
    for name in ("big", "consumer"):
        lines = run(fleet, name, "nvidia-smi -L").splitlines()
        names = [line.split(": ", 1)[1].split(" (UUID")[0] for line in lines]
        assert names == EXPECTED[name]["gpus"]


def test_a_box_without_the_driver_has_no_nvidia_smi(fleet: Fleet) -> None:
    result = fleet.ssh("nodriver", "command -v nvidia-smi")
    assert result.returncode == 1
    assert result.stdout == ""


def test_simulator_environment_reaches_a_non_interactive_shell(fleet: Fleet) -> None:
    host = fleet.host("big")
    env = dict(line.split("=", 1) for line in run(fleet, "big", "env").splitlines() if "=" in line)
    assert env["FAKEGPU_SCENARIO"] == host["scenario"]
    assert env["PATH"].split(":")[0] == str(fleet.simulator_dir / "bin")
    assert env["LD_LIBRARY_PATH"] == host["simulator_env"]["LD_LIBRARY_PATH"]
    assert env["FAKEGPU_STATE_DIR"] == str(Path(host["directory"]) / "gpu-state")
    assert run(fleet, "big", "command -v dmesg").strip() == str(fleet.simulator_dir / "bin" / "dmesg")


def test_data_and_durable_mounts_have_the_sizes_asked(fleet: Fleet) -> None:
    def sizes(name: str, path: str) -> tuple[int, int]:
        size, inodes = run(fleet, name, f"df -B1M --output=size,itotal {path} | tail -1").split()
        return int(size), int(inodes)

    assert sizes("big", "/data") == (96, 3000)
    assert sizes("big", "/durable") == (48, 1500)
    assert sizes("consumer", "/data") == (512, 200_000)
    # Private per box: a file written on one box is not on another.
    run(fleet, "big", "echo x > /data/only-here && echo y > /tmp/only-here")
    assert run(fleet, "consumer", "ls -A /data; ls /tmp/only-here 2>&1 || true").split() == [
        "ls:", "cannot", "access", "'/tmp/only-here':", "No", "such", "file", "or", "directory",
    ]  # fmt: skip


def test_filling_data_fails_with_no_space(fleet: Fleet) -> None:
    result = fleet.ssh("big", "dd if=/dev/zero of=/data/fill bs=1M count=200 2>&1; echo rc=$?; rm -f /data/fill")
    assert "No space left on device" in result.stdout
    assert "rc=1" in result.stdout


@pytest.mark.skipif(fleet_procs.own_memory_cgroup() is None, reason="no writable cgroup-v1 memory hierarchy here")
def test_memory_limit_is_the_boxs_own_cgroup_limit(fleet: Fleet) -> None:
    assert run(fleet, "big", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes").strip() == str(300 * 1024 * 1024)
    assert run(fleet, "big", "grep :memory: /proc/self/cgroup").strip().endswith(":memory:/")
    unlimited = int(run(fleet, "consumer", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes"))
    assert unlimited > 2**60


def test_status_cli_reports_each_host(fleet: Fleet) -> None:
    result = subprocess.run(
        [sys.executable, str(FLEET_PY), "status", "--state-dir", str(fleet.state_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0
    assert [line.split("\t")[:3] for line in result.stdout.splitlines()] == [
        [host["name"], f"{host['address']}:{host['port']}", "up"] for host in fleet.hosts
    ]


def test_default_names_are_stems_made_unique() -> None:
    assert default_names(["a/x.yml", "b/x.yml", "c/y.yml", "x.yaml"]) == ["x", "x-2", "y", "x-3"]


def test_down_leaves_no_process_cgroup_or_state(fresh_fleet: Fleet, tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, "plain", "box: {memory_limit_mib: 200}\n")
    hosts = fresh_fleet.up([scenario, scenario], names=["one", "two"])
    run(fresh_fleet, "one", "nohup sleep 3118 >/dev/null 2>&1 &")  # also leaves an ssh ControlPersist master
    assert fleet_procs.ssh_clients(str(fresh_fleet.control_dir))
    marked = fleet_procs.marked_processes(str(fresh_fleet.state_dir))
    assert len([pid for pid in marked if fleet_procs.is_namespace_init(pid)]) == 2

    fresh_fleet.down()

    assert fleet_procs.marked_processes(str(fresh_fleet.state_dir)) == {}
    assert fleet_procs.ssh_clients(str(fresh_fleet.control_dir)) == []
    assert all(not Path(host["cgroup"]).exists() for host in hosts if host["cgroup"])
    assert sorted(path.name for path in fresh_fleet.state_dir.iterdir()) == ["sim"]
    assert not fresh_fleet.control_dir.exists()
    assert fresh_fleet.status() == {}
    for host in hosts:
        with socket.socket() as probe:
            assert probe.connect_ex((host["address"], host["port"])) != 0


def test_down_finds_hosts_of_an_interrupted_run_by_their_marker(fresh_fleet: Fleet, tmp_path: Path) -> None:
    cgroup = fresh_fleet.up([write_scenario(tmp_path, "plain", "{}\n")])[0]["cgroup"]
    fresh_fleet.fleet_json.unlink()  # as if `up` had been killed before writing its records

    result = subprocess.run(
        [sys.executable, str(FLEET_PY), "down", "--state-dir", str(fresh_fleet.state_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert fleet_procs.marked_processes(str(fresh_fleet.state_dir)) == {}
    assert cgroup is None or not Path(cgroup).parent.exists()


def test_each_host_gets_its_own_copy_of_a_shared_scenario(fresh_fleet: Fleet, tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, "shared", "gpus: [{name: NVIDIA L40S}]\n")
    fresh_fleet.up([scenario, scenario])
    first, second = fresh_fleet.hosts
    assert (first["name"], second["name"]) == ("shared", "shared-2")
    Path(first["scenario"]).write_text("gpus: [{name: NVIDIA L40S}, {name: NVIDIA L40S}]\n")
    assert len(run(fresh_fleet, "shared", "nvidia-smi -L").splitlines()) == 2
    assert len(run(fresh_fleet, "shared-2", "nvidia-smi -L").splitlines()) == 1


def test_a_host_that_fails_to_start_is_named_and_the_rest_torn_down(fresh_fleet: Fleet, tmp_path: Path) -> None:
    good = write_scenario(tmp_path, "good", "{}\n")
    bad = write_scenario(tmp_path, "bad", "box: {data_size_mib: -1}\n")

    with pytest.raises(FleetError, match=r"host bad: init exited; log .*hosts/bad/host\.log") as error:
        fresh_fleet.up([good, bad])

    assert "mount" in str(error.value)
    assert Path(fresh_fleet.state_dir / "hosts" / "bad" / "host.log").exists()
    assert fleet_procs.marked_processes(str(fresh_fleet.state_dir)) == {}
    assert not fresh_fleet.fleet_json.exists()


def test_an_invalid_scenario_is_refused_before_anything_starts(fresh_fleet: Fleet, tmp_path: Path) -> None:
    typo = write_scenario(tmp_path, "typo", "gpus: [{nmae: NVIDIA H100}]\n")
    with pytest.raises(FleetError, match=r"host typo: .*gpus\[0\]\.nmae: unknown key"):
        fresh_fleet.up([typo])
    assert fleet_procs.marked_processes(str(fresh_fleet.state_dir)) == {}
    assert not fresh_fleet.fleet_json.exists()
    assert not fresh_fleet.control_dir.exists()


def test_a_delayed_fleet_pays_the_round_trip_on_every_connection(fresh_fleet: Fleet, tmp_path: Path) -> None:
    fresh_fleet.up([write_scenario(tmp_path, "far", "{}\n")], delay_ms=300)
    assert fresh_fleet.delay_ms == 300
    assert run(fresh_fleet, "far", "echo ready").strip() == "ready"  # opens the multiplexed master

    started = time.monotonic()
    assert run(fresh_fleet, "far", "echo again").strip() == "again"
    assert time.monotonic() - started >= 0.3  # even over the open master, the request and reply cross the delay

    ansible = Path(sys.executable).with_name("ansible")
    ping = subprocess.run(
        [str(ansible), "-i", str(fresh_fleet.inventory_path), "all", "-m", "ansible.builtin.ping"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ping.returncode == 0, ping.stdout + ping.stderr  # the inventory's ProxyCommand survives Ansible's quoting
    assert '"ping": "pong"' in ping.stdout


def test_a_negative_delay_is_refused(fresh_fleet: Fleet, tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="delay_ms must be 0 or more"):
        fresh_fleet.up([write_scenario(tmp_path, "plain", "{}\n")], delay_ms=-1)
    assert not fresh_fleet.fleet_json.exists()


def test_a_box_gets_its_own_variables_mounts_and_profile_dirs(fresh_fleet: Fleet, tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, "plain", "{}\n")
    fresh_fleet.up(
        [scenario, scenario],
        names=["pod", "plain"],
        env={"pod": {"RUNPOD_POD_ID": "pod-17"}},
        mounts={"pod": ["/workspace", "/root/autodl-fs"]},
        profile_dirs=["pod"],
    )
    assert run(fresh_fleet, "pod", "echo $RUNPOD_POD_ID").strip() == "pod-17"
    assert run(fresh_fleet, "plain", "echo ${RUNPOD_POD_ID-unset}").strip() == "unset"
    devices = run(fresh_fleet, "pod", "stat -c %d / /data /workspace /root/autodl-fs").split()
    assert len(set(devices)) == 4  # each mount a filesystem of its own
    run(fresh_fleet, "pod", "echo x > /workspace/only-here")
    assert run(fresh_fleet, "plain", "ls /workspace 2>/dev/null || true").strip() == ""
    lines = {line.split()[0]: line for line in fresh_fleet.inventory_path.read_text().splitlines()[1:]}
    assert "data_dir=" not in lines["pod"] and "durable_dir=" not in lines["pod"]
    assert "data_dir=/data durable_dir=/durable" in lines["plain"]
    assert fresh_fleet.host("pod")["env"] == {"RUNPOD_POD_ID": "pod-17"}


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ({"env": {"one": {"PATH": "/x"}}}, "environment variable 'PATH'"),
        ({"env": {"one": {"A-B": "1"}}}, "environment variable 'A-B'"),
        ({"mounts": {"one": ["/data"]}}, "mount '/data'"),
        ({"mounts": {"one": ["relative"]}}, "mount 'relative'"),
        ({"profile_dirs": ["nobody"]}, "profile_dirs names no host of the fleet: nobody"),
    ],
)
def test_extras_a_box_cannot_get_are_refused(
    fresh_fleet: Fleet, tmp_path: Path, extras: dict[str, Any], message: str
) -> None:
    with pytest.raises(FleetError, match=re.escape(message)):
        fresh_fleet.up([write_scenario(tmp_path, "one", "{}\n")], **extras)
    assert fleet_procs.marked_processes(str(fresh_fleet.state_dir)) == {}
    assert not fresh_fleet.fleet_json.exists()
