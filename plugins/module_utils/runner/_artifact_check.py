# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Is a copied artifact loadable, not only copied? The launch side of teardown's load check.

After an artifact's copy in durable_dir was verified byte for byte, the run may ask two more things of it:

- ``verify_cmd``: the user's loader, an argv run on the copy (``{path}`` in an element is replaced by the copy's
  absolute path, else the path is appended), under the same rules as teardown's load check
  (``teardown/_load_verify.run_check``: no shell, its own session, killed as a group on timeout, output tail kept).
  A non-zero exit, a signal or a timeout is a failure whose message ends with the loader's own last lines.
  ``verify_artifacts`` chooses the artifacts it runs on (a checkpoint loader cannot take ``config.json``), with
  teardown's ``load_verify_artifacts`` matching: fnmatch over the path relative to the checkpoint directory, ``*``
  matching ``/`` too; ``**/`` also matches no directory, as in the artifact globs. Empty: every artifact.
- ``check_finite``: every F16 / BF16 / F32 / F64 tensor of a ``*.safetensors`` file holds no NaN or Inf. The file is
  read in bounded chunks; a header that lies (bad JSON, offsets past the end, a size that does not fit the shape)
  is a failure too, since no loader would take it.

A failed check says what kind of bad the copy is (``bad``: ``non-finite``, ``not-safetensors``, ``verify_cmd``):
the sync marks it so in the run's ``MANIFEST.sha256`` (``_cell_sync``), and teardown names it.

Pure standard library (Python 3.8+).
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._load_verify import (
    DEFAULT_TIMEOUT_S,
    run_check,
    why_failed,
)

PATH_FIELD = "{path}"
OUTPUT_BYTES = 4000  # the loader's output kept while it runs
MESSAGE_LINES = 3  # its last lines quoted in the message
MESSAGE_CHARS = 400
SAFETENSORS_SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
CHUNK_BYTES = 8 * 1024 * 1024
# What a failed check marks the copy as: a tensor holds NaN/Inf, no safetensors file at all, the user's loader refused.
BAD_NON_FINITE, BAD_NOT_SAFETENSORS, BAD_VERIFY_CMD = "non-finite", "not-safetensors", "verify_cmd"
_NOT_LOADABLE = "not a loadable safetensors file"
_UNREADABLE = "cannot be read"
# Bytes per element of the dtypes safetensors names; a tensor of another dtype is not size-checked.
ITEM_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def _table(test: Callable[[int], bool]) -> bytes:
    """A bytes.translate table mapping each byte to 1 where ``test`` holds, else to 0."""
    return bytes(1 if test(value) else 0 for value in range(256))


# A little-endian IEEE float is NaN or Inf exactly when its exponent bits are all ones. Per dtype: (element size,
# [(offset of a byte within the element, which values of that byte carry all-ones exponent bits)]); an element is
# non-finite when every listed byte says so.
_ALL_ONES_HIGH = _table(lambda b: b & 0x7F == 0x7F)
NON_FINITE = {
    "F16": (2, [(1, _table(lambda b: b & 0x7C == 0x7C))]),
    "BF16": (2, [(1, _ALL_ONES_HIGH), (0, _table(lambda b: b & 0x80 == 0x80))]),
    "F32": (4, [(3, _ALL_ONES_HIGH), (2, _table(lambda b: b & 0x80 == 0x80))]),
    "F64": (8, [(7, _ALL_ONES_HIGH), (6, _table(lambda b: b & 0xF0 == 0xF0))]),
}


class ArtifactError(Exception):
    """Why an artifact cannot be the checkpoint it claims to be."""


def _value(dtype: str, element: bytes) -> float:
    if dtype == "BF16":  # the upper half of an F32
        return float(struct.unpack("<f", b"\0\0" + element)[0])
    return float(struct.unpack({"F16": "<e", "F32": "<f", "F64": "<d"}[dtype], element)[0])


def _first_non_finite(handle: Any, start: int, length: int, dtype: str, stopped: Callable[[], bool]) -> Optional[int]:
    """Index of the first NaN/Inf element of the tensor at ``start`` (``length`` bytes), or None."""
    size, tests = NON_FINITE[dtype]
    chunk = CHUNK_BYTES - CHUNK_BYTES % size  # whole elements only: strides stay aligned across chunks
    handle.seek(start)
    done = 0
    while done < length:
        if stopped():
            raise ArtifactError("run stopped during the check")
        want = min(chunk, length - done)
        data = handle.read(want)
        if len(data) != want:
            raise ArtifactError("the file ended inside a tensor (changed while it was checked?)")
        flags = -1
        for offset, table in tests:
            # One byte per element, 1 where this byte has the exponent's bits set; AND across the element's bytes.
            marks = data[offset::size].translate(table)
            if b"\x01" not in marks:
                flags = 0
                break
            flags &= int.from_bytes(marks, "big")
        if flags:
            count = want // size
            return done // size + count - 1 - (flags.bit_length() - 1) // 8  # the most significant is the first
        done += want
    return None


