"""trainer/search/compact_keys.py: search scans int8 keys, and its bounds stay true. Apart from
any rescoring, every bound of the pass is checked against its definition (`int8_bounds_hold`:
each pair's bound >= its exact float64 product, each key's bound >= its share of the score, each
item's bound >= its exact score and the bound on the rest >= every other item's) on rows built
against them: norms from 1e-3 to 1e3, near-ties, rows and query rows whose int8 rounding is at
its worst, query rows along a key's rounding error or leaving their second code's error along
the longest key (Cauchy-Schwarz met), and rows that int8 codes hold exactly (then only the
float32 rounding terms are left, met within 4e-6). The certified top k is the exact scan's; an
index of format 2 (no int8 keys), or a CPU whose int8 product is not exact, is searched through
its faiss first stage."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import trainer.search.index as index
from tests.search_world import SearchWorld, search_world
from tests.test_certified_search import (
    bounds_hold,
    definition_scores,
    every_key,
    exact_keys,
    items_hold,
)
from trainer.batch import owners
from trainer.search.compact_keys import LEVELS, int8_products_exact
from trainer.search.embedder import RetrievalError
from trainer.search.fragment_set import FragmentSet

DIM, SMOOTH, TOP = 48, 5.0, 10
SIGMA, QUERY_SIGMAS = 93 / 64, (101 / 128, 113 * 2.0**-16, 71 * 2.0**5)  # 7 bits each


def worst_rows(count: int, generator: torch.Generator) -> torch.Tensor:
    """Rows whose every element but the largest lies half-way between two int8 steps."""
    rows = torch.randint(-126, 126, (count, DIM), generator=generator) + 0.5
    rows[:, 0] = LEVELS
    return rows


def adversarial_rows() -> torch.Tensor:
    """Rows of norms 1e-3 to 1e3, 40 near-ties (one row, elements moved by 1/512 of its
    largest), 10 exact copies, 30 worst-rounded rows (`worst_rows`: keys 110-139), 10 sign
    patterns (+-1: keys 140-149) and a zero row, each with its negation, so the mean key is ~0
    and the worst rows stay worst after centering."""
    generator = torch.Generator().manual_seed(5)
    spread = 10 ** (6 * torch.rand(60, 1, generator=generator) - 3)
    tie = torch.randn(DIM, generator=generator)
    nudges = torch.randint(-1, 2, (40, DIM), generator=generator) * tie.abs().max() / 512
    rows = torch.cat([torch.randn(60, DIM, generator=generator) * spread, tie + nudges,
                      tie.repeat(10, 1), worst_rows(30, generator), signs(10, generator),
                      torch.zeros(1, DIM)])
    return torch.cat([rows, -rows])


def signs(count: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of +-1."""
    return 2.0 * torch.randint(0, 2, (count, DIM), generator=generator) - 1


def exact_rows() -> torch.Tensor:
    """Rows that int8 codes hold exactly: 127 SIGMA times -1, 0 or 1 (fp16 keeps them, and
    the mean of them and their negations is exactly 0)."""
    rows = torch.randint(-1, 2, (150, DIM), generator=torch.Generator().manual_seed(6))
    return 127 * SIGMA * torch.cat([rows, -rows]).float()


def opened(tmp_path: Path, rows: torch.Tensor, score: str, most_rows: int = 3,
           stem: str = "images") -> index.Collection:
    """The rows as items of 1..most_rows rows, written as an index side and opened."""
    generator, counts, left = torch.Generator().manual_seed(7), [], len(rows)
    while left:
        counts.append(min(left, int(torch.randint(1, most_rows + 1, (), generator=generator))))
        left -= counts[-1]
    items = FragmentSet([f"item-{k}" for k in range(len(counts))], rows, owners(counts),
                        torch.zeros(len(rows), 4))
    index.write_collection(tmp_path, stem, items, score)
    return index.Collection(tmp_path, stem, items.items, score, (lambda n: 1 / n) if
                            stem == "images" else (lambda n: 1 / (n + SMOOTH)))


def queries(side: index.Collection) -> list[FragmentSet]:
    """Query items of 1-5 rows: norms 1e-3 to 1e3, worst-rounded rows, near a key; and rows
    whose product with a rounding error meets Cauchy-Schwarz: the signs of the worst keys'
    errors (int8 holds them exactly: only the keys' error is left), and rows of the worst
    query error in the signs of the sign-pattern keys (0.49 of a step each side)."""
    generator = torch.Generator().manual_seed(8)
    made = [torch.randn(m, DIM, generator=generator) * 10.0 ** (1.5 * m - 4.5)
            for m in range(1, 6)]
    made += [worst_rows(3, generator) * 1e-2, worst_rows(1, generator),
             adversarial_rows()[60:62] + 1e-3 * torch.randn(2, DIM, generator=generator)]
    compact, keys = side.compact, torch.from_numpy(every_key(side))
    if compact is not None and side.score == "eq6":
        coded = compact.scale[110:140, None].double() * compact.codes[110:140].double()
        made += [torch.sign(keys[110:140] - side.center.double() - coded).float()[::6]]
        pattern = torch.sign(keys[140:144]).float()
        made += [(torch.randint(-100, 100, (4, DIM), generator=generator) + 0.49 * pattern)
                 * 2.0**-5]
    return [FragmentSet(["query"], rows, owners([len(rows)]), torch.zeros(len(rows), 3))
            for rows in made]


