"""The DeFrag objective (paper Section 3.3): C = C_F + beta * C_G (eq. 3), on one rank or many;
with `score` cosine or inner, C_G is Kiros et al.'s / Socher et al.'s ranking loss; with scan_t2i
or scan_i2t and `hardest_negative`, SCAN's (Lee et al. 2018, 3.1-3.2).

Names, one per idea, the same from the batch (trainer/batch.py) through the model to this loss:
  pair k           the k-th (image, sentence) of a batch; sentence k is pair k's caption, so a
                   sentence index is a pair index (the loss says pair, the batch sentence)
  v, v_owner       image fragments [Nv, d] (eq. 2) and each one's pair (each one's image in
                   `pair_scores`); the model embeds `Batch.boxes`, owned by image rows
                   (`box_image`), and an image's fragments are repeated for each of its pairs
  s, s_owner       sentence rows [Ns, d] and each one's sentence: the fragments of eq. 1 with
                   `Batch.fragment_sentence`, or one row per sentence (s_owner = arange(B))
                   from a whole-sentence encoder (trainer/encoders: lstm, linear, dtrnn,
                   sdtrnn)
  words,           every sentence's word ids in order, sentence after sentence [Nw], and each
  word_sentence    one's sentence [Nw]: what whole-sentence encoders read (`Batch.words`)
  word_head,       each word's head in its dependency tree as a row of `words` (-1: a root;
  word_relation    a caption may be a forest) and its relation id [Nw] (`Vocabulary.encode_tree`:
                   words out of the dictionary skipped, relations out of the table "other"):
                   what the tree encoders read (dtrnn, sdtrnn; shard format 2)
  sentence_image   the image row of each sentence (`Batch.sentence_image`)
  image_key        [B] int64: a stable key of each pair's image; pairs with one key are never
                   each other's negatives (`trainer.data.reader.image_key` of the image's id)
  image_id         an image's name in the dataset (str; `Batch.image_ids` per image row)
  F = v s^T        fragment scores; S [images, sentences]: image-sentence scores, eq. 6's
                   (`pair_scores`) or another `score` (`image_sentence_scores`; SCAN's:
                   `scan_scores`)
  score_matrix     S of a whole test set or index (trainer.evaluate, trainer/search): eq. 6
                   by `pair_scores` one block of images x sentences at a time, so that a
                   1,000-image test set never holds its [20k, 50k] fragment scores at once
  y_ij             the MIL labels of eq. 5 (`mil_labels`)

Distributed training (docs/design.md section 7): with `world_size` W > 1 every rank calls the
loss on its own pairs. With `global_negatives` the loss all-gathers every rank's fragments (with
autograd) and computes only the terms of its own rows: its image fragments against all sentence
fragments, and all image fragments against its own sentences for eq. 7's column-wise term; the
balance weights' label counts are summed over ranks. The ranks' terms then sum to the global
batch's loss; each rank returns W x its terms, so that the mean over ranks, which DDP and
DeepSpeed take of the gradients, is the global batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from tqdm import tqdm

if TYPE_CHECKING:
    from trainer.config import ObjectiveConfig

TERMS = ("loss", "fragment", "global")  # the values of DeFragLoss's output
SCAN_SCORES = ("scan_t2i", "scan_i2t")  # SCAN's two directions (Lee et al. 2018, 3.1)
SCORES = ("eq6", "cosine", "inner", *SCAN_SCORES)  # objective.score
AGGREGATIONS = ("lse", "avg")  # SCAN's pooling of the relevances R into S (3.1)
_EPS = 1e-8  # SCAN's guard of its norms' divisions


@dataclass(frozen=True)
class ScanSettings:
    """SCAN's knobs (objective.scan_*): the attention's inverse temperature lambda1, the pooling
    of the relevances (`AGGREGATIONS`) and LogSumExp's lambda2; None: the paper's Flickr30K best
    for the direction (`PAPER_SCAN`)."""

    lambda1: float | None = None
    aggregation: str | None = None
    lambda2: float = 6.0

    def __post_init__(self) -> None:
        if self.lambda1 is not None and not self.lambda1 > 0:
            raise ValueError(f"SCAN lambda1 must be > 0: got {self.lambda1}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"SCAN aggregation {self.aggregation!r}: expected one of "
                             f"{AGGREGATIONS}")
        if not self.lambda2 > 0:
            raise ValueError(f"SCAN lambda2 must be > 0: got {self.lambda2}")

    def resolved(self, score: str) -> tuple[float, str, float]:
        """(lambda1, aggregation, lambda2) of the direction `score`, the paper's where unset."""
        lambda1, aggregation = PAPER_SCAN[score]
        return (lambda1 if self.lambda1 is None else self.lambda1,
                aggregation if self.aggregation is None else self.aggregation, self.lambda2)


