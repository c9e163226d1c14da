"""trainer/search/certificate.py: certified top-k over collections of 600 items where the first
stage keeps a few keys per query row, so it must drop most items; every certified result is
checked against the exact scan (every item scored by the model's score), for flat, IVF and
8-bit IVF first stages, for eq. 6 and the cosine and inner scores, for both directions. A
first stage that ignores the query fails the same check. Apart from any rescoring, every bound
of a first round is checked against its definition, pair by pair and item by item
(`bounds_hold`), on these rows, on a trained model's, and on rows built to meet each bound and
the certificate exactly; the certificate also runs with first rescoring batches of 1-10, so the
bounds, not a batch covering every candidate, decide when it stops."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.search.certificate as certificate
import trainer.search.index as index
from tests.search_world import SearchWorld, search_world
from trainer.batch import owners
from trainer.search.certificate import Candidates, Retrieved, item_bounds
from trainer.search.fragment_set import FragmentSet, rank

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


def through_an_ivf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Collections of 500 keys or more get an IVF first stage, searched (as where int8
    products are not exact) instead of their int8 keys."""
    monkeypatch.setattr(index, "IVF_FROM", 500)
    monkeypatch.setattr(index, "int8_products_exact", lambda: False)


def answered(found: Retrieved, keys: np.ndarray, count: int) -> np.ndarray:
    """Which (query row, key) pairs a first-stage answer returned [m, count]."""
    returned = np.zeros((len(found.unseen), count), bool)
    returned[found.rows, keys] = True
    return returned


def first_round(opened: index.Collection, query: FragmentSet, keys: int, probe: int,
                _patch: object = None) -> tuple[Retrieved, np.ndarray]:
    """One first-stage answer and the key of each of its pairs (a fifth argument, which
    tests/test_index.py passes, is not needed)."""
    found = opened.first_stage(query)(keys, probe)
    return found, found.key


def definition_scores(opened: index.Collection, keys: np.ndarray, query: FragmentSet,
                      image_side: bool, smooth: float) -> tuple[np.ndarray, np.ndarray]:
    """The exact (float64) products of the query's first-stage rows with every key [m, N], and
    each item's score from them by its definition: eq. 6's sum of max(0, v_i . s_j) over the
    item's pairs times 1/(n (m + smooth)) for an image of n rows, 1/(m (n + smooth)) for a
    sentence; the cosine and inner scores are the products of the items' keys."""
    products = exact_keys(query, opened.score) @ keys.T
    if opened.score != "eq6":
        return products, products[0]
    m, n = len(query.embeddings), np.maximum(opened.counts, 1)  # an item of no rows scores 0
    norm = 1 / (n * (m + smooth)) if image_side else 1 / (m * (n + smooth))
    return products, np.bincount(opened.key_item, np.maximum(products, 0).sum(0),
                                 len(opened.items)) * norm


def model_agrees(opened: index.Collection, keys: np.ndarray, query: FragmentSet,
                 image_side: bool, smooth: float) -> None:
    """The scores `definition_scores` derives are the model's, as search scores the items."""
    model = opened.scorer(query, image_side, lambda images, sentences: rank(
        images, sentences, smooth, opened.score))(np.arange(len(opened.items)))
    defined = definition_scores(opened, keys, query, image_side, smooth)[1]
    assert np.allclose(defined, model, rtol=1e-5, atol=1e-5)