def _header(handle: Any, file_size: int) -> Tuple[Dict[str, Any], int]:
    """The JSON header and where the data starts; ArtifactError when it is not a well-formed one."""
    raw = handle.read(8)
    if len(raw) != 8:
        raise ArtifactError(f"{file_size} bytes: too short for a safetensors header")
    length = int.from_bytes(raw, "little")
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise ArtifactError(f"its header length {length} does not fit the file's {file_size} bytes")
    try:
        header = json.loads(handle.read(length).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ArtifactError("its header is not a JSON object")
    return header, 8 + length


def _tensor(name: str, entry: Any, data_bytes: int) -> Tuple[str, int, int]:
    """(dtype, begin, end) of a header entry, checked against the shape and the file's size."""
    if not isinstance(entry, dict):
        raise ArtifactError(f"tensor {name!r}: its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")

    def integers(value: Any, count: Optional[int] = None) -> bool:
        plain = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return plain and all(v >= 0 for v in value) and (count is None or len(value) == count)

    if not isinstance(dtype, str) or not integers(shape) or not integers(offsets, 2) or offsets[0] > offsets[1]:
        raise ArtifactError(f"tensor {name!r}: dtype, shape or data_offsets malformed")
    begin, end = offsets
    if end > data_bytes:
        raise ArtifactError(f"tensor {name!r}: data_offsets [{begin}, {end}] run past the file's {data_bytes} bytes")
    if dtype in ITEM_SIZES and (end - begin) != math.prod(shape) * ITEM_SIZES[dtype]:
        raise ArtifactError(f"tensor {name!r}: {end - begin} bytes do not hold a {dtype} tensor of shape {shape}")
    return dtype, begin, end


def check_finite(path: str, stopped: Callable[[], bool] = lambda: False) -> Tuple[bool, str]:
    """(every float tensor of the safetensors file ``path`` is finite, what was found)."""
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            header, data_start = _header(handle, file_size)
            tensors = [
                (name, *_tensor(name, entry, file_size - data_start))
                for name, entry in header.items()
                if name != "__metadata__"
            ]
            floats = 0
            for name, dtype, begin, end in tensors:
                if dtype not in NON_FINITE:
                    continue
                floats += 1
                index = _first_non_finite(handle, data_start + begin, end - begin, dtype, stopped)
                if index is not None:
                    size = NON_FINITE[dtype][0]
                    handle.seek(data_start + begin + index * size)
                    value = _value(dtype, handle.read(size))
                    what = "NaN" if math.isnan(value) else f"{value}".replace("inf", "Inf")
                    return False, f"tensor {name!r} ({dtype}) holds {what} at element {index}"
    except ArtifactError as exc:
        return False, f"{_NOT_LOADABLE}: {exc}"
    except OSError as exc:
        return False, f"{_UNREADABLE}: {exc.strerror or exc}"
    return True, f"{floats} float tensor(s) finite"


def _variants(pattern: str) -> List[str]:
    """The pattern with each ``**/`` kept or dropped: ``**/*.pt`` also names ``best.pt`` at the top."""
    pieces = pattern.split("**/")
    if len(pieces) == 1 or len(pieces) > 5:  # more than four "**/" in one glob: no variants, as written
        return [pattern]
    joins = itertools.product(("**/", ""), repeat=len(pieces) - 1)
    return ["".join(p + j for p, j in zip(pieces, (*join, ""))) for join in joins]


def chosen(relative: str, patterns: Sequence[str]) -> bool:
    """``relative`` (an artifact's path under the checkpoint directory) is one of ``patterns``; all when empty."""
    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(relative, variant) for pattern in patterns for variant in _variants(pattern))


def command_for(template: Sequence[str], path: str) -> List[str]:
    """The verify argv for one artifact: ``{path}`` replaced where it appears, else the path appended."""
    if any(PATH_FIELD in part for part in template):
        return [part.replace(PATH_FIELD, path) for part in template]
    return [*template, path]


def _last_lines(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = " | ".join(lines[-MESSAGE_LINES:])
    return said if len(said) <= MESSAGE_CHARS else "..." + said[-MESSAGE_CHARS:]


def run_verify_cmd(template: Sequence[str], path: str, timeout_s: float) -> Tuple[bool, str]:
    """(the loader took the artifact at ``path``, what happened, ending with its own last lines on a failure)."""
    check = run_check(path, command_for(template, path), timeout_s, OUTPUT_BYTES)
    why = why_failed(check, timeout_s)
    if why is None:
        return True, "verify_cmd exited 0"
    said = _last_lines(str(check.get("output_tail") or ""))
    return False, f"verify_cmd {why}" + (f": {said}" if said else "")


@dataclass(frozen=True)
class Verifier:
    """What a run asks of each copied artifact (RunSpec ``verify_cmd``, ``verify_timeout_s``, ``check_finite``,
    ``verify_artifacts``: the artifacts ``verify_cmd`` runs on; the finite check is on every safetensors file)."""

    command: Optional[Tuple[str, ...]] = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    check_finite: bool = False
    artifacts: Tuple[str, ...] = ()

    def check(self, relative: str, path: str, stopped: Callable[[], bool] = lambda: False) -> Optional[Dict[str, Any]]:
        """``{path: relative, ok, message}`` for the copy at ``path`` (a failure adds ``bad``, its kind); None when
        nothing applies to it."""
        said: List[str] = []
        if self.check_finite and path.lower().endswith(SAFETENSORS_SUFFIX):
            ok, message = check_finite(path, stopped)
            if not ok:
                kind = BAD_NOT_SAFETENSORS if message.startswith((_NOT_LOADABLE, _UNREADABLE)) else BAD_NON_FINITE
                return {"path": relative, "ok": False, "message": message, "bad": kind}
            said.append(message)
        if self.command and chosen(relative, self.artifacts):
            ok, message = run_verify_cmd(self.command, path, self.timeout_s)
            if not ok:
                return {"path": relative, "ok": False, "message": message, "bad": BAD_VERIFY_CMD}
            said.append(message)
        return {"path": relative, "ok": True, "message": "; ".join(said)} if said else None
