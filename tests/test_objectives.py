"""The objective against a slow reference written straight from the paper's equations 4-7, and
its distributed contract: W ranks give the gradients of one process on the concatenated batch."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.objectives import (
    DeFragLoss,
    gather_global_batch,
    image_sentence_scores,
    mil_labels,
    pair_scores,
    same_group_entries,
    sum_over_ranks,
)
from trainer.training.distributed import end_process


def reference_pair_scores(v, v_owner, s, s_owner, num_images, num_sentences, smooth):
    """Eq. 6 with explicit loops."""
    rows = []
    for k in range(num_images):
        g_k = [i for i in range(len(v)) if v_owner[i] == k]
        row = []
        for l in range(num_sentences):
            g_l = [j for j in range(len(s)) if s_owner[j] == l]
            total = sum((torch.relu(v[i] @ s[j]) for i in g_k for j in g_l), v.new_zeros(()))
            denom = max(len(g_k), 1) * (len(g_l) + smooth)
            row.append(total / denom if denom > 0 else total * 0)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference_scores(v, v_owner, s, s_owner, num_images, num_sentences, smooth, score):
    """S of `score`: eq. 6, or the mean image row against the mean sentence row, as their inner
    product (Socher) or cosine (Kiros 2.2), with explicit loops."""
    if score == "eq6":
        return reference_pair_scores(v, v_owner, s, s_owner, num_images, num_sentences, smooth)

    def mean(x, owner, k):
        rows = [x[i] for i in range(len(x)) if owner[i] == k]
        return sum(rows, x.new_zeros(x.shape[1])) / max(len(rows), 1)

    rows = []
    for k in range(num_images):
        x = mean(v, v_owner, k)
        row = []
        for l in range(num_sentences):
            y = mean(s, s_owner, l)
            x_k = x
            if score == "cosine":  # unit vectors; a zero vector stays zero
                x_k = x / x.norm() if float(x.norm()) else x
                y = y / y.norm() if float(y.norm()) else y
            row.append(sum((x_k[i] * y[i] for i in range(len(x))), x.new_zeros(())))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference_loss(v, v_owner, s, s_owner, image_key, beta=1.0, margin=1.0, smooth=5.0,
                   mil=True, balance=True, use_fragment=True, use_global=True,
                   hardest_negative=False, score="eq6"):
    """C = C_F + beta C_G exactly as docs/design.md section 4 states it, one scalar at a time."""
    B = len(image_key)
    F = [[v[i] @ s[j] for j in range(len(s))] for i in range(len(v))]
    labels = {}  # (i, j) -> +1 / -1 for the included fragment pairs
    for j in range(len(s)):
        bag = [i for i in range(len(v)) if v_owner[i] == s_owner[j]]
        for i in range(len(v)):
            if image_key[v_owner[i]] != image_key[s_owner[j]]:
                labels[i, j] = -1
            elif v_owner[i] == s_owner[j]:
                labels[i, j] = (1 if F[i][j].item() > 0 else -1) if mil else 1
        if mil and bag and all(labels[i, j] == -1 for i in bag):
            best = max(bag, key=lambda i: (F[i][j].item(), -i))  # first index on ties
            labels[best, j] = 1
    positives = [(i, j) for (i, j), y in labels.items() if y == 1]
    negatives = [(i, j) for (i, j), y in labels.items() if y == -1]
    fragment = v.new_zeros(())
    for group in (positives, negatives):
        weight = (1.0 / len(group) if group else 0.0) if balance else 1.0
        for i, j in group:
            fragment = fragment + weight * torch.relu(1 - labels[i, j] * F[i][j])

    S = reference_scores(v, v_owner, s, s_owner, B, B, smooth, score)
    ranking = v.new_zeros(())
    for k in range(B):
        others = [l for l in range(B) if image_key[l] != image_key[k]]
        rank_sentences = [torch.relu(S[k, l] - S[k, k] + margin) for l in others]
        rank_images = [torch.relu(S[l, k] - S[k, k] + margin) for l in others]
        for hinges in (rank_sentences, rank_images):
            if hardest_negative:  # VSE++: only the largest hinge counts
                ranking = ranking + max(hinges, key=lambda h: h.item(), default=0 * ranking)
            else:
                ranking = ranking + sum(hinges, 0 * ranking)
    ranking = ranking / B
    fragment = fragment if use_fragment else fragment * 0
    ranking = ranking if use_global else ranking * 0
    return {"loss": fragment + beta * ranking, "fragment": fragment, "global": ranking}


def make_batch(image_frags, sentence_frags, image_key, d=6, seed=0, scale=0.6):
    """Random fragments: image_frags[k] and sentence_frags[k] fragments for pair k."""
    g = torch.Generator().manual_seed(seed)
    v_owner = torch.repeat_interleave(torch.arange(len(image_frags)), torch.tensor(image_frags))
    s_owner = torch.repeat_interleave(torch.arange(len(sentence_frags)),
                                      torch.tensor(sentence_frags))
    # Shuffle the owners so nothing relies on fragments being grouped by pair.
    v_owner = v_owner[torch.randperm(len(v_owner), generator=g)]
    s_owner = s_owner[torch.randperm(len(s_owner), generator=g)]
    v = (scale * torch.randn(len(v_owner), d, generator=g, dtype=torch.float64)).requires_grad_()
    s = (scale * torch.randn(len(s_owner), d, generator=g, dtype=torch.float64)).requires_grad_()
    return v, v_owner, s, s_owner, torch.tensor(image_key)


def assert_matches_reference(batch, **switches):
    v, v_owner, s, s_owner, image_key = batch
    got = DeFragLoss(**switches)(v, v_owner, s, s_owner, image_key)
    want = reference_loss(v, v_owner, s, s_owner, image_key, **switches)
    for key in ("loss", "fragment", "global"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12, msg=key)
    got_grads = torch.autograd.grad(got["loss"], (v, s), allow_unused=True)
    want_grads = torch.autograd.grad(want["loss"], (v, s), allow_unused=True)
    for got_g, want_g in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    return got


# Pairs 1 and 3 share an image; pair 2's sentence has no fragments.
SHARED_IMAGE_BATCH = dict(image_frags=[3, 2, 4, 1, 2], sentence_frags=[2, 3, 0, 4, 1],
                          image_key=[10, 11, 12, 11, 13])


@pytest.mark.parametrize("mil,balance", list(itertools.product([True, False], repeat=2)))
def test_loss_matches_reference(mil, balance):
    got = assert_matches_reference(make_batch(**SHARED_IMAGE_BATCH), mil=mil, balance=balance,
                                   beta=0.7, margin=0.5, smooth=5.0)
    assert got["fragment"] > 0 and got["global"] > 0


@pytest.mark.parametrize("score", ["cosine", "inner"])
@pytest.mark.parametrize("hardest_negative", [False, True])
def test_global_ranking_of_other_scores_matches_reference(score, hardest_negative):
    """Kiros's (cosine) and Socher's (inner product) ranking losses: eq. 7's hinges over S."""
    got = assert_matches_reference(make_batch(**SHARED_IMAGE_BATCH, seed=3), use_fragment=False,
                                   margin=0.2, score=score, hardest_negative=hardest_negative)
    assert got["global"] > 0


