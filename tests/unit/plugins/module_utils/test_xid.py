"""Xid catalog, kernel-log parsing (real captures and every supported format) and Xid findings."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._findings import ACTIONS, status_of
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _gpu_model, _xid
from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu._xid_findings import pci_to_gpu_index, xid_findings
from ansible_collections.remote_gpu.trainer.tests.testpaths import CAPTURES

KMSG = CAPTURES / "kmsg"
UTC = timezone.utc


def parse_capture(name: str, **options):
    with open(KMSG / name, encoding="utf-8") as log:
        return _xid.parse_kernel_log(log, local_tz=UTC, **options)


def groups_by_key(events):
    return {(g["event"], g["code"], g["pci"]): g for g in _xid.summarize_events(events)}


# --- catalog -------------------------------------------------------------------------------------------------
REQUIRED = [8, 13, 31, 32, 38, 43, 44, 45, 48, 56, 57, 58, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 110]
REQUIRED += [119, 120, 121, 122, 123, 136, 140, 143, 144, 145, 146, 147, 148, 149, 150, 154, 155]


@pytest.mark.parametrize("code", REQUIRED)
def test_catalog_knows_the_codes_a_renter_meets(code):
    info = _xid.xid_info(code)
    assert info["known"] is True
    assert info["code"] == code
    assert info["kind"] in ("hardware", "application", "driver")
    assert info["action"] in ACTIONS
    assert info["name"]


@pytest.mark.parametrize("code", [48, 64, 74, 79, 95, 119, 120, 140])
def test_contract_hardware_class_xids_fail(code):
    info = _xid.xid_info(code)
    assert info["level"] == "FAIL"
    assert info["action"] in ("re_rent", "reset_gpu")


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_contract_application_xids_warn(code):
    info = _xid.xid_info(code)
    assert (info["kind"], info["level"]) == ("application", "WARN")


def test_persistent_memory_faults_mean_re_rent():
    assert _xid.xid_info(48)["action"] == "re_rent"
    assert _xid.xid_info(79)["action"] == "re_rent"
    assert _xid.xid_info(119)["action"] == "reset_gpu"


def test_unknown_code_is_a_hardware_suspect_warning():
    info = _xid.xid_info(999)
    assert info == {
        "code": 999,
        "name": "unknown Xid",
        "kind": "unknown",
        "action": "investigate",
        "known": False,
        "level": "WARN",
    }


def test_informational_xids_raise_no_finding():
    assert _xid.xid_info(154)["level"] == "WARN"
    assert _xid.xid_info(141)["level"] is None


# --- pci ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "normalized"),
    [
        ("00000000:18:00.0", "0000:18:00"),
        ("0000:18:00", "0000:18:00"),
        ("PCI:0000:18:00", "0000:18:00"),
        ("0000:9B:00.0", "0000:9b:00"),
        ("00000001:00:00.0", "0001:00:00"),
        ("18:00.0", "18:00"),
        ("not a pci address", None),
    ],
)
def test_normalize_pci(address, normalized):
    assert _gpu_model.kernel_pci(address) == normalized


def test_pci_to_gpu_index_accepts_every_form():
    bus_ids = {0: "00000000:18:00.0", 1: "00000000:2A:00.0", 2: "00000001:18:00.0"}
    assert pci_to_gpu_index("0000:18:00", bus_ids) == 0
    assert pci_to_gpu_index("PCI:0000:2a:00", bus_ids) == 1
    assert pci_to_gpu_index("0001:18:00", bus_ids) == 2
    assert pci_to_gpu_index("2a:00.0", bus_ids) == 1
    assert pci_to_gpu_index("18:00.0", bus_ids) is None  # two domains have bus 18: ambiguous
    assert pci_to_gpu_index("0000:3b:00", bus_ids) is None


# --- real captures -------------------------------------------------------------------------------------------------
def test_capture_decode_iso_xid13_xid43_grouped_with_counts():
    events = parse_capture("gpud__dmesg-decode-iso__xid13-xid43.log")
    groups = groups_by_key(events)
    assert set(groups) == {("xid", 13, "0000:38:00"), ("xid", 43, "0000:38:00")}
    assert groups["xid", 13, "0000:38:00"]["count"] == 629
    assert groups["xid", 43, "0000:38:00"]["count"] == 7
    assert groups["xid", 13, "0000:38:00"]["first_timestamp"] == datetime(2025, 1, 21, 2, 21, 33, 498559, UTC)
    # 629 Xid 13 lines, but only DEFAULT_MAX_PER_KEY are kept: the last kept one counts the rest
    assert len(events) == _xid.DEFAULT_MAX_PER_KEY + 7
    assert [(e["code"], e["count"]) for e in events if e["count"] > 1] == [(13, 629 - _xid.DEFAULT_MAX_PER_KEY + 1)]


def test_capture_decode_iso_keeps_every_event_under_a_large_cap():
    events = parse_capture("gpud__dmesg-decode-iso__xid13-xid43.log", max_per_key=1000)
    assert len(events) == 636
    first_43 = next(e for e in events if e["code"] == 43)
    assert (first_43["pid"], first_43["process"], first_43["detail"]) == (2815167, "pt_main_thread", "Ch 00000008")


def test_capture_journal_fallen_off_bus_block_is_joined():
    events = parse_capture("gpud-pr1209__journalctl-k__fallen-off-bus-multiline__b200.log", year=2026)
    assert len(events) == 1
    event = events[0]
    assert (event["event"], event["code"], event["pci"]) == ("fallen_off_bus", None, "0000:18:00")
    assert event["timestamp"] == datetime(2026, 2, 14, 5, 3, 42, tzinfo=UTC)
    assert "(PCI ID: 10de:2901)" in event["detail"]
    assert event["detail"].endswith("not responding to commands.")


@pytest.mark.parametrize(
    "name", ["gpud__dev-kmsg-raw__nvswitch-no-xid.log", "gpud__dmesg-decode-iso__boot-nvswitch-no-xid.log"]
)
def test_capture_negative_samples_give_no_events(name):
    assert parse_capture(name) == []


def test_capture_ctime_xid119():
    events = parse_capture("gpud__dmesg-ctime__xid119-gsp-timeout__h100-xe9680.log")
    assert [(e["event"], e["code"], e["pci"]) for e in events] == [("xid", 119, "0000:9b:00")] * 5
    assert events[0]["timestamp"] == datetime(2025, 2, 23, 16, 24, 18, tzinfo=UTC)
    assert events[-1]["timestamp"] == datetime(2025, 2, 23, 16, 30, 13, tzinfo=UTC)
    assert (events[0]["pid"], events[0]["process"]) == (2024380, "nvidia-smi")
    assert events[-1]["process"] == "gpud"
    assert events[0]["detail"].startswith("Timeout after 6s of waiting for RPC response from GPU4 GSP!")


def test_capture_iso_xid48_63_94():
    groups = groups_by_key(parse_capture("gpud__dmesg-iso__xid48-63-94-peermem.log"))
    counts = {key[1]: g["count"] for key, g in groups.items()}
    assert counts == {48: 1, 63: 1, 94: 9}
    assert {key[2] for key in groups} == {"0000:19:00"}


def test_capture_ctime_readme_blocks():
    first = groups_by_key(parse_capture("gpud-xid-readme__dmesg-ctime__xid13-xid109-peermem.log"))
    assert {k: g["count"] for k, g in first.items()} == {("xid", 13, "0000:cb:00"): 3, ("xid", 109, "0000:cb:00"): 1}
    second = parse_capture("gpud-xid-readme__dmesg-ctime__xid31-mmu-fault-xid109-perf.log")
    assert [(e["code"], e["pid"], e["process"]) for e in second] == [
        (31, 626486, "pt_main_thread"),
        (109, 1158578, "pt_main_thread"),
    ]


def test_capture_single_line_old_format_without_name():
    events = parse_capture("ml-engineering__xid63-row-remapper__a100-510.73.08__single-line.log")
    assert len(events) == 1
    event = events[0]
    assert (event["code"], event["pci"], event["pid"], event["process"]) == (63, "0000:10:1c", 1896, None)
    assert (event["timestamp"], event["uptime_s"]) == (None, None)
    assert event["detail"].startswith("Row Remapper:")


def test_every_capture_parses():
    for path in sorted(KMSG.iterdir()):
        with open(path, encoding="utf-8") as log:
            for event in _xid.parse_kernel_log(log):
                assert event["event"] in ("xid", "fallen_off_bus")
                assert event["pci"] is None or re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}", event["pci"])
                assert len(event["line"]) <= _xid.LINE_EXCERPT


# --- formats ---------------------------------------------------------------------------------------------------------
XID79_TAIL = "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "timestamp", "uptime"),
    [
        (f"[ 8121.602] {XID79_TAIL}", None, 8121.602),
        (f"[Sun Feb 23 16:24:18 2025] {XID79_TAIL}", datetime(2025, 2, 23, 16, 24, 18, tzinfo=UTC), None),
        (f"2025-01-21T02:21:33,498559+00:00 {XID79_TAIL}", datetime(2025, 1, 21, 2, 21, 33, 498559, UTC), None),
        (f"2025-01-21T04:21:33,5+02:00 {XID79_TAIL}", datetime(2025, 1, 21, 2, 21, 33, 500000, UTC), None),
        (
            f"kern  :warn  : 2025-01-21T02:21:33,000001+00:00 {XID79_TAIL}",
            datetime(2025, 1, 21, 2, 21, 33, 1, UTC),
            None,
        ),
        (f"kern  :err   : [   12.500000] {XID79_TAIL}", None, 12.5),
        (f"4,3964,8121602000,-;{XID79_TAIL}", None, 8121.602),
        (f"Feb 15 10:00:00 gpu-host kernel: {XID79_TAIL}", datetime(2025, 2, 15, 10, 0, 0, tzinfo=UTC), None),
        (f"Feb 15 10:00:00 gpu-host kernel: [ 42.25] {XID79_TAIL}", datetime(2025, 2, 15, 10, tzinfo=UTC), 42.25),
        (f"2025-02-15T10:00:00+0000 gpu-host kernel: {XID79_TAIL}", datetime(2025, 2, 15, 10, tzinfo=UTC), None),
        (
            f"2025-02-15T10:00:00.250000Z gpu-host kernel: {XID79_TAIL}",
            datetime(2025, 2, 15, 10, 0, 0, 250000, UTC),
            None,
        ),
        (XID79_TAIL, None, None),
    ],
)
def test_every_record_format(line, timestamp, uptime):
    events = _xid.parse_kernel_log([line + "\n"], year=2025, local_tz=UTC)
    assert len(events) == 1
    event = events[0]
    assert (event["event"], event["code"], event["pci"]) == ("xid", 79, "0000:18:00")
    assert (event["pid"], event["process"], event["detail"]) == (None, None, "GPU has fallen off the bus.")
    assert (event["timestamp"], event["uptime_s"]) == (timestamp, uptime)
    assert event["line"] == line


def test_local_time_stamps_use_the_given_zone():
    tz = timezone(timedelta(hours=8))
    events = _xid.parse_kernel_log([f"[Sun Feb 23 16:24:18 2025] {XID79_TAIL}"], local_tz=tz)
    assert events[0]["timestamp"] == datetime(2025, 2, 23, 8, 24, 18, tzinfo=UTC)


def test_old_format_without_pci_prefix_or_pid():
    events = _xid.parse_kernel_log(["[ 4909.92] NVRM: Xid (0000:01:00): 13, 0005 00000000 0000502d 00000104"])
    assert [(e["code"], e["pci"], e["pid"], e["detail"]) for e in events] == [
        (13, "0000:01:00", None, "0005 00000000 0000502d 00000104")
    ]


def test_nvswitch_sxid_is_not_an_xid():
    line = "[ 10.0] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error"
    assert _xid.parse_kernel_log([line]) == []


def test_fallen_off_bus_block_split_over_dmesg_records():
    lines = [
        "[    5.100000] NVRM: The NVIDIA GPU 0000:3b:00.0",
        "[    5.100001] NVRM: (PCI ID: 10de:2330) installed in this system has",
        "[    5.100002] NVRM: fallen off the bus and is not responding to commands.",
        "[    5.200000] nvidia: probe of 0000:3b:00.0 failed with error -1",
    ]
    events = _xid.parse_kernel_log(lines)
    assert [(e["event"], e["pci"], e["uptime_s"]) for e in events] == [("fallen_off_bus", "0000:3b:00", 5.1)]
    assert events[0]["detail"] == (
        "NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:2330) installed in this system has "
        "fallen off the bus and is not responding to commands."
    )


def test_fallen_off_bus_line_naming_its_own_gpu():
    events = _xid.parse_kernel_log(["[ 7.0] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."])
    assert [(e["event"], e["pci"]) for e in events] == [("fallen_off_bus", "0000:3b:00")]


def test_unrelated_nvidia_gpu_block_does_not_linger():
    lines = ["[ 1.0] NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:1234)"] + ["[ 2.0] x"] * 10
    lines.append("[ 3.0] pcieport 0000:00:01.0: device has fallen off the bus")
    events = _xid.parse_kernel_log(lines)
    assert [(e["event"], e["pci"]) for e in events] == [("fallen_off_bus", "0000:00:01")]


def test_long_lines_are_truncated():
    line = f"[ 1.0] NVRM: Xid (PCI:0000:18:00): 13, pid=7, name=python, {'x' * 1000}"
    event = _xid.parse_kernel_log([line])[0]
    assert len(event["line"]) == _xid.LINE_EXCERPT
    assert len(event["detail"]) == _xid.LINE_EXCERPT


def test_folding_counts_every_event_and_keeps_the_newest_time():
    lines = [f"[ {i}.0] NVRM: Xid (PCI:0000:18:00): 13, pid={i}, name=python, fault" for i in range(1, 601)]
    events = _xid.parse_kernel_log(lines, max_per_key=5)
    assert len(events) == 5
    assert [e["count"] for e in events] == [1, 1, 1, 1, 596]
    assert events[-1]["last_uptime_s"] == 600.0
    (group,) = _xid.summarize_events(events)
    assert (group["count"], group["first_uptime_s"], group["last_uptime_s"]) == (600, 1.0, 600.0)


def test_a_flood_keeps_the_newest_time_whichever_way_its_events_were_folded():
    """Folded lines are split only once they stay the newest; an Xid inside a bus block takes the block's time."""
    xid = "NVRM: Xid (PCI:0000:18:00): 13, pid={}, name=python, fault"
    lines = [
        "[ 1.0] " + xid.format(1),
        "[ 2.0] " + xid.format(2),  # folded: its time is read only if nothing newer follows
        "[ 3.0] NVRM: The NVIDIA GPU 0000:18:00 (PCI ID: 10de:2330)",
        "    " + xid.format(4),  # folded with the block's time, 3.0, which replaces 2.0
    ]
    (event,) = _xid.parse_kernel_log(lines, max_per_key=1)
    assert (event["count"], event["last_uptime_s"]) == (3, 3.0)
    (event,) = _xid.parse_kernel_log([*lines, "[ 5.0] " + xid.format(5)], max_per_key=1)
    assert (event["count"], event["last_uptime_s"]) == (4, 5.0)
    assert event["uptime_s"] == 1.0 and event["pid"] == 1


