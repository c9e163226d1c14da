"""Featurizer throughput on this machine: sentences/s per parser, images/s per box source.

Uses real Flickr8k captions and images when `--data` holds the release (../shared/flickr8k),
else the synthetic scenes. Each backend runs in this one process with `--threads` torch/OpenCV
threads (1 = what each of 2 featurizer workers gets on a 2-core machine), after a warm-up call
that loads its model. stanza without models is reported as unavailable; without
`--detector-weights` the detector runs with random weights (same speed, meaningless boxes).

    python benchmarks/bench_featurize.py [--data ../shared/flickr8k] [--sentences 2000]
        [--images 40] [--threads 1] [--detector-weights FILE] [--write-readme]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import torch
import torchvision

from featurizer.boxes import make_box_source
from featurizer.images import load_image
from featurizer.parsing import ParserUnavailable, make_parser
from featurizer.sources import FLICKR8K_IMAGES, FLICKR8K_TOKEN_FILE, read_jsonl
from featurizer.synthetic import generate

README = Path(__file__).with_name("README.md")
START, END = "<!-- bench_featurize:start -->", "<!-- bench_featurize:end -->"
GIVEN_BOXES = [[10.0, 10.0, 100.0, 120.0], [50.0, 40.0, 200.0, 210.0], [0.0, 0.0, 60.0, 60.0]]


def load_inputs(data: Path, sentences: int, images: int) -> tuple[list[str], list[Path], str]:
    """Captions and image paths to time, from Flickr8k when present, else synthetic scenes."""
    token_file = data / FLICKR8K_TOKEN_FILE
    if token_file.is_file():
        lines = token_file.read_text(encoding="utf-8").splitlines()
        texts = [line.partition("\t")[2].strip() for line in lines[:sentences]]
        paths = sorted((data / FLICKR8K_IMAGES).glob("*.jpg"))[:images]
        return texts, paths, f"Flickr8k ({data})"
    folder = Path(tempfile.mkdtemp(prefix="bench_featurize_"))
    source = read_jsonl(generate(folder, max(images, sentences // 5), 0, seed=0), folder, "train")
    texts = [c.text for record in source.records for c in record.captions][:sentences]
    return texts, [record.path for record in source.records[:images]], "synthetic scenes"


def rate(run: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def bench_parser(name: str, texts: list[str], batch_size: int) -> dict:
    parser = make_parser(name, batch_size)
    try:
        parser.check()
    except ParserUnavailable as err:
        return {"parser": name, "sentences_per_s": None, "note": str(err).split(". ")[0]}
    parser.parse(texts[:20])  # warm-up: loads the model
    parsed: list = []
    speed = rate(lambda: parsed.extend(parser.parse(texts)), len(texts))
    triplets = sum(len(p.triplets) for p in parsed) / len(parsed)
    return {"parser": name, "sentences_per_s": round(speed, 1),
            "note": f"{len(texts)} captions, batch {batch_size}, "
                    f"{triplets:.2f} triplets/caption"}


def bench_boxes(name: str, options: dict, images: list, remark: str = "") -> dict:
    try:
        source = make_box_source(name, **options)
    except (ValueError, FileNotFoundError) as err:
        return {"boxes": name, "images_per_s": None, "note": str(err).split(";")[0]}
    source(images[0], GIVEN_BOXES)  # warm-up
    counts: list[int] = []
    speed = rate(lambda: counts.extend(len(source(image, GIVEN_BOXES)[0]) for image in images),
                 len(images))
    return {"boxes": name, "images_per_s": round(speed, 2),
            "note": f"{len(images)} images, {sum(counts) / len(counts):.1f} boxes/image{remark}"}


def random_detector_weights() -> str:
    """A randomly initialised Faster R-CNN state dict: its speed is that of trained weights."""
    net = torchvision.models.get_model("fasterrcnn_resnet50_fpn", weights=None,
                                       weights_backbone=None)
    path = Path(tempfile.mkdtemp(prefix="bench_featurize_")) / "fasterrcnn_random.pth"
    torch.save(net.state_dict(), path)
    return str(path)


def markdown(results: dict) -> str:
    lines = [START, "## Featurizer: `python benchmarks/bench_featurize.py`", "",
             f"Machine: {results['machine']}; {results['threads']} torch/OpenCV thread(s) per "
             f"process; data: {results['data']}; load average at start "
             f"{results['load_average']} (the cores are shared). "
             f"Command: `{results['command']}`.", "",
             "| parser | sentences/s | notes |", "|---|---|---|"]
    lines += [f"| {r['parser']} | {r['sentences_per_s'] or 'n/a'} | {r['note']} |"
              for r in results["parsers"]]
    lines += ["", "| box source | images/s | notes |", "|---|---|---|"]
    lines += [f"| {r['boxes']} | {r['images_per_s'] or 'n/a'} | {r['note']} |"
              for r in results["boxes"]]
    return "\n".join([*lines, END])


def write_readme(section: str) -> None:
    """Replace this benchmark's section of benchmarks/README.md (other sections are kept)."""
    text = README.read_text() if README.is_file() else "# Benchmarks\n"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else (
        text.rstrip("\n") + "\n\n" + section)
    README.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/flickr8k"))
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--parse-batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--detector-weights", help="state-dict file for the detector source")
    parser.add_argument("--write-readme", action="store_true",
                        help="write the results into benchmarks/README.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cv2.setNumThreads(args.threads)
    texts, paths, data = load_inputs(args.data, args.sentences, args.images)
    images = [load_image(path).image for path in paths]
    detector = args.detector_weights or random_detector_weights()
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
        "threads": args.threads, "data": data,
        "load_average": round(os.getloadavg()[0], 1),
        "command": "python benchmarks/bench_featurize.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v not in (None, False) and k != "write_readme"),
        "parsers": [bench_parser(name, texts, args.parse_batch_size)
                    for name in ("spacy", "stanza")],
        "boxes": [bench_boxes(name, options, images, remark) for name, options, remark in (
            ("fullframe", {}, ""), ("given", {}, ""), ("selective_search", {}, ""),
            ("detector", {"weights": detector},
             "" if args.detector_weights else ", random weights (speed only)"))],
    }
    print(json.dumps(results, indent=1))
    section = markdown(results)
    print(section)
    if args.write_readme:
        write_readme(section)


if __name__ == "__main__":
    main()