@pytest.mark.parametrize("score", ["eq6", "cosine", "inner"])
def test_image_sentence_scores_match_reference(score):
    v, v_owner, s, s_owner, _ = make_batch(**SHARED_IMAGE_BATCH, seed=5)
    got = image_sentence_scores(v, v_owner, s, s_owner, 5, 5, 5.0, score)
    want = reference_scores(v, v_owner, s, s_owner, 5, 5, 5.0, score)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got[:, 2] == 0).all()  # pair 2's sentence has no rows
    if score == "cosine":
        assert got.abs().max() <= 1 + 1e-12
    with pytest.raises(ValueError, match="score 'dot'"):
        image_sentence_scores(v, v_owner, s, s_owner, 5, 5, 5.0, "dot")


@pytest.mark.parametrize("use_fragment,use_global", [(True, False), (False, True)])
def test_objective_switches(use_fragment, use_global):
    got = assert_matches_reference(make_batch(**SHARED_IMAGE_BATCH, seed=1),
                                   use_fragment=use_fragment, use_global=use_global)
    assert (got["fragment"] == 0) != use_fragment
    assert (got["global"] == 0) != use_global


@pytest.mark.parametrize("seed", [0, 4])
def test_hardest_negative_matches_reference(seed):
    got = assert_matches_reference(make_batch(**SHARED_IMAGE_BATCH, seed=seed), beta=0.7,
                                   margin=0.5, hardest_negative=True)
    summed = DeFragLoss(beta=0.7, margin=0.5)(*make_batch(**SHARED_IMAGE_BATCH, seed=seed))
    assert 0 < got["global"] < summed["global"]


