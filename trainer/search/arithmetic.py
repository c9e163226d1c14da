"""Multimodal vector arithmetic (Kiros et al. 2014, "Multimodal linguistic regularities",
Section 3.2 of the arXiv text, eqs. 12-15): an image's embedding minus some words plus others,
e.g. *image of a blue car* - "blue" + "red", lies near images of red cars.

It needs the linear sentence encoder, whose sentence vector is a sum of word vectors,
s = W sum_i W_e w_i (trainer/encoders/linear.py): then an image of a blue car ~ v_blue + v_car
(eqs. 12-14). As the paper does (eq. 15), the query image q, each subtracted term w_n and each
added term w_p are first scaled to unit norm, and an image x (unit norm too) scores

    (q - sum w_n + sum w_p)^T x / ||q - sum w_n + sum w_p||,

the cosine between the query vector and x, whatever objective.score the model was trained with.
An image's embedding is the mean of its fragments (with `model.fullframe_only`, its one
fragment), as `image_sentence_scores` takes it for the cosine score; a term, a word or a phrase,
is encoded like a sentence (a phrase: the sum of its words).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trainer.objectives import image_sentence_scores, owner_means
from trainer.search.embedder import Embedder, RetrievalError, embed_captions, parse_captions
from trainer.search.fragment_set import FragmentSet

ENCODER = "linear"  # the one sentence encoder whose sentence vector is a sum of word vectors


def check_encoder(embedder: Embedder) -> None:
    """An error unless the model's sentence vectors are sums of word vectors."""
    name = embedder.cfg.model.sentence_encoder
    if name != ENCODER:
        raise RetrievalError(
            f"--minus/--plus: vector arithmetic (Kiros et al. 2014, eqs. 14-15) needs sentence "
            f"vectors that are sums of word vectors, i.e. a model trained with "
            f"model.sentence_encoder={ENCODER}; this model's sentence encoder is {name}")


def term_vectors(terms: Sequence[str], flag: str, embedder: Embedder,
                 device: str = "cpu") -> torch.Tensor:
    """The unit vectors [len(terms), d] of the `flag` (--minus or --plus) terms, each encoded as
    a sentence; a term with a word outside the model's vocabulary is an error naming the word."""
    captions = parse_captions(terms, embedder)
    for term, caption in zip(terms, captions, strict=True):
        if not caption["tokens"]:
            raise RetrievalError(f"{flag} {term!r}: no word in it")
        unknown = [w for w in caption["tokens"] if w not in embedder.vocab.word_index]
        if unknown:
            raise RetrievalError(f"{flag} {term!r}: the word {unknown[0]!r} is not in the "
                                 f"model's vocabulary of {len(embedder.vocab.words)} words")
    return F.normalize(embed_captions(captions, embedder, device).embeddings)


def arithmetic_scores(images: FragmentSet, query: FragmentSet, minus: torch.Tensor,
                      plus: torch.Tensor) -> torch.Tensor:
    """Eq. 15's score [len(images.items)] of every image for the query image `query` (one
    item) minus the unit vectors `minus` plus `plus` (`term_vectors`)."""
    image = F.normalize(owner_means(query.embeddings, query.owner, 1))
    vector = image - minus.sum(0) + plus.sum(0)
    return image_sentence_scores(images.embeddings, images.owner, vector,
                                 torch.zeros(1, dtype=torch.long), len(images.items), 1,
                                 score="cosine")[:, 0]


def expression(image: str, minus: Sequence[str], plus: Sequence[str]) -> str:
    """The query as the report shows it: `IMAGE - 'blue' + 'red'`."""
    return " ".join([image, *(f"- {t!r}" for t in minus), *(f"+ {t!r}" for t in plus)])
