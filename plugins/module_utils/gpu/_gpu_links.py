# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpu_health's link checks (PCIe width, NVLink), on the data model ``_gpu_checks`` describes.

NVLink, as the driver reports it: a card without NVLink hardware has no links (NVML NOT_SUPPORTED;
``nvidia-smi nvlink -s`` prints nothing or "Device does not have or support Nvlink"); a card with
NVLink but no bridge or peer (PCIe cards, single-GPU boxes) reports every link inactive (nvidia-smi:
"Unable to retrieve NVLink information as all links are inActive"). Neither is a fault by itself, so
only a link down among active ones is ``nvlink_down``, or fewer active links than ``expected_nvlinks``
(the way to require an NVLink box, and to catch an SXM board whose links all failed).
"""

from __future__ import annotations

from typing import Any, Dict, List

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import finding


def link_findings(gpu: Dict[str, Any], limits: Dict[str, Any]) -> List[Dict[str, Any]]:
    """pcie_degraded and nvlink_down for one GPU of the data model."""
    return _pcie_findings(gpu) + _nvlink_findings(gpu, limits.get("expected_nvlinks"))


def _pcie_findings(gpu: Dict[str, Any]) -> List[Dict[str, Any]]:
    pcie = gpu.get("pcie") or {}
    width, width_max = pcie.get("width"), pcie.get("width_max")
    # Generation drops at idle to save power; a narrower link is a seating or riser fault.
    if not (width and width_max and width < width_max):
        return []
    return [
        finding(
            "pcie_degraded",
            "WARN",
            f"GPU {gpu['index']} PCIe link x{width} below its maximum x{width_max}",
            "investigate",
            gpu=gpu["index"],
            width=width,
            width_max=width_max,
        )
    ]


def _nvlink_findings(gpu: Dict[str, Any], expected: Any) -> List[Dict[str, Any]]:
    index, reported = gpu["index"], gpu.get("nvlinks") or []
    active = sum(1 for link in reported if link.get("active"))
    # With no active link the inactive ones say nothing (no bridge); nvidia-smi does not even list them.
    down = [link["link"] for link in reported if not link.get("active")] if active else []
    short = expected is not None and active < expected
    if not down and not short:
        return []
    parts = [f"NVLink(s) {', '.join(map(str, down))} down while {active} are active"] if down else []
    if short:
        parts.append(f"{active} of {expected} expected NVLinks active")
    return [
        finding(
            "nvlink_down",
            "FAIL",
            f"GPU {index}: " + "; ".join(parts),
            "re_rent",
            gpu=index,
            links=down,
            active=active,
            expected=expected,
        )
    ]
