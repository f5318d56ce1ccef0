"""The fake training program's checkpoint layouts, and load_check.py refusing what a real loader would refuse."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

WORKLOAD = Path(__file__).resolve().parents[2] / "workload"


def train(out: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(WORKLOAD / "fake_train.py"), "--out", str(out), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def load(path: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(WORKLOAD / "load_check.py"), str(path), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def files(root: Path) -> List[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def test_layouts_write_what_each_framework_writes_and_every_file_loads(tmp_path: Path) -> None:
    for layout in ("plain", "lightning", "hf"):
        assert train(tmp_path / layout, "--layout", layout, "--epochs", "2").returncode == 0
    assert files(tmp_path / "plain") == ["best.pt", "last.pt"]
    assert files(tmp_path / "lightning") == ["checkpoints/epoch=1-step=6.ckpt", "checkpoints/last.ckpt"]
    assert files(tmp_path / "hf") == [
        "checkpoint-3/model.safetensors", "checkpoint-3/optimizer.pt", "checkpoint-3/trainer_state.json",
        "checkpoint-6/model.safetensors", "checkpoint-6/optimizer.pt", "checkpoint-6/trainer_state.json",
        "config.json", "model.safetensors",
    ]  # fmt: skip
    for path in [
        tmp_path / layout / name for layout in ("plain", "lightning", "hf") for name in files(tmp_path / layout)
    ]:
        done = load(path, "--finite")
        assert (done.returncode, done.stderr) == (0, ""), path
        assert done.stdout.startswith(f"load_check: {path}: ok (")


def test_a_truncated_best_checkpoint_exits_0_and_does_not_load(tmp_path: Path) -> None:
    assert train(tmp_path, "--layout", "plain", "--truncate-best").returncode == 0
    done = load(tmp_path / "best.pt")
    assert done.returncode == 1
    assert done.stderr == (
        f"load_check: {tmp_path / 'best.pt'}: truncated: the header says 4096 payload bytes, the file holds 2024\n"
    )
    assert load(tmp_path / "last.pt").returncode == 0


def test_nan_weights_fail_only_the_finite_check_and_a_cut_safetensors_never_loads(tmp_path: Path) -> None:
    assert train(tmp_path, "--layout", "hf", "--nan-weights").returncode == 0
    model = tmp_path / "model.safetensors"
    assert load(model).returncode == 0
    done = load(model, "--finite")
    assert (done.returncode, done.stderr.split(": ", 2)[2]) == (
        1,
        "tensor 'weight' has 1 non-finite value(s) (NaN or Inf)\n",
    )
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(model.read_bytes()[:-10])
    assert "truncated: tensor 'weight' ends at byte 4096, the data holds 4086" in load(cut).stderr
    cut.write_bytes(model.read_bytes() + b"junk")
    assert "malformed: the tensors need 4096 data bytes, the file holds 4100" in load(cut).stderr
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\x80\x02not ours at all")
    assert "not a checkpoint: bad magic" in load(garbage).stderr
    assert load(tmp_path / "absent.pt").stderr.endswith("absent.pt: no such file\n")


def test_starts_file_and_the_detached_helper(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    for _start in range(2):
        assert train(tmp_path, "--starts-file", str(starts), "--detach-helper", "30").returncode == 0
    assert [line.split()[0] for line in starts.read_text().splitlines()] == ["start", "start"]
    pid = int((tmp_path / "helper.pid").read_text())
    try:
        assert os.getsid(pid) == pid  # a session of its own
        assert Path(f"/proc/{pid}/environ").read_bytes() == b""  # no environment: no run marker to find it by
    finally:
        os.kill(pid, 9)
        time.sleep(0.05)