def int8_bounds_hold(side: index.Collection, keys: np.ndarray, query: FragmentSet,
                     image_side: bool, asked: int) -> dict[str, float]:
    """The int8 first stage's bounds against their definitions, nothing rescored (`keys`: every
    key, float64): each pair's bound (its key's own E_k, N_k) >= the exact product; each key's
    bound from the pass (y + beta_j, the largest E_k and N_k) >= its share of the score, eq. 6's
    sum_j max(0, k . q_j), else k . q; the items `candidates` returns for `asked` score at most
    their bounds, the others at most the bound on the rest. Returns how tight each was (on the
    keys with a positive share: the others' shares are 0 whatever their products)."""
    scan = side.compact.scan(torch.from_numpy(exact_keys(query, side.score)))
    products, scores = definition_scores(side, keys, query, image_side, SMOOTH)
    pairs = side.compact.pair_bounds(scan, np.arange(len(keys))).double().numpy().T
    assert np.all(pairs >= products), (pairs - products).min()
    eq6 = side.score == "eq6"
    shares = np.maximum(products, 0).sum(0) if eq6 else products[0]
    bound = side.compact.key_bounds(scan, eq6)
    assert np.all(bound >= shares), (bound - shares).min()
    m = len(query.embeddings)
    weight, reach = side.reach(1 / (m + SMOOTH) if image_side else 1 / m)
    items = items_hold(side.candidates(query, weight, reach)(asked, 1), scores)
    positive = shares > 0
    return {"pair": float((pairs - products).min()),
            "key": float(np.min((bound - shares)[positive], initial=np.inf)), **items}


def test_this_cpus_int8_product_is_exact() -> None:
    """The pass's integer products are exact here (else the float32 keys are scanned)."""
    assert int8_products_exact()
    codes = torch.randint(-LEVELS, LEVELS + 1, (300, 1001), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch._int_mm(codes, codes[:16].T.contiguous()).long(),
                       codes.long() @ codes[:16].long().T)


@pytest.mark.parametrize("score,image_side", [("eq6", True), ("eq6", False),
                                              ("cosine", True), ("inner", True)])
def test_the_bounds_hold_on_adversarial_rows(tmp_path: Path, score: str,
                                             image_side: bool) -> None:
    """Every pair, row and item bound of a first round of 3, 30 and all keys per query row holds
    by its definition; the worst-rounded rows are within 10% of the worst int8 error; each
    certified top 10 is the exact scan's (same items, order and ties)."""
    side = opened(tmp_path, adversarial_rows(), score, stem="images" if image_side else
                  "sentences")
    assert side.compact is not None
    if score == "eq6":  # keys 110-139: the worst-rounded rows
        step = side.compact.scale.numpy()[110:140]
        assert np.all(side.compact.error.numpy()[110:140] >= 0.9 * np.sqrt(DIM - 1) * step / 2)
    keys = every_key(side)
    for query in queries(side):
        for asked in (3, 30, len(side.items)):  # all: every item's bound is checked
            int8_bounds_hold(side, keys, query, image_side, asked)
        found = index.search(side, query, TOP, image_side, SMOOTH, score, budget_s=None)
        truth = index.search(side, query, TOP, image_side, SMOOTH, score, exact_scan=True)
        assert found.exact and found.hits == truth.hits


def test_exactly_coded_rows_meet_the_scaling_term(tmp_path: Path) -> None:
    """Rows and query rows that int8 codes hold exactly: the bounds are then the pass's
    products plus their float32 rounding terms (and MARGIN), met within 4e-6 of the products'
    size (~14 u |k| |q|); they still hold, pair by pair, key by key and item by item."""
    side = opened(tmp_path, exact_rows(), "eq6")
    assert float(side.center.abs().max()) == 0.0
    assert side.compact.most_error < 1e-8 * side.compact.most_norm
    keys = every_key(side)
    pattern = torch.randint(-1, 2, (3, DIM), generator=torch.Generator().manual_seed(9))
    for sigma in QUERY_SIGMAS:
        rows = 127 * sigma * pattern.float()
        query = FragmentSet(["query"], rows, owners([3]), torch.zeros(3, 3))
        size = float(np.abs(keys @ rows.double().numpy().T).max())
        margins = int8_bounds_hold(side, keys, query, True, 5)
        assert margins["pair"] < 4e-6 * size and margins["key"] < 4e-6 * size, margins


