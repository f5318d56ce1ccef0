# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Xid catalog and kernel-log parsing; the findings built from them are in ``_xid_findings``.

Classification, from a renter's point of view (a rented box usually cannot reset its GPU):

* ``hardware``: the GPU, its memory or its links are failing, or need a reset to apply a repair.
  Finding ``xid_hardware`` (FAIL); action ``re_rent`` (persistent) or ``reset_gpu``.
* ``driver``: driver or GPU firmware (GSP, PMU) faults. Those that leave the GPU wedged until a reset
  are FAIL (``xid_hardware``, action ``reset_gpu``); advisory ones are WARN (``xid_application``).
* ``application``: usually the job's own fault; the GPU stays healthy. ``xid_application`` (WARN),
  action ``restart_job`` or ``investigate``.
* ``unknown``: a code this catalog does not know. Nothing rules out a hardware fault, but failing a
  box on a code nobody documented is too harsh: ``xid_unknown`` (WARN), action ``investigate``.

Entries whose action is ``none`` (test or informational events) produce no finding.
An Xid 79 and the no-Xid "has fallen off the bus" block both produce ``gpu_lost`` (FAIL, re_rent); an Xid 79
also produces its ``xid_hardware`` finding, as every hardware Xid does. Xids of a GPU that is not this
box's (a shared host's kernel log) are ``xid_other_gpu`` (WARN) instead: see ``_xid_findings``.
"""

from __future__ import annotations

import re
from datetime import datetime, tzinfo
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._gpu_model import kernel_pci
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._kernel_log import split_record
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._stream_tail import LogLines

# (code, short name, kind, renter's action). Written from NVIDIA's public Xid catalog and nverror.h.
_CATALOG_ROWS = (
    (8, "GPU stopped processing (channel idle timeout)", "application", "restart_job"),
    (11, "invalid or corrupted push buffer stream", "application", "restart_job"),
    (13, "graphics engine exception", "application", "restart_job"),
    (14, "injected test error", "driver", "none"),
    (25, "invalid or illegal push buffer stream", "application", "restart_job"),
    (31, "GPU memory page fault (MMU fault)", "application", "restart_job"),
    (32, "corrupted push buffer stream (PBDMA, usually PCIe quality)", "hardware", "re_rent"),
    (38, "driver firmware watchdog timeout (FECS)", "driver", "investigate"),
    (39, "copy engine exception (CE0)", "application", "restart_job"),
    (40, "copy engine exception (CE1)", "application", "restart_job"),
    (41, "copy engine exception (CE2)", "application", "restart_job"),
    (43, "GPU stopped processing (channel reset after a job fault)", "application", "restart_job"),
    (44, "graphics engine fault during context switch", "application", "restart_job"),
    (45, "preemptive channel teardown (job aborted or killed)", "application", "investigate"),
    (46, "GPU stopped processing (GPU timeout)", "driver", "reset_gpu"),
    (48, "double-bit ECC error (uncorrectable memory error)", "hardware", "re_rent"),
    (54, "auxiliary power not connected", "hardware", "re_rent"),
    (56, "display engine error", "driver", "investigate"),
    (57, "error programming video memory interface", "hardware", "re_rent"),
    (58, "unstable video memory interface (FB memory error)", "hardware", "re_rent"),
    (61, "internal micro-controller breakpoint or warning (PMU)", "driver", "investigate"),
    (62, "internal micro-controller halt (PMU)", "driver", "reset_gpu"),
    (63, "memory row remap or page retirement recorded (applies after a reset)", "hardware", "re_rent"),
    (64, "memory row remap or page retirement failure", "hardware", "re_rent"),
    (68, "video decoder exception (NVDEC0)", "application", "restart_job"),
    (69, "graphics engine class error", "application", "restart_job"),
    (74, "NVLink error", "hardware", "re_rent"),
    (79, "GPU has fallen off the bus", "hardware", "re_rent"),
    (92, "high single-bit ECC error rate", "hardware", "re_rent"),
    (94, "contained ECC error", "hardware", "re_rent"),
    (95, "uncontained ECC error", "hardware", "re_rent"),
    (109, "context switch timeout", "driver", "reset_gpu"),
    (110, "security fault", "hardware", "re_rent"),
    (119, "GSP RPC timeout", "driver", "reset_gpu"),
    (120, "GSP firmware error", "driver", "reset_gpu"),
    (121, "corrected C2C link errors (Grace-Hopper/Blackwell)", "hardware", "none"),
    (122, "PMU RPC read failure over SPI", "driver", "investigate"),
    (123, "PMU RPC write failure over SPI", "driver", "investigate"),
    (136, "NVLink link training failed", "hardware", "re_rent"),
    (137, "NVLink privilege error (illegal peer access)", "application", "restart_job"),
    (140, "unrecovered ECC error (could not remap or retire)", "hardware", "re_rent"),
    (141, "CUDA fast path error", "driver", "none"),
    (143, "GPU initialization error", "driver", "reset_gpu"),
    (144, "NVLink SAW error", "hardware", "reset_gpu"),
    (145, "NVLink RLW error", "hardware", "reset_gpu"),
    (146, "NVLink TLW error", "hardware", "reset_gpu"),
    (147, "NVLink TREX error", "hardware", "reset_gpu"),
    (148, "NVLink NVLPW control error", "hardware", "reset_gpu"),
    (149, "NVLink NETIR error", "hardware", "reset_gpu"),
    (150, "NVLink MSE error", "hardware", "reset_gpu"),
    (151, "key rotation error (confidential computing)", "driver", "investigate"),
    (154, "GPU recovery action changed (see the accompanying Xid)", "driver", "investigate"),
    (155, "NVLink link brought down by software", "driver", "reset_gpu"),
    (156, "resource retirement event (applies after a reset)", "hardware", "reset_gpu"),
    (157, "resource retirement failure", "hardware", "re_rent"),
    (158, "GPU fatal timeout", "driver", "reset_gpu"),
)

CATALOG: Dict[int, Dict[str, Any]] = {
    code: {"code": code, "name": name, "kind": kind, "action": action} for code, name, kind, action in _CATALOG_ROWS
}
_CONDEMNING_ACTIONS = ("re_rent", "reset_gpu")
XID_FALLEN_OFF_BUS = 79


def _level(action: str) -> Optional[str]:
    if action == "none":
        return None
    return "FAIL" if action in _CONDEMNING_ACTIONS else "WARN"


def xid_info(code: int) -> Dict[str, Any]:
    """Catalog entry for an Xid code: code, name, kind, action, known, and the finding ``level`` (or None)."""
    entry = CATALOG.get(int(code))
    if entry is None:
        info = {"code": int(code), "name": "unknown Xid", "kind": "unknown", "action": "investigate", "known": False}
    else:
        info = dict(entry, known=True)
    info["level"] = _level(info["action"])
    return info


# ---------------------------------------------------------------------------------------------------------------
# Kernel log parsing
# ---------------------------------------------------------------------------------------------------------------
_XID_RE = re.compile(
    r"\bXid \((?:PCI:)?([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\): (\d+)(?:,\s*|$)"
)
_PID_RE = re.compile(r"pid=('?)([^,']*)\1,\s*")
_NAME_RE = re.compile(r"name=([^,]*),\s*")
_GPU_AT_RE = re.compile(r"NVIDIA GPU (?:at )?(?:PCI:)?([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")
_ANY_PCI_RE = re.compile(r"\b([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\b")

LINE_EXCERPT = 300
DEFAULT_MAX_PER_KEY = 20
# How many following records may carry the rest of a split "The NVIDIA GPU ... fallen off the bus" block.
_SPLIT_BLOCK_LINES = 4


def _event(
    kind: str,
    code: Optional[int],
    pci: Optional[str],
    timestamp: Optional[datetime],
    uptime: Optional[float],
    **rest: Any,
) -> Dict[str, Any]:
    event = {"event": kind, "code": code, "pci": pci, "pid": None, "process": None, "detail": ""}
    event.update(timestamp=timestamp, uptime_s=uptime, line="", count=1)
    event.update(rest)
    return event


def _xid_event(
    match: Any, pci: Optional[str], message: str, line: str, *, timestamp: Any, uptime: Any
) -> Dict[str, Any]:
    rest = message[match.end() :]
    pid = process = None
    pid_match = _PID_RE.match(rest)
    if pid_match is not None:
        pid = int(pid_match.group(2)) if pid_match.group(2).isdigit() else None
        rest = rest[pid_match.end() :]
        name_match = _NAME_RE.match(rest)
        if name_match is not None:
            process = None if name_match.group(1) in ("<unknown>", "") else name_match.group(1)
            rest = rest[name_match.end() :]
    return _event(
        "xid",
        int(match.group(2)),
        pci,
        timestamp,
        uptime,
        pid=pid,
        process=process,
        detail=rest.strip()[:LINE_EXCERPT],
        line=line[:LINE_EXCERPT],
    )


class _Collector:
    """Keeps at most ``max_per_key`` events per (event, code, pci); later ones are folded into the last kept one."""

    def __init__(self, max_per_key: int) -> None:
        self.max_per_key = max(1, max_per_key)
        self.events: List[Dict[str, Any]] = []
        self._kept: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
        self._counts: Dict[Tuple[Any, ...], int] = {}
        self._pending: Dict[Tuple[Any, ...], str] = {}  # key -> line of its newest folded event, time not yet read

    def is_full(self, key: Tuple[Any, ...]) -> bool:
        return self._counts.get(key, 0) >= self.max_per_key

    def add(self, event: Dict[str, Any]) -> None:
        key = (event["event"], event["code"], event["pci"])
        if self.is_full(key):
            self.fold(key, event["timestamp"], event["uptime_s"])
            return
        self._counts[key] = self._counts.get(key, 0) + 1
        self.events.append(event)
        self._kept[key] = event

    def fold(self, key: Tuple[Any, ...], timestamp: Optional[datetime], uptime: Optional[float]) -> None:
        last = self._kept[key]
        last["count"] += 1
        last["last_timestamp"] = timestamp
        last["last_uptime_s"] = uptime
        self._pending.pop(key, None)

    def fold_line(self, key: Tuple[Any, ...], line: str) -> None:
        """Fold an event whose time is read from ``line`` only if it stays the newest (``finish``)."""
        self._kept[key]["count"] += 1
        self._pending[key] = line

    def finish(self, year: Optional[int], local_tz: Optional[tzinfo]) -> List[Dict[str, Any]]:
        for key, line in self._pending.items():
            timestamp, uptime, _message = split_record(line, year, local_tz)
            self._kept[key].update(last_timestamp=timestamp, last_uptime_s=uptime)
        self._pending.clear()
        return self.events


def parse_kernel_log(
    lines: Iterable[str],
    max_per_key: int = DEFAULT_MAX_PER_KEY,
    year: Optional[int] = None,
    local_tz: Optional[tzinfo] = None,
) -> List[Dict[str, Any]]:
    """Every Xid and "fallen off the bus" event in a kernel log, in log order, in one linear pass.

    Each event: event ('xid' | 'fallen_off_bus'), code, pci ('DDDD:BB:DD' or None), pid, process, detail,
    timestamp (UTC datetime or None), uptime_s (or None), line (raw, truncated) and count. At most
    ``max_per_key`` events are kept per (event, code, pci); the last kept one counts the rest in ``count``
    and holds the newest one's time in ``last_timestamp`` / ``last_uptime_s``. Local-time stamps (dmesg -T,
    syslog) are read in ``local_tz`` (default: this machine's zone); syslog stamps get ``year`` or a guess.
    A ``LogLines`` (what ``read_kernel_log`` returns) is searched as one text, visiting only the lines that matter.
    """
    if isinstance(lines, LogLines):
        lines = _lines_that_may_matter(lines.text)
    collector = _Collector(max_per_key)
    pci_cache: Dict[str, Optional[str]] = {}  # a flood of Xids repeats the same few addresses
    block: Optional[Dict[str, Any]] = None  # an open "The NVIDIA GPU <pci> ... fallen off the bus" block
    for raw in lines:
        line = raw.rstrip("\r\n")
        block = _count_down(block)
        if block is None and not _may_matter(line):
            continue
        if block is None or line[:1] not in (" ", "\t"):  # a record of its own: its message ends the line
            flood = _XID_RE.search(line)
            if flood is not None:
                key = ("xid", int(flood.group(2)), _cached_pci(pci_cache, flood.group(1)))
                if collector.is_full(key):  # a flood of one key: count it, and split only its newest line
                    collector.fold_line(key, line)
                    continue
        record = _record(line, block, year, local_tz)
        xid = _XID_RE.search(record.message)
        if xid is not None:
            _collect_xid(collector, xid, _cached_pci(pci_cache, xid.group(1)), record, line)
        else:
            block = _follow_bus_block(collector, block, record, line)
    return collector.finish(year, local_tz)


def _count_down(block: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The open block, one line older; None once it has spanned ``_SPLIT_BLOCK_LINES`` more lines."""
    if block is None:
        return None
    block["budget"] -= 1
    return block if block["budget"] >= 0 else None


# "Xid (" rather than "Xid": _XID_RE needs it, and the longer word is found twice as fast in a long text.
_KEYWORDS = ("Xid (", "NVIDIA GPU", "fallen off")


def _may_matter(line: str) -> bool:
    """A cheap test that skips the splitting of nearly every line of a long log."""
    return "Xid (" in line or "NVIDIA GPU" in line or "fallen off" in line


def _lines_that_may_matter(text: str) -> Iterator[str]:
    """The lines of ``text`` (as ``LogLines`` splits it) that ``_may_matter``, found with ``str.find``, and each
    "NVIDIA GPU" line's next ``_SPLIT_BLOCK_LINES`` lines, where its block may go on.

    Every line left out is one the plain loop would skip too, and none falls inside a block that may still be
    open, so the block's line budget runs out exactly as it would over every line.
    """
    hits = [text.find(word) for word in _KEYWORDS]
    start = 0  # where the first line not yet visited begins
    while True:
        found = [hit for hit in hits if hit >= 0]
        if not found:
            return
        hit = min(found)
        newline = text.rfind("\n", start, hit)
        start = start if newline < 0 else newline + 1
        follow = 1  # lines still to visit: the hit's own, then a block's
        while follow and start < len(text):
            end = text.find("\n", start)
            end = len(text) if end < 0 else end
            line = text[start:end].rstrip("\r")
            start = end + 1
            if line.strip():
                yield line
                follow = _SPLIT_BLOCK_LINES if "NVIDIA GPU" in line else follow - 1
        hits = [hit if hit < 0 or hit >= start else text.find(word, start) for hit, word in zip(hits, _KEYWORDS)]


class _Record(NamedTuple):
    timestamp: Optional[datetime]
    uptime: Optional[float]
    message: str


def _record(line: str, block: Optional[Dict[str, Any]], year: Optional[int], local_tz: Optional[tzinfo]) -> _Record:
    """One record of the log; an indented line continues the open block and carries its time."""
    if block is not None and line[:1] in (" ", "\t"):
        return _Record(block["timestamp"], block["uptime_s"], line.strip())
    return _Record(*split_record(line, year, local_tz))


def _cached_pci(cache: Dict[str, Optional[str]], raw_pci: str) -> Optional[str]:
    if raw_pci not in cache:
        cache[raw_pci] = kernel_pci(raw_pci)
    return cache[raw_pci]


def _collect_xid(collector: _Collector, xid: Any, pci: Optional[str], record: _Record, line: str) -> None:
    key = ("xid", int(xid.group(2)), pci)
    if collector.is_full(key):  # a flood: count it without building the event
        collector.fold(key, record.timestamp, record.uptime)
    else:
        collector.add(_xid_event(xid, pci, record.message, line, timestamp=record.timestamp, uptime=record.uptime))


def _follow_bus_block(
    collector: _Collector, block: Optional[Dict[str, Any]], record: _Record, line: str
) -> Optional[Dict[str, Any]]:
    """Open, extend or close a "fallen off the bus" block with this record; returns the block still open."""
    timestamp, uptime, message = record
    gpu_at = _GPU_AT_RE.search(message) if "NVIDIA GPU" in message else None
    if gpu_at is not None:
        block = {"pci": kernel_pci(gpu_at.group(1)), "timestamp": timestamp, "uptime_s": uptime}
        block.update(budget=_SPLIT_BLOCK_LINES, parts=[message.strip()], line=line)
    elif block is not None and message.strip():
        block["parts"].append(_strip_nvrm(message))
    if "fallen off the bus" not in message:
        return block
    if block is None:  # the whole report in this one record
        block = {"pci": None, "timestamp": timestamp, "uptime_s": uptime, "parts": [message.strip()], "line": line}
    collector.add(_fallen_off_bus_event(block, message))
    return None


def _fallen_off_bus_event(block: Dict[str, Any], message: str) -> Dict[str, Any]:
    pci = block["pci"]
    if pci is None:
        own = _ANY_PCI_RE.search(message)
        pci = kernel_pci(own.group(1)) if own is not None else None
    parts = block["parts"]
    excerpt = (block["line"].rstrip() + " " + " ".join(parts[1:])).strip()
    detail = " ".join(parts)[:LINE_EXCERPT]
    return _event(
        "fallen_off_bus", None, pci, block["timestamp"], block["uptime_s"], detail=detail, line=excerpt[:LINE_EXCERPT]
    )


def _strip_nvrm(message: str) -> str:
    text = message.strip()
    return text[len("NVRM:") :].strip() if text.startswith("NVRM:") else text


def summarize_events(events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Group events by (event, code, pci): count, first/last timestamp and uptime, first line; in first-seen order."""
    groups: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for event in events:
        key = (event["event"], event["code"], event["pci"])
        group = groups.get(key)
        last_ts = event.get("last_timestamp", event["timestamp"])
        last_up = event.get("last_uptime_s", event["uptime_s"])
        if group is None:
            groups[key] = {
                "event": event["event"],
                "code": event["code"],
                "pci": event["pci"],
                "count": event.get("count", 1),
                "first_timestamp": event["timestamp"],
                "last_timestamp": last_ts,
                "first_uptime_s": event["uptime_s"],
                "last_uptime_s": last_up,
                "first_line": event["line"],
            }
            continue
        group["count"] += event.get("count", 1)
        group["first_timestamp"] = pick(min, group["first_timestamp"], event["timestamp"])
        group["last_timestamp"] = pick(max, group["last_timestamp"], last_ts)
        group["first_uptime_s"] = pick(min, group["first_uptime_s"], event["uptime_s"])
        group["last_uptime_s"] = pick(max, group["last_uptime_s"], last_up)
    return list(groups.values())


def pick(choose: Any, current: Any, candidate: Any) -> Any:
    if current is None:
        return candidate
    if candidate is None:
        return current
    return choose(current, candidate)
