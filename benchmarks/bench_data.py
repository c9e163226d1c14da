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

(a) and (b) alternate, one epoch and one pass over the same images at a time, --repeats times, and
the ratios are the medians of each repeat's: this VM's speed drifts by 20% within seconds, so
timing all of (b) first and all of (a) after measured the drift as much as the loader.

Wall-clock rates depend on what else the machine runs, so CPU time per image is reported too:
of plain decoding, of the loader processes (their whole life, from the kernel's accounting of
finished children) and of the training process (collation). cpu ratio = plain CPU per image /
loader-process CPU per image: the ratio a loader process reaches on a core of its own.

Shards: --shards DIR (a featurizer output folder, e.g. Flickr8k's), else synthetic shards
generated into a temporary folder (PNG scenes of --synthetic-size pixels, spaCy parses: about
half a minute). The cheaper an image is to decode, the more the loader's fixed per-image work
(reading the bytes, handing the pixels over) weighs in the ratio.

    python benchmarks/bench_data.py [--shards DIR] [--split train] [--workers 1]
        [--batch-size 100] [--image-size 224] [--repeats 3] [--synthetic-size 128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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


def time_loader_epoch(loader: TrainLoader, epoch: int) -> dict:
    """One epoch of `loader`: images/s and pairs/s as the training loop gets them, CPU per image
    of the loader processes (reaped at the epoch's end) and of this process."""
    pairs, seen = 0, set()
    start, cpu, workers_cpu = time.perf_counter(), time.process_time(), children_cpu()
    loader.set_epoch(epoch)
    for batch in loader:
        pairs += len(batch.captions)
        seen.update(batch.image_ids)
    seconds = time.perf_counter() - start
    return {"pairs_per_s": pairs / seconds, "images_per_s": len(seen) / seconds,
            "workers_cpu_ms": (children_cpu() - workers_cpu) / len(seen) * 1e3,
            "main_cpu_ms": (time.process_time() - cpu) / len(seen) * 1e3}


def time_plain_decode(images: list[bytes], size: int) -> dict:
    """One pass of trainer.data.decode_image over `images`, in this process."""
    start, cpu = time.perf_counter(), time.process_time()
    for data in images:
        decode_image(data, size)
    seconds = time.perf_counter() - start
    return {"images_per_s": len(images) / seconds,
            "cpu_ms": (time.process_time() - cpu) / len(images) * 1e3}


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
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternations of one loader epoch and one plain decoding pass")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers must be >= 1: this measures loader processes")
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards or synthetic_shards(Path(tmp), args.synthetic_images,
                                                 args.synthetic_size)
        cfg = Config.from_dict({"data": {"shards": str(shards), "train_split": args.split,
                                         "workers": args.workers},
                                "model": {"image_size": args.image_size}})
        vocab = Vocabulary.load(shards / "vocab.json")
        split = read_split(shards, args.split)
        images = [s.get("jpg", s.get("png"))
                  for s in wds.tarfile_samples([{"url": u} for u in split.urls])]
        started = time.perf_counter()
        loader = TrainLoader(cfg, vocab, args.batch_size, rank=0, world_size=1)
        index_s = time.perf_counter() - started  # the metadata, read once
        runs = []
        for repeat in range(args.repeats):
            runs.append({"plain": time_plain_decode(images, args.image_size),
                         "loader": time_loader_epoch(loader, repeat)})
    print(f"{shards} split {args.split!r}: {split.images} images "
          f"({sum(map(len, images)) / 1e6:.1f} MB), {split.captions} pairs, {len(split.urls)} "
          f"shards; image size {args.image_size}; {os.cpu_count()} CPUs")
    print(f"loader: metadata of the split read once in {index_s:.2f} s "
          f"({index_s / split.images * 1e3:.2f} ms per image), when it is made")
    for repeat, run in enumerate(runs):
        epoch, plain = run["loader"], run["plain"]
        run["ratio"] = epoch["images_per_s"] / (args.workers * plain["images_per_s"])
        run["cpu_ratio"] = plain["cpu_ms"] / epoch["workers_cpu_ms"]
        print(f"repeat {repeat}: loader, {args.workers} process(es): "
              f"{epoch['pairs_per_s']:.0f} pairs/s, {epoch['images_per_s']:.1f} images/s, "
              f"CPU per image {epoch['workers_cpu_ms']:.3f} ms in the loader processes, "
              f"{epoch['main_cpu_ms']:.3f} ms in the training process; plain decode "
              f"{plain['images_per_s']:.1f} images/s, {plain['cpu_ms']:.3f} ms; ratio "
              f"{run['ratio']:.2f} wall, {run['cpu_ratio']:.2f} cpu")
    ratio = statistics.median(run["ratio"] for run in runs)
    cpu_ratio = statistics.median(run["cpu_ratio"] for run in runs)
    print(f"ratio per loader process, median of {args.repeats}: {ratio:.2f} wall, "
          f"{cpu_ratio:.2f} cpu (target >= {TARGET}); load average {os.getloadavg()[0]:.1f}")
    print(json.dumps({"shards": str(shards), "split": args.split, "images": split.images,
                      "pairs": split.captions, "image_size": args.image_size,
                      "workers": args.workers, "batch_size": args.batch_size,
                      "loader_index_s": index_s, "runs": runs, "ratio_per_worker": ratio,
                      "cpu_ratio_per_worker": cpu_ratio, "target": TARGET,
                      "load_average": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
