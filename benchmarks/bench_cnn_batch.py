"""The CNN's forward + backward the first and the second time each batch size is seen, with the
batch padded to `cnn_batch_size` (as the trainer does on CUDA) and without: cuDNN prepares its
kernels for every new input shape, and a step's number of images varies.

    python benchmarks/bench_cnn_batch.py [--device cuda] [--sizes 30 31 32 33 34 35]
        [--image-size 128] [--backbone efficientnet_lite0] [--json PATH]

Each setting gets a fresh model (no size seen before); images are channels-last, as the trainer
sends them. Prints one line per setting: the first and second pass per size in ms, and the sum
of the first passes; then the target line and one JSON line (also written to --json PATH).

Target: the first pass of a new batch size within 3x its second (warmed) pass. Padded, a new
number of images either maps onto a padded size met before (the case the padding makes common:
a training run meets a few padded sizes, then only those) or onto a new padded size (a one-off
cost per padded size); the target's figure is the worst first / second over the former, and
the latter are reported beside it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from defrag.backbones import build_backbone
from trainer.model import ImageEncoder, cnn_batch_size

TARGET = 3.0
WARM_UP_ROWS = 2  # the warm-up pass's batch size, not measured


def fresh_encoder(backbone: str, device: str, pad: bool) -> ImageEncoder:
    encoder = ImageEncoder(build_backbone(backbone, pretrained=True), 64).to(device).train()
    encoder.pad_batches = pad
    return encoder


def pass_ms(encoder: ImageEncoder, rows: int, size: int, device: str) -> float:
    """One forward + backward of `rows` whole-image boxes, in ms (device synchronized)."""
    images = torch.rand(rows, 3, size, size, device=device)
    images = images.contiguous(memory_format=torch.channels_last)
    boxes = torch.tensor([[0.0, 0.0, size, size]], device=device).repeat(rows, 1)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    encoder.region_features(images, boxes, torch.arange(rows, device=device)).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def first_over_second(times: dict[int, tuple[float, float]], pad: bool) -> dict:
    """The worst first / second pass over all sizes; padded, also over the sizes whose padded
    size was met before (warm-up included) and the sizes that met a new padded size."""
    ratios = {rows: first / second for rows, (first, second) in times.items()}
    out = {"max_first_over_second": max(ratios.values())}
    if pad:
        seen, reused, new = {cnn_batch_size(WARM_UP_ROWS)}, [], []
        for rows in times:
            (reused if cnn_batch_size(rows) in seen else new).append(rows)
            seen.add(cnn_batch_size(rows))
        out["padded_size_seen"] = {
            "sizes": reused, "max_first_over_second": max((ratios[r] for r in reused),
                                                          default=None)}
        out["padded_size_new"] = {
            "sizes": new, "max_first_over_second": max((ratios[r] for r in new), default=None),
            "first_total_ms": sum(times[r][0] for r in new)}
    return out


def target_line(results: list[dict]) -> str:
    exact, padded = results
    seen, new = padded["padded_size_seen"], padded["padded_size_new"]
    line = (f"first / second pass of a new batch size: exact up to "
            f"{exact['max_first_over_second']:.1f}x")
    if seen["max_first_over_second"] is not None:
        line += (f"; padded, onto a padded size met before ({len(seen['sizes'])} sizes), up to "
                 f"{seen['max_first_over_second']:.1f}x (target <= {TARGET:g})")
    if new["sizes"]:
        line += (f"; onto a new padded size ({len(new['sizes'])}), up to "
                 f"{new['max_first_over_second']:.1f}x, {new['first_total_ms'] / 1e3:.1f} s in all")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[30, 31, 32, 33, 34, 35])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--json", help="also write the JSON line's figures to this file")
    args = parser.parse_args()
    results = []
    for pad in (False, True):
        encoder = fresh_encoder(args.backbone, args.device, pad)
        pass_ms(encoder, WARM_UP_ROWS, args.image_size, args.device)
        times = {rows: (pass_ms(encoder, rows, args.image_size, args.device),
                        pass_ms(encoder, rows, args.image_size, args.device))
                 for rows in args.sizes}
        first_total = sum(first for first, _ in times.values())
        results.append({"padded": pad, "device": args.device, "image_size": args.image_size,
                        "backbone": args.backbone, "ms": times, "first_total_ms": first_total,
                        **first_over_second(times, pad)})
        print(f"{'padded' if pad else 'exact '} on {args.device}: "
              + " ".join(f"{rows}: {first:.0f}/{second:.0f}" for rows, (first, second)
                         in times.items())
              + f" ms (first/second); first passes {first_total / 1e3:.1f} s in all")
    print(target_line(results))
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
