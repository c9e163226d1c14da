"""Two-stage search (trainer/index.py) against the exact scan: agreement, latency, memory.

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

import faiss
import numpy as np
import psutil
import torch

from trainer.fragment_set import FragmentSet, rank
from trainer.index import (
    INDEX_FORMAT,
    SearchIndex,
    build_first_stage,
    first_stage_vectors,
    write_collection,
)

GIB = 2**30
K_TRIED = (10, 20, 50, 100, 200, 500)


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
    images = index.images.select(range(len(index.image_names)))
    sentences = index.sentence_set.select(range(len(index.sentences)))
    print(f"index {args.index}: {len(images.items)} images, {len(sentences.items)} sentences, "
          f"score {index.embedder.cfg.objective.score}")
    rows = []
    for side, queries, truth in (
            ("images", sentences, exact_top(index, images, sentences, args.top, True)),
            ("sentences", images, exact_top(index, images, sentences, args.top, False))):
        for k in K_TRIED:
            start = time.perf_counter()
            found = two_stage_top(index, queries, side, k, args.top)
            seconds = (time.perf_counter() - start) / len(found)
            same = sum(f == t.tolist() for f, t in zip(found, truth, strict=True)) / len(found)
            rows.append({"queries_rank": side, "K": k, "unchanged_top": same,
                         "ms_per_query_without_parse": 1000 * seconds})
            print(f"  {side:>9} for {len(found)} queries, K {k:4d}: exact top {args.top} "
                  f"unchanged for {100 * same:6.2f}%  ({1000 * seconds:.1f} ms/query)")
    for side in ("images", "sentences"):
        ok = [r["K"] for r in rows if r["queries_rank"] == side and r["unchanged_top"] >= 0.99]
        print(f"  smallest K with >= 99% unchanged ({side}): {min(ok) if ok else 'none'}")
    print(json.dumps(rows))


def synthetic_index(real: SearchIndex, folder: Path, images: int, fragments: int) -> None:
    """An index of the real model with `images` images of `fragments` random unit fragments."""
    d = real.embedder.cfg.model.embed_dim
    generator = torch.Generator().manual_seed(images)
    rows = torch.empty(images * fragments, d, dtype=torch.float16)
    for first in range(0, len(rows), 1 << 16):
        block = torch.randn(min(1 << 16, len(rows) - first), d, generator=generator)
        rows[first:first + len(block)] = torch.nn.functional.normalize(block, dim=1).half()
    owner = torch.arange(images).repeat_interleave(fragments)
    names = [f"{k:07d}.jpg" for k in range(images)]
    folder.mkdir(parents=True)
    write_collection(folder, "images", FragmentSet(names, rows, owner,
                                                   torch.zeros(len(rows), 4)), "eq6")
    meta = {**real.meta, "format": INDEX_FORMAT, "images": names, "sentences": [],
            "sentence_origins": [], "problems": []}
    (folder / "index.json").write_text(json.dumps(meta))


def exact_scan_seconds(index: SearchIndex, text: str, block: int = 5000) -> float:
    """The floor: one query scored against every image by the exact eq. 6, block by block."""
    query = index.query_rows(text)
    start = time.perf_counter()
    for first in range(0, len(index.image_names), block):
        positions = range(first, min(first + block, len(index.image_names)))
        index._rank(index.images.select(positions), query)
    return time.perf_counter() - start


def scale(args: argparse.Namespace) -> None:
    real = SearchIndex.open(args.index)
    texts = real.sentences[:args.queries]
    process = psutil.Process()
    print(f"model {real.meta['model_dir']} (d {real.embedder.cfg.model.embed_dim}, score "
          f"{real.embedder.cfg.objective.score}); {len(texts)} query sentences of {args.index}; "
          f"{args.fragments} fragments per image, stored fp16; K {real.candidates}")
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
        scan = min(exact_scan_seconds(index, text) for text in texts[:3])
        row = {"images": size, "disk_gib": sum(p.stat().st_size for p in folder.iterdir()) / GIB,
               "p50_ms": 1000 * statistics.median(times),
               "p95_ms": 1000 * float(np.percentile(times, 95)),
               "exact_scan_ms": 1000 * scan, "rss_added_gib": (process.memory_info().rss
                                                              - before) / GIB,
               "first_stage_gib": index.images.first.ntotal * index.images.first.d * 4 / GIB,
               "build_s": built}
        results.append(row)
        print(f"  {size:>7} images: p50 {row['p50_ms']:6.1f} ms, p95 {row['p95_ms']:6.1f} ms "
              f"per text query (floor: the exact scan {row['exact_scan_ms']:8.1f} ms); disk "
              f"{row['disk_gib']:.2f} GiB, first stage {row['first_stage_gib']:.2f} GiB, "
              f"resident +{row['rss_added_gib']:.2f} GiB")
        del index
        shutil.rmtree(folder)
    if args.first_stage_only:
        results.append(first_stage_only(real, texts, args.first_stage_only, process))
    print(json.dumps(results))


def first_stage_only(real: SearchIndex, texts: list[str], size: int,
                     process: psutil.Process) -> dict:
    """A first stage of `size` random image vectors (the IVF above IVF_FROM): build time,
    memory, latency, and recall of the exact top K against a flat scan."""
    d, k = real.embedder.cfg.model.embed_dim, real.candidates
    generator = torch.Generator().manual_seed(size)
    vectors = torch.nn.functional.normalize(torch.randn(size, d, generator=generator),
                                            dim=1).numpy()
    before = process.memory_info().rss
    start = time.perf_counter()
    first = build_first_stage(vectors)
    built = time.perf_counter() - start
    if isinstance(first, faiss.IndexIVF):
        first.nprobe = 32
    held = (process.memory_info().rss - before) / GIB
    queries = [first_stage_vectors(real.query_rows(t), "eq6")[0].numpy() for t in texts]
    times = []
    for q in queries:
        start = time.perf_counter()
        first.search(q[None], k)
        times.append(time.perf_counter() - start)
    flat = faiss.IndexFlatIP(d)
    flat.add(vectors)
    recall = statistics.mean(
        len(set(first.search(q[None], k)[1][0]) & set(flat.search(q[None], k)[1][0])) / k
        for q in queries[:20])
    row = {"first_stage_images": size, "kind": type(first).__name__, "build_s": built,
           "memory_gib": held, "p50_ms": 1000 * statistics.median(times),
           f"recall_at_{k}_vs_flat": recall}
    print(f"  first stage alone, {size} images ({row['kind']}): built in {built:.0f} s, "
          f"+{held:.2f} GiB resident, p50 {row['p50_ms']:.1f} ms per query, recall of the "
          f"flat top {k}: {recall:.3f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    agree = commands.add_parser("agreement")
    agree.add_argument("--index", type=Path, required=True)
    agree.add_argument("--top", type=int, default=10)
    sizes = commands.add_parser("scale")
    sizes.add_argument("--index", type=Path, required=True)
    sizes.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    sizes.add_argument("--fragments", type=int, default=20)
    sizes.add_argument("--queries", type=int, default=100)
    sizes.add_argument("--first-stage-only", type=int, default=1_000_000)
    sizes.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-search"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    agreement(args) if args.command == "agreement" else scale(args)


if __name__ == "__main__":
    main()
