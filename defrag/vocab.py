"""The word dictionary and relation table shared by the featurizer, the trainer and a model.

A caption as the featurizer stores it is `{"text", "tokens", "triplets"}` with lowercased tokens
and triplets `[relation, governor, dependent]`. `Vocabulary.encode` turns it into the sentence
fragments of one of the paper's three modes, as rows `(relation id, word id, word id)`;
`encode_words` into its word ids in order (the whole-sentence encoders' input), `encode_tree` into
its dependency tree over those words (the tree encoders' input).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FRAGMENT_MODES = ("triplet", "bow", "bigram")
VOCAB_FORMAT = 1


@dataclass
class Vocabulary:
    """Words (row order of W_e) and kept relation types (one (W_R, b_R) each)."""

    words: list[str]
    relations: list[str]

    def __post_init__(self) -> None:
        self.word_index = {w: i for i, w in enumerate(self.words)}
        self.relation_index = {r: i for i, r in enumerate(self.relations)}
        if len(self.word_index) != len(self.words):
            raise ValueError("vocabulary: duplicate words in the word list")
        if len(self.relation_index) != len(self.relations):
            raise ValueError("vocabulary: duplicate relation types in the relation table")

    def num_relations(self, mode: str) -> int:
        """How many (W_R, b_R) the sentence encoder needs in `mode` (BoW and bigram share one)."""
        return len(self.relations) if mode == "triplet" else 1

    def encode(self, caption: dict, mode: str = "triplet") -> torch.Tensor:
        """Sentence fragments of one caption as a LongTensor [n, 3] of (relation, w1, w2).

        Fragments with a word outside the dictionary or a dropped relation type are skipped
        (paper 4: such words are discarded), so n may be 0.
        """
        return torch.from_numpy(self.encode_array(caption, mode))

    def encode_array(self, caption: dict, mode: str = "triplet") -> np.ndarray:
        """`encode` as an int64 numpy array (what the shard reader keeps)."""
        if mode == "triplet":
            rows = [
                (self.relation_index[rel], self.word_index[w1], self.word_index[w2])
                for rel, w1, w2 in caption["triplets"]
                if rel in self.relation_index and w1 in self.word_index and w2 in self.word_index
            ]
        elif mode == "bow":
            rows = [(0, self.word_index[w], self.word_index[w])
                    for w in caption["tokens"] if w in self.word_index]
        elif mode == "bigram":
            tokens = caption["tokens"]
            rows = [(0, self.word_index[a], self.word_index[b])
                    for a, b in zip(tokens, tokens[1:], strict=False)
                    if a in self.word_index and b in self.word_index]
        else:
            raise ValueError(f"fragment mode {mode!r}: expected one of {FRAGMENT_MODES}")
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def encode_words(self, caption: dict) -> np.ndarray:
        """The caption's word ids in sentence order, int64 [n]; words outside the dictionary are
        dropped, as `encode` drops their fragments (paper 4), so n may be 0."""
        return np.array([self.word_index[w] for w in caption["tokens"] if w in self.word_index],
                        dtype=np.int64)

    @property
    def other_relation(self) -> int:
        """The relation id of every relation type outside the relation table (`encode_tree`)."""
        return len(self.relations)

    def encode_tree(self, caption: dict) -> np.ndarray:
        """The caption's dependency tree over its `encode_words` words, int64 [n, 2]: per kept
        word, its head's position among the kept words (-1 for a root) and its relation id.

        A word dropped from the dictionary does not break the tree: its kept children hang on
        its nearest kept ancestor (a root if none), each keeping its own relation, as the
        featurizer does for a head that is punctuation. A relation outside the relation table
        (dropped as too rare, or a "root" kept by none) is `other_relation`. The caption's
        "tree" (shard format 2) is checked: lists as long as "tokens", heads in range, no cycle
        (ValueError otherwise)."""
        tokens, tree = caption["tokens"], caption["tree"]
        heads, relations = tree["heads"], tree["relations"]
        n = len(tokens)
        if len(heads) != n or len(relations) != n:
            raise ValueError(f"tree of {len(heads)} heads and {len(relations)} relations for "
                             f"{n} tokens")
        position = {}  # token index -> position among the kept words
        for index, token in enumerate(tokens):
            if token in self.word_index:
                position[index] = len(position)
        rows = []
        for index in position:
            head, steps = heads[index], 0
            while head != -1 and head not in position:  # climb over dropped words
                if not (isinstance(head, int) and 0 <= head < n) or steps > n:
                    raise ValueError(f"tree: head {head!r} of token {index} is out of range "
                                     f"or in a cycle")
                head, steps = heads[head], steps + 1
            rows.append((position[head] if head != -1 else -1,
                         self.relation_index.get(relations[index], self.other_relation)))
        tree_rows = np.array(rows, dtype=np.int64).reshape(-1, 2)
        _check_acyclic(tree_rows[:, 0])
        return tree_rows

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    def to_json(self) -> str:
        """The vocab.json text (read by `from_json`)."""
        data = {"format": VOCAB_FORMAT, "words": self.words, "relations": self.relations}
        return json.dumps(data, ensure_ascii=False)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        try:
            text = Path(path).read_bytes()
        except OSError as err:
            raise ValueError(f"{path}: cannot read the vocabulary ({err})") from err
        return cls.from_json(text, str(path))

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> Vocabulary:
        """The vocabulary saved as `text` (read from `where`, named in errors)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: cannot read the vocabulary ({err})") from err
        if not isinstance(data, dict) or data.get("format") != VOCAB_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: vocabulary format {found!r}, "
                             f"this code reads format {VOCAB_FORMAT}")
        return cls(words=list(data["words"]), relations=list(data["relations"]))


def _check_acyclic(heads: np.ndarray) -> None:
    """ValueError unless following heads from every word reaches a root (-1) in < n steps."""
    n = len(heads)
    if n and (heads.min() < -1 or heads.max() >= n):
        raise ValueError("tree: a head out of range")
    node = np.arange(n)
    for _ in range(n):
        node = np.where(node >= 0, heads[np.maximum(node, 0)], -1)
    if (node >= 0).any():
        raise ValueError("tree: the heads form a cycle")
