# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which launch a run name belongs to, decided before ``training_run`` starts anything.

After a teardown the durable copy is the only one left, so a launch that reuses the run's name must not write into
it. Every launch has an id (``<UTC time>-<6 hex>``), kept in ``run.json`` and in the durable copy's
``.launch.json`` (written by the runner's first sync). A start is refused when the run has a tombstone on this box,
or when its durable copy holds another launch (or files with no launch record while this box holds no scratch of
the run); resuming a dead run of the same launch stays allowed. ``new_attempt`` archives the earlier copy and the
tombstone by renaming them to ``<name>@attempt-<N>`` (``@`` is in no run name, so no run can own that name) and
starts afresh; nothing is deleted. Pure standard library.
"""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import (
    NAME_PATTERN,
    durable_run_dir,
    run_dir,
    tombstone_path,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import durable_owner, launch_conflict

DURABLE_TIMEOUT_S = 10.0  # durable_dir is often a network mount: looking at it, or renaming in it, is bounded
ATTEMPT_MARK = "@attempt-"
# The launch line keeps 300 characters of a message: the way out comes right after the fact.
WAY_OUT = "set launch_new_attempt: true (module: new_attempt) to archive it and start afresh"


class AttemptRefused(Exception):
    """The start is refused: a one-line message that names the run and the way out; ``done``, the archives made
    before an archive failed (renames are never undone)."""

    def __init__(self, message: str, done: Tuple[Archive, ...] = ()) -> None:
        super().__init__(message)
        self.done = done


@dataclass(frozen=True)
class Archive:
    """A rename that moves an earlier attempt's file or directory aside."""

    source: str
    destination: str

    def as_fact(self) -> Dict[str, str]:
        return {"from": self.source, "to": self.destination}


@dataclass(frozen=True)
class Attempt:
    """The launch id this start runs under and what must be archived first (new_attempt only)."""

    launch_id: str
    archives: Tuple[Archive, ...] = ()


def new_launch_id(now: Optional[float] = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{os.urandom(3).hex()}"


def recorded_launch_id(record: Mapping[str, Any]) -> Optional[str]:
    """The launch id a run.json names, if it names a valid one."""
    value = record.get("launch_id")
    return value if isinstance(value, str) and NAME_PATTERN.match(value) else None


def _attempt_number(directory: str, name: str, suffix: str) -> int:
    """The highest N of ``<name>@attempt-<N><suffix>`` in ``directory`` (0 for none)."""
    pattern = re.compile(re.escape(name + ATTEMPT_MARK) + r"([0-9]{1,9})" + re.escape(suffix) + "$")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    return max((int(m.group(1)) for m in map(pattern.match, names) if m), default=0)


def _durable_look(durable_run: str) -> Dict[str, Any]:
    """What the durable run directory says about its launch, the cells it holds, and the last attempt archived
    beside it."""
    owner = durable_owner(durable_run)
    parent, name = os.path.split(durable_run)
    cells = os.path.join(durable_run, "cells")
    held = sorted(os.listdir(cells)) if os.path.isdir(cells) else []
    return dict(owner, cells=held, attempts=_attempt_number(parent, name, ""))


def _durable(durable_run: str) -> Dict[str, Any]:
    answer = run_with_deadline({"look": functools.partial(_durable_look, durable_run)}, DURABLE_TIMEOUT_S)["look"]
    if answer.get("timed_out"):
        why = f"did not answer within {DURABLE_TIMEOUT_S:g} s (a hung mount?)"
        raise AttemptRefused(f"{durable_run} {why}; cannot tell which launch its files belong to")
    if "error" in answer:
        raise AttemptRefused(f"{durable_run} cannot be read ({answer['error']}); cannot tell which launch owns it")
    return answer["value"]


def plan(
    spec_run: str,
    data_dir: str,
    durable_dir: Optional[str],
    *,
    launch_id: str,
    has_scratch: bool,
    new_attempt: bool,
    cells: Sequence[str] = (),
) -> Attempt:
    """May a start of ``spec_run`` as launch ``launch_id`` go ahead; AttemptRefused when not.

    ``has_scratch``: this box holds the run's run.json (a resume of the launch recorded there, whose id the caller
    passes). Without it, ``new_attempt`` turns each refusal into an archive. ``cells``: this launch's cells; joining
    the launch of a durable copy that holds one of them would overwrite it, so that way out is offered only when
    none is there.
    """
    tombstone = tombstone_path(data_dir, spec_run)
    torn_down = os.path.lexists(tombstone)
    if has_scratch and torn_down:
        raise AttemptRefused(
            f"run {spec_run} was torn down on this box ({tombstone}) but its scratch {run_dir(data_dir, spec_run)} "
            f"is still there: finish the teardown first, then launch it with launch_new_attempt: true"
        )
    if has_scratch and new_attempt:
        raise AttemptRefused(
            f"run {spec_run}: launch_new_attempt starts a run from nothing, but this box holds its scratch "
            f"{run_dir(data_dir, spec_run)}: launch without it to resume, or tear the run down first"
        )
    look = _durable(durable_run_dir(durable_dir, spec_run)) if durable_dir else None
    durable_run = durable_run_dir(durable_dir, spec_run) if durable_dir else ""
    conflict = launch_conflict(durable_run, look, launch_id, has_scratch) if look is not None else None
    if has_scratch:
        if conflict is not None:
            raise AttemptRefused(
                f"run {spec_run}: this box resumes launch {launch_id} but {conflict}: use a new run name, or tear "
                f"the run down on this box and launch it with launch_new_attempt: true"
            )
        return Attempt(launch_id)
    if not new_attempt:
        if torn_down:
            raise AttemptRefused(
                f"run {spec_run} was torn down on this box ({tombstone}), its durable copy is the only one left: "
                f"{WAY_OUT}, or use a new run name"
            )
        if conflict is not None:
            other = look.get("launch_id") if look is not None else None
            held = [cell for cell in (look or {}).get("cells", []) if cell in cells]
            join = f", set launch_id: {other} to add this box to that launch" if other and not held else ""
            which = f"cell {held[0]}" if len(held) == 1 else f"cells {', '.join(held[:5])}"
            overwrite = f" (joining launch {other} would overwrite its {which})" if other and held else ""
            raise AttemptRefused(
                f"run {spec_run}: {conflict}, not {launch_id}: {WAY_OUT}{join}, or use a new run name{overwrite}"
            )
        return Attempt(launch_id)
    # One N for both renames, so an archived durable copy and its tombstone are easy to pair.
    tombstones = os.path.dirname(tombstone)
    number = 1 + max(_attempt_number(tombstones, spec_run, ".json"), (look or {}).get("attempts", 0))
    archives: List[Archive] = []
    if conflict is not None:
        archives.append(Archive(durable_run, f"{durable_run}{ATTEMPT_MARK}{number}"))
    if torn_down:
        archives.append(Archive(tombstone, os.path.join(tombstones, f"{spec_run}{ATTEMPT_MARK}{number}.json")))
    return Attempt(launch_id, tuple(archives))


def _rename(source: str, destination: str) -> None:
    if os.path.lexists(destination):  # os.rename would replace an empty directory or a file there
        raise FileExistsError(f"{destination} exists")
    os.rename(source, destination)


def archive(attempt: Attempt) -> None:
    """Rename each earlier file or directory aside (never a deletion); AttemptRefused when one cannot be."""
    for index, item in enumerate(attempt.archives):
        rename = functools.partial(_rename, item.source, item.destination)
        answer = run_with_deadline({"rename": rename}, DURABLE_TIMEOUT_S)["rename"]
        if "value" not in answer:
            why = answer.get("error") or f"no answer within {DURABLE_TIMEOUT_S:g} s"
            message = f"could not archive {item.source} to {item.destination} ({why}); nothing started"
            raise AttemptRefused(message, attempt.archives[:index])