# --- findings -------------------------------------------------------------------------------------------------------
BUS_IDS = {0: "00000000:18:00.0", 1: "00000000:38:00.0"}


def test_findings_for_the_xid13_xid43_capture():
    findings = xid_findings(parse_capture("gpud__dmesg-decode-iso__xid13-xid43.log"), BUS_IDS)
    assert [(f["code"], f["level"], f["gpu"], f["xid"], f["count"]) for f in findings] == [
        ("xid_application", "WARN", 1, 13, 629),
        ("xid_application", "WARN", 1, 43, 7),
    ]
    assert findings[0]["first_seen"] == "2025-01-21T02:21:33+00:00"
    assert findings[0]["last_seen"] == "2025-01-21T04:41:44+00:00"
    assert findings[0]["action"] == "restart_job"
    assert "Xid 13" in findings[0]["message"] and "629x" in findings[0]["message"]
    assert "\n" not in findings[0]["message"]


def test_findings_for_hardware_xids_fail_on_an_unmapped_gpu():
    findings = xid_findings(parse_capture("gpud__dmesg-iso__xid48-63-94-peermem.log"), BUS_IDS)
    assert {(f["code"], f["xid"], f["gpu"], f["pci"]) for f in findings} == {
        ("xid_hardware", 48, None, "0000:19:00"),
        ("xid_hardware", 63, None, "0000:19:00"),
        ("xid_hardware", 94, None, "0000:19:00"),
    }
    assert status_of(findings) == "FAIL"
    assert all(f["action"] == "re_rent" for f in findings)


