"""The ``nvidia-smi --query-gpu`` field table of the fake nvidia-smi.

Each field has the unit its CSV header shows (``memory.used [MiB]``) and, when the scenario models it, a
function that gives the value. Fields the scenario does not model print what the real tool prints for a
value it cannot read (``[N/A]``, or ``N/A`` for the few fields that print it bare).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from scenario import pci_ids

NA = "[N/A]"
EXIT_GPU_LOST = 15  # nvidia-smi's exit status when a GPU has fallen off the bus
BARE_NA = "N/A"

# Clocks event reasons: NVML bit, --query-gpu suffix, -q label (and the -q indentation level).
EVENT_REASONS: List[Tuple[int, str, str]] = [
    (0x1, "gpu_idle", "Idle"),
    (0x2, "applications_clocks_setting", "Applications Clocks Setting"),
    (0x4, "sw_power_cap", "SW Power Cap"),
    (0x8, "hw_slowdown", "HW Slowdown"),
    (0x40, "hw_thermal_slowdown", "HW Thermal Slowdown"),
    (0x80, "hw_power_brake_slowdown", "HW Power Brake Slowdown"),
    (0x10, "sync_boost", "Sync Boost"),
    (0x20, "sw_thermal_slowdown", "SW Thermal Slowdown"),
    (0x100, "display_clock_setting", "Display Clock Setting"),
]
SUPPORTED_REASONS = 0x1FF


class Row(NamedTuple):
    """What one CSV row is computed from."""

    scenario: Dict[str, Any]
    gpu: Dict[str, Any]
    index: int
    timestamp: str


Getter = Callable[[Row], Optional[str]]  # None: the value is not available on this GPU


def lost_message(gpu: Dict[str, Any]) -> str:
    bus = gpu["pci_bus_id"]
    short_bus = bus[4:] if len(bus) == 16 else bus  # the real message shows the 4-digit domain
    return f"Unable to determine the device handle for GPU{short_bus}: Unknown Error"


def _yes_no(flag: bool) -> str:
    return "Yes" if flag else "No"


def _enabled(flag: bool) -> str:
    return "Enabled" if flag else "Disabled"


def _feature(key: str, pick: Callable[[Dict[str, Any]], Any]) -> Getter:
    """A value read from a feature mapping that may be ``not_supported``."""

    def getter(row: Row) -> Optional[str]:
        value = row.gpu[key]
        return None if value == "not_supported" else str(pick(value))

    return getter


def _bus_part(position: int, width: int) -> Getter:
    def getter(row: Row) -> Optional[str]:
        domain, bus, rest = row.gpu["pci_bus_id"].split(":")
        parts = [int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)]
        return f"0x{parts[position]:0{width}X}"

    return getter


def _pci_id(position: int) -> Getter:
    def getter(row: Row) -> Optional[str]:
        value = pci_ids(row.gpu["name"])[position]
        return f"0x{value:08X}" if value else None

    return getter


def _reason(bit: int) -> Getter:
    return lambda row: "Active" if row.gpu["clocks_event_reasons"] & bit else "Not Active"


def _ecc_count(kind: str, counter: str) -> Getter:
    return _feature("ecc", lambda ecc: ecc[counter][kind])


def _ecc_zero() -> Getter:
    return _feature("ecc", lambda ecc: 0)


def mig_on(gpu: Dict[str, Any]) -> bool:
    return gpu["mig_mode"] != "not_supported" and gpu["mig_mode"]["current"]


def _utilization(row: Row, key: str) -> Optional[str]:
    """Whole-GPU utilization is not available while MIG is on (only per instance)."""
    return None if mig_on(row.gpu) else str(row.gpu["utilization_pct"][key])


def _watts(value: float) -> str:
    return f"{value:.2f}"


_MODELLED: Dict[str, Getter] = {
    "timestamp": lambda row: row.timestamp,
    "driver_version": lambda row: row.scenario["driver"]["version"],
    "count": lambda row: str(len(row.scenario["gpus"])),
    "name": lambda row: row.gpu["name"],
    "uuid": lambda row: row.gpu["uuid"],
    "pci.bus_id": lambda row: row.gpu["pci_bus_id"],
    "pci.domain": _bus_part(0, 4),
    "pci.bus": _bus_part(1, 2),
    "pci.device": _bus_part(2, 2),
    "pci.device_id": _pci_id(0),
    "pci.sub_device_id": _pci_id(1),
    "pcie.link.gen.current": lambda row: str(row.gpu["pcie"]["gen"]),
    "pcie.link.gen.gpucurrent": lambda row: str(row.gpu["pcie"]["gen"]),
    "pcie.link.gen.max": lambda row: str(row.gpu["pcie"]["gen_max"]),
    "pcie.link.gen.gpumax": lambda row: str(row.gpu["pcie"]["gen_max"]),
    "pcie.link.width.current": lambda row: str(row.gpu["pcie"]["width"]),
    "pcie.link.width.max": lambda row: str(row.gpu["pcie"]["width_max"]),
    "index": lambda row: str(row.index),
    "persistence_mode": lambda row: _enabled(row.gpu["persistence_mode"]),
    "pstate": lambda row: "P0",
    "clocks_event_reasons.supported": lambda row: f"0x{SUPPORTED_REASONS:016X}",
    "clocks_event_reasons.active": lambda row: f"0x{row.gpu['clocks_event_reasons']:016X}",
    "memory.total": lambda row: str(row.gpu["memory_mib"]["total"]),
    "memory.reserved": lambda row: "0",
    "memory.used": lambda row: str(row.gpu["memory_mib"]["used"]),
    "memory.free": lambda row: str(max(0, row.gpu["memory_mib"]["total"] - row.gpu["memory_mib"]["used"])),
    "compute_mode": lambda row: "Default",
    "utilization.gpu": lambda row: _utilization(row, "gpu"),
    "utilization.memory": lambda row: _utilization(row, "memory"),
    "ecc.mode.current": _feature("ecc", lambda ecc: _enabled(ecc["enabled"])),
    "ecc.mode.pending": _feature("ecc", lambda ecc: _enabled(ecc["enabled"])),
    "retired_pages.single_bit_ecc.count": _feature("retired_pages", lambda pages: pages["single_bit"]),
    "retired_pages.double_bit.count": _feature("retired_pages", lambda pages: pages["double_bit"]),
    "retired_pages.pending": _feature("retired_pages", lambda pages: _yes_no(pages["pending"])),
    "remapped_rows.correctable": _feature("remapped_rows", lambda rows: rows["corrected"]),
    "remapped_rows.uncorrectable": _feature("remapped_rows", lambda rows: rows["uncorrected"]),
    "remapped_rows.correctable_inactive": _feature("remapped_rows", lambda rows: 0),
    "remapped_rows.uncorrectable_inactive": _feature("remapped_rows", lambda rows: 0),
    "remapped_rows.pending": _feature("remapped_rows", lambda rows: _yes_no(rows["pending"])),
    "remapped_rows.failure": _feature("remapped_rows", lambda rows: _yes_no(rows["failure"])),
    "temperature.gpu": lambda row: str(row.gpu["temperature_c"]),
    "power.draw": lambda row: _watts(row.gpu["power_w"]["draw"]),
    "power.draw.average": lambda row: _watts(row.gpu["power_w"]["draw"]),
    "power.draw.instant": lambda row: _watts(row.gpu["power_w"]["draw"]),
    "power.limit": lambda row: _watts(row.gpu["power_w"]["limit"]),
    "enforced.power.limit": lambda row: _watts(row.gpu["power_w"]["limit"]),
    "power.default_limit": lambda row: _watts(row.gpu["power_w"]["default_limit"]),
    "clocks.current.graphics": lambda row: str(row.gpu["clocks_mhz"]["sm"]),
    "clocks.current.sm": lambda row: str(row.gpu["clocks_mhz"]["sm"]),
    "clocks.current.memory": lambda row: str(row.gpu["clocks_mhz"]["mem"]),
    "clocks.max.graphics": lambda row: str(row.gpu["clocks_mhz"]["sm_max"]),
    "clocks.max.sm": lambda row: str(row.gpu["clocks_mhz"]["sm_max"]),
    "clocks.max.memory": lambda row: str(row.gpu["clocks_mhz"]["mem_max"]),
    "mig.mode.current": _feature("mig_mode", lambda mig: _enabled(mig["current"])),
    "mig.mode.pending": _feature("mig_mode", lambda mig: _enabled(mig["pending"])),
}
for _bit, _suffix, _label in EVENT_REASONS[:-1]:
    _MODELLED[f"clocks_event_reasons.{_suffix}"] = _reason(_bit)
for _kind in ("corrected", "uncorrected"):
    for _counter in ("volatile", "aggregate"):
        for _where in ("device_memory", "dram", "total"):
            _MODELLED[f"ecc.errors.{_kind}.{_counter}.{_where}"] = _ecc_count(_kind, _counter)
        _MODELLED[f"ecc.errors.{_kind}.{_counter}.sram"] = _ecc_zero()
for _name in ("volatile.sram.parity", "volatile.sram.secded", "aggregate.sram.parity", "aggregate.sram.secded"):
    _MODELLED[f"ecc.errors.uncorrected.{_name}"] = _ecc_zero()
_MODELLED["ecc.errors.uncorrected.aggregate.sram.thresholdExceeded"] = _feature("ecc", lambda ecc: "No")
for _source in ("l2", "sm", "mcu", "pcie", "other"):
    _MODELLED[f"ecc.errors.uncorrected.aggregate.sram.{_source}"] = _ecc_zero()

# Every field the fake knows, in `nvidia-smi --help-query-gpu` order, with its header unit.
_FIELD_UNITS = """
timestamp driver_version kmd_version vgpu_driver_capability.heterogenous_multivGPU count name serial uuid
pci.bus_id pci.domain pci.bus pci.device pci.baseClass pci.subClass pci.device_id pci.sub_device_id
vgpu_device_capability.fractional_multiVgpu vgpu_device_capability.heterogeneous_timeSlice_profile
vgpu_device_capability.heterogeneous_timeSlice_sizes vgpu_device_capability.homogeneous_placements
vgpu_device_capability.mig_timeSlicing vgpu_device_capability.mig_timeSlicing_mode
pcie.link.gen.current pcie.link.gen.gpucurrent pcie.link.gen.max pcie.link.gen.gpumax pcie.link.gen.hostmax
pcie.link.width.current pcie.link.width.max index display_mode display_attached display_active persistence_mode
addressing_mode accounting.mode accounting.buffer_size driver_model.current driver_model.pending vbios_version
inforom.img inforom.oem inforom.ecc inforom.pwr inforom.checksum_validation gpu_recovery_action gom.current
gom.pending fan.speed:% pstate clocks_event_reasons.supported clocks_event_reasons.active
clocks_event_reasons.gpu_idle clocks_event_reasons.applications_clocks_setting clocks_event_reasons.sw_power_cap
clocks_event_reasons.hw_slowdown clocks_event_reasons.hw_thermal_slowdown
clocks_event_reasons.hw_power_brake_slowdown clocks_event_reasons.sw_thermal_slowdown
clocks_event_reasons.sync_boost clocks_event_reasons_counters.sw_power_cap:us
clocks_event_reasons_counters.sync_boost:us clocks_event_reasons_counters.sw_thermal_slowdown:us
clocks_event_reasons_counters.hw_thermal_slowdown:us clocks_event_reasons_counters.hw_power_brake_slowdown:us
memory.total:MiB memory.reserved:MiB memory.used:MiB memory.free:MiB compute_mode compute_cap
utilization.gpu:% utilization.memory:% utilization.encoder:% utilization.decoder:% utilization.jpeg:%
utilization.ofa:% encoder.stats.sessionCount encoder.stats.averageFps encoder.stats.averageLatency
dramEncryption.mode.current dramEncryption.mode.pending ecc.mode.current ecc.mode.pending
{ecc_errors}
retired_pages.single_bit_ecc.count retired_pages.double_bit.count retired_pages.pending
remapped_rows.correctable remapped_rows.correctable_inactive remapped_rows.uncorrectable
remapped_rows.uncorrectable_inactive remapped_rows.pending remapped_rows.failure remapped_rows.histogram.max
remapped_rows.histogram.high remapped_rows.histogram.partial remapped_rows.histogram.low
remapped_rows.histogram.none temperature.gpu temperature.gpu.tlimit temperature.memory power.management
power.draw:W power.draw.average:W power.draw.instant:W power.limit:W enforced.power.limit:W
power.default_limit:W power.min_limit:W power.max_limit:W module.power.draw.average:W
module.power.draw.instant:W module.power.limit:W module.enforced.power.limit:W module.power.default_limit:W
module.power.min_limit:W module.power.max_limit:W gpu.base.current:W gpu.base.requested:W gpu.base.default:W
gpu.base.min:W gpu.base.max:W power_smoothing.tmp_floor:W power_smoothing.tmp_ceil:W
power_smoothing.hw_lifetime_remaining_percent:% power_smoothing.enabled
power_smoothing.delayed_power_smoothing_supported power_smoothing.soc_power_smoothing_enabled
power_smoothing.priv_level power_smoothing.imm_ramp_down power_smoothing.max_percent_tmp_floor:%
power_smoothing.min_percent_tmp_floor:% power_smoothing.primary_power_floor:W
power_smoothing.secondary_power_floor:W power_smoothing.min_primary_floor_activation_offset:W
power_smoothing.min_primary_floor_activation_point:W power_smoothing.window_multiplier:ms
power_smoothing.num_preset_profiles power_smoothing.curr_profile.percent_tmp_floor:%
power_smoothing.curr_profile.ramp_up_rate:W/s power_smoothing.curr_profile.ramp_down_rate:W/s
power_smoothing.curr_profile.ramp_down_hysteresis:ms power_smoothing.curr_profile.secondary_power_floor:W
power_smoothing.curr_profile.primary_floor_act_window_multiplier
power_smoothing.curr_profile.primary_floor_tar_window_multiplier
power_smoothing.curr_profile.primary_floor_act_offset:W power_smoothing.active_profile
power_smoothing.admin_override.percent_tmp_floor:% power_smoothing.admin_override.ramp_up_rate:W/s
power_smoothing.admin_override.ramp_down_rate:W/s power_smoothing.admin_override.ramp_down_hysteresis:ms
power_smoothing.admin_override.secondary_power_floor:W
power_smoothing.admin_override.primary_floor_act_window_multiplier
power_smoothing.admin_override.primary_floor_tar_window_multiplier
power_smoothing.admin_override.primary_floor_act_offset:W edpp_multiplier:% clocks.current.graphics:MHz
clocks.current.sm:MHz clocks.current.memory:MHz clocks.current.video:MHz clocks.applications.graphics:MHz
clocks.applications.memory:MHz clocks.default_applications.graphics:MHz clocks.default_applications.memory:MHz
clocks.max.graphics:MHz clocks.max.sm:MHz clocks.max.memory:MHz mig.mode.current mig.mode.pending
gsp.mode.current gsp.mode.default c2c.mode protected_memory.total:MiB protected_memory.used:MiB
protected_memory.free:MiB fabric.state fabric.status fabric.cliqueId fabric.clusterUuid fabric.health.summary
fabric.health.bandwidth fabric.health.route_recovery_in_progress fabric.health.route_unhealthy
fabric.health.access_timeout_recovery fabric.health.incorrect_configuration fabric.health.partition_assigned
platform.chassis_serial_number platform.slot_number platform.tray_index platform.host_id platform.peer_type
platform.module_id platform.gpu_fabric_guid hostname bbx.time_run:seconds
"""


def _ecc_error_fields() -> str:
    names = []
    places = (
        "device_memory",
        "dram",
        "register_file",
        "l1_cache",
        "l2_cache",
        "texture_memory",
        "cbu",
        "sram",
        "total",
    )
    for kind in ("corrected", "uncorrected"):
        for counter in ("volatile", "aggregate"):
            names += [f"ecc.errors.{kind}.{counter}.{place}" for place in places]
    names += [f"ecc.errors.uncorrected.{c}.sram.{k}" for c in ("volatile", "aggregate") for k in ("parity", "secded")]
    names += [f"ecc.errors.uncorrected.aggregate.sram.{s}" for s in ("thresholdExceeded", "l2", "sm", "mcu", "pcie")]
    names.append("ecc.errors.uncorrected.aggregate.sram.other")
    return " ".join(names)


def _parse_units() -> Dict[str, str]:
    units = {}
    for token in _FIELD_UNITS.format(ecc_errors=_ecc_error_fields()).split():
        name, _sep, unit = token.partition(":")
        units[name] = unit
    for _bit, suffix, _label in EVENT_REASONS[:-1]:
        units[f"clocks_throttle_reasons.{suffix}"] = ""
    units["clocks_throttle_reasons.supported"] = units["clocks_throttle_reasons.active"] = ""
    return units


UNITS: Dict[str, str] = _parse_units()

# Older or short spellings the real tool accepts; the header shows the canonical name.
ALIASES: Dict[str, str] = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_serial": "serial",
    "gpu_bus_id": "pci.bus_id",
    "temperature.gpu.current": "temperature.gpu",
    "clocks.gr": "clocks.current.graphics",
    "clocks.sm": "clocks.current.sm",
    "clocks.mem": "clocks.current.memory",
    "clocks.video": "clocks.current.video",
    "clocks.max.gr": "clocks.max.graphics",
    "clocks.max.mem": "clocks.max.memory",
    "pcie.link.gen.gpu_current": "pcie.link.gen.gpucurrent",
}

# Values of fields the scenario does not model that the real tool prints without brackets.
_BARE_NA_PREFIXES = ("temperature.memory", "fabric.")


def canonical(field: str) -> Optional[str]:
    """The canonical name of a --query-gpu field, or None when the real tool would reject it."""
    field = ALIASES.get(field, field)
    return field if field in UNITS else None


def header(field: str) -> str:
    unit = UNITS[field]
    return f"{field} [{unit}]" if unit else field


def value(field: str, row: Row, with_units: bool) -> str:
    if field.startswith("clocks_throttle_reasons."):
        field = "clocks_event_reasons." + field.split(".", 1)[1]
    getter = _MODELLED.get(field)
    if getter is None:
        return BARE_NA if field.startswith(_BARE_NA_PREFIXES) else NA
    text = getter(row)
    if text is None:
        return NA
    unit = UNITS[field]
    return f"{text} {unit}" if with_units and unit else text


def modelled(field: str) -> bool:
    return field in _MODELLED
