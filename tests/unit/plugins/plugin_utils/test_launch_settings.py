"""Launch's settings are checked on the controller before a box is touched: one plain line per problem naming the
launch_* variable, the command template rendered per cell, secrets resolved without showing a value.

The variables come from a YAML sweep loaded the way Ansible loads a vars file (tagged, trusted values) and the options
are rendered from them through a real Templar, as the role's task would: what the action sees in a play.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.parsing.dataloader import DataLoader
from ansible.parsing.vault import VaultLib, VaultSecret
from ansible.template import Templar, trust_as_template

from ansible_collections.remote_gpu.trainer.plugins.modules import training_run
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils import _launch_settings as options
from ansible_collections.remote_gpu.trainer.plugins.plugin_utils._cost import number_of
from ansible_collections.remote_gpu.trainer.tests.profiles import self_stop

SWEEP: Dict[str, Any] = {
    "launch_run": "abl",
    "launch_cells": [
        {"name": "lr-1", "config": "a.yaml", "lr": 0.1, "seed": 1},
        {
            "name": "lr-2",
            "config": "b.yaml",
            "lr": 0.2,
            "seed": 2,
            "artifacts": ["best.pt"],
            "prune": ["checkpoint-*/"],
        },
        {"name": "lr-3", "config": "c.yaml", "lr": 0.3, "seed": 3, "timeout_s": 600, "retries": 1},
    ],
    "launch_command": [
        "python",
        "train.py",
        "-c",
        "{{ cell.config }}",
        "--lr",
        "{{ cell.lr }}",
        "--seed",
        "{{ cell.seed }}",
    ],
    "launch_checkpoint_dir": "{{ cell_dir }}/ckpt",
    "launch_workdir": "/work/proj",
    "launch_artifacts": ["*.json"],
    "data_dir": "/data",  # the platform profile's
    "durable_dir": "/durable",
}
# The options C adds to training_run in this issue (absent from its spec until then).
NEW_MODULE_OPTIONS = {"apply_changes", "optional_artifacts", "verify_cmd", "verify_timeout_s", "check_finite"}
NEW_CELL_OPTIONS = {"artifacts", "optional_artifacts", "prune"}
# Variables the role would not hand the action as options (templates per cell, the profile's own).
NOT_OPTIONS = {"launch_command", "launch_checkpoint_dir"}


def play(tmp_path: Path, changes: Optional[Dict[str, Any]] = None, drop: Tuple[str, ...] = (), **extra: Any) -> Dict:
    """The play's variables for host h1: the sweep (plus ``changes``, less ``drop``) as a tagged, trusted vars file."""
    sweep = {key: value for key, value in {**SWEEP, **(changes or {})}.items() if key not in drop}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(sweep))
    loaded = DataLoader().load_from_file(str(path), trusted_as_template=True)
    hosts = ["h1", "h2", "h3"]
    return {"inventory_hostname": "h1", "groups": {"all": hosts, "ungrouped": hosts}, **loaded, **extra}


def args_of(task_vars: Dict[str, Any]) -> Dict[str, Any]:
    """The action's options, rendered from the launch_* variables as the role's task does: tagged values."""
    templar = Templar(loader=DataLoader(), variables=task_vars)
    return {
        name[len("launch_") :]: templar.template(trust_as_template("{{ " + name + " }}"))
        for name in task_vars
        if name.startswith("launch_") and name not in NOT_OPTIONS and name[len("launch_") :] in options.ARGUMENT_SPEC
    }


def settle(task_vars: Dict[str, Any], loader: Any = None) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    settings, problems = options.settings_of(
        args_of(task_vars), task_vars, Templar(loader=DataLoader(), variables=task_vars), loader
    )
    assert (settings is None) == bool(problems)
    return settings, problems


def problems_of(tmp_path: Path, changes: Optional[Dict[str, Any]] = None, **kwargs: Any) -> List[str]:
    return settle(play(tmp_path, changes, **kwargs))[1]


