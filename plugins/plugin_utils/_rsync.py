# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""rsync between the controller and a box (teardown's pull, launch's code push) over the very SSH command
Ansible's own connection runs.

The ``-e`` command is the ssh connection plugin's own argv (``ansible.cfg``'s ``ssh_args`` with its ControlMaster
and ControlPath, the port, the key, the user, ``ansible_ssh_common_args`` and ``_extra_args``), so a pull reuses the
task's control socket and goes through the same jump host, the way ansible.posix's ``synchronize`` follows its
connection. A password connection is refused (rsync cannot feed sshpass); ``local`` copies between local paths.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any, List, Sequence

from ansible.module_utils.common.text.converters import to_text

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common import _rsync_argv as rsync_text
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import MANIFEST_LOCK

LOCAL = ("local", "ansible.builtin.local")
SSH = ("ssh", "ansible.builtin.ssh")
LISTED_FILES = 50
STDERR_CHARS = 2000
# rsync --itemize-changes: "<f+++++++++ path" for a file received.
ITEM = re.compile(r"\A[<>ch.*][fdLDS][c.+?stpoguax ]{9} (?P<path>.+)\Z")
DELETING = "*deleting "  # what --delete removed (or would)


class RsyncError(ValueError):
    """The connection cannot carry rsync, or a path would be interpreted by a remote shell."""


@dataclass
class Transfer:
    """What one rsync did: its exit status, the files it received (or would), and its last error line."""

    argv: List[str]
    rc: int
    received: List[str] = field(default_factory=list)
    received_count: int = 0
    deleted: List[str] = field(default_factory=list)
    error: str = ""


def _transport(connection: Any) -> str:
    return str(getattr(connection, "transport", "") or getattr(connection, "_load_name", "") or "ssh")


def ssh_command(connection: Any) -> str:
    """rsync's ``-e`` value: the connection's ssh argv, quoted the way rsync splits it."""
    if _transport(connection) not in SSH:
        raise RsyncError(f"cannot rsync over connection {_transport(connection)!r} (ssh or local only)")
    if connection.get_option("password"):
        raise RsyncError("cannot rsync over a password login (rsync cannot answer ssh's prompt): use an SSH key")
    connection.host = connection.get_option("host") or connection._play_context.remote_addr
    argv = [to_text(arg) for arg in connection._build_command(connection.get_option("ssh_executable"), "ssh")]
    try:
        return " ".join(rsync_text.rsync_quote(arg) for arg in argv)
    except rsync_text.RsyncArgvError as error:
        raise RsyncError(str(error)) from None


def remote(connection: Any, path: str) -> str:
    """``host:path`` for rsync (the user is in the ssh command); the path plain and absolute."""
    if not rsync_text.SAFE_REMOTE_PATH.match(path):
        raise RsyncError(f"the box path {path!r} must be an absolute, plain path")
    if _transport(connection) in LOCAL:
        return path
    host = str(connection.get_option("host") or connection._play_context.remote_addr or "")
    if not host:
        raise RsyncError("the host has no address")
    return f"[{host}]:{path}" if ":" in host else f"{host}:{path}"


def pull_argv(connection: Any, source: str, dest: str, *, dry_run: bool, io_timeout_s: int) -> List[str]:
    """Pull the box's directory ``source`` into ``dest``: regular files and directories (a symbolic link is skipped,
    never followed), mtimes kept, ``--partial`` so an interrupted pull resumes, ``--timeout`` against a stall."""
    if not os.path.isabs(dest):
        raise RsyncError(f"the controller directory {dest!r} must be absolute")
    argv = ["rsync", "--recursive", "--times", "--partial", "--itemize-changes", f"--timeout={max(io_timeout_s, 1)}"]
    # The manifest's lock file (launch's sync takes it while writing MANIFEST.sha256) is no result.
    argv.append(f"--exclude=/{MANIFEST_LOCK}")
    if dry_run:
        argv.append("--dry-run")
    if _transport(connection) not in LOCAL:
        argv += ["-e", ssh_command(connection)]
    return [*argv, remote(connection, source.rstrip("/") + "/"), dest.rstrip("/") + "/"]


def push_argv(
    connection: Any,
    source: str,
    dest: str,
    *,
    excludes: Sequence[str] = (),
    delete: bool = False,
    dry_run: bool,
    io_timeout_s: int,
) -> List[str]:
    """Push the controller directory ``source`` into the box's ``dest``: delta transfers by size and mtime, links
    sent as links, ``--delete`` only when asked (the box's own files in ``dest`` go too), ``--timeout`` against a
    stall, and ``--itemize-changes`` so the record lists what was (or, with ``dry_run``, would be) sent."""
    if not os.path.isabs(source):
        raise RsyncError(f"the controller directory {source!r} must be absolute")
    argv = ["rsync", "--recursive", "--links", "--perms", "--times", "--compress", "--itemize-changes"]
    argv += [f"--timeout={max(io_timeout_s, 1)}", *(f"--exclude={pattern}" for pattern in excludes)]
    if delete:
        argv.append("--delete")
    if dry_run:
        argv.append("--dry-run")
    if _transport(connection) not in LOCAL:
        argv += ["-e", ssh_command(connection)]
    return [*argv, source.rstrip("/") + "/", remote(connection, dest.rstrip("/") + "/")]


def run(argv: Sequence[str], timeout_s: float) -> Transfer:
    """Run rsync (no shell, stdin closed) under ``timeout_s``; never raises for rsync's own failures."""
    transfer = Transfer(argv=rsync_text.redact_argv(list(argv)), rc=-1)
    try:
        done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        transfer.error = "rsync is not installed on the controller (apt-get install rsync)"
        return transfer
    except subprocess.TimeoutExpired:
        transfer.error = f"rsync did not finish within {timeout_s:g} s"
        return transfer
    transfer.rc = done.returncode
    received, deleted = [], []
    for line in to_text(done.stdout, errors="surrogate_or_replace").splitlines():
        match = ITEM.match(line)
        if match and line[1] == "f":
            received.append(match.group("path"))
        elif line.startswith(DELETING):
            deleted.append(line[len(DELETING) :].strip())
    transfer.received, transfer.received_count = received[:LISTED_FILES], len(received)
    transfer.deleted = deleted[:LISTED_FILES]
    if done.returncode != 0:
        lines = [x.strip() for x in to_text(done.stderr, errors="surrogate_or_replace").splitlines() if x.strip()]
        told = next((line for line in lines if line.startswith("rsync:")), lines[-1] if lines else "no message")
        transfer.error = f"rsync exited {done.returncode}: {told[:STDERR_CHARS]}"
    return transfer
