"""Load one checkpoint the fake training program wrote, as a user's ``verify_cmd`` loads a real one.

    load_check.py PATH [--finite]

By name: ``*.safetensors`` is parsed as safetensors (header, dtypes, offsets inside the file, the data's length;
with ``--finite`` every F32/F64 value must be finite), ``*.json`` must parse, anything else must be the container of
fake_train.py (``CKPT_MAGIC``, the payload length, the payload, its sha256). Exit 0 with one ``ok`` line on stdout;
exit 1 with one line on stderr saying what is wrong (truncated, bad magic, digest mismatch, NaN ...), as a loader's
exception would. Standard library only: it runs on the fleet's bare system Python, next to fake_train.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_train import CKPT_MAGIC

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT_FORMATS = {"F32": "f", "F64": "d"}
DIGEST_BYTES = 32


class LoadError(Exception):
    """The file does not load; the message says why."""


def check_container(data: bytes) -> str:
    head = len(CKPT_MAGIC) + 8
    if len(data) < head:
        raise LoadError(f"truncated: {len(data)} bytes, shorter than the {head}-byte header")
    if data[: len(CKPT_MAGIC)] != CKPT_MAGIC:
        raise LoadError(f"not a checkpoint: bad magic {data[: len(CKPT_MAGIC)]!r}")
    (length,) = struct.unpack(">Q", data[len(CKPT_MAGIC) : head])
    present = len(data) - head - DIGEST_BYTES
    if present != length:
        raise LoadError(f"truncated: the header says {length} payload bytes, the file holds {max(present, 0)}")
    payload, digest = data[head : head + length], data[head + length :]
    if hashlib.sha256(payload).digest() != digest:
        raise LoadError("corrupt: the payload does not match its sha256")
    return f"{length} payload bytes"


def check_safetensors(data: bytes, finite: bool) -> str:
    if len(data) < 8:
        raise LoadError(f"truncated: {len(data)} bytes, no safetensors header length")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise LoadError(f"truncated: the header length says {size} bytes, the file holds {len(data) - 8}")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as error:
        raise LoadError(f"malformed safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise LoadError("malformed safetensors header: not a JSON object")
    body = data[8 + size :]
    end = 0
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    for name, info in sorted(tensors.items()):
        end = max(end, _check_tensor(name, info, body, finite))
    if end != len(body):
        raise LoadError(f"malformed: the tensors need {end} data bytes, the file holds {len(body)}")
    return f"{len(tensors)} tensor(s), {len(body)} data bytes" + (", all finite" if finite else "")


def _check_tensor(name: str, info: object, body: bytes, finite: bool) -> int:
    if not isinstance(info, dict) or info.get("dtype") not in DTYPE_BYTES:
        raise LoadError(f"malformed safetensors header: tensor {name!r} has no known dtype")
    dtype, shape, offsets = info["dtype"], info.get("shape"), info.get("data_offsets")
    numbers = (shape if isinstance(shape, list) else [None]) + (offsets if isinstance(offsets, list) else [None])
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in numbers):
        raise LoadError(f"malformed safetensors header: tensor {name!r} needs shape and data_offsets")
    begin, end = offsets
    if end > len(body):
        raise LoadError(f"truncated: tensor {name!r} ends at byte {end}, the data holds {len(body)}")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise LoadError(f"malformed safetensors header: tensor {name!r} offsets do not match its shape")
    if finite and dtype in FLOAT_FORMATS:
        count = (end - begin) // DTYPE_BYTES[dtype]
        values: List[float] = list(struct.unpack(f"<{count}{FLOAT_FORMATS[dtype]}", body[begin:end]))
        bad = sum(1 for value in values if not math.isfinite(value))
        if bad:
            raise LoadError(f"tensor {name!r} has {bad} non-finite value(s) (NaN or Inf)")
    return end


def check(path: str, finite: bool) -> str:
    if not os.path.isfile(path):
        raise LoadError("no such file")
    with open(path, "rb") as handle:
        data = handle.read()
    if path.endswith(".safetensors"):
        return check_safetensors(data, finite)
    if path.endswith(".json"):
        try:
            json.loads(data)
        except ValueError as error:
            raise LoadError(f"not JSON: {error}") from None
        return "JSON"
    return check_container(data)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--finite", action="store_true", help="every F32/F64 value of a safetensors file finite")
    args = parser.parse_args(argv)
    try:
        what = check(args.path, args.finite)
    except LoadError as error:
        print(f"load_check: {args.path}: {error}", file=sys.stderr)
        return 1
    print(f"load_check: {args.path}: ok ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
