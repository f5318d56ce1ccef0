# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""rsync over the host's own SSH settings: the ``-e`` command, the remote end's address and the argv's secrets.

Shared by the launch filters (the code pushed to the box) and the teardown filters (the durable copy pulled to the
controller), so both reach the box exactly as Ansible does. Errors are ``RsyncArgvError`` (a ``ValueError``); the
filters turn them into ``AnsibleFilterError`` naming themselves. Pure standard library.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, List, Mapping

# A path the rsync remote end may name: the remote shell of an older rsync splits it, so nothing it would interpret.
SAFE_REMOTE_PATH = re.compile(r"\A/[A-Za-z0-9_.+@%=,/-]*\Z")
SSH_CONNECTIONS = ("ssh", "paramiko", "paramiko_ssh", "ansible.builtin.ssh", "ansible.builtin.paramiko_ssh")
LOCAL_CONNECTIONS = ("local", "ansible.builtin.local")
REDACTED = "<redacted>"
# An ssh option whose value may be a credential (-o SetEnv=API_TOKEN=..., a ProxyCommand with a password).
SECRET_OPTION = re.compile(r"(?i)(pass|token|secret|credential|auth)")
URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")


class RsyncArgvError(ValueError):
    """A connection rsync cannot use, or a path a remote shell would interpret."""


def rsync_quote(argument: str) -> str:
    """One argument of rsync's ``-e`` command: rsync splits it on spaces and honours quotes, not backslashes."""
    if argument and not re.search(r"[\s'\"]", argument):
        return argument
    if "'" not in argument:
        return f"'{argument}'"
    if '"' not in argument:
        return f'"{argument}"'
    raise RsyncArgvError(f"an SSH option holds both quote characters: {argument!r}")


def ssh_argv(connection: Mapping[str, Any]) -> List[str]:
    """The ssh argv rsync runs: ``BatchMode``, the port, the key, ``ansible_ssh_common_args`` and ``_extra_args``."""
    argv = ["ssh", "-o", "BatchMode=yes"]
    if connection.get("port"):
        argv += ["-p", str(connection["port"])]
    if connection.get("private_key_file"):
        argv += ["-i", str(connection["private_key_file"])]
    for key in ("common_args", "extra_args"):
        try:
            argv += shlex.split(str(connection.get(key) or ""))
        except ValueError as error:
            raise RsyncArgvError(f"ansible_ssh_{key} cannot be split: {error}") from None
    return argv


def ssh_command(connection: Mapping[str, Any]) -> str:
    """rsync's ``-e`` value for ``connection``, quoted the way rsync splits it."""
    return " ".join(rsync_quote(argument) for argument in ssh_argv(connection))


def is_local(connection: Mapping[str, Any]) -> bool:
    """Whether the host is the controller itself (rsync then copies between two local paths)."""
    kind = str(connection.get("connection") or "ssh")
    if kind in LOCAL_CONNECTIONS:
        return True
    if kind not in SSH_CONNECTIONS:
        raise RsyncArgvError(f"cannot rsync over connection {kind!r} (ssh or local only)")
    return False


def remote_spec(connection: Mapping[str, Any], path: str, what: str = "path") -> str:
    """``[user@]host:path`` for rsync (an IPv6 address in brackets); ``path`` must be absolute and plain."""
    if not SAFE_REMOTE_PATH.match(str(path)):
        raise RsyncArgvError(f"the {what} {path!r} must be an absolute, plain path")
    address = str(connection.get("host") or "")
    if not address:
        raise RsyncArgvError("the host has no address")
    address = f"[{address}]" if ":" in address else address
    user = f"{connection['user']}@" if connection.get("user") else ""
    return f"{user}{address}:{path}"


def _redact_ssh_argument(argument: str) -> str:
    argument = URL_USERINFO.sub(rf"\1{REDACTED}@", argument)
    # Name=value (SetEnv=NAME=value, ProxyCommand=sshpass -p ...): the value goes when the option looks like it
    # carries a credential, by its name or its value. Over-redacting a harmless option costs nothing.
    name, sep, _value = argument.partition("=")
    if sep and SECRET_OPTION.search(argument):
        return f"{name}={REDACTED}"
    return argument


def _requote(argument: str) -> str:
    try:
        return rsync_quote(argument)
    except RsyncArgvError:
        return REDACTED


def redact_argv(argv: List[str]) -> List[str]:
    """``argv`` fit for a report: secret-looking ssh options and URL credentials replaced by ``<redacted>``.

    The ``-e`` command is split as rsync splits it, each ``Name=value`` that mentions ``pass``, ``token``,
    ``secret``, ``credential`` or ``auth`` (``-o SetEnv=API_TOKEN=...``, ``-o ProxyCommand=sshpass -p ...``) loses
    its value, and ``user:password@`` in a URL
    anywhere becomes ``<redacted>@``. The key file's path stays: it is where the key is, not the key.
    """
    redacted: List[str] = []
    previous = ""
    for argument in argv:
        text = str(argument)
        if previous == "-e":
            try:
                parts = shlex.split(text)
            except ValueError:
                parts = [REDACTED]
            text = " ".join(_requote(_redact_ssh_argument(part)) for part in parts)
        else:
            text = URL_USERINFO.sub(rf"\1{REDACTED}@", text)
        redacted.append(text)
        previous = str(argument)
    return redacted
