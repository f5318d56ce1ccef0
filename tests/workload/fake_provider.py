#!/usr/bin/env python
"""A fake provider CLI: ``runpodctl`` and ``vastai`` look-alikes that keep instance state in a file and record calls.

One script, three faces, chosen by the name it is called by (tests symlink it into a bin directory on PATH):

    runpodctl pod stop ID | pod delete ID | pod get ID
    vastai stop instance ID | destroy instance ID [-y] | show instance ID [--raw]
    fake_provider.py install BIN_DIR          (BIN_DIR/runpodctl and BIN_DIR/vastai: symlinks to a copy of this
                                               script whose shebang is the Python that ran install)
    fake_provider.py add [--state FILE] ID [--status running|exited] [--behaviour normal|sticky|fail|hang]
                         [--settle-polls N] [--print TEXT]
    fake_provider.py show [--state FILE] [ID] (prints the state file, or one instance, as JSON)

The state is a JSON file named by env FAKE_PROVIDER_STATE (``--state`` for the admin commands), read and written
under an flock on FILE.lock and replaced atomically; a missing file holds no instance. Every call of the provider
faces (never the admin ones) is appended as one JSON line ``{"argv": [name, args...], "at": ISO UTC}`` to env
FAKE_PROVIDER_CALLS (default: FILE.calls.jsonl next to the state file) before anything else happens.

Dialects follow the current CLIs. RunPod (runpodctl v2): ``pod stop`` sets desiredStatus EXITED, ``pod delete``
removes the pod, ``pod get`` prints {"id", "name", "desiredStatus", ...}; an unknown id prints ``pod ID not found``
on stderr and exits 1. Vast.ai: ``stop instance`` sets actual_status "exited" and cur_state "stopped",
``destroy instance ID -y`` removes it; WITHOUT ``-y`` it prompts, reads stdin and, on end-of-file or any answer but
y, prints that it aborted and exits 0 while the instance keeps running (the real CLI's trap). ``show instance ID
--raw`` prints {"id", "actual_status", "cur_state", ...}; without ``--raw`` a table; an unknown id prints
``Error: instance ID not found.`` and exits 1.

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
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

FACES = ("runpodctl", "vastai")
BEHAVIOURS = ("normal", "sticky", "fail", "hang")
STATUSES = {"running": "running", "exited": "exited", "stopped": "exited"}
State = Dict[str, Any]
HANG = "\0hang"  # what a verb of a hanging instance returns: no printable output is this


class Refused(Exception):
    """A provider error: its message is printed and the CLI exits 1."""

    def __init__(self, message: str, stream: str = "stderr") -> None:
        super().__init__(message)
        self.stream = stream


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _state_path(explicit: Optional[str] = None) -> str:
    path = explicit or os.environ.get("FAKE_PROVIDER_STATE", "")
    if not path:
        sys.exit("fake_provider: set FAKE_PROVIDER_STATE (or --state) to the state file")
    return path


@contextlib.contextmanager
def _locked(path: str) -> Iterator[State]:
    """The state under an exclusive flock; written back atomically when changed (also when the CLI refuses: a pod
    whose removal settled is gone for good once a status command reported it not found)."""
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
    line = json.dumps({"argv": [face, *args], "at": _utc()}) + "\n"
    with open(calls, "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(line)


# --- the provider faces ------------------------------------------------------------------------------------------


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


def _runpod(args: List[str], state: State) -> str:
    if len(args) != 3 or args[0] != "pod" or args[1] not in ("stop", "delete", "get"):
        word = args[0] if args else ""
        raise Refused(f'Error: unknown command "{word}" for "runpodctl"\nRun \'runpodctl --help\' for usage.')
    action, ident = args[1], args[2]
    missing = Refused(f"pod {ident} not found")
    if action == "get":
        instance = _instance(state, ident, missing)
        if instance.get("print") is not None:
            return instance["print"]
        if _gone_now(state, ident):
            raise missing
        shown = {"running": "RUNNING", "exited": "EXITED"}[instance["status"]]
        return json.dumps({"id": ident, "name": f"pod-{ident}", "desiredStatus": shown, "costPerHr": 2.49}, indent=2)
    hang = _verb(state, ident, "exited" if action == "stop" else "gone", missing, f"{action} pod")
    return hang or f'pod "{ident}" {"stopped" if action == "stop" else "deleted"}'


def _vast(args: List[str], state: State) -> str:
    if len(args) < 3 or args[1] != "instance" or args[0] not in ("stop", "destroy", "show"):
        raise Refused(f"vastai: error: invalid choice: {' '.join(args[:2])!r}", stream="stdout")
    action, ident, extra = args[0], args[2], args[3:]
    missing = Refused(f"Error: instance {ident} not found.", stream="stdout")
    if action == "show":
        instance = _instance(state, ident, missing)
        if instance.get("print") is not None:
            return instance["print"]
        if _gone_now(state, ident):
            raise missing
        actual, cur = ("running", "running") if instance["status"] == "running" else ("exited", "stopped")
        if "--raw" not in extra:
            return f"ID       Status   Cur\n{ident:8} {actual:8} {cur}"
        return json.dumps({"id": int(ident) if ident.isdigit() else ident, "actual_status": actual, "cur_state": cur})
    if action == "destroy" and not ({"-y", "--yes"} & set(extra)):
        _instance(state, ident, missing)
        sys.stdout.write(f"Are you sure you want to destroy instance {ident}? This cannot be undone. [y/N] ")
        sys.stdout.flush()
        answer = sys.stdin.readline()
        if answer.strip().lower() not in ("y", "yes"):
            return "Aborted: instance was not destroyed."
    hang = _verb(state, ident, "exited" if action == "stop" else "gone", missing, f"{action} instance")
    return hang or f"{'stopping' if action == 'stop' else 'destroying'} instance {ident}."


def provider(face: str, args: List[str]) -> int:
    path = _state_path()
    _record(face, args, path)
    try:
        with _locked(path) as state:
            out = (_runpod if face == "runpodctl" else _vast)(args, state)
    except Refused as exc:
        print(exc, file=sys.stderr if exc.stream == "stderr" else sys.stdout)
        return 1
    if out == HANG:  # outside the lock, so status commands still answer
        while True:
            time.sleep(3600)
    print(out)
    return 0


# --- the admin face ----------------------------------------------------------------------------------------------


def _install(bin_dir: str) -> None:
    """BIN_DIR/.fake_provider.py, a copy whose shebang is the Python running this (no PATH lookup, no exec bit needed
    on the checkout), and the symlinks runpodctl and vastai to it."""
    os.makedirs(bin_dir, exist_ok=True)
    with open(os.path.abspath(__file__), encoding="utf-8") as handle:
        body = handle.read().split("\n", 1)[1]
    script = os.path.join(os.path.abspath(bin_dir), ".fake_provider.py")
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(f"#!{sys.executable}\n{body}")
    os.chmod(script, 0o755)
    for face in FACES:
        link = os.path.join(bin_dir, face)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(script, link)


def _admin(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="fake_provider.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="symlink runpodctl and vastai into BIN_DIR")
    install.add_argument("bin_dir")
    add = sub.add_parser("add", help="add or replace an instance")
    add.add_argument("--state", default=None)
    add.add_argument("ident", metavar="ID")
    add.add_argument("--status", default="running", type=str.lower, choices=sorted(STATUSES))
    add.add_argument("--behaviour", default="normal", choices=BEHAVIOURS)
    add.add_argument("--settle-polls", type=int, default=0)
    add.add_argument("--print", dest="print_text", default=None, help="status commands print this instead of JSON")
    show = sub.add_parser("show", help="print the state (or one instance) as JSON")
    show.add_argument("--state", default=None)
    show.add_argument("ident", metavar="ID", nargs="?")
    opts = parser.parse_args(argv)
    if opts.command == "install":
        _install(opts.bin_dir)
        return 0
    path = _state_path(opts.state)
    if opts.command == "add":
        instance: Dict[str, Any] = {"status": STATUSES[opts.status], "behaviour": opts.behaviour}
        if opts.settle_polls:
            instance["settle_polls"] = max(0, opts.settle_polls)
        if opts.print_text is not None:
            instance["print"] = opts.print_text
        with _locked(path) as state:
            state["instances"][opts.ident] = instance
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
