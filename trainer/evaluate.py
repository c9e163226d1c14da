"""Bidirectional retrieval evaluation: the score matrix of a test set and its metrics.

`score_eval_set` turns a test set into image-sentence scores S [N_img, N_sent] with
`trainer.objectives.score_matrix` (eq. 6 or SCAN's in bounded memory, or the training's other
`objective.score`: cosine, inner).
`retrieval_metrics` ranks with S in both directions (docs/design.md section 5, the vsepp / SCAN
convention); `hodosh_metrics` is the paper's protocol for comparing with Hodosh et al.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds
from safetensors.torch import save_file
from tqdm import tqdm

from defrag.cli import add_debug_flag, one_line_errors
from defrag.shard_format import SHARD_NAME
from defrag.urls import redact
from trainer.config import Config
from trainer.data.eval_set import EvalSet, IncompleteSplit, check_complete, load_eval_set
from trainer.data.feature_cache import FeatureCache, feature_stamp
from trainer.data.reader import DataProblem
from trainer.data.shardset import is_folder, training_manifest
from trainer.model import DeFragModel
from trainer.objectives import scan_settings, score_matrix
from trainer.store.model_folder import ModelFolder

RECALL_AT = (1, 5, 10)


def retrieval_metrics(scores: torch.Tensor, sentence_image: torch.Tensor) -> dict[str, float]:
    """R@1/5/10, median and mean rank for image annotation (i2t) and image search (t2i), and rsum.

    `scores` [N_img, N_sent] ranks items by decreasing score; `sentence_image` [N_sent] is the
    image row of each sentence. Ranks are 1-based; i2t keeps the best rank among an image's true
    sentences. Ties are pessimistic: a wrong item scoring the same as the truth ranks above it
    (eq. 6 scores often tie at 0, and a constant matrix must not look perfect); tied true
    sentences do not push each other down. Images with no sentence are left out of i2t but stay
    candidates in t2i.
    """
    _check_retrieval_inputs(scores, sentence_image)
    num_images, num_sentences = scores.shape
    sentence_image = sentence_image.to(scores.device)
    true_score = scores[sentence_image, torch.arange(num_sentences, device=scores.device)]

    # Image search: rank = number of images scoring >= the true one, the true one included.
    t2i_rank = (scores >= true_score).sum(0)

    # Image annotation: the best true sentence of each image against every wrong sentence:
    # rank = 1 + sentences scoring >= it - true sentences scoring >= it.
    best_true = torch.full((num_images,), -math.inf, dtype=scores.dtype, device=scores.device)
    best_true = best_true.scatter_reduce(0, sentence_image, true_score, "amax")
    at_or_above = (scores >= best_true[:, None]).sum(1)
    true_at_best = torch.bincount(sentence_image[true_score >= best_true[sentence_image]],
                                  minlength=num_images)
    has_sentence = torch.bincount(sentence_image, minlength=num_images) > 0
    i2t_rank = (1 + at_or_above - true_at_best)[has_sentence]

    metrics = {**_rank_summary("i2t", i2t_rank), **_rank_summary("t2i", t2i_rank)}
    metrics["rsum"] = sum(metrics[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_AT)
    return metrics


def hodosh_metrics(scores: torch.Tensor, sentence_image: torch.Tensor) -> dict[str, float]:
    """retrieval_metrics on the first sentence of each image only: a 1:1 retrieval (paper Sec. 4).

    "First" is the lowest column of each image in `scores`; the other sentences are dropped.
    """
    _check_retrieval_inputs(scores, sentence_image)
    num_images, num_sentences = scores.shape
    columns = torch.arange(num_sentences, device=sentence_image.device)
    first = torch.full((num_images,), num_sentences, dtype=torch.long, device=columns.device)
    first = first.scatter_reduce(0, sentence_image, columns, "amin")
    first = first[first < num_sentences]  # images with no sentence have no first one
    return retrieval_metrics(scores[:, first.to(scores.device)], sentence_image[first])


@dataclass
class Embedded:
    """Fragment embeddings of an eval set (on the CPU), rows grouped by image and sentence (one
    row per sentence from a whole-sentence encoder)."""

    v: torch.Tensor  # float [N_box, d]
    box_image: torch.Tensor  # long [N_box]: image row of each image fragment
    s: torch.Tensor  # float [Ns, d]
    fragment_sentence: torch.Tensor  # long [Ns]: sentence of each row of s
    sentence_image: torch.Tensor  # long [N_sent]: image row of each sentence
    image_ids: list[str]
    captions: list[str]
    problems: list[DataProblem]

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_sentences(self) -> int:
        return len(self.captions)

    @staticmethod
    def concat(parts: list[Embedded]) -> Embedded:
        """The images and sentences of `parts` one after the other (rows renumbered)."""
        box_image, fragment_sentence, sentence_image = [], [], []
        images = sentences = 0
        for part in parts:
            box_image.append(part.box_image + images)
            fragment_sentence.append(part.fragment_sentence + sentences)
            sentence_image.append(part.sentence_image + images)
            images, sentences = images + part.num_images, sentences + part.num_sentences
        return Embedded(torch.cat([part.v for part in parts]), torch.cat(box_image),
                        torch.cat([part.s for part in parts]), torch.cat(fragment_sentence),
                        torch.cat(sentence_image),
                        [item for part in parts for item in part.image_ids],
                        [item for part in parts for item in part.captions],
                        [problem for part in parts for problem in part.problems])


@torch.no_grad()
def embed_eval_set(model: DeFragModel, eval_set: EvalSet, device: torch.device | str = "cpu",
                   image_batch: int = 32, cache: FeatureCache | None = None,
                   progress: bool = False) -> Embedded:
    """This rank's share of an eval set, streamed and embedded `image_batch` images at a time.

    With a `cache` (the CNN is frozen), box features come from it and the CNN runs once; with a
    trunk cache (its top blocks finetune), the lower blocks' maps come from it."""
    was_training = model.training
    model.eval()
    parts = []
    with tqdm(total=eval_set.expected_images, desc=f"embed {eval_set.split.name}", unit="img",
              disable=not progress, dynamic_ncols=True) as bar:
        for batch in eval_set.batches(image_batch):
            batch = batch.to(device)
            if cache is None:
                features = model.image.region_features(batch.images, batch.boxes,
                                                       batch.box_image)
            else:
                features = cache.lookup(model, batch.images, batch.boxes, batch.box_image,
                                        batch.image_ids, batch.decoded)
                if cache.trunk:
                    features = model.image.top_features(features, batch.boxes, batch.box_image)
            v = model.image.project(features, batch.box_image).float().cpu()
            inputs, sentences = model.sentence.batch_inputs(batch), len(batch.captions)
            s = model.sentence(*inputs, num_sentences=sentences).float().cpu()
            parts.append(Embedded(v, batch.box_image.cpu(), s,
                                  model.sentence.owners(inputs, sentences).cpu(),
                                  batch.sentence_image.cpu(), batch.image_ids, batch.captions,
                                  []))
            bar.update(len(batch.image_ids))
    model.train(was_training)
    dim = model.image.projection.out_features
    empty = torch.zeros(0, dim)
    none = torch.zeros(0, dtype=torch.long)
    result = Embedded.concat([Embedded(empty, none, empty, none, none, [], [], []), *parts])
    result.problems = list(eval_set.problems)
    return result


