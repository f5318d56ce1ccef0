# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The incremental scan of one cell log for crash signatures and progress, with a cursor kept between ticks.

Patrol runs every 30 minutes on logs that grow to gigabytes, so a tick reads only the bytes appended since the
previous one (at most ``max_bytes``): its cost follows the log's growth, never its size, and its memory is a few
1 MiB chunks. The cursor keeps where the scan stopped (device, inode, offset, size, a fingerprint of the bytes
before the offset), the counts and first lines so far, the last progress marker and the unfinished last line. A
cursor made for other patterns is scanned again from the start. So is a lost log, and what was seen stays seen:
a truncated or rewritten log (smaller than before, other bytes before the offset), a replaced one (another
inode) or a deleted one sets ``lost`` once and for good, and the signatures it showed are kept in the cursor
(``before``). A deleted log keeps its old cursor. A tick that stops short of the end also reads the last 64 KiB,
uncounted, so a cold tick on a 2 GB log shows the crash at its end and its current progress. The cursor also
keeps the cell's loss curve (``_series.LossSeries``), fed the same counted lines; a cursor without one (written
before it existed) or with a garbled one keeps its place and starts the curve there.

Growth is timed by the tick's clock (``now``), never by the file's mtime after first sight: a log whose mtime lies
in the future (a clock stepped back, a network volume running ahead) must not look fresh for hours. The runner's
own lines (``[rgt <UTC>] ...``, also glued after a command's unfinished last line) count for no signature and no
progress. An initial best-so-far printed as +inf (``best_val_loss: inf``) is no diverged loss.

Lines end at ``\\n`` and at ``\\r`` (tqdm redraws its bar after a ``\\r``). Only a line's first 4 KiB are matched;
past them its bytes are skipped up to the next line end, so no line is ever held whole. Why needles: a Python
loop per line, or one regex alternation over the text, costs seconds per 64 MiB; a literal-led regex runs at
memory speed, so each signature's needles find the few candidate lines in the raw bytes, and only those are
decoded (leniently: binary garbage costs nothing but reading) and matched. Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Match, NamedTuple, Optional, Pattern, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._series import LossSeries

SCHEMA = 2  # 1: mtime growth, runner lines and best-so-far inf counted; such cursors are scanned again
CHUNK_BYTES = 2**20
LINE_CAP = 4096
TAIL_BYTES = 64 * 1024
SHOWN_CHARS = 200
TRACEBACK_LOOKAHEAD = 60
FINGERPRINT_BYTES = 64
CURSOR_MAX_BYTES = 2**20
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")
LINE_END = re.compile(rb"[\r\n]")
PROGRESS_GROUPS = ("epoch", "epochs", "step", "steps")
PROGRESS_KEYS = ("epoch", "epochs_total", "step", "steps_total")
# The runner's own lines in a cell log start with "[rgt "; its stamp may also follow a command's unfinished line.
RUNNER_LINE = "[rgt "
RUNNER_STAMP = re.compile(r"\[rgt \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[^\]\n]{0,24}\] ")
# A best-so-far key (best_val_loss, min_loss, "lowest eval loss", bestValLoss): its +inf is a start, not a loss.
BEST_SO_FAR = re.compile(r"(?<![A-Za-z])(?:[Bb]est|BEST|[Mm]in(?:imum)?|MIN(?:IMUM)?|[Ll]owest|LOWEST)(?![a-z])")
KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_./- \t")

# Per signature: one regex, matched on a line's first 4 KiB, and its needles (literal-led byte regexes, searched
# over whole blocks at C speed) that find the candidate lines: every match of the regex holds one of them. Why
# each alternative is there, and the decoys that must not match, are in tests/unit/.../test_log_scan.py.
_WHOLE = r"(?![\w-])"  # nan / inf as a whole value: not "nano", "info", "INFO", "infer", "nan-safe"
BUILTIN_SIGNATURES = (
    ("python_traceback", r"Traceback \(most recent call last\):", [r"Traceback \(most recent call last\):"]),
    ("cuda_oom",
     r"\btorch\.(?:cuda\.)?OutOfMemoryError\b|CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED"
     r"|CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY",
     ["OutOfMemoryError", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA_ERROR_"]),
    ("killed",  # prose such as "killed 3 stale workers" is not the job being SIGKILLed
     r"^[ \t]*Killed[ \t]*$|: line \d+: +\d+ Killed\b|Out of memory: Kill(?:ed)? process|\boom-kill"
     r"|\bexit(?:ed with)? (?:code|status)[ :=]*137\b|\bexit_?code[ \t]*[:=][ \t]*(?:137|-9)\b"
     r"|\bsignal 9\b|\bSIGKILL\b|\b[Kk]illed by signal\b",
     ["Killed", "memory: Kill", "oom-kill", "exit", "signal", "SIG"]),
    ("disk_full",
     r"[Nn]o space left on device|PytorchStreamWriter failed writing file|iostream error|\bErrno 28\b"
     r"|Disk quota exceeded",
     ["space left on device", "PytorchStreamWriter", "iostream error", "Errno 28", "quota exceeded"]),
    ("nccl_timeout",
     r"Watchdog caught collective operation timeout|\bTimeout\(ms\)=\d"
     r"|NCCL\b.{0,160}?\b(?:timed out|timing out)\b|NCCL WARN\b.{0,160}?\b[Tt]imeout\b",
     ["Watchdog caught", r"Timeout\(ms\)=", "NCCL"]),
    ("nccl_error",
     r"NCCL error|\bnccl(?:System|Internal|UnhandledCuda|InvalidUsage|InvalidArgument|Remote)Error\b|NCCL WARN\b",
     ["NCCL", "nccl"]),
    ("cuda_illegal_memory_access",
     r"an illegal memory access was encountered|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress",
     ["illegal memory access", "CUDA_ERROR_", "cudaError"]),
    ("ecc_uncorrectable",
     r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable",
     ["uncorrectable ECC", "CUDA_ERROR_", "cudaError"]),
    ("nan_loss",  # a loss-like key directly followed by its nan / inf value, nothing in between
     r"(?i:(?:loss|grad_?norm)['\"]?(?:[ \t]*[:=][ \t]*|[ \t]+(?:is[ \t]+)?)['\"]?(?:tensor\()?"
     r"(?P<value>[-+]?(?:nan|inf(?:inity)?))(?![\w-]))",
     [v + _WHOLE for v in ("nan", "NaN", "NAN", "inf", "Inf(?:inity)?", "INF(?:INITY)?")]),
    ("segfault",
     r"Segmentation fault|\bSIGSEGV\b|\bsignal 11\b|core dumped|\bexit(?:ed with)? (?:code|status)[ :=]*139\b",
     ["Segmentation fault", "SIG", "signal", "core dumped", "exit"]),
)  # fmt: skip
# The line that ends a Python traceback: ``SomeError: message`` (after an optional ``[rank0]:`` prefix).
EXCEPTION_LINE = re.compile(r"^(?:\[[\w.:-]+\]:[ \t]?)?((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*))(:[ \t].*|:?)[ \t]*$", re.M)
BARE_EXCEPTION = re.compile(r"(?:Error|Exception|Interrupt|Exit|Iteration|Warning|Group)$")

_SEP = r"[ \t:=#\[]*"
_NUMBER = r"\d+(?!\.?\d)"  # 0.5 (a fractional epoch) is no epoch number
EPOCH_RE = re.compile(rf"(?i)\bepoch\b{_SEP}(?P<epoch>{_NUMBER})(?:(?:[ \t]*/[ \t]*|[ \t]+of[ \t]+)(?P<epochs>\d+)\b)?")
STEP_RE = re.compile(rf"(?i)\b(?:step|iter|iteration)\b{_SEP}(?P<step>{_NUMBER})(?:[ \t]*/[ \t]*(?P<steps>\d+)\b)?")
# A tqdm bar ``45%|####     | 90/200 [00:10<00:12, 8.1it/s]``: its n/total is the step (it/s or s/it only, so
# download and datasets.map bars, which count bytes or examples, are not training progress).
TQDM_RE = re.compile(r"\|[ \t]*(?P<step>\d+)/(?P<steps>\d+)[ \t]*\[[^\]\n]*(?:it/s|s/it)")
PROGRESS_PROBE = re.compile(r"(?i:\bepoch\b|\bstep\b|\biter(?:ation)?\b)[ \t:=#\[]*\d|\|[ \t]*\d+/\d+[ \t]*\[", re.M)


class Signature(NamedTuple):
    """A crash signature: ``needles`` find candidate lines in the raw bytes; None: search ``regex`` on the text.
    ``veto`` says which of the regex's hits on a line do not count."""

    name: str
    regex: Pattern[str]
    needles: Optional[Tuple[Pattern[bytes], ...]]
    veto: Optional[Callable[[str, Match[str]], bool]] = None

    def matches(self, line: str) -> bool:
        if self.veto is None:
            return self.regex.search(line) is not None
        return any(not self.veto(line, hit) for hit in self.regex.finditer(line))


def _best_so_far(line: str, hit: Match[str]) -> bool:
    """A +inf after a best/min/lowest key: the words and punctuation just before the hit name the key."""
    value = hit.group("value").lower()
    if value.startswith("-") or "inf" not in value:
        return False  # -inf and nan are diverged whatever the key
    start = end = hit.start()
    while start > max(0, end - 64) and line[start - 1] in KEY_CHARS:
        start -= 1
    return BEST_SO_FAR.search(line, start, end) is not None


VETOES: Dict[str, Callable[[str, Match[str]], bool]] = {"nan_loss": _best_so_far}


def own_line(line: str) -> str:
    """The part of a line the command wrote: none of a runner's line, a glued one up to the runner's stamp."""
    if line.startswith(RUNNER_LINE):
        return ""
    stamp = RUNNER_STAMP.search(line)
    return line[: stamp.start()] if stamp else line


class Progress:
    """Finds progress markers: ``probe`` is searched over a block's end, ``patterns`` parse the line it hits."""

    def __init__(self, probe: Pattern[str], patterns: Sequence[Pattern[str]], key: str) -> None:
        self.probe, self.patterns, self.key = probe, tuple(patterns), key

    def parse(self, line: str) -> Optional[Dict[str, Any]]:
        """The marker of one line, or None when no pattern yields a single integer (an empty marker says nothing)."""
        if self.key == "builtin" and _is_exception(line):
            return None  # "RuntimeError: crashed at epoch 1" is the crash, not the run's progress
        values: Dict[str, Optional[int]] = dict.fromkeys(PROGRESS_GROUPS)
        for pattern in self.patterns:
            hit = pattern.search(line)
            for group, value in (hit.groupdict() if hit else {}).items():
                if group in values and values[group] is None:
                    values[group] = _as_int(value)
        if all(value is None for value in values.values()):
            return None
        marker: Dict[str, Any] = {key: values[group] for key, group in zip(PROGRESS_KEYS, PROGRESS_GROUPS)}
        marker["line"] = _shown(line)
        return marker


def _is_exception(line: str) -> bool:
    hit = EXCEPTION_LINE.match(line.strip())
    return bool(hit and hit.group(3).startswith(":") and BARE_EXCEPTION.search(hit.group(2)))


BUILTIN_PROGRESS = Progress(PROGRESS_PROBE, (EPOCH_RE, STEP_RE, TQDM_RE), "builtin")


def _as_int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _shown(line: str) -> str:
    return line.strip()[:SHOWN_CHARS]


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def compile_signatures(user_patterns: Optional[Sequence[Mapping[str, Any]]]) -> List[Signature]:
    """The built-in signatures and the user's ``{name, regex}`` ones; ValueError names the bad pattern."""
    compiled = [
        Signature(name, re.compile(regex, re.M), tuple(re.compile(n.encode()) for n in needles), VETOES.get(name))
        for name, regex, needles in BUILTIN_SIGNATURES
    ]
    taken = {signature.name: "a built-in signature" for signature in compiled}
    for index, entry in enumerate(user_patterns or ()):
        name = entry.get("name") if isinstance(entry, Mapping) else None
        regex = entry.get("regex") if isinstance(entry, Mapping) else None
        good = isinstance(name, str) and NAME_RE.fullmatch(name)
        label = f"crash_patterns[{index}] ({name if good else repr(name)})"
        if not good:
            raise ValueError(f"{label}: name must match ^{NAME_RE.pattern}$")
        if name in taken:
            raise ValueError(f"{label}: the name is already used by {taken[name]}")
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"{label}: regex must be a non-empty string")
        try:
            pattern = re.compile(regex, re.M)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"{label}: regex does not compile: {exc}") from None
        if pattern.search(""):
            raise ValueError(f"{label}: regex matches an empty line, so every line would count")
        taken[name] = f"crash_patterns[{index}]"
        compiled.append(Signature(name, pattern, None))
    return compiled


def compile_progress(regex: Optional[str]) -> Progress:
    """The built-in progress markers for None or "", else the user's regex with named groups epoch, epochs, ..."""
    if not regex:
        return BUILTIN_PROGRESS
    try:
        pattern = re.compile(regex, re.M)
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"progress_regex does not compile: {exc}") from None
    if not set(PROGRESS_GROUPS) & set(pattern.groupindex):
        raise ValueError(f"progress_regex needs at least one of the named groups {', '.join(PROGRESS_GROUPS)}")
    if pattern.search(""):
        raise ValueError("progress_regex matches an empty line, so every line would be a progress marker")
    return Progress(pattern, (pattern,), "user:" + regex)


