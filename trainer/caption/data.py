"""The captions the structure-content language model learns from (Kiros et al. 2014, 2.5): each
caption's words, their part-of-speech tags (the structure variables t_i, stored in the shards by
the featurizer's parser) and its sentence vector u from a trained Kiros encoder.

Captions are read from the shards with the one reader (trainer/data/reader.py) without decoding any
image. The SC-NLM's words are the encoder's vocabulary ("the same vocabulary throughout both
models") plus two ids: START fills the context before the first word, UNKNOWN stands for a word
outside the vocabulary (predicted in training, never generated).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from defrag.vocab import Vocabulary
from trainer.caption.scnlm import training_windows
from trainer.data.reader import Notes, ReadOptions, shard_samples
from trainer.data.shardset import Shard

log = logging.getLogger(__name__)

# The universal part-of-speech tags (spaCy `pos_`, stanza `upos`); END_TAG pads the forward
# structure context past a sentence's last word.
TAGS = ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON",
        "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X")
END_TAG = len(TAGS)
NUM_TAGS = len(TAGS) + 1
TAG_INDEX = {tag: number for number, tag in enumerate(TAGS)}
ENCODE_BATCH = 512  # captions per encoder pass


def start_id(vocab: Vocabulary) -> int:
    return len(vocab.words)


def unknown_id(vocab: Vocabulary) -> int:
    return len(vocab.words) + 1


def scnlm_vocab_size(vocab: Vocabulary) -> int:
    """The SC-NLM's words: the encoder's, START and UNKNOWN."""
    return len(vocab.words) + 2


@dataclass
class Caption:
    """One training caption as the SC-NLM reads it."""

    text: str
    tokens: list[str]  # lowercased words, punctuation dropped (the featurizer's tokens)
    words: list[int]  # SC-NLM word ids (UNKNOWN for a word outside the vocabulary)
    tags: list[int]  # universal POS tag ids, one per word (X for a tag outside TAGS)


def encode_caption(caption: dict, vocab: Vocabulary) -> Caption:
    """A shard caption (`{"text", "tokens", "tree": {"pos"}}`) as a Caption; ValueError if its
    tags do not match its tokens."""
    tokens, tags = caption["tokens"], caption["tree"]["pos"]
    if len(tags) != len(tokens):
        raise ValueError(f"{len(tags)} part-of-speech tags for {len(tokens)} tokens")
    unknown = unknown_id(vocab)
    return Caption(caption["text"], list(tokens),
                   [vocab.word_index.get(token, unknown) for token in tokens],
                   [TAG_INDEX.get(tag, TAG_INDEX["X"]) for tag in tags])


def read_captions(shards: Sequence[Shard], vocab: Vocabulary, options: ReadOptions,
                  what: str) -> list[Caption]:
    """Every usable caption of `shards`, in order, with a progress bar over the shards (`what`
    names them). A sample whose captions cannot be used (broken JSON, tags that do not match the
    tokens) is skipped with a warning naming its shard and key; damaged shards are reported by
    the reader."""
    captions, notes = [], Notes()
    for shard in tqdm(shards, desc=f"read {what} captions", unit="shard", disable=not shards):
        for sample in shard_samples(shard, options, notes):
            try:
                meta = json.loads(sample["json"])
                captions.extend(encode_caption(c, vocab) for c in meta["captions"])
            except (KeyError, ValueError, TypeError) as err:
                log.warning("%s sample %r: skipped, its captions cannot be used (%s: %s)",
                            shard.url, sample.get("__key__"), type(err).__name__, err)
    return captions


@torch.no_grad()
def sentence_vectors(encoder: torch.nn.Module, vocab: Vocabulary,
                     token_lists: Sequence[Sequence[str]], progress: bool = False) -> torch.Tensor:
    """Unit-length sentence vectors [N, D] of token lists from a whole-sentence encoder (the
    LSTM of Kiros 2.2), ENCODE_BATCH at a time: u of eq. 11, and the candidates' embeddings of
    the translation score (5.2). A caption with no known word gets a zero vector."""
    parts = [torch.zeros(0, encoder.embed_dim)]
    starts = range(0, len(token_lists), ENCODE_BATCH)
    for first in tqdm(starts, desc="embed captions", unit="batch", disable=not progress):
        ids = [vocab.encode_words({"tokens": tokens})
               for tokens in token_lists[first:first + ENCODE_BATCH]]
        words = torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *ids]))
        owners = torch.repeat_interleave(torch.arange(len(ids)),
                                         torch.tensor([len(w) for w in ids]))
        parts.append(F.normalize(encoder(words, owners, num_sentences=len(ids)).float(), dim=1))
    return torch.cat(parts)


@dataclass
class Windows:
    """The prediction problems of a set of captions (eq. 10-11 inputs and targets): row i
    predicts `targets[i]` from `context[i]`, `tags[i]` and the vector of caption `caption[i]`."""

    context: torch.Tensor  # [N, context] word ids, oldest first
    tags: torch.Tensor  # [N, forward_tags + 1] tag ids t_n..t_n+k
    targets: torch.Tensor  # [N] word ids
    caption: torch.Tensor  # [N] index of the caption (its row of the sentence vectors)

    def __len__(self) -> int:
        return len(self.targets)

    @classmethod
    def of(cls, captions: Sequence[Caption], vocab: Vocabulary, context: int,
           forward_tags: int) -> Windows:
        # an empty caption's part (no rows) keeps the concatenation defined without captions
        parts = [training_windows(c.words, c.tags, context, forward_tags, start_id(vocab),
                                  END_TAG) for c in [*captions, Caption("", [], [], [])]]
        lengths = torch.tensor([len(c.words) for c in captions], dtype=torch.long).reshape(-1)
        return cls(torch.cat([p[0] for p in parts]).reshape(-1, context),
                   torch.cat([p[1] for p in parts]).reshape(-1, forward_tags + 1),
                   torch.cat([p[2] for p in parts]).long(),
                   torch.repeat_interleave(torch.arange(len(captions)), lengths))

    def batches(self, order: torch.Tensor, size: int) -> Iterator[Windows]:
        """The rows of `order` in batches of `size` (the last one may be shorter)."""
        for first in range(0, len(order), size):
            rows = order[first:first + size]
            yield Windows(self.context[rows], self.tags[rows], self.targets[rows],
                          self.caption[rows])
