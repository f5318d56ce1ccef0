"""rsync reaches the box with the very ssh command of Ansible's own connection (ssh_args, ControlPath, key, user)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _rsync as rsync

CFG_SSH_ARGS = "-o ControlMaster=auto -o ControlPersist=15m -o ServerAliveInterval=15 -o ServerAliveCountMax=4"


def ssh_connection(tmp_path: Path, **options: Any) -> Any:
    context = PlayContext()
    connection = connection_loader.get("ssh", context, None)
    settings = {
        "host": "10.1.2.3",
        "port": 2222,
        "remote_user": "root",
        "private_key_file": "/keys/id_ed25519",
        "ssh_args": CFG_SSH_ARGS,
        "control_path_dir": str(tmp_path / "cp"),
        "control_path": "%(directory)s/%%C",
        "ssh_common_args": "-o ProxyCommand='nc -X connect -x gw:3128 %h %p'",
    }
    settings.update(options)
    connection.set_options(direct=settings)
    return connection


def test_the_ssh_command_is_the_connections_own_with_its_control_path(tmp_path: Path) -> None:
    argv = shlex.split(rsync.ssh_command(ssh_connection(tmp_path)))  # rsync splits -e honouring quotes
    joined = " ".join(argv)
    assert argv[0] == "ssh"
    assert "ControlPersist=15m" in argv and "ServerAliveInterval=15" in argv  # ansible.cfg's ssh_args
    assert f'ControlPath="{tmp_path}/cp/%C"' in argv  # the same socket as Ansible's own tasks
    assert "Port=2222" in argv and 'User="root"' in argv and 'IdentityFile="/keys/id_ed25519"' in argv
    assert "ProxyCommand=nc -X connect -x gw:3128 %h %p" in joined


def test_the_pull_argv_names_the_remote_directory_and_resumes(tmp_path: Path) -> None:
    argv = rsync.pull_argv(
        ssh_connection(tmp_path), "/durable/runs/r1", str(tmp_path / "out"), dry_run=True, io_timeout_s=300
    )
    assert argv[-2:] == ["10.1.2.3:/durable/runs/r1/", f"{tmp_path}/out/"]
    assert "--partial" in argv and "--dry-run" in argv and "--timeout=300" in argv


def test_a_password_login_is_refused(tmp_path: Path) -> None:
    with pytest.raises(rsync.RsyncError, match="password"):
        rsync.ssh_command(ssh_connection(tmp_path, password="hunter2"))


def test_a_remote_path_a_shell_would_interpret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(rsync.RsyncError, match="plain path"):
        rsync.pull_argv(ssh_connection(tmp_path), "/durable/$(reboot)", str(tmp_path), dry_run=False, io_timeout_s=1)


def test_a_missing_rsync_is_named_with_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    transfer = rsync.run(["rsync", "--version"], 5)
    assert transfer.rc == -1 and "apt-get install rsync" in transfer.error


def test_a_local_copy_reports_what_it_received(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "cells" / "a").mkdir(parents=True)
    (source / "cells" / "a" / "best.pth").write_bytes(b"x" * 10)
    local = connection_loader.get("local", PlayContext(), None)
    argv = rsync.pull_argv(local, str(source), str(tmp_path / "dest"), dry_run=False, io_timeout_s=30)
    first = rsync.run(argv, 30)
    assert first.rc == 0 and first.received == ["cells/a/best.pth"]
    again = rsync.run(argv, 30)
    assert again.rc == 0 and again.received_count == 0  # a second pull moves nothing
