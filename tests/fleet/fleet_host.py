"""One simulated box: its files in the fleet's state dir, its sshd config and the environment of its init."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fleet_procs import CGROUP_PREFIX, MARKER, SSHD_CONFIG

HERE = Path(__file__).resolve().parent
INIT_SCRIPT = HERE / "host_init.sh"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Paths host_init.sh hides behind private tmpfs mounts; anything the box needs from under them is re-bound.
MASKED = ("/tmp", "/var/tmp", "/root", "/run", "/dev")
CONTROLLER_PYTHONS = ("/root/.pyenv",)  # so the controller venv's python (tests' pynvml snippets) runs on boxes
BOX_DEFAULTS = {
    "data_size_mib": 512,
    "data_inodes": 200_000,
    "durable_size_mib": 512,
    "durable_inodes": 200_000,
}
PROCESS_TIMEOUT_S = 30
DEFAULT_PYTHON = "/usr/bin/python3"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
OWN_MOUNTS = ("/", "/data", "/durable", "/proc", "/sys", "/usr", "/etc", *MASKED)


@dataclass
class Host:
    """What fleet.json records per host."""

    name: str
    hostname: str
    address: str
    port: int
    scenario: str  # the box's own copy: edit it to change the box's state while it runs
    scenario_source: str
    gpu_count: int
    directory: str
    log: str
    data_size_mib: int
    data_inodes: int
    durable_size_mib: int
    durable_inodes: int
    memory_limit_mib: int | None = None
    cgroup: str | None = None
    unshare_pid: int | None = None
    init_pid: int | None = None
    simulator_env: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # the box's own variables (a platform's RUNPOD_POD_ID)
    mounts: list[str] = field(default_factory=list)  # more private tmpfs mounts (a profile's /workspace)
    profile_dirs: bool = False  # the inventory leaves data_dir and durable_dir to the platform profile
    python: str = DEFAULT_PYTHON  # the inventory's ansible_python_interpreter
    python_version: str | None = None  # its X.Y, when the fleet was given one (None: the image's python3)
    python_dirs: list[str] = field(default_factory=list)  # its prefixes, which the box must see

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def keep_paths(wanted: Sequence[str]) -> list[str]:
    """Directories the box must see although a mask would hide them, minus those inside another kept one."""
    candidates = {os.path.abspath(path) for path in [*wanted, *CONTROLLER_PYTHONS]}
    hidden = [path for path in candidates if os.path.isdir(path) and any(under(path, mask) for mask in MASKED)]
    keep = sorted(path for path in hidden if not any(other != path and under(path, other) for other in hidden))
    for path in keep:
        if ":" in path:
            raise ValueError(f"{path}: a ':' in a path cannot be passed to host_init.sh")
    return keep


def check_extras(name: str, env: dict[str, str], mounts: Sequence[str], simulator_env: dict[str, str]) -> None:
    """ValueError naming the host for a variable or mount the box cannot get."""
    for key, value in env.items():
        if not ENV_NAME.match(key) or key in simulator_env:
            raise ValueError(f"host {name}: environment variable {key!r}: a shell name not set by the simulator")
        _quote_setting(f"{key}={value}")
    for path in mounts:
        if not path.startswith("/") or os.path.normpath(path) != path or ":" in path or path in OWN_MOUNTS:
            raise ValueError(f"host {name}: mount {path!r}: a normalised absolute path (no ':') of its own")


def generate_key(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rgt-fleet", "-f", str(path)],
        check=True,
        timeout=PROCESS_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def _quote_setting(value: str) -> str:
    if any(char in value for char in '"\n\\'):
        raise ValueError(f"cannot put {value!r} into an sshd_config")
    return f'"{value}"'


def sshd_config(host: Host, authorized_keys: str, host_key: str) -> str:
    variables = {**host.simulator_env, **host.env}
    setenv = " ".join(_quote_setting(f"{key}={value}") for key, value in sorted(variables.items()))
    return "\n".join(
        [
            f"ListenAddress {host.address}:{host.port}",
            f"HostKey {_quote_setting(host_key)}",
            "PidFile none",
            "PermitRootLogin prohibit-password",
            f"AuthorizedKeysFile {_quote_setting(authorized_keys)}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "MaxStartups 100",
            "MaxSessions 100",
            "LogLevel INFO",
            "Subsystem sftp internal-sftp",
            f"SetEnv {setenv}",
            "",
        ]
    )


def profile(simulator_env: dict[str, str]) -> str:
    """/root/.profile of the box: Debian's /etc/profile resets PATH for login shells; put the simulator back."""
    path = simulator_env["PATH"]
    if "'" in path:
        raise ValueError(f"PATH {path!r} cannot be quoted for /root/.profile")
    return f"PATH='{path}'\nexport PATH\n"