# SCAN's Flickr30K best (Lee et al. 2018, Section 4): t2i lambda1 = 9, LSE with lambda2 = 6;
# i2t lambda1 = 4, AVG
PAPER_SCAN = {"scan_t2i": (9.0, "lse"), "scan_i2t": (4.0, "avg")}
DEFAULT_SCAN = ScanSettings()


def scan_settings(objective: ObjectiveConfig) -> ScanSettings:
    """The ScanSettings of a config's objective.scan_* keys."""
    return ScanSettings(objective.scan_lambda1, objective.scan_aggregation,
                        objective.scan_lambda2)


def pair_scores(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor, num_images: int,
                num_sentences: int, smooth: float = 5.0) -> Tensor:
    """Image-sentence scores S [num_images, num_sentences] of eq. 6.

    S_kl = sum_{i in g_k, j in g_l} max(0, v_i . s_j) / (|g_k| (|g_l| + smooth)); an image or
    a sentence without fragments scores 0 with everything.
    """
    return _aggregate((v @ s.T).relu_(), v_owner, s_owner, num_images, num_sentences, smooth)


@torch.no_grad()
def score_matrix(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor, num_images: int,
                 num_sentences: int, smooth: float = 5.0, chunk_images: int = 64,
                 chunk_sentences: int = 512, progress: bool = False,
                 score: str = "eq6", scan: ScanSettings = DEFAULT_SCAN) -> Tensor:
    """`pair_scores` (eq. 6) or `scan_scores` of a whole test set, one block of chunk_images
    images x chunk_sentences sentences at a time: fragment scores exist one block at a time.

    v_owner / s_owner give each fragment's image / sentence, in any order. Cosine and inner
    (`image_sentence_scores` of the mean rows) are scored at once.
    """
    _check_fragments("v", v, v_owner, num_images)
    _check_fragments("s", s, s_owner, num_sentences)
    if v.shape[1] != s.shape[1]:
        raise ValueError(f"v and s must have the same embedding size: got {v.shape[1]} and "
                         f"{s.shape[1]}")
    if chunk_images < 1 or chunk_sentences < 1:
        raise ValueError(f"chunk sizes must be >= 1: got chunk_images={chunk_images}, "
                         f"chunk_sentences={chunk_sentences}")
    if smooth < 0:
        raise ValueError(f"smooth must be >= 0: got {smooth}")
    if score not in ("eq6", *SCAN_SCORES):
        return image_sentence_scores(v, v_owner.to(v.device), s, s_owner.to(s.device),
                                     num_images, num_sentences, smooth, score)

    # Sorted by owner, the fragments of a block of owners are one slice of rows (no copy).
    v, v_owner, v_start = _group_by_owner(v, v_owner, num_images)
    s, s_owner, s_start = _group_by_owner(s, s_owner, num_sentences)
    scores = v.new_zeros(num_images, num_sentences)
    image_chunks = range(0, num_images, chunk_images)
    sentence_chunks = range(0, num_sentences, chunk_sentences)
    with tqdm(total=len(image_chunks) * len(sentence_chunks), desc="score matrix", unit="block",
              disable=not progress) as bar:
        for k0 in image_chunks:
            k1 = min(k0 + chunk_images, num_images)
            v_rows = slice(v_start[k0], v_start[k1])
            for l0 in sentence_chunks:
                l1 = min(l0 + chunk_sentences, num_sentences)
                s_rows = slice(s_start[l0], s_start[l1])
                scores[k0:k1, l0:l1] = image_sentence_scores(
                    v[v_rows], v_owner[v_rows] - k0, s[s_rows], s_owner[s_rows] - l0, k1 - k0,
                    l1 - l0, smooth, score, scan)
                bar.update()
    return scores


