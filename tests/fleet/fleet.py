"""A simulated fleet of rented GPU boxes: scenario files in, SSH-reachable hosts and an Ansible inventory out.

    python tests/fleet/fleet.py up --state-dir DIR --scenario a.yml [--scenario b.yml ...] [--name NAME ...]
                                   [--env NAME:KEY=VALUE ...] [--mount NAME:PATH ...] [--profile-dirs NAME ...]
                                   [--python NAME:SPEC ...]
    python tests/fleet/fleet.py status --state-dir DIR
    python tests/fleet/fleet.py ssh --state-dir DIR NAME -- command ...
    python tests/fleet/fleet.py down --state-dir DIR | --all

Each host is an sshd in its own PID, mount, UTS and cgroup namespace, on its own loopback address; see README.md.
From Python: ``Fleet(state_dir).up(scenarios, names=None)``, ``.down()``, ``.inventory_path``, ``.ssh(name, cmd)``.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Collection, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_host
import fleet_procs
from fleet_host import Host

REPO = Path(__file__).resolve().parents[2]
FAKEGPU = Path(os.environ.get("RGT_FAKEGPU_DIR", REPO / "tests" / "fakegpu"))
DELAY_RELAY = Path(__file__).resolve().parent / "delay_relay.py"
COMPAT_PYTHONS = REPO / "tests" / "compat" / "pythons.py"
PYTHON_PROBE = "import sys; print('%d.%d' % sys.version_info[:2]); print(sys.prefix); print(sys.base_prefix)"
ALLOCATION_LOCK = Path("/tmp/rgt-fleet.lock")
ADDRESS_PREFIX = "127.77"
READY_TIMEOUT_S = 30.0
SSH_CHECK_PARALLEL = 8
COMMAND_TIMEOUT_S = 60


class FleetError(RuntimeError):
    """The fleet could not be brought up or torn down; the message names the host and its log."""


@functools.lru_cache(maxsize=None)
def _load(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FleetError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _listening_addresses() -> set[str]:
    """IPv4 addresses with a listening TCP socket on this machine."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # TCP_LISTEN
            raw = bytes.fromhex(fields[1].split(":")[0])
            found.add(socket.inet_ntoa(raw[::-1]))
    return found


def _port_22_taken_by_wildcard() -> bool:
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(path).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and int(port, 16) == 22 and set(address) == {"0"}:
                return True
    return False


def _banner(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5) as conn:
            return conn.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def box_visible_paths() -> list[str]:
    """Directories the boxes must see at their own paths wherever they live (the box's private /tmp would hide a
    checkout under /tmp): the simulator build embeds the python that built it and the simulator's sources, and
    tests run the checkout's scripts and venv python on boxes."""
    return [str(REPO), str(FAKEGPU), sys.prefix, sys.base_prefix]


