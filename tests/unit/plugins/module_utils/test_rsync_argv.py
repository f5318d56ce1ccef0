"""rsync over the host's SSH settings, shared by launch (push) and teardown (pull): quoting, the -e command, the
remote end's address, and the redaction of an argv for a report."""

from __future__ import annotations

import shlex

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common import _rsync_argv as rsync


@pytest.mark.parametrize(
    ("argument", "quoted"),
    [
        ("BatchMode=yes", "BatchMode=yes"),
        ("a b", "'a b'"),
        ("it's", '"it\'s"'),
        ('say "hi"', "'say \"hi\"'"),
        ("", "''"),
    ],
)
def test_quote_as_rsync_splits(argument, quoted):
    assert rsync.rsync_quote(argument) == quoted
    assert shlex.split(quoted) == [argument]


def test_quote_refuses_both_quote_characters():
    with pytest.raises(rsync.RsyncArgvError, match="both quote characters"):
        rsync.rsync_quote('it\'s "x"')


def test_redact_argv_keeps_the_command_and_drops_credentials():
    argv = [
        "rsync",
        "--recursive",
        "-e",
        "ssh -o BatchMode=yes -i /k -o 'ProxyCommand=sshpass -p hunter2 ssh jump' -o SetEnv=HF_TOKEN=hf_abc "
        "-o PasswordAuthentication=no -o ControlPath=/cp/%C",
        "root@h:/d/",
        "https://user:pw@example.com/x",
    ]
    redacted = rsync.redact_argv(argv)
    text = " ".join(redacted)
    assert "hunter2" not in text and "hf_abc" not in text and "pw@" not in text
    ssh = shlex.split(redacted[3])
    assert (
        "ProxyCommand=<redacted>" in ssh and "SetEnv=<redacted>" in ssh and "PasswordAuthentication=<redacted>" in ssh
    )
    assert "ControlPath=/cp/%C" in ssh and "/k" in ssh and "BatchMode=yes" in ssh
    assert redacted[-1] == "https://<redacted>@example.com/x"
    assert redacted[:3] == ["rsync", "--recursive", "-e"] and redacted[4] == "root@h:/d/"
    assert rsync.redact_argv(["rsync", "-e", "ssh -o 'open"]) == ["rsync", "-e", "<redacted>"]
    assert rsync.redact_argv([]) == []