def test_smoothing_and_margin_values():
    batch = make_batch(**SHARED_IMAGE_BATCH, seed=2, scale=1.5)
    for smooth, margin in [(0.0, 1.0), (2.5, 0.1), (5.0, 3.0)]:
        assert_matches_reference(batch, smooth=smooth, margin=margin, beta=2.0)


def test_single_pair_has_no_negatives():
    batch = make_batch(image_frags=[4], sentence_frags=[3], image_key=[0], seed=3)
    got = assert_matches_reference(batch)
    assert torch.isfinite(got["loss"]) and got["global"] == 0


def test_positive_bag_without_positive_score_gets_its_best_member():
    # Two image fragments, one sentence fragment, every score negative.
    v = torch.tensor([[-1.0, 0.0], [-0.5, 0.0], [2.0, 0.0]], dtype=torch.float64,
                     requires_grad=True)
    s = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    v_owner, s_owner = torch.tensor([0, 0, 1]), torch.tensor([0, 1])
    image_key = torch.tensor([0, 1])
    rows, cols = same_group_entries(v_owner, s_owner)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(0, 0), (1, 0), (2, 1)]
    labels = mil_labels((v @ s.T).detach()[rows, cols], rows, cols, 2, mil=True)
    # Sentence fragment 0: bag {0, 1} scores {-1, -0.5} -> fragment 1 becomes positive.
    # Sentence fragment 1: bag {2} scores {-2} -> fragment 2 becomes positive.
    assert labels.tolist() == [False, True, True]
    assert_matches_reference((v, v_owner, s, s_owner, image_key))


def test_mil_ties_pick_the_first_bag_member():
    # Column 0's bag: rows 3, 1, 2 (listed out of order) with a tie at -0.5 between rows 1, 2.
    scores = torch.tensor([-1.0, -0.5, -0.5, 0.0, 2.0])
    rows, cols = torch.tensor([3, 2, 1, 0, 0]), torch.tensor([0, 0, 0, 1, 2])
    labels = mil_labels(scores, rows, cols, 3, mil=True)
    assert labels.tolist() == [False, False, True, True, True]
    assert mil_labels(scores, rows, cols, 3, mil=False).all()


def test_same_group_entries_lists_every_matching_entry():
    g = torch.Generator().manual_seed(7)
    row_group, col_group = torch.randint(0, 5, (17,), generator=g), torch.randint(0, 5, (11,),
                                                                                   generator=g)
    rows, cols = same_group_entries(row_group, col_group)
    dense = (row_group[:, None] == col_group[None, :]).nonzero()
    assert torch.equal(torch.stack([rows, cols], 1), dense)


def test_pair_scores_matches_reference_and_empty_sentences_score_zero():
    v, v_owner, s, s_owner, _ = make_batch(**SHARED_IMAGE_BATCH, seed=4, scale=1.0)
    for smooth in (5.0, 0.0):
        got = pair_scores(v, v_owner, s, s_owner, 5, 5, smooth=smooth)
        want = reference_pair_scores(v, v_owner, s, s_owner, 5, 5, smooth)
        torch.testing.assert_close(got, want)
        assert torch.isfinite(got).all() and (got[:, 2] == 0).all()


def test_pair_scores_gradient_matches_reference():
    v, v_owner, s, s_owner, _ = make_batch(**SHARED_IMAGE_BATCH, seed=5, scale=1.0)
    weights = torch.randn(5, 5, dtype=torch.float64)
    got = torch.autograd.grad((pair_scores(v, v_owner, s, s_owner, 5, 5) * weights).sum(), (v, s))
    want = torch.autograd.grad(
        (reference_pair_scores(v, v_owner, s, s_owner, 5, 5, 5.0) * weights).sum(), (v, s))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("mil,hardest_negative", [(True, False), (False, False), (True, True)])
