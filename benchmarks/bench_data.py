"""The streaming data path: loader throughput against plain decoding of the same images (target:
a loader process at least 90% of plain decode + resize), from local files and from a web server,
and a rank's start-up time and memory as the training set grows (target: flat).

(a) the loader: trainer.data.train_loader.TrainLoader in exact-epoch mode with --workers loader
    processes, timed from the start of an epoch to its last collated Batch (process start-up,
    shard streaming, tar parsing, JSON, caption encoding, decoding and the hand-over included);
    images/s as the training loop gets them, and the CPU time the training process spends per
    image (receiving, pairing, shuffling, collating).
(b) plain decoding: the same image bytes, read from the shards into memory first, decoded one
    after another in this process by trainer.data.reader.decode_image (PIL open, draft, convert to
    RGB, resize to --image-size: exactly the loader's decode), images/s.
(a') the loader processes alone: the same shards streamed and decoded by --workers loader
    processes whose chunks this process receives and drops (no pairing, shuffling, collation):
    what a loader process delivers when the training process does not share the machine's two
    cores with it (on a GPU node the training process has cores of its own). Its decode share
    is the CPU time spent in decode + resize inside the loader processes (a timer around each
    image's decoding) over their whole CPU time: measured at the same moment in the same
    processes, it is free of the drift below, and 1 - share is the loader's own overhead.
(a'') for comparison, open_clip's data pipeline over the same shards (webdataset's DataPipeline
    in torch DataLoader workers, batches of --batch-size images), with the same per-sample work.
ratio = loader images/s / (workers x plain images/s); cpu ratio = plain CPU per image / loader-
process CPU per image (the ratio a loader process reaches on a core of its own). This VM's speed
drifts by 20% within seconds, so every loader measurement is bracketed by two plain passes over
500 of the same images, its floor is their mean, and the medians of --repeats are reported.

With --http the same loader epochs also run from `python -m http.server` serving the shards'
folder on 127.0.0.1 (curl streams each shard), alternating with the same plain passes.

Shards: --shards SPEC (a featurizer output folder), else Flickr-sized synthetic JPEGs generated
into a temporary folder (--synthetic-images scenes at --synthetic-size 500x375, JPEG quality 90,
whole-image boxes, spaCy parses).

--startup 1000,100000 (the default; '' skips it): for each size, a training split of that many
tiny samples is written (tar + manifest, no featurizer: the same 1 KB JPEG and caption in each),
then a fresh process makes a TrainLoader and draws its first batch; its wall times and peak
resident memory are reported (after the imports). The sizes take turns, --startup-repeats times,
and each size's fastest first batch and median peak count. Streaming reads no shard before the
first batch, so both must stay flat: the largest size's within --startup-limit (1.2) times the
smallest's, else the script exits 1.

    python benchmarks/bench_data.py [--shards DIR] [--workers 1] [--image-size 224]
        [--repeats 3] [--http] [--startup 1000,100000] [--startup-repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from defrag.vocab import Vocabulary
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from trainer.batch import CaptionedImage
from trainer.config import Config
from trainer.data.device_decode import Encoded
from trainer.data.loader_processes import Chunk, run_in_processes
from trainer.data.reader import (
    CHUNK_IMAGES,
    PREFETCH_CHUNKS,
    SampleDecoder,
    decode_image,
    image_chunks,
)
from trainer.data.shardset import SplitShards, load_vocabulary, locate_split
from trainer.data.train_loader import TrainLoader

TARGET = 0.9
PLAIN_IMAGES = 500  # images of each plain decoding pass around a loader measurement


def photo_jpeg(image: Image.Image, size: tuple[int, int], noise: np.random.Generator) -> bytes:
    """`image` resized to `size` (width, height) with film grain, as a quality-90 JPEG: a
    photo-like texture, ~60-100 KB at 500x375."""
    pixels = np.asarray(image.convert("RGB").resize(size, Image.Resampling.BICUBIC), np.float32)
    grain = noise.normal(0.0, 10.0, pixels.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels + grain, 0, 255).astype(np.uint8)).save(out, "JPEG",
                                                                           quality=90)
    return out.getvalue()


def synthetic_jpeg_shards(out: Path, images: int, size: tuple[int, int]) -> Path:
    """JPEG scenes of `size` (width, height) with film grain, featurized with whole-image
    boxes."""
    jsonl = generate(out / "source", images, 0, seed=0, image_size=max(size))
    lines, noise = [], np.random.default_rng(0)
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        png = jsonl.parent / record["image"]
        jpg = png.with_suffix(".jpg")
        jpg.write_bytes(photo_jpeg(Image.open(png), size, noise))
        png.unlink()
        lines.append(json.dumps({**record, "image": str(jpg.relative_to(jsonl.parent)),
                                 "boxes": None}))
    jsonl.write_text("\n".join(lines) + "\n")
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=out, parser="spacy", boxes="fullframe",
                       shard_size=max(1, images // 8), workers=1, splits=["train"]))
    return out


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_loader_epoch(loader: TrainLoader, epoch: int) -> dict:
    """One epoch of `loader`: images/s as the training loop gets them, CPU per image of the
    loader processes (and their curl children, reaped at the epoch's end) and of this process."""
    seen = set()
    start, cpu, workers_cpu = time.perf_counter(), time.process_time(), children_cpu()
    loader.set_epoch(epoch)
    for batch in loader:
        seen.update(batch.image_ids)
    seconds = time.perf_counter() - start
    return {"images_per_s": len(seen) / seconds,
            "workers_cpu_ms": (children_cpu() - workers_cpu) / len(seen) * 1e3,
            "main_cpu_ms": (time.process_time() - cpu) / len(seen) * 1e3}


class TimedDecoder(SampleDecoder):
    """The loader's decoder, adding the CPU time its decoding takes (in whichever process runs
    it) to a shared counter."""

    def __init__(self, decoder: SampleDecoder, seconds) -> None:
        super().__init__(**{f.name: getattr(decoder, f.name) for f in dataclasses.fields(decoder)})
        self.seconds = seconds  # multiprocessing.Value("d"), made before the fork

    def pixels_of(self, image: CaptionedImage, data: bytes, where: str = "the image"
                  ) -> np.ndarray | Encoded:
        start = time.thread_time()
        try:
            return super().pixels_of(image, data, where)
        finally:
            with self.seconds.get_lock():
                self.seconds.value += time.thread_time() - start


def time_loader_processes(split: SplitShards, loader: TrainLoader, workers: int) -> dict:
    """The loader processes alone: the chunks of a pass over `split` in `workers` processes
    (decoded like `loader`'s, its verified shards not hashed again), received and dropped: no
    pairing, shuffling or collation in this process. Also the share of the loader processes' CPU
    time spent in decode + resize, timed inside them: both are measured at the same moment in
    the same processes, so the VM's drift cancels out of it."""
    decoding = multiprocessing.get_context("fork").Value("d", 0.0)
    decoder = TimedDecoder(loader.decoder, decoding)

    def source(process: int, processes: int) -> Iterator[Chunk]:
        return image_chunks(split.shards, range(process, len(split.shards), processes),
                            decoder, loader.options, verified=frozenset(loader.verified))

    size = decoder.image_size
    start, workers_cpu, images = time.perf_counter(), children_cpu(), 0
    for chunk, _, _ in run_in_processes(source, workers, CHUNK_IMAGES, (size, size, 3),
                                        PREFETCH_CHUNKS):
        images += len(chunk)
    seconds = time.perf_counter() - start
    workers_cpu = children_cpu() - workers_cpu
    return {"images_per_s": images / seconds,
            "workers_cpu_ms": workers_cpu / images * 1e3,
            "main_cpu_ms": 0.0,
            "decode_share": decoding.value / workers_cpu}


def time_open_clip_pipeline(split: SplitShards, loader: TrainLoader, workers: int,
                            images_per_batch: int) -> dict:
    """The same pass through the pipeline open_clip builds (src/training/data.py): a
    wds.DataPipeline of the shard list, split_by_worker, tarfile_to_samples, a map decoding each
    sample and `batched`, in torch DataLoader workers. Each sample gets the same work as in the
    loader (SampleDecoder.decode: JSON, captions, decode + resize); the hand-over is torch's."""
    decoder = loader.decoder
    warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # PIL's pixels:
    # read-only, and only read (batched stacks them)

    def decoded(sample: dict) -> tuple[torch.Tensor, CaptionedImage]:
        image = decoder.decode(sample)
        return torch.from_numpy(image.pixels), dataclasses.replace(image, pixels=None)

    pipeline = wds.DataPipeline(wds.SimpleShardList(split.urls), wds.split_by_worker,
                                wds.tarfile_to_samples(), wds.map(decoded),
                                wds.batched(images_per_batch, partial=True))
    batches = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=workers)
    start, workers_cpu, images = time.perf_counter(), children_cpu(), 0
    for pixels, _ in batches:
        images += len(pixels)
    seconds = time.perf_counter() - start
    return {"images_per_s": images / seconds,
            "workers_cpu_ms": (children_cpu() - workers_cpu) / images * 1e3,
            "main_cpu_ms": 0.0}


