# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Create the runtime venv and install its packages (roles/runtime), on the box, in one command.

    python3 runtime-<tag>-<digest>.py VENV_DIR --embedded
    python3 runtime_install.py VENV_DIR --archive ARCHIVE
    python3 runtime_install.py VENV_DIR --index PIP_TIMEOUT_S REQUIREMENT ...

Run by the box's base Python (3.8+, standard library only), through ansible.builtin.script. The venv gets
--system-site-packages, so the image's own packages stay visible and untouched.

``--embedded``: files/build_wheelhouse.py writes, on the controller, a copy of this script with the packages
already installed for the box's Python and architecture embedded in it (EMBEDDED_ARCHIVE, a base64 .tar.gz), so
one file travels and nothing else does. The venv needs no pip (nor ensurepip, nor Debian's python3-venv):
unpacking into its site-packages is the whole install. Entries are unpacked into a staging directory inside the
venv, then renamed into place one top-level entry at a time, so an interrupted run leaves no half-written package.
``--archive`` does the same from a .tar.gz file.

``--index``: a venv with pip (ensurepip), then ``pip install`` from the box's own index.

Prints one JSON object; a failure exits non-zero with the reason on stderr.
"""

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv

STEP_TIMEOUT_S = 120
EMBEDDED_ARCHIVE = None  # build_wheelhouse.py puts the archive here (base64 of a .tar.gz)


def site_packages(venv_dir):
    # Asked of the venv's own Python: distributions patch the base Python's install schemes (Debian's
    # dist-packages), not a venv's.
    python = os.path.join(venv_dir, "bin", "python")
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    answer = subprocess.run([python, "-c", code], check=True, stdout=subprocess.PIPE, timeout=STEP_TIMEOUT_S)
    return answer.stdout.decode().strip()


def unpack(archive, site, staging):
    """``archive``: a file object of a .tar.gz."""
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=archive, mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.name.startswith("/") or ".." in member.name.split("/") or member.issym() or member.islnk():
                raise SystemExit(f"refusing archive entry {member.name!r}")
        # Python's "data" filter (3.8.17+, 3.9.17+, 3.10.12+, 3.11.4+) also drops odd modes and device files.
        options = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(staging, **options)
    entries = sorted(os.listdir(staging))
    for name in entries:
        target = os.path.join(site, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)
    os.rmdir(staging)
    return entries


def from_archive(venv_dir, archive):
    venv.EnvBuilder(system_site_packages=True, symlinks=True, with_pip=False).create(venv_dir)
    site = site_packages(venv_dir)
    return {
        "venv": venv_dir,
        "site_packages": site,
        "entries": unpack(archive, site, os.path.join(venv_dir, ".unpack")),
    }


def from_index(venv_dir, pip_timeout_s, requirements):
    python = os.path.join(venv_dir, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv_dir], check=True,
                       timeout=STEP_TIMEOUT_S)  # fmt: skip
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-warn-script-location"]
    pip += ["--timeout", "30"]
    subprocess.run(pip + requirements, check=True, stdout=sys.stderr, timeout=pip_timeout_s)
    return {"venv": venv_dir, "site_packages": site_packages(venv_dir), "installed": requirements}


def main(argv):
    venv_dir, mode = argv[0], argv[1]
    if mode == "--embedded":
        if EMBEDDED_ARCHIVE is None:
            raise SystemExit("no archive embedded in this copy of runtime_install.py")
        return from_archive(venv_dir, io.BytesIO(base64.b64decode(EMBEDDED_ARCHIVE)))
    if mode == "--archive":
        with open(argv[2], "rb") as archive:
            return from_archive(venv_dir, archive)
    if mode == "--index":
        return from_index(venv_dir, float(argv[2]), argv[3:])
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    try:
        print(json.dumps(main(sys.argv[1:])))
    except subprocess.CalledProcessError as exc:
        sys.exit(f"{' '.join(exc.cmd[:4])} ... exited {exc.returncode}")
    except (OSError, subprocess.TimeoutExpired, tarfile.TarError) as exc:
        sys.exit(f"{type(exc).__name__}: {exc}")
