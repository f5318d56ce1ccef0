"""The runtime role's two scripts: the controller's build of the one-file installer and the box's install with it."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Dict, List

FILES = Path(__file__).resolve().parents[3] / "roles" / "runtime" / "files"
BUILD = FILES / "build_wheelhouse.py"
INSTALL = FILES / "runtime_install.py"
TAG = "py3.11-x86_64"


def make_wheel(directory: Path, name: str, version: str = "1.0") -> Path:
    """A pure-Python wheel with one module, ``<name>.py``; enough for pip to install it offline."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VALUE = {name!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in {**files, f"{dist}/RECORD": record}.items():
            wheel.writestr(member, text)
    return path


def build(cache: Path, wheelhouse: Path, packages: List[str]) -> Dict[str, object]:
    result = subprocess.run(
        [sys.executable, str(BUILD), "--cache", str(cache), "--tag", TAG, "--wheelhouse", str(wheelhouse), *packages],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return json.loads(result.stdout)  # pip's own output went to stderr: stdout is the one JSON object


def embedded_archive(script: Path) -> tarfile.TarFile:
    """The archive a built installer carries (its EMBEDDED_ARCHIVE line)."""
    line = next(line for line in script.read_text().splitlines() if line.startswith("EMBEDDED_ARCHIVE = "))
    return tarfile.open(fileobj=io.BytesIO(base64.b64decode(line.split('"')[1])), mode="r:gz")


def test_the_installer_carries_the_installed_packages_and_is_built_once(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    make_wheel(wheelhouse, "rgtdemo")
    cache = tmp_path / "cache"

    first = build(cache, wheelhouse, ["rgtdemo"])
    again = build(cache, wheelhouse, ["rgtdemo"])

    script = Path(str(first["script"]))
    assert first["built"] is True and again == {"script": str(script), "built": False}
    assert script.parent == cache / "archives" and script.name.startswith(f"runtime-{TAG}-")
    with embedded_archive(script) as tar:
        names = tar.getnames()
        owners = {(member.uid, member.gid) for member in tar.getmembers()}
    assert "rgtdemo.py" in names and "rgtdemo-1.0.dist-info/METADATA" in names
    assert not [name for name in names if name.endswith(".pyc")]  # the box's Python compiles its own
    assert owners == {(0, 0)}
    assert "def from_archive" in script.read_text()  # the whole installer, the archive inside it


def test_a_changed_wheelhouse_gets_a_new_installer(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    make_wheel(wheelhouse, "rgtdemo")
    cache = tmp_path / "cache"
    before = build(cache, wheelhouse, ["rgtdemo"])
    make_wheel(wheelhouse, "rgtdemo", "1.1")

    after = build(cache, wheelhouse, ["rgtdemo"])

    assert after["built"] is True and after["script"] != before["script"]


def make_archive(path: Path, members: Dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def run_installer(script: Path, *args: str) -> subprocess.CompletedProcess:
    # As the role runs it: ansible.builtin.script with the box's Python as the executable.
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_the_built_installer_makes_a_venv_without_pip_that_imports_the_packages(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    make_wheel(wheelhouse, "rgtdemo")
    script = Path(str(build(tmp_path / "cache", wheelhouse, ["rgtdemo"])["script"]))
    venv = tmp_path / "data" / ".remote_gpu_trainer" / "venv"

    done = run_installer(script, str(venv), "--embedded")

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["entries"] == ["rgtdemo-1.0.dist-info", "rgtdemo.py"]
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", "import rgtdemo; print(rgtdemo.VALUE)"],
                              capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert imported.stdout.strip() == "rgtdemo"
    assert not list((venv / "bin").glob("pip*"))
    assert not (venv / ".unpack").exists()
    assert [path.name for path in venv.parent.iterdir()] == ["venv"]  # nothing left beside the venv


def test_the_plain_installer_has_nothing_embedded(tmp_path: Path) -> None:
    done = run_installer(INSTALL, str(tmp_path / "venv"), "--embedded")

    assert done.returncode != 0 and "no archive embedded" in done.stderr


def test_an_entry_that_climbs_out_of_site_packages_is_refused(tmp_path: Path) -> None:
    archive = make_archive(tmp_path / "runtime-x.tar.gz", {"../../../escaped.py": "", "ok.py": ""})

    done = run_installer(INSTALL, str(tmp_path / "venv"), "--archive", str(archive))

    assert done.returncode != 0 and "refusing archive entry" in done.stderr
    assert not list(tmp_path.rglob("escaped.py")) and not list(tmp_path.rglob("ok.py"))
    assert not os.path.exists(tmp_path.parent / "escaped.py")