def gather_embedded(part: Embedded) -> Embedded | None:
    """Every rank's embeddings on rank 0, in rank order (None on the other ranks); `part`
    itself without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return part
    parts: list[Embedded] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    return Embedded.concat(parts) if parts is not None else None


def evaluate_model(model: DeFragModel, eval_set: EvalSet, cfg: Config,
                   device: torch.device | str = "cpu", progress: bool = False,
                   cache: FeatureCache | None = None) -> tuple[dict[str, float], str] | None:
    """retrieval_metrics of `model` on `eval_set` (plus hodosh_* keys when cfg.eval.hodosh),
    and a line saying what was evaluated out of what; every rank embeds its share, rank 0 scores
    (the other ranks get None). IncompleteSplit when images are missing (eval.allow_incomplete).
    `cache`: the frozen CNN's features (see embed_eval_set)."""
    scored = score_eval_set(model, eval_set, cfg, device, progress, cache)
    if scored is None:
        return None
    scores, embedded, line = scored
    return split_metrics(scores, embedded.sentence_image, cfg.eval.hodosh), line


def score_eval_set(model: DeFragModel, eval_set: EvalSet, cfg: Config,
                   device: torch.device | str = "cpu", progress: bool = False,
                   cache: FeatureCache | None = None
                   ) -> tuple[torch.Tensor, Embedded, str] | None:
    """The score matrix of `model` on `eval_set` with the embeddings it came from and the line
    of `evaluate_model` (None on ranks other than 0)."""
    embedded = gather_embedded(embed_eval_set(model, eval_set, device, cfg.eval.image_batch,
                                              cache, progress))
    if embedded is None:
        return None
    line = check_complete(eval_set.split, embedded.num_images, embedded.num_sentences,
                          embedded.problems,
                          cfg.eval.allow_incomplete or eval_set.max_images is not None)
    if embedded.num_sentences == 0:
        raise IncompleteSplit(f"no usable image in split {eval_set.split.name!r}: {line}")
    scores = score_matrix(embedded.v, embedded.box_image, embedded.s, embedded.fragment_sentence,
                          embedded.num_images, embedded.num_sentences, cfg.objective.smooth,
                          cfg.eval.chunk_images, cfg.eval.chunk_sentences, progress=progress,
                          score=cfg.objective.score, scan=scan_settings(cfg.objective))
    return scores, embedded, line


