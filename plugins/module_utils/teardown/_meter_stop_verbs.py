# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A platform's meter-stop verbs, each declared once: what it runs, how its status is read, what outlives it.

A profile's ``meter_stop_verbs.<name>`` holds the verb's argv, its status command and how the state (or the
instance's absence from a list) is read, the states that mean it is done, which of the profile's directories
survive it and whether it can be undone; a verb done in a console declares ``manual_steps`` instead. Whatever the
verb is called, every check reads this one declaration, so a label and a command can not disagree; and a verb
whose argv says delete/destroy/terminate can not be declared reversible. Plain stdlib, no Ansible.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple

VERBS = "meter_stop_verbs"
NO_VERB = "none"
SURVIVABLE = ("data_dir", "durable_dir")
# A verb whose argv says one of these words destroys the instance: declaring it reversible is the label/command
# disagreement of a profile that runs "pod delete" under a verb it calls "stop".
DESTRUCTIVE_WORDS = frozenset({"delete", "destroy", "terminate", "remove", "rm", "release"})
COMMAND_KEYS = ("command", "status", "final_states", "survives", "irreversible", "cli_check")
MANUAL_KEYS = ("manual_steps", "survives", "irreversible")
STATUS_KEYS = ("command", "state_key", "list", "id_key", "id", "intended_key")
CLI_CHECK_KEYS = ("command", "pattern", "need")
_KEY_SEGMENT = re.compile(r"[^.\s]+")


@dataclass(frozen=True)
class Status:
    """How a verb's status is read: ``command`` prints JSON; with ``list_path`` set, the instances are listed at that
    dotted path ("" for the whole output) and the one whose ``id_key`` equals ``instance_id`` is read (absent from
    the list: gone); else the output is the instance itself. ``state_key`` is a dotted path to its state;
    ``intended_key`` (optional, "" for none) to the state its owner asked for (Vast.ai's intended_status), which
    tells a stop of the provider's own from one asked for."""

    command: Tuple[str, ...]
    state_key: str
    list_path: Optional[str] = None
    id_key: str = "id"
    instance_id: str = ""
    intended_key: str = ""


@dataclass(frozen=True)
class CliCheck:
    """Run ``command`` before the verb: it must exit 0 with ``pattern`` in its output, else ``need`` is missing."""

    command: Tuple[str, ...]
    pattern: str
    need: str


@dataclass(frozen=True)
class Verb:
    """One declared meter-stop verb. ``command`` is None for a verb done by hand (``manual_steps``) or none."""

    name: str
    command: Optional[Tuple[str, ...]] = None
    status: Optional[Status] = None
    final_states: Tuple[str, ...] = ()
    survives: Tuple[str, ...] = ()
    irreversible: bool = False
    manual_steps: Tuple[str, ...] = ()
    cli_check: Optional[CliCheck] = None

    @property
    def kind(self) -> str:
        """``command`` (run from the controller), ``manual`` (console steps) or ``none`` (nothing is stopped)."""
        if self.command is not None:
            return "command"
        return "manual" if self.manual_steps else NO_VERB


# --- the declaration -----------------------------------------------------------------------------------------------


def shown(argv: Sequence[str]) -> str:
    return shlex.join(list(argv))


def _closest(word: str, choices: Sequence[str]) -> str:
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""


def _strings(value: Any, where: str, what: str, allow_empty: bool = True) -> Tuple[str, ...]:
    """A list of non-blank strings (YAML numbers become strings); raises naming ``where``."""
    if not isinstance(value, (list, tuple)) or (not value and not allow_empty):
        raise ValueError(f"{where} must be a {'' if allow_empty else 'non-empty '}list of {what}, got {value!r}")
    items = []
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)) or not str(item).strip():
            raise ValueError(f"{where}[{index}] must be one of the {what}, got {item!r}")
        items.append(str(item))
    return tuple(items)


def _argv(value: Any, where: str) -> Tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where} must be a non-empty argv list (no shell), got {value!r}")
    argv = []
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise ValueError(f"{where}[{index}] must be a string, got {item!r}")
        argv.append(str(item))
    for index, item in enumerate(argv):
        if not item.strip():
            if index == 0:
                raise ValueError(f"{where}[0] (the program) is empty")
            raise ValueError(f"{where}[{index}] is empty ({shown(argv)}): is instance_id set for this host?")
        if "{{" in item or "{%" in item:
            raise ValueError(f"{where}[{index}] is an unrendered template ({item}): render the profile first")
    return tuple(argv)


