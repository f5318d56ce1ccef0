"""Per-cell artifacts, loadable checkpoints and re-copy instead of retrain, with the real runner on real files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import parse_result, read_exit
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runspec import parse_spec
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._runner import Runner
from ansible_collections.remote_gpu.trainer.tests.workload.harness import make_run, results, train

# A loader that raises on a checkpoint cut short, as torch.load does: magic, payload length, payload.
LOADER = """
import struct, sys
data = open(sys.argv[1], "rb").read()
(length,) = struct.unpack(">Q", data[4:12])
if data[:4] != b"CKPT" or len(data) - 12 < length:
    raise RuntimeError(f"PytorchStreamReader failed reading file data: {len(data) - 12} of {length} bytes")
"""
# A cell's program: appends to $1 (the proof it ran), then writes what the rest of its arguments say into
# $RGT_CKPT_DIR: "ckpt NAME" (a checkpoint), "cut NAME" (one cut to half), "dir NAME" (an HF checkpoint-*/ dir),
# "st NAME VALUE" (a one-tensor F32 safetensors file).
PROGRAM = r"""
import json, os, struct, sys
with open(sys.argv[1], "a") as handle:
    handle.write(f"start {os.environ['RGT_CELL']}\n")
out, args = os.environ["RGT_CKPT_DIR"], sys.argv[2:]
while args:
    kind, name, args = args[0], args[1], args[2:]
    path = os.path.join(out, name)
    if kind in ("ckpt", "cut"):
        data = b"CKPT" + struct.pack(">Q", 4096) + os.urandom(4096)
        open(path, "wb").write(data[: len(data) // 2] if kind == "cut" else data)
    elif kind == "dir":
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "optimizer.pt"), "wb").write(b"o" * 1000)
    else:
        value, args = float(args[0]), args[1:]
        data = struct.pack("<4f", 1.0, value, 2.0, 3.0)
        header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        header += b" " * (-len(header) % 8)
        open(path, "wb").write(struct.pack("<Q", len(header)) + header + data)