def test_a_good_sweep_gives_every_key_and_training_run_options_only(tmp_path: Path) -> None:
    settings, problems = settle(play(tmp_path))
    assert problems == [] and settings is not None
    assert set(settings) == {
        "host", "run", "run_dir", "data_dir", "durable_dir", "workdir", "code", "module_args", "cells", "shard",
        "secret_names", "launch_id", "preflight", "runtime_python", "base_python", "probe_timeout_s",
        "task_timeout_s", "sync_timeout_s", "report_dir", "autostop", "hourly_usd", "hourly_usd_warning",
    }  # fmt: skip
    module = settings["module_args"]
    assert set(module) <= set(training_run.ARGUMENT_SPEC) | NEW_MODULE_OPTIONS
    for cell in module["cells"]:
        assert set(cell) <= set(training_run.CELL_OPTIONS) | NEW_CELL_OPTIONS
    assert module["cells"][0] == {
        "name": "lr-1",
        "command": ["python", "train.py", "-c", "a.yaml", "--lr", "0.1", "--seed", "1"],
        "checkpoint_dir": "/data/runs/abl/cells/lr-1/ckpt",
    }
    assert module["cells"][1]["artifacts"] == ["best.pt"] and module["cells"][1]["prune"] == ["checkpoint-*/"]
    assert module["cells"][2]["timeout_s"] == 600 and module["cells"][2]["retries"] == 1
    assert settings["cells"] == ["lr-1", "lr-2", "lr-3"] and settings["shard"] is None
    assert settings["code"] == {"kind": "none"} and settings["workdir"] == "/work/proj"
    assert module["durable_dir"] == "/durable" and module["state"] == "started" and "secrets" not in module
    assert settings["runtime_python"] == "/data/.remote_gpu_trainer/venv/bin/python"
    assert settings["base_python"] == "python3"
    assert settings["preflight"] == {"skip": False, "require": False, "max_age_s": 3600.0, "report_dir": "reports"}
    # Plain types all through: the settings go into module options and records.
    assert json.loads(json.dumps(settings)) == settings
    assert isinstance(module["cells"][0]["command"][3], str) and isinstance(settings["run"], str)


def test_options_at_the_modules_default_are_left_out(tmp_path: Path) -> None:
    settings, _problems = settle(play(tmp_path, {"launch_gpus": [], "launch_gpus_per_cell": 0, "launch_env_hook": ""}))
    assert settings is not None
    assert not {"gpus", "gpus_per_cell", "max_parallel", "env_hook", "conda_env", "launch_id"} & set(
        settings["module_args"]
    )
    settings, _problems = settle(play(tmp_path, {"launch_gpus": [0, 1], "launch_gpus_per_cell": 1, "launch_id": "L1"}))
    assert settings is not None
    assert {"gpus": [0, 1], "gpus_per_cell": 1, "launch_id": "L1"}.items() <= settings["module_args"].items()


def test_an_unknown_launch_variable_is_named_with_the_closest_valid_one(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, {"launch_alow_concurrent": True, "launch_artefacts": ["x"]})
    assert "launch_alow_concurrent is not a variable of launch (did you mean launch_allow_concurrent?)" in problems
    assert "launch_artefacts is not a variable of launch (did you mean launch_artifacts?)" in problems


@pytest.mark.parametrize("short", ["allow_concurrent", "apply_changes", "new_attempt", "alow_concurrent"])
def test_a_short_name_without_the_prefix_is_named_as_the_prefixed_variable(tmp_path: Path, short: str) -> None:
    # -e allow_concurrent=true used to be ignored silently: the run then refused, or started, for another reason.
    target = short.replace("alow", "allow")
    assert f"{short} is not a variable of launch (did you mean launch_{target}?)" in problems_of(
        tmp_path, {short: True}
    )


@pytest.mark.parametrize("missing", ["launch_run", "launch_cells", "launch_command", "data_dir"])
def test_a_missing_required_variable_says_required(tmp_path: Path, missing: str) -> None:
    problems = problems_of(tmp_path, drop=(missing,))
    name = "launch_data_dir" if missing == "data_dir" else missing
    assert any(problem.startswith(f"{name} is required") for problem in problems), problems


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("launch_stop_grace_s", "soon", "launch_stop_grace_s must be a number, not text"),
        ("launch_allow_concurrent", "maybe", "launch_allow_concurrent must be true or false, not text"),
        ("launch_env", "WANDB_MODE", "launch_env must be a mapping (name: value), not text"),
        ("launch_gpus", ["zero"], "launch_gpus must be a list of whole numbers, not of text"),
        ("launch_monitor_max_bytes", [1], "launch_monitor_max_bytes must be a whole number, not a list"),
        ("launch_secrets", "hunter2", "launch_secrets must be a mapping (name: value), not text"),
        ("launch_cells", {"name": "a"}, "launch_cells must be a list, not a mapping"),
    ],
)
def test_a_wrong_type_names_the_variable_in_plain_words(tmp_path: Path, variable: str, value: Any, said: str) -> None:
    # The old argument spec said "... is of type <class '..._AnsibleTaggedStr'> and we were unable to convert".
    problems = problems_of(tmp_path, {variable: value})
    assert said in problems, problems
    assert not any("Tagged" in p or "<class" in p or "hunter2" in p for p in problems)


def test_argument_spec_messages_read_plainly() -> None:
    assert (
        options.plain_message("missing required arguments: run, cells")
        == "launch_run is required; launch_cells is required"
    )
    assert options.plain_message("value of detach must be one of: auto, tmux, setsid, got: x") == (
        "launch_detach must be one of auto, tmux, setsid"
    )
    told = options.plain_message(
        "argument 'probe_timeout_s' is of type _AnsibleTaggedStr and we were unable to convert to float: "
        "<class 'ansible.module_utils._internal._datatag._AnsibleTaggedStr'> cannot be converted to a float"
    )
    assert told == "launch_probe_timeout_s must be a number, not text"


