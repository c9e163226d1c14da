"""What a region model's image fragments do on their own (docs/results.md, "Regions"): the
model's retrieval on a split scored with every image fragment, with the whole image (box 0) only
and with the regions only (boxes 1..); and, over the true pairs, how many sentence fragments
align best (paper Figure 4) to the whole image rather than to a region.

    .venv/bin/python launch/region_fragments.py --model runs/table2/roi_448/best \
        --shards data/flickr8k --split dev

Prints one JSON line. Scores are the model's own (eq. 6 with its smoothing), computed by
trainer.objectives.score_matrix from the embeddings `defrag evaluate` computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from trainer.data.eval_set import load_eval_set
from trainer.evaluate import Embedded, embed_eval_set, retrieval_metrics
from trainer.objectives import score_matrix
from trainer.store.model_folder import ModelFolder


def box_numbers(box_image: torch.Tensor) -> torch.Tensor:
    """Each image fragment's place among its image's (0 = the whole image; rows are grouped by
    image, the whole image first)."""
    if (box_image.diff() < 0).any():
        raise ValueError("image fragments are not grouped by image in order")
    starts = torch.searchsorted(box_image, box_image, side="left")
    return torch.arange(len(box_image)) - starts


def retrieval_with(embedded: Embedded, keep: torch.Tensor, smooth: float, score: str) -> dict:
    """retrieval_metrics when only the image fragments in `keep` score (an image left with none
    keeps its whole-image fragment)."""
    alone = torch.bincount(embedded.box_image[keep], minlength=embedded.num_images) == 0
    keep = keep | (alone[embedded.box_image] & (box_numbers(embedded.box_image) == 0))
    scores = score_matrix(embedded.v[keep], embedded.box_image[keep], embedded.s,
                          embedded.fragment_sentence, embedded.num_images,
                          embedded.num_sentences, smooth, score=score)
    return {**retrieval_metrics(scores, embedded.sentence_image),
            "images_without_regions": int(alone.sum())}


def whole_image_share(embedded: Embedded) -> float:
    """Of the sentence fragments of every true pair, the share whose best-scoring image fragment
    (v_i . s_j, Figure 4's alignment) is the whole image."""
    number = box_numbers(embedded.box_image)
    whole = 0
    for sentence, image in enumerate(embedded.sentence_image.tolist()):
        boxes = (embedded.box_image == image).nonzero().squeeze(1)
        s = embedded.s[embedded.fragment_sentence == sentence]
        best = (s @ embedded.v[boxes].T).argmax(dim=1)
        whole += int((number[boxes[best]] == 0).sum())
    return whole / len(embedded.s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a region model's folder (one member)")
    parser.add_argument("--shards", required=True, help="the featurized set (with its boxes)")
    parser.add_argument("--split", default="dev")
    args = parser.parse_args()
    folder = ModelFolder.open(args.model)
    model, cfg = folder.load_model(), folder.config
    if cfg.model.sentence_encoder != "fragments":
        parser.error(f"{args.model} encodes whole sentences: it has no sentence fragments")
    cfg.data = dataclasses.replace(cfg.data, shards=args.shards, val_shards=None, manifest=None)
    eval_set = load_eval_set(cfg, folder.vocab, args.split, rank=0, world_size=1)
    embedded = embed_eval_set(model, eval_set, image_batch=cfg.eval.image_batch, progress=True)
    number = box_numbers(embedded.box_image)
    smooth, score = cfg.objective.smooth, cfg.objective.score
    print(json.dumps({
        "model": args.model, "split": args.split, "images": embedded.num_images,
        "image_fragments_per_image": len(number) / embedded.num_images,
        "all": retrieval_with(embedded, torch.ones_like(number, dtype=torch.bool), smooth, score),
        "whole_image_only": retrieval_with(embedded, number == 0, smooth, score),
        "regions_only": retrieval_with(embedded, number > 0, smooth, score),
        "sentence_fragments_aligned_to_the_whole_image": whole_image_share(embedded)}))


if __name__ == "__main__":
    main()