def create_cgroup(parent: Path | None, fleet_id: str, host: Host) -> Path | None:
    """A memory cgroup of the box's own (with its limit) under the caller's, or None where none can be made."""
    if parent is None:
        return None
    directory = parent / f"{CGROUP_PREFIX}{fleet_id}" / host.name
    directory.mkdir(parents=True, exist_ok=True)
    if host.memory_limit_mib:
        (directory / "memory.limit_in_bytes").write_text(str(host.memory_limit_mib * 1024 * 1024))
    return directory


def prepare(host: Host, state_dir: Path, authorized_keys: Path) -> None:
    """Write the box's files: scenario copy, host key, sshd config, login profile."""
    directory = Path(host.directory)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(host.scenario_source, host.scenario)
    (directory / "gpu-state").mkdir(exist_ok=True)
    key = directory / "ssh_host_ed25519_key"
    generate_key(key)
    (directory / SSHD_CONFIG).write_text(sshd_config(host, str(authorized_keys), str(key)))
    (directory / "profile").write_text(profile(host.simulator_env))


def init_environment(
    host: Host, state_dir: str, simulator_bin: Path, with_cgroup: bool, needed: Sequence[str]
) -> dict[str, str]:
    """``needed``: directories the box must see at their own paths (the simulator build embeds some)."""
    directory = Path(host.directory)
    return {
        MARKER: state_dir,
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "RGT_HOSTNAME": host.hostname,
        "RGT_GPU_COUNT": str(host.gpu_count),
        "RGT_SSHD_CONFIG": str(directory / SSHD_CONFIG),
        "RGT_PROFILE": str(directory / "profile"),
        "RGT_DMESG": str(simulator_bin / "dmesg"),
        "RGT_JOURNALCTL": str(simulator_bin / "journalctl"),
        "RGT_DATA_MOUNT": f"{host.data_size_mib}:{host.data_inodes}",
        "RGT_DURABLE_MOUNT": f"{host.durable_size_mib}:{host.durable_inodes}",
        "RGT_MOUNTS": ":".join(host.mounts),
        "RGT_KEEP": ":".join(keep_paths([state_dir, *needed])),
        "RGT_CGROUP_MEMORY": "1" if with_cgroup else "0",
    }


def start(host: Host, environment: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the box: its init runs in fresh namespaces and execs sshd; killing the unshare kills the box."""
    cgroup_procs = Path(host.cgroup) / "cgroup.procs" if host.cgroup else None

    def join_cgroup() -> None:  # runs in the child before exec, so the cgroup namespace starts at the box's cgroup
        if cgroup_procs is not None:
            cgroup_procs.write_text(str(os.getpid()))

    argv = [
        "unshare",
        "--mount",
        "--uts",
        "--pid",
        "--fork",
        "--mount-proc",
        "--cgroup",
        "--kill-child=SIGKILL",
        "--",
        "/bin/sh",
        str(INIT_SCRIPT),
    ]
    with open(host.log, "ab") as log:
        return subprocess.Popen(
            argv,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=join_cgroup,  # noqa: PLW1509 - no threads run while the fleet starts its hosts
        )


def fleet_id(state_dir: str) -> str:
    return hashlib.sha1(state_dir.encode()).hexdigest()[:10]
