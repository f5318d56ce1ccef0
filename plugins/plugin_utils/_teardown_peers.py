# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What one box's teardown learns from the other hosts of its play: an instance id two hosts share.

One instance is one box: two inventory hosts whose ``instance_id`` is the same (as rendered for each) would stop the
same meter for two boxes, and one of them bills on unseen. The controller cannot tell which host is right, so each
is refused, naming the other, before either box is touched.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

SHOWN_HOSTS = 5


def _variable(variables: Any, names: List[str]) -> str:
    """The first of ``names`` the host has, rendered (``hostvars`` templates on access), as one stripped string;
    "" when it has none or it does not render (that host's own teardown says why)."""
    for name in names:
        try:
            if name in variables:
                value = variables[name]
                return str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
        except Exception:  # an undefined variable or a template error of another host is not this host's problem
            return ""
    return ""


def shared_instance_id(task_vars: Mapping[str, Any], host: str, instance_id: str, platform: str) -> Optional[str]:
    """Why this host is refused when another host of the play (``ansible_play_hosts_all``) has its ``instance_id``
    on the same platform (a host with no platform set matches any), or None."""
    if not instance_id:
        return None
    hostvars = task_vars.get("hostvars") or {}
    others = []
    for other in task_vars.get("ansible_play_hosts_all") or []:
        if other == host or other not in hostvars:
            continue
        variables = hostvars[other]
        if _variable(variables, ["teardown_instance_id", "instance_id"]) != instance_id:
            continue
        theirs = _variable(variables, ["teardown_platform", "platform"])
        if not platform or not theirs or theirs == platform:
            others.append(str(other))
    if not others:
        return None
    named = ", ".join(others[:SHOWN_HOSTS]) + (
        f" (+{len(others) - SHOWN_HOSTS} more)" if len(others) > SHOWN_HOSTS else ""
    )
    return (
        f"instance_id {instance_id} is also the instance_id of {named} in this play: one instance is one box, so the "
        "meter-stop would end the wrong box's billing or none; set each host's own provider id (nothing was touched)"
    )