def test_every_keys_bound_takes_the_worst_key(tmp_path: Path) -> None:
    """8 copies of a row, a zero row and their negations, one-row images, twice: a row W whose
    int8 errors (0.4 of a step) share its signs, with a query row along sign(W), which int8
    holds exactly, so it meets the copies' errors; and a row P of +-1, which int8 holds, with a
    query row whose second code leaves 3/8 of a step along P, so it meets P's norm. The pass's
    bound on every key (y + beta) needs the key's own int8 error E_k and norm N_k: each is met
    within 10^-3 of its size, and half of either is broken (the largest of all, here the same,
    only enter float32-level terms)."""
    generator = torch.Generator().manual_seed(10)
    worst = torch.randint(0, 120, (DIM,), generator=generator) + 0.4
    worst[0] = LEVELS
    worst *= torch.where(torch.rand(DIM, generator=generator) < 0.5, -1.0, 1.0)
    pattern = signs(1, generator)[0]
    pattern[0] = 1.0
    along = pattern * 60 + torch.randint(-30, 30, (DIM,), generator=generator)  # codes at 1
    along[0] = LEVELS
    left = torch.randint(-100, 101, (DIM,), generator=generator) + 0.375 * pattern
    left[:2] = torch.tensor([0, LEVELS])  # codes at 2^-9, 3/8 of a step along P: the second
    along += left * 2.0**-9  # pass's error
    for name, key, row in (("W", worst, torch.sign(worst)), ("P", pattern, along / 8)):
        rows = torch.cat([key.repeat(8, 1), torch.zeros(1, DIM)])
        (tmp_path / name).mkdir()
        side = opened(tmp_path / name, torch.cat([rows, -rows]), "eq6", 1)
        query = FragmentSet(["query"], row[None], owners([1]), torch.zeros(1, 3))
        margins = int8_bounds_hold(side, every_key(side), query, True, 3)
        assert margins["key"] < 1e-3 * float(side.compact.most_norm * row.norm()), margins


def without_int8_keys(folder: Path, stem: str) -> None:
    """The side as format 2 wrote it: the same tensors but the int8 keys."""
    path = folder / f"{stem}.safetensors"
    save_file({name: tensor for name, tensor in load_file(path).items()
               if not name.startswith("int8_")}, path)


@pytest.mark.parametrize("cause", ["format 2", "inexact int8 product"])
def test_the_float32_keys_are_searched_without_int8_keys(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         cause: str) -> None:
    """An index side without int8 keys, or on a CPU whose int8 product is not exact, scans
    its float32 keys: the bounds hold and each certified top 10 is the exact scan's."""
    items = opened(tmp_path, adversarial_rows(), "eq6").items
    if cause == "format 2":
        without_int8_keys(tmp_path, "images")
    else:
        monkeypatch.setattr(index, "int8_products_exact", lambda: False)
    side = index.Collection(tmp_path, "images", items, "eq6", lambda n: 1 / n)
    assert side.compact is None
    keys = every_key(side)
    for query in queries(side):
        bounds_hold(side, keys, query, True, SMOOTH, (3, 1))
        found = index.search(side, query, TOP, True, SMOOTH, "eq6", budget_s=None)
        truth = index.search(side, query, TOP, True, SMOOTH, "eq6", exact_scan=True)
        assert found.exact and found.hits == truth.hits


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> SearchWorld:
    """The small trained model's index of tests/search_world.py (shared with test_serve.py)."""
    return search_world(tmp_path_factory.getbasetemp() / "search-world")


@pytest.mark.slow
def test_an_index_of_format_2_opens_and_format_1_is_refused(trained: SearchWorld,
                                                           tmp_path: Path) -> None:
    """The trained world's index as format 2 wrote it opens and searches through its float32
    keys, each caption's and image's certified top 3 the exact scan's; format 1: one line."""
    old = tmp_path / "old"
    shutil.copytree(trained.index, old)
    for stem in ("images", "sentences"):
        without_int8_keys(old, stem)
    meta = json.loads((old / "index.json").read_text())
    (old / "index.json").write_text(json.dumps({**meta, "format": 2}))
    searched = index.SearchIndex.open(old)
    assert searched.images.compact is None and searched.sentence_set.compact is None
    for texts in trained.captions.values():
        found, truth = (searched.images_for(texts[0], 3, exact_scan=scan) for scan in (False, True))
        assert found.exact and found.hits == truth.hits
    for name in searched.image_names:
        found, truth = (searched.sentences_for_image(name, 3, exact_scan=scan)
                        for scan in (False, True))
        assert found.exact and found.hits == truth.hits
    (old / "index.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(RetrievalError, match=re.escape(
            f"index {old} has format 1, this code reads formats 2 and 3: rebuild it with "
            "defrag index")):
        index.SearchIndex.open(old)
