"""Loadable, not only copied: the user's verify command per artifact and the finite-weights check of safetensors."""

from __future__ import annotations

import json
import struct
import sys
import time

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner import _artifact_check
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._artifact_check import (
    Verifier,
    check_finite,
    command_for,
    run_verify_cmd,
)

NAN, INF = float("nan"), float("inf")
# A loader in the spirit of torch.load: a magic, the payload's length, the payload; a short file raises.
LOADER = """
import struct, sys
data = open(sys.argv[1], "rb").read()
if data[:4] != b"CKPT":
    raise ValueError("not a checkpoint")
(length,) = struct.unpack(">Q", data[4:12])
if len(data) - 12 < length:
    raise RuntimeError(f"PytorchStreamReader failed reading file data: truncated ({len(data) - 12} of {length} bytes)")
"""


def checkpoint(payload: bytes) -> bytes:
    return b"CKPT" + struct.pack(">Q", len(payload)) + payload


def encode(dtype: str, values) -> bytes:
    """Little-endian raw tensor bytes; BF16 is the upper half of each F32."""
    if dtype == "BF16":
        return b"".join(struct.pack("<f", value)[2:] for value in values)
    code = {"F16": "e", "F32": "f", "F64": "d"}[dtype]
    return struct.pack(f"<{len(values)}{code}", *values)


