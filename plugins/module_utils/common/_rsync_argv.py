# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""rsync's text rules: quoting an ``-e`` argument, the paths a remote end may name, and the argv's secrets.

Used by the controller's rsync (``plugin_utils/_rsync.py``: launch's code push and teardown's pull). Errors are
``RsyncArgvError`` (a ``ValueError``). Pure standard library.
"""

from __future__ import annotations

import re
import shlex
from typing import List

# A path the rsync remote end may name: the remote shell of an older rsync splits it, so nothing it would interpret.
SAFE_REMOTE_PATH = re.compile(r"\A/[A-Za-z0-9_.+@%=,/-]*\Z")
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
