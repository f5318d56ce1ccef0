"""Build the GPU simulator into a directory and print the environment that activates it.

    python tests/fakegpu/build.py build --out DIR
        DIR/lib/libnvidia-ml.so.1      the fake NVML library (gcc), rebuilt only when its inputs changed
        DIR/bin/{nvidia-smi,dmesg,journalctl}
        DIR/bin-nolib/{dmesg,journalctl}, DIR/lib-absent/   for scenarios with driver.library: absent
    python tests/fakegpu/build.py env --out DIR --scenario FILE
        KEY=VALUE lines: FAKEGPU_SCENARIO, PATH, LD_LIBRARY_PATH, FAKEGPU_STATE_DIR

From Python: ``environment(out_dir, scenario_path)`` builds if needed and returns the same variables.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from scenario import ScenarioError, load  # noqa: E402

SOURCE = os.path.join(HERE, "fakenvml.c")
FLATTEN = os.path.join(HERE, "flatten.py")
LIBRARY = "libnvidia-ml.so.1"
COMPILE_TIMEOUT_S = 120
# Executable name -> (module, extra arguments to its main()).
TOOLS = {"nvidia-smi": ("nvidia_smi", ""), "dmesg": ("dmesg", ""), "journalctl": ("dmesg", ', "journalctl"')}
NOLIB_TOOLS = ("dmesg", "journalctl")


class BuildError(RuntimeError):
    """The simulator could not be built (e.g. no C compiler)."""


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _compile_command(output: str) -> List[str]:
    return [
        "gcc",
        "-shared",
        "-fPIC",
        "-O2",
        "-pthread",
        "-Wl,-soname," + LIBRARY,
        f"-DFAKEGPU_PYTHON={_c_string(sys.executable)}",
        f"-DFAKEGPU_FLATTEN={_c_string(FLATTEN)}",
        "-o",
        output,
        SOURCE,
    ]


def _write_if_changed(path: str, content: str, mode: int) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            if handle.read() == content:
                return
    except OSError:
        pass
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(content)
    os.chmod(temp, mode)
    os.replace(temp, path)


def _wrapper(module: str, extra: str) -> str:
    # -E -s: the caller's PYTHONPATH or user site must not change what the fake tools import.
    return (
        f"#!{sys.executable} -Es\n"
        "import sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        f"from {module} import main\n"
        f"sys.exit(main(sys.argv[1:]{extra}))\n"
    )


def _build_library(lib_dir: str) -> None:
    output = os.path.join(lib_dir, LIBRARY)
    with open(SOURCE, "rb") as handle:
        source = handle.read()
    stamp_text = hashlib.sha256(source + "\0".join(_compile_command(output)).encode()).hexdigest()
    stamp = os.path.join(lib_dir, ".stamp")
    if os.path.exists(output) and os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as handle:
            if handle.read() == stamp_text:
                return
    if shutil.which("gcc") is None:
        raise BuildError("gcc not found on PATH: the fake libnvidia-ml.so.1 is compiled from C (install gcc)")
    temp = f"{output}.tmp-{os.getpid()}"
    try:
        result = subprocess.run(
            _compile_command(temp), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"gcc did not finish within {COMPILE_TIMEOUT_S} s") from exc
    if result.returncode != 0:
        raise BuildError(f"gcc failed to compile {SOURCE}:\n{result.stderr}")
    os.replace(temp, output)
    _write_if_changed(stamp, stamp_text, 0o644)


def build(out_dir: str) -> str:
    """Build the simulator into ``out_dir`` (idempotent, fast when up to date); returns its absolute path."""
    out_dir = os.path.abspath(out_dir)
    dirs = {name: os.path.join(out_dir, name) for name in ("lib", "bin", "bin-nolib", "lib-absent", "state")}
    for path in dirs.values():
        os.makedirs(path, exist_ok=True)
    _build_library(dirs["lib"])
    for name, (module, extra) in TOOLS.items():
        _write_if_changed(os.path.join(dirs["bin"], name), _wrapper(module, extra), 0o755)
        if name in NOLIB_TOOLS:
            _write_if_changed(os.path.join(dirs["bin-nolib"], name), _wrapper(module, extra), 0o755)
    return out_dir


def environment(out_dir: str, scenario_path: str) -> Dict[str, str]:
    """The variables that make a process (started with them) see the scenario's box."""
    out_dir = build(out_dir)
    scenario = load(scenario_path)
    absent = scenario["driver"]["library"] == "absent"
    bin_dir = os.path.join(out_dir, "bin-nolib" if absent else "bin")
    return {
        "FAKEGPU_SCENARIO": os.path.abspath(scenario_path),
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", os.defpath)]),
        "LD_LIBRARY_PATH": os.path.join(out_dir, "lib-absent" if absent else "lib"),
        "FAKEGPU_STATE_DIR": os.path.join(out_dir, "state"),
    }


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="build.py", description=__doc__.split("\n", maxsplit=1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="build the simulator into --out")
    build_cmd.add_argument("--out", required=True)
    env_cmd = commands.add_parser("env", help="print KEY=VALUE lines for a scenario")
    env_cmd.add_argument("--out", required=True)
    env_cmd.add_argument("--scenario", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build(args.out))
        else:
            for key, value in environment(args.out, args.scenario).items():
                print(f"{key}={value}")
    except (BuildError, ScenarioError) as exc:
        print(f"build.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
