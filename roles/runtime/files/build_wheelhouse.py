# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Build, on the controller, the one file the runtime role sends a box: its venv's packages, installed, in a script.

    build_wheelhouse.py --cache DIR --tag py3.11-x86_64 [--wheelhouse DIR] [--timeout S] PACKAGE ...

Runs on the controller (the runtime role calls it once per box Python and architecture). Without
``--wheelhouse`` it first downloads the wheels for that tag into ``DIR/<tag>`` (``pip download``); then it
installs them for the tag's Python and architecture into a staging tree (``pip install --target --platform``,
no index, no byte-compiling), packs the tree as a .tar.gz and embeds it (base64) in a copy of
files/runtime_install.py: ``DIR/archives/runtime-<tag>-<digest>.py``. The role runs that script on the box with
ansible.builtin.script (one transfer, no module), which makes the venv and unpacks the packages into it: no pip on
the box, no file left behind but the venv.

The digest covers the tag, the requirements, the wheels' names and sizes and the installer's text, so a changed
wheelhouse or installer gets a new script and an unchanged one is never rebuilt. Everything appears complete or
not at all (a ``.complete`` marker for the wheelhouse, a rename for the script), so parallel runs and interrupted
downloads leave no half file. Prints one JSON object on stdout (pip's own output goes to stderr): ``script``, its
path, and ``built``, false when it was already there.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

# Bump when the archive's layout changes, so caches of older layouts are not reused.
ARCHIVE_FORMAT = "2"
INSTALLER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime_install.py")
PLACEHOLDER = "EMBEDDED_ARCHIVE = None  # build_wheelhouse.py puts the archive here (base64 of a .tar.gz)\n"


def parse_tag(tag: str) -> tuple:
    """'py3.11-x86_64' -> ('3.11', 'x86_64')."""
    version, _sep, machine = tag.removeprefix("py").partition("-")
    if not version or not machine:
        raise SystemExit(f"bad wheel tag {tag!r}: expected py<major>.<minor>-<machine>")
    return version, machine


def target_options(tag: str) -> list:
    """pip options that pick wheels for the box's Python and architecture, not the controller's."""
    version, machine = parse_tag(tag)
    platforms = [f"manylinux2014_{machine}", f"manylinux_2_17_{machine}", f"manylinux2010_{machine}", "any"]
    options = ["--only-binary=:all:", "--python-version", version, "--implementation", "cp"]
    return options + [arg for platform in platforms for arg in ("--platform", platform)]


def download(dest: str, tag: str, packages: list, timeout: int) -> None:
    """The wheels for the tag into ``dest``, atomically (a ``.complete`` marker in a renamed directory)."""
    if os.path.exists(os.path.join(dest, ".complete")):
        return
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--dest", staging]
    try:
        subprocess.run(command + target_options(tag) + packages, check=True, timeout=timeout, stdout=sys.stderr)
        with open(os.path.join(staging, ".complete"), "w") as marker:
            marker.write(tag + "\n")
        os.chmod(staging, 0o755)
        os.rename(staging, dest)
    except OSError:
        if not os.path.exists(os.path.join(dest, ".complete")):  # another run may have won the rename
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def digest(tag: str, packages: list, wheelhouse: str) -> str:
    wheels = sorted((name, os.path.getsize(os.path.join(wheelhouse, name)))
                    for name in os.listdir(wheelhouse) if name.endswith(".whl"))  # fmt: skip
    if not wheels:
        raise SystemExit(f"no wheels in {wheelhouse}")
    with open(INSTALLER, "rb") as installer:
        installer_sha = hashlib.sha256(installer.read()).hexdigest()
    text = json.dumps([ARCHIVE_FORMAT, tag, sorted(packages), wheels, installer_sha])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # The box's root owns what it unpacks; the controller's user and group mean nothing there.
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def build_script(script: str, wheelhouse: str, tag: str, packages: list, timeout: int) -> None:
    """Install the packages for the box into a staging tree, pack it (entries sorted) and embed it in the installer."""
    directory = os.path.dirname(script)
    os.makedirs(directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".partial-", dir=directory)
    tree = os.path.join(staging, "site")
    command = [
        sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-warn-script-location",
        # The box's Python compiles on first import; .pyc files built here would be for the controller's Python.
        "--no-compile", "--no-index", "--find-links", wheelhouse, "--target", tree,
    ]  # fmt: skip
    try:
        subprocess.run(command + target_options(tag) + packages, check=True, timeout=timeout, stdout=sys.stderr)
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w:gz", compresslevel=6) as tar:
            for name in sorted(os.listdir(tree)):
                tar.add(os.path.join(tree, name), arcname=name, filter=_normalised)
        with open(INSTALLER, encoding="utf-8") as installer:
            text = installer.read()
        if PLACEHOLDER not in text:
            raise SystemExit(f"{INSTALLER} lost its EMBEDDED_ARCHIVE line")
        embedded = f'EMBEDDED_ARCHIVE = "{base64.b64encode(packed.getvalue()).decode()}"\n'
        partial = os.path.join(staging, "runtime.py")
        with open(partial, "w", encoding="utf-8") as out:
            out.write(text.replace(PLACEHOLDER, embedded, 1))
        os.chmod(partial, 0o644)
        os.replace(partial, script)  # same content whichever parallel run wins
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", required=True, help="controller cache: DIR/<tag> wheels, DIR/archives the scripts")
    parser.add_argument("--tag", required=True, help="py<major>.<minor>-<machine>, as the role's probe prints it")
    parser.add_argument("--wheelhouse", default="", help="wheels to install from (default: download into the cache)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    parse_tag(args.tag)  # a bad tag stops here, before anything is created
    wheelhouse = args.wheelhouse or os.path.join(args.cache, args.tag)
    if not args.wheelhouse:
        download(wheelhouse, args.tag, args.packages, args.timeout)
    name = f"runtime-{args.tag}-{digest(args.tag, args.packages, wheelhouse)}.py"
    script = os.path.join(args.cache, "archives", name)
    built = not os.path.exists(script)
    if built:
        build_script(script, wheelhouse, args.tag, args.packages, args.timeout)
    print(json.dumps({"script": script, "built": built}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