def _last_marker(raw: bytes, progress: Progress) -> Optional[Dict[str, Any]]:
    """The last progress marker in the last 64 KiB of a block, looked for in growing windows from the end:
    markers are frequent, so the first 4 KiB window nearly always has one (and a block's cost stays bounded)."""
    start = max(0, len(raw) - TAIL_BYTES)
    if start:
        cut = LINE_END.search(raw, start)
        start = cut.end() if cut else len(raw)
    text = _decode(raw[start:]).replace("\r", "\n")
    end, size = len(text), LINE_CAP
    while end > 0:
        start = max(0, end - size)
        start = text.rfind("\n", 0, start) + 1 if start else 0
        seen = -1
        for hit in reversed(list(progress.probe.finditer(text, start, end))):
            line_start = text.rfind("\n", 0, hit.start()) + 1
            if line_start != seen:
                seen = line_start
                line_end = text.find("\n", line_start)
                line = own_line(text[line_start : line_end if line_end >= 0 else len(text)][:LINE_CAP])
                marker = progress.parse(line) if line else None
                if marker is not None:
                    return marker
        end, size = start, size * 4
    return None


class _Scanner:
    """One tick's scan state: fed chunks of raw bytes, it keeps at most one unfinished line (4 KiB) of them."""

    def __init__(
        self,
        signatures: Sequence[Signature],
        progress: Progress,
        cursor: Optional[Mapping[str, Any]],
        loss: Optional[LossSeries] = None,
    ):
        self.needles: Dict[bytes, Tuple[Pattern[bytes], List[Signature]]] = {}
        for signature in signatures:
            for needle in signature.needles or ():
                self.needles.setdefault(needle.pattern, (needle, []))[1].append(signature)
        self.searched = [signature for signature in signatures if signature.needles is None]
        self.all = list(signatures)
        self.progress = progress
        self.loss = loss  # None for the uncounted tail read
        self.found: Dict[str, Dict[str, Any]] = {}
        self.carry, self.skipping, self.marker, self.pending = b"", False, None, 0
        if cursor is not None:
            self.found = {entry["signature"]: dict(entry) for entry in cursor["signatures"]}
            self.carry, self.skipping = base64.b64decode(cursor["carry"]), cursor["skipping"]

    def feed(self, chunk: bytes) -> None:
        data = self.carry + chunk if self.carry else chunk
        self.carry = b""
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut >= 0:
            head, data = data[: cut + 1], data[cut + 1 :]
            if self.skipping:  # the rest of a line whose first 4 KiB were matched already
                head, self.skipping = head[LINE_END.search(head).end() :], False  # type: ignore[union-attr]
            if head:
                self._block(head)
        if self.skipping:
            return
        if len(data) > LINE_CAP:
            self._block(data[:LINE_CAP] + b"\n")
            self.skipping = True
        else:
            self.carry = data

    def unfinished(self) -> Tuple[Dict[str, Dict[str, Any]], Optional[Dict[str, Any]]]:
        """Signatures and marker with the unfinished last line counted (e.g. a tqdm bar), the cursor's left as is."""
        if not self.carry or self.skipping:
            return self.found, None
        kept = ({name: dict(entry) for name, entry in self.found.items()}, self.marker, self.pending, self.loss)
        self.marker, self.loss = None, None  # the loss of a line not finished is counted once it is
        self._block(self.carry + b"\n")
        found, marker = self.found, self.marker
        self.found, self.marker, self.pending, self.loss = kept
        return found, marker

    def _block(self, raw: bytes) -> None:
        """Whole lines ending in ``\\n``: the needles' lines checked against their signatures, in log order."""
        if b"\r" in raw:
            raw = raw.replace(b"\r", b"\n")
        if self.pending:
            self._exception_line(raw, 0)
        lines: Dict[int, Dict[str, Signature]] = {}
        for needle, signatures in self.needles.values():
            hit = needle.search(raw)
            while hit is not None:
                start, pos = raw.rfind(b"\n", 0, hit.start()) + 1, raw.find(b"\n", hit.start()) + 1
                if hit.start() < start + LINE_CAP:
                    lines.setdefault(start, {}).update((s.name, s) for s in signatures)
                hit = needle.search(raw, pos) if pos else None
        for start in sorted(lines):
            end = raw.find(b"\n", start)
            line = own_line(_decode(raw[start : min(end, start + LINE_CAP)]))
            for signature in lines[start].values():
                if line and signature.matches(line):
                    self._count(signature.name, line, raw, end + 1)
        if self.searched:
            self._search(_decode(raw))
        if self.loss is not None:
            self.loss.feed(raw)
        marker = _last_marker(raw, self.progress)
        self.marker = marker or self.marker

    def _search(self, text: str) -> None:
        """The user's signatures: each searched over the block's text, each line it hits checked on its own."""
        for signature in self.searched:
            pos = 0
            while pos < len(text):
                hit = signature.regex.search(text, pos)
                if hit is None:
                    break
                start, end = text.rfind("\n", 0, hit.start()) + 1, text.find("\n", hit.start())
                end = len(text) if end < 0 else end
                line = own_line(text[start : min(end, start + LINE_CAP)])
                if line and signature.regex.search(line):
                    self._count(signature.name, line, b"", 0)
                pos = end + 1

    def _count(self, name: str, line: str, raw: bytes, after: int) -> None:
        entry = self.found.setdefault(name, {"signature": name, "count": 0, "first_line": None})
        entry["count"] += 1
        if entry["first_line"] is None:
            entry["first_line"] = _shown(line)
            if name == "python_traceback":
                self.pending = TRACEBACK_LOOKAHEAD
                self._exception_line(raw, after)

    def _exception_line(self, raw: bytes, pos: int) -> None:
        """The first traceback's ``SomeError: message`` line, if within the next lines: its first_line then."""
        end, lines = pos, 0
        while lines < self.pending and end < len(raw):
            end, lines = raw.find(b"\n", end) + 1 or len(raw), lines + 1
        for hit in EXCEPTION_LINE.finditer(_decode(raw[pos:end])):
            last, message = hit.group(2), hit.group(3)
            if last != last.upper() and (len(message) > 1 or "." in hit.group(1) or BARE_EXCEPTION.search(last)):
                self.found["python_traceback"]["first_line"] = _shown(hit.group(0))
                self.pending = 0
                return
        self.pending -= lines