def bounds_hold(opened: index.Collection, keys: np.ndarray, query: FragmentSet,
                image_side: bool, smooth: float, asked: tuple[int, int],
                _patch: object = None) -> dict[str, float]:
    """A first-stage answer's bounds (`asked`: keys, probe) checked against their definitions,
    with nothing scored for the search: each returned pair's bound >= the exact product of its
    key (`keys`: every key, float64) and query row; each key a row did not return scores at
    most that row's `unseen`; each returned item's bound >= its score, every other item's
    score <= the bound on the rest. Returns how tight each was (least bound minus bounded)."""
    found, pair_keys = first_round(opened, query, *asked)
    products, scores = definition_scores(opened, keys, query, image_side, smooth)
    assert np.array_equal(opened.key_item[pair_keys], found.items)
    exact = products[found.rows, pair_keys]
    assert np.all(found.upper >= exact), (found.upper - exact).min()
    dropped = np.where(answered(found, pair_keys, len(keys)), -np.inf, products).max(axis=1)
    assert np.all(dropped <= found.unseen), (found.unseen - dropped).min()
    m = len(query.embeddings)
    weight, reach = opened.reach(1 / (m + smooth) if image_side else 1 / m)
    items = items_hold(item_bounds(found, opened.score == "eq6", opened.counts, weight, reach),
                       scores)
    items_hold(opened.candidates(query, weight, reach)(*asked), scores)  # what search takes
    left = dropped > -np.inf  # rows with a key not returned
    return {"pair": float(np.min(found.upper - exact, initial=np.inf)),
            "unseen": float(np.min(found.unseen[left] - dropped[left], initial=np.inf)),
            "rest": items["rest"]}


def items_hold(found: Candidates, scores: np.ndarray) -> dict[str, float]:
    """Each of a first stage's items scores at most its bound, every other item at most the
    bound on the rest (`scores`: every item's, by definition). Returns how tight each was."""
    assert np.all(scores[found.items] <= found.bounds), (found.bounds - scores[found.items]).min()
    rest = np.delete(scores, found.items)
    assert np.all(rest <= found.outside), found.outside - rest.max()
    return {"item": float(np.min(found.bounds - scores[found.items], initial=np.inf)),
            "rest": float(found.outside - rest.max()) if len(rest) else np.inf}


def exact_keys(fragments: FragmentSet, score: str) -> np.ndarray:
    """The first-stage keys of `fragments` computed in float64, as the model scores them."""
    return index.first_stage_keys(dataclasses.replace(
        fragments, embeddings=fragments.embeddings.double()), score)[0].numpy()


def every_key(opened: index.Collection) -> np.ndarray:
    """The first stage's keys in float64 [N, d], built again from the stored rows."""
    return exact_keys(opened.select(range(len(opened.items))), opened.score)


def disagreements(opened: index.Collection, score: str, image_side: bool,
                  budget_s: float | None, k: int = TOP,
                  check_bounds: bool = False) -> tuple[list[int], int, int]:
    """For 25 queries (24 with rows): those whose certified result differs from the exact
    scan, how many were certified, and the items scored exactly over all of them. With
    `check_bounds`, each query's first round of bounds is checked first (`bounds_hold`)."""
    queries = fragments(25, 4 if image_side else 6, seed=2, side=-1.0)
    wrong, certified, scored = [], 0, 0
    keys = every_key(opened) if check_bounds else None
    for q in range(25):
        query = queries.select([q])
        if not len(query.embeddings):
            continue
        if keys is not None:
            if q == 1:  # the first query with rows
                model_agrees(opened, keys, query, image_side, SMOOTH)
            bounds_hold(opened, keys, query, image_side, SMOOTH, (
                opened.key_candidates if score == "eq6" else max(k, index.CANDIDATES),
                opened.probe))
        found = index.search(opened, query, k, image_side, SMOOTH, score, budget_s=budget_s)
        truth = index.search(opened, query, k, image_side, SMOOTH, score, exact_scan=True)
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
    if ivf_from < ITEMS:
        through_an_ivf(monkeypatch)
    opened = collection(tmp_path, score, image_side)
    assert (opened.compact is None) == (ivf_from < ITEMS)
    wrong, certified, scored = disagreements(opened, score, image_side, budget_s=None,
                                             check_bounds=True)
    assert wrong == [] and certified == 24  # no budget: widened until certified
    if score == "eq6":  # the first stage ruled most items out
        assert scored < 0.6 * 25 * ITEMS, scored


