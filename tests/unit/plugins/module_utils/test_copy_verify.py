"""_copy_verify: a copy matches only with every file there, plain, inside its root, of the right size and sha256."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown import _copy_verify
from ansible_collections.remote_gpu.trainer.plugins.module_utils.teardown._copy_verify import (
    checked_expected,
    verify_copy,
)


def entry(path: str, data: bytes) -> Dict[str, Any]:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture
def copy(tmp_path: Path) -> List[Dict[str, Any]]:
    (tmp_path / "cells" / "a").mkdir(parents=True)
    (tmp_path / "cells" / "a" / "best.pth").write_bytes(b"x" * 3000)
    (tmp_path / "cells" / "a" / "notes.txt").write_bytes(b"")
    return [entry("cells/a/best.pth", b"x" * 3000), entry("cells/a/notes.txt", b"")]


def test_a_matching_copy_passes_with_counts(tmp_path, copy):
    result = verify_copy(str(tmp_path), copy)
    assert result == {"passed": True, "files": 2, "bytes": 3000, "mismatches": [], "reason": ""}


def test_each_kind_of_difference_is_a_mismatch_naming_the_file(tmp_path, copy):
    (tmp_path / "cells" / "a" / "best.pth").write_bytes(b"x" * 2999 + b"y")
    os.unlink(tmp_path / "cells" / "a" / "notes.txt")
    result = verify_copy(str(tmp_path), [*copy, entry("cells/b/gone.pt", b"z")])
    problems = {m["path"]: m["problem"] for m in result["mismatches"]}
    assert problems == {
        "cells/a/best.pth": "same size, different sha256 (the content changed)",
        "cells/a/notes.txt": "missing",
        "cells/b/gone.pt": "missing",
    }
    assert result["passed"] is False
    assert result["reason"].startswith("cells/a/best.pth under ") and "(and 2 more)" in result["reason"]
    assert result["files"] == 1


def test_a_symlink_or_a_path_through_a_symlinked_directory_is_not_a_copy(tmp_path, copy):
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "best.pth").write_bytes(b"x" * 3000)
    (tmp_path / "cells" / "a" / "best.pth").unlink()
    (tmp_path / "cells" / "a" / "best.pth").symlink_to(outside / "best.pth")
    (tmp_path / "cells" / "b").symlink_to(outside)
    result = verify_copy(str(tmp_path), [copy[0], {**copy[0], "path": "cells/b/best.pth"}])
    problems = [m["problem"] for m in result["mismatches"]]
    assert "symbolic link" in problems[0]
    assert "out of the copy's directory" in problems[1]


def test_a_missing_root_or_a_file_where_the_root_should_be_fails_with_a_reason(tmp_path, copy):
    assert verify_copy(str(tmp_path / "nope"), copy)["reason"].endswith("does not exist")
    (tmp_path / "file").write_text("x")
    assert verify_copy(str(tmp_path / "file"), copy)["reason"].endswith("is not a directory")


def test_a_hung_read_fails_within_the_deadline(tmp_path, copy, monkeypatch):
    def hang(*_args: Any) -> Dict[str, Any]:
        time.sleep(30)
        return {}

    monkeypatch.setattr(_copy_verify, "_digest_one", hang)
    started = time.monotonic()
    result = verify_copy(str(tmp_path), copy, timeout_s=1)
    assert time.monotonic() - started < 10
    assert "did not answer within 1 s" in result["reason"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"path": "../x", "size": 1, "sha256": "a" * 64}, "not a plain relative path"),
        ({"path": "/etc/passwd", "size": 1, "sha256": "a" * 64}, "not a plain relative path"),
        ({"path": "a//b", "size": 1, "sha256": "a" * 64}, "not a plain relative path"),
        ({"path": "a", "size": -1, "sha256": "a" * 64}, "size must be a non-negative integer"),
        ({"path": "a", "size": True, "sha256": "a" * 64}, "size must be a non-negative integer"),
        ({"path": "a", "size": float("nan"), "sha256": "a" * 64}, "size must be a non-negative integer"),
        ({"path": "a", "size": 1, "sha256": "A" * 64}, "sha256 must be 64 lowercase hex"),
        ("cells/a", "must be a dict"),
    ],
)
def test_bad_expected_entries_are_refused_naming_the_entry(bad, message):
    with pytest.raises(ValueError, match=message) as raised:
        checked_expected([bad])
    assert "expected[0]" in str(raised.value)
