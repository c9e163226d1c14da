"""The rules that build the word dictionary and relation table saved with the shards (paper 4).

- Relation types: kept when they make at least `min_fraction` (1%) of the training split's
  triplets, most frequent first (the paper: hundreds of types -> about 20).
- Words: every lowercase word of a word-vector file when one is given (GloVe or word2vec *text*
  format, file order), else the training captions' words seen at least
  `min_count` times, most frequent first.
- Or reuse the tables of an existing featurized training set or registered model (`vocab.json`),
  so a new split is encoded exactly like the data the model was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from defrag.shard_format import VOCAB
from defrag.urls import join_url, read_url
from defrag.vocab import Vocabulary


def kept_relations(counts: Mapping[str, int], min_fraction: float) -> list[str]:
    """Relation types with at least `min_fraction` of all triplets, most frequent first."""
    total = sum(counts.values())
    kept = [rel for rel, n in counts.items() if total and n / total >= min_fraction]
    return sorted(kept, key=lambda rel: (-counts[rel], rel))


def words_from_counts(counts: Mapping[str, int], min_count: int) -> list[str]:
    """Words seen at least `min_count` times, most frequent first (ties alphabetical)."""
    return sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))


def words_from_vectors(path: Path) -> list[str]:
    """The lowercase words of a GloVe / word2vec text file, in file order, without repeats.

    Caption tokens are lowercased, so a cased entry ("Paris") could never match one; keeping the
    file's own spelling lets trainer.wordvecs find every dictionary word's row by exact match.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"word-vector file {path} does not exist")
    words: dict[str, None] = {}
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                fields = line.rstrip().split(" ")
                if number == 1 and len(fields) == 2 and all(f.isdigit() for f in fields):
                    continue  # word2vec header: "<count> <dim>"
                if fields[0] and fields[0] == fields[0].lower():
                    words.setdefault(fields[0])
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err}); binary word2vec files must be "
                         f"converted to text") from err
    if not words:
        raise ValueError(f"{path}: no lowercase words in the word-vector file")
    return list(words)


def build_vocabulary(relation_counts: Mapping[str, int], word_counts: Mapping[str, int], *,
                     min_fraction: float, min_count: int,
                     word_vectors: Path | None = None) -> Vocabulary:
    """The vocabulary of a training split from its triplet relation and token counts."""
    words = (words_from_vectors(word_vectors) if word_vectors is not None
             else words_from_counts(word_counts, min_count))
    return Vocabulary(words=words, relations=kept_relations(relation_counts, min_fraction))


def vocabulary_file(path: Path) -> Path:
    """`path` itself, or the vocab.json inside a featurized dataset or model folder."""
    path = Path(path)
    file = path / VOCAB if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no vocabulary at {file} (give a vocab.json or a folder holding "
                                f"one: a featurized dataset or a registered model)")
    return file


def reused_vocabulary(location: str | Path) -> Vocabulary:
    """The vocabulary at `location`: a vocab.json or a folder holding one (a featurized set or a
    model), on disk or at an http(s) URL."""
    location = str(location)
    if location.startswith(("http://", "https://")):
        is_file = urlsplit(location).path.endswith(".json")  # a signed URL ends in its query
        url = location if is_file else join_url(location, VOCAB)
        return Vocabulary.from_json(read_url(url), url)
    return Vocabulary.load(vocabulary_file(Path(location)))


def coverage(vocab: Vocabulary, word_counts: Mapping[str, int]) -> float:
    """Fraction of caption tokens (with repeats) that are in the dictionary."""
    total = sum(word_counts.values())
    known = sum(n for w, n in word_counts.items() if w in vocab.word_index)
    return known / total if total else 0.0
