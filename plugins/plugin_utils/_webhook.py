# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Sending a tick's notifications: every message POSTed in parallel under ONE deadline, 307/308 followed for the
POST (urllib would not re-POST them), and the webhook URL, a secret, never part of an error."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from typing import Any, Dict, Optional, Sequence
from urllib.parse import urljoin, urlsplit

URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
ERROR_CHARS = 200
MAX_HOPS = 5
MAX_PARALLEL = 16
ANSWER_BYTES = 65536


class _Undelivered(Exception):
    """A webhook answer or a redirect this module refuses; its message names no URL."""


def redact(text: Any, url: str = "") -> str:
    """One bounded line with ``url`` and anything that looks like a URL replaced by ``<webhook>``."""
    line = " ".join(str(text).split())
    if url:
        line = line.replace(url, "<webhook>")
    line = URL.sub("<webhook>", line)
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3] + "..."


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Every redirect comes back as an HTTPError: 307/308 are followed by hand (urllib does not re-POST them)."""

    def redirect_request(self, *_args: Any, **_kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _post(url: str, body: bytes, timeout_s: float, deadline: float) -> None:
    """POST ``body`` to ``url``, following at most MAX_HOPS 307/308 redirects (same scheme, or http to https).
    Raises with a message that never holds a URL (the caller redacts it again anyway)."""
    target = url
    for _hop in range(MAX_HOPS + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Undelivered("no answer within the tick's deadline")
        request = urllib.request.Request(target, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            with _OPENER.open(request, timeout=min(timeout_s, left)) as answer:
                answer.read(ANSWER_BYTES)
            return
        except urllib.error.HTTPError as error:
            location = error.headers.get("Location") if error.headers else None
            error.close()
            if error.code not in (307, 308):
                hint = ": redirect not followed for a POST (only 307 and 308 are)" if 300 <= error.code < 400 else ""
                raise _Undelivered(f"status {error.code}{hint}") from None
            if not location:
                raise _Undelivered(f"status {error.code} without a Location") from None
            following = urljoin(target, location)
            before, after = urlsplit(target).scheme, urlsplit(following).scheme
            if after != before and (before, after) != ("http", "https"):
                raise _Undelivered(f"status {error.code} to a {after or 'schemeless'} URL refused") from None
            target = following
    raise _Undelivered(f"more than {MAX_HOPS} redirects")


def _why(error: BaseException) -> str:
    if isinstance(error, _Undelivered):
        return str(error)
    if isinstance(error, urllib.error.URLError):
        return f"no answer: {error.reason}"
    if isinstance(error, (TimeoutError, OSError, HTTPException)):
        return f"no answer: {error or type(error).__name__}"
    return f"failed: {type(error).__name__}"


def send_all(
    url: str, messages: Sequence[Any], deadline_s: float, timeout_s: Optional[float] = None
) -> Dict[int, Optional[str]]:
    """POST each message as JSON to ``url``, MAX_PARALLEL at a time, all within ONE deadline of ``deadline_s``
    seconds (each request also within ``timeout_s``, by default the deadline); returns message index -> None (a
    2xx) or why not (never the URL). A message unanswered at the deadline is an error; its thread is abandoned."""
    scheme = urlsplit(url).scheme if isinstance(url, str) else ""
    if scheme not in ("http", "https") or not urlsplit(url).netloc:
        return dict.fromkeys(range(len(messages)), "the webhook URL is not an http(s) URL")
    deadline = time.monotonic() + max(0.0, deadline_s)
    per_request = max(0.1, deadline_s if timeout_s is None else timeout_s)
    results: Dict[int, Optional[str]] = {}
    done = threading.Condition()
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(messages)):
        work.put(index)

    def worker() -> None:
        while True:
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            try:
                _post(url, json.dumps(messages[index], default=str).encode(), per_request, deadline)
                outcome = None
            except Exception as error:  # any failure is this message's error, never the tick's
                outcome = redact(_why(error), url)
            with done:
                results[index] = outcome
                done.notify_all()

    for _worker in range(min(MAX_PARALLEL, len(messages))):
        threading.Thread(target=worker, name="rgt-notify", daemon=True).start()
    with done:
        done.wait_for(lambda: len(results) == len(messages), timeout=max(0.0, deadline - time.monotonic()))
        answered = dict(results)
    late = f"no answer within the tick's {deadline_s:g}s deadline"
    return {index: answered.get(index, late) for index in range(len(messages))}
