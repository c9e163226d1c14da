"""The CNN's forward + backward the first and the second time each batch size is seen, with the
batch padded to `cnn_batch_size` (as the trainer does on CUDA) and without: cuDNN prepares its
kernels for every new input shape, and a step's number of images varies.

    python benchmarks/bench_cnn_batch.py [--device cuda] [--sizes 30 31 32 33 34 35]
        [--image-size 128] [--backbone efficientnet_lite0]

Each setting gets a fresh model (no size seen before). Prints one line per setting: the first
and second pass per size in ms, and the sum of the first passes; then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from defrag.backbones import build_backbone
from trainer.model import ImageEncoder


def fresh_encoder(backbone: str, device: str, pad: bool) -> ImageEncoder:
    encoder = ImageEncoder(build_backbone(backbone, pretrained=True), 64).to(device).train()
    encoder.pad_batches = pad
    return encoder


def pass_ms(encoder: ImageEncoder, rows: int, size: int, device: str) -> float:
    """One forward + backward of `rows` whole-image boxes, in ms (device synchronized)."""
    images = torch.rand(rows, 3, size, size, device=device)
    boxes = torch.tensor([[0.0, 0.0, size, size]], device=device).repeat(rows, 1)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    encoder.region_features(images, boxes, torch.arange(rows, device=device)).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[30, 31, 32, 33, 34, 35])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--backbone", default="efficientnet_lite0")
    args = parser.parse_args()
    results = []
    for pad in (False, True):
        encoder = fresh_encoder(args.backbone, args.device, pad)
        pass_ms(encoder, 2, args.image_size, args.device)  # warm-up at a size not measured
        times = {rows: (pass_ms(encoder, rows, args.image_size, args.device),
                        pass_ms(encoder, rows, args.image_size, args.device))
                 for rows in args.sizes}
        first_total = sum(first for first, _ in times.values())
        results.append({"padded": pad, "device": args.device, "ms": times,
                        "first_total_ms": first_total})
        print(f"{'padded' if pad else 'exact '} on {args.device}: "
              + " ".join(f"{rows}: {first:.0f}/{second:.0f}" for rows, (first, second)
                         in times.items())
              + f" ms (first/second); first passes {first_total / 1e3:.1f} s in all")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