"""


def program(starts: Path, *writes: object) -> list:
    return [sys.executable, "-c", PROGRAM, str(starts), *(str(w) for w in writes)]


def run(run_dir: Path) -> int:
    return Runner(str(run_dir), dict(os.environ)).run()


def respec(run_dir: Path, **changes: object) -> None:
    """Rewrite spec.json as a relaunch that applies changes does (its cells' lists, the run's globs)."""
    document = json.loads((run_dir / "spec.json").read_text())
    document.update(changes)
    (run_dir / "spec.json").write_text(json.dumps(parse_spec(document).to_json()))


def starts_of(path: Path) -> list:
    return path.read_text().splitlines() if path.exists() else []


def durable(tmp_path: Path, cell: str = "") -> Path:
    root = tmp_path / "durable" / "runs" / "sweep"
    return root / "cells" / cell if cell else root


def log(run_dir: Path) -> str:
    return (run_dir / "runner.log").read_text()


def test_a_cells_own_artifacts_stand_beside_the_runs(tmp_path):
    starts = tmp_path / "starts"
    cells = [
        {"name": "plain", "command": train()},  # best.pth, latest.pth: the run's lists
        {"name": "hf", "command": program(starts, "st", "model.safetensors", 0.5, "dir", "checkpoint-3", "dir",
                                          "checkpoint-6"),
         "artifacts": ["model.safetensors"], "optional_artifacts": ["config.json"], "prune": ["checkpoint-*/"]},
        {"name": "eval", "command": program(starts), "artifacts": [], "optional_artifacts": []},
    ]  # fmt: skip
    run_dir = make_run(tmp_path, cells, artifacts=["best.pth"], prune=["latest.pth"], check_finite=True)
    assert run(run_dir) == 0 and (run_dir / "DONE").exists()
    found = results(run_dir)
    assert [a["path"] for a in found["plain"]["artifacts"]] == ["best.pth"]
    assert found["plain"]["pruned"] == ["latest.pth"]
    hf = found["hf"]
    assert ([a["path"] for a in hf["artifacts"]], hf["pruned"]) == (
        ["model.safetensors"],
        ["checkpoint-3/", "checkpoint-6/"],
    )
    assert hf["verify"] == [{"path": "model.safetensors", "ok": True, "message": "1 float tensor(s) finite"}]
    assert not (run_dir / "cells" / "hf" / "checkpoint-3").exists() and (run_dir / "cells" / "hf" / "log").exists()
    assert (found["eval"]["sync"], found["eval"]["artifacts"]) == ("skipped", [])  # its own "none"
    assert sorted(p.name for p in durable(tmp_path).joinpath("cells").iterdir()) == ["hf", "plain"]
    for name, result in found.items():
        assert (result["command"], result["recopied"], result["leftovers"]) == (cells_command(cells, name), False, [])
        ended = read_exit(str(run_dir / "cells" / name / "exit.json"))
        assert ended is not None and (ended["status"], ended["command"]) == ("succeeded", result["command"])
    assert json.loads((run_dir / "cells" / "hf" / "exit.json").read_text())["checkpoint_dir"] == str(
        run_dir / "cells" / "hf"
    )


def cells_command(cells: list, name: str) -> list:
    return next(cell["command"] for cell in cells if cell["name"] == name)


def test_a_truncated_checkpoint_is_refused_by_the_verify_command_with_the_loaders_message(tmp_path):
    starts = tmp_path / "starts"
    cells = [{"name": "good", "command": program(starts, "ckpt", "best.pt")},
             {"name": "cut", "command": program(starts, "cut", "best.pt")}]  # fmt: skip
    run_dir = make_run(tmp_path, cells, artifacts=["best.pt"], verify_cmd=[sys.executable, "-c", LOADER, "{path}"])
    assert run(run_dir) == 1 and not (run_dir / "DONE").exists()
    good, cut = results(run_dir)["good"], results(run_dir)["cut"]
    assert good["sync"] == "verified" and good["verify"] == [
        {"path": "best.pt", "ok": True, "message": "verify_cmd exited 0"}
    ]
    assert (cut["status"], cut["sync"], cut["artifacts"]) == ("succeeded", "failed", [])
    said = "RuntimeError: PytorchStreamReader failed reading file data: 2042 of 4096 bytes"
    assert cut["sync_error"].startswith("best.pt: verify_cmd exited with 1: ") and cut["sync_error"].endswith(said)
    assert cut["verify"][0]["ok"] is False and not parse_result(cut).counts_as_done(True)
    assert f"SYNC FAILED: {cut['sync_error']}" in (run_dir / "cells" / "cut" / "log").read_text()


# A cell that writes a checkpoint and the model's config.json beside it, as HF and Lightning runs do.
WITH_CONFIG = (
    "import os, struct; d = os.environ['RGT_CKPT_DIR']; "
    "open(os.path.join(d, 'best.pt'), 'wb').write(b'CKPT' + struct.pack('>Q', 8) + b'w' * 8); "
    "open(os.path.join(d, 'config.json'), 'w').write('{\"hidden\": 8}')"
)


def test_verify_artifacts_keep_the_loader_off_config_json(tmp_path):
    cells = [{"name": "a", "command": [sys.executable, "-c", WITH_CONFIG]}]
    loader = [sys.executable, "-c", LOADER, "{path}"]
    chosen = make_run(tmp_path / "chosen", cells, artifacts=["best.pt", "config.json"], verify_cmd=loader,
                      verify_artifacts=["*.pt"])  # fmt: skip
    assert run(chosen) == 0 and (chosen / "DONE").exists()
    result = results(chosen)["a"]
    assert (result["sync"], sorted(a["path"] for a in result["artifacts"])) == ("verified", ["best.pt", "config.json"])
    assert result["verify"] == [{"path": "best.pt", "ok": True, "message": "verify_cmd exited 0"}]
    # Without it the loader runs on every artifact, config.json included, and the sync fails naming it.
    every = make_run(tmp_path / "every", cells, artifacts=["best.pt", "config.json"], verify_cmd=loader)
    assert run(every) == 1 and not (every / "DONE").exists()
    result = results(every)["a"]
    assert (result["status"], result["sync"]) == ("succeeded", "failed")
    assert result["sync_error"].startswith("config.json: verify_cmd exited with 1: ")
    assert [(check["path"], check["ok"]) for check in result["verify"]] == [("best.pt", True), ("config.json", False)]


def test_nan_weights_are_refused_by_the_finite_check(tmp_path):
    cells = [{"name": "nan", "command": program(tmp_path / "starts", "st", "model.safetensors", "nan")}]
    run_dir = make_run(tmp_path, cells, artifacts=["*.safetensors"], check_finite=True)
    assert run(run_dir) == 1
    result = results(run_dir)["nan"]
    assert (result["sync"], result["sync_error"]) == (
        "failed",
        "model.safetensors: tensor 'w' (F32) holds NaN at element 1",
    )


def test_a_runner_killed_during_the_copy_copies_again_without_running_the_command(tmp_path):
    starts = tmp_path / "starts"
    cells = [
        {"name": "a", "command": program(starts, "ckpt", "best.pt")},
        {"name": "b", "command": program(starts), "artifacts": []},
    ]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pt"], optional_artifacts=["*.json"])  # b: *.json, none
    assert run(run_dir) == 0
    # What kill -9 during a's copy leaves: exit.json, no result.json, a half-written temporary copy, no DONE.
    (run_dir / "cells" / "a" / "result.json").unlink()
    (run_dir / "DONE").unlink()
    for name in ("best.pt", "MANIFEST.sha256"):
        where = durable(tmp_path, "a") if name == "best.pt" else durable(tmp_path)
        (where / f".{name}.rgt-tmp-0badc0de").write_bytes(b"half")
    (durable(tmp_path, "a") / "best.pt").unlink()
    assert run(run_dir) == 0 and (run_dir / "DONE").exists()
    assert starts_of(starts) == ["start a", "start b"]  # neither cell trained again
    a = results(run_dir)["a"]
    assert (a["recopied"], a["sync"], a["command"]) == (True, "verified", cells[0]["command"])
    assert (durable(tmp_path, "a") / "best.pt").read_bytes() == (run_dir / "cells" / "a" / "best.pt").read_bytes()
    assert not [p for p in durable(tmp_path).rglob("*") if "rgt-tmp" in p.name]
    record = json.loads((run_dir / "run.json").read_text())
    assert [(c["name"], c["state"]) for c in record["cells"]] == [("a", "recopy"), ("b", "skipped")]
    assert (record["recopy_cells"], record["skipped_cells"]) == (["a"], ["b"])
    text = log(run_dir)
    assert "durable_temp_cleared count=2" in text and "cell_recopy cell=a" in text
    assert "cell_started cell=a" not in text.split("runner_started")[-1]


def test_a_sync_failed_cell_is_copied_again_with_fixed_globs_and_never_retrained(tmp_path):
    starts = tmp_path / "starts"
    cells = [{"name": "a", "command": program(starts, "ckpt", "model.pt")}]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pt"])  # the wrong glob
    assert run(run_dir) == 1
    first = results(run_dir)["a"]
    assert (first["status"], first["sync"], first["recopied"]) == ("succeeded", "failed", False)
    assert first["sync_error"] == f"artifact 'best.pt' matched no file in {run_dir / 'cells' / 'a'}"
    assert run(run_dir) == 1 and starts_of(starts) == ["start a"]  # the same globs: copied again, fails again
    respec(run_dir, artifacts=["model.pt"])
    assert run(run_dir) == 0 and (run_dir / "DONE").exists()
    assert starts_of(starts) == ["start a"]
    again = results(run_dir)["a"]
    assert (again["recopied"], again["sync"], [x["path"] for x in again["artifacts"]]) == (
        True,
        "verified",
        ["model.pt"],
    )
    assert (again["started_at"], again["ended_at"], again["exit_code"]) == (first["started_at"], first["ended_at"], 0)
    assert parse_result(again).counts_as_done(True)


def test_a_result_of_a_runner_before_exit_json_is_copied_again_too(tmp_path):
    starts = tmp_path / "starts"
    cells = [{"name": "a", "command": program(starts, "ckpt", "model.pt")}]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pt"])
    assert run(run_dir) == 1
    (run_dir / "cells" / "a" / "exit.json").unlink()
    result = json.loads((run_dir / "cells" / "a" / "result.json").read_text())
    for key in ("command", "recopied", "verify", "leftovers", "hook_failed"):
        del result[key]
    (run_dir / "cells" / "a" / "result.json").write_text(json.dumps(result))
    respec(run_dir, artifacts=["model.pt"])
    assert run(run_dir) == 0 and starts_of(starts) == ["start a"]
    assert results(run_dir)["a"]["recopied"] is True


def test_a_failed_command_runs_again_and_a_kept_result_keeps_the_argv_that_made_it(tmp_path):
    starts = tmp_path / "starts"
    crash = [sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write('start b\\n'); sys.exit(3)", str(starts)]
    cells = [{"name": "a", "command": program(starts, "ckpt", "best.pt")}, {"name": "b", "command": crash}]
    run_dir = make_run(tmp_path, cells, artifacts=["best.pt"])
    assert run(run_dir) == 1
    assert json.loads((run_dir / "cells" / "b" / "exit.json").read_text())["status"] == "failed"
    fixed = [{"name": "a", "command": program(starts, "ckpt", "best.pt", "ckpt", "extra.pt")},
             {"name": "b", "command": program(starts, "ckpt", "best.pt")}]  # fmt: skip
    respec(run_dir, cells=fixed)
    assert run(run_dir) == 0
    assert starts_of(starts) == ["start a", "start b", "start b"]  # b ran again, a was kept
    record = json.loads((run_dir / "run.json").read_text())
    a, b = record["cells"]
    assert (a["state"], a["command"], a["command_now"]) == ("skipped", cells[0]["command"], fixed[0]["command"])
    assert b["command"] == fixed[1]["command"] and "command_now" not in b
    assert results(run_dir)["b"]["command"] == fixed[1]["command"]