def test_small_first_batches_leave_the_bounds_to_decide(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A first rescoring batch of 50 covers nearly every candidate of these collections, so
    the bounds hardly decide when to stop; of 1, 5 or 10 items (k = 1, 3, 10: a first batch
    is at least k), over an IVF of 46 of 48 directions, they do, and every answer is still
    the exact scan's."""
    through_an_ivf(monkeypatch)
    monkeypatch.setattr(index, "FIRST_STAGE_DIMS", 46)
    opened = collection(tmp_path, "eq6", True)
    queries = fragments(25, 4, seed=2, side=-1.0)
    scored = {1: 0, 5: 0, 10: 0}
    for q in range(25):
        query = queries.select([q])
        if not len(query.embeddings):
            continue
        truth = index.search(opened, query, TOP, True, SMOOTH, "eq6", exact_scan=True).hits
        for first_batch, k in ((1, 1), (5, 3), (10, 10)):
            monkeypatch.setattr(certificate, "RESCORE_FIRST", first_batch)
            found = index.search(opened, query, k, True, SMOOTH, "eq6", budget_s=None)
            assert found.exact and found.hits == truth[:k], (q, first_batch)
            scored[first_batch] += found.scored
    assert max(scored.values()) < 24 * 50, scored  # fewer than one batch of 50 a query


def test_a_spent_budget_returns_uncertified_results_with_their_gap(tmp_path: Path) -> None:
    """budget 0: the first round only. Some queries are certified (and exact), others not."""
    opened = collection(tmp_path, "eq6", True)  # 12 items first (int8 keys): 19 certified
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
    candidates = index.Collection.candidates

    def ignores_the_query(self: index.Collection, query: FragmentSet, weight: Callable,
                          reach: float) -> Callable:
        return candidates(self, other, weight, reach)

    monkeypatch.setattr(index.Collection, "candidates", ignores_the_query)
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
    through_an_ivf(monkeypatch)
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
    through_an_ivf(monkeypatch)
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


SPREAD = torch.tensor([[4.0, 0.0, 0.5], [-4.0, 0.0, 0.5], [0.0, 4.0, -0.5], [0.0, -4.0, -0.5]])


@pytest.mark.parametrize("score", ["eq6", "cosine", "inner"])
def test_rows_built_to_meet_each_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       score: str) -> None:
    """600 one-row images on the 4 rows of SPREAD, an IVF over their 2 principal directions:
    every key leaves out the same part, +-0.5 along the third, so for a query row with a part
    there its bound's residual term is exact for the keys on its side; the row's 12 best keys
    tie with copies the first stage leaves out. Each bound (a returned pair's, a row's
    `unseen`, the items') is then met within rounding: cut any bound, or leave a residual term
    out, and it is broken."""
    through_an_ivf(monkeypatch)
    monkeypatch.setattr(index, "FIRST_STAGE_DIMS", 2)
    items = FragmentSet([f"item-{k}" for k in range(ITEMS)], SPREAD[torch.arange(ITEMS) % 4],
                        owners([1] * ITEMS), torch.zeros(ITEMS, 4))
    index.write_collection(tmp_path, "images", items, score)
    opened = index.Collection(tmp_path, "images", items.items, score, lambda n: 1 / n)
    keys = every_key(opened)
    for row in ([1.0, 0.0, 1.0], [0.0, -1.0, -2.0]):
        query = FragmentSet(["query"], torch.tensor([row]), owners([1]), torch.zeros(1, 3))
        probe = index.first_stage_keys(query, score)[0]
        term = opened.largest_residual * float(index.left_out(probe, opened.basis)[0])
        margins = bounds_hold(opened, keys, query, True, SMOOTH, (12, opened.lists))
        assert term > 0.08 and max(margins.values()) < 1e-3 * term, (term, margins)