def _mapping(value: Any, where: str, keys: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping with keys {', '.join(keys)}, got {value!r}")
    for key in value:
        if key not in keys:
            raise ValueError(f"{where}.{key} is not a known key (known: {', '.join(keys)}){_closest(str(key), keys)}")
    return value


def _dotted(value: Any, where: str, allow_root: bool = False) -> str:
    if isinstance(value, str) and (
        (allow_root and value == "") or all(_KEY_SEGMENT.fullmatch(segment) for segment in value.split("."))
    ):
        return value
    root = ' ("" for the whole output)' if allow_root else ""
    raise ValueError(f"{where} must be a dotted JSON path such as desiredStatus or data.status{root}, got {value!r}")


def _status(value: Any, where: str) -> Status:
    spec = _mapping(value, where, STATUS_KEYS)
    for key in ("command", "state_key"):
        if key not in spec:
            raise ValueError(f"{where}.{key} is missing")
    list_path = None if "list" not in spec else _dotted(spec["list"], f"{where}.list", allow_root=True)
    instance_id = str(spec.get("id", "")).strip()
    if list_path is not None and not instance_id:
        raise ValueError(f"{where}.id is empty: the instance to find in the list (is instance_id set for this host?)")
    if list_path is None and ("id" in spec or "id_key" in spec):
        raise ValueError(f"{where}.id and .id_key only apply with {where}.list (the instances listed)")
    id_key = spec.get("id_key", "id")
    if not isinstance(id_key, str) or not id_key.strip():
        raise ValueError(f"{where}.id_key must be the key holding each listed instance's id, got {id_key!r}")
    intended = "" if "intended_key" not in spec else _dotted(spec["intended_key"], f"{where}.intended_key")
    return Status(
        command=_argv(spec["command"], f"{where}.command"),
        state_key=_dotted(spec["state_key"], f"{where}.state_key"),
        list_path=list_path,
        id_key=id_key,
        instance_id=instance_id,
        intended_key=intended,
    )


def _cli_check(value: Any, where: str) -> CliCheck:
    spec = _mapping(value, where, CLI_CHECK_KEYS)
    for key in CLI_CHECK_KEYS:
        if key not in spec:
            raise ValueError(f"{where}.{key} is missing")
    pattern, need = spec["pattern"], spec["need"]
    try:
        re.compile(pattern)
    except (re.error, TypeError) as error:
        raise ValueError(f"{where}.pattern is no regular expression ({pattern!r}): {error}") from error
    if not isinstance(need, str) or not need.strip():
        raise ValueError(f"{where}.need must say what is needed (a release, how to install it), got {need!r}")
    return CliCheck(command=_argv(spec["command"], f"{where}.command"), pattern=pattern, need=need)


def _survival(spec: Mapping[str, Any], where: str) -> Tuple[Tuple[str, ...], bool]:
    for key in ("survives", "irreversible"):
        if key not in spec:
            raise ValueError(f"{where}.{key} is missing: declare what outlives the verb and whether it can be undone")
    survives = _strings(spec["survives"], f"{where}.survives", "directories data_dir, durable_dir")
    for name in survives:
        if name not in SURVIVABLE:
            raise ValueError(
                f"{where}.survives lists {name!r}: each must be data_dir or durable_dir{_closest(name, SURVIVABLE)}"
            )
    irreversible = spec["irreversible"]
    if not isinstance(irreversible, bool):
        raise ValueError(f"{where}.irreversible must be true or false, got {irreversible!r}")
    if irreversible and "data_dir" in survives:
        raise ValueError(f"{where}.survives lists data_dir, but an irreversible verb deletes the instance's disks")
    return tuple(dict.fromkeys(survives)), irreversible


def parse_verb(verbs: Any, selected: str) -> Verb:
    """The declaration of verb ``selected`` in ``verbs`` (the profile's ``meter_stop_verbs``, rendered); verb
    ``none`` needs none. Raises ValueError with one line naming the variable path and, for a misspelt verb or key,
    the closest valid name."""
    if selected == NO_VERB:
        return Verb(name=NO_VERB, survives=SURVIVABLE)
    if not isinstance(verbs, Mapping):
        raise ValueError(f"{VERBS} must be a mapping of verb names to declarations, got {type(verbs).__name__}")
    names = [*(str(name) for name in verbs), NO_VERB]
    if not isinstance(selected, str) or selected not in verbs:
        hint = _closest(str(selected), names)
        raise ValueError(
            f"meter_stop_verb {selected!r} is not declared in {VERBS} (declared: {', '.join(names)}){hint}"
        )
    where = f"{VERBS}.{selected}"
    manual = isinstance(verbs[selected], Mapping) and "manual_steps" in verbs[selected]
    both = [key for key in COMMAND_KEYS if key not in MANUAL_KEYS and manual and key in verbs[selected]]
    if both:
        raise ValueError(f"{where} declares manual_steps and {both[0]}: a verb is run or done by hand, not both")
    spec = _mapping(verbs[selected], where, MANUAL_KEYS if manual else COMMAND_KEYS)
    survives, irreversible = _survival(spec, where)
    if manual:
        steps = _strings(spec["manual_steps"], f"{where}.manual_steps", "console steps", allow_empty=False)
        return Verb(name=selected, survives=survives, irreversible=irreversible, manual_steps=steps)
    for key in ("command", "status", "final_states"):
        if key not in spec:
            raise ValueError(f"{where}.{key} is missing (or declare manual_steps for a verb done by hand)")
    command = _argv(spec["command"], f"{where}.command")
    status = _status(spec["status"], f"{where}.status")
    final = _strings(spec["final_states"], f"{where}.final_states", "states", allow_empty=status.list_path is not None)
    said = sorted(DESTRUCTIVE_WORDS & {part for arg in command for part in re.split(r"[/\s]+", arg.lower())})
    if said and not irreversible:
        raise ValueError(f"{where}.command runs {said[0]!r} ({shown(command)}) but {where}.irreversible is false")
    check = _cli_check(spec["cli_check"], f"{where}.cli_check") if "cli_check" in spec else None
    return Verb(selected, command, status, final, survives, irreversible, (), check)
