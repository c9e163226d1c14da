"""Images/s of each box source, and how well selective search finds the synthetic shapes.

Times `--images` real Flickr8k images (224x224) from `--data` when present, else synthetic
scenes, through selective search (default options, and any `--ss-option KEY=VALUE` variant) and
Faster R-CNN detectors with RANDOM weights (saved to a temporary file and loaded like real ones:
the cost is the same, the boxes are meaningless). Each source runs in this process with
`--threads` torch threads (1 = what each of 2 featurizer workers gets on 2 cores) after one
warm-up image; wall-clock and process CPU seconds per image are both printed, CPU time being
the steadier one on a shared machine. Then, on `--scenes` synthetic scenes with ground-truth
boxes, the fraction of shapes that selective search covers at IoU >= 0.5 within all its boxes
(recall@19) and within its top k boxes, k = the number of shapes (how well the CNN ranks them).

    python benchmarks/bench_boxes.py [--data ../shared/flickr8k] [--images 30] [--threads 1]
        [--detectors fasterrcnn_mobilenet_v3_large_320_fpn fasterrcnn_resnet50_fpn]
        [--ss-option score_size=224] [--scenes 40]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import cv2
import torch
import torchvision
from PIL import Image
from torchvision.ops import box_iou

from featurizer.boxes import BoxSource, make_box_source
from featurizer.synthetic import make_scenes, render


def load_images(data: Path, count: int) -> tuple[list[Image.Image], str]:
    """Flickr8k images when the release is at `data`, else synthetic 224 px scenes."""
    paths = sorted((data / "Flicker8k_Dataset").glob("*.jpg"))[:count]
    if paths:
        return [Image.open(p).convert("RGB") for p in paths], f"Flickr8k ({data})"
    return [render(s) for s in make_scenes(count, 0, "bench", 224)], "synthetic scenes, 224 px"


def time_source(source: BoxSource, images: list[Image.Image]) -> dict:
    """Images/s (wall) and CPU seconds per image over `images`, after one warm-up call."""
    source(images[0])
    wall, cpu = time.perf_counter(), time.process_time()
    counts = [len(source(image)[0]) - 1 for image in images]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"images_per_s": round(len(images) / wall, 2),
            "cpu_s_per_image": round(cpu / len(images), 3),
            "boxes_per_image": round(sum(counts) / len(counts), 1)}


def random_detector(model: str, folder: Path) -> BoxSource:
    """A detector source loaded from a file of randomly initialised weights (timing only)."""
    path = folder / f"{model}.pth"
    torch.save(torchvision.models.get_model(model, weights=None, weights_backbone=None)
               .state_dict(), path)
    return make_box_source("detector", model=model, weights=str(path), score_thresh=0.0)


def shape_recall(source: BoxSource, count: int) -> dict:
    """Fraction of synthetic shapes covered (IoU >= 0.5) by any box / by the top-k boxes."""
    found = found_top = total = 0
    for scene in make_scenes(count, 0, "bench-recall"):
        boxes, _ = source(render(scene))
        truth = torch.tensor([list(shape.box) for shape in scene.shapes], dtype=torch.float)
        iou = box_iou(truth, torch.tensor(boxes[1:]).reshape(-1, 4))
        if iou.numel():
            found += int((iou.amax(dim=1) >= 0.5).sum())
            found_top += int((iou[:, :len(truth)].amax(dim=1) >= 0.5).sum())
        total += len(truth)
    return {"recall_all": round(found / total, 3), "recall_top_k": round(found_top / total, 3)}


def parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/flickr8k"))
    parser.add_argument("--images", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--detectors", nargs="*", default=[
        "fasterrcnn_mobilenet_v3_large_320_fpn", "fasterrcnn_resnet50_fpn"])
    parser.add_argument("--ss-option", type=parse_option, action="append", default=[],
                        metavar="KEY=VALUE", help="also time selective search with this option")
    parser.add_argument("--scenes", type=int, default=40, help="synthetic scenes for recall")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cv2.setNumThreads(args.threads)
    images, origin = load_images(args.data, args.images)
    print(f"{len(images)} images from {origin}, {args.threads} thread(s)", flush=True)
    variants = [{}] + [dict([option]) for option in args.ss_option]
    for options in variants:
        source = make_box_source("selective_search", **options)
        result = time_source(source, images) | shape_recall(source, args.scenes)
        print(f"selective_search {json.dumps(options)}: {json.dumps(result)}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for model in args.detectors:
            result = time_source(random_detector(model, Path(folder)), images)
            print(f"detector {model} (random weights): {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
