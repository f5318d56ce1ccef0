"""The collection tarball holds the collection and nothing a training checkout keeps beside it.

A renter's checkout of the collection often also holds a training venv, checkpoints and tracker output; one such
tree once made a 3 GB tarball. The build runs the real ``ansible-galaxy collection build`` on a copy of the tracked
files plus that clutter, under names no list of venv names would guess.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from ansible_collections.remote_gpu.trainer.tests.collection_path import REPO

CLUTTER = {
    "trainenv/lib/python3.11/site-packages/torch/lib/libtorch.so": 2 * 1024 * 1024,
    "trainenv/bin/python3": 1024,
    "trainenv/pyvenv.cfg": 64,
    "miniconda/envs/ml/lib/python3.10/site-packages/x.so": 1024 * 1024,
    "miniconda/envs/ml/conda-meta/history": 64,
    ".venv/lib/python3.12/site-packages/a.py": 1024,
    "checkpoints/best.pt": 1024 * 1024,
    "experiments/run1/checkpoint-500/model.safetensors": 1024 * 1024,
    "experiments/run1/lightning_logs/version_0/checkpoints/last.ckpt": 1024 * 1024,
    "wandb/run-20261204/files/output.log": 4096,
    "outputs/2026-12-04/train.log": 4096,
    ".env": 64,
}


def tracked_copy(destination: Path) -> None:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, timeout=60
    ).stdout.split(b"\0")
    for name in filter(None, names):
        source = REPO / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def test_a_checkout_with_a_venv_and_checkpoints_builds_a_small_tarball_without_them(tmp_path: Path) -> None:
    tree = tmp_path / "checkout"
    tracked_copy(tree)
    for name, size in CLUTTER.items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
    galaxy = Path(sys.executable).with_name("ansible-galaxy")
    subprocess.run(
        [str(galaxy), "collection", "build", "--output-path", str(tmp_path / "dist"), str(tree)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (tarball,) = (tmp_path / "dist").glob("remote_gpu-trainer-*.tar.gz")
    with tarfile.open(tarball) as archive:
        names = {member.name for member in archive.getmembers() if member.isfile()}
    # Empty directories above an ignored one may stay; no file of the clutter may.
    leaked = sorted(name for name in names if any(name.startswith(top.split("/")[0]) for top in CLUTTER))
    assert leaked == []
    assert {"plugins/modules/training_run.py", "roles/launch/meta/argument_specs.yml", "meta/runtime.yml"} <= names
    assert tarball.stat().st_size < 1024 * 1024