@pytest.mark.parametrize(
    ("cells", "said"),
    [
        ([{"name": "a"}, {"config": "x"}], "launch_cells[1] has no name"),
        ([{"name": "a b"}], "launch_cells[0].name 'a b' must match"),
        ([{"name": "a"}, {"name": "a"}], "launch_cells: names must be unique, and these repeat: a"),
        (["a"], "launch_cells[0] must be a mapping with a name, not text"),
        ([], "launch_cells must be a non-empty list"),
        ([{"name": "a", "timeout_s": 0}], "launch_cells a: timeout_s must be a number of seconds, at least 1"),
        ([{"name": "a", "retries": -1}], "launch_cells a: retries must be a whole number, at least 0"),
        ([{"name": "a", "checkpoint_dir": "ckpt"}], "launch_cells a: checkpoint_dir must be an absolute path"),
        ([{"name": "a", "artifacts": ["/etc/passwd"]}], "launch_cells a: artifacts: /etc/passwd must be relative"),
        ([{"name": "a", "prune": ["../x/"]}], "launch_cells a: prune: ../x/ must be relative"),
        ([{"name": "a", "optional_artifacts": "x.pt"}], "launch_cells a: optional_artifacts must be a list of"),
    ],
)
def test_bad_cells_are_refused_naming_the_cell(tmp_path: Path, cells: List[Any], said: str) -> None:
    problems = problems_of(tmp_path, {"launch_cells": cells})
    assert any(problem.startswith(said) for problem in problems), problems


def test_a_cell_with_artifacts_needs_a_durable_dir(tmp_path: Path) -> None:
    changes = {"launch_artifacts": [], "launch_cells": [{"name": "a", "optional_artifacts": ["*.pt"]}]}
    problems = problems_of(tmp_path, changes, drop=("durable_dir",))
    assert problems == ["artifacts are declared but launch_durable_dir is empty: copies need a durable directory"]


def test_an_undefined_key_in_the_command_names_the_cell_and_the_key(tmp_path: Path) -> None:
    # The old role said "One or more items failed".
    cells = [{"name": "lr-1", "config": "a", "lr": 1, "seed": 1}, {"name": "lr-3", "config": "c", "lr": 3}]
    assert problems_of(tmp_path, {"launch_cells": cells}) == ["launch_command: cell lr-3 has no key 'seed'"]
    command = ["python", "--x={{ nope }}"]
    assert problems_of(tmp_path, {"launch_command": command}) == [
        f"launch_command: cell {name}: the variable 'nope' is undefined" for name in ("lr-1", "lr-2", "lr-3")
    ]


def test_rendered_elements_become_text_and_a_list_is_spliced(tmp_path: Path) -> None:
    command = [
        "{{ 'python' }}", "{{ cell.lr * 10 }}", "{{ cell.seed > 1 }}", "{{ ['--a', cell.seed] }}", "{{ run_dir }}",
        "{{ data_dir }}:{{ durable_dir }}:{{ run }}",
    ]  # fmt: skip
    settings, problems = settle(play(tmp_path, {"launch_command": command}))
    assert problems == [] and settings is not None
    assert settings["module_args"]["cells"][1]["command"] == [
        "python", "2.0", "true", "--a", "2", "/data/runs/abl", "/data:/durable:abl",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["{{ '' }}"], "launch_command: cell lr-1: the argv is empty or its program (first element) rendered empty"),
        ([], "launch_command must be a non-empty list (the argv template), not a list"),
        ("python train.py", "launch_command must be a non-empty list (the argv template), not text"),
        (["python", "{{ {'a': 1} }}"], "launch_command: cell lr-1: element 1 rendered to a mapping, not text"),
    ],
)
def test_a_command_that_is_no_argv_is_refused(tmp_path: Path, command: Any, said: str) -> None:
    assert said in problems_of(tmp_path, {"launch_command": command})


def test_an_untrusted_template_is_not_rendered(tmp_path: Path) -> None:
    # A command from a module's result (untrusted) would otherwise run with its "{{ ... }}" left in, or worse.
    task_vars = play(tmp_path)
    task_vars["launch_command"] = ["python", "".join(["{{ cell.config }}"])]  # built at run time: no trust tag
    assert (
        settle(task_vars)[1]
        == ["launch_command element 1 is not a trusted template (set it in vars, not from a result)"] * 3
    )


