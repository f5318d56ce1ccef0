"""The fleet page shows a silent box by what its provider said (issue 29, item 10): a STOPPED box is a quiet card
billing its storage, a GONE one an alarm like an unreachable one."""

from __future__ import annotations

import re
from typing import Any, Dict

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._fleet_page import render_page


def down(host: str, box_state: str, state: str, **more: Any) -> Dict[str, Any]:
    return {"host": host, "reachable": False, "state": state, "box_state": box_state, "escalate": False, **more}


def card(page: str, host: str) -> str:
    found = re.search(rf'<section class="box" data-host="{host}"[^>]*>.*?</section>', page, re.S)
    assert found, host
    return found.group(0)


def test_a_stopped_box_is_a_quiet_card_billing_storage_and_a_gone_one_an_alarm() -> None:
    cost = {"hourly_usd": 2.0, "usd": 8.01, "stopped_at": "2026-12-04T02:05:09Z", "hourly_usd_stopped": 0.01}
    hosts = [
        down("s1", "STOPPED", "stopped", cost=cost),
        down("g1", "GONE", "unreachable"),
        down("i1", "INTERRUPTED", "interrupted"),
        {"host": "r1", "reachable": True, "state": "running", "escalate": False},
    ]
    page = render_page({"generated_at": "2026-12-04T03:00:00Z", "stage": "patrol", "hosts": hosts})
    stopped = card(page, "s1")
    assert 'data-state="stopped" data-escalate="false"' in stopped
    assert "stopped, storage $8.01 so far at $0.01/h" in stopped and "$2.00/h" not in stopped
    assert 'data-state="gone" data-escalate="true"' in card(page, "g1")
    assert 'data-state="interrupted" data-escalate="false"' in card(page, "i1")
    assert page.index('data-host="g1"') < page.index('data-host="r1"')  # the alarm first
