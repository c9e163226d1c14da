"""Feeding the finetuning step: what one CPU core of loader processes delivers with JPEGs decoded
in the loader processes (`data.decode=loader`) and on the device (`data.decode=device`), how
many cores one GPU needs for each, and whether --workers of them keep it fed.

(a) pixels: the mean absolute difference (0-255) between the device decoder's pixels and the
    loader path's for the same JPEGs at --image-size.
(b) per core: one loader process streams an epoch of Flickr-sized JPEGs (--jpeg-size 500x375,
    photo-like); its CPU time per image (and the training process's, which with `device` decodes)
    gives images/s per core.
(c) the floor: phase-2 finetuning steps (MIL, CNN finetuned; roi boxes, EfficientNet-Lite0,
    --batch pairs, bf16 with --bf16) on batches already on the device, images/s.
(d) fed: the same steps fed live by --workers loader processes for each decode mode
    (`batches_on_device`: on CUDA a thread collates and copies the next batch while one trains);
    images/s and its ratio to (c) (target with `device`: >= 0.9 with 4 workers).
Cores one GPU needs = (c)'s images/s x a loader process's CPU seconds per image.

The shards' images are rewritten as JPEGs of --jpeg-size (metadata and boxes scaled), so any
featurized shards serve, without spaCy: --shards DIR, else synthetic scenes featurized here.

    python benchmarks/bench_feed.py [--shards DIR] [--device cuda] [--bf16] [--workers 4]
        [--batch 100] [--image-size 224] [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from bench_data import photo_jpeg, time_loader_epoch
from bench_train import synthetic_shards
from PIL import Image

from trainer.batch import batches_on_device
from trainer.config import Config
from trainer.data.device_decode import decode_chunk, for_device
from trainer.data.reader import decode_image
from trainer.data.shardset import load_vocabulary, locate_split
from trainer.data.train_loader import TrainLoader
from trainer.model import DeFragModel
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import TrainState
from trainer.training.distributed import DistContext
from trainer.training.loop import Trainer

TARGET_FED = 0.9  # fed throughput over the floor, with data.decode=device and 4 workers


def jpeg_shards(source: Path, out: Path, size: tuple[int, int]) -> Path:
    """`source`'s shards with every image rewritten as a photo-like JPEG of `size`
    (`bench_data.photo_jpeg`), metadata size and boxes scaled to it."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("source", "*.jpg", "*.png"))
    noise = np.random.default_rng(0)
    for shard in sorted(out.glob("*/shard-*.tar")):
        samples = list(wds.tarfile_samples([{"url": str(shard)}]))
        with shard.open("wb") as stream, wds.TarWriter(stream, encoder=False) as writer:
            for sample in samples:
                data = sample.pop("jpg", None) or sample.pop("png")
                image = Image.open(io.BytesIO(data)).convert("RGB")
                meta = json.loads(sample["json"])
                scale = [size[0] / image.width, size[1] / image.height] * 2
                meta.update(width=size[0], height=size[1],
                            boxes=[[c * s for c, s in zip(box, scale, strict=True)]
                                   for box in meta["boxes"]])
                writer.write({"__key__": sample["__key__"], "json": json.dumps(meta).encode(),
                              "jpg": photo_jpeg(image, size, noise)})
    return out


def make_config(shards: Path, args: argparse.Namespace, decode: str, workers: int) -> Config:
    return Config.from_dict({
        "model": {"embed_dim": 1000, "image_size": args.image_size},
        "data": {"shards": str(shards), "workers": workers, "decode": decode,
                 "verify_shards": "none", "val_split": args.val_split},
        "optim": {"batch_size": args.batch, "lr": 0.001, "frozen_cnn_epochs": 0, "epochs": 1},
        "run": {"device": args.device, "bf16": args.bf16},
    })


def pixel_difference(shards: Path, size: int, device: torch.device, images: int = 64) -> dict:
    """(a): mean and largest absolute difference of the device decoder's pixels from the loader
    path's, over the first `images` JPEGs."""
    samples = list(wds.tarfile_samples([{"url": url} for url in
                                        locate_split(str(shards), "train").urls]))[:images]
    encoded = []
    for sample in samples:
        meta = json.loads(sample["json"])
        encoded.append(for_device(sample["jpg"], (meta["width"], meta["height"]), 10**9,
                                  sample["__key__"]))
    pixels, failed = decode_chunk(encoded, size, device)
    assert not failed, failed
    difference = np.stack([np.abs(image.cpu().numpy().astype(int)
                                  - decode_image(sample["jpg"], size)[0].astype(int))
                           for image, sample in zip(pixels, samples, strict=True)])
    return {"mean_abs_difference": float(difference.mean()), "max_abs_difference":
            int(difference.max()), "images": len(samples)}


def per_core(shards: Path, args: argparse.Namespace, vocab, device: torch.device) -> dict:
    """(b): one loader process per decode mode, an epoch each, decoding on `device`."""
    out = {}
    for decode in ("loader", "device"):
        loader = TrainLoader(make_config(shards, args, decode, 1), vocab, args.batch, 0, 1,
                             device=device)
        time_loader_epoch(loader, 0)  # warm-up: the page cache, the decoder's first call
        timed = time_loader_epoch(loader, 1)
        out[decode] = {**timed, "images_per_s_per_core": 1e3 / timed["workers_cpu_ms"]}
    return out


def synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def finetune_trainer(shards: Path, args: argparse.Namespace, vocab,
                     device: torch.device) -> Trainer:
    cfg = make_config(shards, args, "loader", 0)
    trainer = Trainer(cfg, DistContext(0, 1, 0, device),
                      DeFragModel.from_config(cfg.model, vocab).to(device), vocab,
                      Tracker(None, None, None), TrainState())
    trainer.start_epoch(0)  # frozen_cnn_epochs 0: MIL, the CNN finetuned
    trainer.model.train()
    return trainer


def images_per_s(trainer: Trainer, batches, steps: int, device: torch.device) -> float:
    """Finetuning steps over `batches` (two warm-up steps first), distinct images per second."""
    batches = iter(batches)
    for _ in range(2):
        trainer.train_step(next(batches), 0)
    images, start = 0, synchronized(device)
    for _, batch in zip(range(steps), batches, strict=False):
        trainer.train_step(batch, 0)
        images += len(batch.image_ids)
    return images / (synchronized(device) - start)


def fed(shards: Path, args: argparse.Namespace, vocab, device: torch.device) -> dict:
    """(c) and (d), alternating: the floor on batches already on the device, then each decode
    mode fed live by --workers loader processes; --repeats rounds, medians."""
    trainer = finetune_trainer(shards, args, vocab, device)
    loaders = {decode: TrainLoader(make_config(shards, args, decode, args.workers), vocab,
                                   args.batch, 0, 1, device=device)
               for decode in ("loader", "device")}
    ready = [batch.to(device) for _, batch in zip(range(args.steps + 2), loaders["loader"],
                                                  strict=False)]
    rounds = []
    for repeat in range(args.repeats):
        row = {"floor": images_per_s(trainer, ready, args.steps, device)}
        for decode, loader in loaders.items():
            loader.set_epoch(repeat)
            row[decode] = images_per_s(trainer, batches_on_device(loader.batches(), device),
                                       args.steps, device)
        rounds.append(row)
    floor = statistics.median(row["floor"] for row in rounds)
    out = {"floor_images_per_s": floor, "rounds": rounds}
    for decode in loaders:
        out[f"{decode}_images_per_s"] = statistics.median(row[decode] for row in rounds)
        out[f"{decode}_ratio"] = statistics.median(row[decode] / row["floor"] for row in rounds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="featurizer output (default: synthetic, needs spaCy)")
    parser.add_argument("--val-split", default="val")
    parser.add_argument("--jpeg-size", default="500x375", help="the JPEGs' WIDTHxHEIGHT")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA only)")
    parser.add_argument("--workers", type=int, default=4, help="loader processes feeding (d)")
    parser.add_argument("--batch", type=int, default=100, help="pairs per step (paper: 100)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    jpeg_size = tuple(int(side) for side in args.jpeg_size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.shards) if args.shards else Path(synthetic_shards(Path(tmp) / "s"))
        shards = jpeg_shards(source, Path(tmp) / "jpeg", jpeg_size)
        vocab = load_vocabulary(make_config(shards, args, "loader", 0).data)
        split = locate_split(str(shards), "train")
        figures = {"device": str(device), "bf16": args.bf16, "jpeg_size": args.jpeg_size,
                   "image_size": args.image_size, "pairs_per_step": args.batch,
                   "workers": args.workers, "images": split.images,
                   "pixels": pixel_difference(shards, args.image_size, device),
                   "per_core": per_core(shards, args, vocab, device),
                   "fed": fed(shards, args, vocab, device)}
    floor = figures["fed"]["floor_images_per_s"]
    for row in figures["per_core"].values():
        row["cores_per_gpu"] = floor * row["workers_cpu_ms"] / 1e3
    pixels, fed_device = figures["pixels"], figures["fed"]["device_ratio"]
    figures["target_fed_device"] = {"value": fed_device, "target": TARGET_FED,
                                    "met": fed_device >= TARGET_FED}
    print(f"pixels: device decoder vs loader, mean |difference| "
          f"{pixels['mean_abs_difference']:.3f} (largest {pixels['max_abs_difference']}) of 255")
    for decode, row in figures["per_core"].items():
        print(f"{decode:6s} decoding: {row['images_per_s_per_core']:.0f} images/s per loader "
              f"core ({row['workers_cpu_ms']:.2f} ms CPU per image; training process "
              f"{row['main_cpu_ms']:.2f} ms); one {args.device} finetuning at {floor:.0f} "
              f"images/s needs {row['cores_per_gpu']:.1f} cores")
    for decode in ("loader", "device"):
        print(f"fed by {args.workers} loader processes, {decode:6s} decoding: "
              f"{figures['fed'][f'{decode}_images_per_s']:.0f} images/s = "
              f"{figures['fed'][f'{decode}_ratio']:.2f} of the floor"
              + (f" (target >= {TARGET_FED})" if decode == "device" else ""))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