def split_metrics(scores: torch.Tensor, sentence_image: torch.Tensor,
                  hodosh: bool = False) -> dict[str, float]:
    """retrieval_metrics, and with `hodosh` hodosh_metrics under hodosh_* keys."""
    metrics = retrieval_metrics(scores, sentence_image)
    if hodosh:
        extra = hodosh_metrics(scores, sentence_image)
        metrics.update({f"hodosh_{key}": value for key, value in extra.items()})
    return metrics


def _rank_summary(direction: str, rank: torch.Tensor) -> dict[str, float]:
    """R@K (percent), floor of the median rank and mean rank of 1-based ranks."""
    rank = rank.cpu().numpy()
    summary = {f"{direction}_r{k}": 100.0 * float(np.mean(rank <= k)) for k in RECALL_AT}
    summary[f"{direction}_medr"] = float(np.floor(np.median(rank)))
    summary[f"{direction}_meanr"] = float(np.mean(rank))
    return summary


def _check_retrieval_inputs(scores: torch.Tensor, sentence_image: torch.Tensor) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a 2-D float tensor [N_img, N_sent]: got "
                         f"{scores.dtype} of shape {tuple(scores.shape)}")
    num_images, num_sentences = scores.shape
    if sentence_image.dim() != 1 or sentence_image.dtype != torch.long:
        raise ValueError(f"sentence_image must be a 1-D LongTensor [N_sent]: got "
                         f"{sentence_image.dtype} of shape {tuple(sentence_image.shape)}")
    if len(sentence_image) != num_sentences:
        raise ValueError(f"sentence_image has {len(sentence_image)} entries but scores has "
                         f"{num_sentences} sentence columns")
    if num_sentences == 0:
        raise ValueError("no sentences to evaluate: scores has 0 columns")
    low, high = int(sentence_image.min()), int(sentence_image.max())
    if low < 0 or high >= num_images:
        raise ValueError(f"sentence_image must hold image rows in [0, {num_images}): got values "
                         f"from {low} to {high}")
    if bool(scores.isnan().any()):
        raise ValueError("scores contain NaN: ranks would be meaningless")


def main(argv: list[str] | None = None) -> None:
    """`defrag evaluate --model DIR --shards SHARDS`: metrics, last line JSON."""
    parser = argparse.ArgumentParser(prog="defrag evaluate", description=main.__doc__)
    parser.add_argument("--model", required=True,
                        help="a registered model folder, or an ensemble folder (the weighted sum "
                             "of its members' scores; defrag registry ensemble)")
    parser.add_argument("--shards", required=True,
                        help="featurizer output folder or its http(s) URL (with --split), or a "
                             "WebDataset shard list such as 'data/test/shard-{000000..000004}.tar'"
                             " or 'pipe:aws s3 cp s3://bucket/f8k/test/shard-{000000..000004}.tar"
                             " -' (with --manifest when it cannot be found two folders up)")
    parser.add_argument("--split", help="split of the featurized set (default: the one the "
                                        "shard list belongs to, else 'test')")
    parser.add_argument("--manifest", help="the shards' manifest.json (path or URL)")
    parser.add_argument("--max-images", type=int, help="only the first N images")
    parser.add_argument("--workers", type=int, default=2, help="loader processes")
    parser.add_argument("--allow-incomplete", action="store_true",
                        help="evaluate even when usable images differ from the manifest's count")
    parser.add_argument("--save-scores", type=Path, metavar="FILE.safetensors",
                        help="also write the score matrix [images, sentences] and each "
                             "sentence's image row (e.g. to choose ensemble weights)")
    parser.add_argument("--device", default="cpu")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    with one_line_errors(parser.prog, args.debug):
        evaluate_folder(args.model, args.shards, args.split, manifest=args.manifest,
                        max_images=args.max_images, workers=args.workers,
                        allow_incomplete=args.allow_incomplete, save_scores=args.save_scores,
                        device=args.device)


