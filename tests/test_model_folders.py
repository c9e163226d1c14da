"""Model folders (trainer/store/model_folder.py) that pass their checksums but must still be
refused: pickled weights (a `torch.save` zip, a plain pickle) named by what they are, and symlinks
that lead out of the folder; and a folder read once by what uses it."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from defrag import files
from tests.test_registry import VOCAB_WORDS, rewrite_checksums, tiny_model
from trainer.search.embedder import Embedder
from trainer.store import model_folder
from trainer.store.model_folder import (
    CAPTIONER,
    CAPTIONER_ENCODER,
    MODEL_FORMAT,
    VOCAB,
    WEIGHTS,
    ModelFolder,
    ModelFolderError,
    save_model_folder,
)
from trainer.store.registry import main as registry_main


def torch_save(state: dict, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer, **kwargs)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, config = tiny_model(seed=3)
    return save_model_folder(tmp_path_factory.mktemp("saved") / "model", model, config,
                             VOCAB_WORDS)


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    """A copy of the saved folder a test may change."""
    return Path(shutil.copytree(saved, tmp_path / "model"))


@pytest.mark.parametrize("kind,expected", [
    ("torch.save", "a zip archive .torch.save's format, which unpickles."),
    ("legacy torch.save", "a pickle .plain, or torch.save's legacy format."),
    ("pickle", "a pickle .plain, or torch.save's legacy format."),
])
def test_pickled_weights_are_refused_by_what_they_are(folder: Path, kind: str,
                                                      expected: str) -> None:
    state = ModelFolder.open(folder).load_model().state_dict()
    data = {"torch.save": lambda: torch_save(state),
            "legacy torch.save": lambda: torch_save(state, _use_new_zipfile_serialization=False),
            "pickle": lambda: pickle.dumps({k: v.numpy() for k, v in state.items()})}[kind]()
    (folder / WEIGHTS).write_bytes(data)
    rewrite_checksums(folder)  # the checksums match: only the content gives it away
    with pytest.raises(ModelFolderError,
                       match=f"{folder / WEIGHTS} is {expected}, not safetensors"):
        ModelFolder.open(folder)


def test_weights_that_are_not_safetensors_are_named(folder: Path) -> None:
    (folder / WEIGHTS).write_bytes(b"\xff" * 64)
    rewrite_checksums(folder)
    with pytest.raises(ModelFolderError, match=f"{folder / WEIGHTS} is not a safetensors file"):
        ModelFolder.open(folder)


def test_symlink_out_of_the_folder_is_refused(folder: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / VOCAB
    outside.parent.mkdir()
    shutil.move(folder / VOCAB, outside)
    (folder / VOCAB).symlink_to(outside)  # the same bytes: the checksums match
    with pytest.raises(ModelFolderError, match=f"{folder / VOCAB} is a link to {outside}, "
                                               "outside"):
        ModelFolder.open(folder)


def test_a_folder_reached_through_a_link_loads(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "linked").symlink_to(folder)  # e.g. models/champion -> runs/f8k/best
    ModelFolder.open(tmp_path / "linked").load_model()


def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files hashed from now on (`sha256_file` wrapped, not replaced)."""
    hashed, sha256_file = [], files.sha256_file

    def counted(path: Path) -> str:
        hashed.append(path.name)
        return sha256_file(path)

    monkeypatch.setattr(files, "sha256_file", counted)
    monkeypatch.setattr(model_folder, "sha256_file", counted)
    return hashed


def test_an_embedder_hashes_its_folder_once(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening verifies every file and takes the checksums key in one pass; the embedder built
    from the opened folder hashes nothing again."""
    hashed = count_hashes(monkeypatch)
    embedder = Embedder.from_folder(ModelFolder.open(saved))
    assert sorted(hashed) == sorted(path.name for path in saved.iterdir())
    assert embedder.model_key == files.sha256_file(saved / "checksums.json")


def captioner_shaped(root: Path, encoder: Path) -> Path:
    """A folder laid out as a captioner (captioner.json naming its encoder/ by checksums key,
    its own checksums), around a copy of `encoder`: what the store checks of a captioner."""
    folder = root / "captioner"
    shutil.copytree(encoder, folder / CAPTIONER_ENCODER)
    key = ModelFolder.open(encoder).checksums_key
    (folder / CAPTIONER).write_text(json.dumps({"encoder_checksums_sha256": key}))
    files.write_checksums(folder, format=MODEL_FORMAT)
    return folder


def test_registry_verify_refuses_a_captioner_with_another_encoder_or_an_extra_folder(
        saved: Path, tmp_path: Path) -> None:
    folder = captioner_shaped(tmp_path, saved)
    registry_main(["verify", str(folder)])  # intact
    other, config = tiny_model(seed=4)
    shutil.rmtree(folder / CAPTIONER_ENCODER)
    save_model_folder(folder / CAPTIONER_ENCODER, other, config, VOCAB_WORDS)
    with pytest.raises(SystemExit, match="is not the encoder captioner.json records"):
        registry_main(["verify", str(folder)])
    extra = captioner_shaped(tmp_path / "extra", saved)
    shutil.copytree(saved, extra / "extra")
    with pytest.raises(SystemExit, match=r"holds the folders \['encoder', 'extra'\]; a captioner"):
        registry_main(["verify", str(extra)])
