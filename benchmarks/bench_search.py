"""Two-stage search (trainer/search/index.py) against the exact scan: agreement, latency, memory.

    # 1. the share of queries whose exact top 10 the two-stage search returns unchanged, per K,
    #    on a real index (every indexed sentence queries the images, every image the sentences)
    python benchmarks/bench_search.py agreement --index INDEX [--top 10]
    # 2. latency per text query (parse + embed + first stage + exact eq. 6 over K) and memory
    #    at several sizes of synthetic full-size fragments, the exact scan as the floor; then a
    #    1M-image first stage alone
    python benchmarks/bench_search.py scale --index INDEX [--sizes 1000 10000 100000]
                                            [--fragments 20] [--first-stage-only 1000000]

`scale` takes the model, the embedding size and the query sentences from the real INDEX and
writes synthetic indexes of that model under --work (default /tmp/defrag-bench-search); the
exact scan's time is the floor, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from trainer.search.fragment_set import FragmentSet, rank
from trainer.search.index import (
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


def two_stage_top(index: SearchIndex, queries: FragmentSet, side: str, k: int,
                  top: int) -> list[list[int]]:
    """What SearchIndex returns for each query (stored rows as queries): top positions."""
    search = index.images_for_rows if side == "images" else index.sentences_for_rows
    return [[hit.position for hit in search(queries.select([q]), top, k)]
            for q in range(len(queries.items))]


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
            for k in args.candidates:
                start = time.perf_counter()
                found = two_stage_top(index, queries, side, k, args.top)
                seconds = (time.perf_counter() - start) / len(found)
                same = sum(f == t.tolist() for f, t in zip(found, truth, strict=True)) / len(found)
                rows.append({"queries_rank": side, "M": m, "K": k, "unchanged_top": same,
                             "ms_per_query_without_parse": 1000 * seconds})
                print(f"  {side:>9} for {len(found)} queries, M {m:5d}, K {k:4d}: exact top "
                      f"{args.top} unchanged for {100 * same:6.2f}%  ({1000 * seconds:.1f} "
                      "ms/query without the parse)")
    print(json.dumps(rows))


class SyntheticRows:
    """`count` fragment rows made from the real index's rows plus noise, generated a block at
    a time on demand (a 1M-image collection's rows would not fit in memory)."""

    BLOCK = 1 << 16

    def __init__(self, real: torch.Tensor, count: int) -> None:
        self.real, self.count = real, count
        generator = torch.Generator().manual_seed(0)  # one block of noise, shuffled per block
        self.noise = 0.5 * real.std(0) * torch.randn(self.BLOCK, real.shape[1],
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


def synthetic_index(real: SearchIndex, folder: Path, images: int, fragments: int) -> None:
    """An index of the real model with `images` images of `fragments` rows (SyntheticRows)."""
    source = SyntheticRows(real_rows(real), images * fragments)
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
          f"{args.fragments} fragments per image (the index's rows plus noise), stored fp16; "
          f"M {real.images.key_candidates}, K {real.candidates}")
    results = []
    for size in args.sizes:
        folder = args.work / f"images-{size}"
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        synthetic_index(real, folder, size, args.fragments)
        built = time.perf_counter() - start
        before = process.memory_info().rss
        index = SearchIndex.open(folder)
        for text in texts[:5]:  # warm up: parser, first touch of the pages
            index.images_for(text)
        times = []
        for text in texts:
            start = time.perf_counter()
            index.images_for(text)
            times.append(time.perf_counter() - start)
        scans = [exact_scan(index, text) for text in texts[:args.exact_queries]]
        scan = min(seconds for seconds, _ in scans)
        unchanged = statistics.mean(
            [hit.position for hit in index.images_for(text, 10)] == top
            for text, (_, top) in zip(texts, scans, strict=False))
        recall = first_stage_recall(index, texts[:10])
        row = {"images": size, "disk_gib": sum(p.stat().st_size for p in folder.iterdir()) / GIB,
               "p50_ms": 1000 * statistics.median(times),
               "p95_ms": 1000 * float(np.percentile(times, 95)),
               "exact_scan_ms": 1000 * scan, "rss_added_gib": (process.memory_info().rss
                                                              - before) / GIB,
               "first_stage": type(index.images.first).__name__, "build_s": built,
               "first_stage_recall": recall, "top10_unchanged": unchanged}
        results.append(row)
        print(f"  {size:>7} images: p50 {row['p50_ms']:6.1f} ms, p95 {row['p95_ms']:6.1f} ms "
              f"per text query (floor: the exact scan {row['exact_scan_ms']:8.1f} ms); disk "
              f"{row['disk_gib']:.2f} GiB, resident +{row['rss_added_gib']:.2f} GiB after the "
              f"queries; first stage {row['first_stage']} (finds {100 * recall:.1f}% of the "
              f"exact best keys); exact top 10 unchanged for {100 * unchanged:.0f}% of the first "
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
    center, basis = fit_projection(rows)
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
    agree.add_argument("--key-candidates", type=int, nargs="+", default=[300, 1000, 3000])
    agree.add_argument("--candidates", type=int, nargs="+", default=[50, 100, 200])
    sizes = commands.add_parser("scale")
    sizes.add_argument("--index", type=Path, required=True)
    sizes.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    sizes.add_argument("--fragments", type=int, default=20)
    sizes.add_argument("--queries", type=int, default=100)
    sizes.add_argument("--exact-queries", type=int, default=10,
                       help="queries also scanned exactly (the floor, and the top-10 agreement)")
    sizes.add_argument("--first-stage-only", type=int, default=1_000_000,
                       help="images of the first stage measured alone (0: skip)")
    sizes.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-search"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    agreement(args) if args.command == "agreement" else scale(args)


if __name__ == "__main__":
    main()
