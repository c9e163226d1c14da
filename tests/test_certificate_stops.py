"""certified_top_k (trainer/search/certificate.py) when it stops before its bounds close (the
budget spent): what it certifies is the exact top k, and its gap covers what it left unscored.
A first stage of given bounds and exact scores, no model."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.search.certificate import RESCORE_FIRST, Candidates, certified_top_k


def ranked(scores: np.ndarray, found: Candidates, k: int, budget_s: float | None):
    """The certified top k over a first stage that finds `found`, and every item once widened."""
    n = len(scores)
    every = Candidates(np.arange(n), scores.astype(np.float64), -np.inf, 4 * n, True)
    return certified_top_k(lambda keys, probe: found if keys <= n else every,
                           lambda positions: scores[positions], [str(i) for i in range(n)], k,
                           keys=n, probe=1, budget_s=budget_s)


def test_a_search_stopped_by_its_budget_leaves_the_next_bound_open() -> None:
    """The first batch (RESCORE_FIRST items, bounds 10, scores 1) is all a spent budget allows;
    the next candidate (bound 10) scores 5, the last is bounded by 0.5: not certified, and the
    gap covers 5 - 1 (the bound left open is the next candidate's, not the one after it)."""
    n = RESCORE_FIRST + 2
    scores, bounds = np.ones(n), np.full(n, 10.0)
    scores[RESCORE_FIRST], scores[-1], bounds[-1] = 5.0, 0.25, 0.5
    ranking = ranked(scores, Candidates(np.arange(n), bounds, -np.inf, n, False), 1, 0.0)
    assert not ranking.exact
    assert ranking.hits[0].score + ranking.gap >= scores.max()


@pytest.mark.parametrize("seed", range(40))
def test_certified_is_the_exact_top_k_and_a_gap_covers_the_rest(seed: int) -> None:
    """Random scores, bounds at or above them, some items only under `outside`; stopped at once
    (budget 0) or not at all: a certified answer is the exact top k (ties in index order), an
    uncertified one's k-th score plus its gap reaches the true k-th score."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(60, 300)), int(rng.integers(1, 12))
    scores = rng.normal(size=n).round(1)  # ties
    listed = np.sort(rng.choice(n, int(rng.integers(k, n + 1)), replace=False))
    left = np.setdiff1d(np.arange(n), listed)
    bounds = scores[listed] + rng.exponential(rng.choice([0.01, 1.0]), len(listed))
    outside = scores[left].max() + 0.1 if len(left) else -np.inf
    found = Candidates(listed, bounds, outside, n, not len(left))
    truth = np.argsort(-scores, kind="stable")[:k]
    for budget_s in (0.0, None):
        ranking = ranked(scores, found, k, budget_s)
        if ranking.exact:
            assert [hit.position for hit in ranking.hits] == truth.tolist()
        else:
            assert ranking.hits[-1].score + ranking.gap >= scores[truth[-1]] - 1e-12
