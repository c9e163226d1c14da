"""Certified search (trainer/search/index.py) against the exact scan: agreement, latency, memory.

    # 1. the share of queries certified and of those whose exact top 10 the search returns
    #    unchanged, per first-stage width M, on a real index (every 5th indexed sentence queries
    #    the images, every image the sentences)
    python benchmarks/bench_search.py agreement --index INDEX [--top 10]
    # 2. a large real index (benchmarks/search_collection.py): text queries ranking the images
    #    and sampled indexed images ranking the sentences, certified against the exact scan;
    #    the RSS after the certified searches (before the exact scans, which read every row)
    python benchmarks/bench_search.py certify --index INDEX --query-file QUERIES
                                              [--queries 1000] [--top 10] [--budget-s S]
    # 3. latency per text query (parse + embed + certified search) and memory at several sizes
    #    of synthetic fragments (the index's rows plus noise), the exact scan as the floor; then
    #    a 1M-image first stage alone
    python benchmarks/bench_search.py scale --index INDEX [--sizes 1000 10000 100000]
                                            [--fragments 20] [--noise 0.5]
                                            [--first-stage-only 1000000]
    # 4. one flat first-stage pass (every query row's product with every key) over float32,
    #    bf16 and int8 keys (synthetic, the time does not depend on the values), the float32
    #    pass as the floor, and the bound each key's rounding adds (relative to |k| |q|)
    python benchmarks/bench_search.py keys [--keys 100000] [--dim 1001] [--rows 16]
                                           [--threads 2] [--repeat 9]

`scale` takes the model, the embedding size and the query sentences from the real INDEX and
writes synthetic indexes of that model under --work (default /tmp/defrag-bench-search); the
exact scan's time is the floor, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from tqdm import tqdm

from trainer.search.certificate import Ranking
from trainer.search.compact_keys import CompactKeys, compact_keys
from trainer.search.fragment_set import FragmentSet, rank
from trainer.search.index import (
    BUDGET_S,
    FIRST_STAGE_DIMS,
    INDEX_FORMAT,
    IVF_PROBE,
    SearchIndex,
    build_first_stage,
    fit_projection,
    project,
    write_collection,
)

GIB = 2**30


def exact_top(index: SearchIndex, images: FragmentSet, sentences: FragmentSet, top: int,
              by_sentence: bool) -> torch.Tensor:
    """The exact scan's top `top` positions of every query [queries, top] (ties by index)."""
    objective = index.embedder.cfg.objective
    scores = rank(images, sentences, objective.smooth, objective.score)
    scores = scores.T if by_sentence else scores
    return torch.stack([torch.argsort(row, descending=True, stable=True)[:top]
                        for row in scores])


def certified_top(index: SearchIndex, queries: FragmentSet, side: str,
                  top: int) -> list[Ranking]:
    """What SearchIndex returns for each query (stored rows as queries)."""
    search = index.images_for_rows if side == "images" else index.sentences_for_rows
    return [search(queries.select([q]), top) for q in range(len(queries.items))]


def agreement(args: argparse.Namespace) -> None:
    index = SearchIndex.open(args.index)
    index.sentence_set.exact_up_to = 0  # measure the first stage itself
    images = index.images.select(range(len(index.image_names)))
    sentences = index.sentence_set.select(range(len(index.sentences)))
    every = range(0, len(sentences.items), args.sentence_step)
    print(f"index {args.index}: {len(images.items)} images ({len(images.embeddings)} "
          f"fragments), {len(sentences.items)} sentences ({len(sentences.embeddings)}), score "
          f"{index.embedder.cfg.objective.score}; queries: every {args.sentence_step}th "
          f"sentence, every image")
    rows = []
    for side, queries, truth in (
            ("images", sentences.select(every),
             exact_top(index, images, sentences.select(every), args.top, True)),
            ("sentences", images, exact_top(index, images, sentences, args.top, False))):
        if side not in args.sides:
            continue
        for m in args.key_candidates:
            index.images.key_candidates = index.sentence_set.key_candidates = m
            start = time.perf_counter()
            found = certified_top(index, queries, side, args.top)
            seconds = (time.perf_counter() - start) / len(found)
            same = statistics.mean([h.position for h in f.hits] == t.tolist()
                                   for f, t in zip(found, truth, strict=True))
            certified = statistics.mean(f.exact for f in found)
            rows.append({"queries_rank": side, "M": m, "certified": certified,
                         "unchanged_top": same, "ms_per_query_without_parse": 1000 * seconds})
            print(f"  {side:>9} for {len(found)} queries, M {m:5d}: certified "
                  f"{100 * certified:6.2f}%, exact top {args.top} unchanged for "
                  f"{100 * same:6.2f}%  ({1000 * seconds:.1f} ms/query without the parse)")
    print(json.dumps(rows))


