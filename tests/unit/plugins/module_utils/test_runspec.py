"""The run spec the module writes and the runner reads: validation names the bad field, slots, the files beside it."""

from __future__ import annotations

import json
import os

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout import _runspec
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import (
    load_spec,
    parse_spec,
    read_secrets,
)


def spec(**overrides):
    data = {
        "run": "sweep",
        "data_dir": "/data",
        "durable_dir": "/durable",
        "workdir": "/data/code",
        "cells": [{"name": "a", "command": ["python", "train.py"]}, {"name": "b", "command": ["python", "t.py"]}],
    }
    data.update(overrides)
    return data


def test_a_minimal_spec_gets_the_documented_defaults():
    parsed = parse_spec(spec())
    assert parsed.run_dir == "/data/runs/sweep"
    assert [cell.name for cell in parsed.cells] == ["a", "b"]
    assert parsed.cells[0].command == ("python", "train.py")
    assert (parsed.gpus_per_cell, parsed.max_parallel, parsed.stop_on_failure) == (None, None, False)
    assert parsed.stop_grace_s == _runspec.DEFAULT_STOP_GRACE_S
    assert parsed.slots() == 1  # the seed's way: every GPU, one cell at a time


@pytest.mark.parametrize(
    ("gpus", "per_cell", "max_parallel", "slots"),
    [([0, 1, 2, 3, 4, 5, 6, 7], 1, None, 8), ([0, 1, 2, 3, 4, 5, 6, 7], 1, 3, 3), ([0, 1, 2], 2, None, 1),
     ([], 1, None, 1), ([0, 1, 2, 3], None, 4, 1)],
)  # fmt: skip
def test_slots_pack_cells_onto_gpus(gpus, per_cell, max_parallel, slots):
    assert parse_spec(spec(gpus=gpus, gpus_per_cell=per_cell, max_parallel=max_parallel)).slots() == slots


def test_to_json_round_trips_through_parse_spec():
    original = parse_spec(spec(env={"SEED": "1"}, artifacts=["best.pth"], gpus=[0, 1], gpus_per_cell=1))
    assert parse_spec(json.loads(json.dumps(original.to_json()))) == original


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run": "../escape"}, "run '../escape' does not match"),
        ({"data_dir": "relative"}, "data_dir must be an absolute path"),
        ({"cells": []}, "cells must be a non-empty list"),
        ({"cells": [{"name": "a", "command": "python train.py"}]}, "cell a: command must be a non-empty list"),
        ({"cells": [{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}]}, "unique: a"),
        ({"cells": [{"name": "a b", "command": ["x"]}]}, r"cells\[0\].name 'a b' does not match"),
        ({"cells": [{"name": "a", "command": ["x"], "timeout_s": float("nan")}]}, "timeout_s must be a number"),
        ({"cells": [{"name": "a", "command": ["x"], "retries": -1}]}, "retries must be an integer of at least 0"),
        ({"gpus": [0, 1], "gpus_per_cell": 3}, "gpus_per_cell 3 is more than the box's 2 GPUs"),
        ({"artifacts": ["../../etc/passwd"]}, "must stay inside the cell's directory"),
        ({"prune": ["/abs/latest.pth"]}, "must stay inside the cell's directory"),
        ({"artifacts": ["best.pth"], "durable_dir": None}, "artifacts are declared but durable_dir is not set"),
        ({"env": {"BAD-NAME": "x"}}, "'BAD-NAME' is not an environment variable name"),
        ({"env": {"N": 1}}, "env.N must be a string"),
        ({"schema": 2}, "spec schema 2 is not 1"),
        ({"cells": [{"name": "a", "command": ["x"], "artifacts": "best.pt"}]}, "cell a: artifacts must be a list"),
        ({"cells": [{"name": "a", "command": ["x"], "prune": ["../up/"]}]}, "cell a: prune: '../up/' must stay inside"),
        ({"cells": [{"name": "a", "command": ["x"], "optional_artifacts": [""]}]}, "cell a: optional_artifacts must"),
        ({"optional_artifacts": ["/abs"]}, "optional_artifacts: '/abs' must stay inside"),
        (
            {
                "durable_dir": None,
                "cells": [
                    {"name": "a", "command": ["x"]},
                    {"name": "b", "command": ["y"], "optional_artifacts": ["*.json"]},
                ],
            },
            r"artifacts are declared but durable_dir is not set \(cells b\)",
        ),
        ({"verify_cmd": "python load.py"}, "verify_cmd must be a non-empty list of strings"),
        ({"verify_cmd": [""]}, "verify_cmd must be a non-empty list of strings"),
        ({"verify_cmd": ["load", "a\0b"]}, "verify_cmd must not contain a NUL character"),
        ({"verify_timeout_s": 0}, "verify_timeout_s must be a number of at least 1"),
        ({"check_finite": "yes"}, "check_finite must be true or false, not 'yes'"),
        ({"verify_cmd": ["load"], "verify_artifacts": "*.pt"}, "verify_artifacts must be a list of non-empty strings"),
        ({"verify_cmd": ["load"], "verify_artifacts": ["../x.pt"]}, "verify_artifacts: '../x.pt' must stay inside"),
        ({"verify_artifacts": ["*.pt"]}, "verify_artifacts chooses the artifacts verify_cmd runs on, but verify_cmd"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec(**overrides))


