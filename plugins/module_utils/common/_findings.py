# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Findings: the shared result shape of every check (see docs/contracts: findings)."""

from __future__ import annotations

from typing import Any, Iterable, Optional

LEVELS = ("PASS", "WARN", "FAIL")
ACTIONS = ("re_rent", "reset_gpu", "reap_zombies", "free_disk", "restart_job", "investigate", "none")

_RANK = {level: rank for rank, level in enumerate(LEVELS)}


def finding(
    code: str,
    level: str,
    message: str,
    action: str,
    gpu: Optional[int] = None,
    **measured: Any,
) -> dict[str, Any]:
    """Build one finding; extra keyword arguments are the measured values behind it."""
    if level not in ("WARN", "FAIL"):
        raise ValueError(f"finding level must be WARN or FAIL, not {level!r}")
    if action not in ACTIONS:
        raise ValueError(f"finding action must be one of {', '.join(ACTIONS)}, not {action!r}")
    result: dict[str, Any] = {"code": code, "level": level, "gpu": gpu, "message": message, "action": action}
    result.update(measured)
    return result


def worst_status(levels: Iterable[str]) -> str:
    """The worst of PASS / WARN / FAIL among ``levels`` (PASS when empty); anything else raises ``ValueError``.

    These three are the only levels. vram_zombies' ``status`` (clean, candidates, reaped, partial) is an outcome,
    not a level: its level is that of its findings (``status_of``), a vram_zombies WARN while zombies remain.
    """
    worst = "PASS"
    for level in levels:
        if level not in _RANK:
            raise ValueError(f"unknown status {level!r}: expected one of {', '.join(LEVELS)}")
        if _RANK[level] > _RANK[worst]:
            worst = level
    return worst


def status_of(findings: Iterable[dict[str, Any]]) -> str:
    """A module's overall status: the worst level among its findings."""
    return worst_status(f["level"] for f in findings)
