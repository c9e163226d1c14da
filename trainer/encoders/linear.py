"""Kiros et al.'s linear sentence encoder (Kiros 2014, Section 3.2): the sentence vector is a
linear map of the sum of its word vectors, v = W sum_i w_i, so that a sentence is the sum of its
words' embeddings W w_i (the multimodal vector arithmetic of Kiros eqs. 14-15)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from trainer.encoders import register
from trainer.encoders.base import SentenceEncoderBase, word_vector_parameter

if TYPE_CHECKING:
    pass


@register
class LinearEncoder(SentenceEncoderBase):
    """s = W sum_i W_e w_i (Kiros 3.2; no bias, so word contributions add up)."""

    inputs = ("words", "word_sentence")

    def __init__(self, word_vectors: Tensor, embed_dim: int,
                 train_word_vectors: bool = False) -> None:
        super().__init__()
        self.word_vectors = word_vector_parameter(word_vectors, train_word_vectors)  # W_e
        self.embed_dim = embed_dim
        self.projection = nn.Linear(word_vectors.shape[1], embed_dim, bias=False)  # W
        # LeCun init (no nonlinearity follows), as W_m of eq. 2; the paper gives none.
        nn.init.normal_(self.projection.weight, std=word_vectors.shape[1] ** -0.5)

    def forward(self, words: Tensor, word_sentence: Tensor, num_sentences: int) -> Tensor:
        """Word ids [Nw], their sentence [Nw] -> s [num_sentences, embed_dim] (a sentence
        without words is the zero vector)."""
        vectors = F.embedding(words, self.word_vectors)
        sums = vectors.new_zeros(num_sentences, vectors.shape[1]).index_add(0, word_sentence,
                                                                          vectors)
        return self.projection(sums)
