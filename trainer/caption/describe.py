"""Describe images in words with a captioner folder (trainer/caption/captioner.py; Kiros et al.
2014, 5.2): the best captions of each image, and its nearest training sentence beside them.

    defrag caption --model DIR IMAGE... [--json] [--candidates N] [--seed S]

A registered captioner is downloaded first: defrag registry download
models:/defrag-captioner@champion --dst DIR --tracking-uri URI. An image that cannot be read is
skipped with a warning naming it (and listed with its error in --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from defrag.cli import add_debug_flag, one_line_errors
from trainer.caption.captioner import Captioner, Description, image_vectors
from trainer.search.embedder import embed_images

log = logging.getLogger("trainer.caption.describe")


def caption_images(captioner: Captioner, paths: list[Path], seed: int
                   ) -> tuple[dict[str, Description], dict[str, str]]:
    """Each usable image's Description by file name, and the unusable ones' problems."""
    images, problems = embed_images(paths, captioner.embedder, skip_bad=True)
    vectors = image_vectors(images.embeddings, images.owner, len(images.items))
    described = {}
    with torch.no_grad():
        for name, vector in tqdm(list(zip(images.items, vectors, strict=True)), desc="caption",
                                 unit="img", disable=not images.items):
            described[name] = captioner.describe(vector, name, seed)
    return described, problems


def as_text(described: dict[str, Description], problems: dict[str, str]) -> str:
    lines = []
    for name, description in described.items():
        lines.append(name)
        for number, candidate in enumerate(description.captions, start=1):
            lines.append(f"  {number}. {candidate.text}   (score {candidate.score:.3f}: "
                         f"translation {candidate.translation:.3f}, language model "
                         f"{candidate.language_model:.1f})")
        lines.append(f"  nearest training sentence: {description.nearest_sentence}")
    lines.extend(f"{name}: skipped ({problem})" for name, problem in problems.items())
    return "\n".join(lines)


def as_json(described: dict[str, Description], problems: dict[str, str]) -> str:
    rows = [{"image": name, **dataclasses.asdict(description)}
            for name, description in described.items()]
    rows += [{"image": name, "error": problem} for name, problem in problems.items()]
    return json.dumps(rows, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="defrag caption", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a captioner folder")
    parser.add_argument("images", nargs="+", type=Path, help="image files")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--candidates", type=int,
                        help="candidate captions per image (default: the folder's, 1000 as in "
                             "the paper)")
    parser.add_argument("--top", type=int, help="captions printed per image (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="seeds each image's draws")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with one_line_errors(parser.prog, args.debug):
        for flag in ("candidates", "top"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag} {getattr(args, flag)}: expected 1 or more")
        captioner = Captioner(args.model)
        chosen = {k: getattr(args, k) for k in ("candidates", "top") if getattr(args, k)}
        captioner.settings = dataclasses.replace(captioner.settings, **chosen)
        described, problems = caption_images(captioner, args.images, args.seed)
        print(as_json(described, problems) if args.json else as_text(described, problems))
        if not described:
            raise ValueError("no image could be read (see the warnings above)")

