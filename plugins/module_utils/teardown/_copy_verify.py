# Copyright (c) remote_gpu.trainer contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether a copy of a run's artifacts holds what it should: every file there, a plain file inside the copy's
root, with the expected size and a sha256 recomputed now.

Teardown's gate uses it on the box (the durable copy, and the scratch files it was made from) and on the controller
(the pulled copy): the digests in ``result.json`` and ``MANIFEST.sha256`` are what a copy must match, never proof
that it does. Every read happens in a forked child under one deadline (``_deadline``): a hung mount costs the
deadline, not the whole teardown. Pure standard library.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ansible_collections.remote_gpu.trainer.plugins.module_utils.common._deadline import run_with_deadline
from ansible_collections.remote_gpu.trainer.plugins.module_utils.layout._runs import SHA256_PATTERN
from ansible_collections.remote_gpu.trainer.plugins.module_utils.runner._cell_sync import BAD_MARK, hash_file

MAX_REPORTED = 50  # mismatches and extra files listed per copy; the counts are always whole
DEFAULT_TIMEOUT_S = 1800.0
MAX_PATH_CHARS, MAX_KIND_CHARS = 500, 40  # a known-bad mark is read from the box: bounded


def known_bad(manifest_text: str) -> List[Dict[str, str]]:
    """``[{path, bad}]``: the files ``MANIFEST.sha256`` marks as known bad (``# bad  <kind>  <path>``: a check of the
    run refused the copy, for example ``non-finite`` weights or ``verify_cmd``), in the manifest's order."""
    found: List[Dict[str, str]] = []
    for line in manifest_text.splitlines():
        if not line.startswith(BAD_MARK):
            continue
        fields = line[len(BAD_MARK) :].split("  ", 1)
        if len(fields) == 2 and fields[0].strip() and fields[1].strip():
            found.append({"path": fields[1][:MAX_PATH_CHARS], "bad": fields[0].strip()[:MAX_KIND_CHARS]})
    return found


def checked_relative(path: Any) -> str:
    """A copy-relative path that cannot leave the copy's root; ValueError otherwise."""
    text = str(path) if isinstance(path, str) else ""
    parts = text.split("/")
    if not text or text.startswith("/") or any(part in ("", ".", "..") for part in parts) or "\x00" in text:
        raise ValueError(f"{path!r} is not a plain relative path (no leading /, no . or .. parts)")
    return text


def checked_expected(entries: Any) -> List[Dict[str, Any]]:
    """``[{path, size, sha256}]``, validated (a bad entry is a ValueError naming it)."""
    if not isinstance(entries, list):
        raise ValueError("expected must be a list of {path, size, sha256}")
    checked: List[Dict[str, Any]] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"expected[{index}] must be a dict with path, size and sha256")
        size, sha256 = entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"expected[{index}].size must be a non-negative integer, got {size!r}")
        if not isinstance(sha256, str) or not SHA256_PATTERN.match(sha256):
            raise ValueError(f"expected[{index}].sha256 must be 64 lowercase hex digits, got {sha256!r}")
        try:
            path = checked_relative(entry.get("path"))
        except ValueError as exc:
            raise ValueError(f"expected[{index}].path: {exc}") from None
        checked.append({"path": path, "size": size, "sha256": sha256})
    return checked


def _digest_one(root: str, real_root: str, relative: str) -> Dict[str, Any]:
    path = os.path.join(root, relative)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return {"problem": "missing"}
    except OSError as exc:
        return {"problem": f"cannot be read: {exc.strerror or exc}"}
    if stat.S_ISLNK(info.st_mode):
        return {"problem": "a symbolic link, not a copy: it would not survive its target"}
    if not stat.S_ISREG(info.st_mode):
        return {"problem": "not a regular file"}
    if not os.path.realpath(path).startswith(real_root.rstrip("/") + "/"):
        return {"problem": "reached through a symbolic link out of the copy's directory"}
    try:
        size, sha256 = hash_file(path, drop_cache=True)
    except OSError as exc:
        return {"problem": f"cannot be read: {exc.strerror or exc}"}
    return {"size": size, "sha256": sha256}


def digests(root: str, relatives: Sequence[str], timeout_s: float) -> Dict[str, Any]:
    """``{"files": {relative: {size, sha256} or {problem}}}``, or ``{"problem": ...}`` when ``root`` itself is
    missing, not a directory or did not answer within ``timeout_s``."""

    def probe() -> Dict[str, Any]:
        if not os.path.isdir(root):
            return {"problem": f"{root} does not exist" if not os.path.lexists(root) else f"{root} is not a directory"}
        real_root = os.path.realpath(root)
        return {"files": {relative: _digest_one(root, real_root, relative) for relative in relatives}}

    answer = run_with_deadline({"digests": probe}, timeout_s)["digests"]
    if answer.get("timed_out"):
        return {"problem": f"{root} did not answer within {timeout_s:g} s (a hung mount?)"}
    if "error" in answer:
        return {"problem": f"{root}: {answer['error']}"}
    return answer["value"]


def mismatch(entry: Mapping[str, Any], found: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """How a file found differs from its expected entry; None when it matches."""
    base = {"path": entry["path"], "expected_size": entry["size"], "expected_sha256": entry["sha256"]}
    if "problem" in found:
        return {**base, "problem": found["problem"], "size": None, "sha256": None}
    report = {**base, "size": found["size"], "sha256": found["sha256"]}
    if found["size"] != entry["size"]:
        return {**report, "problem": f"{found['size']} bytes, expected {entry['size']}"}
    if found["sha256"] != entry["sha256"]:
        return {**report, "problem": "same size, different sha256 (the content changed)"}
    return None


def verify_copy(
    root: str, expected: Sequence[Mapping[str, Any]], timeout_s: float = DEFAULT_TIMEOUT_S
) -> Dict[str, Any]:
    """Recompute every expected file under ``root`` and compare; ``passed`` only when every one matches."""
    entries = checked_expected(list(expected))
    answer = digests(root, [entry["path"] for entry in entries], timeout_s)
    if "problem" in answer:
        return {"passed": False, "files": 0, "bytes": 0, "mismatches": [], "reason": answer["problem"]}
    found = answer["files"]
    mismatches = [m for m in (mismatch(entry, found[entry["path"]]) for entry in entries) if m is not None]
    verified = [entry for entry in entries if "size" in found[entry["path"]]]
    result: Dict[str, Any] = {
        "passed": not mismatches,
        "files": len(verified),
        "bytes": sum(found[entry["path"]]["size"] for entry in verified),
        "mismatches": mismatches[:MAX_REPORTED],
        "reason": "",
    }
    if mismatches:
        first = mismatches[0]
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        result["reason"] = f"{first['path']} under {root}: {first['problem']}{more}"
    return result
