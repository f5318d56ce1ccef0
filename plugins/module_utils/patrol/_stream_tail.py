# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The last lines of a long command output, read without holding (or decoding) the rest.

A kernel log can be a hundred megabytes; what is checked is its tail. ``stream_command`` reads a command's stdout
straight into a ``TailBuffer``, which keeps only the newest blocks, and ``LogLines`` holds the decoded tail as one
text, split only where it is looked at.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import subprocess
import time
from collections import deque
from typing import IO, Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, cast

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import (
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
)

# Blocks of the tail buffer, and reads from the command's pipe (the pipe is widened to this where allowed).
BLOCK = 1024 * 1024
# At most this much is kept: 200,000 kernel log lines of up to 160 bytes each.
KEEP_BYTES = 32 * 1024 * 1024
_STDERR_BYTES = 64 * 1024
_F_SETPIPE_SZ = 1031  # Linux fcntl; named in the fcntl module only from Python 3.10


class TailBuffer:
    """The last ``max_lines`` lines, and at most ``max_bytes`` bytes, of a byte stream read or fed in any pieces.

    The stream fills fixed blocks; the oldest one is dropped, and its memory reused, once the blocks after it hold
    ``max_bytes``, so however long the stream, memory stays near ``max_bytes``. Newlines are counted once, in
    ``text()``, and only back from the end to where the kept lines begin; only those lines are decoded.
    """

    def __init__(self, max_lines: int, max_bytes: int = KEEP_BYTES, block: int = BLOCK) -> None:
        self.max_lines = max(1, max_lines)
        self.max_bytes = max(1, max_bytes)
        self.block = max(1, block)
        self.bytes_read = 0
        self._blocks: Deque[bytearray] = deque()  # full blocks, oldest first
        self._spare: List[bytearray] = []
        self._open = bytearray(self.block)  # the block being filled
        self._filled = 0
        self._rest_bytes = 0  # bytes in every full block but the first
        self._dropped_newline = True  # whether the stream so far ends a line where the kept blocks begin

    def read_from(self, fd: int) -> int:
        """One read from ``fd`` straight into the open block; 0 at the end of the stream."""
        with memoryview(self._open) as view:
            got = os.readv(fd, [view[self._filled :]])
        self._got(got)
        return got

    def feed(self, data: bytes) -> None:
        offset = 0
        while offset < len(data):
            size = min(len(data) - offset, self.block - self._filled)
            self._open[self._filled : self._filled + size] = data[offset : offset + size]
            offset += size
            self._got(size)

    def _got(self, size: int) -> None:
        self._filled += size
        self.bytes_read += size
        if self._filled == self.block:
            self._push()

    def _push(self) -> None:
        self._blocks.append(self._open)
        if len(self._blocks) > 1:
            self._rest_bytes += len(self._open)
        self._open, self._filled = (self._spare.pop() if self._spare else bytearray(self.block)), 0
        while len(self._blocks) > 1 and self._rest_bytes >= self.max_bytes:
            oldest = self._blocks.popleft()
            self._dropped_newline = oldest.endswith(b"\n")
            self._spare.append(oldest)
            self._rest_bytes -= len(self._blocks[0])

    def text(self) -> Tuple[str, int, bool]:
        """(the kept tail decoded leniently, how many bytes were decoded, whether anything was dropped).

        The tail starts at a line start: a line the byte cap cuts in two is dropped whole. The buffer is empty
        afterwards.
        """
        del self._open[self._filled :]  # the open block is the newest piece, as far as it is filled
        pieces = deque([*self._blocks, self._open])
        self._blocks.clear()
        self._spare.clear()
        self._open, self._filled, self._rest_bytes = bytearray(), 0, 0
        kept = sum(len(piece) for piece in pieces)
        index, offset = _tail_start(list(pieces), self.max_lines, min(kept, self.max_bytes), self._dropped_newline)
        for _older in range(index):
            pieces.popleft()
        size = sum(len(piece) for piece in pieces) - offset
        tail = bytearray(size)
        at = 0
        while pieces:  # each block is let go as soon as it is copied: memory holds about the tail twice at most
            piece = pieces.popleft()
            tail[at : at + len(piece) - offset] = memoryview(piece)[offset:]
            at += len(piece) - offset
            offset = 0
        text = str(tail, "utf-8", "replace")
        return text, size, size < self.bytes_read


def _tail_start(pieces: List[bytearray], max_lines: int, max_bytes: int, starts_a_line: bool) -> Tuple[int, int]:
    """(piece index, offset in it) where the last ``max_lines`` lines within the last ``max_bytes`` bytes begin.

    ``starts_a_line``: whether the first piece begins a line (it does not when the bytes before it were dropped
    in the middle of one). A final line without a newline counts as a line.
    """
    last = pieces[-1] if pieces[-1] or len(pieces) == 1 else pieces[-2]
    newlines_wanted = max_lines + (1 if last[-1:] == b"\n" else 0)
    budget = max_bytes  # bytes still allowed, from the end back
    for index in range(len(pieces) - 1, -1, -1):
        piece = pieces[index]
        low = max(0, len(piece) - budget)
        count = piece.count(b"\n", low)
        if count >= newlines_wanted:
            cut = len(piece)
            for _newline in range(newlines_wanted):
                cut = piece.rfind(b"\n", low, cut)
            return _line_start(pieces, index, cut + 1)
        newlines_wanted -= count
        budget -= len(piece) - low
        if budget == 0 or index == 0:
            return _first_line_start(pieces, index, low, starts_a_line)
    raise AssertionError("pieces always holds the open block")


