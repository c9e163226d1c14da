"""Vocabulary rules: the 1% relation threshold, minimum word count, word-vector dictionary."""

from pathlib import Path

import pytest

from defrag.vocab import Vocabulary
from featurizer.vocabulary import (
    build_vocabulary,
    coverage,
    kept_relations,
    vocabulary_file,
    words_from_counts,
    words_from_vectors,
)


def test_relations_need_one_percent_of_training_triplets() -> None:
    counts = {"det": 500, "amod": 300, "nsubj": 190, "prep": 10, "rare": 9, "once": 1}  # of 1010
    assert kept_relations(counts, 0.01) == ["det", "amod", "nsubj"]
    counts["prep"] = 11  # 11 / 1011 >= 1%
    assert kept_relations(counts, 0.01) == ["det", "amod", "nsubj", "prep"]
    assert kept_relations({}, 0.01) == []
    assert kept_relations({"b": 5, "a": 5}, 0.5) == ["a", "b"]  # ties: alphabetical


def test_words_need_the_minimum_count() -> None:
    counts = {"dog": 9, "a": 20, "cat": 5, "zebra": 4, "bee": 5}
    assert words_from_counts(counts, 5) == ["a", "dog", "bee", "cat"]
    assert words_from_counts(counts, 1)[-1] == "zebra"


def test_word_vector_file_gives_the_dictionary(tmp_path: Path) -> None:
    glove = tmp_path / "glove.txt"
    glove.write_text("the 0.1 0.2\ndog 0.3 0.4\nParis 0.5 0.6\nthe 0.7 0.8\nrare 0 0\n")
    assert words_from_vectors(glove) == ["the", "dog", "rare"]  # cased entries never match
    word2vec = tmp_path / "w2v.txt"
    word2vec.write_text("2 2\ncat 1 2\ndog 3 4\n")
    assert words_from_vectors(word2vec) == ["cat", "dog"]  # header skipped
    vocab = build_vocabulary({"det": 3}, {"zzz": 100}, min_fraction=0.01, min_count=1,
                             word_vectors=glove)
    assert vocab.words == ["the", "dog", "rare"] and vocab.relations == ["det"]
    with pytest.raises(FileNotFoundError):
        words_from_vectors(tmp_path / "missing.txt")
    binary = tmp_path / "w2v.bin"
    binary.write_bytes(b"3 2\n\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="binary word2vec"):
        words_from_vectors(binary)


def test_vocabulary_from_counts_and_coverage() -> None:
    vocab = build_vocabulary({"det": 99, "weird": 1}, {"a": 5, "dog": 5, "cat": 1},
                             min_fraction=0.02, min_count=2)
    assert vocab.words == ["a", "dog"] and vocab.relations == ["det"]
    assert coverage(vocab, {"a": 5, "dog": 3, "cat": 2}) == pytest.approx(0.8)
    assert coverage(vocab, {}) == 0.0


def test_vocabulary_file_accepts_a_file_or_a_folder(tmp_path: Path) -> None:
    Vocabulary(words=["a"], relations=["det"]).save(tmp_path / "vocab.json")
    assert vocabulary_file(tmp_path) == tmp_path / "vocab.json"
    assert vocabulary_file(tmp_path / "vocab.json") == tmp_path / "vocab.json"
    with pytest.raises(FileNotFoundError, match="no vocabulary"):
        vocabulary_file(tmp_path / "model")
