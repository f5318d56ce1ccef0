# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The process side of ``training_run``: install the runner, start it detached, tell whether it lives, stop it.

- The runner's code is copied into ``<run>/runner/`` at every start (read with ``pkgutil.get_data``, which works
  from the AnsiballZ zip the module runs from), so a run never depends on a later version of the collection.
- Detach: ``tmux new-session -d`` (argv, never a shell string) or a double fork with ``setsid``, stdin from
  /dev/null and stdout/stderr appended to ``runner.log``: the runner survives the SSH session, the Ansible worker
  and the controller going away, and holds none of the module's descriptors (Ansible waits for those to close).
- Liveness is ``_proctree.run_is_live`` over a table read from ``/proc`` (no psutil needed), with its PID-reuse
  guard; stopping signals the run's process group, then SIGKILLs every process left in its session.

Pure standard library, Linux ``/proc``.
"""

from __future__ import annotations

import errno
import importlib
import os
import pkgutil
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import Run
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import runner_dir
from ansible_collections.remote_gpu.trainer.plugins.module_utils.procs._proctree import Proc, run_is_live
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._procfs import ProcStat, read_stat

PACKAGE = "ansible_collections.remote_gpu.trainer.plugins.module_utils"
TMUX_PREFIX = "rgt-"
TMUX_TIMEOUT_S = 10.0
POLL_S = 0.1
KILL_WAIT_S = 10.0
MAX_ENVIRON_BYTES = 1024 * 1024


class DetachError(Exception):
    """The runner could not be installed or started; the message is one line without any environment value."""


def module_source(name: str) -> bytes:
    """The source of ``module_utils/<name>`` (``runner/_runner.py``), from the zip the module runs from or from the
    collection's tree."""
    data = None
    try:
        data = pkgutil.get_data(PACKAGE, name)
    except OSError:
        data = None
    if data is None:  # a namespace package (the collection's tree, without __init__.py files) has no get_data
        module = importlib.import_module(f"{PACKAGE}.{name[:-3].replace('/', '.')}")
        spec = module.__spec__
        loader = getattr(spec, "loader", None) if spec is not None else None
        if spec is None or spec.origin is None or not hasattr(loader, "get_data"):
            raise DetachError(f"cannot read the source of module_utils {name}")
        data = loader.get_data(spec.origin)  # type: ignore[union-attr]
    return data


def _write(path: str, data: bytes, mode: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)


