# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A box's state beside its runs' (``box_state``): RUNNING when it answers, else what the provider says of its
instance and whether we stopped it.

    STOPPED      the provider says stopped and we stopped it (autostop or teardown, with when), or its owner asked
                 for the stop (the status' intended_key says so): quiet; it bills storage only
    INTERRUPTED  the provider says stopped and no stop of ours is on record (outbid, preempted, a host fault), or
                 its intended state is still running: a warning, results may be stranded
    GONE         the provider no longer lists it (or lists it in an irreversible verb's final state): an alarm
    UNREACHABLE  the provider says it runs, or could not be asked (no instance_id, no status command, the CLI
                 failed: the record says which): an alarm, the meter runs

The provider is asked with the status command of the profile's ``meter_stop_verb`` (the one teardown's meter-stop
polls), from the controller, read-only, under a timeout. Whether we stopped the box is read on the controller, since
the box's own stop record is out of reach while it is down: the host's previous patrol record in the report
directory (its autostop's stop, a stop a down record carried, or an autostop that was due to stop the box) and
teardown's newest report that stopped its meter, each only when newer than the last tick that saw the box run. A box
that answers is RUNNING, unless its autostop's confirmed stop is newer than the container's start (a stopped box
whose SSH still answers for a moment): STOPPED.
"""

from __future__ import annotations

import glob
import json
import os
import re
from datetime import datetime
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._command import Runner, subprocess_runner
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _meter_stop as meter
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_billing as billing
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _patrol_record as records
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import (
    box_cost,
    ledger_of,
    parse_since,
    stopped_cost,
)
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._launch_cells import plain
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._stage import one_line

RUNNING, STOPPED, INTERRUPTED, GONE, UNREACHABLE = "RUNNING", "STOPPED", "INTERRUPTED", "GONE", "UNREACHABLE"
BOX_STATES = (RUNNING, STOPPED, INTERRUPTED, GONE, UNREACHABLE)
# The record's state (and status) of a box that did not answer: GONE keeps "unreachable" (exit code 4, as before).
DOWN_STATES = {
    STOPPED: "stopped",
    INTERRUPTED: "interrupted",
    GONE: records.UNREACHABLE,
    UNREACHABLE: records.UNREACHABLE,
}
PROBLEMS = {INTERRUPTED: "interrupted", GONE: "gone", UNREACHABLE: records.UNREACHABLE}
ACTIONS = {INTERRUPTED: ["restart_job"], GONE: ["re_rent"], UNREACHABLE: ["investigate"]}
STATUS_TIMEOUT_S = 30.0
REPORTS_READ = 10  # the newest reports of a stage read back for a host's record
REPORT_BYTES = 64 * 1024 * 1024
_REPORT_NAME = re.compile(r"-(\d{8}T\d{6}Z)(?:-(\d+))?\.json\Z")
# An owner's intended state that asks for no running instance (Vast.ai's intended_status "stopped").
_STOP_WORDS = frozenset({"stopped", "stop", "exited", "inactive", "paused"})


# ---- the provider ------------------------------------------------------------------------------------------------


def _rendered(value: Any, templar: Any) -> Any:
    return plain(templar.template(value) if templar is not None and value is not None else value)


def _final_states(verbs: Any, verb: meter.Verb, self_stop: Any) -> Tuple[List[str], List[str]]:
    """(states that mean stopped, states that mean gone) for ``verb``'s status: the final states of each declared
    verb read by the same status command (an irreversible one's mean gone), and the self-stop verb's."""
    stopped: List[str] = []
    gone: List[str] = []
    for name in verbs if isinstance(verbs, Mapping) else {}:
        try:
            other = meter.parse_verb(verbs, str(name))
        except ValueError:
            continue  # the verb in use was parsed already: another's mistake only costs its states
        if other.status is not None and other.status.command == (verb.status.command if verb.status else None):
            (gone if other.irreversible else stopped).extend(other.final_states)
    own = self_stop.get("verb") if isinstance(self_stop, Mapping) else None
    finals = own.get("final_states") if isinstance(own, Mapping) else None
    if isinstance(finals, list) and not (isinstance(own, Mapping) and own.get("irreversible") is True):
        stopped.extend(str(state) for state in finals if isinstance(state, (str, int)))
    return stopped, [state for state in gone if state not in stopped]


def ask_provider(
    task_vars: Mapping[str, Any], templar: Any = None, runner: Runner = subprocess_runner
) -> Dict[str, Any]:
    """What the provider says of this host's instance: ``{asked, says (stopped|gone|running|None), state, intended,
    intended_stop, error, command}``; ``error`` says why it was not asked or gave no answer."""
    answer: Dict[str, Any] = dict.fromkeys(("says", "state", "intended", "intended_stop", "error", "command"))
    answer["asked"] = False
    try:
        name = _rendered(task_vars.get("meter_stop_verb"), templar)
        verbs = _rendered(task_vars.get("meter_stop_verbs"), templar)
        ident = _rendered(task_vars.get("instance_id"), templar)
        self_stop = _rendered(task_vars.get("self_stop"), templar)
    except Exception as error:  # any template error of the profile: the reason, in one line
        return dict(answer, error=f"the profile cannot be rendered: {one_line(error, 200)}")
    if not isinstance(name, str) or name in ("", meter.NO_VERB):
        return dict(answer, error="no status command to ask it with (meter_stop_verb is none)")
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or not str(ident).strip():
        return dict(answer, error="no instance_id for this host")
    try:
        verb = meter.parse_verb(verbs, name)
    except ValueError as error:
        return dict(answer, error=one_line(error, 240))
    if verb.status is None:
        return dict(answer, error=f"no status command to ask it with (meter_stop_verb {verb.name} is done by hand)")
    plan = meter.plan_for(verb, timeout_s=0, poll_interval_s=1, command_timeout_s=STATUS_TIMEOUT_S)
    poll = meter.poll_status(plan, runner)
    answer.update(asked=True, command=meter.shown(verb.status.command))
    if poll.error:
        return dict(answer, error=one_line(f"{answer['command']} {poll.error}", 300))
    stopped, gone = _final_states(verbs, verb, self_stop)
    label = one_line(poll.label, 60)
    says = "gone" if poll.gone or label in gone else "stopped" if label in stopped else "running"
    intended = one_line(poll.intended, 60) if poll.intended is not None else None
    intended_stop = None if intended is None else (intended.lower() in _STOP_WORDS or intended in stopped)
    answer.update(says=says, state=None if poll.gone else label, intended=intended, intended_stop=intended_stop)
    return answer


# ---- whether we stopped it ---------------------------------------------------------------------------------------


def _reports(report_dir: str, stage: str) -> List[str]:
    """The stage's stamped reports in ``report_dir``, newest first, at most REPORTS_READ."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(os.path.expanduser(report_dir)), f"{stage}-2*.json")):
        match = _REPORT_NAME.search(path)
        if match:
            found.append((match.group(1), int(match.group(2) or 0), path))
    return [path for _stamp, _n, path in sorted(found, reverse=True)[:REPORTS_READ]]


def _hosts(path: str) -> Tuple[Optional[str], List[Mapping[str, Any]]]:
    """A report's ``generated_at`` and host records; nothing for a file that is unreadable or not a report."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(REPORT_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= REPORT_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None, []
    if not isinstance(doc, Mapping) or not isinstance(doc.get("hosts"), list):
        return None, []
    stamp = doc.get("generated_at") if isinstance(doc.get("generated_at"), str) else None
    return stamp, [record for record in doc["hosts"] if isinstance(record, Mapping)]


def _records(report_dir: str, stage: str, host: str) -> Iterator[Tuple[Optional[str], Mapping[str, Any]]]:
    for path in _reports(report_dir, stage):
        stamp, records = _hosts(path)
        yield from ((stamp, record) for record in records if record.get("host") == host)


def _stop(by: str, at: Any, source: str, inferred: bool = False) -> Optional[Dict[str, Any]]:
    when = parse_since(at)
    if when is None:
        return None
    return {"by": by, "at": when.isoformat().replace("+00:00", "Z"), "source": source, "inferred": inferred}


def autostop_stop(record: Mapping[str, Any], source: str, now: datetime) -> Optional[Dict[str, Any]]:
    """The stop a box's autostop facts show: issued (stopping, stopped) after the container's start, or an idle wait
    of an autostop that was to stop the box and is past due (inferred: its watcher had no tick to tell)."""
    autostop = record.get("autostop") if isinstance(record.get("autostop"), Mapping) else None
    box = record.get("box") if isinstance(record.get("box"), Mapping) else {}
    booted = box.get("container_started_at")
    if not autostop or billing.restarted_since(autostop, booted) is not None:
        return None
    if autostop.get("state") in billing.STOPS:
        return _stop("autostop", billing.stopped_at(autostop), source)
    due = parse_since(autostop.get("due_at"))
    if autostop.get("state") in billing.WAITS and billing.will_stop(autostop, booted) and due and due <= now:
        return _stop("autostop", autostop.get("due_at"), source, inferred=True)
    return None


def history(report_dir: str, host: str, now: datetime) -> Dict[str, Any]:
    """What the controller knows of this host from its reports: ``{our_stop, seen_running_at, since}``: the newest
    stop of ours not older than the last tick that saw the box run, that tick's time, and the box's billing start."""
    known: Dict[str, Any] = {"our_stop": None, "seen_running_at": None, "since": None}
    for stamp, record in _records(report_dir, "patrol", host):
        source = f"patrol report of {stamp or '?'}"
        if record.get("reachable") is False:
            carried = record.get("our_stop")
            if isinstance(carried, Mapping):
                known["our_stop"] = _stop(str(carried.get("by")), carried.get("at"), str(carried.get("source")))
            seen = record.get("last_seen")
            if isinstance(seen, Mapping):
                known.update(seen_running_at=seen.get("at"), since=seen.get("since"))
        else:
            box = record.get("box") if isinstance(record.get("box"), Mapping) else {}
            known.update(seen_running_at=stamp, since=box.get("since"), our_stop=autostop_stop(record, source, now))
        break
    seen = parse_since(known["seen_running_at"])
    for stamp, record in _records(report_dir, "teardown", host):
        meter_stop = record.get("meter_stop") if isinstance(record.get("meter_stop"), Mapping) else {}
        if meter_stop.get("state") != "stopped" or record.get("check_mode") is True:
            continue
        cost = record.get("cost") if isinstance(record.get("cost"), Mapping) else {}
        found = _stop("teardown", cost.get("stopped_at") or stamp, f"teardown report of {stamp or '?'}")
        ours = parse_since((known["our_stop"] or {}).get("at"))
        when = parse_since((found or {}).get("at"))
        if when is not None and (seen is None or when > seen) and (ours is None or when > ours):
            known["our_stop"] = found
        break  # the newest teardown that stopped the meter decides
    return known


# ---- the verdict -------------------------------------------------------------------------------------------------


def judge(provider: Mapping[str, Any], our_stop: Optional[Mapping[str, Any]], now: datetime) -> Tuple[str, str]:
    """(box_state, why in one line) of a box that did not answer."""
    state = provider.get("state") or "?"
    if provider.get("says") == "gone":
        said = "no longer lists the instance" if provider.get("state") is None else f"says {state}"
        return GONE, f"the provider {said}: whatever was only on the box is lost (re-rent)"
    if provider.get("error"):
        return UNREACHABLE, f"the provider was not asked: {provider['error']}"
    if provider.get("says") == "running":
        return UNREACHABLE, f"the provider says {state}: the meter runs"
    intended = provider.get("intended")
    if provider.get("intended_stop") is False:
        return INTERRUPTED, (
            f"the provider says {state} while the instance's intended state is {intended}: stopped by the provider "
            "(outbid, preempted or a host fault); results not copied off the box may be stranded"
        )
    if our_stop:
        guess = (
            " (it was due; the box's own record is out of reach while it is down)" if our_stop.get("inferred") else ""
        )
        return STOPPED, f"by {our_stop['by']} at {billing.clock(our_stop['at'], now)}{guess}; the provider says {state}"
    if provider.get("intended_stop") is True:
        return (
            STOPPED,
            f"by its owner (intended state {intended}, no stop of ours on record); the provider says {state}",
        )
    return INTERRUPTED, (
        f"the provider says {state} and no stop of ours is on record (outbid, preempted or a host fault): results "
        "not copied off the box may be stranded"
    )


ADVICE = {
    STOPPED: "restart it to go on (its disk is kept), or delete it to end the storage bill",
    INTERRUPTED: "restart it in the provider's console (its disk is kept) and launch again to resume, or move its runs",
    GONE: "re-rent: the instance is gone, and with it whatever was only on its disks",
    UNREACHABLE: f"{records.CONSOLE_ADVICE} (re-rent when it is gone)",
}


def down_record(
    host: str, reason: str, provider: Mapping[str, Any], known: Mapping[str, Any], now: datetime
) -> Dict[str, Any]:
    """The record of a box that did not answer (``reason``, the connection's error), judged with the provider's
    answer and what the controller knows (``history``)."""
    record = records.unreachable(host, reason)
    box_state, why = judge(provider, known.get("our_stop"), now)
    problems = [PROBLEMS[box_state]] if box_state in PROBLEMS else []
    if box_state == UNREACHABLE:
        reason = f"{record['error']}; {why}; {records.CONSOLE_ADVICE}"
    else:
        reason = f"{why}; {record['error']}"
    record.update(
        box_state=box_state, state=DOWN_STATES[box_state], problems=problems, actions=ACTIONS.get(box_state, []),
        reasons=[one_line(reason, 400)], msg=one_line(why, 300),
        provider=dict(provider), last_seen={"at": known.get("seen_running_at"), "since": known.get("since")},
        # Carried to the next tick while the box stays stopped; a stop the provider contradicts is not.
        our_stop=known.get("our_stop") if box_state == STOPPED else None,
    )  # fmt: skip
    return record


def answered_state(record: Dict[str, Any]) -> None:
    """``box_state`` of a box that answered: RUNNING, or STOPPED when its autostop's confirmed stop is newer than
    the container's start (the provider stopped it; its SSH answers a moment longer)."""
    autostop = record.get("autostop") if isinstance(record.get("autostop"), Mapping) else None
    box = record.get("box") if isinstance(record.get("box"), Mapping) else {}
    found = None
    if (
        autostop
        and autostop.get("state") == "stopped"
        and not billing.restarted_since(autostop, box.get("container_started_at"))
    ):
        found = _stop("autostop", billing.stopped_at(autostop), "the box's autostop")
    record.update(box_state=STOPPED if found else RUNNING, our_stop=found)


def bill(record: Dict[str, Any], rate: Optional[float], storage: Optional[float], bills: Any, now: datetime) -> None:
    """The record's cost by its box_state (``record["cost"]`` holds box_cost's for a box that answered): a stopped
    box's GPU hours end at the stop (at the last tick that saw it run, for one the provider stopped), then it bills
    ``storage`` per hour; a GONE one bills nothing after that; an UNREACHABLE one bills on."""
    state = record.get("box_state")
    record["stopped_bills"] = one_line(bills, 160) if isinstance(bills, str) and bills.strip() else None
    if record.get("reachable") is False:
        seen = record.get("last_seen") if isinstance(record.get("last_seen"), Mapping) else {}
        cost = box_cost(rate, seen.get("since"), now)
        stop = (record.get("our_stop") or {}).get("at") if state == STOPPED else seen.get("at")
        if state in (STOPPED, INTERRUPTED, GONE) and stop:
            cost = stopped_cost(cost, stop, 0.0 if state == GONE else storage, now)
        record["cost"] = cost
    elif state == STOPPED:
        box = record.get("box") if isinstance(record.get("box"), Mapping) else {}
        ledger = ledger_of(box.get("ledger"))
        counted_to = parse_since(box.get("box_now")) or now  # the clock box_cost counted the box's hours on
        ended = ledger is not None and ledger.get("stopped_at") is not None
        stop = (record.get("our_stop") or {}).get("at")
        record["cost"] = stopped_cost(record.get("cost"), stop, storage, counted_to, cut=not ended)