def test_xid79_and_fallen_off_bus_block_give_one_gpu_lost():
    lines = [
        "[ 5.0] NVRM: The NVIDIA GPU 0000:18:00.0",
        "[ 5.0] NVRM: (PCI ID: 10de:2330) installed in this system has",
        "[ 5.0] NVRM: fallen off the bus and is not responding to commands.",
        f"[ 9.0] {XID79_TAIL}",
    ]
    findings = xid_findings(_xid.parse_kernel_log(lines), BUS_IDS)
    assert sorted((f["code"], f["level"], f["gpu"], f["xid"], f["count"], f["action"]) for f in findings) == [
        ("gpu_lost", "FAIL", 0, 79, 2, "re_rent"),
        ("xid_hardware", "FAIL", 0, 79, 1, "re_rent"),
    ]


def test_unknown_and_informational_codes():
    lines = ["[ 1.0] NVRM: Xid (PCI:0000:18:00): 999, something new", "[ 1.0] NVRM: Xid (PCI:0000:18:00): 141, x"]
    findings = xid_findings(_xid.parse_kernel_log(lines), BUS_IDS)
    assert [(f["code"], f["level"], f["action"], f["kind"]) for f in findings] == [
        ("xid_unknown", "WARN", "investigate", "unknown")
    ]


