"""A tiny local webhook receiver for tests: every POST body becomes one JSON line in a file.

    webhook_receiver.py start --state-dir DIR [--timeout S] [--lifetime S]   start in the background, print the URL
    webhook_receiver.py stop --state-dir DIR [--timeout S]    stop it (SIGTERM, then wait); fine when not running
    webhook_receiver.py serve --state-dir DIR [--lifetime S]  the same server in the foreground

The server listens on 127.0.0.1 on a free port and keeps its files in DIR: ``port`` (written once it listens),
``pid``, ``received.jsonl`` (one line per POST delivered, appended and flushed before the reply, so a client that
got its answer finds its line), ``requests.jsonl`` (one line per request of any path, on arrival:
``{"path", "method", "t", "answer"}``, ``t`` the receiver's wall clock) and ``server.log``. A JSON body is written as
itself (re-serialized on one line); any other body as ``{"invalid_json": "<the text>"}``. Other methods get 405.
``start`` returns only when the port file exists. The server also ends on its own when its ``pid`` file disappears
(a test's directory removed, as Molecule removes its ephemeral directory) and after ``--lifetime`` seconds (default 0:
no limit), so a test that fails before its ``stop`` leaves nothing running for long. Standard library only.

What a POST gets depends on its path (``start`` prints the URL of ``/hook``):

    /hang         the body is read, then no answer at all until the server stops (a webhook that hangs)
    /307, /308    that redirect, to ``/hook`` (a relative Location); nothing is delivered at this hop
    /hook, other  ``200 ok``, the body delivered to received.jsonl (as Slack's incoming webhooks answer)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Sequence

MAX_BODY = 1 << 20
HANG_MAX_S = 3600.0
REDIRECTS = {"/307": 307, "/308": 308}


class _Handler(BaseHTTPRequestHandler):
    server_version = "rgt-webhook-receiver"
    lines_path: Path
    requests_path: Path
    lock = threading.Lock()
    stopping = threading.Event()  # set when the server stops: the hung requests end with it

    def do_POST(self) -> None:
        length = min(int(self.headers.get("Content-Length") or 0), MAX_BODY)
        raw = self.rfile.read(length) if length > 0 else b""
        path = self.path.split("?", 1)[0]
        answer = REDIRECTS.get(path, "hang" if path == "/hang" else 200)
        self._append(self.requests_path, {"path": path, "method": "POST", "t": time.time(), "answer": answer})
        if answer == "hang":
            self.stopping.wait(HANG_MAX_S)
            self.close_connection = True
            return
        if answer in (307, 308):
            self.send_response(int(answer))
            self.send_header("Location", "/hook")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        text = raw.decode("utf-8", errors="replace")
        try:
            body = json.loads(text)
        except ValueError:
            body = {"invalid_json": text}
        self._append(self.lines_path, body)
        self._answer(200, b"ok")

    def do_GET(self) -> None:
        self._append(self.requests_path, {"path": self.path, "method": "GET", "t": time.time(), "answer": 405})
        self._answer(405, b"POST only")

    def _append(self, path: Path, record: object) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with self.lock, open(path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"{self.address_string()} {format % args}\n")
        sys.stderr.flush()


def _watch(server: ThreadingHTTPServer, pid_file: Path, lifetime_s: float) -> None:
    """Shut the server down when its pid file is gone or its lifetime is over."""
    deadline = time.monotonic() + lifetime_s if lifetime_s > 0 else None
    while pid_file.exists() and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.5)
    server.shutdown()


def serve(state_dir: Path, lifetime_s: float = 0) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    _Handler.lines_path = state_dir / "received.jsonl"
    _Handler.requests_path = state_dir / "requests.jsonl"
    _Handler.lines_path.touch()
    _Handler.requests_path.touch()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True

    def on_term(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    (state_dir / "pid").write_text(f"{os.getpid()}\n")
    threading.Thread(target=_watch, args=(server, state_dir / "pid", lifetime_s), daemon=True).start()
    port_tmp = state_dir / "port.tmp"
    port_tmp.write_text(f"{server.server_address[1]}\n")
    os.replace(port_tmp, state_dir / "port")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        _Handler.stopping.set()
        server.server_close()
        for name in ("port", "pid"):
            (state_dir / name).unlink(missing_ok=True)
    return 0


def _pid(state_dir: Path) -> Optional[int]:
    try:
        return int((state_dir / "pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start(state_dir: Path, timeout_s: float, lifetime_s: float = 0) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    pid = _pid(state_dir)
    if pid is not None and _alive(pid) and (state_dir / "port").exists():
        print(f"http://127.0.0.1:{(state_dir / 'port').read_text().strip()}/hook")
        return 0
    for name in ("port", "pid"):
        (state_dir / name).unlink(missing_ok=True)
    with open(state_dir / "server.log", "ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "serve",
                "--state-dir",
                str(state_dir),
                "--lifetime",
                str(lifetime_s),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # outlives the caller's session (an Ansible task)
        )
    deadline = time.monotonic() + timeout_s
    while not (state_dir / "port").exists():
        if process.poll() is not None:
            sys.stderr.write(f"webhook receiver exited {process.returncode}; see {state_dir / 'server.log'}\n")
            return 1
        if time.monotonic() > deadline:
            process.kill()
            sys.stderr.write(f"webhook receiver did not listen within {timeout_s:g} s\n")
            return 1
        time.sleep(0.05)
    print(f"http://127.0.0.1:{(state_dir / 'port').read_text().strip()}/hook")
    return 0


def stop(state_dir: Path, timeout_s: float) -> int:
    pid = _pid(state_dir)
    if pid is None or not _alive(pid):
        print("not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while (state_dir / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if (state_dir / "pid").exists():
        os.kill(pid, signal.SIGKILL)
        (state_dir / "pid").unlink(missing_ok=True)
        (state_dir / "port").unlink(missing_ok=True)
        sys.stderr.write(f"webhook receiver {pid} ignored SIGTERM for {timeout_s:g} s: killed\n")
        return 1
    print("stopped")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("start", "stop", "serve"))
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds start / stop wait")
    parser.add_argument("--lifetime", type=float, default=0.0, help="seconds until the server stops on its own")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.state_dir, args.lifetime)
    if args.command == "start":
        return start(args.state_dir, args.timeout, args.lifetime)
    return stop(args.state_dir, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