def timed_rankings(index: SearchIndex, queries: list, search, top: int,
                   budget_s: float | None, checked: int | None) -> tuple[list[dict], float]:
    """Each query (a sentence, or an image's stored rows) searched by `search` (certified: its
    times and certificate), the process's RSS in GiB after those searches, then the exact scan
    of the first `checked` queries (all if None) as the reference (agreement), which reads every
    stored row (~10 s a query at 1,000,000 images)."""
    results = []
    for query in tqdm(queries, desc="queries", unit="q", leave=False):
        start = time.perf_counter()
        rows = index.query_rows(query) if isinstance(query, str) else query
        parsed = time.perf_counter()
        ranking = search(rows, top, budget_s=budget_s)
        done = time.perf_counter()
        results.append({"rows": rows, "ranking": ranking, "seconds": done - start,
                        "search_s": done - parsed, "exact": ranking.exact, "gap": ranking.gap,
                        "scored": ranking.scored, "keys": ranking.keys})
    rss = psutil.Process().memory_info().rss / GIB
    for result in tqdm(results[:checked], desc="exact scans", unit="q", leave=False):
        ranking = result["ranking"]
        reference = search(result["rows"], top, exact_scan=True)
        result.update(same=[h.position for h in ranking.hits]
                      == [h.position for h in reference.hits],
                      same_scores=same_scores(ranking, reference))
    return results, rss


def same_scores(ranking: Ranking, reference: Ranking) -> bool:
    """Whether two top k hold the same scores in the same order (agreement up to the order of
    tied items, e.g. a sentence that appears twice in the index)."""
    return len(ranking.hits) == len(reference.hits) and np.allclose(
        [h.score for h in ranking.hits], [h.score for h in reference.hits], rtol=1e-5,
        atol=1e-6)


def summary(side: str, results: list[dict]) -> dict:
    """The certified share and latency of one side's queries, and the agreement with the exact
    scan of those checked."""
    checked = [r for r in results if "same" in r]
    certified = [r for r in checked if r["exact"]]
    ms = {key: 1000 * np.array([r[key] for r in results]) for key in ("seconds", "search_s")}
    return {"queries_rank": side, "queries": len(results),
            "certified": statistics.mean(r["exact"] for r in results),
            "agree_certified": (statistics.mean(r["same"] for r in certified) if certified
                                else None),
            "checked": len(checked),
            "agree_all": statistics.mean(r["same"] for r in checked),
            "same_scores_certified": (statistics.mean(r["same_scores"] for r in certified)
                                      if certified else None),
            "p50_ms": float(np.median(ms["seconds"])),
            "p95_ms": float(np.percentile(ms["seconds"], 95)),
            "p50_ms_without_parse": float(np.median(ms["search_s"])),
            "p95_ms_without_parse": float(np.percentile(ms["search_s"], 95)),
            "scored_p50": float(np.median([r["scored"] for r in results])),
            "keys_p50": float(np.median([r["keys"] for r in results])),
            "gap_max": max(r["gap"] for r in results)}


