"""Training loader throughput against plain decoding of the same images (target: the loader at
least 80% of plain decode throughput per loader process).

(a) the loader: trainer.data.TrainLoader in exact-epoch mode with --workers loader processes,
    timed from the start of an epoch to its last collated Batch (process start-up included);
    reading the split's metadata (tar headers, JSON, caption encoding), which the loader does
    once when it is made, is timed and reported on its own;
    pairs/s and images/s (distinct images in the epoch's batches) as the training loop gets them
    (images uint8: their float conversion happens in Batch.to(device), on the device).
(b) plain decoding: the same image bytes, read from the shards into memory first, decoded one
    after another in this process by trainer.data.decode_image (PIL open, convert to RGB, resize
    to --image-size: exactly the loader's decode), images/s.
ratio = loader images/s / (workers x plain images/s).

Wall-clock rates depend on what else the machine runs, so CPU time per image is reported too:
of plain decoding, of the loader processes (their whole life, from the kernel's accounting of
finished children) and of the training process (collation). cpu ratio = plain CPU per image /
loader-process CPU per image: the ratio a loader process reaches on a core of its own.

Shards: --shards DIR (a featurizer output folder, e.g. Flickr8k's), else synthetic shards
generated into a temporary folder (PNG scenes of --synthetic-size pixels, spaCy parses: about
half a minute). The cheaper an image is to decode, the more the loader's fixed per-image work
(reading the bytes, handing the pixels over) weighs in the ratio.

    python benchmarks/bench_data.py [--shards DIR] [--split train] [--workers 1]
        [--batch-size 100] [--image-size 224] [--epochs 2] [--synthetic-size 128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import webdataset as wds

from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from trainer.config import Config
from trainer.data import TrainLoader, decode_image, read_split
from trainer.vocab import Vocabulary

TARGET = 0.8


def synthetic_shards(out: Path, images: int, size: int) -> Path:
    jsonl = generate(out / "source", images, 0, seed=0, image_size=size)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=out, parser="spacy", boxes="given", shard_size=max(1, images // 8),
                       workers=1, splits=["train"]))
    return out


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_loader(cfg: Config, vocab: Vocabulary, batch_size: int, epochs: int) -> dict:
    started = time.perf_counter()
    loader = TrainLoader(cfg, vocab, batch_size, rank=0, world_size=1)  # reads the metadata
    index_s = time.perf_counter() - started
    pairs = images = 0
    start, cpu, workers_cpu = time.perf_counter(), time.process_time(), children_cpu()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        seen: set[str] = set()
        for batch in loader:
            pairs += len(batch.captions)
            seen.update(batch.image_ids)
        images += len(seen)
    seconds = time.perf_counter() - start
    return {"index_s": index_s, "pairs_per_s": pairs / seconds, "images_per_s": images / seconds,
            "workers_cpu_ms": (children_cpu() - workers_cpu) / images * 1e3,
            "main_cpu_ms": (time.process_time() - cpu) / images * 1e3}


def time_plain_decode(urls: list[str], size: int, epochs: int) -> dict:
    images = [s.get("jpg", s.get("png")) for s in wds.tarfile_samples([{"url": u} for u in urls])]
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        for data in images:
            decode_image(data, size)
    seconds = time.perf_counter() - start
    return {"images_per_s": len(images) * epochs / seconds,
            "cpu_ms": (time.process_time() - cpu) / (len(images) * epochs) * 1e3,
            "megabytes": sum(map(len, images)) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, help="featurizer output folder (default: "
                                                    "synthetic shards in a temporary folder)")
    parser.add_argument("--synthetic-images", type=int, default=400)
    parser.add_argument("--synthetic-size", type=int, default=128, help="synthetic image side")
    parser.add_argument("--split", default="train")
    parser.add_argument("--workers", type=int, default=1, help="loader processes")
    parser.add_argument("--batch-size", type=int, default=100, help="pairs per batch")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards or synthetic_shards(Path(tmp), args.synthetic_images,
                                                 args.synthetic_size)
        cfg = Config.from_dict({"data": {"shards": str(shards), "train_split": args.split,
                                         "workers": args.workers},
                                "model": {"image_size": args.image_size}})
        vocab = Vocabulary.load(shards / "vocab.json")
        split = read_split(shards, args.split)
        plain = time_plain_decode(split.urls, args.image_size, args.epochs)
        loader = time_loader(cfg, vocab, args.batch_size, args.epochs)
    ratio = loader["images_per_s"] / (args.workers * plain["images_per_s"])
    cpu_ratio = plain["cpu_ms"] / loader["workers_cpu_ms"]
    print(f"{shards} split {args.split!r}: {split.images} images ({plain['megabytes']:.1f} MB), "
          f"{split.captions} pairs, {len(split.urls)} shards; image size {args.image_size}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"loader: metadata of the split read once in {loader['index_s']:.2f} s "
          f"({loader['index_s'] / split.images * 1e3:.2f} ms per image), when it is made")
    print(f"loader, {args.workers} process(es): {loader['pairs_per_s']:.0f} pairs/s, "
          f"{loader['images_per_s']:.1f} images/s; CPU per image: loader processes "
          f"{loader['workers_cpu_ms']:.2f} ms, training process {loader['main_cpu_ms']:.2f} ms")
    print(f"plain decode, 1 process: {plain['images_per_s']:.1f} images/s; CPU per image "
          f"{plain['cpu_ms']:.2f} ms")
    print(f"ratio per loader process: {ratio:.2f} wall, {cpu_ratio:.2f} cpu "
          f"(target >= {TARGET})")
    print(json.dumps({"shards": str(shards), "split": args.split, "images": split.images,
                      "pairs": split.captions, "image_size": args.image_size,
                      "workers": args.workers, "batch_size": args.batch_size,
                      "epochs": args.epochs, "loader_index_s": loader["index_s"],
                      "loader_pairs_per_s": loader["pairs_per_s"],
                      "loader_images_per_s": loader["images_per_s"],
                      "plain_images_per_s": plain["images_per_s"], "ratio_per_worker": ratio,
                      "loader_process_cpu_ms": loader["workers_cpu_ms"],
                      "training_process_cpu_ms": loader["main_cpu_ms"],
                      "plain_cpu_ms": plain["cpu_ms"], "cpu_ratio_per_worker": cpu_ratio,
                      "target": TARGET, "load_average": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
