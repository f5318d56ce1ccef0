"""ssh ProxyCommand that makes a simulated box look far away: every byte each way arrives half an RTT late.

    ssh -o 'ProxyCommand=python3 delay_relay.py --rtt-ms 100 %h %p' ...

Stands in for `tc qdisc add dev lo root netem delay`, which this machine's kernel lacks (CONFIG_NET_SCH_NETEM is
not set, and no module can be loaded). Only connections made through this relay are delayed: nothing else on the
machine or in the boxes changes. Connecting costs one RTT, as a TCP handshake does; bandwidth is not limited.
"""

from __future__ import annotations

import argparse
import collections
import os
import selectors
import socket
import sys
import time

CHUNK = 65536


class Direction:
    """Bytes read from one end, each chunk held until its due time, then written to the other end."""

    def __init__(self, write: object, delay_s: float) -> None:
        self.write = write
        self.delay_s = delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.eof = False  # the reading end closed: pass that on once the queue is empty

    def received(self, data: bytes) -> None:
        self.queue.append((time.monotonic() + self.delay_s, data))

    def flush_due(self) -> None:
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            self.write(self.queue.popleft()[1])  # type: ignore[operator]

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    @property
    def drained(self) -> bool:
        return self.eof and not self.queue


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def relay(host: str, port: int, rtt_s: float) -> int:
    time.sleep(rtt_s)  # the handshake's round trip
    upstream = socket.create_connection((host, port), timeout=10)
    upstream.settimeout(None)
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    to_box = Direction(upstream.sendall, rtt_s / 2)
    to_client = Direction(lambda data: _write_all(1, data), rtt_s / 2)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, (0, to_box))
    selector.register(upstream, selectors.EVENT_READ, (upstream, to_client))
    upstream_shut = False
    while True:
        dues = [due for due in (to_box.next_due(), to_client.next_due()) if due is not None]
        timeout = max(0.0, min(dues) - time.monotonic()) if dues else None
        if selector.get_map():
            for key, _events in selector.select(timeout):
                source, direction = key.data
                data = os.read(0, CHUNK) if source == 0 else upstream.recv(CHUNK)
                if data:
                    direction.received(data)
                else:
                    direction.eof = True
                    selector.unregister(key.fileobj)
        elif timeout:
            time.sleep(timeout)
        to_box.flush_due()
        to_client.flush_due()
        if to_box.drained and not upstream_shut:
            upstream.shutdown(socket.SHUT_WR)
            upstream_shut = True
        if to_client.drained:
            return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, required=True)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    args = parser.parse_args()
    try:
        return relay(args.host, args.port, args.rtt_ms / 1000)
    except (OSError, BrokenPipeError) as exc:
        print(f"delay_relay: {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main())
