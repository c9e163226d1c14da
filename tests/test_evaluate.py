"""trainer/evaluate.py against slow references written from the definitions, and tiny hand cases."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer.evaluate import hodosh_metrics, retrieval_metrics
from trainer.objectives import score_matrix

KEYS = {f"{d}_{m}" for d in ("i2t", "t2i") for m in ("r1", "r5", "r10", "medr", "meanr")} | {"rsum"}


# ---------------------------------------------------------------- slow references


def reference_metrics(scores: torch.Tensor, sentence_image: torch.Tensor) -> dict[str, float]:
    """Sort every list, wrong items before true ones on ties (the pessimistic rule), and count."""
    rows, owner = scores.tolist(), sentence_image.tolist()
    i2t, t2i = [], []
    for k, row in enumerate(rows):
        if k not in owner:
            continue  # an image with no sentence is not an i2t query
        ranked = sorted(range(len(row)), key=lambda col: (-row[col], owner[col] == k))
        i2t.append(1 + min(pos for pos, col in enumerate(ranked) if owner[col] == k))
    for col, true_image in enumerate(owner):
        column = [row[col] for row in rows]
        ranked = sorted(range(len(rows)), key=lambda k: (-column[k], k == true_image))
        t2i.append(1 + ranked.index(true_image))
    metrics = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in (1, 5, 10):
            metrics[f"{name}_r{k}"] = 100.0 * sum(r <= k for r in ranks) / len(ranks)
        metrics[f"{name}_medr"] = float(math.floor(statistics.median(ranks)))
        metrics[f"{name}_meanr"] = sum(ranks) / len(ranks)
    metrics["rsum"] = sum(metrics[f"{name}_r{k}"] for name in ("i2t", "t2i") for k in (1, 5, 10))
    return metrics


def reference_scores(v, v_owner, s, s_owner, num_images, num_sentences, smooth=5.0):
    """Eq. 6 one pair at a time, in float64."""
    out = torch.zeros(num_images, num_sentences, dtype=torch.float64)
    for k in range(num_images):
        image = [v[i].double() for i in range(len(v)) if v_owner[i] == k]
        for l in range(num_sentences):
            sentence = [s[j].double() for j in range(len(s)) if s_owner[j] == l]
            if not image or not sentence:
                continue
            total = sum(max(0.0, float(vi @ sj)) for vi in image for sj in sentence)
            out[k, l] = total / (len(image) * (len(sentence) + smooth))
    return out


def assert_metrics_equal(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == KEYS
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-9), key


def random_fragments(seed, num_images, num_sentences, d=8, max_image=4, max_sentence=5):
    """Random fragments, shuffled owners, random counts that include 0."""
    g = torch.Generator().manual_seed(seed)
    v_count = torch.randint(0, max_image + 1, (num_images,), generator=g)
    s_count = torch.randint(0, max_sentence + 1, (num_sentences,), generator=g)
    v_count[1], s_count[2] = 0, 0  # at least one image and one sentence with no fragments
    v_owner = torch.repeat_interleave(torch.arange(num_images), v_count)
    s_owner = torch.repeat_interleave(torch.arange(num_sentences), s_count)
    v_owner = v_owner[torch.randperm(len(v_owner), generator=g)]
    s_owner = s_owner[torch.randperm(len(s_owner), generator=g)]
    v = torch.randn(len(v_owner), d, generator=g)
    s = torch.randn(len(s_owner), d, generator=g)
    return v, v_owner, s, s_owner


# ---------------------------------------------------------------- retrieval_metrics


@pytest.mark.parametrize("seed", range(3))
def test_metrics_match_reference_five_sentences_per_image(seed):
    g = torch.Generator().manual_seed(seed)
    num_images = 30
    sentence_image = torch.arange(num_images).repeat_interleave(5)
    sentence_image = sentence_image[torch.randperm(len(sentence_image), generator=g)]
    # Signal plus noise so that ranks spread over 1..N, and a few coarse ties.
    scores = torch.randn(num_images, 5 * num_images, generator=g)
    scores[sentence_image, torch.arange(5 * num_images)] += 1.5
    scores[:, :20] = scores[:, :20].round()
    assert_metrics_equal(retrieval_metrics(scores, sentence_image),
                         reference_metrics(scores, sentence_image))


@pytest.mark.parametrize("seed", range(3))
def test_metrics_match_reference_uneven_counts(seed):
    g = torch.Generator().manual_seed(seed)
    num_images, num_sentences = 24, 70
    sentence_image = torch.randint(0, num_images, (num_sentences,), generator=g)
    sentence_image[:num_images - 2] = torch.arange(num_images - 2)  # the last two may lack one
    scores = torch.randn(num_images, num_sentences, generator=g).round(decimals=1)
    assert_metrics_equal(retrieval_metrics(scores, sentence_image),
                         reference_metrics(scores, sentence_image))


def test_perfect_scores():
    sentence_image = torch.tensor([0, 0, 1, 1, 2, 2])
    scores = (sentence_image[None, :] == torch.arange(3)[:, None]).float()
    metrics = retrieval_metrics(scores, sentence_image)
    for direction in ("i2t", "t2i"):
        assert metrics[f"{direction}_r1"] == 100.0
        assert metrics[f"{direction}_medr"] == 1.0
        assert metrics[f"{direction}_meanr"] == 1.0
    assert metrics["rsum"] == 600.0


def test_hand_computed_ranks():
    # Row k is image k, column l sentence l, sentence l belongs to image l.
    scores = torch.tensor([[0.90, 0.80, 0.10, 0.00],
                           [0.95, 0.50, 0.70, 0.20],
                           [0.10, 0.20, 0.30, 0.40],
                           [0.00, 0.10, 0.20, 0.05]])
    metrics = retrieval_metrics(scores, torch.arange(4))
    # i2t ranks (along rows): 1, 3, 2, 3; t2i ranks (along columns): 2, 2, 2, 3.
    assert metrics == pytest.approx({
        "i2t_r1": 25.0, "i2t_r5": 100.0, "i2t_r10": 100.0, "i2t_medr": 2.0, "i2t_meanr": 2.25,
        "t2i_r1": 0.0, "t2i_r5": 100.0, "t2i_r10": 100.0, "t2i_medr": 2.0, "t2i_meanr": 2.25,
        "rsum": 425.0})


def test_recall_at_5_and_10_boundaries():
    # Image 0 owns sentence 6, its 7th best; image 1 owns the others, all tied at its top.
    scores = torch.stack([-torch.arange(12.0), (torch.arange(12) != 6).float()])
    sentence_image = torch.where(torch.arange(12) == 6, 0, 1)
    metrics = retrieval_metrics(scores, sentence_image)
    assert (metrics["i2t_r1"], metrics["i2t_r5"], metrics["i2t_r10"]) == (50.0, 50.0, 100.0)
    assert (metrics["i2t_medr"], metrics["i2t_meanr"]) == (4.0, 4.0)
    assert_metrics_equal(metrics, reference_metrics(scores, sentence_image))


def test_ties_are_pessimistic():
    # A constant matrix: every wrong item ties with the truth and is ranked above it.
    sentence_image = torch.tensor([0, 0, 1, 1])
    metrics = retrieval_metrics(torch.zeros(2, 4), sentence_image)
    assert metrics["i2t_r1"] == 0.0 and metrics["i2t_meanr"] == 3.0  # behind 2 wrong sentences
    assert metrics["t2i_r1"] == 0.0 and metrics["t2i_meanr"] == 2.0  # behind 1 wrong image
    # True sentences tied with each other do not push each other down.
    scores = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    assert retrieval_metrics(scores, sentence_image)["i2t_r1"] == 100.0


def test_image_without_sentence_is_a_t2i_candidate_only():
    sentence_image = torch.tensor([0, 1])
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])  # image 2 has no sentence
    metrics = retrieval_metrics(scores, sentence_image)
    assert metrics["i2t_r1"] == 100.0  # over images 0 and 1 only
    assert metrics["t2i_r1"] == 0.0 and metrics["t2i_meanr"] == 2.0  # image 2 beats the truth
    assert_metrics_equal(metrics, reference_metrics(scores, sentence_image))


@pytest.mark.parametrize(("scores", "sentence_image", "message"), [
    (torch.zeros(4), torch.zeros(4, dtype=torch.long), "2-D float"),
    (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long), "2-D float"),
    (torch.zeros(2, 3), torch.zeros(4, dtype=torch.long), "4 entries but scores has 3"),
    (torch.zeros(2, 3), torch.zeros(3), "LongTensor"),
    (torch.zeros(2, 3), torch.tensor([0, 1, 2]), r"\[0, 2\)"),
    (torch.zeros(2, 3), torch.tensor([0, -1, 1]), r"\[0, 2\)"),
    (torch.zeros(2, 0), torch.zeros(0, dtype=torch.long), "no sentences"),
    (torch.tensor([[0.0, math.nan]]), torch.tensor([0, 0]), "NaN"),
])
def test_metrics_input_errors(scores, sentence_image, message):
    with pytest.raises(ValueError, match=message):
        retrieval_metrics(scores, sentence_image)
    with pytest.raises(ValueError, match=message):
        hodosh_metrics(scores, sentence_image)


# ---------------------------------------------------------------- Hodosh protocol


def test_hodosh_matches_reference_on_first_sentences():
    g = torch.Generator().manual_seed(7)
    num_images, num_sentences = 20, 60
    sentence_image = torch.randint(0, num_images, (num_sentences,), generator=g)
    scores = torch.randn(num_images, num_sentences, generator=g)
    first = [owner_cols[0] for k in range(num_images)
             if (owner_cols := [c for c in range(num_sentences) if sentence_image[c] == k])]
    want = reference_metrics(scores[:, first], sentence_image[first])
    assert_metrics_equal(hodosh_metrics(scores, sentence_image), want)


def test_hodosh_keeps_first_of_each_group_of_five():
    sentence_image = torch.arange(4).repeat_interleave(5)
    scores = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    want = retrieval_metrics(scores[:, ::5], torch.arange(4))
    assert hodosh_metrics(scores, sentence_image) == want


# ---------------------------------------------------------------- score_matrix


@pytest.mark.parametrize(("chunk_images", "chunk_sentences"), [(1, 1), (3, 4), (2, 5), (100, 100)])
def test_score_matrix_matches_eq6_reference(chunk_images, chunk_sentences):
    num_images, num_sentences = 7, 11
    v, v_owner, s, s_owner = random_fragments(0, num_images, num_sentences)
    got = score_matrix(v, v_owner, s, s_owner, num_images, num_sentences,
                       chunk_images=chunk_images, chunk_sentences=chunk_sentences)
    want = reference_scores(v, v_owner, s, s_owner, num_images, num_sentences)
    assert got.shape == (num_images, num_sentences) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (got[1] == 0).all() and (got[:, 2] == 0).all()  # the owners with no fragments


def test_score_matrix_empty_owners_score_zero_without_smoothing():
    v, v_owner, s, s_owner = random_fragments(1, 5, 6)
    got = score_matrix(v, v_owner, s, s_owner, 5, 6, smooth=0.0, chunk_images=2,
                       chunk_sentences=4)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), reference_scores(v, v_owner, s, s_owner, 5, 6, 0.0),
                               rtol=1e-5, atol=1e-6)
    empty = score_matrix(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), torch.ones(2, 3),
                         torch.tensor([0, 0]), 2, 3)
    assert empty.shape == (2, 3) and (empty == 0).all()


def test_score_matrix_ignores_fragment_order_and_gradients():
    v, v_owner, s, s_owner = random_fragments(2, 6, 9)
    v.requires_grad_(True)
    ordered = score_matrix(v, v_owner, s, s_owner, 6, 9, chunk_images=4, chunk_sentences=4)
    perm_v, perm_s = torch.randperm(len(v)), torch.randperm(len(s))
    shuffled = score_matrix(v[perm_v], v_owner[perm_v], s[perm_s], s_owner[perm_s], 6, 9,
                            chunk_images=4, chunk_sentences=4, progress=True)
    torch.testing.assert_close(ordered, shuffled)
    assert not ordered.requires_grad


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"v_owner": torch.tensor([0, 3])}, r"v_owner must hold indices in \[0, 3\)"),
    ({"s_owner": torch.tensor([0, 1, 2])}, "one entry per row of s"),
    ({"s": torch.zeros(2, 5)}, "same embedding size"),
    ({"v": torch.zeros(2, 4, dtype=torch.long)}, "2-D float"),
    ({"chunk_images": 0}, "chunk sizes"),
    ({"smooth": -1.0}, "smooth"),
])
def test_score_matrix_input_errors(kwargs, message):
    args = {"v": torch.zeros(2, 4), "v_owner": torch.tensor([0, 1]), "s": torch.zeros(2, 4),
            "s_owner": torch.tensor([0, 1]), "num_images": 3, "num_sentences": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        score_matrix(**args)


def test_score_matrix_matches_pair_scores():
    from trainer.objectives import pair_scores  # the training objective's one-shot eq. 6

    v, v_owner, s, s_owner = random_fragments(3, 9, 14, d=16)
    want = pair_scores(v, v_owner, s, s_owner, 9, 14, smooth=5.0)
    got = score_matrix(v, v_owner, s, s_owner, 9, 14, smooth=5.0, chunk_images=2,
                       chunk_sentences=3)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