def test_the_checkpoint_dir_template_and_a_cells_own_dir(tmp_path: Path) -> None:
    cells = [{"name": "a", "checkpoint_dir": "/own/a"}, {"name": "b"}]
    settings, _problems = settle(play(tmp_path, {"launch_cells": cells, "launch_command": ["python"]}))
    assert settings is not None
    assert [cell["checkpoint_dir"] for cell in settings["module_args"]["cells"]] == [
        "/own/a",
        "/data/runs/abl/cells/b/ckpt",
    ]
    problems = problems_of(tmp_path, {"launch_checkpoint_dir": "ckpt/{{ cell.name }}"})
    assert problems[0] == "launch_checkpoint_dir: cell lr-1: rendered to 'ckpt/lr-1', not an absolute path"


@pytest.mark.parametrize(
    "name", ["HF_TOKEN", "WANDB_API_KEY", "openai_api_key", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"]
)
def test_a_credential_in_launch_env_is_refused_pointing_to_launch_secrets(tmp_path: Path, name: str) -> None:
    # It used to land in a 0644 spec.json.
    problems = problems_of(tmp_path, {"launch_env": {name: "s3cr3t-value"}})
    assert len(problems) == 1 and problems[0].startswith(f"launch_env.{name} looks like a credential")
    assert "launch_secrets" in problems[0] and "s3cr3t-value" not in problems[0]


def test_plain_environment_values_become_text(tmp_path: Path) -> None:
    env = {"TOKENIZERS_PARALLELISM": False, "OMP_NUM_THREADS": 4, "HF_HOME": "/data/hf"}
    settings, _problems = settle(play(tmp_path, {"launch_env": env}))
    assert settings is not None
    assert settings["module_args"]["env"] == {
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "4",
        "HF_HOME": "/data/hf",
    }


def test_wandb_online_needs_the_key_in_launch_secrets_not_in_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key in launch_env used to satisfy the check.
    problems = problems_of(tmp_path, {"launch_env": {"WANDB_MODE": "online", "WANDB_API_KEY": "k"}})
    assert any(
        problem.startswith("launch_env WANDB_MODE=online needs WANDB_API_KEY in launch_secrets") for problem in problems
    )
    monkeypatch.setenv("RGT_TEST_WANDB", "k-123")
    secrets = {"WANDB_API_KEY": {"env": "RGT_TEST_WANDB"}}
    settings, problems = settle(play(tmp_path, {"launch_env": {"WANDB_MODE": "online"}, "launch_secrets": secrets}))
    assert problems == [] and settings is not None and settings["module_args"]["secrets"] == {"WANDB_API_KEY": "k-123"}


def test_secrets_are_resolved_on_the_controller_and_only_in_module_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RGT_TEST_TOKEN", "tok-from-env")
    (tmp_path / "hf").write_text("tok-from-file\n")
    secrets = {"MY_TOKEN": {"env": "RGT_TEST_TOKEN"}, "HF_TOKEN": {"file": str(tmp_path / "hf")}}
    settings, problems = settle(play(tmp_path, {"launch_secrets": secrets}))
    assert problems == [] and settings is not None
    assert settings["module_args"]["secrets"] == {"MY_TOKEN": "tok-from-env", "HF_TOKEN": "tok-from-file"}
    assert settings["secret_names"] == ["HF_TOKEN", "MY_TOKEN"]
    rest = dict(settings, module_args={k: v for k, v in settings["module_args"].items() if k != "secrets"})
    record = json.dumps(options.redacted(settings)) + json.dumps(rest)
    assert "tok-from" not in record and "<hidden>" in record
    assert settings["module_args"]["secrets"]["MY_TOKEN"] == "tok-from-env"  # redacted copies, never changes


def test_a_missing_or_empty_secret_names_the_secret_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RGT_TEST_UNSET", raising=False)
    (tmp_path / "empty").write_text("\n")
    secrets = {
        "A_TOKEN": {"env": "RGT_TEST_UNSET"},
        "B_TOKEN": {"file": str(tmp_path / "nope")},
        "C_TOKEN": {"file": str(tmp_path / "empty")},
        "D_TOKEN": {"env": "X", "file": "/y"},
    }
    assert problems_of(tmp_path, {"launch_secrets": secrets}) == [
        "launch_secrets.A_TOKEN: the controller's environment variable RGT_TEST_UNSET is unset or empty",
        f"launch_secrets.B_TOKEN: the controller file {tmp_path}/nope does not exist (or is no file)",
        f"launch_secrets.C_TOKEN: the controller file {tmp_path}/empty is empty",
        "launch_secrets.D_TOKEN must be {env: VARIABLE} or {file: PATH} (exactly one, not empty)",
    ]


def test_a_vault_encrypted_secret_file_is_decrypted_by_the_actions_loader(tmp_path: Path) -> None:
    vault = [("default", VaultSecret(b"pw"))]
    (tmp_path / "key.vault").write_bytes(VaultLib(vault).encrypt("vaulted-key\n"))
    task_vars = play(tmp_path, {"launch_secrets": {"MY_KEY": {"file": str(tmp_path / "key.vault")}}})
    problems = settle(task_vars)[1]
    assert len(problems) == 1 and "cannot be read (vault-encrypted" in problems[0]
    loader = DataLoader()
    loader.set_vault_secrets(vault)
    settings, problems = settle(task_vars, loader)
    assert problems == [] and settings is not None and settings["module_args"]["secrets"] == {"MY_KEY": "vaulted-key"}


def test_shards_come_from_the_inventory_whatever_the_limit(tmp_path: Path) -> None:
    cells = [{"name": f"c{index}"} for index in range(7)]
    changes = {"launch_shard": True, "launch_cells": cells, "launch_command": ["python"]}
    # --limit h2: the play has one host, the inventory three; h2 keeps index 1 and its cells.
    settings, _problems = settle(play(tmp_path, changes, inventory_hostname="h2", ansible_play_hosts=["h2"]))
    assert settings is not None
    assert settings["shard"] == {"index": 1, "count": 3} == settings["module_args"]["shard"]
    assert settings["cells"] == ["c1", "c4"] and [c["name"] for c in settings["module_args"]["cells"]] == ["c1", "c4"]
    settings, _problems = settle(play(tmp_path, dict(changes, launch_shard_hosts=["h9", "h1"])))
    assert (
        settings is not None
        and settings["shard"] == {"index": 0, "count": 2}
        and settings["cells"] == ["c0", "c2", "c4", "c6"]
    )
    problems = problems_of(tmp_path, dict(changes, launch_shard_hosts=["h2", "h3"]))
    assert problems == ["launch_shard: this host h1 is not among launch_shard_hosts (h2, h3)"]


def test_code_and_python_defaults_are_computed_when_not_set(tmp_path: Path) -> None:
    code = tmp_path / "proj"
    code.mkdir()
    settings, _problems = settle(
        play(
            tmp_path,
            {"launch_code_dir": str(code)},
            drop=("launch_workdir",),
            ansible_python_interpreter="/usr/bin/python3.10",
        )
    )
    assert settings is not None
    excludes = [".git", ".venv", "__pycache__", "*.pyc", "wandb"]
    assert settings["code"] == {
        "kind": "rsync", "source": str(code), "dest": "/data/code/abl", "excludes": excludes, "delete": False,
    }  # fmt: skip
    assert settings["workdir"] == settings["module_args"]["workdir"] == "/data/code/abl"
    assert settings["base_python"] == "/usr/bin/python3.10"
    settings, _problems = settle(
        play(tmp_path, {"launch_git_repo": "https://x/p.git", "launch_code_dest": "/src"}, drop=("launch_workdir",))
    )
    assert settings is not None
    assert settings["code"] == {
        "kind": "git",
        "repo": "https://x/p.git",
        "ref": "HEAD",
        "depth": 0,
        "dest": "/src",
        "environment": {},
    }
    assert settings["workdir"] == "/src"
    assert problems_of(tmp_path, drop=("launch_workdir",)) == [
        "launch_workdir is required when no launch_code_dir or launch_git_repo is given"
    ]
    assert problems_of(tmp_path, {"launch_code_dir": str(tmp_path / "nope")})[0].startswith(
        "launch_code_dir must be a directory"
    )


def test_the_profile_gives_what_is_not_set(tmp_path: Path) -> None:
    profile = {
        "env_hook": "/etc/network_turbo",
        "detach": "setsid",
        "preflight_report_dir": "pre",
        "durable_dir": "{{ data_dir }}/fs",
    }
    settings, _problems = settle(play(tmp_path, {**profile, "launch_detach": None}))
    assert settings is not None
    module = settings["module_args"]
    assert (module["env_hook"], module["detach"], module["durable_dir"]) == ("/etc/network_turbo", "setsid", "/data/fs")
    assert settings["preflight"]["report_dir"] == "pre"
    # An explicit empty durable dir means none, not the profile's.
    settings, _problems = settle(
        play(
            tmp_path,
            {
                "launch_durable_dir": "",
                "launch_artifacts": [],
                "launch_cells": [{"name": "a"}],
                "launch_command": ["x"],
            },
        )
    )
    assert settings is not None and "durable_dir" not in settings["module_args"]


def test_verify_cmd_is_an_argv_or_one_command_line(tmp_path: Path) -> None:
    settings, _problems = settle(
        play(tmp_path, {"launch_verify_cmd": "python -c 'import torch, sys; torch.load(sys.argv[1])'"})
    )
    assert settings is not None
    assert settings["module_args"]["verify_cmd"] == ["python", "-c", "import torch, sys; torch.load(sys.argv[1])"]
    settings, _problems = settle(
        play(tmp_path, {"launch_verify_cmd": ["check", "{path}", 3], "launch_verify_timeout_s": 60})
    )
    assert settings is not None and settings["module_args"]["verify_cmd"] == ["check", "{path}", "3"]
    assert settings["module_args"]["verify_timeout_s"] == 60.0
    assert problems_of(tmp_path, {"launch_verify_cmd": "python -c 'x"})[0].startswith(
        "launch_verify_cmd cannot be split"
    )


def test_verify_artifacts_reach_training_run_only_when_given(tmp_path: Path) -> None:
    assert "launch_verify_artifacts" in options.KNOWN_VARIABLES
    settings, _problems = settle(play(tmp_path, {"launch_verify_cmd": ["load", "{path}"]}))
    assert settings is not None and "verify_artifacts" not in settings["module_args"]  # empty: every artifact
    chosen = {"launch_verify_cmd": ["load", "{path}"], "launch_verify_artifacts": ["*.pt", "**/*.safetensors"]}
    settings, _problems = settle(play(tmp_path, chosen))
    assert settings is not None and settings["module_args"]["verify_artifacts"] == ["*.pt", "**/*.safetensors"]
    assert "verify_artifacts" in training_run.ARGUMENT_SPEC
    assert problems_of(tmp_path, {"launch_verify_artifacts": ["*.pt"]}) == [
        "launch_verify_artifacts chooses what launch_verify_cmd runs on, but it is not set"
    ]
    assert problems_of(tmp_path, {"launch_verify_cmd": ["load"], "launch_verify_artifacts": ["../*.pt"]}) == [
        "launch_verify_artifacts: ../*.pt must be relative and stay inside the checkpoint directory"
    ]
    assert problems_of(tmp_path, {"verify_artifacts": ["*.pt"]}) == [
        "verify_artifacts is not a variable of launch (did you mean launch_verify_artifacts?)"
    ]


def test_bounds_and_paths_are_checked_before_a_box_is_asked(tmp_path: Path) -> None:
    problems = problems_of(
        tmp_path,
        {"launch_stop_grace_s": 99999, "launch_data_dir": "data", "launch_run": "../x", "launch_detach": "nohup"},
    )
    assert "launch_stop_grace_s must be a number at least 0 and at most 3600, not 99999.0" in problems
    assert "launch_data_dir must be an absolute path on the box, not 'data'" in problems
    assert any(problem.startswith("launch_run must match") for problem in problems)
    assert any(problem.startswith("launch_detach must be one of auto, tmux, setsid") for problem in problems)


def test_a_name_in_both_env_and_secrets_and_an_empty_verify_program_are_refused(tmp_path: Path) -> None:
    (tmp_path / "v").write_text("x")
    changes = {"launch_env": {"HF_HOME": "/a"}, "launch_secrets": {"HF_HOME": {"file": str(tmp_path / "v")}}}
    assert problems_of(tmp_path, changes) == [
        "launch_env.HF_HOME is in launch_secrets too: give it once, in launch_secrets"
    ]
    assert problems_of(tmp_path, {"launch_verify_cmd": ["", "{path}"]}) == [
        "launch_verify_cmd: its program (first element) is empty"
    ]


def test_every_problem_is_told_at_once(tmp_path: Path) -> None:
    changes = {
        "launch_env": {"MY_TOKEN": "x"},
        "launch_cells": [{"name": "a"}, {}],
        "launch_code_dir": str(tmp_path / "no"),
    }
    problems = problems_of(tmp_path, changes, drop=("launch_command",))
    assert [problem.split(" ")[0] for problem in problems] == [
        "launch_command", "launch_cells[1]", "launch_code_dir", "launch_env.MY_TOKEN",
    ]  # fmt: skip


# ---- autostop and cost (issue 22) -----------------------------------------------------------------------------

RUNPOD_SELF_STOP: Dict[str, Any] = self_stop("runpod")
VASTAI_SELF_STOP: Dict[str, Any] = self_stop("vastai")
PROFILES = Path(__file__).resolve().parents[4] / "inventories" / "group_vars"


def armed(tmp_path: Path, self_stop: Any = RUNPOD_SELF_STOP, platform: str = "runpod", **changes: Any) -> Tuple:
    variables = {"launch_autostop": True, "self_stop": self_stop, "platform": platform, **changes}
    return settle(play(tmp_path, variables))


def test_autostop_off_asks_training_run_nothing(tmp_path: Path) -> None:
    settings, _problems = settle(play(tmp_path, {"self_stop": RUNPOD_SELF_STOP}))
    assert settings is not None and settings["autostop"] is None and "autostop" not in settings["module_args"]
    assert settings["hourly_usd"] is None


@pytest.mark.parametrize(("platform", "self_stop"), [("runpod", RUNPOD_SELF_STOP), ("vastai", VASTAI_SELF_STOP)])
def test_autostop_on_a_box_that_can_stop_itself_passes_its_profile_to_training_run(
    tmp_path: Path, platform: str, self_stop: Dict[str, Any]
) -> None:
    settings, problems = armed(tmp_path, self_stop, platform, launch_autostop_controller_silence_hours=6)
    assert problems == [] and settings is not None
    expected = {
        "idle_minutes": 30.0, "controller_silence_hours": 6.0, "check_interval_s": 60.0, "disarm": False,
        "id_env": self_stop["id_env"], "env": self_stop["env"], "verb": self_stop["verb"], "platform": platform,
    }  # fmt: skip
    assert settings["module_args"]["autostop"] == settings["autostop"] == expected
    # Exactly the suboptions training_run takes, of their types.
    spec = training_run.ARGUMENT_SPEC["autostop"]["options"]
    assert not ArgumentSpecValidator(spec).validate(dict(expected)).error_messages
    # The {instance_id} placeholder is left for the box, which reads its id from id_env.
    assert "{instance_id}" in settings["autostop"]["verb"]["command"]
    assert json.loads(json.dumps(settings)) == settings


@pytest.mark.parametrize(
    ("platform", "reason"),
    [
        ("lambda", "Lambda instances carry no API key of their own and can only be terminated, never stopped"),
        ("autodl", "AutoDL documents no API or CLI an instance could use to shut itself down (console only)"),
        ("generic_ssh", "a generic SSH box has no provider meter to stop"),
    ],
)
def test_autostop_is_refused_where_the_platform_gives_no_self_stop_with_its_reason(
    tmp_path: Path, platform: str, reason: str
) -> None:
    problems = armed(tmp_path, {"unsupported": reason}, platform)[1]
    assert problems == [
        f"launch_autostop: {platform}'s boxes cannot stop themselves ({reason}): patrol's idle_billing "
        "(patrol_idle_billing_minutes) says when h1 bills with no live run; stop it with remote_gpu.trainer.teardown"
    ]


def test_a_profile_without_self_stop_says_which_boxes_can_stop_themselves(tmp_path: Path) -> None:
    assert armed(tmp_path, None)[1] == [
        "launch_autostop: h1 has no self_stop in its platform profile (runpod and vastai boxes can stop themselves)"
    ]


def verb_with(**changes: Any) -> Dict[str, Any]:
    return dict(RUNPOD_SELF_STOP, verb=dict(RUNPOD_SELF_STOP["verb"], **changes))


@pytest.mark.parametrize(
    ("self_stop", "said"),
    [
        (
            verb_with(command=["runpodctl", "pod", "remove", "{instance_id}"], irreversible=True, survives=[]),
            "launch_autostop: h1's self_stop.verb is irreversible (runpodctl pod remove '{instance_id}'): autostop "
            "only stops; never delete/destroy/terminate",
        ),
        (
            verb_with(command=["runpodctl", "pod", "terminate", "{instance_id}"]),
            "launch_autostop: h1's self_stop.verb.command runs 'terminate'",
        ),
        (
            verb_with(command=["runpodctl", "pod", "stop"]),
            "launch_autostop: h1's self_stop.verb.command must name the box by {instance_id}",
        ),
        (verb_with(irreversible="no"), "launch_autostop: h1's self_stop.verb.irreversible must be true"),
        (dict(RUNPOD_SELF_STOP, id_env=[]), "launch_autostop: h1's self_stop.id_env must be a non-empty list"),
        (dict(RUNPOD_SELF_STOP, env={"RUNPOD_API_KEY": "$KEY"}), "launch_autostop: h1's self_stop.env must map"),
        (dict(RUNPOD_SELF_STOP, verbs={}), "launch_autostop: h1's self_stop.verbs is not a key of self_stop"),
        ("runpodctl", "launch_autostop: h1's self_stop must be a mapping"),
    ],
)
def test_a_self_stop_that_could_delete_or_stop_another_box_is_refused(
    tmp_path: Path, self_stop: Any, said: str
) -> None:
    problems = armed(tmp_path, self_stop)[1]
    assert any(problem.startswith(said) for problem in problems), problems


def test_the_dead_man_alone_needs_no_idle_timer_but_one_timer_is_needed(tmp_path: Path) -> None:
    settings, _problems = armed(
        tmp_path, launch_autostop_idle_minutes=None, launch_autostop_controller_silence_hours=0.5
    )
    assert settings is not None
    assert (settings["autostop"]["idle_minutes"], settings["autostop"]["controller_silence_hours"]) == (None, 0.5)
    # -e gives text: "null" is null there, a number in text is a number.
    settings, _problems = armed(
        tmp_path, launch_autostop_idle_minutes="null", launch_autostop_controller_silence_hours="12"
    )
    assert settings is not None and settings["autostop"]["controller_silence_hours"] == 12.0
    assert armed(tmp_path, launch_autostop_idle_minutes=None)[1] == [
        "launch_autostop needs a timer: launch_autostop_idle_minutes or launch_autostop_controller_silence_hours "
        "(both are null)"
    ]


def test_autostop_bounds_and_kinds_are_named(tmp_path: Path) -> None:
    problems = armed(
        tmp_path,
        launch_autostop_idle_minutes=-1,
        launch_autostop_controller_silence_hours="soon",
        launch_autostop_check_interval_s=0,
    )[1]
    assert problems == [
        "launch_autostop_idle_minutes must be at least 0 minutes (or null), not -1",
        "launch_autostop_controller_silence_hours must be a number of hours, or null for no such timer, not text",
        "launch_autostop_check_interval_s must be a number between 1 and 3600, not 0",
    ]
    assert "launch_autostop_controller_silence_hours must be above 0 hours (or null), not 0" in problems_of(
        tmp_path, {"launch_autostop_controller_silence_hours": 0}
    )
    assert problems_of(tmp_path, {"launch_autostop": "sure"}) == ["launch_autostop must be true or false, not text"]


@pytest.mark.parametrize("text", ["1_000", "nan", "inf", "0x10"])
def test_autostop_timers_read_text_by_the_one_rule_hourly_usd_is_read_by(tmp_path: Path, text: str) -> None:
    assert number_of(text) is None  # the rule every stage applies to hourly_usd
    assert problems_of(tmp_path, {"launch_autostop_controller_silence_hours": text}) == [
        "launch_autostop_controller_silence_hours must be a number of hours, or null for no such timer, not text"
    ]
    settings, _problems = armed(tmp_path, launch_autostop_controller_silence_hours=" 2.5 ")
    assert settings is not None and settings["autostop"]["controller_silence_hours"] == 2.5 == number_of(" 2.5 ")


def test_a_typod_autostop_variable_is_named_with_the_closest_valid_one(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, {"launch_autostop_idle_minute": 10, "auto_stop": True})
    assert problems == [
        "launch_autostop_idle_minute is not a variable of launch (did you mean launch_autostop_idle_minutes?)",
        "auto_stop is not a variable of launch (did you mean launch_autostop?)",
    ]


def test_disarm_asks_training_run_to_disarm_whatever_the_platform(tmp_path: Path) -> None:
    settings, _problems = settle(play(tmp_path, {"launch_autostop_disarm": True, "self_stop": {"unsupported": "x"}}))
    assert settings is not None and settings["module_args"]["autostop"] == {"disarm": True}
    assert armed(tmp_path, launch_autostop_disarm=True)[1] == [
        "launch_autostop and launch_autostop_disarm are both true: set one (arm the box's stop, or disarm it)"
    ]


@pytest.mark.parametrize("rate", ["abc", -1, True, "nan"])
def test_a_bad_hourly_rate_is_a_warning_naming_hourly_usd_never_a_refusal(tmp_path: Path, rate: Any) -> None:
    settings, problems = settle(play(tmp_path, {"hourly_usd": rate}))
    assert problems == [] and settings is not None and settings["hourly_usd"] is None
    assert settings["hourly_usd_warning"].startswith("hourly_usd: must be a number of US dollars per hour (>= 0)")


def test_an_hourly_rate_given_as_text_is_the_rate(tmp_path: Path) -> None:
    settings, problems = settle(play(tmp_path, {"hourly_usd": "2.5"}))  # -e hourly_usd=2.5
    assert problems == [] and settings is not None
    assert (settings["hourly_usd"], settings["hourly_usd_warning"]) == (2.5, None)


def test_the_hourly_rate_is_read_from_the_host_and_may_be_a_template(tmp_path: Path) -> None:
    settings, _problems = settle(play(tmp_path, {"hourly_usd": 2.69}))
    assert settings is not None and settings["hourly_usd"] == 2.69
    settings, _problems = settle(play(tmp_path, {"gpu_rate": 1.5, "hourly_usd": "{{ gpu_rate * 2 }}"}))
    assert settings is not None and settings["hourly_usd"] == 3.0


@pytest.mark.parametrize("profile", sorted(path.name for path in PROFILES.glob("*.yml") if path.name != "all.yml"))
def test_every_platform_profile_either_stops_itself_safely_or_says_why_not(tmp_path: Path, profile: str) -> None:
    variables = yaml.safe_load((PROFILES / profile).read_text())
    problems = armed(tmp_path, variables.get("self_stop"), variables.get("platform", profile[:-4]))[1]
    if isinstance(variables.get("self_stop"), dict) and "unsupported" in variables["self_stop"]:
        assert len(problems) == 1 and "cannot stop themselves" in problems[0]
    else:
        assert problems == [], problems
