"""A stand-in training job for vram_zombies tests: a launcher whose workers hold an NVIDIA device node open.

    fake_job.py launch --device /dev/nvidia0 --workers 2 --state /tmp/job.json [--dataloaders]
                       [--register DATA_DIR --run NAME] [--ignore-term] [--daemon] [--keep-session]

The launcher leads its own session and process group (as a detached launch does; with ``--keep-session`` it
stays in its caller's, as ``nohup launcher &`` leaves it), starts the workers
and writes ``--state`` ({launcher, pgid, sid, workers, dataloaders}) once every holder has the device
open. ``--register`` also writes ``DATA_DIR/runs/NAME/run.json`` the way the launch role does. Kill the
launcher with SIGKILL to leave its workers orphaned. Standard library only: the fleet hosts' system
Python has nothing else; files are written with the collection's own atomic writer, as launch writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for collection_path
from collection_path import collection_root

sys.path.insert(0, str(collection_root()))
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import write_json_atomic

READY_TIMEOUT_S = 20.0


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(path, data)


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"fake_job: {path} did not appear within {READY_TIMEOUT_S:.0f}s")
        time.sleep(0.05)


def _sleep_forever(ignore_term: bool) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(3600)


def worker(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel, never left defunct
    device = open(args.device, "rb")  # noqa: SIM115 - held open until the process dies, like a CUDA context
    children = []
    if args.dataloader:
        ready = f"{args.ready}.loader"
        command = [sys.executable, __file__, "worker", "--device", args.device, "--ready", ready]
        if args.ignore_term:
            command.append("--ignore-term")
        children.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        _wait_for(ready)
    _write_json(args.ready, {"pid": os.getpid(), "fd": device.fileno(), "children": [c.pid for c in children]})
    _sleep_forever(args.ignore_term)


def launch(args: argparse.Namespace) -> None:
    if args.daemon and os.fork() > 0:
        _wait_for(args.state)  # the caller (an Ansible task) returns once the job is up
        return
    if os.getsid(0) != os.getpid() and not args.keep_session:
        os.setsid()  # started with start_new_session=True it already leads its session
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for stream in (0, 1, 2):
        os.dup2(devnull, stream)
    workers, loaders = [], []
    for number in range(args.workers):
        ready = f"{args.state}.worker{number}"
        command = [sys.executable, __file__, "worker", "--device", args.device, "--ready", ready]
        command += ["--dataloader"] if args.dataloaders else []
        command += ["--ignore-term"] if args.ignore_term else []
        workers.append(subprocess.Popen(command).pid)
        _wait_for(ready)
        with open(ready, encoding="utf-8") as handle:
            loaders.extend(json.load(handle)["children"])
    state = {"launcher": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "workers": workers}
    state["dataloaders"] = loaders
    if args.register:
        started = datetime.now(timezone.utc).isoformat()
        run = {
            "run": args.run,
            "pgid": state["pgid"],
            "sid": state["sid"],
            "pids": [os.getpid()],
            "started_at": started,
        }
        _write_json(os.path.join(args.register, "runs", args.run, "run.json"), run)
    _write_json(args.state, state)
    _sleep_forever(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    start = modes.add_parser("launch")
    start.add_argument("--device", required=True)
    start.add_argument("--workers", type=int, default=2)
    start.add_argument("--state", required=True)
    start.add_argument("--dataloaders", action="store_true")
    start.add_argument("--register", metavar="DATA_DIR")
    start.add_argument("--run", default="live")
    start.add_argument("--ignore-term", action="store_true", help="workers ignore SIGTERM (needs SIGKILL)")
    start.add_argument("--daemon", action="store_true", help="return once the job is up")
    start.add_argument("--keep-session", action="store_true", help="stay in the caller's process group and session")
    work = modes.add_parser("worker")
    work.add_argument("--device", required=True)
    work.add_argument("--ready", required=True)
    work.add_argument("--dataloader", action="store_true")
    work.add_argument("--ignore-term", action="store_true")
    args = parser.parse_args()
    if args.mode == "launch":
        launch(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
