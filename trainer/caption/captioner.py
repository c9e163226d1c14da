"""Describe images in words: a trained Kiros encoder and a structure-content neural language model
(SC-NLM) in one model folder, and the caption generation of Kiros et al. 2014, Section 5.2.

    <folder>/encoder/                     the Kiros encoder's model folder (embeds images, captions)
             scnlm.safetensors            the SC-NLM's weights (trainer/caption/scnlm.py)
             captioner.json               its sizes, the generation settings, the tags, the
                                          encoder's checksums.json sha256
             sentences.json               the training captions: text, tokens, POS tags
             sentence_vectors.safetensors their unit vectors in the joint space
             language_model.json          the Kneser-Ney trigram model (trainer/caption/trigram.py)
             metrics.json, checksums.json

For an image (5.2): its unit vector v in the joint space; two conditioning vectors, v itself and
the mean of its N nearest words and N nearest training sentences ("bag of concepts"); the set of
the training set's POS sequences of 4-12 words. Each candidate draws a conditioning vector and a
POS sequence and is the SC-NLM's greedy (per-word MAP) decode; candidates are re-ranked by
    translation score (cosine of the candidate's encoder vector with v, x repeat_penalty per
    repeated non-stopword) + lm_weight x the trigram log-probability,
and the best `top` are returned with the nearest training sentence.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spacy.lang.en.stop_words import STOP_WORDS

from trainer.caption.data import (
    END_TAG,
    NUM_TAGS,
    TAGS,
    Caption,
    scnlm_vocab_size,
    sentence_vectors,
    start_id,
    unknown_id,
)
from trainer.caption.scnlm import SCNLM
from trainer.caption.trigram import TrigramLM
from trainer.config import Config
from trainer.objectives import owner_means
from trainer.search.embedder import Embedder
from trainer.store.model_folder import (
    CAPTIONER,
    CAPTIONER_ENCODER,
    METRICS,
    MODEL_FORMAT,
    ModelFolder,
    ModelFolderError,
    write_folder,
)

SCNLM_WEIGHTS = "scnlm.safetensors"
SENTENCES, SENTENCE_VECTORS = "sentences.json", "sentence_vectors.safetensors"
LANGUAGE_MODEL = "language_model.json"


@dataclass
class CaptionerParts:
    """What a captioner keeps beside its two networks, built once from the training captions."""

    captions: list[Caption]
    vectors: torch.Tensor  # [N, D] unit sentence vectors of `captions`
    language_model: TrigramLM

    @classmethod
    def build(cls, captions: list[Caption], vectors: torch.Tensor) -> CaptionerParts:
        return cls(captions, vectors, TrigramLM.fit([c.tokens for c in captions]))


def save_captioner(folder: str | Path, encoder_dir: Path, scnlm: SCNLM, cfg: Config,
                   parts: CaptionerParts, metrics: dict[str, Any] | None = None) -> Path:
    """Write a captioner folder atomically (model_folder.write_folder): the encoder folder copied
    in, the SC-NLM, the training captions and their vectors, the trigram model."""
    encoder = ModelFolder.open(encoder_dir)

    def fill(staging: Path) -> None:
        shutil.copytree(encoder_dir, staging / CAPTIONER_ENCODER)
        state = {k: v.detach().cpu().contiguous().clone() for k, v in scnlm.state_dict().items()}
        save_file(state, staging / SCNLM_WEIGHTS)
        record = {"format": MODEL_FORMAT, "scnlm": scnlm.sizes(), "tags": list(TAGS),
                  "caption": {k: v for k, v in asdict(cfg.caption).items() if k != "encoder"},
                  "encoder_source": str(encoder_dir),
                  "encoder_checksums_sha256": encoder.checksums_key}
        (staging / CAPTIONER).write_text(json.dumps(record, indent=2))
        (staging / SENTENCES).write_text(json.dumps(
            [{"text": c.text, "tokens": c.tokens, "words": c.words, "tags": c.tags}
             for c in parts.captions]))
        save_file({"vectors": parts.vectors.contiguous()}, staging / SENTENCE_VECTORS)
        (staging / LANGUAGE_MODEL).write_text(json.dumps(parts.language_model.to_json()))
        if metrics is not None:
            (staging / METRICS).write_text(json.dumps(metrics, indent=2, sort_keys=True))

    return write_folder(Path(folder), fill)


def open_captioner(folder: Path) -> tuple[dict[str, Any], ModelFolder]:
    """A captioner folder verified whole (ModelFolder.open: its files, and its encoder the one
    `captioner.json` names): its record and its encoder."""
    opened = ModelFolder.open(folder)
    if not opened.is_captioner:
        raise ModelFolderError(f"{folder} is not a captioner folder (no {CAPTIONER}): train one "
                               "with trainer.caption.train")
    return json.loads((folder / CAPTIONER).read_text()), opened.parts[CAPTIONER_ENCODER]


@dataclass
class Candidate:
    """A generated caption and its scores (5.2)."""

    text: str
    score: float  # translation + lm_weight x language model
    translation: float  # cosine with the image, x the repeat penalty
    language_model: float  # natural-log trigram probability


@dataclass
class Description:
    """An image's best captions, and its nearest training sentence (shown beside them)."""

    captions: list[Candidate]
    nearest_sentence: str


