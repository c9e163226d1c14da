"""Certified top-k: the exact eq. 6 (or cosine / inner) top k of a whole collection, found by
scoring only the items a first stage could not rule out, with the proof that nothing else scores
higher (docs/design.md, "Certified search").

The first stage (trainer/search/index.py) returns, for each query row j, its best keys (item
rows) with an upper bound on each retrieved pair's v_i . s_j, and `unseen[j]`, an upper bound on
v_i . s_j of every key it did not return (Fagin et al.'s threshold: the last key returned, widened
by what the projection and the codes leave out). Eq. 6 sums max(0, v_i . s_j) over an item's
pairs, so an item's score is at most its retrieved pairs' bounds plus `unseen` for the rest, and
an item with no retrieved pair scores at most `reach` x sum_j max(0, unseen[j]). Items are then
scored exactly (the model's score, as trainer.evaluate computes it) in order of their bounds until
the k-th exact score exceeds every bound left: the top k is then the exact one. Otherwise the
first stage is widened (more keys, more IVF lists) until it holds or the time budget runs out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

RESCORE_FIRST = 50  # items scored exactly in the first batch (doubled each batch)
WIDEN = 4  # how much more of the first stage each widening searches


@dataclass
class Hit:
    """One search result: an image's file name or a sentence, its score, its row in the index."""

    item: str
    score: float
    position: int


@dataclass
class Ranking:
    """The top k of a search, and whether it is proven to be the exact scan's top k."""

    hits: list[Hit]
    exact: bool  # a certificate held: these are the exact scan's top k, in its order
    gap: float  # 0.0 when exact; else the highest bound left minus the k-th score
    scored: int  # items the model scored exactly
    keys: int  # first-stage keys each query row found at the end (0: the exact scan)

    def proof(self) -> dict[str, bool | float | int]:
        """What a report says of the top k: proven exact or not, the gap left, items scored."""
        return {"exact": self.exact, "gap": self.gap, "scored": self.scored}


@dataclass
class Retrieved:
    """What one first-stage search returned for a query of m rows: P retrieved (row, key) pairs
    with an upper bound on each pair's inner product, and the bound on every pair not returned."""

    items: np.ndarray  # int64 [P]: the item owning each retrieved key
    rows: np.ndarray  # int64 [P]: the query row of each pair
    upper: np.ndarray  # float64 [P]: >= v_i . s_j of the pair
    unseen: np.ndarray  # float64 [m]: >= v_i . s_j of any pair of row j not retrieved; -inf: none
    keys: int  # keys searched per query row
    complete: bool  # every key of every row was returned: nothing more to widen
    key: np.ndarray  # int64 [P]: the key of each pair (what `upper` bounds the product of)


@dataclass
class Candidates:
    """What a first stage rules in: items with an upper bound on each one's score, and the bound
    on every other item's score (`outside`)."""

    items: np.ndarray  # int64: the items' positions
    bounds: np.ndarray  # float64: >= each one's score
    outside: float  # >= the score of every item not in `items`; -inf: none left
    keys: int  # first-stage keys (or items) searched per query row
    complete: bool  # nothing more to widen


def item_bounds(found: Retrieved, eq6: bool, counts: np.ndarray,
                weight: Callable[[np.ndarray], np.ndarray], reach: float) -> Candidates:
    """The items with a retrieved pair, an upper bound on each one's score, and the bound on
    every other item's score. eq. 6: an item of n rows with weight w(n) (its normalisation
    times the query's) scores at most w(n) [sum over its retrieved pairs of max(0, upper) +
    sum_j (n - retrieved_j) max(0, unseen_j)]; `reach` = max_n n w(n). Otherwise (one key per
    item, one query row) the pair's bound is the item's."""
    if not eq6:
        unseen = float(found.unseen[0]) if len(found.unseen) else -np.inf
        return Candidates(found.items, found.upper, unseen, found.keys, found.complete)
    open_ = np.maximum(found.unseen, 0.0)  # -inf (no key unseen) counts 0
    items, inverse = np.unique(found.items, return_inverse=True)
    extra = np.bincount(inverse, np.maximum(found.upper, 0.0) - open_[found.rows],
                        minlength=len(items))
    n = counts[items].astype(np.float64)
    bounds = weight(n) * (extra + n * open_.sum())
    return Candidates(items, bounds, reach * float(open_.sum()), found.keys, found.complete)


