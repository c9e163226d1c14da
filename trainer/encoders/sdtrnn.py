"""Socher et al.'s semantic DT-RNN, SDT-RNN (Socher 2014, Section 3.3): eq. 4 of the DT-RNN
(dtrnn.py, whose composition this reuses) with "the matrices W_pos(i,j) replaced with matrices
based on the dependency relationship": one W_rel per relation type of the vocabulary's relation
table, and one more for every relation outside it (`Vocabulary.other_relation`; the paper has
141 relation types, "most are very rare"). Initialised, like the DT-RNN's, to identities plus
Gaussian noise (6.1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from trainer.config import ModelConfig
from trainer.encoders import register
from trainer.encoders.dtrnn import DTRNNEncoder

if TYPE_CHECKING:
    from defrag.vocab import Vocabulary


@register
class SDTRNNEncoder(DTRNNEncoder):
    """Eq. 4 over the dependency tree, W_rel by the child's relation to its parent."""

    def __init__(self, word_vectors: Tensor, embed_dim: int, num_relations: int,
                 train_word_vectors: bool = False) -> None:
        """`num_relations` matrices: relation ids 0..num_relations-1 (the last: "other")."""
        super(DTRNNEncoder, self).__init__()
        self.num_relations = num_relations
        self._build(word_vectors, embed_dim, num_relations, train_word_vectors)

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab: Vocabulary,
                    word_vectors: Tensor) -> SDTRNNEncoder:
        """n = model.embed_dim; the vocabulary's relation types and "other"."""
        return cls(word_vectors, cfg.embed_dim, vocab.other_relation + 1, cfg.train_word_vectors)

    def child_matrix(self, word_head: Tensor, word_relation: Tensor) -> Tensor:
        """Each word's relation id: its row of `matrices()` (out-of-range ids are "other")."""
        return word_relation.clamp(0, self.num_relations - 1)
