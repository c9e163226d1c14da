"""A review of the int8 first stage's soundness (trainer/search/compact_keys.py): inputs on
which a certified top k is not the exact scan's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.search.index as index
from tests.test_certified_search import definition_scores, every_key
from tests.test_compact_keys import SMOOTH, opened
from trainer.batch import owners
from trainer.search.fragment_set import FragmentSet


def query_of(rows: torch.Tensor) -> FragmentSet:
    """One query item of `rows`."""
    return FragmentSet(["query"], rows, owners([len(rows)]), torch.zeros(len(rows), 3))


def certified_right(side: index.Collection, query: FragmentSet, k: int) -> bool:
    """Whether the search is either not certified or the exact scan's top k."""
    found = index.search(side, query, k, True, SMOOTH, "eq6", budget_s=None)
    truth = index.search(side, query, k, True, SMOOTH, "eq6", exact_scan=True)
    return not found.exact or found.hits == truth.hits


def test_one_dimensional_keys_are_bounded_and_certified_right(tmp_path: Path) -> None:
    """d = 1 (model.embed_dim is any positive int): the query codes' transpose [1, columns]
    keeps strides (1, 1), for which torch._int_mm returns memory it never wrote
    (int8_products_exact checks d = 1040 only); every pair's bound must still be >= its exact
    product, and every certified top k the exact scan's."""
    rows = 3 * torch.randn(200, 1, generator=torch.Generator().manual_seed(0))
    side = opened(tmp_path, rows, "eq6", 3)
    assert side.compact is not None
    side.key_candidates, keys = 5, every_key(side)
    for value in (-5.0, -1.0, 2.0, 5.0):
        query = query_of(torch.tensor([[value], [0.5]]))
        scan = side.compact.scan(query.embeddings.double())
        pairs = side.compact.pair_bounds(scan, np.arange(len(keys))).double().numpy().T
        products = definition_scores(side, keys, query, True, SMOOTH)[0]
        assert np.all(pairs >= products), (value, int(np.sum(pairs < products)))
        assert all(certified_right(side, query, k) for k in (1, 3)), value


def test_a_nan_row_does_not_certify_a_wrong_top_k(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One fragment row of NaN outside the projection's sample (any collection of more than
    PROJECTION_SAMPLE keys can hold one; the build checks no row): the largest key error and
    norm are NaN, so every item's bound is, and the certificate (Python's max drops a NaN)
    certifies the first 50 items scored."""
    monkeypatch.setattr(index, "PROJECTION_SAMPLE", 300)
    sample = set(torch.randperm(600, generator=torch.Generator().manual_seed(0))[:300].tolist())
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(600, 8, generator=generator)
    rows[min(set(range(600)) - sample), 2] = float("nan")
    side = opened(tmp_path, rows, "eq6", 1)
    assert side.compact is not None
    for _ in range(3):
        assert certified_right(side, query_of(torch.randn(2, 8, generator=generator)), 3)
