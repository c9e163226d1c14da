"""trainer/search/certificate.py: certified top-k over collections of 600 items where the first
stage keeps a few keys per query row, so it must drop most items; every certified result is
checked against the exact scan (every item scored by the model's score), for flat, IVF and
8-bit IVF first stages, for eq. 6 and the cosine and inner scores, for both directions. A
first stage that ignores the query fails the same check."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.search.index as index
from trainer.batch import owners
from trainer.search.certificate import Retrieved
from trainer.search.fragment_set import FragmentSet

ITEMS, DIM, SMOOTH, TOP = 600, 48, 5.0, 10


def fragments(count: int, most_rows: int, seed: int, side: float) -> FragmentSet:
    """`count` items of 1..most_rows rows each, a few without rows, like a trained model's:
    each item shows one of 60 scenes, each row one of its scene's 3 topics (of 40), and a query
    row and a collection row (`side` -1 and +1 along a shared direction) score positive on
    the same topic only."""
    generator = torch.Generator().manual_seed(seed)
    fixed = torch.Generator().manual_seed(99)
    topics = 3 * torch.nn.functional.normalize(torch.randn(40, DIM, generator=fixed), dim=1)
    scenes = torch.randint(0, 40, (60, 3), generator=fixed)
    counts = torch.randint(1, most_rows + 1, (count,), generator=generator)
    counts[::97] = 0
    rows = int(counts.sum())
    scene = torch.randint(0, 60, (count,), generator=generator).repeat_interleave(counts)
    picked = scenes[scene, torch.randint(0, 3, (rows,), generator=generator)]
    shared = torch.zeros(DIM)
    shared[0] = 1.7 * side
    embeddings = topics[picked] + shared + 0.5 * torch.randn(rows, DIM, generator=generator)
    return FragmentSet([f"item-{k}" for k in range(count)], embeddings,
                       owners(counts.tolist()), torch.zeros(rows, 4))


def collection(tmp_path: Path, score: str, image_side: bool) -> index.Collection:
    """The 600 items written as an index side and opened, with few keys per query row."""
    items = fragments(ITEMS, 6 if image_side else 4, seed=1, side=1.0)
    stem = "images" if image_side else "sentences"
    index.write_collection(tmp_path, stem, items, score)
    opened = index.Collection(tmp_path, stem, items.items, score,
                              (lambda n: 1 / n) if image_side else (lambda n: 1 / (n + SMOOTH)))
    opened.key_candidates, opened.probe = 12, 2
    return opened


def disagreements(opened: index.Collection, score: str, image_side: bool,
                  budget_s: float | None) -> tuple[list[int], int, int]:
    """For 25 queries: those whose certified result differs from the exact scan, how many
    were certified, and the items scored exactly over all of them."""
    queries = fragments(25, 4 if image_side else 6, seed=2, side=-1.0)
    wrong, certified, scored = [], 0, 0
    for q in range(25):
        query = queries.select([q])
        if not len(query.embeddings):
            continue
        found = index.search(opened, query, TOP, image_side, SMOOTH, score, budget_s=budget_s)
        truth = index.search(opened, query, TOP, image_side, SMOOTH, score, exact_scan=True)
        same = [h.position for h in found.hits] == [h.position for h in truth.hits]
        assert found.exact or found.gap > 0
        if found.exact:
            certified += 1
            assert [h.score for h in found.hits] == [h.score for h in truth.hits] or not same
            if not same:
                wrong.append(q)
        scored += found.scored
    return wrong, certified, scored


@pytest.mark.parametrize("ivf_from,sq8_from,dims", [
    (10**9, 10**9, 256),  # flat, every dimension
    (500, 10**9, 46),  # IVF over 46 of 48 directions: the residual bound at work
    (500, 500, 46),  # IVF with 8-bit codes
])
@pytest.mark.parametrize("score", ["eq6", "cosine", "inner"])
@pytest.mark.parametrize("image_side", [True, False], ids=["images", "sentences"])
def test_certified_results_are_the_exact_scans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               ivf_from: int, sq8_from: int, dims: int,
                                               score: str, image_side: bool) -> None:
    monkeypatch.setattr(index, "IVF_FROM", ivf_from)
    monkeypatch.setattr(index, "SQ8_FROM", sq8_from)
    monkeypatch.setattr(index, "FIRST_STAGE_DIMS", dims)
    opened = collection(tmp_path, score, image_side)
    wrong, certified, scored = disagreements(opened, score, image_side, budget_s=None)
    assert wrong == [] and certified >= 23  # no budget: widened until certified
    if score == "eq6":  # the first stage ruled most items out
        assert scored < 0.6 * 25 * ITEMS, scored


def test_a_spent_budget_returns_uncertified_results_with_their_gap(tmp_path: Path) -> None:
    """budget 0: the first round only. Some queries are certified (and exact), others not."""
    opened = collection(tmp_path, "eq6", True)
    opened.key_candidates = 100
    wrong, certified, _ = disagreements(opened, "eq6", True, budget_s=0.0)
    assert wrong == [] and 0 < certified < 24


def test_a_first_stage_that_ignores_the_query_is_caught(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails when the first stage answers another query than the one asked."""
    opened = collection(tmp_path, "eq6", True)
    opened.key_candidates = 200
    wrong, certified, _ = disagreements(opened, "eq6", True, budget_s=0.0)  # one round
    assert wrong == [] and certified >= 22
    other = fragments(2, 1, seed=7, side=-1.0).select([1])
    first_stage = index.Collection.first_stage

    def ignores_the_query(self: index.Collection, query: FragmentSet) -> Callable:
        search, rows = first_stage(self, other), len(query.embeddings)

        def answer(keys: int, probe: int) -> Retrieved:
            found = search(keys, probe)
            return Retrieved(found.items, found.rows % rows, found.upper,
                             np.resize(found.unseen, rows), found.keys, found.complete)
        return answer

    monkeypatch.setattr(index.Collection, "first_stage", ignores_the_query)
    wrong, certified, _ = disagreements(opened, "eq6", True, budget_s=0.0)
    assert wrong or certified < 22, "a first stage ignoring the query went unnoticed"