def _group_by_owner(x: Tensor, owner: Tensor, num_owners: int) -> tuple[Tensor, Tensor, list[int]]:
    """Rows of x and their owners sorted by owner (no copy when already sorted), and the first
    row of each owner (num_owners + 1 offsets: owner k's rows are start[k]:start[k + 1])."""
    owner = owner.to(x.device)
    if bool((owner[1:] < owner[:-1]).any()):
        order = torch.argsort(owner, stable=True)
        x, owner = x[order], owner[order]
    count = torch.bincount(owner, minlength=num_owners)
    return x, owner, [0, *count.cumsum(0).tolist()]


def _check_fragments(name: str, x: Tensor, owner: Tensor, num_owners: int) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a 2-D float tensor [fragments, d]: got {x.dtype} of "
                         f"shape {tuple(x.shape)}")
    if owner.dim() != 1 or owner.dtype != torch.long or len(owner) != len(x):
        raise ValueError(f"{name}_owner must be a 1-D LongTensor with one entry per row of {name} "
                         f"({len(x)}): got {owner.dtype} of shape {tuple(owner.shape)}")
    if len(owner) and (int(owner.min()) < 0 or int(owner.max()) >= num_owners):
        raise ValueError(f"{name}_owner must hold indices in [0, {num_owners}): got values from "
                         f"{int(owner.min())} to {int(owner.max())}")


def owner_means(x: Tensor, owner: Tensor, num_owners: int) -> Tensor:
    """The mean row of each owner [num_owners, d]; zeros for an owner without rows."""
    sums = x.new_zeros(num_owners, x.shape[1]).index_add(0, owner, x)
    counts = torch.bincount(owner, minlength=num_owners).clamp(min=1).to(x.dtype)
    return sums / counts[:, None]


def image_sentence_scores(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor,
                          num_images: int, num_sentences: int, smooth: float = 5.0,
                          score: str = "eq6", scan: ScanSettings = DEFAULT_SCAN) -> Tensor:
    """S [num_images, num_sentences] of `score`: eq6 (`pair_scores`), SCAN's (`scan_scores`),
    else the mean image fragment x_k against the mean sentence row v_l (one row for
    whole-sentence encoders): inner = x_k . v_l (Socher et al. 2014, Section 4), cosine = the
    same of unit vectors (Kiros et al. 2014, Section 2.2). An image or sentence without rows
    scores 0."""
    if score == "eq6":
        return pair_scores(v, v_owner, s, s_owner, num_images, num_sentences, smooth)
    if score in SCAN_SCORES:
        return scan_scores(v, v_owner, s, s_owner, num_images, num_sentences, score, scan)
    if score not in SCORES:
        raise ValueError(f"score {score!r}: expected one of {SCORES}")
    images = owner_means(v, v_owner, num_images)
    sentences = owner_means(s, s_owner, num_sentences)
    if score == "cosine":
        images, sentences = nn.functional.normalize(images), nn.functional.normalize(sentences)
    return images @ sentences.T


