"""Kiros et al.'s LSTM sentence encoder (Kiros 2014, Section 2.1-2.2, eqs. 1-5): one layer over
the caption's word vectors in order; the sentence vector is the hidden state after the last word.

The paper's gates have peephole terms (C_{t-1} W_ci, C_{t-1} W_cf, C_t W_co, full matrices as
written); torch.nn.LSTM has none, so its gates do NOT equal the paper's, and the recurrence is
written out here: one batched step per word position, every sentence of the batch at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.encoders import register
from trainer.encoders.base import SentenceEncoderBase, word_vector_parameter

if TYPE_CHECKING:
    pass

INIT_RANGE = 0.08  # "weights initialized uniformly from [-0.08, 0.08]" (Kiros 3.1)


def word_positions(word_sentence: Tensor, num_sentences: int) -> tuple[Tensor, Tensor]:
    """Each word's position in its sentence and each sentence's length, for words grouped by
    sentence in order (the Batch's `words`, `word_sentence`)."""
    lengths = torch.bincount(word_sentence, minlength=num_sentences)
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(len(word_sentence), device=word_sentence.device) - starts[word_sentence], \
        lengths


@register
class LSTMEncoder(SentenceEncoderBase):
    """Kiros eqs. 1-5: I, F, O gates with peepholes, cell C, hidden M; s = M_N (Kiros 2.2)."""

    inputs = ("words", "word_sentence")

    def __init__(self, word_vectors: Tensor, embed_dim: int,
                 train_word_vectors: bool = False) -> None:
        super().__init__()
        self.word_vectors = word_vector_parameter(word_vectors, train_word_vectors)  # W_T
        hidden = self.embed_dim = embed_dim  # the hidden state is the sentence vector (K)
        # Gate blocks in the order i, f, c, o: W_x* [d, 4K], W_h* [K, 4K], b_* [4K].
        self.weight_x = nn.Parameter(torch.empty(word_vectors.shape[1], 4 * hidden))
        self.weight_h = nn.Parameter(torch.empty(hidden, 4 * hidden))
        self.weight_c = nn.Parameter(torch.empty(hidden, 3 * hidden))  # peepholes W_ci, W_cf, W_co
        self.bias = nn.Parameter(torch.zeros(4 * hidden))
        for weight in (self.weight_x, self.weight_h, self.weight_c):
            nn.init.uniform_(weight, -INIT_RANGE, INIT_RANGE)

    def forward(self, words: Tensor, word_sentence: Tensor, num_sentences: int) -> Tensor:
        """Word ids [Nw] grouped by sentence in order, their sentence [Nw] -> s [num_sentences,
        embed_dim]: M after each sentence's last word (zeros for a sentence without words)."""
        positions, lengths = word_positions(word_sentence, num_sentences)
        hidden = self.embed_dim
        steps = int(lengths.max()) if num_sentences and len(words) else 0
        # X_t W_x* of every word at once, laid out [T, B, 4K] (zeros past a sentence's end).
        inputs = F.embedding(words, self.word_vectors) @ self.weight_x
        padded = inputs.new_zeros(steps, num_sentences, 4 * hidden)
        padded = padded.index_put((positions, word_sentence), inputs)
        m = c = inputs.new_zeros(num_sentences, hidden)
        w_ci, w_cf, w_co = self.weight_c.split(hidden, dim=1)
        # unbind: each step's backward then fills its own slice, not a [T, B, 4K] gradient
        for t, step_inputs in enumerate(padded.unbind(0)):
            x_i, x_f, x_c, x_o = (step_inputs + m @ self.weight_h + self.bias).split(hidden, 1)
            i = torch.sigmoid(x_i + c @ w_ci)  # eq. 1
            f = torch.sigmoid(x_f + c @ w_cf)  # eq. 2
            c_new = f * c + i * torch.tanh(x_c)  # eq. 3
            o = torch.sigmoid(x_o + c_new @ w_co)  # eq. 4
            m_new = o * torch.tanh(c_new)  # eq. 5
            active = (t < lengths)[:, None]  # sentences still reading a word at step t
            m, c = torch.where(active, m_new, m), torch.where(active, c_new, c)
        return m