def resolve_python(name: str, spec: str) -> tuple[str, str, list[str]]:
    """(path, "X.Y", prefixes) of host ``name``'s Python ``spec``: a version ("3.8", found by
    tests/compat/pythons.py) or an absolute path. The prefixes are what the box must see for it to run."""
    pythons = _load("rgt_compat_pythons", COMPAT_PYTHONS)
    try:
        path = spec if spec.startswith("/") else pythons.find_python(spec)
    except (LookupError, ValueError) as exc:
        raise FleetError(f"host {name}: python {spec!r}: {exc} (give a version like 3.8 or an absolute path)") from exc
    try:
        done = subprocess.run(
            [path, "-c", PYTHON_PROBE],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FleetError(f"host {name}: python {spec!r}: {path} does not run: {exc}") from exc
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 3:
        raise FleetError(f"host {name}: python {spec!r}: {path} does not run: {done.stderr.strip()[-200:]}")
    return path, lines[0], sorted({os.path.dirname(path), lines[1], lines[2]})


def default_names(scenarios: Sequence[str]) -> list[str]:
    """File stems, de-duplicated with -2, -3, ..."""
    names: list[str] = []
    for scenario in scenarios:
        stem = Path(scenario).stem
        name, number = stem, 1
        while name in names:
            number += 1
            name = f"{stem}-{number}"
        names.append(name)
    return names


class Fleet:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(os.path.realpath(state_dir))
        self.fleet_json = self.state_dir / "fleet.json"
        self.inventory_path = self.state_dir / "inventory.ini"
        self.simulator_dir = self.state_dir / "sim"
        self.key_path = self.state_dir / "ssh" / "id_ed25519"
        self.control_dir = self._control_dir()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.down()

    # ---- paths and records ---------------------------------------------------------------------------------

    def _control_dir(self) -> Path:
        """ControlPath sockets: under the state dir unless that makes them too long for a unix socket (108 bytes;
        ssh adds '/' + 40 hex digits of %C + a 17-character temporary suffix)."""
        inside = self.state_dir / fleet_procs.CONTROL_DIR_TAG
        if len(str(inside)) + 58 < 104:
            return inside
        return Path("/tmp") / f"{fleet_procs.CONTROL_DIR_TAG}-{fleet_host.fleet_id(str(self.state_dir))}"

    def record(self) -> dict[str, Any]:
        """fleet.json as written by up(), or an empty record."""
        try:
            return json.loads(self.fleet_json.read_text())
        except (OSError, ValueError):
            return {"hosts": []}

    @property
    def hosts(self) -> list[dict[str, Any]]:
        return self.record()["hosts"]

    def host(self, name: str) -> dict[str, Any]:
        for host in self.hosts:
            if host["name"] == name:
                return host
        raise FleetError(f"no host {name!r} in {self.fleet_json}")

    @property
    def delay_ms(self) -> float:
        """Round-trip delay every SSH connection to this fleet's hosts pays (0: none)."""
        return float(self.record().get("delay_ms", 0))

    def ssh_options(self, *, multiplex: bool = True) -> list[str]:
        options = [
            "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
        ]  # fmt: skip
        if multiplex:
            options += [
                "-o",
                "ControlMaster=auto",
                "-o",
                "ControlPersist=60s",
                "-o",
                f"ControlPath={self.control_dir}/%C",
            ]
        else:
            options += ["-o", "ControlMaster=no", "-o", "ControlPath=none"]
        if self.delay_ms:
            options += ["-o", f"ProxyCommand={sys.executable} {DELAY_RELAY} --rtt-ms {self.delay_ms:g} %h %p"]
        return options

    def ssh_argv(self, name: str, command: str | Sequence[str], *, multiplex: bool = True) -> list[str]:
        """argv that runs ``command`` on host ``name`` as root (a sequence is joined by the remote shell)."""
        host = self.host(name)
        options = self.ssh_options(multiplex=multiplex)
        remote = command if isinstance(command, str) else " ".join(command)
        return [
            "ssh", *options, "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
            "-i", str(self.key_path), "-p", str(host["port"]), f"root@{host['address']}", remote,
        ]  # fmt: skip

    def ssh(
        self, name: str, command: str | Sequence[str], timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.ssh_argv(name, command),
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    # ---- up ------------------------------------------------------------------------------------------------

    def up(
        self,
        scenarios: Sequence[str | os.PathLike[str]],
        names: Sequence[str] | None = None,
        timeout_s: float = READY_TIMEOUT_S,
        delay_ms: float = 0,
        *,
        env: Mapping[str, Mapping[str, str]] | None = None,
        mounts: Mapping[str, Sequence[str]] | None = None,
        profile_dirs: Collection[str] = (),
        python: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Start one host per scenario, wait until each answers SSH, write inventory.ini and fleet.json.

        ``delay_ms``: every SSH connection to the hosts (ours and the inventory's) pays that round-trip delay.
        Per host name: ``env``, variables every SSH session on the box gets (a platform's RUNPOD_POD_ID);
        ``mounts``, more paths that get a private tmpfs each (a platform profile's /workspace); ``profile_dirs``,
        hosts whose inventory line leaves data_dir and durable_dir out, so their platform profile sets them;
        ``python``, the box's Python (a version like "3.8" or an absolute path): the inventory's
        ansible_python_interpreter (default /usr/bin/python3), checked to run on the box.
        """
        if delay_ms < 0:
            raise FleetError(f"delay_ms must be 0 or more, not {delay_ms}")
        paths = [str(Path(scenario).resolve()) for scenario in scenarios]
        names = list(names) if names else default_names(paths)
        self._check_names(paths, names)
        extras = {
            "env": dict(env or {}),
            "mounts": dict(mounts or {}),
            "profile_dirs": set(profile_dirs),
            "python": dict(python or {}),
        }
        for key, given in extras.items():
            unknown = sorted(set(given) - set(names))
            if unknown:
                raise FleetError(f"{key} names no host of the fleet: {', '.join(unknown)}")
        if fleet_procs.marked_processes(str(self.state_dir)):
            raise FleetError(f"a fleet is already running in {self.state_dir}: run `down` first")
        self._remove_state()  # leftovers of an interrupted run
        try:
            hosts = self._up(names, paths, timeout_s, delay_ms, extras)
        except BaseException:
            self.down(keep_logs=True)
            raise
        self._write_records(hosts, delay_ms)
        return self.hosts

    def _up(
        self, names: list[str], paths: list[str], timeout_s: float, delay_ms: float, extras: dict[str, Any]
    ) -> list[Host]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.control_dir.mkdir(parents=True, exist_ok=True)
        self._build_simulator()
        self.key_path.parent.mkdir(exist_ok=True)
        fleet_host.generate_key(self.key_path)
        authorized_keys = self.key_path.with_name("authorized_keys")
        shutil.copyfile(self.key_path.with_suffix(".pub"), authorized_keys)
        hosts = [self._describe(name, path, "", 0, extras) for name, path in zip(names, paths)]  # refuse bad extras
        wanted = {"/data", "/durable"} | {path for host in hosts for path in host.mounts}
        for mountpoint in sorted(wanted):  # mount points must exist; hosts mount private tmpfs on them
            if not any(fleet_host.under(mountpoint, mask) for mask in fleet_host.MASKED):  # those are private already
                os.makedirs(mountpoint, exist_ok=True)
        with open(ALLOCATION_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent fleets must not pick the same addresses
            subnet = self._free_subnet()
            port = 2222 if _port_22_taken_by_wildcard() else 22
            for index, host in enumerate(hosts):
                host.address, host.port = f"{ADDRESS_PREFIX}.{subnet}.{index + 1}", port
            started = self._start(hosts, authorized_keys, delay_ms)
            self._wait_for_banners(hosts, started, timeout_s)
        self._check_ssh(hosts, timeout_s, delay_ms)
        return hosts

    def _check_names(self, paths: list[str], names: list[str]) -> None:
        if len(names) != len(paths):
            raise FleetError(f"{len(names)} names for {len(paths)} scenarios")
        if len(set(names)) != len(names):
            raise FleetError(f"duplicate host names: {names}")
        if not 1 <= len(paths) <= 254:
            raise FleetError("a fleet has 1 to 254 hosts")
        for name in names:
            if not fleet_host.NAME_PATTERN.match(name):
                raise FleetError(f"host name {name!r}: use letters, digits, '.', '_' and '-'")

    def _build_simulator(self) -> None:
        """Build the simulator into the state dir unless a build newer than its sources is there."""
        library = self.simulator_dir / "lib" / "libnvidia-ml.so.1"
        sources = [path for path in FAKEGPU.glob("*") if path.is_file()]
        if library.exists() and all(path.stat().st_mtime <= library.stat().st_mtime for path in sources):
            return
        result = subprocess.run(
            [sys.executable, str(FAKEGPU / "build.py"), "build", "--out", str(self.simulator_dir)],
            check=False, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if result.returncode != 0:
            raise FleetError(f"simulator build failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def _free_subnet(self) -> int:
        """A third address byte no running fleet listens on; stable per state dir when free."""
        used = {
            int(address.split(".")[2]) for address in _listening_addresses() if address.startswith(ADDRESS_PREFIX + ".")
        }
        start = int(fleet_host.fleet_id(str(self.state_dir)), 16) % 254
        for offset in range(254):
            candidate = (start + offset) % 254 + 1
            if candidate not in used:
                return candidate
        raise FleetError(f"every {ADDRESS_PREFIX}.x.0/24 has a listener: run `down --all`")

    def _describe(self, name: str, path: str, address: str, port: int, extras: dict[str, Any]) -> Host:
        build_module = _load("fakegpu_build", FAKEGPU / "build.py")
        scenario_module = importlib.import_module("scenario")  # the one build.py put on sys.path and uses itself
        try:
            scenario = scenario_module.load(path)
            simulator_env = build_module.environment(str(self.simulator_dir), path)
        except scenario_module.ScenarioError as exc:
            raise FleetError(f"host {name}: {exc}") from exc
        box = dict(fleet_host.BOX_DEFAULTS, **scenario.get("box", {}))
        directory = self.state_dir / "hosts" / name
        own_copy = str(directory / "scenario.yml")
        simulator_env = {key: str(value) for key, value in simulator_env.items()}
        simulator_env["FAKEGPU_SCENARIO"] = own_copy
        simulator_env["FAKEGPU_STATE_DIR"] = str(directory / "gpu-state")  # per box, even for a shared scenario
        env = {str(key): str(value) for key, value in extras["env"].get(name, {}).items()}
        mounts = [str(path) for path in extras["mounts"].get(name, [])]
        try:
            fleet_host.check_extras(name, env, mounts, simulator_env)
        except ValueError as exc:
            raise FleetError(str(exc)) from exc
        python, python_version, python_dirs = fleet_host.DEFAULT_PYTHON, None, []
        if name in extras["python"]:
            python, python_version, python_dirs = resolve_python(name, str(extras["python"][name]))
        return Host(
            name=name,
            hostname=box.get("hostname", name),
            address=address,
            port=port,
            scenario=own_copy,
            scenario_source=path,
            gpu_count=len(scenario["gpus"]),
            directory=str(directory),
            log=str(directory / "host.log"),
            data_size_mib=box["data_size_mib"],
            data_inodes=box["data_inodes"],
            durable_size_mib=box["durable_size_mib"],
            durable_inodes=box["durable_inodes"],
            memory_limit_mib=box.get("memory_limit_mib"),
            simulator_env=simulator_env,
            env=env,
            mounts=mounts,
            profile_dirs=name in extras["profile_dirs"],
            python=python,
            python_version=python_version,
            python_dirs=python_dirs,
        )

    def _start(self, hosts: list[Host], authorized_keys: Path, delay_ms: float) -> dict[str, subprocess.Popen[bytes]]:
        cgroup_parent = fleet_procs.own_memory_cgroup()
        for host in hosts:
            fleet_host.prepare(host, self.state_dir, authorized_keys)
        started = {}
        for host in hosts:
            cgroup = fleet_host.create_cgroup(cgroup_parent, fleet_host.fleet_id(str(self.state_dir)), host)
            host.cgroup = str(cgroup) if cgroup else None
            if host.memory_limit_mib and cgroup is None:
                print(
                    f"warning: {host.name}: no writable memory cgroup here, memory_limit_mib ignored", file=sys.stderr
                )
            environment = fleet_host.init_environment(
                host,
                str(self.state_dir),
                self.simulator_dir / "bin",
                cgroup is not None,
                [*box_visible_paths(), *host.python_dirs],
            )
            started[host.name] = fleet_host.start(host, environment)
            host.unshare_pid = started[host.name].pid
        self._write_records(hosts, delay_ms)  # so `down` and `status` know the pids even if waiting fails
        return started

    def _wait_for_banners(
        self, hosts: list[Host], started: dict[str, subprocess.Popen[bytes]], timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(hosts)
        while pending:
            for host in list(pending):
                if _banner(host.address, host.port):
                    children = fleet_procs.children_of(started[host.name].pid)
                    host.init_pid = children[0] if children else None
                    pending.remove(host)
                elif started[host.name].poll() is not None:
                    raise FleetError(f"host {host.name}: init exited; log {host.log}:\n{_tail(host.log)}")
            if pending and time.monotonic() > deadline:
                host = pending[0]
                raise FleetError(
                    f"host {host.name} ({host.address}:{host.port}) did not answer within {timeout_s:.0f}s;"
                    f" log {host.log}:\n{_tail(host.log)}"
                )
            if pending:
                time.sleep(0.05)

    def _check_ssh(self, hosts: list[Host], timeout_s: float, delay_ms: float) -> None:
        """Log in once per host (key, shell and simulator environment all work), a few at a time."""
        self._write_records(hosts, delay_ms)
        queue = list(hosts)
        running: list[tuple[Host, subprocess.Popen[bytes]]] = []
        deadline = time.monotonic() + timeout_s
        while queue or running:
            while queue and len(running) < SSH_CHECK_PARALLEL:
                host = queue.pop(0)
                check = 'test -n "$FAKEGPU_SCENARIO"'
                if host.python_version:  # the Python it was given runs there (its prefix is visible)
                    check += f" && {shlex.quote(host.python)} -c ''"
                argv = self.ssh_argv(host.name, check, multiplex=False)
                process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
                running.append((host, process))
            host, process = running.pop(0)
            try:
                output = process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise FleetError(f"host {host.name}: ssh login timed out; log {host.log}:\n{_tail(host.log)}") from None
            if process.returncode != 0:
                raise FleetError(
                    f"host {host.name}: ssh login failed ({process.returncode}): {output.decode(errors='replace')}"
                    f" log {host.log}:\n{_tail(host.log)}"
                )

    def _write_records(self, hosts: list[Host], delay_ms: float) -> None:
        record = {
            "state_dir": str(self.state_dir),
            "delay_ms": delay_ms,
            "key": str(self.key_path),
            "control_dir": str(self.control_dir),
            "inventory": str(self.inventory_path),
            "hosts": [host.as_dict() for host in hosts],
        }
        self.fleet_json.write_text(json.dumps(record, indent=2) + "\n")
        self.inventory_path.write_text(self.inventory(hosts))

    def inventory(self, hosts: list[Host]) -> str:
        # The value sits in single quotes and Ansible splits it like a shell: an option with spaces gets double ones.
        common = " ".join(f'"{option}"' if " " in option else option for option in self.ssh_options())
        lines = ["[fleet]"]
        for host in hosts:
            lines.append(
                f"{host.name} ansible_host={host.address} ansible_port={host.port} ansible_user=root"
                f" ansible_ssh_private_key_file={self.key_path} ansible_ssh_common_args='{common}'"
                f" ansible_python_interpreter={host.python}"
                f"{'' if host.profile_dirs else ' data_dir=/data durable_dir=/durable'}"
                f" fakegpu_scenario={host.scenario} fakegpu_scenario_source={host.scenario_source}"
                f" fakegpu_gpu_count={host.gpu_count}"
            )
        return "\n".join(lines) + "\n"

    # ---- status and down -----------------------------------------------------------------------------------

    def status(self) -> dict[str, bool]:
        """host name -> whether it answers SSH."""
        return {host["name"]: _banner(host["address"], host["port"]) for host in self.hosts}

    def down(self, keep_logs: bool = False) -> None:
        """Kill every host of this fleet, its ssh masters and cgroups; remove its state (the simulator build stays).

        ``keep_logs`` leaves hosts/<name>/host.log for a failed ``up`` to point at.
        """
        left = fleet_procs.kill_fleet_processes(str(self.state_dir))
        stray_ssh = fleet_procs.stop_ssh_clients(str(self.control_dir))
        cgroups = fleet_procs.fleet_cgroups(fleet_host.fleet_id(str(self.state_dir)))  # found without fleet.json too
        failed_cgroups = [str(path) for path in cgroups if not fleet_procs.remove_cgroup_tree(path)]
        self._remove_state(keep_logs)
        if left or stray_ssh or failed_cgroups:
            raise FleetError(f"down left processes {left + stray_ssh} and cgroups {failed_cgroups}")

    def _remove_state(self, keep_logs: bool = False) -> None:
        for path in (self.fleet_json, self.inventory_path):
            path.unlink(missing_ok=True)
        for directory in (self.key_path.parent, self.control_dir):
            shutil.rmtree(directory, ignore_errors=True)
        hosts = self.state_dir / "hosts"
        if not keep_logs:
            shutil.rmtree(hosts, ignore_errors=True)
            return
        for entry in hosts.glob("*/*"):
            if entry.name != "host.log":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def down_all() -> list[str]:
    """Tear down every fleet on this machine, including strays of interrupted runs; return their state dirs."""
    state_dirs = sorted(set(fleet_procs.marked_processes().values()))
    for state_dir in state_dirs:
        Fleet(state_dir).down()
    left = fleet_procs.kill_fleet_processes(None)
    left += fleet_procs.stop_ssh_clients(fleet_procs.CONTROL_DIR_TAG)
    failed = [str(path) for path in fleet_procs.fleet_cgroups() if not fleet_procs.remove_cgroup_tree(path)]
    for control_dir in Path("/tmp").glob(f"{fleet_procs.CONTROL_DIR_TAG}-*"):
        shutil.rmtree(control_dir, ignore_errors=True)
    if left or failed:
        raise FleetError(f"down --all left processes {left} and cgroups {failed}")
    return state_dirs


def _extras_of(
    env_args: Sequence[str], mount_args: Sequence[str], python_args: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """``--env NAME:KEY=VALUE``, ``--mount NAME:PATH`` and ``--python NAME:SPEC`` as up()'s ``env``, ``mounts``
    and ``python``."""
    env: dict[str, dict[str, str]] = {}
    for given in env_args:
        name, _colon, pair = given.partition(":")
        key, equals, value = pair.partition("=")
        if not equals:
            raise FleetError(f"--env {given!r}: NAME:KEY=VALUE")
        env.setdefault(name, {})[key] = value
    mounts: dict[str, list[str]] = {}
    for given in mount_args:
        name, colon, path = given.partition(":")
        if not colon:
            raise FleetError(f"--mount {given!r}: NAME:PATH")
        mounts.setdefault(name, []).append(path)
    python: dict[str, str] = {}
    for given in python_args:
        name, colon, spec = given.partition(":")
        if not colon or not spec or name in python:
            raise FleetError(f"--python {given!r}: NAME:SPEC, once per host (SPEC: a version like 3.8 or a path)")
        python[name] = spec
    return env, mounts, python


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start one host per scenario and write inventory.ini")
    up.add_argument("--state-dir", required=True)
    up.add_argument("--scenario", action="append", required=True)
    up.add_argument("--name", action="append", help="host names, in scenario order (default: file stems)")
    up.add_argument("--timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for SSH")
    up.add_argument("--delay-ms", type=float, default=0, help="round-trip delay of every SSH connection to the hosts")
    up.add_argument("--env", action="append", default=[], metavar="NAME:KEY=VALUE", help="a variable of host NAME")
    up.add_argument("--mount", action="append", default=[], metavar="NAME:PATH", help="a private tmpfs on host NAME")
    up.add_argument("--profile-dirs", action="append", default=[], metavar="NAME", help="no data_dir/durable_dir")
    up.add_argument(
        "--python", action="append", default=[], metavar="NAME:SPEC", help="host NAME's Python: X.Y or a path"
    )
    status = commands.add_parser("status", help="print each host and whether it answers SSH")
    status.add_argument("--state-dir", required=True)
    ssh = commands.add_parser("ssh", help="run a command on one host")
    ssh.add_argument("--state-dir", required=True)
    ssh.add_argument("name")
    ssh.add_argument("remote", nargs=argparse.REMAINDER)
    down = commands.add_parser("down", help="kill the hosts and remove the fleet's state")
    target = down.add_mutually_exclusive_group(required=True)
    target.add_argument("--state-dir")
    target.add_argument("--all", action="store_true", help="every fleet on this machine, strays included")
    args = parser.parse_args(argv)

    try:
        if args.command == "up":
            env, mounts, python = _extras_of(args.env, args.mount, args.python)
            hosts = Fleet(args.state_dir).up(
                args.scenario,
                args.name,
                args.timeout,
                args.delay_ms,
                env=env,
                mounts=mounts,
                profile_dirs=args.profile_dirs,
                python=python,
            )
            for host in hosts:
                where = f"{host['address']}:{host['port']}"
                python = f"\tpython {host['python_version']}" if host["python_version"] else ""
                print(f"{host['name']}\t{where}\t{host['gpu_count']} GPU(s)\t{host['scenario_source']}{python}")
            print(f"inventory: {Fleet(args.state_dir).inventory_path}")
        elif args.command == "status":
            fleet = Fleet(args.state_dir)
            answers = fleet.status()
            for host in fleet.hosts:
                state = "up" if answers[host["name"]] else "DOWN"
                print(f"{host['name']}\t{host['address']}:{host['port']}\t{state}\t{host['scenario_source']}")
            return 0 if answers and all(answers.values()) else 1
        elif args.command == "ssh":
            remote = args.remote[1:] if args.remote[:1] == ["--"] else args.remote
            argv_ssh = Fleet(args.state_dir).ssh_argv(args.name, remote)
            return subprocess.run(argv_ssh, check=False).returncode
        elif args.all:
            for state_dir in down_all():
                print(f"down: {state_dir}")
        else:
            Fleet(args.state_dir).down()
    except FleetError as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
