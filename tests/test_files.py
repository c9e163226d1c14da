"""defrag/files.py's write-then-rename and sha256 helpers."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from defrag.files import (
    TEMPORARY,
    recover_replaced,
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


def test_a_folder_whose_new_copy_cannot_take_its_place_is_put_back(tmp_path: Path,
                                                                    monkeypatch) -> None:
    target = tmp_path / "step-2"
    target.mkdir()
    (target / "old").write_text("old")
    real_replace, calls = os.replace, []

    def second_rename_fails(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("the disk went away")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError), replaced_atomically(target) as temporary:
        temporary.mkdir()
        (temporary / "new").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]
    assert (target / "old").read_text() == "old"


def test_what_a_kill_left_is_put_back_or_removed(tmp_path: Path) -> None:
    """A kill between the two renames of a folder, and temporaries of killed writes."""
    (tmp_path / f".step-3{TEMPORARY}ab12cd34").mkdir()  # step-3 retired, its new copy never in
    (tmp_path / f".step-3{TEMPORARY}ab12cd34" / "old").write_text("old")
    (tmp_path / "step-4").mkdir()  # step-4 replaced, the old copy left beside it
    (tmp_path / f".step-4{TEMPORARY}00ff00ff").mkdir()
    (tmp_path / f"step-5{TEMPORARY}0a0b0c0d").mkdir()  # a new copy never renamed
    (tmp_path / f"latest{TEMPORARY}12345678").write_text("step-5")
    recover_replaced(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    assert (tmp_path / "step-3" / "old").read_text() == "old"
