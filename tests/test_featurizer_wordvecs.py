"""`defrag featurize wordvecs`: word2vec vectors from the training captions of real shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from defrag.vocab import Vocabulary
from featurizer.command import main
from featurizer.wordvecs import caption_tokens
from trainer.wordvecs import load_word_vectors


def test_vectors_cover_the_vocabulary_and_are_deterministic(shards: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    for out in (first, second):
        assert main(["wordvecs", "--shards", str(shards), "--out", str(out), "--dim", "16",
                     "--epochs", "2"]) == 0
    assert first.read_bytes() == second.read_bytes()
    vocab = Vocabulary.load(shards / "vocab.json")
    words, vectors = load_word_vectors(first, only=vocab.words)
    assert vectors.shape == (len(vocab.words), 16)  # every dictionary word is a training token
    assert sum(len(t) for t in caption_tokens(shards)) > 40 * 5


def test_missing_shards_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="wordvecs: error: no shards in .*: featurize the "):
        main(["wordvecs", "--shards", str(tmp_path), "--out", str(tmp_path / "v.txt")])