class Captioner:
    """A loaded captioner folder: embeds images and generates their captions (5.2)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        record, encoder = open_captioner(folder)
        try:
            self.settings = Config.from_dict({"caption": record["caption"]}).caption
            sizes = record["scnlm"]
        except (ValueError, KeyError, TypeError) as err:
            raise ModelFolderError(f"{folder / CAPTIONER} is malformed ({err!r})") from err
        # the encoder with the featurizer steps of its training shards
        self.embedder = Embedder.from_folder(encoder)
        self.model, self.vocab = self.embedder.model, self.embedder.vocab
        self.scnlm = SCNLM(**sizes)
        self.scnlm.load_state_dict(load_file(folder / SCNLM_WEIGHTS))
        self.scnlm.eval()
        if sizes["vocab_size"] != scnlm_vocab_size(self.vocab) or sizes["num_tags"] != NUM_TAGS:
            raise ModelFolderError(f"{folder / SCNLM_WEIGHTS} does not fit the encoder's "
                                   f"vocabulary or this code's tags")
        sentences = json.loads((folder / SENTENCES).read_text())
        self.sentences = [Caption(**s) for s in sentences]
        self.sentence_vectors = load_file(folder / SENTENCE_VECTORS)["vectors"]
        self.language_model = TrigramLM.from_json(json.loads(
            (folder / LANGUAGE_MODEL).read_text()))
        # each word of the vocabulary as a one-word sentence: the "nearest words" of 5.2
        self.word_vectors = sentence_vectors(self.model.sentence, self.vocab,
                                             [[w] for w in self.vocab.words])
        self.pos_sequences = sorted({tuple(c.tags) for c in self.sentences
                                     if self.settings.min_length <= len(c.tags)
                                     <= self.settings.max_length})

    def concepts(self, image: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The "top-N nearest words and sentences" conditioning vector of a unit image vector
        (their mean, unit length), and the index of the nearest training sentence."""
        n = self.settings.neighbours
        words = (self.word_vectors @ image).topk(min(n, len(self.word_vectors))).indices
        sentences = (self.sentence_vectors @ image).topk(min(n, len(self.sentences))).indices
        bag = torch.cat([self.word_vectors[words], self.sentence_vectors[sentences]])
        return F.normalize(bag.mean(0), dim=0), int(sentences[0])

    def candidates(self, image: torch.Tensor, seed: int) -> tuple[list[tuple[str, ...]], int]:
        """The distinct greedy decodes of `settings.candidates` draws of (conditioning vector,
        POS sequence), and the nearest training sentence's index."""
        concept, nearest = self.concepts(image)
        conditions = torch.stack([image, concept])
        generator = torch.Generator().manual_seed(seed)
        count = self.settings.candidates
        which = torch.randint(len(conditions), (count,), generator=generator)
        drawn = torch.randint(len(self.pos_sequences), (count,), generator=generator)
        sequences = [self.pos_sequences[i] for i in drawn.tolist()]
        lengths = torch.tensor([len(s) for s in sequences])
        tags = torch.full((count, int(lengths.max())), END_TAG, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            tags[row, :len(sequence)] = torch.tensor(sequence)
        words = self.scnlm.greedy_decode(conditions[which], tags, lengths, start_id(self.vocab),
                                         END_TAG, banned=[unknown_id(self.vocab)])
        decoded = dict.fromkeys(tuple(self.vocab.words[w] for w in row if w >= 0)
                                for row in words.tolist())
        return list(decoded), nearest

    def rerank(self, image: torch.Tensor, candidates: Sequence[tuple[str, ...]]
               ) -> list[Candidate]:
        """Candidates by their score (5.2), best first."""
        vectors = sentence_vectors(self.model.sentence, self.vocab, candidates)
        cosines = (vectors @ image).tolist()
        scored = []
        for tokens, cosine in zip(candidates, cosines, strict=True):
            repeats = sum(count - 1 for word, count in Counter(tokens).items()
                          if count > 1 and word not in STOP_WORDS)
            translation = cosine * self.settings.repeat_penalty ** repeats
            lm = self.language_model.log_prob(tokens)
            scored.append(Candidate(" ".join(tokens), translation + self.settings.lm_weight * lm,
                                    translation, lm))
        return sorted(scored, key=lambda c: -c.score)

    def describe(self, image: torch.Tensor, name: str, seed: int = 0) -> Description:
        """The best `settings.top` captions of a unit image vector; `name` (e.g. the file name)
        seeds its draws with `seed`, so an image gets the same captions in any batch."""
        image_seed = int(np.random.SeedSequence([seed, zlib.crc32(name.encode())])
                         .generate_state(1)[0])
        candidates, nearest = self.candidates(image, image_seed)
        best = self.rerank(image, candidates)[:self.settings.top]
        return Description(best, self.sentences[nearest].text)


def image_vectors(v: torch.Tensor, owner: torch.Tensor, count: int) -> torch.Tensor:
    """Each image's unit vector in the joint space: the mean of its image fragments (the cosine
    score's image side, Kiros 2.2), [count, D]."""
    return F.normalize(owner_means(v.float(), owner, count), dim=1)
