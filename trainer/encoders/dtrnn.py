"""Socher et al.'s dependency-tree recursive network, DT-RNN (Socher, Karpathy, Le, Manning and
Ng 2014, Section 3.2), and the composition it shares with its semantic variant (sdtrnn.py).

Every word i of a caption is a node of its dependency tree (`Batch.word_head`); its hidden vector
is eq. 4,

    h_i = f( 1/l(i) * ( W_v x_i + sum_{j in C(i)} l(j) W_pos(i,j) h_j ) ),   l(i) = 1 + sum l(j),

with x_i the word's vector (W_e, fixed: "word vectors are not finetuned during training", 6.1),
W_v [n, d] the word matrix, C(i) the children of i, l(i) the number of words under i (itself
included) and f = tanh ("generally find tanh to perform best", 3.2). A leaf is h = f(W_v x)
(eq. 1). W_pos(i,j) is chosen by the child's position relative to its parent: W_l1, W_l2, ... for
the nearest, second nearest, ... child on the left, W_r1, W_r2, ... on the right (eq. 3); a child
beyond the last matrix uses the identity ("the corresponding matrix would be the identity
matrix", 3.2). The paper finds the number of matrices per side from the data; the model's
parameters exist before any data is read, so it is `model.dtrnn_max_children` here.

The sentence vector is the root's hidden vector, y = h_root, and is itself the joint space: the
paper maps the image into it (v = W_I z, Section 5), so `embed_dim` = n (the paper: n = d = 50).
A caption parsed as a forest (several roots) is the mean of its roots' vectors; a caption without
a word in the dictionary is the zero vector. Initialisation: "the weight matrices are initialized
to block identity matrices plus Gaussian noise" (6.1), the noise's deviation unstated (0.01
here). Eq. 4 has no bias term, and none is added.

Batched: all trees of the batch are computed level by level, a node's level being its height
(0 for a leaf, 1 + its highest child's otherwise); the only Python loop is over the levels, and
each level's children are multiplied by their matrices in one batched product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.config import ModelConfig
from trainer.encoders import register
from trainer.encoders.base import SentenceEncoderBase, word_vector_parameter

if TYPE_CHECKING:
    from defrag.vocab import Vocabulary

INIT_NOISE = 0.01  # std of the Gaussian noise on the block identities (the paper gives none)


def block_identity(rows: int, cols: int) -> Tensor:
    """[rows, cols] of identity blocks: [I; I; ...] when tall, [I I ...] when wide."""
    k = min(rows, cols)
    return (torch.arange(rows)[:, None] % k == torch.arange(cols)[None, :] % k).float()


@torch.no_grad()
def tree_levels(word_head: Tensor) -> tuple[Tensor, Tensor]:
    """Each node's height (0 for a leaf) and l(i), the number of words under it (itself
    included), for the forest of `word_head` (a head row or -1). One loop step per level."""
    n = len(word_head)
    child = torch.nonzero(word_head >= 0).squeeze(1)
    parent = word_head[child]
    height = torch.zeros(n, dtype=torch.long, device=word_head.device)
    for _ in range(n):
        new = height.scatter_reduce(0, parent, height[child] + 1, "amax")
        if torch.equal(new, height):
            break
        height = new
    leaves = torch.ones(n, dtype=torch.long, device=word_head.device)
    for level in range(int(height.max()) if n else 0):
        done = child[height[child] == level]
        leaves = leaves.index_add(0, word_head[done], leaves[done])
    return height, leaves


def matmul_by_index(x: Tensor, matrices: Tensor, index: Tensor) -> Tensor:
    """Row r of x [k, n] times matrices[index[r]] ([M, n, n]): one batched product over the
    distinct matrices used, their rows padded to the longest group."""
    used, group = torch.unique(index, return_inverse=True)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=len(used))
    slot = torch.arange(len(x), device=x.device) - (torch.cumsum(counts, 0) - counts)[group[order]]
    padded = x.new_zeros(len(used), int(counts.max()), x.shape[1])
    padded = padded.index_put((group[order], slot), x[order])
    products = torch.bmm(padded, matrices[used].transpose(1, 2))  # rows h^T W^T = (W h)^T
    return torch.zeros_like(x).index_copy(0, order, products[group[order], slot])


@register
class DTRNNEncoder(SentenceEncoderBase):
    """Eq. 4 over the dependency tree, W_pos by the child's position (DT-RNN, Socher 3.2)."""

    inputs = ("words", "word_sentence", "word_head", "word_relation")

    def __init__(self, word_vectors: Tensor, embed_dim: int, max_children: int = 6,
                 train_word_vectors: bool = False) -> None:
        """`max_children` matrices per side: W_l1..W_lk and W_r1..W_rk."""
        super().__init__()
        self.max_children = max_children
        self._build(word_vectors, embed_dim, 2 * max_children, train_word_vectors)

    def _build(self, word_vectors: Tensor, embed_dim: int, num_matrices: int,
               train_word_vectors: bool) -> None:
        self.word_vectors = word_vector_parameter(word_vectors, train_word_vectors)  # W_e
        self.embed_dim = n = embed_dim
        d = word_vectors.shape[1]
        self.word_matrix = nn.Parameter(block_identity(n, d) + INIT_NOISE * torch.randn(n, d))
        self.child_matrices = nn.Parameter(  # W_pos (or W_rel) [M, n, n]
            block_identity(n, n).expand(num_matrices, n, n)
            + INIT_NOISE * torch.randn(num_matrices, n, n))
        self.register_buffer("identity", torch.eye(n)[None], persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab: Vocabulary,
                    word_vectors: Tensor) -> DTRNNEncoder:
        """n = model.embed_dim, model.dtrnn_max_children per side, W_e trained only with
        train_word_vectors (the paper keeps it fixed)."""
        return cls(word_vectors, cfg.embed_dim, cfg.dtrnn_max_children, cfg.train_word_vectors)

    def child_matrix(self, word_head: Tensor, word_relation: Tensor) -> Tensor:
        """Each word's row of `matrices()` as its parent's child, pos(i, j) (anything for a
        root): l1..lk are rows 0..k-1, r1..rk rows k..2k-1, farther children the identity."""
        k = self.max_children
        child = torch.nonzero(word_head >= 0).squeeze(1)
        head = word_head[child]
        right = (child > head).long()
        group = 2 * head + right  # the children of one side of one parent
        order = torch.argsort(group * (len(word_head) + 1) + (child - head).abs())
        _, counts = torch.unique_consecutive(group[order], return_counts=True)
        rank = torch.empty_like(child)
        rank[order] = (torch.arange(len(child), device=child.device)
                       - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts))
        position = torch.where(rank < k, right * k + rank, 2 * k)
        return torch.zeros_like(word_head).index_copy(0, child, position)

    def matrices(self) -> Tensor:
        """The child matrices [M + 1, n, n], the identity last."""
        return torch.cat([self.child_matrices, self.identity.to(self.child_matrices.dtype)])

    def hidden(self, words: Tensor, word_head: Tensor, word_relation: Tensor) -> Tensor:
        """h [Nw, n] of every node (eq. 4), level by level from the leaves up."""
        height, leaves = tree_levels(word_head)
        leaves = leaves.to(self.word_matrix.dtype)
        which = self.child_matrix(word_head, word_relation)
        matrices = self.matrices()
        total = F.embedding(words, self.word_vectors) @ self.word_matrix.T  # W_v x_i
        h = total.new_zeros(len(words), self.embed_dim)
        for level in range(int(height.max()) + 1 if len(words) else 0):
            nodes = torch.nonzero(height == level).squeeze(1)
            h_level = torch.tanh(total[nodes] / leaves[nodes, None])
            h = h.index_copy(0, nodes, h_level)
            has_parent = word_head[nodes] >= 0
            children = nodes[has_parent]
            if len(children):  # l(j) W_pos(i,j) h_j, added to the parent's sum
                terms = matmul_by_index(h_level[has_parent], matrices, which[children])
                total = total.index_add(0, word_head[children], leaves[children, None] * terms)
        return h

    def forward(self, words: Tensor, word_sentence: Tensor, word_head: Tensor | None,
                word_relation: Tensor | None, num_sentences: int) -> Tensor:
        """Word ids [Nw] grouped by sentence, their sentence, head row (-1: root) and relation
        id [Nw] -> s [num_sentences, embed_dim]: the root's h (the mean of the roots' for a
        forest; zeros for a sentence without words)."""
        if word_head is None or word_relation is None:
            raise ValueError(f"the {type(self).__module__.rpartition('.')[2]} sentence encoder "
                             f"needs the captions' dependency trees (Batch.word_head, "
                             f"word_relation), which this batch was read without")
        h = self.hidden(words, word_head, word_relation)
        roots = torch.nonzero(word_head < 0).squeeze(1)
        owner = word_sentence[roots]
        sums = h.new_zeros(num_sentences, self.embed_dim).index_add(0, owner, h[roots])
        counts = torch.bincount(owner, minlength=num_sentences).clamp(min=1).to(h.dtype)
        return sums / counts[:, None]