class Scores:
    """The exact scores of the items scored so far (positions -> the model's score), and the
    time they took (to tell whether more fit in the budget)."""

    def __init__(self, score: Callable[[np.ndarray], np.ndarray]) -> None:
        self.score, self.of, self.seconds = score, {}, 0.0

    def add(self, positions: np.ndarray) -> None:
        """Score the positions not scored yet (in index order, as `score` takes them)."""
        todo = np.sort(np.array([p for p in positions.tolist() if p not in self.of], np.int64))
        if len(todo):
            started = time.monotonic()
            self.of.update(zip(todo.tolist(), self.score(todo).tolist(), strict=True))
            self.seconds += time.monotonic() - started

    def fit(self, count: int, deadline: float | None) -> bool:
        """Whether scoring `count` more items, at the pace so far, ends before `deadline`."""
        pace = self.seconds / max(len(self.of), 1)
        return deadline is None or time.monotonic() + pace * count <= deadline

    def kth(self, k: int) -> float:
        """The k-th best score so far (-inf while fewer than k items are scored)."""
        if len(self.of) < k:
            return -np.inf
        return float(-np.partition(-np.fromiter(self.of.values(), float, len(self.of)), k - 1)[
            k - 1])

    def ranking(self, items: list[str], k: int, certified: bool, gap: float,
                keys: int) -> Ranking:
        """The k best scored items, best first, ties in index order (as the exact scan)."""
        positions = np.array(sorted(self.of), np.int64)
        values = np.array([self.of[p] for p in positions.tolist()], np.float64)
        best = np.argsort(-values, kind="stable")[:k]
        return Ranking([Hit(items[positions[b]], float(values[b]), int(positions[b]))
                        for b in best], certified, 0.0 if certified else float(max(gap, 0.0)),
                       len(positions), keys)


def certified_top_k(search: Callable[[int, int], Candidates], score: Callable[[np.ndarray],
                    np.ndarray], items: list[str], k: int, *, keys: int, probe: int,
                    budget_s: float | None) -> Ranking:
    """The top k of `items` by `score` (exact scores of sorted positions), certified.
    `search(keys, probe)` is the first stage; it is widened WIDEN-fold while the bound on the
    items it did not retrieve is above what the k-th item can score, until the certificate
    holds, everything was retrieved, or the next round would end after `budget_s` seconds
    (then exact=False)."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    exact = Scores(score)
    k = min(k, len(items))
    if not k:
        return Ranking([], True, 0.0, 0, 0)
    while True:
        started = time.monotonic()
        found = search(keys, probe)
        took = time.monotonic() - started  # the next round searches WIDEN times as much
        # a NaN bound (a non-finite key or query row) bounds nothing: +inf, never certified
        bounds = np.where(np.isnan(found.bounds), np.inf, found.bounds)
        outside = np.inf if np.isnan(found.outside) else found.outside
        order = np.argsort(-bounds, kind="stable")
        candidates, bounds = found.items[order], bounds[order]
        last = found.complete or (deadline is not None
                                  and time.monotonic() + WIDEN * took > deadline)
        possible = bounds[k - 1] if len(bounds) >= k else -np.inf  # the k-th can score at most
        if possible <= outside and not last:
            keys, probe = keys * WIDEN, probe * WIDEN  # no certificate yet: widen first
            continue
        done = _rescore(exact, candidates, bounds, k,
                        len(candidates) if possible > outside else max(k, RESCORE_FIRST),
                        deadline)
        left = max(outside, bounds[done] if done < len(bounds) else -np.inf)
        kth = exact.kth(k)
        if kth > left:
            return exact.ranking(items, k, True, 0.0, found.keys)
        if found.complete and exact.fit(len(items) - len(exact.of), deadline):
            exact.add(np.arange(len(items)))  # every key returned, yet ties: score the rest
            return exact.ranking(items, k, True, 0.0, found.keys)
        if last:
            low = kth if len(exact.of) >= k else min(exact.of.values(), default=0.0)
            return exact.ranking(items, k, False, left - low, found.keys)
        keys, probe = keys * WIDEN, probe * WIDEN


def _rescore(exact: Scores, candidates: np.ndarray, bounds: np.ndarray, k: int,
             most: int, deadline: float | None) -> int:
    """Score candidates exactly in order of their bounds (descending), a doubling batch at a
    time, until the k-th exact score beats the next bound, `most` were taken, or the next
    batch would end after `deadline` (the first always runs); how many."""
    done, batch = 0, max(RESCORE_FIRST, k)
    while (done < min(most, len(candidates)) and not exact.kth(k) > bounds[done]
           and (not done or exact.fit(batch, deadline))):
        exact.add(candidates[done:done + batch])
        done, batch = done + batch, batch * 2
    return min(done, len(candidates))


def full_scan(score: Callable[[np.ndarray], np.ndarray], items: list[str], k: int,
              chunk: int = 4096) -> Ranking:
    """Every item scored: the reference the certificate is checked against."""
    exact = Scores(score)
    for first in range(0, len(items), chunk):
        exact.add(np.arange(first, min(first + chunk, len(items))))
    return exact.ranking(items, min(k, len(items)), True, 0.0, 0)
