"""data.decode=device (trainer/data/device_decode.py) on the CPU, where the same code runs
torchvision's CPU decoder: which images travel undecoded, pixels close to the loader path's, the
same training batches and boxes, PNG and other images decoded in the loader processes, and
damaged images skipped and counted as with data.decode=loader."""

from __future__ import annotations

import io
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from defrag.vocab import Vocabulary
from tests.small_training import small_config
from tests.test_data import batch_pairs, make_config, rewrite_shard
from trainer.data.device_decode import Encoded, decode_chunk, for_device
from trainer.data.reader import decode_image
from trainer.data.train_loader import MIRROR, make_train_loader
from trainer.training.checkpoint import latest_checkpoint, load_state
from trainer.training.distributed import DistContext

CPU = torch.device("cpu")


def photo(size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A smooth gradient with grain: JPEG-like content whose resampling differences are small."""
    width, height = size
    rng = np.random.default_rng(seed)
    x, y = np.meshgrid(np.linspace(0, 1, width), np.linspace(0, 1, height))
    base = np.stack([x * 200 + 20, y * 180 + 40, (1 - x) * y * 220 + 10], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def encoded(image: Image.Image, exif: Image.Exif | None = None, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, **({"exif": exif} if exif else {}), **options)
    return out.getvalue()


def bogus_huffman_table(data: bytes) -> bytes:
    """A JPEG whose header PIL accepts but whose Huffman table no decoder can use."""
    at = data.index(b"\xff\xc4")
    return data[:at + 5] + bytes([255] * 16) + data[at + 21:]


def test_for_device_takes_the_jpegs_the_device_decodes_and_nothing_else() -> None:
    rgb = photo((120, 90))
    rotated = Image.Exif()
    rotated[0x0112] = 6  # EXIF orientation: turned 90 degrees
    png = io.BytesIO()
    rgb.save(png, "PNG")
    jpeg = encoded(rgb)
    assert for_device(jpeg, (120, 90), 10**6, "x") == Encoded(jpeg, "x")
    assert isinstance(for_device(encoded(rgb.convert("L")), (120, 90), 10**6, "x"), Encoded)
    assert isinstance(for_device(encoded(rgb, progressive=True), (120, 90), 10**6, "x"), Encoded)
    for other in (png.getvalue(),  # another format
                  encoded(rgb.convert("CMYK")),  # CMYK: PIL's conversion (Adobe's inversion)
                  encoded(rgb, rotated),  # EXIF-rotated: the loader orients it
                  jpeg[: len(jpeg) // 2],  # truncated: the loader's decoder names the damage
                  b"not an image"):
        assert for_device(other, (120, 90), 10**6, "x") is None
    assert for_device(jpeg, (90, 120), 10**6, "x") is None  # not the size its metadata says
    assert for_device(jpeg, (120, 90), 120 * 90 - 1, "x") is None  # the loader refuses it


@pytest.mark.parametrize(("size", "mad"), [((128, 96), 0.0), ((512, 384), 3.0)])
def test_device_pixels_are_close_to_the_loader_pixels(size: tuple[int, int], mad: float) -> None:
    """Decoded at 64 px: equal where PIL decodes at full size (under twice the target), close
    where it decodes at 1/2-1/8 scale first (DCT-domain `draft`); grey JPEGs become RGB."""
    images = [encoded(photo(size, seed=1)), encoded(photo(size, "L", seed=2))]
    pixels, failed = decode_chunk([Encoded(data, "x") for data in images], 64, CPU)
    assert not failed
    for data, device in zip(images, pixels, strict=True):
        loader, _ = decode_image(data, 64)
        assert device.dtype == torch.uint8 and device.shape == (64, 64, 3)
        difference = np.abs(device.numpy().astype(int) - loader.astype(int))
        assert difference.mean() <= mad, difference.mean()


@pytest.fixture(scope="module")
def vocab(shards: Path) -> Vocabulary:
    return Vocabulary.load(shards / "vocab.json")


@pytest.fixture(scope="module")
def jpeg_shards(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic shards with three in four training images stored as JPEG (every tenth of
    them grey) and the others left PNG."""
    copy = tmp_path_factory.mktemp("jpeg") / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("source"))
    count = iter(range(10**6))

    def to_jpeg(sample: dict) -> dict:
        number = next(count)
        if number % 4 == 3:
            return sample
        image = Image.open(io.BytesIO(sample.pop("png"))).convert("L" if number % 10 == 0
                                                                  else "RGB")
        return {**sample, "jpg": encoded(image)}

    for shard in sorted((copy / "train").glob("shard-*.tar")):
        rewrite_shard(shard, to_jpeg)
    return copy


