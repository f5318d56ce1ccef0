#!/usr/bin/env python
"""A fake provider CLI: ``runpodctl``, ``vastai`` and ``curl`` (the Lambda Cloud API) look-alikes that keep instance
state in a file and record calls.

One script, several faces, chosen by the name it is called by (tests symlink it into a bin directory on PATH):

    runpodctl pod stop ID | pod delete ID | pod get ID | pod list [--all] [--output json]
    vastai stop instance ID | destroy instance ID [-y] | destroy instance --help | show instance ID [--raw]
           | show instances [--raw]
    curl [-sS] [--fail-with-body] [--max-time N] -H @HEADER_FILE [-H H] [-d BODY] URL   (Lambda Cloud API v1:
           GET .../instances, GET .../instances/ID, POST .../instance-operations/terminate)
    fake_provider.py install BIN_DIR [--faces FACE ...] [--state FILE]
                         (BIN_DIR/<face>: symlinks to a copy of this script whose shebang is the Python that ran
                          install; default faces runpodctl and vastai, so a real curl is not shadowed; --state FILE:
                          the copy's faces use FILE when FAKE_PROVIDER_STATE is unset, as on a box whose PATH has
                          them but whose environment is the platform's own)
    fake_provider.py add [--state FILE] ID [--status running|exited] [--behaviour normal|sticky|fail|hang]
                         [--settle-polls N] [--print TEXT] [--intended running|stopped]
    fake_provider.py set [--state FILE] [--vastai-release new|old] [--status-fault none|traceback|auth]
    fake_provider.py show [--state FILE] [ID] (prints the state file, or one instance, as JSON)

The state is a JSON file named by env FAKE_PROVIDER_STATE (``--state`` for the admin commands), read and written
under an flock on FILE.lock and replaced atomically; a missing file holds no instance. Every call of the provider
faces (never the admin ones) is appended as one JSON line ``{"argv": [name, args...], "at": ISO UTC, "key_env":
NAME|null}`` to env FAKE_PROVIDER_CALLS (default: FILE.calls.jsonl next to the state file) before anything else
happens. ``key_env`` names the API key variable the real CLI reads (RUNPOD_API_KEY for runpodctl, VAST_API_KEY for
vastai) when it was set and not empty, else null (never for curl): which key a caller passed, never its value.

Dialects follow the real CLIs. RunPod (runpodctl v2, JSON output): ``pod stop`` sets desiredStatus EXITED, ``pod
delete`` removes the pod, ``pod get`` prints {"id", "name", "desiredStatus", ...} (an unknown id: a JSON error on
stderr, exit 1), ``pod list`` prints the pods as a JSON list, RUNNING ones only unless ``--all``. Vast.ai: ``stop
instance`` sets actual_status "exited", cur_state "stopped" and intended_status "stopped" (one added ``--status
exited`` keeps intended_status "running", as the provider's own stop does, unless ``--intended stopped``), ``destroy
instance ID -y`` removes it; WITHOUT ``-y`` it prompts, reads stdin and, on end-of-file or any answer but y, prints
"Aborted." and exits 0 while the instance keeps running (the real CLI's trap). ``show instances --raw`` prints a
JSON list of {"id" (a number), "actual_status", "intended_status", "cur_state", "jupyter_token", ...}; ``show
instance ID --raw`` one of them, an unknown id printing ``Error: instance ID not found.`` with exit 1. Lambda: the
instance list is {"data": [{"id", "status" (active), "jupyter_token", ...}]}; terminate removes the instance; the
header file must hold ``Authorization: Bearer fake-lambda-key`` (else HTTP 401); an HTTP error with --fail-with-body
prints the JSON body and exits 22.

Settings (``set``; env FAKE_VASTAI_RELEASE and FAKE_PROVIDER_STATUS_FAULT override the state file):
``vastai_release`` ``new`` (default; destroy takes ``-y``, its --help shows ``-y, --yes``) or ``old`` (an older
vastai: ``-y`` is an argparse error, exit 2; --help lacks it; destroy without it destroys at once).
``status_fault``: ``traceback`` makes every status command (pod get/list, show, a GET) crash with a Python
traceback ending in "FileNotFoundError: [Errno 2] No such file or directory: ..." and exit 1; ``auth`` makes it
fail as an unknown key ("API key not found", exit 1; curl: HTTP 401, exit 22). The verbs are not affected.

Behaviours of an instance: ``normal``; ``sticky`` (the stop/delete verb exits 0 and changes nothing); ``fail`` (the
verb prints an error and exits 1); ``hang`` (the verb sleeps, for command timeouts). ``--settle-polls N``: after a
normal verb the status commands report the old state N more times before the new one (a slow provider).
``--print TEXT``: the status commands print TEXT instead of JSON and exit 0 (garbage output). Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

FACES = ("runpodctl", "vastai", "curl")
DEFAULT_FACES = ("runpodctl", "vastai")
BEHAVIOURS = ("normal", "sticky", "fail", "hang")
STATUSES = {"running": "running", "exited": "exited", "stopped": "exited"}
RELEASES = ("new", "old")
FAULTS = ("none", "traceback", "auth")
LAMBDA_KEY = "fake-lambda-key"
State = Dict[str, Any]
HANG = "\0hang"  # what a verb of a hanging instance returns: no printable output is this
KEY_ENV = {"runpodctl": "RUNPOD_API_KEY", "vastai": "VAST_API_KEY"}  # where each real CLI finds its API key
# `install --state FILE` writes FILE here in its copy of this script: the faces need no FAKE_PROVIDER_STATE then.
INSTALLED_STATE: Optional[str] = None


class Refused(Exception):
    """A provider error: what the CLI prints on stdout and stderr, and its exit status."""

    def __init__(self, stderr: str = "", rc: int = 1, stdout: str = "") -> None:
        super().__init__(stderr or stdout)
        self.stderr, self.rc, self.stdout = stderr, rc, stdout


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _state_path(explicit: Optional[str] = None) -> str:
    path = explicit or os.environ.get("FAKE_PROVIDER_STATE", "") or INSTALLED_STATE or ""
    if not path:
        sys.exit("fake_provider: set FAKE_PROVIDER_STATE (or --state) to the state file")
    return path


@contextlib.contextmanager
def _locked(path: str) -> Iterator[State]:
    """The state under an exclusive flock; written back atomically when changed (also when the CLI refuses: a pod
    whose removal settled is gone for good once a status command reported it gone)."""
    with open(f"{path}.lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _read(path)
        before = json.dumps(state, sort_keys=True)
        try:
            yield state
        finally:
            if json.dumps(state, sort_keys=True) != before:
                _write(path, state)


def _read(path: str) -> State:
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except FileNotFoundError:
        return {"instances": {}}
    except ValueError as exc:
        sys.exit(f"fake_provider: {path} is not JSON: {exc}")
    if not isinstance(state, dict) or not isinstance(state.get("instances"), dict):
        sys.exit(f"fake_provider: {path} has no 'instances' object")
    return state


def _write(path: str, state: State) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".fake_provider.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(temp, path)


def _record(face: str, args: List[str], state_path: str) -> None:
    calls = os.environ.get("FAKE_PROVIDER_CALLS") or f"{state_path}.calls.jsonl"
    key = KEY_ENV.get(face)
    line = json.dumps({"argv": [face, *args], "at": _utc(), "key_env": key if key and os.environ.get(key) else None})
    line += "\n"
    with open(calls, "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(line)


def _setting(state: State, name: str, env: str, default: str) -> str:
    return os.environ.get(env) or state.get("settings", {}).get(name) or default


# --- what every face shares --------------------------------------------------------------------------------------


def _instance(state: State, ident: str, missing: Refused) -> Dict[str, Any]:
    found = state["instances"].get(ident)
    if found is None:
        raise missing
    return found


def _status_view(instance: Dict[str, Any]) -> str:
    """The status a status command shows now; consumes one settle poll."""
    pending = instance.get("pending")
    if pending is None:
        return instance["status"]
    if pending["polls"] > 0:
        pending["polls"] -= 1
        return instance["status"]
    instance.pop("pending")
    if pending["target"] == "gone":
        return "gone"
    instance["status"] = pending["target"]
    return instance["status"]


def _verb(state: State, ident: str, target: str, missing: Refused, verb: str) -> Optional[str]:
    """Apply a stop (target ``exited``) or a removal (``gone``) per the instance's behaviour; HANG when it hangs."""
    instance = _instance(state, ident, missing)
    behaviour = instance.get("behaviour", "normal")
    if behaviour == "fail":
        raise Refused(f"Error: failed to {verb} {ident}: internal server error (500)")
    if behaviour == "hang":
        return HANG
    if behaviour == "sticky":
        return None
    if instance.get("settle_polls", 0) > 0:
        instance["pending"] = {"target": target, "polls": instance["settle_polls"]}
    elif target == "gone":
        del state["instances"][ident]
    else:
        instance["status"] = target
    if target == "exited":
        instance["intended"] = "stopped"  # asked for: Vast.ai's intended_status
    return None