def _config_key(signatures: Sequence[Signature], progress: Progress) -> str:
    """A cursor counts only for the patterns it was made with: changing them rescans the log."""
    spec = json.dumps([[s.name, s.regex.pattern] for s in signatures] + [progress.key])
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def _fingerprint(fd: int, offset: int) -> str:
    start = max(0, offset - FINGERPRINT_BYTES)
    return hashlib.sha256(os.pread(fd, offset - start, start)).hexdigest()[:16]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entries(found: Any) -> bool:
    return isinstance(found, list) and all(
        isinstance(e["signature"], str) and _is_int(e["count"]) and isinstance(e["first_line"], (str, type(None)))
        for e in found
    )


def _usable(cursor: Any) -> bool:
    """A cursor of this SCHEMA with every field of its type; anything else is no cursor (the log is scanned again,
    as if first seen: an older schema's counts and growth time are not trusted). Its ``loss`` is checked apart, by
    ``LossSeries``: a missing or garbled curve costs the curve, not the scan's place."""
    try:
        marker, growth, lost = cursor["progress"], cursor["last_growth"], cursor["lost"]
        return (
            cursor["schema"] == SCHEMA
            and all(_is_int(cursor[key]) for key in ("dev", "inode", "offset", "size"))
            and cursor["offset"] <= cursor["size"]
            and all(isinstance(cursor[key], str) for key in ("config", "fingerprint", "carry"))
            and len(base64.b64decode(cursor["carry"], validate=True)) <= LINE_CAP
            and isinstance(cursor["skipping"], bool)
            and isinstance(growth, (int, float)) and not isinstance(growth, bool) and math.isfinite(growth)
            and (lost is None or isinstance(lost, str))
            and (marker is None or (isinstance(marker["line"], str) and all(
                marker[key] is None or _is_int(marker[key]) for key in PROGRESS_KEYS)))
            and _entries(cursor["signatures"])
            and _entries(cursor["before"])
        )  # fmt: skip
    except (KeyError, TypeError, ValueError):  # binascii.Error is a ValueError
        return False


