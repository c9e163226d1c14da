"""Measure a captioner on a split of shards (Kiros et al. 2014, 5.2): BLEU-1..4, CIDEr and METEOR of
each image's top caption against its reference captions, beside two baselines scored the same way,
and "caption retrieval" (each caption as a text query over the split's images: its image's rank).

    defrag caption-eval --model DIR --shards data/flickr8k-whole --split dev \\
        [--images N] [--candidates N] [--out results.json] [--examples 10 --picture FILE.jpg]

Systems: `generated` (the captioner), `nearest_sentence` (the nearest training sentence to the
image in the joint space) and `language_model` (no image: the SC-NLM conditioned on the mean
training sentence vector, its candidates ranked by the trigram language model alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import textwrap
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from tqdm import tqdm

from defrag.cli import add_debug_flag, one_line_errors
from defrag.urls import redact
from trainer.caption.captioner import Captioner, image_vectors
from trainer.caption.data import sentence_vectors
from trainer.caption.metrics import system_scores, tokenize
from trainer.config import Config
from trainer.data.eval_set import load_eval_set
from trainer.data.reader import read_images
from trainer.evaluate import Embedded, embed_eval_set, retrieval_metrics

log = logging.getLogger("trainer.caption.evaluate")
SYSTEMS = ("generated", "nearest_sentence", "language_model")


def reading(captioner: Captioner, shards: str) -> Config:
    """The encoder's config, reading `shards` (folder, URL or list) in this process."""
    data = dataclasses.replace(captioner.embedder.cfg.data, shards=shards, val_shards=None,
                               manifest=None, vocab=None, workers=0)
    return dataclasses.replace(captioner.embedder.cfg, data=data)


def embed_split(captioner: Captioner, shards: str, split: str, images: int | None
                ) -> tuple[Embedded, torch.Tensor]:
    """The split's images and references, streamed through the one reader, and each image's
    unit vector in the joint space."""
    eval_set = load_eval_set(reading(captioner, shards), captioner.vocab, split,
                             max_images=images)
    embedded = embed_eval_set(captioner.model, eval_set, progress=True)
    return embedded, image_vectors(embedded.v, embedded.box_image, embedded.num_images)


def caption_split(captioner: Captioner, embedded: Embedded, vectors: torch.Tensor,
                  seed: int) -> dict[str, list[str]]:
    """Each system's caption of every image, in image order."""
    unconditioned = F.normalize(captioner.sentence_vectors.mean(0), dim=0)
    out: dict[str, list[str]] = {name: [] for name in SYSTEMS}
    with torch.no_grad():
        for name, vector in tqdm(list(zip(embedded.image_ids, vectors, strict=True)),
                                 desc="caption", unit="img"):
            description = captioner.describe(vector, name, seed)
            out["generated"].append(description.captions[0].text)
            out["nearest_sentence"].append(description.nearest_sentence)
            drawn, _ = captioner.candidates(unconditioned, seed_of(seed, name))
            scores = [captioner.language_model.log_prob(tokens) for tokens in drawn]
            out["language_model"].append(" ".join(drawn[int(np.argmax(scores))]))
    return out


def seed_of(seed: int, name: str) -> int:
    """The language-model baseline's draws for an image: other than the captioner's."""
    return int(np.random.SeedSequence([seed, 1, len(name), *name.encode()]).generate_state(1)[0])


def caption_retrieval(captioner: Captioner, captions: list[str],
                      vectors: torch.Tensor) -> dict[str, float]:
    """Each image's caption as a text query over all the images: R@1/5/10 and median rank of
    its own image (trainer.evaluate's image search figures)."""
    queries = sentence_vectors(captioner.model.sentence, captioner.vocab,
                               [tokenize(c) for c in captions])
    metrics = retrieval_metrics(vectors @ queries.T, torch.arange(len(captions)))
    return {k.removeprefix("t2i_"): v for k, v in metrics.items() if k.startswith("t2i_")}


def references_of(embedded: Embedded) -> list[list[str]]:
    refs: list[list[str]] = [[] for _ in range(embedded.num_images)]
    for caption, image in zip(embedded.captions, embedded.sentence_image.tolist(), strict=True):
        refs[image].append(caption)
    return refs


def examples_picture(embedded_pixels: list[np.ndarray], rows: list[dict], path: Path) -> None:
    """A grid of example images, each with its generated caption and nearest sentence."""
    tile, text_height, columns = 224, 110, 5
    count = len(rows)
    lines = (count + columns - 1) // columns
    sheet = Image.new("RGB", (columns * tile, lines * (tile + text_height)), "white")
    draw = ImageDraw.Draw(sheet)
    for number, (pixels, row) in enumerate(zip(embedded_pixels, rows, strict=True)):
        x, y = (number % columns) * tile, (number // columns) * (tile + text_height)
        sheet.paste(Image.fromarray(pixels).resize((tile, tile)), (x, y))
        text = "\n".join([*textwrap.wrap(row["generated"], 36),
                          *textwrap.wrap(f"nearest: {row['nearest_sentence']}", 36)])
        draw.multiline_text((x + 4, y + tile + 4), text, fill="black", spacing=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def evaluate_captioner(captioner: Captioner, shards: str, split: str, images: int | None,
                       seed: int) -> tuple[dict, list[dict]]:
    """The figures of every system, and one row per image (its captions and references)."""
    embedded, vectors = embed_split(captioner, shards, split, images)
    captions = caption_split(captioner, embedded, vectors, seed)
    references = references_of(embedded)
    refs = dict(zip(embedded.image_ids, references, strict=True))
    scores = system_scores({system: dict(zip(embedded.image_ids, captions[system], strict=True))
                            for system in SYSTEMS}, refs)
    results = {system: {**scores[system], "retrieval": caption_retrieval(
        captioner, captions[system], vectors)} for system in SYSTEMS}
    rows = [{"image": image, **{s: captions[s][i] for s in SYSTEMS},
             "references": references[i]} for i, image in enumerate(embedded.image_ids)]
    return {"images": embedded.num_images, "split": split, "shards": redact(shards), "seed": seed,
            "settings": dataclasses.asdict(captioner.settings), "systems": results}, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="defrag caption-eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a captioner folder")
    parser.add_argument("--shards", required=True, help="featurizer output folder or URL")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--images", type=int, help="only the first N images of the split")
    parser.add_argument("--candidates", type=int, help="candidates per image (default: the "
                        "folder's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures and every caption as JSON")
    parser.add_argument("--picture", type=Path,
                        help="a picture (.png, .jpg) of the first --examples images")
    parser.add_argument("--examples", type=int, default=10)
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with one_line_errors(parser.prog, args.debug):
        captioner = Captioner(args.model)
        if args.candidates:
            captioner.settings = dataclasses.replace(captioner.settings,
                                                     candidates=args.candidates)
        results, rows = evaluate_captioner(captioner, args.shards, args.split, args.images,
                                           args.seed)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**results, "captions": rows}, indent=2))
        if args.picture:
            examples_picture(first_pixels(captioner, args.shards, args.split, args.examples),
                             rows[:args.examples], args.picture)
        print(json.dumps(results, indent=2))


def first_pixels(captioner: Captioner, shards: str, split: str, count: int) -> list[np.ndarray]:
    """The decoded pixels of the split's first `count` images (for the examples picture)."""
    eval_set = load_eval_set(reading(captioner, shards), captioner.vocab, split)
    images = read_images(eval_set.split.shards, eval_set.decoder, eval_set.options)
    return [image.pixels for image in itertools.islice(images, count)]

