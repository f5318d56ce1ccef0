# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Launch filters for the verdicts: the preflight gate, one host's launch record, its line and the fleet summary.

Documented per filter in the YAML files next to this one (``ansible-doc -t filter remote_gpu.trainer.<name>``).
A record holds what ``training_run`` returned (never its inputs: the secrets and the environment stay out of it).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ansible_collections.remote_gpu.trainer.plugins.filter.fleet import (
    UNREACHABLE,
    fleet_results,
    summary_exit_code,
    tally_statuses,
    with_report_error,
)

# What a host's launch came to, in the order the summary counts them.
LAUNCHED = ("STARTED", "RESUMED", "RUNNING", "DONE", "WOULD_START", "WOULD_RESUME")
NOT_LAUNCHED = ("IDLE", "REFUSED", "FAILED", UNREACHABLE)
STATUSES = LAUNCHED + NOT_LAUNCHED
CELL_STATES = ("succeeded", "failed", "running", "pending")
MESSAGE_CHARS = 300
SHOWN_CODES = 3


def _line(text: Any) -> str:
    """One bounded line: module messages and task errors can span lines."""
    line = " ".join(str(text or "").split())
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."


def _report_age_s(report: Mapping[str, Any], now: float) -> Optional[float]:
    try:
        generated = datetime.strptime(str(report.get("generated_at")), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return now - generated.replace(tzinfo=timezone.utc).timestamp()


def _report_entry(report: Any, host: str) -> Optional[Mapping[str, Any]]:
    hosts = report.get("hosts") if isinstance(report, Mapping) else None
    for entry in hosts if isinstance(hosts, list) else []:
        if isinstance(entry, Mapping) and entry.get("host") == host:
            return entry
    return None


def _fail_codes(result: Mapping[str, Any]) -> str:
    findings = [f for f in result.get("findings") or [] if isinstance(f, Mapping) and f.get("level") == "FAIL"]
    shown = [f"{f.get('code')} -> {f.get('action')}" for f in findings[:SHOWN_CODES]]
    return "; ".join(shown) or "no FAIL finding recorded"


def launch_preflight_gate(
    host: str,
    *,
    play_result: Optional[Mapping[str, Any]] = None,
    report: Optional[Mapping[str, Any]] = None,
    max_age_s: float = 3600,
    skip: bool = False,
    require: bool = False,
    report_file: str = "",
    now: Optional[float] = None,
) -> Dict[str, Any]:
    """Whether launch may start on ``host``: ``{allowed, status, source, age_s, reason}``.

    The preflight of the same play (``play_result``, the host's ``preflight_result``) decides; else the host's
    entry in ``report`` (the newest preflight report) when it is at most ``max_age_s`` old. A FAIL refuses the box;
    no preflight refuses it only with ``require``. ``skip`` allows every box.
    """
    gate: Dict[str, Any] = {"allowed": True, "status": None, "source": None, "age_s": None, "reason": ""}
    if skip:
        return dict(gate, source="skipped", reason="preflight skipped (launch_skip_preflight)")
    now = time.time() if now is None else float(now)
    result: Optional[Mapping[str, Any]] = None
    if isinstance(play_result, Mapping) and play_result.get("status"):
        result, gate["source"], gate["age_s"] = play_result, "this play", 0.0
    elif isinstance(report, Mapping):
        age = _report_age_s(report, now)
        entry = _report_entry(report, host)
        if age is not None and age <= float(max_age_s) and entry is not None:
            result, gate["source"], gate["age_s"] = entry, report_file or "report", round(max(age, 0.0), 1)
        elif age is not None and entry is not None:
            gate["reason"] = f"the newest preflight report is {int(age)} s old (launch_preflight_max_age_s {max_age_s})"
    if result is not None:
        gate["status"] = result.get("status")
        if gate["status"] == "FAIL":
            return dict(gate, allowed=False, reason=f"preflight FAIL ({gate['source']}): {_fail_codes(result)}")
        return dict(gate, reason=f"preflight {gate['status']} ({gate['source']})")
    if require:
        why = gate["reason"] or f"no preflight of {host} in this play or a report younger than {max_age_s} s"
        return dict(gate, allowed=False, reason=f"{why}, and launch_require_preflight is set")
    return dict(gate, reason=gate["reason"] or "no recent preflight")


def _cell_counts(cells: Iterable[Mapping[str, Any]]) -> Dict[str, int]:
    counts = dict.fromkeys((*CELL_STATES, "done", "sync_failed"), 0)
    for cell in cells:
        status = cell.get("status")
        if status in counts:
            counts[status] += 1
        counts["done"] += 1 if cell.get("done") else 0
        counts["sync_failed"] += 1 if cell.get("sync") == "failed" else 0
    return counts


def _status(module: Mapping[str, Any], check_mode: bool) -> str:
    if module.get("changed"):
        if check_mode:
            return "WOULD_RESUME" if module.get("resumed") else "WOULD_START"
        return "RESUMED" if module.get("resumed") else "STARTED"
    return "DONE" if module.get("state") == "done" else "RUNNING"


def launch_result(
    host: str,
    run: str,
    module: Optional[Mapping[str, Any]],
    *,
    gate: Mapping[str, Any],
    shard: Optional[Mapping[str, Any]] = None,
    code: Optional[Mapping[str, Any]] = None,
    check_mode: bool = False,
    error: str = "",
) -> Dict[str, Any]:
    """One host's launch record: the gate, the shard, the code sync and what training_run returned."""
    shard = shard or {}
    record: Dict[str, Any] = {
        "host": host,
        "reachable": True,
        "run": run,
        "check_mode": bool(check_mode),
        "preflight": dict(gate),
        "shard": None,
        "code": dict(code) if code else None,
        "msg": "",
    }
    if int(shard.get("count") or 1) > 1:
        names = [cell.get("name") for cell in shard.get("cells") or []]
        record["shard"] = {"index": shard.get("index"), "count": shard.get("count"), "cells": names}
    module = module if isinstance(module, Mapping) and not module.get("skipped") else None
    if not gate.get("allowed", True):
        return dict(record, status="REFUSED", msg=_line(gate.get("reason")))
    if error:
        return dict(record, status="FAILED", msg=_line(error))
    if not shard.get("cells", True):
        return dict(record, status="IDLE", msg=f"no cells in shard {shard.get('index', 0) + 1}/{shard.get('count')}")
    if module is None:
        return dict(record, status="FAILED", msg="training_run did not run")
    if module.get("failed"):
        reason = module.get("msg") or module.get("module_stderr") or "training_run failed"
        return dict(record, status="FAILED", msg=_line(reason))
    cells = [cell for cell in module.get("cells") or [] if isinstance(cell, Mapping)]
    keys = ("state", "changed", "resumed", "run_dir", "detach", "attach", "pgid", "sid", "skipped_cells")
    record.update({key: module.get(key) for key in keys})
    record.update(status=_status(module, check_mode), msg=_line(module.get("msg")), cells=cells)
    record["counts"] = _cell_counts(cells)
    return record


def launch_results(hostnames: Iterable[str], hostvars: Mapping[str, Any], key: str = "launch_result") -> List[Any]:
    """Every targeted host's record; a host without one never answered or stopped before launch (see its error)."""
    return fleet_results(hostnames, hostvars, key, reason="unreachable, or stopped before launch (see its task error)")


def _cells_part(record: Mapping[str, Any]) -> str:
    counts = record.get("counts") or {}
    cells = record.get("cells") or []
    shown = [f"{counts[state]} {state}" for state in CELL_STATES if counts.get(state)]
    if counts.get("sync_failed"):
        shown.append(f"{counts['sync_failed']} sync failed")
    return f"{len(cells)} cells" + (f" ({', '.join(shown)})" if shown else "")


def _code_part(code: Mapping[str, Any], check_mode: bool) -> str:
    if not code.get("synced"):
        return f"code ({code['source']}): {code.get('note') or 'not synced'}"
    if code["source"] == "git":
        verb = "would check out" if check_mode else ("checked out" if code.get("changed") else "at")
        return f"code (git): {verb} {str(code.get('version') or '?')[:12]}"
    files = len(code.get("files") or [])
    verb = "would send" if check_mode else "sent"
    return f"code (rsync): {files} files {verb}" if files or code.get("changed") else "code (rsync): up to date"


def launch_line(record: Mapping[str, Any]) -> str:
    """One line: host, status, run, its cells and how to reach it, or why nothing was started."""
    host, status = record.get("host", "?"), record.get("status", "?")
    if status == UNREACHABLE or not record.get("reachable", True):
        return f"{host}  {UNREACHABLE}  {record.get('error') or 'host unreachable'}"
    parts = []
    if record.get("shard"):
        parts.append(f"shard {record['shard']['index'] + 1}/{record['shard']['count']}")
    if status in NOT_LAUNCHED:
        return f"{host}  {status}  {record.get('run')}: " + "; ".join([*parts, str(record.get("msg") or "")])
    parts.insert(0, _cells_part(record))
    if record.get("detach"):
        parts.append(f"{record['detach']} pgid {record.get('pgid')}" if record.get("pgid") else record["detach"])
    if record.get("attach"):
        parts.append(f"attach: {record['attach']}")
    if (record.get("code") or {}).get("source"):
        parts.append(_code_part(record["code"], bool(record.get("check_mode"))))
    return f"{host}  {status}  {record.get('run')}: " + "; ".join(parts)


def launch_summary(
    records: Iterable[Mapping[str, Any]], cells: Optional[List[str]] = None, *, report_error: str = ""
) -> Dict[str, Any]:
    """Counts per status, the hosts that launched nothing, the cells of a sharded sweep left unlaunched, the exit code.

    Exit code: 2 when a host was refused or failed, else 4 when one is unreachable, else 0; 3 when ``report_error``
    says the report could not be written.
    """
    records = list(records)
    counts, by_status = tally_statuses(records, STATUSES, "launch_summary")
    launched_cells, sharded = set(), False
    for record in records:
        shard = record.get("shard")
        sharded = sharded or bool(shard)
        if shard and record.get("reachable", True) and record.get("status") in LAUNCHED:
            launched_cells.update(shard.get("cells") or [])
    unlaunched = [name for name in cells or [] if name not in launched_cells] if sharded else []
    exit_code = summary_exit_code(counts, ("REFUSED", "FAILED"), report_error)
    line = f"{len(records)} hosts: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    for status in ("REFUSED", "FAILED", UNREACHABLE):
        if by_status[status]:
            line += f"; {status.lower()}: {', '.join(by_status[status])}"
    if unlaunched:
        line += f"; cells not launched: {', '.join(unlaunched)}"
    summary = {
        "hosts": len(records),
        "counts": {status: count for status, count in counts.items() if count},
        "refused": by_status["REFUSED"],
        "failed": by_status["FAILED"],
        "unreachable": by_status[UNREACHABLE],
        "cells_not_launched": unlaunched,
        "exit_code": exit_code,
        "line": line if records else "0 hosts",
    }
    return with_report_error(summary, report_error)


class FilterModule:
    """Launch filters for the preflight gate and the launch report."""

    def filters(self) -> Dict[str, Any]:
        return {
            "launch_preflight_gate": launch_preflight_gate,
            "launch_result": launch_result,
            "launch_results": launch_results,
            "launch_line": launch_line,
            "launch_summary": launch_summary,
        }