def _first_line_start(pieces: List[bytearray], index: int, offset: int, starts_a_line: bool) -> Tuple[int, int]:
    """The first line start at or after (index, offset): that place itself when the byte before it ends a line."""
    if offset:
        before = pieces[index][offset - 1 : offset]
    else:
        before = pieces[index - 1][-1:] if index else (b"\n" if starts_a_line else b"")
    if before == b"\n":
        return _line_start(pieces, index, offset)
    for later in range(index, len(pieces)):
        newline = pieces[later].find(b"\n", offset if later == index else 0)
        if newline >= 0:
            return _line_start(pieces, later, newline + 1)
    return len(pieces) - 1, len(pieces[-1])


def _line_start(pieces: List[bytearray], index: int, offset: int) -> Tuple[int, int]:
    """A start at the end of a piece is the start of the next one."""
    if offset >= len(pieces[index]) and index + 1 < len(pieces):
        return index + 1, 0
    return index, offset


class LogLines(Sequence[str]):
    """The kept lines of a log, held as one text and split only when indexed or counted.

    Lines end at ``\n`` (a ``\r`` before it is dropped); blank lines are left out. ``parse_kernel_log``
    searches ``text`` itself rather than visiting every line.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self._list: Optional[List[str]] = None

    def __iter__(self) -> Iterator[str]:
        return iter(self._list) if self._list is not None else self._split()

    def _split(self) -> Iterator[str]:
        text, start = self.text, 0
        while start < len(text):
            end = text.find("\n", start)
            end = len(text) if end < 0 else end
            line = text[start:end].rstrip("\r")
            if line.strip():
                yield line
            start = end + 1

    def _lines(self) -> List[str]:
        if self._list is None:
            self._list = list(self._split())
        return self._list

    def __len__(self) -> int:
        return len(self._lines())

    def __getitem__(self, index: Any) -> Any:
        return self._lines()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, LogLines)):
            return self._lines() == list(other)
        return NotImplemented

    __hash__ = None  # mutable-looking and compared by content, like a list

    def __repr__(self) -> str:
        return f"LogLines({len(self.text)} characters)"


def stream_command(argv: List[str], timeout_s: float, tail: TailBuffer) -> Tuple[int, str]:
    """Run ``argv`` (no shell) like ``subprocess_runner``, its stdout read straight into ``tail``.

    Returns (rc, stderr): rc 124 when ``timeout_s`` ran out (the command is killed), 127 when it is missing,
    126 when it cannot be executed. Only the first 64 KiB of stderr are kept: its first line is the message.
    """
    env = dict(os.environ, LC_ALL="C", LANG="C")  # tool output is parsed, so keep it untranslated
    try:
        # Not run_command: its stdout streams into a bounded tail instead of memory, and no AnsibleModule runs here.
        proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
    except FileNotFoundError:
        return RC_NOT_FOUND, f"{argv[0]}: command not found"
    except PermissionError as exc:
        return RC_NOT_EXECUTABLE, f"{argv[0]}: {exc.strerror}"
    stderr = bytearray()

    def read_stderr(fd: int) -> int:
        piece = os.read(fd, _STDERR_BYTES)
        stderr.extend(piece[: max(0, _STDERR_BYTES - len(stderr))])
        return len(piece)

    deadline = time.monotonic() + timeout_s
    with proc:
        stdout, stderr_pipe = cast(IO[bytes], proc.stdout), cast(IO[bytes], proc.stderr)  # both asked for
        _widen_pipe(stdout.fileno())
        finished = _pump({stdout.fileno(): tail.read_from, stderr_pipe.fileno(): read_stderr}, deadline)
        if finished:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                finished = False
        if not finished:
            proc.kill()
            proc.wait()
            return RC_TIMEOUT, f"timed out after {timeout_s:g} s"
    return proc.returncode, bytes(stderr).decode("utf-8", "replace")


def _pump(readers: Dict[int, Callable[[int], int]], deadline: float) -> bool:
    """Call each fd's reader while it has data, until every fd ends (a reader returns 0); False on the deadline."""
    with selectors.DefaultSelector() as selector:
        for fd, reader in readers.items():
            selector.register(fd, selectors.EVENT_READ, reader)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _events in selector.select(remaining):
                if not key.data(key.fd):
                    selector.unregister(key.fd)
    return True


def _widen_pipe(fd: int) -> None:
    """Fewer, larger reads of a long log; the default 64 KiB pipe is fine where this is refused."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, BLOCK)