def certify(args: argparse.Namespace) -> None:
    index = SearchIndex.open(args.index)
    texts = [line.strip() for line in args.query_file.read_text().splitlines()
             if line.strip()][:args.queries]
    picked = random.Random(0).sample(range(len(index.image_names)),
                                     min(args.image_queries, len(index.image_names)))
    print(f"index {args.index}: {len(index.image_names)} images, {len(index.sentences)} "
          f"sentences, score {index.embedder.cfg.objective.score}; {len(texts)} text queries "
          f"from {args.query_file}, {len(picked)} image queries; top {args.top}, budget "
          f"{args.budget_s} s")
    started = time.perf_counter()
    asked = index.read_ahead()  # as `defrag serve` does at its start
    print(f"read ahead: {asked / 2**30:.2f} GiB asked of the page cache, "
          f"{time.perf_counter() - started:.1f} s")
    for text in texts[:5]:  # warm up: the parser, the first touch of the pages
        index.images_for_rows(index.query_rows(text), args.top, budget_s=args.budget_s)
    found, rss = timed_rankings(index, texts, index.images_for_rows, args.top, args.budget_s,
                                 args.checked)
    rows = [{**summary("images", found), "rss_gib": rss}]
    if index.sentence_set is not None and picked:
        images = [index.images.select([p]) for p in picked]
        found, rss = timed_rankings(index, images, index.sentences_for_rows, args.top,
                                    args.budget_s, args.checked)
        rows.append({**summary("sentences", found), "rss_gib": rss})
    for row in rows:
        print(f"  {row['queries']:5d} queries ranking {row['queries_rank']}: certified "
              f"{100 * row['certified']:.1f}%, agreeing with the exact scan "
              f"{100 * (row['agree_certified'] or 0):.1f}% of the certified, "
              f"{100 * row['agree_all']:.1f}% of all {row['checked']} checked (the same scores: "
              f"{100 * (row['same_scores_certified'] or 0):.1f}% of the certified); p50 "
              f"{row['p50_ms']:.1f} ms, p95 "
              f"{row['p95_ms']:.1f} ms ({row['p50_ms_without_parse']:.1f} / "
              f"{row['p95_ms_without_parse']:.1f} ms without the parse); RSS "
              f"{row['rss_gib']:.2f} GiB after them")
    print(json.dumps({"index": str(args.index), "images": len(index.image_names),
                      "sentences": len(index.sentences), "top": args.top,
                      "budget_s": args.budget_s, "results": rows}))


