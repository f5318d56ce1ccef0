# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPUs as one patrol tick sees them: utilization and memory now, and the GPUs the driver calls lost.

NVML when pynvml can be imported and the driver answers, else one ``nvidia-smi`` query (with the PCI bus ids the
kernel log's Xids are matched by). Runs in a probe child of ``_patrol`` under its deadline. The module runs under the
box's base Python (the runtime venv lives under the data dir, which may hang), so it is only here, in the child,
that the venv's site-packages join ``sys.path`` for pynvml, and the monitor's readers are imported: a hung data dir
costs this probe, never the tick, and the module's own import stays light.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._patrol_decide import finite

NVML_GPU_IS_LOST = 15
SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=index,utilization.gpu,memory.used,memory.total,pci.bus_id",
    "--format=csv,noheader,nounits",
)


def _smi_gpus(text: str) -> List[Dict[str, Any]]:
    """The query's lines: the monitor's four columns, then the PCI bus id (for the kernel log's Xids)."""
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import parse_gpu_csv  # noqa: PLC0415

    rows = [line.rsplit(",", 1) for line in text.splitlines() if line.count(",") == 4]
    gpus = parse_gpu_csv("\n".join(row[0] for row in rows))
    bus_ids = {int(row[0].split(",")[0]): row[1].strip() for row in rows if row[0].split(",")[0].strip().isdigit()}
    return [_gpu(gpu, bus_ids.get(gpu["index"]) or None) for gpu in gpus]


def _gpu(reading: Dict[str, Any], bus_id: Optional[str]) -> Dict[str, Any]:
    return {
        "index": reading["index"],
        "utilization_pct": finite(reading["util_pct"]),
        "memory_used_mib": finite(reading["memory_used_mib"]),
        "memory_total_mib": finite(reading["memory_total_mib"]),
        "pci_bus_id": bus_id,
    }


def _nvml_bus_id(nvml: Any, index: int) -> Optional[str]:
    try:
        bus = nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(index)).busId
    except nvml.NVMLError:
        return None  # a lost GPU answers nothing
    return bus.decode() if isinstance(bus, bytes) else str(bus)


def _nvml_lost(nvml: Any, index: int) -> bool:
    """Whether NVML answers GPU_IS_LOST for this GPU (asked only of a GPU whose reading failed)."""
    try:
        nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByIndex(index))
    except nvml.NVMLError as exc:
        return getattr(exc, "value", None) == NVML_GPU_IS_LOST
    return False


def add_venv(venv: Optional[str]) -> List[str]:
    """Put the venv's site-packages on ``sys.path`` (after the base Python's own), so pynvml installed there is
    found; the directories added. Touches the venv: call it only in a probe child."""
    if not venv:
        return []
    found = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages")))
    added = [path for path in found if os.path.isdir(path) and path not in sys.path]
    sys.path.extend(added)
    return added


def _open_nvml() -> Tuple[bool, Any]:
    """(pynvml could be imported, pynvml initialised or None): imported here, after :func:`add_venv`."""
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        return False, None
    try:
        pynvml.nvmlInit()
    except Exception:  # no libnvidia-ml, no driver: the nvidia-smi query stands in
        return True, None
    return True, pynvml


def read_gpus(backend: str, timeout_s: float, venv: Optional[str] = None) -> Dict[str, Any]:
    """Per-GPU utilization and memory now: NVML when ``backend`` allows and pynvml answers (from the base Python or
    the runtime ``venv``), else nvidia-smi.

    ``lost`` lists the GPUs the driver calls lost ({gpu, pci}): NVML's GPU_IS_LOST, or nvidia-smi's "Unable to
    determine the device handle" (which names the bus id only, and may exit non-zero with the other GPUs' rows).
    """
    if backend in ("auto", "nvml"):
        add_venv(venv)
        from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import nvml_gpus  # noqa: PLC0415

        imported, nvml = _open_nvml()
        if nvml is not None:
            gpus = [_gpu(gpu, _nvml_bus_id(nvml, gpu["index"])) for gpu in nvml_gpus(nvml)]
            lost = [
                {"gpu": g["index"], "pci": g["pci_bus_id"]}
                for g in gpus
                if g["utilization_pct"] is None and _nvml_lost(nvml, g["index"])
            ]
            return {"backend": "nvml", "gpus": gpus, "lost": lost, "error": None}
        if backend == "nvml":
            if not imported:
                error = f"gpu_backend nvml needs nvidia-ml-py (pynvml): neither the base Python nor {venv} has it"
            else:
                error = "NVML did not initialise (no driver or no libnvidia-ml)"
            return {"backend": "nvml", "gpus": [], "lost": [], "error": error}
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._smi_parse import lost_bus_ids  # noqa: PLC0415
    from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._monitor import bounded_output  # noqa: PLC0415

    rc, out = bounded_output(SMI_QUERY, timeout_s)
    gpus, lost = _smi_gpus(out), [{"gpu": None, "pci": bus} for bus in lost_bus_ids(out)]
    error = None
    if rc is None:
        error = f"nvidia-smi did not answer within {timeout_s:g} s"
    elif rc != 0 and not gpus and not lost:
        error = "nvidia-smi " + ("not found" if rc == 127 else f"exited {rc}")
    return {"backend": "nvidia-smi", "gpus": gpus, "lost": lost, "error": error}


def lost_findings(lost: Sequence[Dict[str, Any]], backend: Optional[str]) -> List[Dict[str, Any]]:
    """A FAIL gpu_lost per GPU the driver calls lost now (the kernel log may say it too, or be unreadable)."""
    found = []
    for gpu in lost:
        where = f"GPU {gpu['gpu']}" if gpu["gpu"] is not None else f"the GPU at {gpu['pci']}"
        found.append(
            {
                "code": "gpu_lost",
                "level": "FAIL",
                "gpu": gpu["gpu"],
                "pci": gpu["pci"],
                "message": f"{where} is lost ({backend} says so now): the run cannot use it; re-rent the box",
                "action": "re_rent",
            }
        )
    return found
