"""What the fixed part of the CNN computes, once per image and view and reused: the region
features of a frozen CNN (phase 1, frozen-CNN runs), or the lower blocks' maps while the top
`model.finetune_blocks` blocks finetune (phase 2; kept in fp16).

A fixed CNN (its BatchNorm included) makes each box's features a pure function of the image and
its boxes, and a fixed lower part its maps a function of the image, so they are cached by image
id (a mirrored view has its own id): in memory, and optionally in a folder on disk
(`run.feature_cache`) that later runs and other experiments on the same shards reuse. The
entries of one set of settings (`feature_stamp`, `trunk_stamp`) live in a subfolder named by
the settings' hash, so runs with other settings (image size, boxes, backbone, cut) never mix
theirs; each rank writes what it computed to its own safetensors file there, stamped with the
settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import defrag.images
from defrag.files import replaced_atomically
from trainer.config import Config
from trainer.data.shardset import training_manifest
from trainer.model import DeFragModel

log = logging.getLogger(__name__)


def shards_fingerprint(cfg: Config) -> str | None:
    """The content of the train and val shards (their sha256 in the manifest), not their path:
    re-featurized shards (other boxes) get new features, a moved folder keeps its cache."""
    if not cfg.data.shards:
        return None
    manifest = training_manifest(cfg.data)
    digests = sorted(shard["sha256"] for split in (cfg.data.train_split, cfg.data.val_split)
                     for shard in manifest["splits"].get(split, {}).get("shards", []))
    return hashlib.sha256(" ".join(digests).encode()).hexdigest()


def feature_stamp(cfg: Config) -> dict[str, Any]:
    """Everything the cached features depend on: the CNN, its input (the shards' boxes, and the
    decoder's pixels: defrag.images.DECODER_VERSION, and data.decode=device's own decoder)."""
    model = cfg.model
    decoder = defrag.images.DECODER_VERSION
    return {"backbone": model.backbone, "pretrained": model.pretrained,
            "backbone_weights": model.backbone_weights, "image_size": model.image_size,
            "region_mode": model.region_mode, "crop_size": model.crop_size,
            "roi_output_size": model.roi_output_size,
            "max_boxes": 1 if model.fullframe_only else cfg.data.max_boxes,
            "shards": shards_fingerprint(cfg),
            "decoder": f"{decoder}+device" if cfg.data.decode == "device" else decoder}


def trunk_stamp(cfg: Config) -> dict[str, Any]:
    """What the lower blocks' cached maps depend on: the feature stamp and where the CNN is cut."""
    return {**feature_stamp(cfg), "cached": "trunk maps (fp16)",
            "finetune_blocks": cfg.model.finetune_blocks}


class FeatureCache:
    """CNN(I_b) of every box of an image (or, with `trunk`, the maps of `ImageEncoder.trunk`:
    one per image in roi mode, one per box in crop mode), by image id; `lookup` computes only
    what is missing."""

    def __init__(self, folder: str | Path | None = None, stamp: dict[str, Any] | None = None,
                 rank: int = 0, trunk: bool = False) -> None:
        self.trunk = trunk
        self.stamp = stamp or {}
        key = hashlib.sha256(json.dumps(self.stamp, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = Path(folder) / key if folder else None
        self.rank = rank
        self.features: dict[str, torch.Tensor] = {}
        self.computed: set[str] = set()  # ids this rank computed (and writes to its own file)
        self.unsaved = 0
        if self.folder is not None and self.folder.is_dir():
            self._load()

    @torch.no_grad()
    def lookup(self, model: DeFragModel, images: torch.Tensor | None, boxes: torch.Tensor,
               box_image: torch.Tensor, image_ids: list[str],
               decoded: Sequence[bool] | None = None) -> torch.Tensor:
        """Features [len(boxes), feature_dim] of the boxes of `images` (with `trunk`: the maps,
        fp16, one per image or box), on the boxes' device.

        `decoded` (a Batch's; default all) says which images have pixels: only those can be
        computed, the others must be cached."""
        missing = [i for i, key in enumerate(image_ids) if key not in self.features]
        without_pixels = [i for i in missing if decoded is not None and not decoded[i]]
        if without_pixels:
            raise RuntimeError(f"feature cache: no features for image "
                               f"{image_ids[without_pixels[0]]} and its pixels were not decoded "
                               f"(the loader was told its features were cached)")
        # The CNN runs on the missing images only, one at a time: an image's features must not
        # depend on the images that shared its forward pass (CPU convolutions round differently
        # for other batch sizes), or a run resumed mid-epoch would drift from the original.
        compute = model.image.trunk if self.trunk else model.image.region_features
        for i in missing:
            keep = box_image == i
            fresh = compute(images[i:i + 1], boxes[keep], torch.zeros_like(box_image[keep]))
            self.features[image_ids[i]] = fresh.to(torch.float16 if self.trunk
                                                   else torch.float32).cpu()
            self.computed.add(image_ids[i])
        self.unsaved += len(missing)
        if self.trunk and model.image.region_mode == "roi":  # one map per image, in batch order
            return torch.cat([self.features[key] for key in image_ids]).to(boxes.device)
        counts = torch.bincount(box_image, minlength=len(image_ids)).tolist()
        for key, count in zip(image_ids, counts, strict=True):
            if len(self.features[key]) != count:
                raise ValueError(f"feature cache: image {key} has {count} boxes but "
                                 f"{len(self.features[key])} cached; the cache folder "
                                 f"{self.folder} belongs to other boxes: delete it")
        rows = torch.cat([self.features[key] for key in image_ids])
        order = torch.argsort(box_image, stable=True)  # rows are grouped by image, in id order
        out = torch.empty_like(rows)
        out[order] = rows
        return out.to(boxes.device)

    def save(self) -> None:
        """Write this rank's new features to `<folder>/rank-<r>.safetensors` (atomically)."""
        if self.folder is None or not self.unsaved:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank-{self.rank}.safetensors"
        tensors = {key: self.features[key].contiguous() for key in sorted(self.computed)}
        with replaced_atomically(path) as tmp:
            save_file(tensors, tmp, metadata={"stamp": json.dumps(self.stamp, sort_keys=True)})
        self.unsaved = 0
        log.info("feature cache: %d images written to %s", len(tensors), path)

    def _load(self) -> None:
        for path in sorted(self.folder.glob("rank-*.safetensors")):
            with safe_open(path, framework="pt") as handle:
                stamp = json.loads((handle.metadata() or {}).get("stamp", "{}"))
                if stamp != self.stamp:
                    diff = sorted(k for k in {*stamp, *self.stamp}
                                  if stamp.get(k) != self.stamp.get(k))
                    raise ValueError(f"feature cache {path} was made with other settings "
                                     f"({', '.join(diff)} differ) than its folder's name says: "
                                     f"it was moved or altered; delete it")
                keys = handle.keys()  # a safe_open handle is not iterable
                for key in keys:
                    self.features[key] = handle.get_tensor(key)
                if path.name == f"rank-{self.rank}.safetensors":  # rewritten whole by `save`
                    self.computed.update(keys)
                    if path.name == f"rank-{self.rank}.safetensors":
                        self.computed.add(key)
        if self.features:
            log.info("feature cache: %d images read from %s", len(self.features), self.folder)