def time_plain_decode(images: list[bytes], size: int) -> dict:
    """One pass of trainer.data.reader.decode_image over `images`, in this process."""
    start, cpu = time.perf_counter(), time.process_time()
    for data in images:
        decode_image(data, size)
    seconds = time.perf_counter() - start
    return {"images_per_s": len(images) / seconds,
            "cpu_ms": (time.process_time() - cpu) / len(images) * 1e3}


def bracketed(measure, images: list[bytes], size: int) -> dict:
    """`measure()` with a plain decoding pass over `images` just before and just after it: the
    mean of the two is its floor, so the machine's drift between measurements cancels out."""
    before = time_plain_decode(images, size)
    result = measure()
    after = time_plain_decode(images, size)
    plain = {key: (before[key] + after[key]) / 2 for key in before}
    return {**result, "plain": plain}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def throughput(args: argparse.Namespace, shards: str) -> dict:
    """Alternating loader epochs (local, and http with --http) and plain decoding passes."""
    cfg = Config.from_dict({"data": {"shards": shards, "workers": args.workers},
                            "model": {"image_size": args.image_size}})
    vocab = load_vocabulary(cfg.data)
    split = locate_split(shards, "train")
    images = [s.get("jpg", s.get("png"))
              for s in wds.tarfile_samples([{"url": u} for u in split.urls])]
    sources = {"local": shards}
    server = None
    if args.http:
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", shards],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        sources["http"] = f"http://127.0.0.1:{port}"
    try:
        loaders = {name: TrainLoader(Config.from_dict({**cfg.to_dict(), "data": {
            **cfg.to_dict()["data"], "shards": spec}}), vocab, args.batch_size, 0, 1)
            for name, spec in sources.items()}
        sample = images[::max(1, len(images) // PLAIN_IMAGES)]
        runs = []
        for repeat in range(args.repeats):
            run = {}
            for name, loader in loaders.items():
                run[name] = bracketed(functools.partial(time_loader_epoch, loader, repeat),
                                      sample, args.image_size)
            run["alone"] = bracketed(functools.partial(
                time_loader_processes, split, loaders["local"], args.workers), sample,
                args.image_size)
            run["open_clip"] = bracketed(functools.partial(
                time_open_clip_pipeline, split, loaders["local"], args.workers,
                args.batch_size), sample, args.image_size)
            runs.append(run)
    finally:
        if server is not None:
            server.terminate()
    mb = sum(map(len, images)) / 1e6
    print(f"{shards}: {split.images} images ({mb:.1f} MB, {mb / split.images * 1e3:.0f} KB "
          f"each), {split.captions} pairs, {len(split.urls)} shards; image size "
          f"{args.image_size}; {os.cpu_count()} CPUs; {args.workers} loader process(es)")
    summary = summarize(runs, [*sources, "alone", "open_clip"], args.workers)
    plain_ms = statistics.median(run[name]["plain"]["cpu_ms"] for run in runs
                                 for name in run)
    print(f"plain decode + resize: {plain_ms:.3f} ms CPU per image; load average "
          f"{os.getloadavg()[0]:.1f}")
    return {"shards": shards, "images": split.images, "image_size": args.image_size,
            "workers": args.workers, "plain_cpu_ms": plain_ms, "runs": runs, **summary}


def summarize(runs: list[dict], names: list[str], workers: int) -> dict:
    """Each way of loading's medians over the runs (ratios per loader process, images/s, the
    training process's CPU per image) and the loader processes' decode share, printed."""
    summary = {}
    for name in names:
        wall = [run[name]["images_per_s"] / (workers * run[name]["plain"]["images_per_s"])
                for run in runs]
        cpu = [run[name]["plain"]["cpu_ms"] / run[name]["workers_cpu_ms"] for run in runs]
        main_ms = statistics.median(run[name]["main_cpu_ms"] for run in runs)
        rate = statistics.median(run[name]["images_per_s"] for run in runs)
        summary[name] = {"ratio": statistics.median(wall), "cpu_ratio": statistics.median(cpu),
                         "images_per_s": rate, "training_process_cpu_ms": main_ms}
        print(f"{name:>5}: loader {rate:.0f} images/s; ratio per loader process (median of "
              f"{len(runs)}) {summary[name]['ratio']:.2f} wall, "
              f"{summary[name]['cpu_ratio']:.2f} cpu (target >= {TARGET}); training process "
              f"{main_ms:.3f} ms CPU per image; repeats {', '.join(f'{w:.2f}' for w in wall)}")
    shares = [run["alone"]["decode_share"] for run in runs]
    summary["alone"]["decode_share"] = statistics.median(shares)
    print(f"alone: decode + resize take {summary['alone']['decode_share']:.3f} of the loader "
          f"processes' CPU time (timed inside them; repeats "
          f"{', '.join(f'{share:.3f}' for share in shares)})")
    return summary


def tiny_split(out: Path, samples: int, shard_size: int = 1000) -> Path:
    """A training split of `samples` copies of one tiny sample, with its manifest and vocab."""
    jpeg = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 40, 40)).save(jpeg, "JPEG")
    caption = {"text": "a red square", "tokens": ["a", "red", "square"],
               "triplets": [["det", "square", "a"], ["amod", "square", "red"]]}
    shards = []
    (out / "train").mkdir(parents=True)
    for index, start in enumerate(range(0, samples, shard_size)):
        count = min(shard_size, samples - start)
        name = f"train/shard-{index:06d}.tar"
        with wds.TarWriter(str(out / name), encoder=False) as writer:
            for number in range(start, start + count):
                meta = {"image_id": f"img{number:08d}", "split": "train", "width": 32,
                        "height": 24, "captions": [caption] * 5, "boxes": [[0, 0, 32, 24]]}
                writer.write({"__key__": f"img{number:08d}", "jpg": jpeg.getvalue(),
                              "json": json.dumps(meta).encode()})
        shards.append({"file": name, "samples": count, "captions": 5 * count, "sha256": None})
    manifest = {"format": 1, "splits": {"train": {  # format 1: captions without trees
        "images": samples, "captions": 5 * samples, "shards": shards}}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    Vocabulary(["a", "red", "square"], ["amod", "det"]).save(out / "vocab.json")
    return out


# A fresh training process with only the trainer's imports: make a TrainLoader, draw its first
# batch; print its wall times and peak resident memory.
STARTUP_CHILD = """
import json, sys, time
start = time.perf_counter()
from trainer.config import Config
from trainer.data.shardset import load_vocabulary
from trainer.data.train_loader import TrainLoader
imported = time.perf_counter()
cfg = Config.from_dict({"data": {"shards": sys.argv[1], "workers": 1},
                        "model": {"image_size": 64}})
loader = TrainLoader(cfg, load_vocabulary(cfg.data), 100, 0, 1)
made = time.perf_counter()
batches = loader.batches()
next(batches)
first = time.perf_counter()
status = open("/proc/self/status").read()  # VmHWM: peak RSS of this program (ru_maxrss
rss_mb = int(status.split("VmHWM:")[1].split()[0]) / 1024  # keeps the forking parent's)
batches.close()
print(json.dumps({"loader_made_s": made - imported, "first_batch_s": first - imported,
                  "peak_rss_mb": rss_mb}))
"""


def startup(sizes: list[int], repeats: int) -> list[dict]:
    """Each size's fastest time to the first batch and median peak RSS over `repeats` fresh
    processes, the sizes taking turns (so the machine's drift hits them alike)."""
    runs: dict[int, list[dict]] = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        splits = {size: tiny_split(Path(tmp) / str(size), size) for size in sizes}
        for _ in range(repeats):
            for size, shards in splits.items():
                out = subprocess.run([sys.executable, "-c", STARTUP_CHILD, str(shards)],
                                     check=True, capture_output=True, text=True).stdout
                runs[size].append(json.loads(out.splitlines()[-1]))
    rows = []
    for size, measured in runs.items():
        times = ", ".join(f"{run['first_batch_s']:.3f}" for run in measured)
        rows.append({"samples": size, "repeats": measured,
                     **{key: min(run[key] for run in measured)
                        for key in ("loader_made_s", "first_batch_s")},
                     "peak_rss_mb": statistics.median(run["peak_rss_mb"] for run in measured)})
        print(f"start-up, {size:>7} samples: loader made in {rows[-1]['loader_made_s']:.3f} s, "
              f"first batch at {rows[-1]['first_batch_s']:.3f} s (fastest of {repeats}; all: "
              f"{times}), peak RSS "
              f"{rows[-1]['peak_rss_mb']:.0f} MB")
    return rows


def startup_flat(rows: list[dict], limit: float) -> dict:
    """The largest size's first-batch time and peak RSS over the smallest's, and whether both
    are within `limit`."""
    small, large = rows[0], rows[-1]
    ratios = {key: large[key] / small[key] for key in ("first_batch_s", "peak_rss_mb")}
    flat = all(ratio <= limit for ratio in ratios.values())
    print(f"start-up, {large['samples']} against {small['samples']} samples: first batch "
          f"x{ratios['first_batch_s']:.2f}, peak RSS x{ratios['peak_rss_mb']:.2f} (limit "
          f"{limit}): {'flat' if flat else 'NOT FLAT'}")
    return {"ratios": ratios, "limit": limit, "flat": flat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="featurizer output folder (default: synthetic JPEGs)")
    parser.add_argument("--synthetic-images", type=int, default=400)
    parser.add_argument("--synthetic-size", default="500x375",
                        help="WIDTHxHEIGHT of the synthetic JPEGs (Flickr-sized by default; "
                             "224x224 for thumbnails)")
    parser.add_argument("--workers", type=int, default=1, help="loader processes")
    parser.add_argument("--batch-size", type=int, default=100, help="pairs per batch")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternations of loader epochs and plain decoding passes")
    parser.add_argument("--http", action="store_true", help="also stream from a web server")
    parser.add_argument("--startup", default="1000,100000",
                        help="comma-separated training set sizes of the start-up check ('' "
                             "skips it)")
    parser.add_argument("--startup-repeats", type=int, default=5,
                        help="fresh processes per size")
    parser.add_argument("--startup-limit", type=float, default=1.2,
                        help="largest size's first batch and peak RSS, in multiples of the "
                             "smallest's")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers must be >= 1: this measures loader processes")
    result = {}
    if args.repeats > 0:
        with tempfile.TemporaryDirectory() as tmp:
            size = tuple(int(side) for side in args.synthetic_size.split("x"))
            shards = args.shards or str(synthetic_jpeg_shards(Path(tmp), args.synthetic_images,
                                                              size))
            result["throughput"] = throughput(args, shards)
    if args.startup:
        rows = startup(sorted(int(size) for size in args.startup.split(",")),
                       args.startup_repeats)
        result["startup"] = {"sizes": rows, **startup_flat(rows, args.startup_limit)}
    print(json.dumps(result))
    if args.startup and not result["startup"]["flat"]:
        sys.exit(f"start-up grows with the training set: over {args.startup_limit} x the "
                 f"{rows[0]['samples']}-sample split's (see the start-up lines)")


if __name__ == "__main__":
    main()