def scan_scores(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor, num_images: int,
                num_sentences: int, score: str, scan: ScanSettings = DEFAULT_SCAN) -> Tensor:
    """SCAN's S(I, T) [num_images, num_sentences] (Lee et al. 2018, 3.1), rows L2-normalised.

    scan_t2i: s_ij = cos(v_i, e_j), s'_ij = [s_ij]_+ / sqrt(sum_j [s_ij]_+^2), alpha_ij =
    softmax_i(lambda1 s'_ij), a_j = sum_i alpha_ij v_i, R_j = cos(e_j, a_j), S = LSE (1/lambda2)
    log sum_j exp(lambda2 R_j) or AVG mean_j R_j. scan_i2t: the same with regions and words
    swapped. R needs only e_j . a_j = sum_i alpha_ij s_ij and |a_j|^2 = alpha_j^T G alpha_j with
    G the image's region Gram (the sentence's word Gram for i2t): no attended vector is built.
    An image or sentence without rows scores 0.
    """
    lambda1, aggregation, lambda2 = scan.resolved(score)
    scores = v.new_zeros(num_images, num_sentences)
    if len(v) == 0 or len(s) == 0:
        return scores
    v, s = nn.functional.normalize(v, dim=1), nn.functional.normalize(s, dim=1)
    images, v_index, v_mask = _padded_layout(v_owner)
    sentences, s_index, s_mask = _padded_layout(s_owner)
    # cos(v_i, e_j) [images, regions, sentences, words]; a pad's index is the appended zero row.
    # A zero row attended over only scales the attended vector a, which R, a cosine, ignores.
    v, s = nn.functional.pad(v, (0, 0, 0, 1)), nn.functional.pad(s, (0, 0, 0, 1))
    cosines = (v @ s.T)[v_index[:, :, None, None], s_index[None, None]]
    if score == "scan_t2i":  # each word attends over its image's regions (dim 1)
        alpha = _scan_attention(cosines, 1, 3, lambda1)
        regions = v[v_index]
        gram = regions @ regions.transpose(1, 2)  # [images, regions, regions]
        squared = (alpha * torch.einsum("irm,imtw->irtw", gram, alpha)).sum(1)
        relevance, mask, dim = _cosine(alpha, cosines, squared, 1), s_mask[None], 2
    else:  # each region attends over the sentence's words (dim 3)
        alpha = _scan_attention(cosines, 3, 1, lambda1)
        words = s[s_index]
        gram = words @ words.transpose(1, 2)  # [sentences, words, words]
        squared = (alpha * torch.einsum("twm,irtm->irtw", gram, alpha)).sum(3)
        relevance, mask, dim = _cosine(alpha, cosines, squared, 3), v_mask[:, :, None], 1
    if aggregation == "lse":
        block = torch.logsumexp((lambda2 * relevance).masked_fill(~mask, float("-inf")),
                                dim) / lambda2
    else:
        block = (relevance * mask).sum(dim) / mask.sum(dim)
    return scores.index_put((images[:, None], sentences[None, :]), block)


