"""The frozen-CNN feature cache: exact features, computed once, kept on disk, stamp-checked;
and the trunk cache of phase 2 with `model.finetune_blocks` (the lower blocks' maps, fp16)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import defrag.images
from defrag.vocab import Vocabulary
from trainer.config import Config
from trainer.data.feature_cache import FeatureCache, feature_stamp, trunk_stamp
from trainer.model import DeFragModel


def tiny_model(**model: object) -> DeFragModel:
    cfg = Config.from_dict({"model": {"embed_dim": 8, "word_dim": 4, **model}})
    return DeFragModel.from_config(cfg.model, Vocabulary(["a", "b"], ["det"]), seed=0)


def images_and_boxes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 64, 64, generator=generator)
    boxes = torch.tensor([[0, 0, 63, 63], [5, 5, 30, 40], [0, 0, 63, 63], [10, 2, 60, 50],
                          [0, 0, 63, 63], [20, 20, 40, 40]], dtype=torch.float)
    box_image = torch.tensor([1, 0, 0, 2, 1, 1])  # not grouped by image: order must be kept
    return images, boxes, box_image, ["x", "y", "z"]


def test_lookup_equals_the_cnn_and_reuses_cached_features(tmp_path: Path) -> None:
    model = tiny_model().eval()
    images, boxes, box_image, ids = images_and_boxes()
    # The cache runs the CNN one image at a time (a feature must not depend on its batch), so
    # the reference does too: a batch's oneDNN sums come in another order (~1e-5 apart).
    expected = torch.cat([model.image.region_features(
        images[box_image[row]][None], boxes[row:row + 1], torch.zeros(1, dtype=torch.long))
        for row in range(len(boxes))])
    cache = FeatureCache()
    torch.testing.assert_close(cache.lookup(model, images, boxes, box_image, ids), expected)
    # Second lookup, in another batch order: served from the cache (the black images would
    # give other features if the CNN ran again).
    subset = torch.tensor([1, 3, 2])  # boxes of "x", "z", "x": batch images 1, 0, 1
    again = cache.lookup(model, torch.zeros(2, 3, 64, 64), boxes[subset],
                         torch.tensor([1, 0, 1]), ["z", "x"])
    torch.testing.assert_close(again, expected[subset])
    # A batch mixing a cached image ("x") and a new one ("w"): the CNN runs on "w" alone.
    new_image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    mixed = cache.lookup(model, torch.cat([torch.zeros(1, 3, 64, 64), new_image]),
                         boxes[[1, 5, 2]], torch.tensor([0, 1, 0]), ["x", "w"])
    torch.testing.assert_close(mixed[[0, 2]], expected[[1, 2]])
    torch.testing.assert_close(mixed[1:2], model.image.region_features(
        new_image, boxes[[5]], torch.tensor([0])))


def test_undecoded_images_are_served_from_the_cache_only() -> None:
    """A feature-only batch (no images, none decoded) gets its cached features; an undecoded
    image whose features are missing is an error naming it, never features of zeros."""
    model = tiny_model().eval()
    images, boxes, box_image, ids = images_and_boxes()
    cache = FeatureCache()
    expected = cache.lookup(model, images, boxes, box_image, ids)
    torch.testing.assert_close(cache.lookup(model, None, boxes, box_image, ids, [False] * 3),
                               expected)
    with pytest.raises(RuntimeError, match="no features for image w and its pixels were not"):
        cache.lookup(model, torch.cat([images[:1], torch.zeros(1, 3, 64, 64)]), boxes[:2],
                     torch.tensor([0, 1]), ["x", "w"], [True, False])


def test_features_survive_on_disk_per_settings(tmp_path: Path) -> None:
    model = tiny_model().eval()
    images, boxes, box_image, ids = images_and_boxes()
    stamp = feature_stamp(Config())
    first = FeatureCache(tmp_path, stamp, rank=1)
    expected = first.lookup(model, images, boxes, box_image, ids)
    first.save()
    assert (first.folder / "rank-1.safetensors").is_file()
    second = FeatureCache(tmp_path, stamp, rank=0)
    assert second.folder == first.folder and set(second.features) == {"x", "y", "z"}
    torch.testing.assert_close(second.lookup(model, torch.zeros_like(images), boxes, box_image,
                                             ids), expected)
    second.save()  # nothing new computed on rank 0: no file
    assert not (second.folder / "rank-0.safetensors").exists()
    # A resumed rank 1 adds an image to its file and keeps the ones it wrote before.
    resumed = FeatureCache(tmp_path, stamp, rank=1)
    resumed.lookup(model, images[:1], boxes[:1], torch.tensor([0]), ["w"])
    resumed.save()
    assert set(FeatureCache(tmp_path, stamp).features) == {"w", "x", "y", "z"}
    # Other settings: another subfolder, nothing shared.
    other = FeatureCache(tmp_path, feature_stamp(Config.from_dict({"model": {"image_size": 128}})))
    assert other.folder != first.folder and not other.features
    # A file whose stamp does not match its folder (moved by hand) is refused.
    other.folder.mkdir()
    (first.folder / "rank-1.safetensors").rename(other.folder / "rank-1.safetensors")
    with pytest.raises(ValueError, match="image_size differ"):
        FeatureCache(tmp_path, other.stamp)


def test_a_box_count_mismatch_is_an_error() -> None:
    model = tiny_model().eval()
    images, boxes, box_image, ids = images_and_boxes()
    cache = FeatureCache()
    cache.lookup(model, images, boxes, box_image, ids)
    with pytest.raises(ValueError, match="image x has 1 boxes but 2 cached"):
        cache.lookup(model, images[:1], boxes[:1], torch.tensor([0]), ["x"])


def test_stamp_follows_the_shards_content_not_their_path(shards: Path, tmp_path: Path) -> None:
    def stamp(folder: Path) -> dict:
        return feature_stamp(Config.from_dict({"data": {"shards": str(folder)}}))

    moved = tmp_path / "moved"
    shutil.copytree(shards, moved)
    assert stamp(moved) == stamp(shards)  # a moved or copied folder keeps its cache
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["sha256"] = "0" * 64  # re-featurized shard
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert stamp(moved)["shards"] != stamp(shards)["shards"]


def test_stamp_follows_the_decoders_version(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Features of pixels an older decoder gave (unrotated, 16-bit clipped) are not reused."""
    old = FeatureCache(tmp_path, feature_stamp(Config()))
    monkeypatch.setattr(defrag.images, "DECODER_VERSION", defrag.images.DECODER_VERSION + 1)
    new = FeatureCache(tmp_path, feature_stamp(Config()))
    assert new.stamp["decoder"] == old.stamp["decoder"] + 1 and new.folder != old.folder


