# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Teardown holding the box (``_box_state``'s lease) across its box calls: the gate takes it, each later call of the
same teardown refreshes it, the end gives it back.

While a teardown pulls and load-verifies, the box must not stop under it: the autostop watcher waits while a lease
is active. The lock is on the box, not on the controller, so a watcher, or a second controller's teardown, sees it.
A lease expires by itself (``ttl_s`` after its last refresh): a controller that died mid-teardown never pins the
box. Pure standard library.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.instance import _box_state as box_state

HOLDER = "teardown"
TOKEN = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
HOLDER_NAME = re.compile(r"\A[a-z][a-z0-9_-]{0,31}\Z")
MAX_TTL_S = box_state.MAX_LEASE_S


def checked(token: Any, ttl_s: Any, option: str) -> Tuple[str, float]:
    """The token and ttl of ``option``; ValueError naming it."""
    if not isinstance(token, str) or not TOKEN.match(token):
        raise ValueError(f"{option}.token must match {TOKEN.pattern} (letters, digits, _ . : -), not {token!r}")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 1 <= ttl_s <= MAX_TTL_S:
        raise ValueError(f"{option}.ttl_s must be a number of seconds from 1 to {MAX_TTL_S:g}, not {ttl_s!r}")
    return token, float(ttl_s)


def public(lease: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """What a result tells of a lease: holder, token, since, until (ISO 8601 UTC), and ``problem`` for an unreadable
    lease file."""
    if lease is None:
        return None
    told = {key: lease.get(key) for key in ("holder", "token", "since", "until")}
    return dict(told, problem=lease["problem"]) if lease.get("problem") else told


def current() -> Optional[Dict[str, Any]]:
    """The lease holding the box now (an unreadable lease file holds it too, with its ``problem``), or None."""
    return public(box_state.active_lease())


def held_by(lease: Mapping[str, Any]) -> str:
    """The refusal when another holds the box."""
    holder = str(lease.get("holder") or "unknown")[:32]
    why = f" (its lease file is unreadable: {str(lease['problem'])[:200]})" if lease.get("problem") else ""
    return (
        f"the box is held by {holder} since {lease.get('since')} until {lease.get('until')}{why}: another stage is "
        "under way (a teardown from another controller, or the autostop watcher stopping the box); wait for it to "
        "end, or for its lease to expire"
    )


def hold(
    token: str, ttl_s: float, holder: str = HOLDER
) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]], Optional[str]]:
    """Take (or refresh) the box for ``token`` for ``ttl_s`` seconds from now: ``(lease, None, None)``; ``(None,
    other, None)`` when another holds it; ``(None, None, note)`` when the instance dir cannot be written (a read-only
    home: nothing can hold the box there, ``RGT_INSTANCE_DIR`` moves it)."""
    try:
        other = box_state.take_lease(holder, token, ttl_s)
    except (OSError, TimeoutError) as exc:
        return None, None, f"the box lease could not be taken, so a watcher may stop the box meanwhile: {exc}"
    if other is not None:
        return None, public(other), None
    return public(box_state.active_lease()), None, None


def release(token: str) -> Tuple[bool, Optional[str]]:
    """Give the box back when ``token`` holds it: (released, problem)."""
    try:
        return box_state.release_lease(token), None
    except (OSError, TimeoutError) as exc:
        return False, f"the box lease could not be given back (it expires by itself): {exc}"