class SyntheticRows:
    """`count` fragment rows made from the real index's rows plus noise, generated a block at
    a time on demand (a 1M-image collection's rows would not fit in memory)."""

    BLOCK = 1 << 16

    def __init__(self, real: torch.Tensor, count: int, noise: float = 0.5) -> None:
        self.real, self.count = real, count
        generator = torch.Generator().manual_seed(0)  # one block of noise, shuffled per block
        self.noise = noise * real.std(0) * torch.randn(self.BLOCK, real.shape[1],
                                                       generator=generator)

    def __len__(self) -> int:
        return self.count

    def block(self, number: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(number)
        size = min(self.BLOCK, self.count - number * self.BLOCK)
        picked = torch.randint(len(self.real), (size,), generator=generator)
        return self.real[picked] + self.noise[torch.randperm(self.BLOCK, generator=generator)[
            :size]]

    def __getitem__(self, rows: slice | torch.Tensor) -> torch.Tensor:
        if isinstance(rows, slice):
            return self.block(rows.start // self.BLOCK)
        blocks = rows // self.BLOCK
        return torch.cat([self.block(int(b))[rows[blocks == b] - b * self.BLOCK]
                          for b in blocks.unique()])


def real_rows(real: SearchIndex) -> torch.Tensor:
    return real.images.select(range(len(real.image_names))).embeddings


def synthetic_index(real: SearchIndex, folder: Path, images: int, fragments: int,
                    noise: float) -> None:
    """An index of the real model with `images` images of `fragments` rows (SyntheticRows)."""
    source = SyntheticRows(real_rows(real), images * fragments, noise)
    rows = torch.cat([source.block(b) for b in range(-(-len(source) // source.BLOCK))]).half()
    owner = torch.arange(images).repeat_interleave(fragments)
    names = [f"{k:07d}.jpg" for k in range(images)]
    folder.mkdir(parents=True)
    write_collection(folder, "images", FragmentSet(names, rows, owner,
                                                   torch.zeros(len(rows), 4)), "eq6")
    meta = {**real.meta, "format": INDEX_FORMAT, "images": names, "sentences": [],
            "sentence_origins": [], "problems": []}
    (folder / "index.json").write_text(json.dumps(meta))


def exact_scan(index: SearchIndex, text: str, block: int = 5000) -> tuple[float, list[int]]:
    """The floor: one query scored against every image by the exact eq. 6, block by block; its
    seconds and its exact top 10 (ties by index)."""
    query = index.query_rows(text)
    start = time.perf_counter()
    scores = torch.cat([index._rank(index.images.select(range(first, min(
        first + block, len(index.image_names)))), query)[:, 0]
        for first in range(0, len(index.image_names), block)])
    seconds = time.perf_counter() - start
    return seconds, torch.argsort(scores, descending=True, stable=True)[:10].tolist()


def first_stage_recall(index: SearchIndex, texts: list[str]) -> float:
    """The share of each query fragment's exact M best keys (a flat scan of the projected
    keys) that the first stage finds, over the fragments of `texts`."""
    images = index.images
    keys = np.concatenate([project(images.select(range(first, min(first + 5000, len(
        images.items)))).embeddings, images.center, images.basis, queries=False)
        for first in range(0, len(images.items), 5000)])
    shares = []
    for text in texts:
        probes = project(index.query_rows(text).embeddings, images.center, images.basis,
                         queries=True)
        exact = np.argsort(-(probes @ keys.T), axis=1)[:, :images.key_candidates]
        found = images.first.search(probes, images.key_candidates)[1]
        shares += [len(set(e) & set(f)) / len(e) for e, f in zip(exact, found, strict=True)]
    return float(np.mean(shares))


def scale(args: argparse.Namespace) -> None:
    real = SearchIndex.open(args.index)
    texts = real.sentences[:args.queries]
    process = psutil.Process()
    print(f"model {real.meta['model_dir']} (d {real.embedder.cfg.model.embed_dim}, score "
          f"{real.embedder.cfg.objective.score}); {len(texts)} query sentences of {args.index}; "
          f"{args.fragments} fragments per image (the index's rows plus noise at {args.noise} "
          f"of their spread), stored fp16; {real.images.key_candidates} first-stage keys per "
          f"query row at first, budget {BUDGET_S} s")
    results = []
    for size in args.sizes:
        folder = args.work / f"images-{size}"
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        synthetic_index(real, folder, size, args.fragments, args.noise)
        built = time.perf_counter() - start
        before = process.memory_info().rss
        index = SearchIndex.open(folder)
        for text in texts[:5]:  # warm up: parser, first touch of the pages
            index.images_for(text)
        times, certified = [], []
        for text in texts:
            start = time.perf_counter()
            certified.append(index.images_for(text).exact)
            times.append(time.perf_counter() - start)
        scans = [exact_scan(index, text) for text in texts[:args.exact_queries]]
        scan = min(seconds for seconds, _ in scans)
        unchanged = statistics.mean(
            [hit.position for hit in index.images_for(text, 10).hits] == top
            for text, (_, top) in zip(texts, scans, strict=False))
        recall = first_stage_recall(index, texts[:10])
        row = {"images": size, "disk_gib": sum(p.stat().st_size for p in folder.iterdir()) / GIB,
               "p50_ms": 1000 * statistics.median(times),
               "p95_ms": 1000 * float(np.percentile(times, 95)),
               "exact_scan_ms": 1000 * scan, "rss_added_gib": (process.memory_info().rss
                                                              - before) / GIB,
               "first_stage": ("int8 keys" if index.images.compact is not None
                               else type(index.images.first).__name__), "build_s": built,
               "first_stage_recall": recall, "certified": statistics.mean(certified),
               "top10_unchanged": unchanged}
        results.append(row)
        print(f"  {size:>7} images: p50 {row['p50_ms']:6.1f} ms, p95 {row['p95_ms']:6.1f} ms "
              f"per text query (floor: the exact scan {row['exact_scan_ms']:8.1f} ms); disk "
              f"{row['disk_gib']:.2f} GiB, resident +{row['rss_added_gib']:.2f} GiB after the "
              f"queries; first stage {row['first_stage']} (finds {100 * recall:.1f}% of the "
              f"exact best keys); certified {100 * row['certified']:.0f}%, exact top 10 "
              f"unchanged for {100 * unchanged:.0f}% of the first "
              f"{len(scans)} queries; written in {built:.0f} s")
        del index
        shutil.rmtree(folder)
    if args.first_stage_only:
        results.append(first_stage_only(real, texts, args.first_stage_only, args.fragments,
                                        process))
    print(json.dumps(results))


def first_stage_only(real: SearchIndex, texts: list[str], images: int, fragments: int,
                     process: psutil.Process) -> dict:
    """The first stage of `images` images of `fragments` rows alone (IVF + 8-bit codes):
    build time, memory, latency per text query."""
    rows = real_rows(real)
    keys = SyntheticRows(rows, images * fragments)
    center, basis = fit_projection(rows, FIRST_STAGE_DIMS)
    before = process.memory_info().rss
    start = time.perf_counter()
    first = build_first_stage(keys, center, basis)
    built = time.perf_counter() - start
    first.nprobe = IVF_PROBE
    held = (process.memory_info().rss - before) / GIB
    m = real.images.key_candidates
    probes = [project(real.query_rows(t).embeddings, center, basis, queries=True) for t in texts]
    times = []
    for probe in probes:
        start = time.perf_counter()
        first.search(probe, m)
        times.append(time.perf_counter() - start)
    row = {"first_stage_images": images, "keys": len(keys), "kind": type(first).__name__,
           "build_s": built, "memory_gib": held, "p50_ms": 1000 * statistics.median(times)}
    print(f"  first stage alone, {images} images = {len(keys)} keys ({row['kind']}): built in "
          f"{built:.0f} s, +{held:.2f} GiB resident, p50 {row['p50_ms']:.1f} ms per text query "
          f"({m} keys per query row)")
    return row


def median_ms(run, repeat: int) -> float:
    """The median time of `repeat` runs of `run()` after one to warm up, in ms."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def keys(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(args.keys, args.dim, generator=generator)
    rows = torch.randn(args.rows, args.dim, generator=generator)
    center = floats[:10_000].mean(0)
    compact = CompactKeys({name: tensor.numpy() for name, tensor in compact_keys(
        lambda block: floats[block].double(), len(floats), center).items()}, center)
    halves = floats.bfloat16()
    passes = {"float32": lambda: rows @ floats.T,
              "bf16": lambda: rows.bfloat16() @ halves.T,
              "int8": lambda: torch._int_mm(compact.codes, compact.codes[:args.rows].T
                                            .contiguous()),
              "int8 first stage (every key's bound, eq. 6)": lambda: compact.key_bounds(
                  compact.scan(rows.double()), True)}
    ms = {name: median_ms(run, args.repeat) for name, run in passes.items()}
    size = torch.linalg.vector_norm(floats - center, dim=1).numpy()
    rounded = torch.linalg.vector_norm(floats - halves.float(), dim=1).numpy()
    error = {"int8": float(np.median(compact.error.numpy() / size)),
             "bf16": float(np.median(rounded / torch.linalg.vector_norm(floats, dim=1).numpy()))}
    print(f"{args.keys} keys x {args.dim}, {args.rows} query rows, {args.threads} threads, "
          f"median of {args.repeat}:")
    for name, value in ms.items():
        print(f"  {name:>48}: {value:7.1f} ms per pass ({ms['float32'] / value:.1f}x float32)")
    print(f"  a key's rounding |k - k~| / |k| (median): int8 {error['int8']:.2e}, bf16 "
          f"{error['bf16']:.2e}")
    print(json.dumps({"keys": args.keys, "dim": args.dim, "rows": args.rows,
                      "threads": args.threads, "ms_per_pass": ms, "key_error": error}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    agree = commands.add_parser("agreement")
    agree.add_argument("--index", type=Path, required=True)
    agree.add_argument("--top", type=int, default=10)
    agree.add_argument("--sentence-step", type=int, default=5)
    agree.add_argument("--sides", nargs="+", default=["images", "sentences"],
                       help="what the queries rank: images (sentence queries), sentences")
    agree.add_argument("--key-candidates", type=int, nargs="+", default=[300, 1000, 3000],
                       help="keys each query row finds first (widened until certified)")
    proof = commands.add_parser("certify")
    proof.add_argument("--index", type=Path, required=True)
    proof.add_argument("--query-file", type=Path, required=True,
                       help="query sentences, one per line (search_collection.py's queries.txt)")
    proof.add_argument("--queries", type=int, default=1000, help="text queries (the first N)")
    proof.add_argument("--image-queries", type=int, default=200,
                       help="indexed images (a seeded sample) ranking the sentences")
    proof.add_argument("--top", type=int, default=10)
    proof.add_argument("--checked", type=int, default=None,
                       help="queries checked against the exact scan (the first N; default all)")
    proof.add_argument("--budget-s", type=float, default=BUDGET_S,
                       help="a search's latency budget, after which it stops widening")
    sizes = commands.add_parser("scale")
    sizes.add_argument("--index", type=Path, required=True)
    sizes.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    sizes.add_argument("--fragments", type=int, default=20)
    sizes.add_argument("--noise", type=float, default=0.5,
                       help="Gaussian noise added to the real rows, in units of their spread")
    sizes.add_argument("--queries", type=int, default=100)
    sizes.add_argument("--exact-queries", type=int, default=10,
                       help="queries also scanned exactly (the floor, and the top-10 agreement)")
    sizes.add_argument("--first-stage-only", type=int, default=1_000_000,
                       help="images of the first stage measured alone (0: skip)")
    sizes.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-search"))
    passes = commands.add_parser("keys")
    passes.add_argument("--keys", type=int, default=100_000)
    passes.add_argument("--dim", type=int, default=1001)
    passes.add_argument("--rows", type=int, default=16, help="query rows (one query's)")
    passes.add_argument("--threads", type=int, default=2)
    passes.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    {"agreement": agreement, "certify": certify, "scale": scale, "keys": keys}[args.command](args)


if __name__ == "__main__":
    main()
