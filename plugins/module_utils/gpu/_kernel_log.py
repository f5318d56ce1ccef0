# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Reading the kernel log on a (usually containerised) rented box, and splitting its records.

``read_kernel_log`` tries ``dmesg --time-format=iso`` (plain ``dmesg`` when that flag is rejected),
then ``journalctl -k``. A container where dmesg is denied and the journal is empty cannot rule out
Xids, so that is "unreadable" (finding ``kernel_log_unreadable``), never a silent pass.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, Dict, List, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import (
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
    Runner,
    subprocess_runner,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._stream_tail import (
    LogLines,
    TailBuffer,
    stream_command,
)

DEFAULT_MAX_LINES = 200000
_ERROR_TEXT = 200

DMESG_ISO = ["dmesg", "--time-format=iso"]
DMESG_PLAIN = ["dmesg"]


def journalctl_argv(max_lines: int) -> List[str]:
    return ["journalctl", "-k", "-o", "short-iso", "--no-pager", "-q", "-n", str(max_lines)]


def _one_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:_ERROR_TEXT]
    return ""


def _is_flag_rejected(rc: int, stderr: str) -> bool:
    """Busybox and old util-linux dmesg reject --time-format; permission errors are not that."""
    lowered = stderr.lower()
    if rc in (RC_TIMEOUT, RC_NOT_FOUND, RC_NOT_EXECUTABLE) or "not permitted" in lowered or "denied" in lowered:
        return False
    return any(word in lowered for word in ("unrecognized", "invalid option", "unknown", "usage", "unsupported"))


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------
def _attempt(
    run: Runner, argv: List[str], timeout_s: float, max_lines: int
) -> Tuple[Dict[str, Any], Optional[LogLines], str, Dict[str, Any]]:
    """(attempt record, kept lines or None, stderr, what was read: truncated, bytes_read, bytes_decoded)."""
    tail = TailBuffer(max_lines)
    if run is subprocess_runner:  # the module's own runner: stream, never holding the whole output
        rc, stderr = stream_command(argv, timeout_s, tail)
    else:
        rc, stdout, stderr = run(argv, timeout_s)
        tail.feed(stdout.encode("utf-8", "surrogatepass"))
    text, decoded, truncated = tail.text()
    lines = LogLines(text)
    first = next(iter(lines), None)  # iterating stops early: nothing is split beyond what is looked at
    command = " ".join(argv)
    if rc == RC_TIMEOUT:
        error: Optional[str] = f"timed out after {timeout_s:g} s"
    elif rc == RC_NOT_FOUND:
        error = "not installed"
    elif rc != 0:
        error = _one_line(stderr) or _one_line(first or "") or "failed with no message"
    elif first is None or all(line.strip() == "-- No entries --" for line in lines):
        error = "no entries"
    else:
        error = None
    record = {"command": command, "rc": rc, "error": error}
    if error is not None:
        return record, None, stderr, dict(_NOTHING_READ)
    return record, lines, stderr, {"truncated": truncated, "bytes_read": tail.bytes_read, "bytes_decoded": decoded}


_NOTHING_READ: Dict[str, Any] = {"truncated": False, "bytes_read": 0, "bytes_decoded": 0}


def read_kernel_log(run: Runner, timeout_s: float, max_lines: int = DEFAULT_MAX_LINES) -> Dict[str, Any]:
    """The kernel log's last ``max_lines`` lines, from dmesg or the journal.

    Returns ``lines`` (a ``LogLines``, None when unreadable), ``source`` ('dmesg' | 'journalctl' | None),
    ``attempts`` (``{command, rc, error}`` each, error None for the one that worked), and what was read:
    ``truncated`` (older lines were left out, so an Xid there went unseen; journalctl applies the cap itself,
    so there it means it printed the full ``max_lines``), ``bytes_read`` and ``bytes_decoded`` (only the kept
    tail is decoded). ``run(argv, timeout)`` returns ``(rc, stdout, stderr)``; each command gets ``timeout_s``.
    The module's own ``subprocess_runner`` is not called: the command is streamed under the same contract.
    """
    attempts = []
    record, lines, stderr, read = _attempt(run, DMESG_ISO, timeout_s, max_lines)
    attempts.append(record)
    if lines is None and _is_flag_rejected(record["rc"], stderr):
        record, lines, _stderr, read = _attempt(run, DMESG_PLAIN, timeout_s, max_lines)
        attempts.append(record)
    if lines is not None:
        return dict(read, lines=lines, source="dmesg", attempts=attempts)
    record, lines, _stderr, read = _attempt(run, journalctl_argv(max_lines), timeout_s, max_lines)
    attempts.append(record)
    if lines is not None:
        read["truncated"] = read["truncated"] or lines.text.count("\n") >= max_lines
        return dict(read, lines=lines, source="journalctl", attempts=attempts)
    return dict(_NOTHING_READ, lines=None, source=None, attempts=attempts)


