"""parse_verb: one declaration per verb, refused with one line naming the variable path (and the closest name)."""

from __future__ import annotations

import copy
from typing import Any, Dict

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._meter_stop_verbs import NO_VERB, parse_verb

LIST = {"command": ["runpodctl", "pod", "list", "--all"], "list": "", "id": "p1", "state_key": "desiredStatus"}


def runpod() -> Dict[str, Any]:
    """A rendered RunPod-shaped meter_stop_verbs."""
    return {
        "stop": {
            "command": ["runpodctl", "pod", "stop", "p1"],
            "status": dict(LIST),
            "final_states": ["EXITED"],
            "survives": ["data_dir", "durable_dir"],
            "irreversible": False,
        },
        "delete": {
            "command": ["runpodctl", "pod", "delete", "p1"],
            "status": dict(LIST),
            "final_states": ["TERMINATED"],
            "survives": [],
            "irreversible": True,
        },
    }


def test_a_command_verb_is_read_whole():
    verb = parse_verb(runpod(), "delete")
    assert verb.kind == "command" and verb.command == ("runpodctl", "pod", "delete", "p1")
    assert (verb.survives, verb.irreversible, verb.final_states) == ((), True, ("TERMINATED",))
    assert verb.status is not None and verb.status.list_path == "" and verb.status.instance_id == "p1"
    assert verb.status.id_key == "id" and verb.cli_check is None


def test_what_survives_comes_from_the_declaration_not_from_the_label():
    """The old flat keys judged the verb by its label: meter_stop_verb: stop with meter_stop_cmd [pod, delete] passed
    the survival check and got no irreversible warning. A declaration carries its own survival."""
    verbs = runpod()
    verbs["stop"] = copy.deepcopy(verbs["delete"])  # delete's declaration under the label "stop"
    verb = parse_verb(verbs, "stop")
    assert verb.name == "stop" and verb.command == ("runpodctl", "pod", "delete", "p1")
    assert verb.irreversible is True and "data_dir" not in verb.survives and "durable_dir" not in verb.survives


def test_delete_s_command_declared_with_stop_s_survival_is_refused():
    verbs = runpod()
    verbs["stop"]["command"] = ["runpodctl", "pod", "delete", "p1"]
    with pytest.raises(ValueError) as refused:
        parse_verb(verbs, "stop")
    assert str(refused.value) == (
        "meter_stop_verbs.stop.command runs 'delete' (runpodctl pod delete p1) but "
        "meter_stop_verbs.stop.irreversible is false"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["vastai", "destroy", "instance", "42", "-y"],
        ["runpodctl", "remove", "pod", "p1"],
        ["curl", "-d", "{}", "https://cloud.lambdalabs.com/api/v1/instance-operations/terminate"],
    ],
)
def test_any_destroying_command_must_be_declared_irreversible(command):
    verbs = runpod()
    verbs["stop"]["command"] = command
    with pytest.raises(ValueError, match=r"^meter_stop_verbs\.stop\.command runs '\w+'"):
        parse_verb(verbs, "stop")


def test_an_irreversible_verb_can_not_keep_data_dir():
    verbs = runpod()
    verbs["delete"]["survives"] = ["data_dir", "durable_dir"]
    with pytest.raises(ValueError, match=r"^meter_stop_verbs\.delete\.survives lists data_dir, but an irreversible"):
        parse_verb(verbs, "delete")


def test_a_manual_verb():
    verbs = {"shutdown": {"manual_steps": ["Console -> Shut down"], "survives": ["data_dir"], "irreversible": False}}
    verb = parse_verb(verbs, "shutdown")
    assert verb.kind == "manual" and verb.command is None and verb.status is None
    assert verb.manual_steps == ("Console -> Shut down",) and verb.survives == ("data_dir",)


def test_verb_none_needs_no_declaration_and_keeps_everything():
    verb = parse_verb({}, NO_VERB)
    assert verb.kind == "none" and verb.survives == ("data_dir", "durable_dir") and verb.irreversible is False


def test_a_cli_check_is_read():
    verbs = runpod()
    verbs["delete"]["cli_check"] = {"command": ["x", "--help"], "pattern": "-y, --yes", "need": "x 2 (pip install x)"}
    check = parse_verb(verbs, "delete").cli_check
    assert check is not None and check.command == ("x", "--help") and check.pattern == "-y, --yes"


