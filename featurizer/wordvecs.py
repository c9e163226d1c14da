"""Word vectors learned from a featurized set's own training captions (word2vec, gensim).

The paper fixes pretrained 200-d vectors (W_e of eq. 1). Where no pretrained file can be had,
skip-gram vectors trained on the training captions are the closest substitute; they are written
as a word2vec text file that `model.word_vectors` (trainer/wordvecs.py) reads like any other.
"""

from __future__ import annotations

import json
import logging
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from gensim.models import Word2Vec

log = logging.getLogger(__name__)


def caption_tokens(shards_dir: str | Path, split: str = "train") -> Iterator[list[str]]:
    """The token list of every caption in `<shards_dir>/<split>/*.tar`, shard by shard."""
    shards = sorted((Path(shards_dir) / split).glob("*.tar"))
    if not shards:
        raise FileNotFoundError(f"no shards in {Path(shards_dir) / split}: featurize the "
                                f"dataset first (defrag featurize ...)")
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    for caption in json.load(tar.extractfile(member))["captions"]:
                        yield caption["tokens"]


def _stable_hash(text: str) -> int:
    """gensim seeds each word's initial vector with a hash: Python's own changes per process."""
    return zlib.crc32(text.encode())


def learn_word_vectors(shards_dir: str | Path, out: str | Path, dim: int = 200,
                       window: int = 5, epochs: int = 10, min_count: int = 1,
                       seed: int = 0) -> int:
    """Train skip-gram vectors on the training captions; write a word2vec text file.

    Deterministic for a given input and seed (one worker thread, a stable hash). Returns the
    number of words written.
    """
    sentences = list(caption_tokens(shards_dir))
    model = Word2Vec(sentences, vector_size=dim, window=window, min_count=min_count, sg=1,
                     epochs=epochs, seed=seed, workers=1, hashfxn=_stable_hash)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    model.wv.save_word2vec_format(str(out), binary=False)
    log.info("word vectors: %d words x %d from %d captions -> %s", len(model.wv), dim,
             len(sentences), out)
    return len(model.wv)
