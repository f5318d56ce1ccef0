# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown filters for the copies the gate checks on the controller's side: the pull of the durable copy (its
rsync argv over the host's SSH settings and what it did) and the load-verify checks (which artifacts, each
check's argv, the verdict).

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
The role renders the load-verify command per artifact; these filters only check and shape what came out.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Dict, List, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter.teardown import _command_reason, _line, _number
from ansible_collections.remote_gpu.trainer.plugins.module_utils import _rsync_argv as rsync
from ansible_collections.remote_gpu.trainer.plugins.module_utils._cell_sync import MANIFEST_NAME

MANIFEST_LOCK = f".{MANIFEST_NAME}.lock"
TAIL_CHARS = 2000
LISTED_FILES = 50
RSYNC_ITEM = re.compile(r"\A[<>ch.*][fdLDS][c.+?stpoguax ]{9} (?P<path>.+)\Z")


def _tail(text: Any, limit: int = TAIL_CHARS) -> str:
    text = str(text if text is not None else "")
    return text if len(text) <= limit else text[-limit:]


# ---- the pull ----------------------------------------------------------------------------------------------------


def teardown_rsync_argv(
    connection: Mapping[str, Any], src: str, dest: str, *, dry_run: bool = False, io_timeout_s: Any = 300
) -> List[str]:
    """rsync's argv to pull the box's directory ``src`` into the controller's ``dest``, over the host's SSH settings.

    Regular files and directories only (a symbolic link in the durable copy is skipped, never followed), mtimes
    kept, ``--partial`` so that an interrupted pull resumes where it stopped, ``--itemize-changes`` to list what
    came (or would come, with ``dry_run``), and ``--timeout`` so that a stalled connection fails instead of hanging.
    """
    if not str(dest).startswith("/"):
        raise AnsibleFilterError(f"teardown_rsync_argv: the controller directory {dest!r} must be absolute")
    timeout = _number(io_timeout_s)
    # The manifest's lock file (launch's sync takes it while writing MANIFEST.sha256) is no result.
    argv = ["rsync", "--recursive", "--times", "--partial", "--itemize-changes", f"--exclude=/{MANIFEST_LOCK}"]
    argv.append(f"--timeout={max(int(timeout or 300), 1)}")
    if dry_run:
        argv.append("--dry-run")
    target = str(dest).rstrip("/") + "/"
    source = str(src).rstrip("/") + "/"
    try:
        if not rsync.SAFE_REMOTE_PATH.match(source):
            raise rsync.RsyncArgvError(f"the durable directory {src!r} must be an absolute, plain path")
        if rsync.is_local(connection):
            return [*argv, source, target]
        return [*argv, "-e", rsync.ssh_command(connection), rsync.remote_spec(connection, source), target]
    except rsync.RsyncArgvError as error:
        raise AnsibleFilterError(f"teardown_rsync_argv: {error}") from None


