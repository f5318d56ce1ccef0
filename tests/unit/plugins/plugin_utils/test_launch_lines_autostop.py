"""Launch's autostop words where the armed stop cannot do everything (issue 29): an archived run that blocks a stop
which would lose its scratch, and a dead-man that a failed cell disables, said on the box's line."""

from __future__ import annotations

from typing import Any, Dict

from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_lines as lines

BLOCKED = (
    "archived run r0 (.archive/r0-20300101T000000Z) blocks it: the stop keeps only durable_dir and would lose its "
    "scratch (teardown_run or abandon)"
)
CAVEAT = (
    "a failed cell disables the dead-man: the stop keeps only durable_dir, so a run that ended with a failed cell "
    "holds the box until it is torn down"
)
TERMS = "stops the box 30 min after every run is secured (dead-man: 6 h without a patrol tick)"


def record(check_mode: bool = False, **autostop: Any) -> Dict[str, Any]:
    facts = {
        "asked": "arm", "armed": True, "changed": True, "idle_minutes": 30.0, "controller_silence_hours": 6.0,
        "blocked_by": [], "caveats": [], "decision": None,
    }  # fmt: skip
    facts.update(autostop)
    return {
        "host": "b1", "status": "STARTED", "step": None, "reason": "", "run": "abl", "cells": [], "cells_left": 0,
        "recopy_cells": [], "kept_cells": [], "changes": [], "detach": "tmux", "pgid": 812, "attach": None,
        "gate": None, "check_mode": check_mode, "autostop": facts,
    }  # fmt: skip


def test_an_archived_run_that_blocks_the_stop_is_on_the_line_with_what_to_do() -> None:
    text = lines.line(record(blocked_by=[BLOCKED, BLOCKED.replace("r0", "r7")]))
    assert f"; autostop armed, but {BLOCKED}; and 1 more archived run; {TERMS}" in text
    assert f"; autostop stays armed, but {BLOCKED}; {TERMS}" in lines.line(record(changed=False, blocked_by=[BLOCKED]))
    would = lines.line(record(check_mode=True, blocked_by=[BLOCKED]))
    assert f"; check mode: would arm autostop, but {BLOCKED}; {TERMS}" in would


def test_a_dead_man_a_failed_cell_disables_is_said_after_the_terms() -> None:
    assert f"; autostop armed: {TERMS}; {CAVEAT}" in lines.line(record(caveats=[CAVEAT]))


def test_a_stop_that_keeps_the_disk_says_only_its_terms() -> None:
    text = lines.line(record())
    assert f"; autostop armed: {TERMS}" in text and "but" not in text and "dead-man:" in text
