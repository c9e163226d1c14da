"""The DeFrag objective (paper Section 3.3): C = C_F + beta * C_G (eq. 3).

Inputs are flat fragment embeddings with owner indices: image fragments `v [Nv, d]` owned by
pairs `v_owner [Nv]`, sentence fragments `s [Ns, d]` owned by pairs `s_owner [Ns]`, and the
dataset image id of each pair `image_key [B]` (two pairs of one image are never negatives of
each other). Everything is vectorised over the fragment score matrix F = v s^T.

Distributed training (DESIGN.md section 4) calls the same loss with the gathered global batch
and `own_pairs`, the pairs of this rank: the rank then computes only the terms of its own rows
(its image fragments against all sentence fragments; all image fragments against its own
sentences for the column-wise ranking term), so the ranks' losses sum to the global loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def pair_scores(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor, num_images: int,
                num_sentences: int, smooth: float = 5.0) -> Tensor:
    """Image-sentence scores S [num_images, num_sentences] of eq. 6.

    S_kl = sum_{i in g_k, j in g_l} max(0, v_i . s_j) / (|g_k| (|g_l| + smooth)); an image or
    a sentence without fragments scores 0 with everything.
    """
    return _aggregate(torch.relu(v @ s.T), v_owner, s_owner, num_images, num_sentences, smooth)


def _aggregate(relu_scores: Tensor, v_owner: Tensor, s_owner: Tensor, num_images: int,
               num_sentences: int, smooth: float) -> Tensor:
    """Sum thresholded fragment scores per (image, sentence) and normalise them (eq. 6)."""
    sums = relu_scores.new_zeros(num_images, num_sentences)
    images, image_of = torch.unique(v_owner, return_inverse=True)
    sentences, sentence_of = torch.unique(s_owner, return_inverse=True)
    # Owner sums as products with one-hot matrices (BLAS beats scatter here); reduce the
    # side with more owners second so the intermediate stays small.
    rows = nn.functional.one_hot(image_of, len(images)).T.to(relu_scores.dtype)
    cols = nn.functional.one_hot(sentence_of, len(sentences)).to(relu_scores.dtype)
    if len(images) <= len(sentences):
        block = (rows @ relu_scores) @ cols
    else:
        block = rows @ (relu_scores @ cols)
    sums = sums.index_put((images[:, None], sentences[None, :]), block)
    image_sizes = torch.bincount(v_owner, minlength=num_images).clamp(min=1)
    sentence_sizes = torch.bincount(s_owner, minlength=num_sentences) + smooth
    # A sentence without fragments has a zero sum; only smooth == 0 makes its denominator 0.
    norm = image_sizes[:, None] * sentence_sizes.clamp(min=1e-6)[None, :]
    return sums / norm.to(sums.dtype)


def same_group_entries(row_group: Tensor, col_group: Tensor) -> tuple[Tensor, Tensor]:
    """Indices (i, j) of every entry with row_group[i] == col_group[j], row-major.

    Built from the groups alone (sort + searchsorted), never from a full comparison matrix:
    the same-image blocks of F are a tiny fraction of it.
    """
    col_order = torch.argsort(col_group, stable=True)
    sorted_groups = col_group[col_order]
    first = torch.searchsorted(sorted_groups, row_group)
    count = torch.searchsorted(sorted_groups, row_group, right=True) - first
    rows = torch.repeat_interleave(torch.arange(len(row_group), device=row_group.device), count)
    row_start = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    within = torch.arange(len(rows), device=rows.device) - row_start
    return rows, col_order[torch.repeat_interleave(first, count) + within]


def fragment_labels(scores: Tensor, rows: Tensor, cols: Tensor, num_cols: int,
                    mil: bool) -> Tensor:
    """Positive labels (y_ij = +1) of same-pair entries (rows[e], cols[e]) with scores F_e.

    MIL off (C_0, eq. 4): every fragment pair of a corresponding image-sentence pair is positive.
    MIL on (C_F, eq. 5, mi-SVM heuristic): y_ij = sign(F_ij) (0 counts as negative); a sentence
    fragment whose positive bag has no positive score gets +1 on its highest-scoring bag member,
    the first row on ties. Inferred without gradient.
    """
    if not mil:
        return torch.ones_like(scores, dtype=torch.bool)
    positive = scores > 0
    satisfied = torch.zeros(num_cols, dtype=torch.bool, device=scores.device)
    satisfied[cols[positive]] = True
    best = scores.new_full((num_cols,), float("-inf")).scatter_reduce(0, cols, scores, "amax")
    candidate = ~satisfied[cols] & (scores == best[cols])
    first = torch.full((num_cols,), torch.iinfo(torch.long).max, device=scores.device)
    first = first.scatter_reduce(0, cols[candidate], rows[candidate], "amin")
    return positive | (candidate & (rows == first[cols]))


class DeFragLoss(nn.Module):
    """C = C_F + beta * C_G: fragment alignment (eq. 4/5) plus global ranking (eq. 7).

    `hardest_negative` (not in the paper; VSE++, Faghri et al. 2018) replaces eq. 7's sums over
    the negatives l by their maximum: each pair k is ranked against its hardest sentence and
    its hardest image of the (global) batch.
    """

    def __init__(self, beta: float = 1.0, margin: float = 1.0, smooth: float = 5.0,
                 mil: bool = True, balance: bool = True, use_fragment: bool = True,
                 use_global: bool = True, hardest_negative: bool = False) -> None:
        super().__init__()
        if smooth < 0:
            raise ValueError(f"smooth must be >= 0 (eq. 6's n), got {smooth}")
        if not (use_fragment or use_global):
            raise ValueError("DeFragLoss: enable at least one of use_fragment / use_global")
        self.beta, self.margin, self.smooth = beta, margin, smooth
        self.mil, self.balance = mil, balance
        self.use_fragment, self.use_global = use_fragment, use_global
        self.hardest_negative = hardest_negative

    def forward(self, v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor, image_key: Tensor,
                own_pairs: Tensor | None = None,
                sum_over_ranks: Callable[[Tensor], Tensor] | None = None) -> dict[str, Tensor]:
        """Loss of a batch of B = len(image_key) pairs; keys "loss", "fragment", "global".

        `own_pairs` (bool [B], default all) restricts the computed terms to this rank's pairs;
        `sum_over_ranks` all-reduces the positive / negative label counts so that the balance
        weights 1/|P| and 1/|N| are global (default: the counts are already global).
        """
        num_pairs = image_key.shape[0]
        if own_pairs is None:
            own_pairs = torch.ones(num_pairs, dtype=torch.bool, device=v.device)
        own_rows = own_pairs[v_owner]
        rows_v, rows_owner = (v, v_owner) if own_rows.all() else (v[own_rows], v_owner[own_rows])
        row_scores = rows_v @ s.T  # F for this rank's image fragments, all sentence fragments
        zero = row_scores.sum() * 0

        fragment = zero
        if self.use_fragment:
            fragment = self._fragment_alignment(row_scores, rows_owner, s_owner, image_key,
                                                sum_over_ranks)
        ranking = zero
        if self.use_global:
            ranking = self._global_ranking(row_scores, rows_owner, v, v_owner, s, s_owner,
                                           image_key, own_pairs)
        return {"loss": fragment + self.beta * ranking, "fragment": fragment, "global": ranking}

    def _fragment_alignment(self, scores: Tensor, v_owner: Tensor, s_owner: Tensor,
                            image_key: Tensor, sum_over_ranks: Callable | None) -> Tensor:
        """C_F = sum_ij w_ij max(0, 1 - y_ij F_ij) over included fragment pairs (eq. 4, 5).

        Every entry of F between different images is a negative. The few same-image entries
        are handled as a list: those of different pairs are excluded, the same pair's get
        their labels from `fragment_labels`.
        """
        rows, cols = same_group_entries(image_key[v_owner], image_key[s_owner])
        same_image = scores[rows, cols]
        same_pair = v_owner[rows] == s_owner[cols]
        pair = same_image[same_pair]
        with torch.no_grad():
            positive = fragment_labels(pair, rows[same_pair], cols[same_pair], scores.shape[1],
                                       self.mil)
        # Over the other-image entries, sum max(0, 1 + F) = sum over all - over same-image ones.
        other_image = (scores.clamp(min=-1).sum() + scores.numel()
                       - (same_image.clamp(min=-1) + 1).sum())
        negative = other_image + torch.relu(1 + pair[~positive]).sum()
        positive_hinge = torch.relu(1 - pair[positive]).sum()
        if not self.balance:
            return positive_hinge + negative
        with torch.no_grad():
            other_count = scores.numel() - len(rows)
            counts = torch.stack([positive.sum(), other_count + (~positive).sum()])
            counts = counts.to(scores.dtype)
            if sum_over_ranks is not None:
                counts = sum_over_ranks(counts)
            # An empty set contributes 0 (e.g. B = 1 has no negatives).
            pos_weight, neg_weight = torch.where(counts > 0, 1 / counts.clamp(min=1), 0)
        return pos_weight * positive_hinge + neg_weight * negative

    def _global_ranking(self, row_scores: Tensor, rows_owner: Tensor, v: Tensor,
                        v_owner: Tensor, s: Tensor, s_owner: Tensor, image_key: Tensor,
                        own_pairs: Tensor) -> Tensor:
        """C_G of eq. 7 for the own pairs k, averaged over all B pairs."""
        num_pairs = image_key.shape[0]
        rows = _aggregate(torch.relu(row_scores), rows_owner, s_owner, num_pairs, num_pairs,
                          self.smooth)  # S_kl for own images k, every sentence l
        if bool(own_pairs.all()):
            columns = rows
        else:  # S_lk for every image l, own sentences k
            own_cols = own_pairs[s_owner]
            columns = pair_scores(v, v_owner, s[own_cols], s_owner[own_cols], num_pairs,
                                  num_pairs, self.smooth)
        own = own_pairs.nonzero().squeeze(1)
        true_scores = rows[own, own]  # S_kk
        negatives = (image_key[own][:, None] != image_key[None, :]).to(rows.dtype)
        rank_sentences = torch.relu(rows[own] - true_scores[:, None] + self.margin) * negatives
        rank_images = torch.relu(columns[:, own].T - true_scores[:, None] + self.margin) * negatives
        if self.hardest_negative:  # hinges are >= 0, so a pair without negatives adds 0
            return (rank_sentences.amax(1) + rank_images.amax(1)).sum() / num_pairs
        return (rank_sentences + rank_images).sum() / num_pairs
