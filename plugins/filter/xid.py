# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filter ``xid_info``: classify an NVIDIA Xid code (documentation in xid_info.yml)."""

from __future__ import annotations

from typing import Any, Callable, Dict

from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid import xid_info as _catalog_lookup


def xid_info(code: Any) -> Dict[str, Any]:
    """Catalog entry for an Xid given as an int or a decimal string (``"79"``, ``" 79 "``)."""
    if isinstance(code, bool):
        raise AnsibleFilterError(f"xid_info expects an Xid code (integer), got {code!r}")
    try:
        number = int(str(code).strip()) if isinstance(code, str) else int(code)
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"xid_info expects an Xid code (integer), got {code!r}") from exc
    if number < 0:
        raise AnsibleFilterError(f"xid_info expects a non-negative Xid code, got {number}")
    return _catalog_lookup(number)


class FilterModule:
    def filters(self) -> Dict[str, Callable[..., Any]]:
        return {"xid_info": xid_info}