def test_per_rank_terms_sum_to_the_global_loss(num_ranks, mil, hardest_negative):
    """The decomposition the gathered loss relies on, in one process: the terms of each rank's
    own pairs, weighted with the label counts of all ranks, sum to the whole batch's loss."""
    batch = make_batch(image_frags=[3, 2, 4, 1, 2, 5, 2], sentence_frags=[2, 3, 0, 4, 1, 2, 3],
                       image_key=[10, 11, 12, 11, 13, 10, 14], seed=6)
    v, v_owner, s, s_owner, image_key = batch
    loss = DeFragLoss(mil=mil, beta=0.5, hardest_negative=hardest_negative)
    full = loss(*batch)
    full_grads = torch.autograd.grad(full["loss"], (v, s))

    rank_of_pair = torch.arange(len(image_key)) % num_ranks
    terms = [loss.rank_terms(*batch, own_pairs=rank_of_pair == rank) for rank in range(num_ranks)]
    label_counts = sum(t.label_counts for t in terms)
    parts = [loss.combine(t, label_counts) for t in terms]
    for key in ("loss", "fragment", "global"):
        torch.testing.assert_close(sum(p[key] for p in parts), full[key], msg=key)
    part_grads = torch.autograd.grad(sum(p["loss"] for p in parts), (v, s))
    for a, b in zip(part_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_invalid_switches_are_rejected():
    with pytest.raises(ValueError, match="smooth"):
        DeFragLoss(smooth=-1)
    with pytest.raises(ValueError, match="use_fragment"):
        DeFragLoss(use_fragment=False, use_global=False)


# ---------------------------------------------------------------------------------------------
# The gradient contract over real gloo processes: each rank calls the loss on its own pairs and
# backpropagates; the mean of the ranks' gradients (what DDP and DeepSpeed apply) is the gradient
# of one process on the concatenated batch, and `mean_over_ranks` is its loss.

# Seven pairs split unevenly over the ranks; pairs 1 and 4 (and 0 and 5) share an image,
# pair 2's sentence has no fragments, fragment counts differ per pair.
IMAGE_FRAGS = [3, 2, 4, 1, 2, 5, 2]
SENTENCE_FRAGS = [2, 3, 0, 4, 1, 2, 3]
IMAGE_KEY = [10, 11, 12, 13, 11, 10, 14]
SPLITS = {2: [3, 4], 3: [2, 4, 1]}  # pairs per rank


def make_model_and_inputs():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"image": torch.nn.Linear(5, 8), "sentence": torch.nn.Linear(4, 8)})
    model = model.double()
    image_inputs = [torch.randn(n, 5, dtype=torch.float64) for n in IMAGE_FRAGS]
    sentence_inputs = [torch.randn(n, 4, dtype=torch.float64) for n in SENTENCE_FRAGS]
    return model, image_inputs, sentence_inputs


def local_batch(model, image_inputs, sentence_inputs, pairs):
    v = model["image"](torch.cat([image_inputs[p] for p in pairs]))
    s = model["sentence"](torch.cat([sentence_inputs[p] for p in pairs]))
    v_owner = torch.cat([torch.full((IMAGE_FRAGS[p],), i) for i, p in enumerate(pairs)])
    s_owner = torch.cat([torch.full((SENTENCE_FRAGS[p],), i) for i, p in enumerate(pairs)])
    return v, v_owner, s, s_owner, torch.tensor([IMAGE_KEY[p] for p in pairs])


def gradient_contract_worker(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    for mil, hardest_negative in ((True, False), (False, False), (True, True)):
        check_gradients(rank, world_size,
                        {"mil": mil, "beta": 0.5, "hardest_negative": hardest_negative})
    for score, hardest_negative in (("cosine", False), ("inner", False), ("cosine", True)):
        check_gradients(rank, world_size, {"use_fragment": False, "margin": 0.2,
                                           "score": score, "hardest_negative": hardest_negative})
    check_gradients(rank, world_size, {"beta": 0.5, "score": "inner"})  # C_F + Socher's C_G
    end_process(0)  # destroys the group; gloo may abort at interpreter exit otherwise


def check_gradients(rank, world_size, switches):
    model, image_inputs, sentence_inputs = make_model_and_inputs()
    full = DeFragLoss(**switches)(*local_batch(model, image_inputs, sentence_inputs,
                                               range(len(IMAGE_KEY))))
    want = torch.autograd.grad(full["loss"], list(model.parameters()))

    start = sum(SPLITS[world_size][:rank])
    mine = local_batch(model, image_inputs, sentence_inputs,
                       range(start, start + SPLITS[world_size][rank]))
    assert gather_global_batch(*mine).image_key.tolist() == IMAGE_KEY
    loss = DeFragLoss(**switches, world_size=world_size)
    out = loss(*mine)
    grads = torch.autograd.grad(out["loss"], list(model.parameters()))
    assert loss.mean_over_ranks(out) == pytest.approx({k: float(full[k]) for k in full})
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(sum_over_ranks(got) / world_size, expected)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_gathered_loss_gradients_equal_single_process(tmp_path, world_size):
    mp.spawn(gradient_contract_worker, args=(world_size, str(tmp_path / "store")),
             nprocs=world_size)
