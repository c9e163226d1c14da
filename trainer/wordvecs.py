"""Pretrained word vectors (the W_e of eq. 1) from GloVe or word2vec text files.

Both formats are one `word v1 ... vd` row per line; word2vec text files start with a
`count dim` header line, which is detected and checked. Binary word2vec files are not read:
convert them to text first.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


def load_word_vectors(path: str | Path, only: Collection[str] | None = None,
                      ) -> tuple[list[str], torch.Tensor]:
    """Words and their vectors [n, dim] from a GloVe or word2vec text file.

    Every row is checked (a wrong value count or a non-number is a ValueError naming the file and
    line); a repeated word keeps its first row. `only` keeps just those words, so a
    multi-million-word file costs memory for the vocabulary only.
    """
    path = Path(path)
    words: list[str] = []
    rows: list[np.ndarray] = []
    seen: set[str] = set()
    dim = header_count = None
    rows_read = 0
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                parts = line.rstrip().split(" ")
                if parts == [""]:
                    continue  # blank line, e.g. at the end of the file
                if number == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                    header_count, dim = int(parts[0]), int(parts[1])  # word2vec header
                    continue
                if dim is None:
                    dim = len(parts) - 1
                if len(parts) != dim + 1 or dim == 0:
                    raise ValueError(f"{path}:{number}: expected a word and {dim or 'some'} "
                                     f"values, got {len(parts) - 1} values")
                rows_read += 1
                word = parts[0]
                if word in seen or (only is not None and word not in only):
                    _parse_values(parts[1:], path, number)  # still validate the row
                    continue
                seen.add(word)
                words.append(word)
                rows.append(_parse_values(parts[1:], path, number))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err}); binary word2vec files must be "
                         "converted to text") from err
    if dim is None:
        raise ValueError(f"{path}: no word vectors in the file")
    if header_count is not None and header_count != rows_read:
        raise ValueError(f"{path}: the word2vec header announces {header_count} words, the file "
                         f"has {rows_read} (truncated download?)")
    vectors = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, dim)
    return words, vectors


def _parse_values(values: list[str], path: Path, number: int) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float32)
    except ValueError as err:
        raise ValueError(f"{path}:{number}: a value is not a number ({err})") from err


def embedding_matrix(words: list[str], path: str | Path | None, dim: int,
                     seed: int = 0) -> torch.Tensor:
    """W_e rows [len(words), d] aligned with `words` (a Vocabulary's word order).

    Words found in the file get its vectors; the others, and every word when `path` is None, get
    seeded N(0, sigma^2) rows, sigma = the file's value std (unknown words look like known ones)
    or 1/sqrt(dim) without a file (unit expected norm). With a file, the file's dimension is used
    and `dim` (ModelConfig.word_dim) is ignored, so a config need not repeat the file's size.
    """
    generator = torch.Generator().manual_seed(seed)
    if path is None:
        return torch.randn(len(words), dim, generator=generator) / dim**0.5
    file_words, vectors = load_word_vectors(path, only=set(words))
    if not file_words:
        raise ValueError(f"{path}: none of the {len(words)} vocabulary words has a vector; "
                         "wrong file or vocabulary?")
    sigma = vectors.std().item() if vectors.numel() > 1 else 1.0 / vectors.shape[1] ** 0.5
    matrix = torch.randn(len(words), vectors.shape[1], generator=generator) * sigma
    row = {w: i for i, w in enumerate(words)}
    matrix[[row[w] for w in file_words]] = vectors
    log.info("word vectors: %d of %d vocabulary words found in %s (dim %d)",
             len(file_words), len(words), path, vectors.shape[1])
    return matrix