def load_cursor(path: str) -> Optional[Dict[str, Any]]:
    """The cursor saved at ``path``; None for a missing, unreadable, oversized or garbage file (never raises)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(CURSOR_MAX_BYTES + 1)
        cursor = json.loads(raw.decode("utf-8")) if len(raw) <= CURSOR_MAX_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    return cursor if _usable(cursor) else None


def save_cursor(path: str, cursor: Mapping[str, Any]) -> None:
    """Write atomically (temp file in the same directory, fsync, rename): a killed tick leaves the old cursor."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o755, exist_ok=True)
    payload = json.dumps(cursor, sort_keys=True, separators=(",", ":")).encode()
    fd, temp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def scan_log(
    path: str,
    cursor: Optional[Mapping[str, Any]],
    signatures: Sequence[Signature],
    progress: Progress,
    *,
    max_bytes: int = 64 * 2**20,
    now: Optional[float] = None,
) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Scan the bytes of ``path`` past the cursor (at most ``max_bytes``): this tick's scan and the new cursor.

    ``now`` is the tick's wall clock (time.time() when None): ``last_growth`` is the ``now`` of the tick that saw
    the log's size or identity change, or min(mtime, now) when the log is first seen. The cursor is None when a
    log never seen does not exist; a deleted log's cursor is the old one with ``lost`` set. When the log cannot be
    read, the old cursor comes back as it was, and so do its signatures and progress: a passing error loses
    nothing found so far.
    """
    now = time.time() if now is None else now
    prev = dict(cursor) if _usable(cursor) else None
    scan: Dict[str, Any] = {
        "path": path, "exists": True, "error": None, "size": None, "read_bytes": 0, "restarted": False,
        "more": False, "signatures": [], "progress": None, "last_growth": None, "mtime": None, "lost": None,
        "loss_series": None,
    }  # fmt: skip
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO must not block
    except (FileNotFoundError, NotADirectoryError):
        if prev is None:
            return dict(scan, exists=False), None
        gone = dict(prev, lost=prev["lost"] or f"log deleted (was {prev['size']} bytes)")
        return _kept(dict(scan, exists=False), gone, signatures, now), gone
    except OSError as exc:
        return _failed(scan, prev, signatures, now, f"{path} cannot be read: {exc.strerror or exc}")
    try:
        info = os.fstat(fd)
        scan["mtime"] = info.st_mtime
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            return _failed(scan, prev, signatures, now, f"{path} is {kind}, not a log")
        key, (lost, intact) = _config_key(signatures, progress), _loss(fd, info, prev)
        resume = prev if prev is not None and intact and prev["config"] == key else None
        loss = LossSeries(resume.get("loss") if resume is not None else None)
        scanner = _Scanner(signatures, progress, resume, loss)
        start = offset = resume["offset"] if resume is not None else 0
        budget = max(0, min(max_bytes, info.st_size - offset))
        while budget > 0:
            chunk = os.pread(fd, min(CHUNK_BYTES, budget), offset)
            if not chunk:
                break
            offset, budget = offset + len(chunk), budget - len(chunk)
            scanner.feed(chunk)
        more, (found, unfinished) = offset < info.st_size, scanner.unfinished()
        if more:  # far behind: the end's signatures and progress now, from a bounded read of the last 64 KiB
            found, unfinished = _tail(fd, info.st_size, offset, scanner, found)
        fingerprint = _fingerprint(fd, offset)
    except OSError as exc:
        return _failed(scan, prev, signatures, now, f"{path} cannot be read: {exc.strerror or exc}")
    finally:
        os.close(fd)
    kept = (unfinished if more else None) or scanner.marker or (resume["progress"] if resume is not None else None)
    before = prev["before"] if prev is not None else []
    if prev is not None and not intact:  # what the lost bytes showed stays seen
        before = _merged(signatures, before, prev["signatures"])
    if prev is None:
        growth = min(info.st_mtime, now)
    elif lost is not None or info.st_size != prev["size"]:
        growth = now
    else:
        growth = min(prev["last_growth"], now)
    lost = (prev["lost"] if prev is not None else None) or lost  # the first loss stays the reason
    scan.update(
        size=info.st_size, read_bytes=offset - start, restarted=cursor is not None and resume is None, more=more,
        last_growth=growth, signatures=_merged(signatures, before, list(found.values())), progress=unfinished or kept,
        lost=lost, loss_series=loss.view(),
    )  # fmt: skip
    return scan, {
        "schema": SCHEMA, "dev": info.st_dev, "inode": info.st_ino, "offset": offset, "size": info.st_size,
        "config": key, "fingerprint": fingerprint, "carry": base64.b64encode(scanner.carry).decode(),
        "skipping": scanner.skipping, "signatures": _merged(signatures, list(scanner.found.values())),
        "progress": kept, "last_growth": growth, "lost": lost, "before": before, "loss": loss.state(),
    }  # fmt: skip


def _loss(fd: int, info: os.stat_result, prev: Optional[Mapping[str, Any]]) -> Tuple[Optional[str], bool]:
    """Why bytes the cursor saw are gone (None: none are; another file at the path, or the same one cut or
    rewritten), and whether the bytes before its offset are still those it counted (then it goes on from there)."""
    if prev is None:
        return None, False
    if (prev["dev"], prev["inode"]) != (info.st_dev, info.st_ino):
        return "log replaced by another file", False
    intact = prev["offset"] <= info.st_size and _fingerprint(fd, prev["offset"]) == prev["fingerprint"]
    if intact and info.st_size >= prev["size"]:
        return None, True
    return f"log truncated (was {prev['size']} bytes, now {info.st_size})", intact


def _merged(signatures: Sequence[Signature], *found: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Entries of the same signature added up, the earliest first line kept, in the signatures' order."""
    merged: Dict[str, Dict[str, Any]] = {}
    for entries in found:
        for entry in entries:
            into = merged.setdefault(
                entry["signature"], {"signature": entry["signature"], "count": 0, "first_line": None}
            )
            into["count"] += entry["count"]
            into["first_line"] = into["first_line"] or entry["first_line"]
    order = {signature.name: index for index, signature in enumerate(signatures)}
    return sorted(merged.values(), key=lambda entry: order.get(entry["signature"], len(order)))


