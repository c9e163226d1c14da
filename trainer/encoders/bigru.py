"""SCAN's word encoder (Lee et al. 2018, "Stacked Cross Attention for Image-Text Matching",
Section 3.4; not in the papers this project reproduces): a one-layer bidirectional GRU over the
caption's word vectors, each word's feature the mean of its forward and backward hidden states.
One row per word (s_owner = each word's sentence), for the SCAN scores `objective.score` =
scan_t2i / scan_i2t (trainer/objectives.py), which attend over words and regions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

from trainer.encoders import register
from trainer.encoders.base import SentenceEncoderBase, word_vector_parameter


@register
class BiGRUEncoder(SentenceEncoderBase):
    """e_j = (h_fwd_j + h_bwd_j) / 2 of a bidirectional GRU over W_e w_1 .. W_e w_N (SCAN 3.4)."""

    inputs = ("words", "word_sentence")

    def __init__(self, word_vectors: Tensor, embed_dim: int,
                 train_word_vectors: bool = False) -> None:
        super().__init__()
        self.word_vectors = word_vector_parameter(word_vectors, train_word_vectors)  # W_e
        self.embed_dim = embed_dim  # each direction's hidden state is a word feature's size
        self.rnn = nn.GRU(word_vectors.shape[1], embed_dim, bidirectional=True)

    def owners(self, inputs: tuple[Tensor, ...], num_sentences: int) -> Tensor:
        """s_owner is `word_sentence`: a sentence has one row per word."""
        return inputs[1]

    def forward(self, words: Tensor, word_sentence: Tensor, num_sentences: int) -> Tensor:
        """Word ids [Nw] grouped by sentence in order, their sentence [Nw] -> e [Nw, embed_dim],
        one row per word in the same order (a sentence without words has no row)."""
        vectors = F.embedding(words, self.word_vectors)
        if len(words) == 0:
            return vectors.new_zeros(0, self.embed_dim)
        lengths = torch.bincount(word_sentence, minlength=num_sentences)
        sentences = [x for x in vectors.split(lengths.tolist()) if len(x)]
        packed, _ = self.rnn(pack_sequence(sentences, enforce_sorted=False))
        hidden, counts = pad_packed_sequence(packed, batch_first=True)  # in the order given
        # Row-major over [sentence, position]: the words' own order.
        is_word = torch.arange(hidden.shape[1])[None, :] < counts[:, None]
        forward, backward = hidden[is_word.to(hidden.device)].split(self.embed_dim, dim=1)
        return (forward + backward) / 2
