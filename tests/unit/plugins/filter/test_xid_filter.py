"""The xid_info filter: catalog lookups from playbooks."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.remote_gpu.trainer.plugins.filter.xid import FilterModule, xid_info


def test_filter_is_registered_under_its_name():
    assert FilterModule().filters()["xid_info"] is xid_info


def test_int_code():
    assert xid_info(79) == {
        "code": 79,
        "name": "GPU has fallen off the bus",
        "kind": "hardware",
        "action": "re_rent",
        "known": True,
        "level": "FAIL",
    }


def test_string_code_matches_int_code():
    assert xid_info(" 13 ") == xid_info(13)
    assert xid_info("13")["kind"] == "application"


def test_unknown_code():
    info = xid_info("4242")
    assert (info["known"], info["kind"], info["level"]) == (False, "unknown", "WARN")


@pytest.mark.parametrize("bad", ["seventy-nine", None, True, -1, "", [79]])
def test_rejects_what_is_not_an_xid_code(bad):
    with pytest.raises(AnsibleFilterError):
        xid_info(bad)