def _with(path: str, value: Any) -> Dict[str, Any]:
    """runpod() with ``value`` at ``delete.<path>`` (dotted); a value of ... deletes the key."""
    verbs = runpod()
    node = verbs["delete"]
    *parents, last = path.split(".")
    for parent in parents:
        node = node[parent]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return verbs


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("final_states", "TERMINATED", "meter_stop_verbs.delete.final_states must be a list of states, got 'TER"),
        ("final_states", ["TERMINATED", ""], "meter_stop_verbs.delete.final_states[1] must be one of the states"),
        ("survives", ["data"], "meter_stop_verbs.delete.survives lists 'data': each must be data_dir or durable_dir;"),
        ("survives", ..., "meter_stop_verbs.delete.survives is missing"),
        ("irreversible", "yes", "meter_stop_verbs.delete.irreversible must be true or false, got 'yes'"),
        ("command", [], "meter_stop_verbs.delete.command must be a non-empty argv list (no shell), got []"),
        ("command", "runpodctl pod delete p1", "meter_stop_verbs.delete.command must be a non-empty argv list"),
        ("command", ["runpodctl", "pod", "delete", ""], "meter_stop_verbs.delete.command[3] is empty"),
        ("command", ["", "pod"], "meter_stop_verbs.delete.command[0] (the program) is empty"),
        ("command", ["runpodctl", "pod", "delete", "{{ instance_id }}"], "command[3] is an unrendered template"),
        ("command", ["runpodctl", ["pod"]], "meter_stop_verbs.delete.command[1] must be a string, got ['pod']"),
        ("status", ..., "meter_stop_verbs.delete.status is missing"),
        ("status", "runpodctl pod list", "meter_stop_verbs.delete.status must be a mapping with keys command,"),
        ("status.state_key", "data..status", "meter_stop_verbs.delete.status.state_key must be a dotted JSON path"),
        ("status.state_key", "", "meter_stop_verbs.delete.status.state_key must be a dotted JSON path"),
        ("status.list", "data status", "meter_stop_verbs.delete.status.list must be a dotted JSON path"),
        ("status.id", "", "meter_stop_verbs.delete.status.id is empty: the instance to find in the list"),
        ("status.id_key", "", "meter_stop_verbs.delete.status.id_key must be the key holding each listed"),
        ("status.command", ["runpodctl", "pod", "list", " "], "meter_stop_verbs.delete.status.command[3] is empty"),
        ("status.state_kye", "x", "meter_stop_verbs.delete.status.state_kye is not a known key"),
        ("cli_check", {"command": ["x"], "pattern": "(", "need": "x"}, "delete.cli_check.pattern is no regular"),
        ("cli_check", {"command": ["x"], "pattern": "y"}, "meter_stop_verbs.delete.cli_check.need is missing"),
        ("manual_steps", ["Console"], "meter_stop_verbs.delete declares manual_steps and command: a verb is run or"),
    ],
)
def test_bad_declarations_are_refused_with_one_line_naming_the_path(path, value, message):
    with pytest.raises(ValueError) as refused:
        parse_verb(_with(path, value), "delete")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_status_of_the_instance_itself_needs_final_states():
    verbs = _with("status", {"command": ["runpodctl", "pod", "get", "p1"], "state_key": "desiredStatus"})
    assert parse_verb(verbs, "delete").status.list_path is None
    verbs["delete"]["final_states"] = []
    with pytest.raises(ValueError) as refused:
        parse_verb(verbs, "delete")
    assert str(refused.value) == "meter_stop_verbs.delete.final_states must be a non-empty list of states, got []"


def test_a_listed_status_may_have_no_final_state_absence_is_done():
    verb = parse_verb(_with("final_states", []), "delete")
    assert verb.final_states == () and verb.status.list_path == ""


def test_an_id_without_a_list_is_refused():
    status = {"command": ["runpodctl", "pod", "get", "p1"], "state_key": "desiredStatus", "id": "p1"}
    with pytest.raises(ValueError, match=r"status\.id and \.id_key only apply with meter_stop_verbs\.delete\.status"):
        parse_verb(_with("status", status), "delete")


@pytest.mark.parametrize(
    ("verbs", "selected", "message"),
    [
        (
            runpod(),
            "delet",
            "meter_stop_verb 'delet' is not declared in meter_stop_verbs (declared: stop, delete, none)",
        ),
        (runpod(), "delet", "did you mean 'delete'?"),
        ([], "stop", "meter_stop_verbs must be a mapping of verb names to declarations, got list"),
        ({"stop": ["runpodctl"]}, "stop", "meter_stop_verbs.stop must be a mapping with keys command,"),
    ],
)
def test_unknown_verbs_and_shapes(verbs, selected, message):
    with pytest.raises(ValueError) as refused:
        parse_verb(verbs, selected)
    assert message in str(refused.value)


def test_a_misspelt_key_names_the_closest():
    verbs = runpod()
    verbs["stop"]["survive"] = verbs["stop"].pop("survives")
    with pytest.raises(ValueError) as refused:
        parse_verb(verbs, "stop")
    assert str(refused.value).startswith("meter_stop_verbs.stop.survive is not a known key (known: command, status,")
    assert str(refused.value).endswith("did you mean 'survives'?")


def test_yaml_numbers_in_an_argv_become_strings():
    verbs = runpod()
    verbs["stop"]["command"] = ["curl", "--max-time", 30, "https://x/stop"]
    assert parse_verb(verbs, "stop").command == ("curl", "--max-time", "30", "https://x/stop")