def test_load_spec_and_secrets_read_the_run_directory(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps(parse_spec(spec()).to_json()))
    assert load_spec(str(tmp_path)).run == "sweep"
    assert read_secrets(str(tmp_path)) == {}
    secrets = tmp_path / ".secrets.json"
    secrets.write_text(json.dumps({"WANDB_API_KEY": "k"}))
    assert read_secrets(str(tmp_path)) == {"WANDB_API_KEY": "k"}
    assert _runspec.secrets_json(str(tmp_path)) == str(secrets)


def test_an_oversized_spec_is_refused_before_it_is_parsed(tmp_path):
    (tmp_path / "spec.json").write_bytes(b" " * (_runspec.MAX_SPEC_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        load_spec(str(tmp_path))


def test_durable_paths_follow_the_contract():
    assert _runspec.manifest_path("/durable", "sweep") == os.path.join("/durable", "runs", "sweep", "MANIFEST.sha256")


def test_a_cells_own_artifact_lists_replace_the_runs_even_when_empty():
    cells = [
        {"name": "plain", "command": ["x"]},
        {"name": "hf", "command": ["y"], "artifacts": ["model.safetensors"], "prune": ["checkpoint-*/"]},
        {"name": "none", "command": ["z"], "artifacts": [], "optional_artifacts": []},
    ]
    parsed = parse_spec(spec(cells=cells, artifacts=["best.pt"], optional_artifacts=["*.json"], prune=["last.pt"]))
    plain, hf, none = parsed.cells
    assert (parsed.artifacts_of(plain), parsed.optional_artifacts_of(plain), parsed.prune_of(plain)) == (
        ("best.pt",),
        ("*.json",),
        ("last.pt",),
    )
    assert (parsed.artifacts_of(hf), parsed.optional_artifacts_of(hf), parsed.prune_of(hf)) == (
        ("model.safetensors",),
        ("*.json",),
        ("checkpoint-*/",),
    )
    assert (parsed.artifacts_of(none), parsed.optional_artifacts_of(none), parsed.prune_of(none)) == (
        (),
        (),
        ("last.pt",),
    )
    assert [parsed.declares_artifacts(cell) for cell in parsed.cells] == [True, True, False]
    assert parse_spec(json.loads(json.dumps(parsed.to_json()))) == parsed  # None (the run's) and [] survive


def test_verify_settings_default_off_and_round_trip():
    parsed = parse_spec(spec())
    assert (parsed.verify_cmd, parsed.verify_timeout_s, parsed.check_finite, parsed.optional_artifacts) == (
        None,
        300.0,
        False,
        (),
    )
    checked = parse_spec(spec(verify_cmd=["python3", "load.py", "{path}"], verify_timeout_s=20, check_finite=True))
    assert (checked.verify_cmd, checked.verify_timeout_s, checked.check_finite) == (
        ("python3", "load.py", "{path}"),
        20.0,
        True,
    )
    assert parse_spec(json.loads(json.dumps(checked.to_json()))) == checked
    assert parsed.verify_artifacts == ()  # every artifact
    chosen = parse_spec(spec(verify_cmd=["load"], verify_artifacts=["*.pt", "**/*.safetensors"]))
    assert chosen.verify_artifacts == ("*.pt", "**/*.safetensors")
    assert parse_spec(json.loads(json.dumps(chosen.to_json()))) == chosen


def test_a_spec_json_from_before_per_cell_artifacts_still_loads(tmp_path):
    old = {  # as the previous release wrote it: no per-cell lists, no verify keys
        "schema": 1, "run": "sweep", "data_dir": "/data", "durable_dir": "/durable", "workdir": "/data/code",
        "cells": [{"name": "a", "command": ["python", "t.py"], "timeout_s": None, "retries": 0,
                   "checkpoint_dir": None}],
        "env": {}, "env_hook": None, "conda_env": None, "gpus": [], "gpus_per_cell": None, "max_parallel": None,
        "prune": ["latest.pth"], "artifacts": ["best.pth"], "stop_on_failure": False, "stop_grace_s": 30.0,
        "monitor_interval_s": 30.0, "monitor_max_bytes": 8388608, "shard": None, "launch_id": None,
    }  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(old))
    loaded = load_spec(str(tmp_path))
    assert loaded.cells[0].artifacts is None and loaded.artifacts_of(loaded.cells[0]) == ("best.pth",)
    assert (loaded.verify_cmd, loaded.check_finite, loaded.verify_artifacts) == (None, False, ())
