"""VSE++'s sentence encoder (Faghri et al. 2018, "VSE++", Section 3.3; not in the papers this
project reproduces): one GRU layer over the caption's word vectors in order; the sentence vector
is the hidden state after the last word. torch.nn.GRU runs the recurrence in one fused kernel per
layer, about twice as fast as the step-by-step peephole LSTM of trainer/encoders/lstm.py at the
same size (benchmarks/README.md), so wide (1024-d) sentence vectors fit this project's CPU budget
(docs/results.md, Flickr8k quality).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_sequence

from trainer.encoders import register
from trainer.encoders.base import SentenceEncoderBase, word_vector_parameter


@register
class GRUEncoder(SentenceEncoderBase):
    """s = h_N of a GRU over W_e w_1 .. W_e w_N (VSE++'s EncoderText without its L2 norm: the
    cosine score normalises)."""

    inputs = ("words", "word_sentence")

    def __init__(self, word_vectors: Tensor, embed_dim: int,
                 train_word_vectors: bool = False) -> None:
        super().__init__()
        self.word_vectors = word_vector_parameter(word_vectors, train_word_vectors)  # W_e
        self.embed_dim = embed_dim  # the hidden state is the sentence vector
        self.rnn = nn.GRU(word_vectors.shape[1], embed_dim, batch_first=False)

    def forward(self, words: Tensor, word_sentence: Tensor, num_sentences: int) -> Tensor:
        """Word ids [Nw] grouped by sentence in order, their sentence [Nw] -> s [num_sentences,
        embed_dim]: h after each sentence's last word (zeros for a sentence without words)."""
        vectors = F.embedding(words, self.word_vectors)
        lengths = torch.bincount(word_sentence, minlength=num_sentences)
        out = vectors.new_zeros(num_sentences, self.embed_dim)
        has_words = (lengths > 0).nonzero().flatten()
        if len(has_words) == 0:
            return out
        sentences = vectors.split(lengths.tolist())  # words are grouped by sentence, in order
        packed = pack_sequence([sentences[i] for i in has_words.tolist()], enforce_sorted=False)
        _, last = self.rnn(packed)  # [1, n, embed_dim], in the order given
        return out.index_copy(0, has_words, last[0])