def test_widening_reaches_everything_and_then_scans(tmp_path: Path) -> None:
    """A query row that ties every item at 0 leaves no bound to prove the order by: the first
    stage widens until it returns every key; the top k is then the exact scan's, in index
    order."""
    opened = collection(tmp_path, "eq6", True)
    query = FragmentSet(["x"], torch.zeros(1, DIM), owners([1]), torch.zeros(1, 3))
    found = index.search(opened, query, TOP, True, SMOOTH, "eq6", budget_s=None)
    truth = index.search(opened, query, TOP, True, SMOOTH, "eq6", exact_scan=True)
    assert found.exact and [h.position for h in found.hits] == [h.position for h in truth.hits]


def test_an_ivf_with_empty_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """600 items on 4 distinct rows: most of the IVF's 48 lists stay empty, and are bounded."""
    monkeypatch.setattr(index, "IVF_FROM", 500)
    rows = fragments(5, 1, seed=3, side=1.0).embeddings
    items = FragmentSet([f"item-{k}" for k in range(ITEMS)], rows[torch.arange(ITEMS) % len(rows)],
                        owners([1] * ITEMS), torch.zeros(ITEMS, 4))
    index.write_collection(tmp_path, "images", items, "eq6")
    opened = index.Collection(tmp_path, "images", items.items, "eq6", lambda n: 1 / n)
    assert opened.lists == 48 and (opened.list_radius == 0).sum() >= 40
    query = fragments(3, 3, seed=4, side=-1.0).select([1])
    found = index.search(opened, query, TOP, True, SMOOTH, "eq6", budget_s=None)
    truth = index.search(opened, query, TOP, True, SMOOTH, "eq6", exact_scan=True)
    assert found.exact and [h.position for h in found.hits] == [h.position for h in truth.hits]


def test_ivf_searches_at_once_and_every_list(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads search one IVF at once (as the web app's thread pool does; each search
    sets the index's nprobe), each answer the exact scan's; asked for every list, the first
    stage searches every one (the lists come from the stored centres, not the HNSW quantizer,
    which may miss some) and returns every key."""
    monkeypatch.setattr(index, "IVF_FROM", 500)
    opened = collection(tmp_path, "eq6", True)
    queries = fragments(25, 4, seed=2, side=-1.0)
    asked = [queries.select([q]) for q in range(25) if queries.counts[q]] * 3

    def same_as_the_scan(query: FragmentSet) -> bool:
        found = index.search(opened, query, TOP, True, SMOOTH, "eq6", budget_s=None)
        truth = index.search(opened, query, TOP, True, SMOOTH, "eq6", exact_scan=True)
        return found.exact and found.hits == truth.hits

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(same_as_the_scan, asked))
    total = opened.first.ntotal
    everything = opened.first_stage(asked[0])(total, opened.lists)
    assert everything.complete
    found = opened.first_stage(asked[0])(total - 1, opened.lists)
    assert len(found.items) == (total - 1) * len(asked[0].embeddings)