def _padded_layout(owner: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The owners that have rows (sorted), and [owners, longest] the row index of each one's
    rows in order (len(owner), the appended zero row, past its end) and whether it is a row."""
    owners, slot = torch.unique(owner, return_inverse=True)
    counts = torch.bincount(slot, minlength=len(owners))
    order = torch.argsort(slot, stable=True)
    position = torch.arange(len(owner), device=owner.device) - (counts.cumsum(0) - counts)[
        slot[order]]
    index = torch.full((len(owners), int(counts.max())), len(owner), device=owner.device)
    index[slot[order], position] = order
    return owners, index, index < len(owner)


def _scan_attention(cosines: Tensor, dim: int, query_dim: int, lambda1: float) -> Tensor:
    """alpha = softmax over `dim` (the attended rows) of lambda1 times the thresholded cosines,
    each attended row's normalised over the queries (`query_dim`; SCAN 3.1's s'_ij for i2t,
    3.2's for t2i, and its code's clipped_l2norm)."""
    positive = cosines.clamp(min=0)
    # + eps: a row without a positive cosine (as a pad) gets 0, not 0/0
    norm = torch.linalg.vector_norm(positive, dim=query_dim, keepdim=True)
    return torch.softmax(lambda1 * positive / (norm + _EPS), dim)


def _cosine(alpha: Tensor, cosines: Tensor, squared: Tensor, dim: int) -> Tensor:
    """R = cos(query, a) for unit queries: (sum over `dim` of alpha x cosine) / |a|, with |a|^2
    = `squared` (clamped first: the root's gradient stays finite)."""
    return (alpha * cosines).sum(dim) / squared.clamp(min=_EPS ** 2).sqrt()


def _aggregate(relu_scores: Tensor, v_owner: Tensor, s_owner: Tensor, num_images: int,
               num_sentences: int, smooth: float) -> Tensor:
    """Sum thresholded fragment scores per (image, sentence) and normalise them (eq. 6)."""
    sums = relu_scores.new_zeros(num_images, num_sentences)
    images, image_of = torch.unique(v_owner, return_inverse=True)
    sentences, sentence_of = torch.unique(s_owner, return_inverse=True)
    # Owner sums as products with one-hot matrices (BLAS beats scatter here); reduce the
    # side with more owners second so the intermediate stays small.
    rows = _one_hot(image_of, len(images), relu_scores.dtype).T
    cols = _one_hot(sentence_of, len(sentences), relu_scores.dtype)
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


def _one_hot(index: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """[len(index), num_classes] of `dtype`, 1 at (i, index[i]) and 0 elsewhere."""
    zeros = torch.zeros(len(index), num_classes, dtype=dtype, device=index.device)
    return zeros.scatter_(1, index[:, None], 1)


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


def mil_labels(scores: Tensor, rows: Tensor, cols: Tensor, num_cols: int, mil: bool) -> Tensor:
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


class RankTerms(NamedTuple):
    """The loss terms of some pairs (one rank's), before C_F's balance weights: those need the
    label counts of the whole batch, the sum of every rank's `label_counts`."""

    positive: Tensor  # sum of max(0, 1 - F_ij) over the positive fragment pairs (eq. 4/5)
    negative: Tensor  # sum of max(0, 1 + F_ij) over the negative ones
    label_counts: Tensor  # [|P|, |N|]: positive and negative fragment pairs counted
    ranking: Tensor  # C_G (eq. 7): these pairs' hinges over all B pairs


class DeFragLoss(nn.Module):
    """C = C_F + beta * C_G: fragment alignment (eq. 4/5) plus global ranking (eq. 7).

    `hardest_negative` (not in the paper; VSE++, Faghri et al. 2018) replaces eq. 7's sums over
    the negatives l by their maximum: each pair k is ranked against its hardest sentence and
    its hardest image of the (global) batch. `score` is C_G's image-sentence score
    (`image_sentence_scores`): eq6, or cosine with `use_fragment` off and `margin` 0.2 for Kiros
    et al.'s loss (Kiros eq. 6, their sum over pairs divided by B here), or scan_t2i / scan_i2t
    (`scan`'s knobs) with `use_fragment` off, `margin` 0.2 and `hardest_negative` for SCAN's
    (Lee et al. 2018, 3.2; their sum over pairs divided by B here). With `world_size` > 1
    each rank passes its own pairs; `global_negatives` gathers every rank's fragments, so that
    negatives span the global batch (module doc); without, each rank's loss is that of its
    local batch.
    """

    def __init__(self, beta: float = 1.0, margin: float = 1.0, smooth: float = 5.0,
                 mil: bool = True, balance: bool = True, use_fragment: bool = True,
                 use_global: bool = True, hardest_negative: bool = False, world_size: int = 1,
                 global_negatives: bool = True, score: str = "eq6",
                 scan: ScanSettings = DEFAULT_SCAN) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score {score!r}: expected one of {SCORES}")
        if smooth < 0:
            raise ValueError(f"smooth must be >= 0 (eq. 6's n), got {smooth}")
        if not (use_fragment or use_global):
            raise ValueError("DeFragLoss: enable at least one of use_fragment / use_global")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.beta, self.margin, self.smooth = beta, margin, smooth
        self.mil, self.balance = mil, balance
        self.use_fragment, self.use_global = use_fragment, use_global
        self.hardest_negative = hardest_negative
        self.world_size, self.global_negatives = world_size, global_negatives
        self.score, self.scan = score, scan

    def forward(self, v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor,
                image_key: Tensor) -> dict[str, Tensor]:
        """Loss of a batch of B = len(image_key) pairs; keys "loss", "fragment", "global".

        On W > 1 ranks the batch is this rank's, and the values are scaled so that their mean
        over ranks (`mean_over_ranks`; DDP averages gradients alike) is the objective: the
        global batch's loss with `global_negatives`, else the mean of the local batches' losses.
        """
        if self.world_size == 1 or not self.global_negatives:
            terms = self.rank_terms(v, v_owner, s, s_owner, image_key)
            return self.combine(terms, terms.label_counts)
        batch = gather_global_batch(v, v_owner, s, s_owner, image_key)
        terms = self.rank_terms(batch.v, batch.v_owner, batch.s, batch.s_owner, batch.image_key,
                                batch.own_pairs)
        out = self.combine(terms, sum_over_ranks(terms.label_counts))
        return {key: value * self.world_size for key, value in out.items()}

    def mean_over_ranks(self, out: dict[str, Tensor]) -> dict[str, float]:
        """The values of `forward`'s `out` averaged over ranks, without gradient: the
        objective's value, the same on every rank (for the log and the non-finite check)."""
        values = torch.stack([out[key] for key in TERMS]).detach()
        if self.world_size > 1:
            values = sum_over_ranks(values) / self.world_size
        return dict(zip(TERMS, values.tolist(), strict=True))

    def rank_terms(self, v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor,
                   image_key: Tensor, own_pairs: Tensor | None = None) -> RankTerms:
        """The terms of the pairs `own_pairs` (bool [B], default all) of a batch: their image
        fragments against every sentence fragment, and every image against their sentences.
        Over a partition of the pairs, the terms and their label counts sum to the batch's."""
        num_pairs = image_key.shape[0]
        if own_pairs is None:
            own_pairs = torch.ones(num_pairs, dtype=torch.bool, device=v.device)
        own_rows = own_pairs[v_owner]
        rows_v, rows_owner = (v, v_owner) if own_rows.all() else (v[own_rows], v_owner[own_rows])
        # F for this rank's image fragments and all sentence rows, when a term needs it
        row_scores = rows_v @ s.T if self.use_fragment or self.score == "eq6" else None
        zero = (rows_v.sum() + s.sum()) * 0

        positive = negative = zero
        label_counts = s.new_zeros(2)
        if self.use_fragment:
            positive, negative, label_counts = self._fragment_hinges(row_scores, rows_owner,
                                                                     s_owner, image_key)
        ranking = zero
        if self.use_global:
            ranking = self._global_ranking(row_scores, rows_v, rows_owner, v, v_owner, s,
                                           s_owner, image_key, own_pairs)
        return RankTerms(positive, negative, label_counts, ranking)

    def combine(self, terms: RankTerms, label_counts: Tensor) -> dict[str, Tensor]:
        """C_F from the hinge sums, with `balance` weighted by 1/|P| and 1/|N| of the batch's
        `label_counts`, and C = C_F + beta * C_G (eq. 3)."""
        if self.balance:
            # An empty set contributes 0 (e.g. B = 1 has no negatives).
            pos_weight, neg_weight = torch.where(label_counts > 0,
                                                 1 / label_counts.clamp(min=1), 0)
            fragment = pos_weight * terms.positive + neg_weight * terms.negative
        else:
            fragment = terms.positive + terms.negative
        return {"loss": fragment + self.beta * terms.ranking, "fragment": fragment,
                "global": terms.ranking}

    def _fragment_hinges(self, scores: Tensor, v_owner: Tensor, s_owner: Tensor,
                         image_key: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """C_F's hinges max(0, 1 - y_ij F_ij) summed over the positive and over the negative
        fragment pairs (eq. 4, 5), and the two counts.

        Every entry of F between different images is a negative. The few same-image entries
        are handled as a list: those of different pairs are excluded, the same pair's get
        their labels from `mil_labels`.
        """
        rows, cols = same_group_entries(image_key[v_owner], image_key[s_owner])
        same_image = scores[rows, cols]
        same_pair = v_owner[rows] == s_owner[cols]
        pair = same_image[same_pair]
        with torch.no_grad():
            positive = mil_labels(pair, rows[same_pair], cols[same_pair], scores.shape[1],
                                  self.mil)
            other_count = scores.numel() - len(rows)
            counts = torch.stack([positive.sum(), other_count + (~positive).sum()])
        # Over the other-image entries, sum max(0, 1 + F) = sum over all - over same-image ones.
        other_image = (scores.clamp(min=-1).sum() + scores.numel()
                       - (same_image.clamp(min=-1) + 1).sum())
        negative = other_image + torch.relu(1 + pair[~positive]).sum()
        return torch.relu(1 - pair[positive]).sum(), negative, counts.to(scores.dtype)

    def _global_ranking(self, row_scores: Tensor | None, rows_v: Tensor, rows_owner: Tensor,
                        v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor,
                        image_key: Tensor, own_pairs: Tensor) -> Tensor:
        """C_G of eq. 7 (Kiros eq. 6 alike) with `score`'s S for the own pairs k, averaged over
        all B pairs."""
        num_pairs = image_key.shape[0]
        if self.score == "eq6":  # S_kl for own images k, every sentence l, from F
            rows = _aggregate(torch.relu(row_scores), rows_owner, s_owner, num_pairs, num_pairs,
                              self.smooth)
        else:
            rows = image_sentence_scores(rows_v, rows_owner, s, s_owner, num_pairs, num_pairs,
                                         self.smooth, self.score, self.scan)
        if bool(own_pairs.all()):
            columns = rows
        else:  # S_lk for every image l, own sentences k
            own_cols = own_pairs[s_owner]
            columns = image_sentence_scores(v, v_owner, s[own_cols], s_owner[own_cols],
                                            num_pairs, num_pairs, self.smooth, self.score,
                                            self.scan)
        own = own_pairs.nonzero().squeeze(1)
        true_scores = rows[own, own]  # S_kk
        negatives = (image_key[own][:, None] != image_key[None, :]).to(rows.dtype)
        rank_sentences = torch.relu(rows[own] - true_scores[:, None] + self.margin) * negatives
        rank_images = torch.relu(columns[:, own].T - true_scores[:, None] + self.margin) * negatives
        if self.hardest_negative:  # hinges are >= 0, so a pair without negatives adds 0
            return (rank_sentences.amax(1) + rank_images.amax(1)).sum() / num_pairs
        return (rank_sentences + rank_images).sum() / num_pairs


# ---------------------------------------------------------------------------------------------
# The global batch: every rank's fragments, gathered with autograd. The gather's backward sums
# the gradients of every rank's loss into the rows of the rank that owns them.


@dataclass
class GlobalBatch:
    """The fragments of every rank's pairs, with pair indices renumbered globally."""

    v: Tensor
    v_owner: Tensor
    s: Tensor
    s_owner: Tensor
    image_key: Tensor
    own_pairs: Tensor  # bool [B_global]: the pairs of this rank


def gather_global_batch(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor,
                        image_key: Tensor, group: dist.ProcessGroup | None = None) -> GlobalBatch:
    """All-gather a rank's local batch (pair indices 0..B_local-1) into the global batch."""
    counts = torch.tensor([len(image_key), len(v), len(s)], device=v.device)
    everyone = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, counts, group=group)
    pairs, v_sizes, s_sizes = torch.stack(everyone).T.tolist()
    rank = dist.get_rank(group)
    offset = sum(pairs[:rank])
    own_pairs = torch.zeros(sum(pairs), dtype=torch.bool, device=v.device)
    own_pairs[offset:offset + len(image_key)] = True
    return GlobalBatch(
        v=all_gather_rows(v, v_sizes, group),
        v_owner=all_gather_rows(v_owner + offset, v_sizes, group),
        s=all_gather_rows(s, s_sizes, group),
        s_owner=all_gather_rows(s_owner + offset, s_sizes, group),
        image_key=all_gather_rows(image_key, pairs, group),
        own_pairs=own_pairs,
    )


def all_gather_rows(x: Tensor, sizes: list[int], group: dist.ProcessGroup | None = None) -> Tensor:
    """Concatenate the rows of `x` from every rank (rank r holds sizes[r] rows), differentiably.

    Row counts differ per rank: pad to the largest, gather, then drop the padding.
    """
    group = group or dist.group.WORLD
    longest = max(sizes)
    padded = torch.cat([x, x.new_zeros(longest - len(x), *x.shape[1:])])
    gathered = _all_gather_single(padded.contiguous(), 0, group)
    lengths = torch.tensor(sizes, device=x.device)
    keep = torch.arange(longest, device=x.device)[None, :] < lengths[:, None]
    return gathered[keep.flatten()]


# torch 2.11 and older (the stock image of many GPU clusters) name the differentiable gather
# all_gather_tensor_autograd; later versions deprecate that name.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd


def sum_over_ranks(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """All-reduce (sum) a copy of `x`, without gradient: label counts, logged values."""
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return total