def _kept(
    scan: Dict[str, Any], cursor: Mapping[str, Any], signatures: Sequence[Signature], now: float
) -> Dict[str, Any]:
    """The scan a kept cursor tells: what it saw, no newer than this tick."""
    return dict(
        scan, signatures=_merged(signatures, cursor["before"], cursor["signatures"]), progress=cursor["progress"],
        last_growth=min(cursor["last_growth"], now), lost=cursor["lost"],
        loss_series=LossSeries(cursor.get("loss")).view(),
    )  # fmt: skip


def _failed(
    scan: Dict[str, Any], prev: Optional[Dict[str, Any]], signatures: Sequence[Signature], now: float, error: str
) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    scan["error"] = error
    return (_kept(scan, prev, signatures, now) if prev is not None else scan), prev


def _tail(
    fd: int, size: int, offset: int, scanner: _Scanner, found: Dict[str, Dict[str, Any]]
) -> Tuple[Dict[str, Dict[str, Any]], Optional[Dict[str, Any]]]:
    """What the last 64 KiB add to ``found`` (not to the cursor: the scan counts them when it gets there), and
    their last marker: a cold tick on a 2 GB log shows the crash at its end and its current progress."""
    start = max(offset, size - TAIL_BYTES)
    raw = os.pread(fd, size - start, start)
    if start > offset or scanner.carry or scanner.skipping:  # begin at a line start
        cut = LINE_END.search(raw)
        raw = raw[cut.end() :] if cut else b""
    tail = _Scanner(scanner.all, scanner.progress, None)
    tail.found = {name: dict(entry) for name, entry in found.items()}
    tail.feed(raw)
    found, unfinished = tail.unfinished()
    return found, unfinished or tail.marker