def test_since_ignores_older_events_exactly():
    path = KMSG / "gpud__dmesg-decode-iso__xid13-xid43.log"
    since = datetime(2025, 1, 21, 3, 0, tzinfo=UTC)
    with open(path, encoding="utf-8") as log:
        stamps = re.findall(
            r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d),\d+\+00:00 NVRM: Xid \(PCI:0000:38:00\): 13,", log.read()
        )
    expected = sum(1 for stamp in stamps if stamp >= "2025-01-21T03:00:00")
    assert 0 < expected < 629
    findings = xid_findings(parse_capture(path.name, max_per_key=1000), BUS_IDS, since=since)
    assert {f["xid"]: f["count"] for f in findings}[13] == expected
    assert all(f["first_seen"] >= "2025-01-21T03:00:00+00:00" for f in findings)


def test_since_after_everything_leaves_no_findings():
    events = parse_capture("gpud__dmesg-decode-iso__xid13-xid43.log")
    assert xid_findings(events, BUS_IDS, since=datetime(2026, 1, 1, tzinfo=UTC)) == []


def test_folded_group_counts_in_full_when_its_newest_event_is_recent():
    events = parse_capture("gpud__dmesg-decode-iso__xid13-xid43.log", max_per_key=3)
    findings = xid_findings(events, BUS_IDS, since=datetime(2025, 1, 21, 3, 0, tzinfo=UTC))
    assert {f["xid"]: f["count"] for f in findings}[13] == 629 - 2