def install_runner(run_directory: str, modules: Iterable[str], run_py: str) -> str:
    """Put ``run_py`` (as run.py), the runner's module_utils and the packages' ``__init__.py`` files into
    ``<run>/runner/``, replacing an older copy; the path of run.py.

    The new tree is built beside the old one and swapped in with renames, so a half-written tree never runs.
    """
    target = runner_dir(run_directory)
    staging = os.path.join(run_directory, f".runner.{os.urandom(4).hex()}")
    try:
        package_dir = os.path.join(staging, *PACKAGE.split("."))
        parts = PACKAGE.split(".")
        for depth in range(1, len(parts) + 1):
            _write(os.path.join(staging, *parts[:depth], "__init__.py"), b"", 0o644)
        for module in modules:
            path = os.path.join(package_dir, module)
            _write(os.path.join(os.path.dirname(path), "__init__.py"), b"", 0o644)
            _write(path, module_source(module), 0o644)
        _write(os.path.join(staging, "run.py"), run_py.encode("utf-8"), 0o755)
        retired = None
        if os.path.lexists(target):
            retired = os.path.join(run_directory, f".runner.old.{os.urandom(4).hex()}")
            os.rename(target, retired)
        os.rename(staging, target)
        if retired:
            shutil.rmtree(retired, ignore_errors=True)
    except (OSError, ImportError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise DetachError(f"could not install the runner into {target}: {exc}") from exc
    return os.path.join(target, "run.py")


def tmux_session(run: str) -> str:
    """The run's tmux session name; tmux turns '.' and ':' in a session name into '_'."""
    return TMUX_PREFIX + run.replace(".", "_").replace(":", "_")


def attach_command(detach: Optional[str], run: str, log_path: str) -> Optional[str]:
    """The command that watches the run: the tmux session, or the runner's log."""
    if detach == "tmux":
        return f"tmux attach -t {tmux_session(run)}"
    if detach == "setsid":
        return f"tail -f {log_path}"
    return None


def _tmux_env(env: Mapping[str, str]) -> Dict[str, str]:
    # Inside a tmux pane already (a local connection), tmux would refuse a nested session.
    return {key: value for key, value in env.items() if key not in ("TMUX", "TMUX_PANE")}


def _tmux(tmux: str, args: Sequence[str], env: Mapping[str, str]) -> Tuple[int, str]:
    try:
        # Not run_command: plain stdlib module_utils, called with the launch's own environment.
        done = subprocess.run(  # pylint: disable=ansible-bad-function
            [tmux, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_tmux_env(env),
            timeout=TMUX_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return 124, f"tmux {args[0]} did not answer within {TMUX_TIMEOUT_S:g} s"
    except OSError as exc:
        return 127, f"{tmux}: {exc.strerror or exc}"
    return done.returncode, done.stdout.decode("utf-8", errors="replace").strip()


def tmux_panes(tmux: str, session: str, env: Mapping[str, str]) -> Optional[List[Tuple[bool, int]]]:
    """(dead, pid) per pane of ``session``, or None when there is no such session."""
    rc, text = _tmux(tmux, ["list-panes", "-s", "-t", f"={session}", "-F", "#{pane_dead} #{pane_pid}"], env)
    if rc != 0:
        return None
    panes = []
    for line in text.splitlines():
        dead, _sep, pid = line.partition(" ")
        if pid.strip().isdigit():
            panes.append((dead.strip() == "1", int(pid)))
    return panes


def kill_tmux_session(tmux: str, session: str, env: Mapping[str, str]) -> None:
    _tmux(tmux, ["kill-session", "-t", f"={session}"], env)


def start_tmux(tmux: str, session: str, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
    """``tmux new-session -d``; the pane runs ``argv`` directly (several arguments: no shell parses them).

    An existing tmux server gives the pane its own global environment, not this one, so ``env``'s RGT_DETACH
    goes through ``env`` (the binary) in the argv.
    """
    command = ["env", f"RGT_DETACH={env.get('RGT_DETACH', 'tmux')}", *argv]
    rc, text = _tmux(tmux, ["new-session", "-d", "-s", session, "-c", cwd, "--", *command], env)
    if rc != 0:
        raise DetachError(f"tmux new-session -s {session} failed (rc {rc}): {text.splitlines()[-1] if text else ''}")


def start_setsid(argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str) -> int:
    """Double fork: the child calls setsid and forks the runner, which execs ``argv``; the runner's pid.

    The runner is not a session leader (it can never get a controlling terminal), its parent is gone at once (init
    adopts it), stdin is /dev/null and stdout/stderr are appended to ``log_path``; it keeps no other descriptor.
    Between fork and exec only os calls run, and every path ends in exec or ``os._exit`` (never the module's own
    cleanup).
    """
    read_fd, write_fd = os.pipe()
    env_items = dict(env)
    pid = os.fork()
    if pid == 0:  # the intermediate child
        status = 127
        try:
            os.close(read_fd)
            os.setsid()
            runner = os.fork()
            if runner != 0:
                os.write(write_fd, str(runner).encode())
                status = 0
            else:
                os.chdir(cwd)
                null = os.open(os.devnull, os.O_RDONLY)
                log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.closerange(3, _max_fd())
                os.execve(argv[0], list(argv), env_items)
        except BaseException as exc:  # nothing may escape a forked child
            try:
                os.write(2, f"rgt: could not start the runner: {exc}\n".encode())
            finally:
                os._exit(status)
        os._exit(status)
    os.close(write_fd)
    try:
        os.waitpid(pid, 0)
        chunks = []
        while True:
            chunk = os.read(read_fd, 64)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
    text = b"".join(chunks).decode()
    if not text.isdigit():
        raise DetachError("the double fork did not report the runner's pid")
    return int(text)


def _max_fd() -> int:
    try:
        return min(int(os.sysconf("SC_OPEN_MAX")), 1 << 20)
    except (ValueError, OSError):
        return 4096


def _boot_time() -> float:
    with open("/proc/stat", "rb") as handle:
        for line in handle:
            if line.startswith(b"btime"):
                return float(line.split()[1])
    return 0.0


def proc_table(pids: Iterable[int]) -> Dict[int, Proc]:
    """The processes named (those that exist), with the create time psutil would compute (boot time + ticks)."""
    boot, ticks = _boot_time(), os.sysconf("SC_CLK_TCK")
    table = {}
    for pid in set(pids):
        stat = read_stat(pid) if pid > 0 else None
        if stat is not None:
            table[pid] = Proc(
                pid=pid,
                ppid=0,
                pgid=stat.pgid,
                sid=stat.sid,
                uid=None,
                name=stat.comm,
                cmdline=(),
                create_time=boot + stat.start_ticks / ticks,
                defunct=stat.state == "Z",
            )
    return table


def is_live(run: Run) -> bool:
    """run.json's rule (``_proctree.run_is_live``): its launcher lives and is no reused PID."""
    ids = [i for i in (run.pgid, run.sid) if i is not None]
    return run_is_live(run, proc_table([*ids, *run.pids]))


def pid_alive(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


def _environ_has(pid: int, entries: Sequence[bytes]) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            data = b"\0" + handle.read(MAX_ENVIRON_BYTES) + b"\0"
    except OSError:
        return False
    return any(b"\0" + entry + b"\0" in data for entry in entries)


def run_members(run: Run, markers: Sequence[str] = ()) -> List[ProcStat]:
    """Live processes of a run: its session (or group, without one), its pids, and any process whose environment
    holds one of ``markers`` (``NAME=value``: a worker that left the session with setsid); never this process."""
    own = os.getpid()
    entries = [marker.encode() for marker in markers]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        stat = read_stat(int(name))
        if stat is None or stat.state == "Z":
            continue
        member = stat.pid in run.pids or (stat.sid == run.sid if run.sid is not None else stat.pgid == run.pgid)
        if member or (entries and _environ_has(stat.pid, entries)):
            found.append(stat)
    return found


def _signal(targets: Iterable[int], signum: int, group: bool) -> None:
    for target in targets:
        try:
            if group:
                os.killpg(target, signum)
            else:
                os.kill(target, signum)
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise


def _still_there(proc: ProcStat) -> bool:
    """The same process (same start time: no reused PID) is alive and no zombie."""
    now = read_stat(proc.pid)
    return now is not None and now.state != "Z" and now.start_ticks == proc.start_ticks


def _wait_gone(procs: Sequence[ProcStat], seconds: float) -> None:
    """Poll only the processes already found (a full scan reads every process's environment): until they are gone."""
    until = time.monotonic() + seconds
    while any(_still_there(p) for p in procs) and time.monotonic() < until:
        time.sleep(POLL_S)


@dataclass(frozen=True)
class StopOutcome:
    found: int  # processes of the run when the stop began
    killed: List[int]  # the ones that needed SIGKILL
    left: List[int]  # still there at the end: the stop failed


def stop_run(run: Run, grace_s: float, markers: Sequence[str] = (), settle_s: float = 10.0) -> StopOutcome:
    """SIGTERM the runner's process group (the runner stops its cells: SIGTERM, SIGKILL after its own grace, and
    records them), wait ``grace_s`` + ``settle_s``, SIGKILL every process of the run still there, verify none is.

    Without a live runner among them (its cells outlived it), every process found gets the SIGTERM itself.
    """
    found = run_members(run, markers)
    if not found:
        return StopOutcome(0, [], [])
    present = {p.pid: p for p in found}
    runners = [pid for pid in run.pids if pid in present]
    if runners and run.pgid is not None:
        _signal([run.pgid], signal.SIGTERM, group=True)
    targets = [pid for pid in runners if present[pid].pgid != run.pgid] if runners else list(present)
    _signal(targets, signal.SIGTERM, group=False)
    _wait_gone(found, grace_s + settle_s)
    left = run_members(run, markers)  # a full scan again: also what started while the runner stopped
    if not left:
        return StopOutcome(len(found), [], [])
    killed = [p.pid for p in left]
    # Whole groups only inside the run's session (its cells' groups); anything else one process at a time.
    _signal(sorted({p.pgid for p in left if p.pgid > 1 and p.sid == run.sid}), signal.SIGKILL, group=True)
    _signal(killed, signal.SIGKILL, group=False)
    _wait_gone(left, KILL_WAIT_S)
    return StopOutcome(len(found), killed, [p.pid for p in run_members(run, markers)])