def _gone_now(state: State, ident: str) -> bool:
    """A pending removal whose settle polls ran out removes the instance."""
    instance = state["instances"].get(ident)
    if instance is None:
        return True
    if instance.get("print") is not None:
        return False
    if _status_view(instance) == "gone":
        del state["instances"][ident]
        return True
    return False


def _listed(state: State) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(garbage text to print instead, or None; the (id, status) of every instance a list shows now)."""
    shown = []
    for ident in sorted(state["instances"]):
        instance = state["instances"][ident]
        if instance.get("print") is not None:
            return instance["print"], []
        if not _gone_now(state, ident):
            shown.append((ident, instance["status"]))
    return None, shown


def _secret(ident: str) -> str:
    """A per-instance token (32 hex digits) that a report must never carry."""
    return hashlib.sha256(f"jupyter-{ident}".encode()).hexdigest()[:32]


def _status_fault(state: State, face: str) -> None:
    """The configured failure of a status command: a crash or an unknown key, never a state."""
    fault = _setting(state, "status_fault", "FAKE_PROVIDER_STATUS_FAULT", "none")
    if fault == "traceback":
        raise Refused(
            "Traceback (most recent call last):\n"
            f'  File "/usr/local/bin/{face}", line 8, in <module>\n    sys.exit(main())\n'
            '  File "/usr/local/lib/python3.10/site-packages/cli/config.py", line 31, in load\n'
            "    with open(path) as handle:\n"
            f"FileNotFoundError: [Errno 2] No such file or directory: '/root/.config/{face}/api_key'"
        )
    if fault == "auth" and face == "curl":
        body = {"error": {"code": "global/invalid-api-key", "message": "API key not found"}}
        raise Refused("curl: (22) The requested URL returned error: 401", 22, json.dumps(body))
    if fault == "auth" and face == "vastai":
        raise Refused(stdout="Error: API key not found. Set it with: vastai set api-key KEY")
    if fault == "auth":
        raise Refused('{"error":"API key not found: run \'runpodctl doctor\'","code":"cli_error"}')


# --- runpodctl ---------------------------------------------------------------------------------------------------


def _runpod_pod(ident: str, status: str) -> Dict[str, Any]:
    shown = {"running": "RUNNING", "exited": "EXITED"}[status]
    return {"id": ident, "name": f"pod-{ident}", "desiredStatus": shown, "costPerHr": 2.49, "volumeInGb": 50}


def _runpod_list(args: List[str], state: State) -> str:
    flags = list(args)
    every = False
    while flags:
        flag = flags.pop(0)
        if flag in ("--all", "-a"):
            every = True
        elif flag in ("--output", "-o") and flags and flags[0] == "json":
            flags.pop(0)
        else:
            raise Refused(json.dumps({"error": f"unknown flag: {flag}", "code": "usage_error"}))
    _status_fault(state, "runpodctl")
    garbage, listed = _listed(state)
    if garbage is not None:
        return garbage
    pods = [_runpod_pod(ident, status) for ident, status in listed if every or status == "running"]
    return json.dumps(pods, indent=2)


def _runpod(args: List[str], state: State) -> str:
    if args[:2] == ["pod", "list"]:
        return _runpod_list(args[2:], state)
    if len(args) != 3 or args[0] != "pod" or args[1] not in ("stop", "delete", "get"):
        word = args[0] if args else ""
        raise Refused(f'Error: unknown command "{word}" for "runpodctl"\nRun \'runpodctl --help\' for usage.')
    action, ident = args[1], args[2]
    missing = Refused(json.dumps({"error": f"pod {ident} not found", "code": "not_found", "status": 404}))
    if action == "get":
        _status_fault(state, "runpodctl")
        instance = _instance(state, ident, missing)
        if instance.get("print") is not None:
            return instance["print"]
        if _gone_now(state, ident):
            raise missing
        return json.dumps(_runpod_pod(ident, instance["status"]), indent=2)
    hang = _verb(state, ident, "exited" if action == "stop" else "gone", missing, f"{action} pod")
    return hang or json.dumps({"id": ident, "stopped" if action == "stop" else "deleted": True})


# --- vastai ------------------------------------------------------------------------------------------------------


def _vast_row(ident: str, status: str, intended: Optional[str] = None) -> Dict[str, Any]:
    actual, cur = ("running", "running") if status == "running" else ("exited", "stopped")
    number = int(ident) if ident.isdigit() else ident
    row = {"id": number, "actual_status": actual, "cur_state": cur, "jupyter_token": _secret(ident)}
    return dict(row, intended_status=intended or "running")


def _vast_destroy_help(release: str) -> str:
    flag = "" if release == "old" else " [-y]"
    lines = [f"usage: vastai destroy instance id [-h]{flag} [--api-key API_KEY] [--raw]", "", "positional arguments:"]
    lines += ["  id                 id of instance to delete", "", "options:", "  -h, --help         show this help"]
    if release != "old":
        lines.append("  -y, --yes          Skip confirmation prompt")
    return "\n".join(lines)


def _vast_show(args: List[str], state: State) -> str:
    _status_fault(state, "vastai")
    if args[1] == "instances":
        garbage, listed = _listed(state)
        if garbage is not None:
            return garbage
        rows = [_vast_row(ident, status, state["instances"][ident].get("intended")) for ident, status in listed]
        if "--raw" in args:
            return json.dumps(rows)
        return "\n".join(
            ["ID       Status   Cur", *(f"{r['id']!s:8} {r['actual_status']:8} {r['cur_state']}" for r in rows)]
        )
    ident = args[2]
    missing = Refused(stdout=f"Error: instance {ident} not found.")
    instance = _instance(state, ident, missing)
    if instance.get("print") is not None:
        return instance["print"]
    if _gone_now(state, ident):
        raise missing
    row = _vast_row(ident, instance["status"], instance.get("intended"))
    if "--raw" not in args:
        return f"ID       Status   Cur\n{ident:8} {row['actual_status']:8} {row['cur_state']}"
    return json.dumps(row)


def _vast(args: List[str], state: State) -> str:
    release = _setting(state, "vastai_release", "FAKE_VASTAI_RELEASE", "new")
    if args[:2] == ["show", "instances"]:
        return _vast_show(args, state)
    if len(args) < 3 or args[1] != "instance" or args[0] not in ("stop", "destroy", "show"):
        raise Refused(stdout=f"vastai: error: invalid choice: {' '.join(args[:2])!r}")
    if args[0] == "destroy" and "--help" in args:
        return _vast_destroy_help(release)
    if args[0] == "show":
        return _vast_show(args, state)
    action, ident, extra = args[0], args[2], args[3:]
    yes = bool({"-y", "--yes"} & set(extra))
    if action == "destroy" and yes and release == "old":
        usage = "usage: vastai destroy instance id [-h] [--api-key API_KEY] [--raw]"
        raise Refused(f"{usage}\nvastai: error: unrecognized arguments: {' '.join(extra)}", rc=2)
    missing = Refused(stdout=f"Error: instance {ident} not found.")
    if action == "destroy" and not yes and release == "new":
        _instance(state, ident, missing)
        sys.stdout.write(f"Are you sure you want to destroy instance {ident}? This is irreversible. [y/N] ")
        sys.stdout.flush()
        answer = sys.stdin.readline()
        if answer.strip().lower() != "y":
            return "\nAborted." if not answer else "Aborted."
    hang = _verb(state, ident, "exited" if action == "stop" else "gone", missing, f"{action} instance")
    return hang or f"{'stopping' if action == 'stop' else 'destroying'} instance {ident}."


# --- curl, as the Lambda Cloud API -------------------------------------------------------------------------------


def _lambda_instance(ident: str, status: str) -> Dict[str, Any]:
    token = _secret(ident)
    return {
        "id": ident,
        "name": f"train-{ident[:6]}",
        "ip": "192.0.2.10",
        "status": {"running": "active", "exited": "terminating"}[status],
        "region": {"name": "us-tx-3", "description": "Austin, Texas"},
        "instance_type": {"name": "gpu_1x_a100_sxm4"},
        "jupyter_token": token,
        "jupyter_url": f"https://jupyter-{token}.cloud.lambdalabs.com",
    }


def _http_error(code: int, error: str, message: str, fail: bool) -> Refused:
    body = json.dumps({"error": {"code": error, "message": message}})
    if not fail:  # without --fail(-with-body) curl exits 0 whatever the HTTP status
        return Refused(rc=0, stdout=body)
    return Refused(f"curl: (22) The requested URL returned error: {code}", 22, body)


def _curl_parse(args: List[str]) -> Tuple[List[str], Optional[str], Optional[str], bool]:
    headers: List[str] = []
    body = url = None
    fail = False
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg in ("-s", "-S", "-sS", "-Ss", "--silent", "--show-error"):
            continue
        if arg in ("--fail-with-body", "--fail", "-f"):
            fail = True
        elif arg in ("--max-time", "-m") and rest:
            rest.pop(0)
        elif arg in ("-H", "--header") and rest:
            headers.append(rest.pop(0))
        elif arg in ("-d", "--data") and rest:
            body = rest.pop(0)
        elif arg.startswith("https://"):
            url = arg
        else:
            raise Refused(f"curl: option {arg}: is unknown (fake curl: only the Lambda Cloud API)", 2)
    return headers, body, url, fail


def _curl_key(headers: List[str]) -> str:
    key = ""
    for given in headers:
        line = given
        if given.startswith("@"):
            try:
                with open(given[1:], encoding="utf-8") as handle:
                    line = handle.read().strip()
            except OSError:
                raise Refused("curl: (26) Failed to open/read local data from file/application", 26) from None
        if line.lower().startswith("authorization: bearer "):
            key = line.split(None, 2)[2]
    return key


def _curl(args: List[str], state: State) -> str:
    headers, body, url, fail = _curl_parse(args)
    marker = "/api/v1/"
    if url is None or marker not in url:
        raise Refused("curl: fake curl answers only https://.../api/v1/ (the Lambda Cloud API)", 2)
    path = url.split(marker, 1)[1].rstrip("/")
    if body is None:
        _status_fault(state, "curl")
    if _curl_key(headers) != LAMBDA_KEY:
        raise _http_error(401, "global/invalid-api-key", "API key was invalid, expired, or deleted.", fail)
    if body is None and path == "instances":
        garbage, listed = _listed(state)
        return garbage if garbage is not None else json.dumps({"data": [_lambda_instance(*row) for row in listed]})
    if body is None and path.startswith("instances/"):
        ident = path.split("/", 1)[1]
        if ident not in state["instances"] or _gone_now(state, ident):
            raise _http_error(404, "global/object-does-not-exist", "Specified instance does not exist.", fail)
        return json.dumps({"data": _lambda_instance(ident, state["instances"][ident]["status"])})
    if body is not None and path == "instance-operations/terminate":
        idents = json.loads(body).get("instance_ids", [])
        missing = _http_error(404, "global/object-does-not-exist", "Specified instance does not exist.", fail)
        done = []
        for ident in idents:
            instance = _lambda_instance(ident, _instance(state, ident, missing)["status"])
            if _verb(state, ident, "gone", missing, "terminate instance") == HANG:
                return HANG
            done.append(dict(instance, status="terminating"))
        return json.dumps({"data": {"terminated_instances": done}})
    raise _http_error(404, "global/not-found", f"no such endpoint: {path}", fail)


# --- the provider faces and the admin face -----------------------------------------------------------------------


def provider(face: str, args: List[str]) -> int:
    path = _state_path()
    _record(face, args, path)
    handlers = {"runpodctl": _runpod, "vastai": _vast, "curl": _curl}
    try:
        with _locked(path) as state:
            out = handlers[face](args, state)
    except Refused as exc:
        if exc.stdout:
            print(exc.stdout)
        if exc.stderr:
            print(exc.stderr, file=sys.stderr)
        return exc.rc
    if out == HANG:  # outside the lock, so status commands still answer
        while True:
            time.sleep(3600)
    print(out)
    return 0


def _install(bin_dir: str, faces: List[str], state: Optional[str] = None) -> None:
    """BIN_DIR/.fake_provider.py, a copy whose shebang is the Python running this (no PATH lookup, no exec bit needed
    on the checkout) and whose INSTALLED_STATE is ``state``, and a symlink to it per face."""
    os.makedirs(bin_dir, exist_ok=True)
    with open(os.path.abspath(__file__), encoding="utf-8") as handle:
        body = handle.read().split("\n", 1)[1]
    if state is not None:
        default = "INSTALLED_STATE: Optional[str] = None\n"
        if body.count(default) != 1:
            sys.exit("fake_provider: install --state: this copy has no INSTALLED_STATE line to set")
        body = body.replace(default, f"INSTALLED_STATE: Optional[str] = {os.path.abspath(state)!r}\n")
    script = os.path.join(os.path.abspath(bin_dir), ".fake_provider.py")
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(f"#!{sys.executable}\n{body}")
    os.chmod(script, 0o755)
    for face in faces:
        link = os.path.join(bin_dir, face)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(script, link)


def _admin(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="fake_provider.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="symlink the faces into BIN_DIR")
    install.add_argument("bin_dir")
    install.add_argument("--faces", nargs="+", choices=FACES, default=list(DEFAULT_FACES))
    install.add_argument("--state", default=None, help="the state file the faces use without FAKE_PROVIDER_STATE")
    add = sub.add_parser("add", help="add or replace an instance")
    add.add_argument("--state", default=None)
    add.add_argument("ident", metavar="ID")
    add.add_argument("--status", default="running", type=str.lower, choices=sorted(STATUSES))
    add.add_argument("--behaviour", default="normal", choices=BEHAVIOURS)
    add.add_argument("--settle-polls", type=int, default=0)
    add.add_argument("--print", dest="print_text", default=None, help="status commands print this instead of JSON")
    add.add_argument("--intended", default=None, choices=("running", "stopped"), help="Vast.ai's intended_status")
    settings = sub.add_parser("set", help="choose the vastai release and a status command fault")
    settings.add_argument("--state", default=None)
    settings.add_argument("--vastai-release", choices=RELEASES)
    settings.add_argument("--status-fault", choices=FAULTS)
    show = sub.add_parser("show", help="print the state (or one instance) as JSON")
    show.add_argument("--state", default=None)
    show.add_argument("ident", metavar="ID", nargs="?")
    opts = parser.parse_args(argv)
    if opts.command == "install":
        _install(opts.bin_dir, opts.faces, opts.state)
        return 0
    path = _state_path(opts.state)
    if opts.command == "add":
        instance: Dict[str, Any] = {"status": STATUSES[opts.status], "behaviour": opts.behaviour}
        if opts.settle_polls:
            instance["settle_polls"] = max(0, opts.settle_polls)
        if opts.print_text is not None:
            instance["print"] = opts.print_text
        if opts.intended is not None:
            instance["intended"] = opts.intended
        with _locked(path) as state:
            state["instances"][opts.ident] = instance
        return 0
    if opts.command == "set":
        with _locked(path) as state:
            chosen = {"vastai_release": opts.vastai_release, "status_fault": opts.status_fault}
            state.setdefault("settings", {}).update({k: v for k, v in chosen.items() if v is not None})
        return 0
    with _locked(path) as state:
        view = state if opts.ident is None else state["instances"].get(opts.ident)
    print(json.dumps(view, indent=2, sort_keys=True))
    return 0 if view is not None else 1


def main(argv: List[str]) -> int:
    face = os.path.basename(argv[0])
    if face in FACES:
        return provider(face, argv[1:])
    return _admin(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