def test_uptime_events_are_dated_with_boot_time():
    lines = [f"[ 30.0] {XID79_TAIL}", "[ 100.0] NVRM: Xid (PCI:0000:38:00): 48, pid=1, name=python, DBE"]
    boot = datetime(2025, 1, 1, tzinfo=UTC)
    findings = xid_findings(_xid.parse_kernel_log(lines), BUS_IDS, since=boot + timedelta(seconds=60), boot_time=boot)
    assert [(f["code"], f["gpu"], f["first_seen"]) for f in findings] == [
        ("xid_hardware", 1, "2025-01-01T00:01:40+00:00")
    ]


def test_undated_events_are_kept_when_since_is_given():
    events = parse_capture("ml-engineering__xid63-row-remapper__a100-510.73.08__single-line.log")
    findings = xid_findings(events, {}, since=datetime(2030, 1, 1, tzinfo=UTC))
    assert [(f["code"], f["xid"], f["first_seen"], f["gpu"]) for f in findings] == [("xid_hardware", 63, None, None)]
    assert "unknown time" in findings[0]["message"]


def test_uptime_events_without_boot_time_are_kept():
    findings = xid_findings(
        _xid.parse_kernel_log([f"[ 30.0] {XID79_TAIL}"]), BUS_IDS, since=datetime(2030, 1, 1, tzinfo=UTC)
    )
    assert sorted((f["code"], f["first_seen"]) for f in findings) == [("gpu_lost", None), ("xid_hardware", None)]
    assert all("30 s after boot" in f["message"] for f in findings)


