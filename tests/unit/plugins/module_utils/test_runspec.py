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
