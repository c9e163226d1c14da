"""Inputs on which the int8 first stage (trainer/search/compact_keys.py) once certified a top k
that was not the exact scan's: one-dimensional keys, and NaN bounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.search.index as index
from tests.test_certified_search import definition_scores, every_key
from tests.test_compact_keys import SMOOTH, opened
from trainer.batch import owners
from trainer.search.embedder import RetrievalError
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


def test_fragments_that_are_not_finite_are_refused_in_one_line(tmp_path: Path) -> None:
    """A NaN fragment would make every bound NaN: the index side is not written."""
    rows = torch.randn(600, 8, generator=torch.Generator().manual_seed(0))
    rows[455, 2] = float("nan")
    rows[7, 0] = float("inf")
    with pytest.raises(RetrievalError, match=r"2 of the \d+ images have fragments that are not "
                                             r"finite \(NaN or inf\), e.g. item-\d+, item-\d+"):
        opened(tmp_path, rows, "eq6", 1)
    assert not (tmp_path / "images.safetensors").exists()


def test_a_side_not_wholly_appended_is_never_written(tmp_path: Path) -> None:
    """A merge's arrays are made before its units are appended: a side written with some
    never appended (rows of uninitialised memory) is an error, and nothing is written."""
    rows = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    items = [f"item-{k}" for k in range(10)]
    side = index.StoredFragments.room(items, 40, 8, torch.zeros(0, 4))
    side.append(FragmentSet(items[:5], rows[:20], owners([4] * 5), torch.zeros(20, 4)), "images")
    with pytest.raises(RuntimeError, match="only 5 of the 10 images were appended"):
        index.write_collection(tmp_path, "images", side, "eq6")
    assert not (tmp_path / "images.safetensors").exists()
    side.append(FragmentSet(items[5:], rows[20:], owners([4] * 5), torch.zeros(20, 4)), "images")
    index.write_collection(tmp_path, "images", side, "eq6")


def test_nan_bounds_never_certify_a_wrong_top_k(tmp_path: Path) -> None:
    """Bounds that are NaN (an index whose largest key error is NaN: every item's bound is)
    bound nothing: the certificate takes them as +inf (Python's max would drop them and
    certify the first items scored)."""
    generator = torch.Generator().manual_seed(0)
    side = opened(tmp_path, torch.randn(600, 8, generator=generator), "eq6", 1)
    assert side.compact is not None
    side.compact.most_error = float("nan")
    for _ in range(3):
        assert certified_right(side, query_of(torch.randn(2, 8, generator=generator)), 3)
