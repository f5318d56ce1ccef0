"""The delay relay that stands in for netem: bytes arrive intact, each way half an RTT late, and EOF passes through."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

RELAY = Path(__file__).resolve().parents[1] / "delay_relay.py"
RTT_S = 0.2


@pytest.fixture
def echo_server() -> Iterator[int]:
    """A loopback server that echoes what it reads, then closes when the client stops sending."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        connection, _address = server.accept()
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()


def start_relay(port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(RELAY), "--rtt-ms", str(RTT_S * 1000), "127.0.0.1", str(port)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def read_exactly(stream: object, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = stream.read1(size - len(chunks))  # type: ignore[attr-defined]
        assert chunk, f"relay closed after {len(chunks)} of {size} bytes"
        chunks += chunk
    return bytes(chunks)


def test_an_echo_through_the_relay_takes_at_least_one_round_trip(echo_server: int) -> None:
    relay = start_relay(echo_server)
    assert relay.stdin is not None and relay.stdout is not None
    warm_up = b"the connection's own round trip is paid here\n"
    relay.stdin.write(warm_up)
    relay.stdin.flush()
    assert read_exactly(relay.stdout, len(warm_up)) == warm_up

    started = time.monotonic()
    relay.stdin.write(b"ping\n")
    relay.stdin.flush()
    assert read_exactly(relay.stdout, 5) == b"ping\n"
    assert time.monotonic() - started >= RTT_S * 0.95  # one way to the server, one way back
    relay.stdin.close()
    assert relay.wait(timeout=10) == 0


def test_a_large_payload_arrives_intact_and_eof_reaches_both_ends(echo_server: int) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB, every byte value
    relay = start_relay(echo_server)
    assert relay.stdin is not None
    out, _err = relay.communicate(payload, timeout=30)
    assert out == payload
    assert relay.returncode == 0


def test_an_unreachable_box_is_an_error_naming_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connecting is refused
        argv = [sys.executable, str(RELAY), "--rtt-ms", "10", "127.0.0.1", str(port)]
        relay = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        _out, err = relay.communicate(b"", timeout=10)
    assert relay.returncode == 255
    assert f"127.0.0.1:{port}" in err.decode()