def safetensors(tensors, header_patch=None) -> bytes:
    """A safetensors file: u64 header length, the JSON header (space-padded to 8), the tensors' bytes."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, values in tensors:
        raw = encode(dtype, values) if isinstance(values, list) else values
        size = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8}[dtype]
        header[name] = {"dtype": dtype, "shape": [len(raw) // size], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header.update(header_patch or {})
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


def write(tmp_path, data: bytes, name="model.safetensors"):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
@pytest.mark.parametrize(("bad", "said"), [(NAN, "NaN"), (INF, "Inf"), (-INF, "-Inf")])
def test_a_non_finite_weight_is_found_in_every_float_dtype(tmp_path, dtype, bad, said):
    values = [0.5 * i for i in range(1000)]
    values[700] = bad
    path = write(tmp_path, safetensors([("embed", "I64", struct.pack("<4q", 1, 2, 3, -1)), ("w", dtype, values)]))
    assert check_finite(path) == (False, f"tensor 'w' ({dtype}) holds {said} at element 700")


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_clean_weights_pass_even_at_the_dtypes_largest_finite_values(tmp_path, dtype):
    largest = {"F16": 65504.0, "BF16": 3.3895313892515355e38, "F32": 3.4028234663852886e38, "F64": sys.float_info.max}
    values = [largest[dtype], -largest[dtype], 0.0, -0.0, 1e-5, 3.0] * 50
    path = write(tmp_path, safetensors([("a", dtype, values), ("b", "F32", [1.0, 2.0])]))
    assert check_finite(path) == (True, "2 float tensor(s) finite")


def test_the_element_is_found_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(_artifact_check, "CHUNK_BYTES", 30)  # not a multiple of 4: chunks stay element-aligned
    for index in (0, 6, 7, 8, 999):
        values = [1.0] * 1000
        values[index] = NAN
        path = write(tmp_path, safetensors([("w", "F32", values)]))
        assert check_finite(path) == (False, f"tensor 'w' (F32) holds NaN at element {index}")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x10\x00", "too short for a safetensors header"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776 does not fit the file's 10 bytes"),
        (struct.pack("<Q", 8) + b"{not js}", "its header is not JSON"),
        (struct.pack("<Q", 8) + b"[1, 2]  ", "its header is not a JSON object"),
        (
            safetensors([("w", "F32", [1.0, 2.0])], {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4096]}}),
            "tensor 'w': data_offsets [0, 4096] run past the file's 8 bytes",
        ),
        (
            safetensors([("w", "F32", [1.0, 2.0])], {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
            "tensor 'w': 8 bytes do not hold a F32 tensor of shape [3]",
        ),
        (
            safetensors([("w", "F32", [1.0])], {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}),
            "tensor 'w': dtype, shape or data_offsets malformed",
        ),
    ],
)
def test_a_header_that_lies_is_a_failure(tmp_path, data, message):
    ok, said = check_finite(write(tmp_path, data))
    assert not ok and said.startswith("not a loadable safetensors file: ") and message in said, said


def test_a_missing_file_is_a_failure_with_its_reason(tmp_path):
    assert check_finite(str(tmp_path / "gone.safetensors")) == (False, "cannot be read: No such file or directory")


def test_the_path_replaces_its_field_or_is_appended():
    assert command_for(["load", "--ckpt={path}", "{path}"], "/d/best.pt") == ["load", "--ckpt=/d/best.pt", "/d/best.pt"]
    assert command_for(["python3", "load.py"], "/d/best.pt") == ["python3", "load.py", "/d/best.pt"]


def test_a_truncated_checkpoint_is_refused_with_the_loaders_own_message(tmp_path):
    good = write(tmp_path, checkpoint(b"w" * 1000), "good.pt")
    cut = write(tmp_path, checkpoint(b"w" * 1000)[:500], "best.pt")
    loader = [sys.executable, "-c", LOADER, "{path}"]
    assert run_verify_cmd(loader, good, 30) == (True, "verify_cmd exited 0")
    ok, message = run_verify_cmd(loader, cut, 30)
    assert not ok
    assert message.startswith("verify_cmd exited with 1: ")
    assert message.endswith("RuntimeError: PytorchStreamReader failed reading file data: truncated (488 of 1000 bytes)")


def test_a_loader_that_hangs_is_killed_at_its_timeout(tmp_path):
    started = time.monotonic()
    ok, message = run_verify_cmd(["bash", "-c", "sleep 60", "loader"], write(tmp_path, b"x", "best.pt"), 1)
    assert (ok, message) == (False, "verify_cmd timed out after 1 s (its process group was killed)")
    assert time.monotonic() - started < 15


def test_a_loader_that_cannot_start_says_so(tmp_path):
    ok, message = run_verify_cmd(["/nonexistent/loader"], write(tmp_path, b"x", "best.pt"), 5)
    assert not ok and "could not start: program not found: /nonexistent/loader" in message


def test_the_verifier_checks_what_applies_to_each_artifact(tmp_path):
    weights = write(tmp_path, safetensors([("w", "F32", [1.0, NAN])]))
    clean = write(tmp_path, safetensors([("w", "F32", [1.0])]), "clean.safetensors")
    best = write(tmp_path, checkpoint(b"w"), "best.pt")
    finite_only = Verifier(check_finite=True)
    assert finite_only.check("best.pt", best) is None  # not a safetensors file: nothing to check
    assert finite_only.check("model.safetensors", weights) == {
        "path": "model.safetensors",
        "ok": False,
        "message": "tensor 'w' (F32) holds NaN at element 1",
        "bad": "non-finite",  # what the manifest marks it as
    }
    lying = write(tmp_path, b"\xff" * 8, "lying.safetensors")
    assert finite_only.check("lying.safetensors", lying)["bad"] == "not-safetensors"
    both = Verifier((sys.executable, "-c", LOADER), 30, check_finite=True)
    assert both.check("best.pt", best) == {"path": "best.pt", "ok": True, "message": "verify_cmd exited 0"}
    said = both.check("clean.safetensors", clean)
    # Only the last lines: where the traceback starts depends on the Python (3.13 adds the -c source lines).
    assert said is not None and not said["ok"] and said["message"].startswith("verify_cmd exited with 1: ")
    assert said["message"].endswith("| ValueError: not a checkpoint")  # the loader's last lines, one line
    assert said["bad"] == "verify_cmd" and "bad" not in both.check("best.pt", best)
    assert Verifier().check("best.pt", best) is None


@pytest.mark.parametrize(
    ("relative", "patterns", "expected"),
    [
        ("best.pt", (), True),  # none given: every artifact
        ("best.pt", ("*.pt",), True),
        ("config.json", ("*.pt",), False),
        ("sub/best.pt", ("*.pt",), True),  # "*" matches "/" too, as teardown's load_verify_artifacts
        ("best.pt", ("**/*.pt",), True),  # "**/" may match no directory, as in the artifact globs
        ("a/b/best.pt", ("**/*.pt",), True),
        ("ckpt/model.safetensors", ("ckpt/**/*.safetensors", "*.pt"), True),
        ("other/model.safetensors", ("ckpt/**/*.safetensors",), False),
        ("BEST.PT", ("*.pt",), False),  # case matters, as on the box's filesystem
    ],
)
def test_verify_artifacts_choose_by_the_path_under_the_checkpoint_dir(relative, patterns, expected):
    assert _artifact_check.chosen(relative, patterns) is expected


def test_the_verify_command_runs_only_on_the_chosen_artifacts_the_finite_check_on_every_safetensors(tmp_path):
    config = write(tmp_path, b'{"hidden": 8}', "config.json")
    best = write(tmp_path, checkpoint(b"w"), "best.pt")
    weights = write(tmp_path, safetensors([("w", "F32", [1.0, INF])]))
    chosen = Verifier((sys.executable, "-c", LOADER), 30, check_finite=True, artifacts=("*.pt",))
    assert chosen.check("config.json", config) is None  # the loader never sees it
    assert chosen.check("best.pt", best) == {"path": "best.pt", "ok": True, "message": "verify_cmd exited 0"}
    said = chosen.check("model.safetensors", weights)
    assert said == {
        "path": "model.safetensors",
        "ok": False,
        "message": "tensor 'w' (F32) holds Inf at element 1",
        "bad": "non-finite",
    }
    every = Verifier((sys.executable, "-c", LOADER), 30)
    refused = every.check("config.json", config)
    assert refused is not None and not refused["ok"] and refused["message"].endswith("ValueError: not a checkpoint")