def kernel_log_finding(result: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``kernel_log_unreadable`` WARN finding when ``read_kernel_log`` found nothing usable, else None."""
    if result.get("lines") is not None:
        return None
    tried = "; ".join(f"{a['command']}: {a['error']}" for a in result.get("attempts", [])) or "nothing tried"
    message = f"kernel log unreadable, Xids cannot be ruled out ({tried})"
    return finding("kernel_log_unreadable", "WARN", message, "investigate", attempts=result.get("attempts", []))


def boot_time(stat_path: str = "/proc/stat") -> Optional[datetime]:
    """When this machine booted (UTC), from the ``btime`` line of /proc/stat; None when unavailable."""
    try:
        with open(stat_path, encoding="ascii", errors="replace") as stat:
            for line in stat:
                if line.startswith("btime "):
                    return datetime.fromtimestamp(int(line.split()[1]), tz=timezone.utc)
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---------------------------------------------------------------------------------------------------------------
# Splitting one record: dmesg, dmesg -T, dmesg --time-format=iso [--decode], /dev/kmsg, journal, syslog
# ---------------------------------------------------------------------------------------------------------------
_KMSG_RE = re.compile(r"(\d+),\d+,(\d+),[^;]*;")
_DECODE_RE = re.compile(r"[a-z]+ *:[a-z]+ *: ")
_ISO_RE = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(Z|[+-]\d\d:?\d\d)?\s+(?:\S+ kernel: )?"
)
_CTIME_RE = re.compile(r"\[(?:[A-Z][a-z]{2} )?([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\]\s*")
_SYSLOG_RE = re.compile(r"([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) \S+ [^:\s]+: ")
_UPTIME_RE = re.compile(r"\[\s*(\d+\.\d+)\]\s*")
_MONTHS = {
    m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)
}


def _local(naive: datetime, local_tz: Optional[tzinfo]) -> datetime:
    aware = naive.replace(tzinfo=local_tz) if local_tz is not None else naive.astimezone()
    return aware.astimezone(timezone.utc)


def _iso_time(match: Any) -> datetime:
    year, month, day, hour, minute, second, fraction, offset = match.groups()
    micro = int((fraction or "0")[:6].ljust(6, "0"))
    naive = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), micro)
    if offset is None:
        return _local(naive, None)
    if offset == "Z":
        return naive.replace(tzinfo=timezone.utc)
    sign = -1 if offset[0] == "-" else 1
    digits = offset[1:].replace(":", "")
    return (naive - sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))).replace(tzinfo=timezone.utc)


def _syslog_time(fields: Tuple[str, ...], year: Optional[int], local_tz: Optional[tzinfo]) -> datetime:
    """Syslog stamps carry no year: take ``year``, else this year, or last year when that is in the future."""
    month, day, hour, minute, second = (
        _MONTHS[fields[0]],
        int(fields[1]),
        int(fields[2]),
        int(fields[3]),
        int(fields[4]),
    )
    now = datetime.now(timezone.utc)
    stamp = _local(datetime(year or now.year, month, day, hour, minute, second), local_tz)
    if year is None and stamp > now + timedelta(days=1):
        stamp = _local(datetime(now.year - 1, month, day, hour, minute, second), local_tz)
    return stamp


def split_record(
    line: str, year: Optional[int] = None, local_tz: Optional[tzinfo] = None
) -> Tuple[Optional[datetime], Optional[float], str]:
    """(UTC timestamp or None, seconds since boot or None, message) of one kernel log record.

    Local-time stamps (``dmesg -T``, syslog) are read in ``local_tz``, default this machine's zone.
    """
    kmsg = _KMSG_RE.match(line)
    if kmsg is not None:
        return None, int(kmsg.group(2)) / 1e6, line[kmsg.end() :]
    rest = line
    decode = _DECODE_RE.match(rest)
    if decode is not None:
        rest = rest[decode.end() :]
    timestamp = None
    match = _ISO_RE.match(rest)
    if match is not None:
        timestamp = _iso_time(match)
    else:
        match = _CTIME_RE.match(rest)
        if match is not None and match.group(1) in _MONTHS:
            month, day, hour, minute, second, year_text = match.groups()
            timestamp = _local(
                datetime(int(year_text), _MONTHS[month], int(day), int(hour), int(minute), int(second)), local_tz
            )
        else:
            match = _SYSLOG_RE.match(rest)
            if match is not None and match.group(1) in _MONTHS:
                timestamp = _syslog_time(match.groups(), year, local_tz)
            else:
                match = None
    if match is not None:
        rest = rest[match.end() :]
    uptime = None
    bracket = _UPTIME_RE.match(rest)
    if bracket is not None:
        uptime = float(bracket.group(1))
        rest = rest[bracket.end() :]
    return timestamp, uptime, rest