def certificate_rows() -> torch.Tensor:
    """600 rows in 3 dimensions: one item whose projected product with (1, 0, 1) is the best,
    4, with -0.5 left out (its score 3.5), 60 at 3.8 (scores 3.3) and 61 at 3.7 with +0.5 left
    out (scores 4.2, the best), each mirrored along the first direction, and 356 along the second:
    the principal directions are the first two, and every key leaves out 0.5 along the third."""
    lead = torch.tensor([[4.0, 0.0, -0.5]] + [[3.8, 0.0, -0.5]] * 60 + [[3.7, 0.0, 0.5]] * 61)
    side = torch.tensor([[0.0, 4.0, 0.5], [0.0, 4.0, -0.5], [0.0, -4.0, 0.5],
                         [0.0, -4.0, -0.5]]).repeat(89, 1)
    return torch.cat([lead, lead * torch.tensor([-1.0, 1.0, 1.0]), side])


@pytest.mark.parametrize("score", ["eq6", "inner"])
def test_the_certificate_holds_only_above_every_bound(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      score: str) -> None:
    """`certificate_rows` over an IVF of 2 directions, 50 keys first: the first round returns the
    item scoring 3.5 (bound 4.5) and 49 at 3.8 and bounds the rest by 4.3, so 3.5 is within 20%
    of the bound while the items left out score 4.2. Only a certificate that needs the k-th
    score above every bound widens and finds them."""
    through_an_ivf(monkeypatch)
    monkeypatch.setattr(index, "FIRST_STAGE_DIMS", 2)
    rows = certificate_rows()
    items = FragmentSet([f"item-{k}" for k in range(len(rows))], rows, owners([1] * len(rows)),
                        torch.zeros(len(rows), 4))
    index.write_collection(tmp_path, "images", items, score)
    opened = index.Collection(tmp_path, "images", items.items, score, lambda n: 1 / n)
    opened.key_candidates, opened.probe = 50, opened.lists
    query = FragmentSet(["query"], torch.tensor([[1.0, 0.0, 1.0]]), owners([1]),
                        torch.zeros(1, 3))
    bounds_hold(opened, every_key(opened), query, True, SMOOTH, (50, opened.lists))
    found = index.search(opened, query, 1, True, SMOOTH, score, budget_s=None)
    assert found.exact and [hit.position for hit in found.hits] == [61]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> SearchWorld:
    """The small trained model's index of tests/search_world.py (shared with test_serve.py)."""
    return search_world(tmp_path_factory.getbasetemp() / "search-world")


@pytest.mark.slow
def test_a_trained_models_bounds_hold_and_certify(trained: SearchWorld,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A trained model's rows, 2 keys per query row: each caption's first stage over the
    images, and each image's over the sentences (their int8 keys), bounds every pair and item
    by the definitions; with a first batch of 1, each certified top 3 is the exact scan's."""
    searched = index.SearchIndex.open(trained.index)
    objective = searched.embedder.cfg.objective
    monkeypatch.setattr(certificate, "RESCORE_FIRST", 1)
    images = [searched.images.select([k]) for k in range(len(searched.image_names))]
    captions = [searched.query_rows(text) for texts in trained.captions.values()
                for text in texts]
    for side, image_side, queries in ((searched.images, True, captions),
                                      (searched.sentence_set, False, images)):
        side.key_candidates, keys = 2, every_key(side)
        assert side.compact is not None  # the int8 keys (trainer/search/compact_keys.py)
        model_agrees(side, keys, queries[0], image_side, objective.smooth)
        for query in queries:
            bounds_hold(side, keys, query, image_side, objective.smooth, (2, 1))
            found, truth = (index.search(side, query, 3, image_side, objective.smooth,
                                         objective.score, exact_scan=scan, budget_s=None)
                            for scan in (False, True))
            assert found.exact and found.hits == truth.hits