@pytest.mark.parametrize("region_mode", ["roi", "crop"])
def test_trunk_maps_are_cached_in_fp16_under_a_stamp_per_cut(tmp_path: Path,
                                                              region_mode: str) -> None:
    """With `model.finetune_blocks` the cache holds the lower blocks' maps in fp16 (one per
    image in roi mode, one per box in crop mode, in batch order), computed once, kept on disk in
    a folder of their own for each cut, never the frozen features' folder."""
    settings = {"finetune_blocks": 2, "region_mode": region_mode, "crop_size": 32}
    model = tiny_model(**settings).eval()
    images, boxes, box_image, ids = images_and_boxes()
    per_image = [model.image.trunk(images[i:i + 1], boxes[box_image == i],
                                   torch.zeros(int((box_image == i).sum()), dtype=torch.long))
                 for i in range(len(ids))]
    if region_mode == "roi":
        expected = torch.cat(per_image)
    else:  # each image's crops in its boxes' order, put back in the batch's box order
        rows = torch.cat([torch.nonzero(box_image == i).flatten() for i in range(len(ids))])
        expected = torch.empty_like(torch.cat(per_image))
        expected[rows] = torch.cat(per_image)
    cfg = Config.from_dict({"model": settings})
    cache = FeatureCache(tmp_path, trunk_stamp(cfg), trunk=True)
    maps = cache.lookup(model, images, boxes, box_image, ids)
    assert maps.dtype == torch.float16 and maps.shape[1] == 192  # below the top 2 of Lite0
    torch.testing.assert_close(maps, expected.half())
    cache.save()
    reopened = FeatureCache(tmp_path, trunk_stamp(cfg), trunk=True)  # black images: from disk
    torch.testing.assert_close(reopened.lookup(model, torch.zeros_like(images), boxes,
                                               box_image, ids), maps)
    deeper = Config.from_dict({"model": {**settings, "finetune_blocks": 3}})
    folders = {cache.folder, FeatureCache(tmp_path, feature_stamp(cfg)).folder,
               FeatureCache(tmp_path, trunk_stamp(deeper), trunk=True).folder}
    assert len(folders) == 3