def teardown_pull(
    result: Any,
    argv: Any = None,
    dest: str = "",
    *,
    check_mode: bool = False,
    verify: Any = None,
    skip: str = "",
) -> Dict[str, Any]:
    """The pull's record: the rsync run (``result``, registered), its argv without secrets, and ``verify``
    (copy_verify's answer on the controller copy).

    ``{to, argv, dry_run, ran, rc, received, received_count, stdout_tail, stderr_tail, changed, verified, files,
    bytes, mismatches, passed, step, reason, note}``; ``verified`` is null when copy_verify did not run (check mode:
    the copy is an rsync ``--dry-run``). ``step`` is ``pull`` (rsync failed) or ``pull_verify`` (the copy does not
    verify) when it did not pass. ``skip`` (why no pull was wanted) passes with that note.
    """
    record: Dict[str, Any] = {
        "to": dest or None,
        "argv": rsync.redact_argv([str(item) for item in argv]) if isinstance(argv, (list, tuple)) else [],
        "dry_run": bool(check_mode),
        "ran": False,
        "rc": None,
        "received": [],
        "received_count": 0,
        "stdout_tail": "",
        "stderr_tail": "",
        "changed": False,
        "verified": None,
        "files": 0,
        "bytes": 0,
        "mismatches": [],
        "passed": False,
        "step": None,
        "reason": "",
        "note": "",
    }
    if skip:
        return dict(record, passed=True, note=_line(skip))
    if not isinstance(result, Mapping) or result.get("skipped"):
        return dict(record, step="pull", reason="rsync did not run")
    received = []
    for line in str(result.get("stdout") or "").splitlines():
        match = RSYNC_ITEM.match(line)
        if match and line[1] == "f":
            received.append(match.group("path"))
    record.update(
        ran=True,
        rc=result.get("rc"),
        received=received[:LISTED_FILES],
        received_count=len(received),
        stdout_tail=_tail(result.get("stdout")),
        stderr_tail=_tail(result.get("stderr")),
        changed=bool(received) and not check_mode,
    )
    if result.get("failed") or result.get("rc") != 0:
        return dict(record, step="pull", reason=_command_reason(result))
    if check_mode:
        return dict(record, passed=True, note="not verified: check mode (rsync --dry-run)")
    if not isinstance(verify, Mapping) or verify.get("skipped"):
        return dict(record, step="pull_verify", reason="the controller copy was not verified")
    record.update(
        verified=verify.get("passed") is True,
        files=verify.get("files") if isinstance(verify.get("files"), int) else 0,
        bytes=verify.get("bytes") if isinstance(verify.get("bytes"), int) else 0,
        mismatches=list(verify.get("mismatches") or [])[:LISTED_FILES],
    )
    if verify.get("passed") is not True:
        why = verify.get("reason") or verify.get("msg") or "copy_verify failed"
        return dict(record, step="pull_verify", reason=_line(f"the controller copy in {dest} does not verify: {why}"))
    return dict(record, passed=True)


# ---- load-verify -------------------------------------------------------------------------------------------------


def teardown_load_plan(artifacts: Any, patterns: Any = None, root: str = "", command: Any = None) -> Dict[str, Any]:
    """Which artifacts the load-verify command runs on: ``{root, paths, targets, reason}``.

    ``paths`` are the artifacts' ``cells/<cell>/<rel>`` that match one of ``patterns`` (fnmatch, where ``*`` also
    matches ``/``; none given: every artifact), ``targets`` the same under ``root`` (where the command runs: the
    durable copy on the box, or the controller copy). With a command, patterns that match none of the artifacts give
    a ``reason`` (a typo would otherwise pass the gate unverified).
    """
    paths = [str(entry.get("path")) for entry in artifacts or [] if isinstance(entry, Mapping) and entry.get("path")]
    if isinstance(patterns, str):  # -e teardown_load_verify_artifacts='*.pth,*.pt' on the command line
        patterns = [pattern for pattern in patterns.split(",") if pattern.strip()]
    wanted = [str(pattern).strip() for pattern in patterns or []]
    chosen = [path for path in paths if not wanted or any(fnmatch.fnmatchcase(path, p) for p in wanted)]
    base = str(root).rstrip("/")
    plan = {"root": base, "paths": chosen, "targets": [f"{base}/{path}" for path in chosen], "reason": ""}
    if command and paths and not chosen:
        plan["reason"] = (
            f"teardown_load_verify_artifacts {wanted} match none of the {len(paths)} artifacts "
            f"(e.g. {paths[0]}); patterns match cells/<cell>/<path>"
        )
    return plan


def _argv_part(value: Any, position: int, nested: bool = False) -> List[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, str):
        return [value]
    if _number(value) is not None:
        return [str(value)]
    if isinstance(value, (list, tuple)) and not nested:
        return [part for item in value for part in _argv_part(item, position, nested=True)]
    raise AnsibleFilterError(
        f"teardown_load_verify_cmd element {position} rendered to {type(value).__name__} {str(value)[:60]!r}; "
        "each element must render to a string, a number or a flat list of them"
    )