def test_device_decoding_gives_the_loader_batches(jpeg_shards: Path, vocab: Vocabulary) -> None:
    """The same pairs, boxes and mirrored views in the same order, PNG pixels equal, JPEG
    pixels close (the CPU's decoder differs from PIL's only in PIL's DCT-domain downscaling)."""
    batches = {decode: list(make_train_loader(make_config(jpeg_shards, {
        "max_boxes": 3, "workers": 2, "hflip": True, "decode": decode,
        "verify_shards": "none"}), vocab, batch_size=12)[0]) for decode in ("loader", "device")}
    differences, exact = [], 0
    for loader, device in zip(batches["loader"], batches["device"], strict=True):
        assert batch_pairs(loader) == batch_pairs(device)
        assert device.decoded == loader.decoded
        for name in ("boxes", "box_image", "fragments", "image_key", "words"):
            assert torch.equal(getattr(loader, name), getattr(device, name)), name
        assert device.images.dtype == torch.uint8 and device.images.shape == loader.images.shape
        assert device.images.is_contiguous(memory_format=torch.channels_last)
        difference = (device.images.int() - loader.images.int()).abs()
        differences.append(difference.float().mean(dim=(1, 2, 3)))
        exact += int((difference.flatten(1).amax(dim=1) == 0).sum())
    per_image = torch.cat(differences)
    assert per_image.mean() < 2.0 and per_image.max() < 4.0  # mirrored views included
    # the PNGs (a quarter) alone are equal: decoded in the loader processes, the JPEGs on the
    # device (measured: mean 1.23, largest 2.58 of 255 for 128 px JPEGs decoded at 64 px)
    assert len(per_image) // 5 <= exact <= len(per_image) // 3
    assert any(image_id.endswith(MIRROR) for b in batches["device"] for image_id in b.image_ids)


def test_damaged_images_are_skipped_and_counted_as_by_the_loader(
        jpeg_shards: Path, vocab: Vocabulary, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A truncated JPEG (decoded, and refused, in the loader process), one whose Huffman table
    no decoder takes (refused on the device, then by the loader's decoder in the training
    process) and bytes that are no image: each skipped with its shard and key, counted once."""
    copy = tmp_path / "shards"
    shutil.copytree(jpeg_shards, copy)
    damage = {"images__train_00000_png": lambda data: data[: len(data) // 2],
              "images__train_00001_png": bogus_huffman_table,
              "images__train_00002_png": lambda data: b"not an image"}
    shard = copy / "train/shard-000000.tar"
    rewrite_shard(shard, lambda s: {**s, "jpg": damage[s["__key__"]](s["jpg"])}
                  if s["__key__"] in damage else s)
    cfg = make_config(copy, {"decode": "device", "workers": 2, "verify_shards": "none"})
    loader, steps = make_train_loader(cfg, vocab, batch_size=10)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        seen = Counter(pair for batch in loader for pair in batch_pairs(batch))
    assert seen.total() == steps * 10 == 200  # the last batches are filled from a second pass
    assert len(seen) == 200 - 3 * 5 and not {image for image, _ in seen} & set(damage)
    assert len(loader.problems) == 3
    for key in damage:
        (problem,) = [p for p in loader.problems if key in p]
        assert str(shard) in problem and "cannot decode" in problem
    # the loader processes log theirs (tests/test_data.py); the training process logs its own
    (device_problem,) = [p for p in loader.problems if "images__train_00001_png" in p]
    assert any(device_problem == record.getMessage() for record in caplog.records)


def test_a_run_trains_on_device_decoded_images(jpeg_shards: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`trainer.main` with data.decode=device: a frozen-CNN epoch (features cached from the
    device's pixels) and a finetuning epoch, mirrored views, two loader processes."""
    from trainer.main import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = small_config(jpeg_shards, tmp_path / "run", optim={"epochs": 2},
                       data={"decode": "device", "workers": 2, "hflip": True,
                             "verify_shards": "none"})
    summary = train(cfg, DistContext(0, 1, 0, CPU), resume="none")
    assert summary["best_val_rsum"] > 0
    state = load_state(latest_checkpoint(tmp_path / "run"))
    assert state.epoch == 2 and state.global_step == 20 and state.finetunes_cnn