# A container on a shared 8-GPU host that can read the host's kernel log: this box has GPUs 18 and 38.
OTHER_TENANT = [
    "[ 1.0] NVRM: Xid (PCI:0000:b8:00): 48, pid=901, name=python, An uncorrectable double bit error",
    "[ 2.0] NVRM: Xid (PCI:0000:b8:00): 13, pid=901, name=python, Graphics Exception",
    "[ 3.0] NVRM: Xid (PCI:0000:c8:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
]


def test_xids_of_another_tenants_gpu_are_one_warning_each_not_a_failure():
    findings = xid_findings(_xid.parse_kernel_log(OTHER_TENANT), BUS_IDS, complete=True)
    assert [(f["code"], f["level"], f["action"], f["gpu"], f["pci"], f["xid"]) for f in findings] == [
        ("xid_other_gpu", "WARN", "investigate", None, "0000:b8:00", 48),
        ("xid_other_gpu", "WARN", "investigate", None, "0000:c8:00", 79),
    ]  # the other tenant's own application fault (Xid 13) says nothing about this host or box
    assert "not one of this box's GPUs" in findings[0]["message"] and status_of(findings) == "WARN"


def test_an_unmapped_address_still_fails_when_the_box_may_own_it():
    # Without a complete list of this box's addresses (a lost GPU NVML could not name), it may be ours.
    findings = xid_findings(_xid.parse_kernel_log(OTHER_TENANT), BUS_IDS)
    assert {(f["code"], f["xid"]) for f in findings} >= {("xid_hardware", 48), ("gpu_lost", 79)}


def test_own_gpu_xid_is_attributed_whatever_the_spelling_of_its_address():
    lines = ["[ 1.0] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=python, DBE"]
    for bus_id in ("00000000:3B:00.0", "0000:3b:00.0", "00000000:3b:00.0"):
        (found,) = xid_findings(_xid.parse_kernel_log(lines), {0: bus_id}, complete=True)
        assert (found["code"], found["gpu"]) == ("xid_hardware", 0)


def test_findings_are_sorted_fail_first():
    lines = ["[ 1.0] NVRM: Xid (PCI:0000:18:00): 13, a", "[ 2.0] NVRM: Xid (PCI:0000:38:00): 48, b"]
    findings = xid_findings(_xid.parse_kernel_log(lines), BUS_IDS)
    assert [(f["level"], f["gpu"]) for f in findings] == [("FAIL", 1), ("WARN", 0)]
