"""defrag/files.py's write-then-rename and sha256 helpers."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from defrag.files import (
    TEMPORARY,
    replaced_atomically,
    sha256_file,
    sha256_stream,
    write_atomically,
)


def test_a_file_replaced_atomically_is_the_old_or_the_new(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    write_atomically(target, "old")
    with pytest.raises(RuntimeError), replaced_atomically(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    with replaced_atomically(target) as temporary:
        assert temporary.parent == tmp_path and TEMPORARY in temporary.name
        temporary.write_text("new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_folder_replaced_atomically_under_a_given_name(tmp_path: Path) -> None:
    target, staged = tmp_path / "step-1", tmp_path / "tmp-step-1"
    target.mkdir()
    (target / "old").write_text("old")
    staged.mkdir()
    with replaced_atomically(target, staged) as temporary:
        (temporary / "new").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["step-1"]
    assert [p.name for p in target.iterdir()] == ["new"]
    staged.mkdir()
    with pytest.raises(OSError), replaced_atomically(target, staged):
        raise OSError("disk full")
    assert [p.name for p in tmp_path.iterdir()] == ["step-1"]


def test_sha256_of_a_file_and_a_stream(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000  # more than one block
    (tmp_path / "data").write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert sha256_file(tmp_path / "data") == want == sha256_stream(io.BytesIO(data))