def teardown_load_check(rendered: Any, artifact: str, root: str = "") -> Dict[str, Any]:
    """One load_verify check, ``{artifact, argv}``: the command rendered for ``artifact`` (an absolute path), shaped
    into an argv (scalars as strings, a list element spliced in), named by the artifact's path under ``root``."""
    if not isinstance(rendered, (list, tuple)) or not rendered:
        raise AnsibleFilterError(f"teardown_load_verify_cmd must be a non-empty argv list, not {rendered!r}")
    argv = [part for position, value in enumerate(rendered) for part in _argv_part(value, position)]
    if not argv or not argv[0]:
        raise AnsibleFilterError("teardown_load_verify_cmd: the first element (the program) rendered empty")
    base = str(root).rstrip("/") + "/"
    name = str(artifact)[len(base) :] if root and str(artifact).startswith(base) else str(artifact)
    return {"artifact": name, "argv": argv}


def teardown_load(
    result: Any, plan: Any = None, on: str = "box", *, command: Any = None, check_mode: bool = False
) -> Dict[str, Any]:
    """The load-verify's record from load_verify's ``result`` and the ``plan`` (teardown_load_plan):
    ``{on, command, ran, passed, checks, failed, reason, note}``.

    No command, no artifact to load, or a controller copy in check mode (an rsync ``--dry-run`` makes none) pass
    with a ``note``; patterns that match nothing, a load_verify that did not run or failed, and any check that did
    not exit 0 in time do not.
    """
    plan = plan if isinstance(plan, Mapping) else {}
    record: Dict[str, Any] = {
        "on": on,
        "command": bool(command),
        "ran": False,
        "passed": False,
        "checks": [],
        "failed": [],
        "reason": "",
        "note": "",
    }
    if not command:
        return dict(record, passed=True, note="no load-verify command (teardown_load_verify_cmd)")
    if plan.get("reason"):
        return dict(record, reason=_line(plan["reason"]))
    if not plan.get("targets"):
        return dict(record, passed=True, note="no artifact to load")
    if on == "controller" and check_mode:
        return dict(record, passed=True, note="not run: check mode makes no controller copy")
    if not isinstance(result, Mapping) or result.get("skipped"):
        return dict(record, reason="load_verify did not run")
    if result.get("unreachable"):
        return dict(record, unreachable=True, msg=result.get("msg"), reason=_line(result.get("msg")))
    checks = [check for check in result.get("checks") or [] if isinstance(check, Mapping)]
    # Not the module's own `failed` list: a registered result's `failed` is Ansible's flag (failed_when sets it).
    failed = [str(check.get("artifact")) for check in checks if check.get("rc") != 0 or check.get("timed_out")]
    complete = len(checks) == len(plan["targets"])
    passed = result.get("passed") is True and not failed and complete
    record.update(ran=True, checks=checks, failed=failed, passed=passed)
    if not record["passed"] and not failed and not complete and result.get("passed") is True:
        return dict(record, reason=f"load-verify ({on}): {len(checks)} checks ran for {len(plan['targets'])} artifacts")
    if not record["passed"]:
        why = result.get("reason") or result.get("msg") or "load_verify failed"
        return dict(record, reason=_line(f"load-verify ({on}): {why}"))
    return dict(record, reason=_line(result.get("reason") or f"{len(checks)} load check(s) passed"))


class FilterModule:
    """Teardown filters for the pull and the load-verify."""

    def filters(self) -> Dict[str, Any]:
        return {
            "teardown_rsync_argv": teardown_rsync_argv,
            "teardown_pull": teardown_pull,
            "teardown_load_plan": teardown_load_plan,
            "teardown_load_check": teardown_load_check,
            "teardown_load": teardown_load,
        }