def evaluate_folder(model_dir: str, shards: str, split: str | None = None, *,
                    manifest: str | None = None, max_images: int | None = None, workers: int = 2,
                    allow_incomplete: bool = False, save_scores: Path | None = None,
                    device: str = "cpu") -> None:
    """`defrag evaluate`'s work: load the model folder (each member of an ensemble) and the split
    of `shards`, evaluate, print the metrics (the last line JSON)."""
    split = split or _split_of_list(shards)
    members, weights = zip(*ModelFolder.open(model_dir).members, strict=True)
    total, first = None, None
    # members with one CNN share its features (a cache computes them one image at a time: only
    # an ensemble gains)
    caches: dict[str, FeatureCache] = {}
    for member, weight in zip(members, weights, strict=True):
        if len(members) > 1:
            print(f"member {member.path.name} of {len(members)}", file=sys.stderr)
        model, cfg, vocab = member.load_model(), member.config, member.vocab
        model.to(device)
        cfg.data = dataclasses.replace(cfg.data, shards=shards, val_shards=None,
                                       manifest=manifest, workers=workers)
        cfg.eval.allow_incomplete = allow_incomplete
        if _trained_boxes(member) == "fullframe":  # the box it was trained on, as retrieve does
            cfg.model = dataclasses.replace(cfg.model, fullframe_only=True)
        else:
            _warn_other_boxes(member, cfg)
        eval_set = load_eval_set(cfg, vocab, split, max_images, rank=0, world_size=1)
        cache = (caches.setdefault(cnn_fingerprint(model, cfg), FeatureCache())
                 if len(members) > 1 else None)
        scores, embedded, line = score_eval_set(model, eval_set, cfg, device, progress=True,
                                                cache=cache)
        if first is None:
            total, first = scores.mul_(weight), embedded  # in place: one matrix held
        elif (embedded.image_ids, embedded.captions) != (first.image_ids, first.captions):
            raise IncompleteSplit(f"{member.path} read other images or captions than "
                                  f"{members[0].path} from {shards}: an ensemble's members "
                                  "must see the same pairs")
        else:
            total.add_(scores, alpha=weight)
    metrics = split_metrics(total, first.sentence_image, cfg.eval.hodosh)
    if save_scores:
        save_file({"scores": total.contiguous(), "sentence_image": first.sentence_image},
                  save_scores)
    count = len(set(eval_set.split.urls))
    images = eval_set.images_read
    chance = {k: 100.0 * min(k, images) / images for k in RECALL_AT}
    what = f"an ensemble of {len(members)} models, " if len(members) > 1 else ""
    print(f"evaluated {what}{line} from {count} shard(s)")
    for direction, name in (("i2t", "image annotation"), ("t2i", "image search")):
        recalls = " ".join(f"R@{k} {metrics[f'{direction}_r{k}']:5.1f} (chance {chance[k]:.1f})"
                           for k in RECALL_AT)
        print(f"{name:>16}: {recalls}  med r {metrics[f'{direction}_medr']:.0f}")
    print(json.dumps({"model": str(model_dir), "members": len(members),
                      "shards": redact(shards), "split": split, **metrics}))


def _trained_boxes(model: ModelFolder) -> str | None:
    """The box source of the model's training shards (None: not recorded). A model trained on
    the whole image (`fullframe`) reads only the whole-image box (row 0) of any shards, as
    `defrag retrieve` boxes new images for it: an ensemble of whole-image and region models is
    evaluated on region shards."""
    return ((model.featurizer or {}).get("box_source") or {}).get("name")


def _warn_other_boxes(model: ModelFolder, cfg: Config) -> None:
    """Say so when the shards' boxes come from another source than the model's training boxes
    (e.g. whole-image shards for a region model): its figures then measure other inputs."""
    trained = _trained_boxes(model)
    boxes = training_manifest(cfg.data).get("box_source")
    if trained and boxes and trained != boxes["name"]:
        print(f"warning: {model.path} was trained on {trained!r} boxes but these shards "
              f"have {boxes['name']!r} boxes; featurize them with --boxes {trained} "
              "to measure the model on the inputs it was trained on", file=sys.stderr)


def cnn_fingerprint(model: DeFragModel, cfg: Config) -> str:
    """What a model's box features depend on: its CNN's weights and input settings (members of
    an ensemble trained with one frozen CNN have the same, and share its features)."""
    digest = hashlib.sha256(json.dumps(feature_stamp(cfg), sort_keys=True).encode())
    for name, tensor in sorted(model.image.backbone.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _split_of_list(shards: str) -> str:
    """The split a shard list belongs to (its first shard's folder name); 'test' for a folder."""
    if is_folder(shards):
        return "test"
    match = SHARD_NAME.findall(wds.shardlists.expand_urls(shards)[0])
    return match[-1].split("/")[0] if match else "test"


if __name__ == "__main__":
    main()
