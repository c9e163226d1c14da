"""Training and evaluation data: the featurizer's WebDataset shards -> batches of (image, caption)
pairs (DESIGN.md sections 4 and 6; the shard format is in featurizer/__init__.py).

A shard sample is one image with all its captions. As a `CaptionedImage`, its image is decoded
once per epoch and resized to model.image_size x model.image_size (aspect ratio not kept, boxes
scaled alike), and its captions are encoded by `Vocabulary.encode` in model.fragment_mode. The
training process reads each shard's metadata once (`index_shard`: tar headers, JSON, caption
encoding); every epoch its loader processes then only seek to, read and decode the images, and
hand over their pixels in shared memory with a few integers that name the samples. It
expands each image into one `Pair` per caption, shuffles the pairs in a buffer and collates
`batch_size` of them into a `Batch`: the distinct images of the batch once, and the variable
numbers of boxes and sentence fragments as flat tensors with owner indices.
Images stay uint8 until `Batch.to(device)` makes them float in [0, 1] on the device: the pair
shuffle puts an image in several batches, and converting it for each on the CPU can cost more
than decoding it.

Training (`make_train_loader`) runs in one of two modes, and every rank yields exactly
`steps_per_epoch` batches of `batch_size` pairs per epoch, so no DDP rank waits at an epoch's end:

- exact epochs (default, small data): each epoch the split's shards are permuted with
  (seed, epoch) and dealt to the world_size x workers loader processes, each of which reads its
  own shards once. steps_per_epoch = floor(pairs of the split / (batch_size x world_size)).
  A pair is seen AT MOST ONCE per epoch, except on a rank whose shards hold fewer than
  steps_per_epoch x batch_size pairs (shards that do not divide evenly over the ranks): that
  rank fills its last batches from a second, reshuffled pass over its own shards. With equal
  shards dealt evenly, every pair is seen exactly once but for fewer than batch_size per rank
  left over at the end.
- resampled (large data): each loader process draws shards with replacement, endlessly; an
  epoch is steps_per_epoch = floor(epoch_pairs / (batch_size x world_size)) batches per rank.

With the same shards, batch size and data settings, a rank's batches depend only on (seed,
epoch, rank, world_size): a resumed run replays an epoch's batches exactly.

Evaluation (`load_eval_set`): every image of a split once, in shard order, with all its captions
as sentences.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import random
import tarfile
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds
from PIL import Image
from torch import Tensor
from webdataset.tariterators import base_plus_ext

from featurizer.shards import FORMAT_VERSION
from trainer.config import Config
from trainer.loader_processes import Chunk, run_in_processes
from trainer.vocab import FRAGMENT_MODES, Vocabulary

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"  # written by featurizer.pipeline beside the split folders
CHUNK_IMAGES = 8  # decoded images a loader process hands over at a time
PLACEHOLDER_PIXELS = np.zeros((1, 1, 3), np.uint8)  # an image left undecoded (pixels=False)
PREFETCH_CHUNKS = 4  # chunks each loader process decodes ahead (a batch of 100 pairs needs ~20)


class ShardError(RuntimeError):
    """A shard listed in the manifest is missing or cannot be read."""


class BadSample(ValueError):
    """A shard sample that cannot be used (undecodable image, broken metadata)."""


# ---------------------------------------------------------------------------------------------
# The shard set


@dataclass
class SplitShards:
    """One split of a featurized set, as its manifest lists it."""

    name: str
    urls: list[str]  # shard paths, manifest order
    images: int
    captions: int  # = (image, caption) pairs


def read_split(shards_dir: str | Path | None, split: str) -> SplitShards:
    """The shards of `split` under `shards_dir` (the featurizer's --out), checked to exist."""
    if shards_dir is None:
        raise ValueError("data.shards is not set: point it at the output folder of "
                         "`python -m featurizer ...`")
    manifest_path = Path(shards_dir) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot read {manifest_path} ({err}): data.shards must be the "
                                f"output folder of `python -m featurizer ...`") from err
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: shard format {manifest.get('format')!r}, this code "
                         f"reads format {FORMAT_VERSION}; re-run the featurizer")
    splits = manifest["splits"]
    if split not in splits:
        raise ValueError(f"split {split!r} is not in {manifest_path}, which has "
                         f"{sorted(splits)}; set data.train_split / data.val_split")
    entry = splits[split]
    urls = [str(Path(shards_dir) / shard["file"]) for shard in entry["shards"]]
    if not urls:
        raise ValueError(f"split {split!r} of {manifest_path} has no shards")
    missing = [url for url in urls if not Path(url).is_file()]
    if missing:
        raise ShardError(f"{len(missing)} of the {len(urls)} shards of split {split!r} are "
                         f"missing, e.g. {missing[:3]}: re-run the featurizer command of "
                         f"{manifest_path} (created_by) with the same --out to rewrite them")
    return SplitShards(split, urls, entry["images"], entry["captions"])


# ---------------------------------------------------------------------------------------------
# One shard sample -> a decoded image with its captions -> pairs


def decode_image(data: bytes, size: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Image bytes -> RGB uint8 [size, size, 3] (aspect ratio not kept), and the original
    (width, height). Channels move first in `collate`, which copies the pixels anyway.

    A JPEG at least twice the target size is decoded at 1/2, 1/4 or 1/8 scale first (PIL's
    `draft`: DCT-domain downscaling, much cheaper than decoding every pixel); an image already
    RGB and size x size is not copied again.
    """
    with Image.open(io.BytesIO(data)) as image:
        original = image.size
        image.draft("RGB", (size, size))
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb), original


def image_key(image_id: str) -> int:
    """A stable int64 id of an image: the same in every process and run (unlike `hash`)."""
    digest = hashlib.blake2b(image_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class CaptionedImage:
    """One shard sample: the resized image (once decoded), its boxes and its encoded captions."""

    image_id: str
    image_key: int
    pixels: np.ndarray  # uint8 [S, S, 3], as decoded
    boxes: np.ndarray  # float32 [n_box, 4] xyxy in resized pixels; row 0 = the whole image
    captions: list[str]
    fragments: list[np.ndarray]  # per caption: int64 [n, 3] (relation, w1, w2) ids; n may be 0
    size: tuple[int, int]  # (width, height) of the original image, which the boxes were in

    def pairs(self) -> list[Pair]:
        return [Pair(self, index) for index in range(len(self.captions))]


@dataclass(frozen=True)
class Pair:
    """One (image, caption) pair: caption number `caption` of `image`."""

    image: CaptionedImage
    caption: int


@dataclass
class SampleDecoder:
    """How a shard sample becomes a CaptionedImage: image size, boxes kept, fragment mode."""

    vocab: Vocabulary
    image_size: int
    max_boxes: int  # boxes kept per image, the whole image (row 0) included
    fragment_mode: str
    pixels: bool = True  # False: no image decoding (a 1x1 placeholder), for cached features

    @classmethod
    def from_config(cls, cfg: Config, vocab: Vocabulary) -> SampleDecoder:
        """model.image_size / fragment_mode / fullframe_only and data.max_boxes, checked."""
        if cfg.model.fragment_mode not in FRAGMENT_MODES:
            raise ValueError(f"model.fragment_mode {cfg.model.fragment_mode!r}: expected one of "
                             f"{FRAGMENT_MODES}")
        if cfg.model.image_size < 1 or cfg.data.max_boxes < 1:
            raise ValueError(f"model.image_size ({cfg.model.image_size}) and data.max_boxes "
                             f"({cfg.data.max_boxes}) must be >= 1")
        max_boxes = 1 if cfg.model.fullframe_only else cfg.data.max_boxes
        return cls(vocab, cfg.model.image_size, max_boxes, cfg.model.fragment_mode)

    def decode(self, sample: dict) -> CaptionedImage:
        """The CaptionedImage of one shard sample; BadSample if it cannot be used."""
        data = sample.get("jpg", sample.get("png"))
        if data is None:
            raise BadSample(f"no jpg or png entry (entries: "
                            f"{sorted(k for k in sample if not k.startswith('__'))})")
        return self.with_pixels(self.describe(sample["json"]), data)

    def describe(self, meta_json: bytes | str) -> CaptionedImage:
        """A sample's metadata as a CaptionedImage whose pixels are not decoded yet: boxes kept
        and scaled to the decoded size, captions encoded; BadSample if it cannot be used."""
        try:
            meta = json.loads(meta_json)
            width, height = int(meta["width"]), int(meta["height"])
            image_id = str(meta["image_id"])
            boxes = np.asarray(meta["boxes"][:self.max_boxes], dtype=np.float32).reshape(-1, 4)
            captions = [c["text"] for c in meta["captions"]]
            fragments = [self.vocab.encode(c, self.fragment_mode).numpy()
                         for c in meta["captions"]]
        except (KeyError, ValueError, TypeError) as err:
            raise BadSample(f"unusable metadata ({type(err).__name__}: {err})") from None
        if len(boxes) == 0:
            raise BadSample("no boxes (row 0 should be the whole image)")
        if width < 1 or height < 1:
            raise BadSample(f"metadata gives the image size {width} x {height}")
        scale = np.array([self.image_size / width, self.image_size / height] * 2, np.float32)
        return CaptionedImage(image_id, image_key(image_id), PLACEHOLDER_PIXELS,
                              np.clip(boxes * scale, 0, self.image_size), captions, fragments,
                              (width, height))

    def with_pixels(self, image: CaptionedImage, data: bytes) -> CaptionedImage:
        """`image` with its pixels decoded from `data` (see `pixels_of`)."""
        return dataclasses.replace(image, pixels=self.pixels_of(image, data))

    def pixels_of(self, image: CaptionedImage, data: bytes) -> np.ndarray:
        """The pixels of `image` decoded from `data` (the placeholder when this decoder skips
        pixels); BadSample if the bytes do not decode to an image of the size its metadata
        gives."""
        if not self.pixels:
            return PLACEHOLDER_PIXELS
        try:
            pixels, size = decode_image(data, self.image_size)
        except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, ...
            raise BadSample(f"cannot decode the image ({type(err).__name__}: {err})") from None
        if size != image.size:
            raise BadSample(f"the image is {size[0]} x {size[1]} pixels, its metadata (and "
                            f"boxes) say {image.size[0]} x {image.size[1]}")
        return pixels


def _read_shards(urls: Iterable[str]) -> Iterator[dict]:
    """The samples of each shard in turn; a shard that cannot be read raises ShardError."""
    for url in urls:
        try:
            yield from wds.tarfile_samples([{"url": url}])
        except Exception as err:  # tarfile.ReadError, OSError, ... (webdataset appends args)
            detail = err.args[0] if err.args else ""
            raise ShardError(f"cannot read shard {url} ({type(err).__name__}: {detail}): it is "
                             f"damaged or missing; re-run the featurizer command of its "
                             f"manifest with the same --out, which rewrites shards that no "
                             f"longer match their checksum") from err


def _decode(samples: Iterable[dict], decoder: SampleDecoder,
            skipped: list[str]) -> Iterator[CaptionedImage]:
    """Every usable sample decoded; an unusable one is logged, listed in `skipped`, left out."""
    for sample in samples:
        try:
            yield decoder.decode(sample)
        except BadSample as err:
            skipped.append(f"{sample['__url__']} sample {sample['__key__']!r}: {err}")
            log.warning("skipped %s (%d skipped by this process)", skipped[-1], len(skipped))


# ---------------------------------------------------------------------------------------------
# Pairs -> a batch


@dataclass
class Batch:
    """B (image, caption) pairs: one rank's share of a training step.

    An image appears once even when several of the pairs share it; the boxes and sentence
    fragments of all pairs are flat tensors with owner indices.
    """

    images: Tensor  # [n_img, 3, S, S]: the distinct images, first-seen order; uint8 (0-255)
    #                 from the loader, float32 in [0, 1] after `to(device)`
    boxes: Tensor  # float [N_box, 4] xyxy in resized pixels, grouped by image; row 0 = image
    box_image: Tensor  # long [N_box]: image row of each box
    pair_image: Tensor  # long [B]: image row of each pair
    fragments: Tensor  # long [Ns, 3]: (relation, w1, w2) of every caption, pair by pair
    fragment_pair: Tensor  # long [Ns]: pair of each sentence fragment
    image_key: Tensor  # long [B]: stable id of each pair's image (equal for one image's pairs)
    image_ids: list[str]  # [n_img]
    captions: list[str]  # [B]

    def pin_memory(self) -> Batch:
        """A copy in page-locked memory, for asynchronous host-to-GPU copies."""
        return self._map_tensors(Tensor.pin_memory)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device`, its images float in [0, 1] there (converted after the copy:
        uint8 travels, 4x less to copy, and a GPU converts for free)."""
        moved = self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))
        return dataclasses.replace(moved, images=unit_float(moved.images))

    def _map_tensors(self, fn) -> Batch:
        return dataclasses.replace(self, **{
            f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)})


def collate(pairs: Sequence[Pair]) -> Batch:
    """A Batch of `pairs`: each distinct image once, boxes and fragments flattened with owners."""
    image_row: dict[str, int] = {}
    images: list[CaptionedImage] = []
    for pair in pairs:
        if pair.image.image_id not in image_row:
            image_row[pair.image.image_id] = len(images)
            images.append(pair.image)
    fragments = [pair.image.fragments[pair.caption] for pair in pairs]
    return Batch(
        images=torch.from_numpy(np.stack([image.pixels.transpose(2, 0, 1) for image in images])),
        boxes=torch.from_numpy(np.concatenate([image.boxes for image in images])),
        box_image=_owners([len(image.boxes) for image in images]),
        pair_image=torch.tensor([image_row[pair.image.image_id] for pair in pairs]),
        fragments=torch.from_numpy(np.concatenate(fragments)),
        fragment_pair=_owners([len(f) for f in fragments]),
        image_key=torch.tensor([pair.image.image_key for pair in pairs], dtype=torch.long),
        image_ids=[image.image_id for image in images],
        captions=[pair.image.captions[pair.caption] for pair in pairs],
    )


def batches_on_device(batches: Iterable[Batch], device: torch.device,
                      prefetch: bool | None = None) -> Iterator[Batch]:
    """`batches` moved to `device`. With `prefetch` (default: on CUDA) a thread collates the
    next batch and pins its memory while the current one trains, and the copy to the GPU is
    asynchronous, as DataLoader's pin_memory thread does; on CPU the collation would only take
    a core from the step."""
    if not (device.type == "cuda" if prefetch is None else prefetch):
        for batch in batches:
            yield batch.to(device)
        return
    source = iter(batches)
    pin = device.type == "cuda"

    def next_batch() -> Batch | None:
        batch = next(source, None)
        return batch.pin_memory() if pin and batch is not None else batch

    pool = ThreadPoolExecutor(1, thread_name_prefix="defrag-prefetch")
    try:
        pending = pool.submit(next_batch)
        while (batch := pending.result()) is not None:
            pending = pool.submit(next_batch)
            yield batch.to(device, non_blocking=pin)
    finally:
        pool.shutdown(wait=True)  # the thread is out of `source` before it is closed
        if hasattr(source, "close"):  # a generator, e.g. TrainLoader.batches
            source.close()  # stops the loader processes of an epoch left early


def unit_float(images: Tensor) -> Tensor:
    """uint8 pixels (0-255) as float32 in [0, 1]; float images as they are."""
    return images.float().div_(255) if images.dtype == torch.uint8 else images


def _owners(counts: list[int]) -> Tensor:
    """Owner index of each flat row, owner k holding counts[k] rows (numpy: torch's thread pool
    makes such small ops slow in a busy training process)."""
    return torch.from_numpy(np.repeat(np.arange(len(counts)), counts))


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class IndexedSample:
    """One usable shard sample as an epoch needs it: its metadata, decoded once, and where its
    image bytes lie in the shard file."""

    key: str  # the WebDataset key
    image: CaptionedImage  # pixels not decoded (PLACEHOLDER_PIXELS)
    offset: int  # of the image bytes in the tar file
    size: int


@dataclass
class ShardIndex:
    """One shard read once, when a TrainLoader is made (tar headers and JSON entries, not the
    image bytes: ~0.25 ms per sample): every epoch's loader processes then only seek, read and
    decode the images. A rank holds the metadata of the whole split (~1 KB per image)."""

    url: str
    samples: list[IndexedSample]
    skipped: list[str]  # unusable samples, "shard sample 'key': reason"


def index_shard(url: str, decoder: SampleDecoder) -> ShardIndex:
    """The ShardIndex of one shard; ShardError when the file is missing, damaged or truncated."""
    index = ShardIndex(url, [], [])
    try:
        file_size = os.path.getsize(url)
        with tarfile.open(url) as tar:
            entries: dict[str, dict[str, tarfile.TarInfo]] = {}
            for member in tar:  # headers only: random-access mode seeks past the data
                key, extension = base_plus_ext(member.name)
                if member.isreg() and key is not None:
                    entries.setdefault(key, {})[extension] = member
                if member.offset_data + member.size > file_size:
                    raise tarfile.ReadError(f"{member.name} runs past the end of the file")
            for key, sample in entries.items():
                try:
                    index.samples.append(_indexed_sample(tar, key, sample, decoder))
                except BadSample as err:
                    index.skipped.append(f"{url} sample {key!r}: {err}")
                    log.warning("skipped %s", index.skipped[-1])
    except (tarfile.TarError, OSError) as err:
        raise ShardError(f"cannot read shard {url} ({type(err).__name__}: {err}): it is damaged "
                         f"or missing; re-run the featurizer command of its manifest with the "
                         f"same --out, which rewrites shards that no longer match their "
                         f"checksum") from err
    return index


def _indexed_sample(tar: tarfile.TarFile, key: str, entries: dict[str, tarfile.TarInfo],
                    decoder: SampleDecoder) -> IndexedSample:
    image = entries.get("jpg", entries.get("png"))
    if image is None or "json" not in entries:
        raise BadSample(f"needs a json and a jpg or png entry (entries: {sorted(entries)})")
    meta = tar.extractfile(entries["json"]).read()
    return IndexedSample(key, decoder.describe(meta), image.offset_data, image.size)


def _image_bytes(shard: ShardIndex) -> Iterator[bytes]:
    """The image bytes of each sample of an indexed shard, in order."""
    try:
        file = os.open(shard.url, os.O_RDONLY)
        try:
            for sample in shard.samples:
                data = os.pread(file, sample.size, sample.offset)
                if len(data) != sample.size:
                    raise OSError(f"sample {sample.key!r} ends past the end of the file")
                yield data
        finally:
            os.close(file)
    except OSError as err:
        raise ShardError(f"cannot read shard {shard.url} ({err}) although it was indexed at the "
                         f"epoch's start: was it rewritten or removed meanwhile?") from err


def _image_chunks(shards: list[ShardIndex], decoder: SampleDecoder, seed: str, resampled: bool,
                  process: int, processes: int) -> Iterator[Chunk]:
    """The decoded images of loader process `process` of `processes`, CHUNK_IMAGES at a time:
    its share of `shards` in a seeded order (exact), or shards drawn with replacement, endlessly
    (resampled). A row is (shard number in `shards`, sample number in it)."""
    rng = random.Random(f"{seed}:{process}")
    if resampled:
        order: Iterable[int] = (rng.randrange(len(shards)) for _ in itertools.count())
    else:
        order = list(range(len(shards)))[process::processes]
        rng.shuffle(order)
    rows: list[tuple[int, int]] = []
    pixels: list[np.ndarray] = []
    skipped: list[str] = []
    for number in order:
        shard = shards[number]
        data = (_image_bytes(shard) if decoder.pixels
                else itertools.repeat(b"", len(shard.samples)))
        for row, (sample, image_bytes) in enumerate(zip(shard.samples, data, strict=True)):
            try:
                pixels.append(decoder.pixels_of(sample.image, image_bytes))
            except BadSample as err:
                skipped.append(f"{shard.url} sample {sample.key!r}: {err}")
                log.warning("skipped %s (%d skipped by this process)", skipped[-1], len(skipped))
                continue
            rows.append((number, row))
            if len(rows) == CHUNK_IMAGES:
                yield rows, pixels, skipped
                rows, pixels, skipped = [], [], []
    yield rows, pixels, skipped


class TrainLoader:
    """This rank's training batches: `steps_per_epoch` Batches of `batch_size` pairs per
    iteration, in the order of (seed, epoch); `set_epoch` before each epoch."""

    def __init__(self, cfg: Config, vocab: Vocabulary, batch_size: int | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 epoch: int = 0, pixels: bool = True) -> None:
        data = cfg.data
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        if batch_size is None:
            batch_size = cfg.optim.batch_size // self.world_size
        self.batch_size = batch_size
        if self.batch_size < 1 or data.workers < 0 or data.shuffle_buffer < 0:
            raise ValueError(f"need batch_size >= 1 (got {self.batch_size}), data.workers >= 0 "
                             f"(got {data.workers}) and data.shuffle_buffer >= 0 "
                             f"(got {data.shuffle_buffer})")
        self.split = read_split(data.shards, data.train_split)
        self.decoder = dataclasses.replace(SampleDecoder.from_config(cfg, vocab), pixels=pixels)
        self.workers, self.shuffle_buffer, self.resampled = (data.workers, data.shuffle_buffer,
                                                             data.resampled)
        self.seed = cfg.seed if data.seed is None else data.seed
        self.epoch = epoch
        self.skipped: set[str] = set()  # every unusable sample met so far
        processes = self.world_size * max(1, data.workers)
        if not data.resampled and len(self.split.urls) < processes:
            raise ValueError(
                f"split {data.train_split!r} has {len(self.split.urls)} shards, fewer than the "
                f"{self.world_size} rank(s) x {max(1, data.workers)} data.workers = {processes} "
                f"loader processes that each need their own in exact-epoch mode: featurize with "
                f"--shard-size {max(1, self.split.images // processes)} or smaller, lower "
                f"data.workers, or set data.resampled=true")
        epoch_pairs = self.split.captions
        if data.resampled and data.epoch_pairs is not None:
            epoch_pairs = data.epoch_pairs
        self.steps_per_epoch = epoch_pairs // (self.batch_size * self.world_size)
        if self.steps_per_epoch < 1:
            raise ValueError(f"an epoch of {epoch_pairs} pairs is less than one global batch "
                             f"of {self.batch_size} x {self.world_size} ranks")
        started = time.perf_counter()
        self.indexes = {url: index_shard(url, self.decoder) for url in self.split.urls}
        for index in self.indexes.values():
            self.skipped.update(index.skipped)
        log.info("read the metadata of the %d shards of split %r in %.1f s", len(self.indexes),
                 self.split.name, time.perf_counter() - started)

    def set_epoch(self, epoch: int, pixels: bool | None = None) -> None:
        """Iterate epoch `epoch` next: its shard deal and shuffles; `pixels` as in
        make_train_loader (unchanged when None)."""
        self.epoch = epoch
        if pixels is not None:
            self.decoder = dataclasses.replace(self.decoder, pixels=pixels)

    def image_ids(self) -> set[str]:
        """The id of every usable image of the training split (from the metadata read once)."""
        return {sample.image.image_id for index in self.indexes.values()
                for sample in index.samples}

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def batches(self, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches after its first `skip` (whose pairs are drawn, not collated: a
        run resumed mid-epoch goes on in the same order)."""
        pairs = self._pairs()
        try:
            for step in range(self.steps_per_epoch):
                chosen = list(itertools.islice(pairs, self.batch_size))
                if step >= skip:
                    yield collate(chosen)
        finally:
            pairs.close()  # stops the loader processes

    def _pairs(self) -> Iterator[Pair]:
        """This rank's pairs, shuffled: pass after pass over its shards (exact; passes after the
        first only fill the epoch's last batches), or one endless pass (resampled)."""
        for pass_index in itertools.count():
            seed = f"{self.seed}:{self.epoch}:{pass_index}:{self.rank}"
            pairs = self._pass(seed)
            if self.shuffle_buffer > 0:  # per pass, so a pass ends before the next one starts
                pairs = wds.shuffle(self.shuffle_buffer, rng=random.Random(seed))(pairs)
            count = 0
            for pair in pairs:
                count += 1
                yield pair
            if count == 0:
                raise ShardError(f"rank {self.rank} got no usable pair from its shards "
                                 f"{self._shards()}: every sample was skipped (see the warnings)")

    def _pass(self, seed: str) -> Iterator[Pair]:
        """The pairs of one pass of this rank's loader processes, in the order they arrive."""
        shards = [self.indexes[url] for url in self._shards()]
        size = self.decoder.image_size if self.decoder.pixels else 1
        chunks = run_in_processes(
            functools.partial(_image_chunks, shards, self.decoder, seed, self.resampled),
            self.workers, CHUNK_IMAGES, (size, size, 3), PREFETCH_CHUNKS)
        try:
            for rows, pixels, skipped in chunks:
                self.skipped.update(skipped)
                for (number, row), image_pixels in zip(rows, pixels, strict=True):
                    image = shards[number].samples[row].image
                    yield from dataclasses.replace(image, pixels=image_pixels).pairs()
        finally:
            chunks.close()  # stops the loader processes

    def _shards(self) -> list[str]:
        """Every shard (resampled), or this rank's share of the epoch's deal (exact)."""
        if self.resampled:
            return self.split.urls
        deal = self.split.urls.copy()
        random.Random(f"{self.seed}:{self.epoch}").shuffle(deal)
        return deal[self.rank::self.world_size]


def make_train_loader(cfg: Config, vocab: Vocabulary, rank: int | None = None,
                      world_size: int | None = None, epoch: int = 0,
                      batch_size: int | None = None,
                      pixels: bool = True) -> tuple[TrainLoader, int]:
    """The loader of epoch `epoch` on this rank and its steps per epoch (the same on every rank).

    `batch_size` is pairs per rank (default optim.batch_size // world_size); `rank` and
    `world_size` default to the process group's (see `_rank_and_world_size`). `pixels=False`
    skips image decoding (batches carry 1x1 placeholders) when every box's features are cached.
    """
    loader = TrainLoader(cfg, vocab, batch_size, rank, world_size, epoch, pixels)
    return loader, loader.steps_per_epoch


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Given values, else torch.distributed's initialised process group, else torchrun's RANK
    and WORLD_SIZE environment variables, else a single process."""
    if dist.is_available() and dist.is_initialized():
        found = dist.get_rank(), dist.get_world_size()
    else:
        found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rank = found[0] if rank is None else rank
    world_size = found[1] if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    return rank, world_size


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class ImageChunk:
    """Consecutive rows of an EvalSet's images, as the image encoder takes them."""

    first: int  # EvalSet row of images[0]: a box's image row is first + box_image
    images: Tensor  # float [n, 3, S, S] in [0, 1]
    boxes: Tensor  # float [n_box, 4]
    box_image: Tensor  # long [n_box], 0..n-1


@dataclass
class EvalSet:
    """Every image of a split once, with all its captions as sentences (retrieval evaluation).

    Image fragments are owned by image rows (`box_image`), sentence fragments by sentence rows
    (`fragment_sentence`), as trainer.evaluate.score_matrix takes them; `sentence_image` is
    retrieval_metrics' ground truth. Sentences are grouped by image, in caption order.
    """

    pixels: Tensor  # uint8 [N_img, 3, S, S] (4x smaller than floats); see image_batches
    boxes: Tensor  # float [N_box, 4] xyxy in resized pixels, grouped by image row
    box_image: Tensor  # long [N_box]
    fragments: Tensor  # long [Ns, 3]
    fragment_sentence: Tensor  # long [Ns]
    sentence_image: Tensor  # long [N_sent]
    image_ids: list[str]  # [N_img]
    captions: list[str]  # [N_sent]
    skipped: list[str]  # unusable samples left out

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_sentences(self) -> int:
        return len(self.captions)

    def image_batches(self, size: int,
                      device: torch.device | str = "cpu") -> Iterator[ImageChunk]:
        """The images `size` at a time, float on `device`, with their boxes: bounded memory."""
        box_start = [0, *torch.bincount(self.box_image, minlength=self.num_images)
                     .cumsum(0).tolist()]
        for first in range(0, self.num_images, size):
            last = min(first + size, self.num_images)
            rows = slice(box_start[first], box_start[last])
            yield ImageChunk(first, unit_float(self.pixels[first:last].to(device)),
                             self.boxes[rows].to(device), (self.box_image[rows] - first).to(device))


def load_eval_set(cfg: Config, vocab: Vocabulary, split: str | None = None,
                  max_images: int | None = None) -> EvalSet:
    """The eval set of `split` (default data.val_split) of data.shards, read in shard order in
    this process: the first `max_images` usable images (default all)."""
    split_shards = read_split(cfg.data.shards, cfg.data.val_split if split is None else split)
    return eval_set_from_shards(split_shards.urls, cfg, vocab, split_shards.name, max_images)


def read_images(urls: list[str], cfg: Config, vocab: Vocabulary,
                skipped: list[str]) -> Iterator[CaptionedImage]:
    """The usable images of `urls` in shard order, decoded in this process (unusable ones are
    listed in `skipped`)."""
    return _decode(_read_shards(urls), SampleDecoder.from_config(cfg, vocab), skipped)


def eval_set_from_shards(urls: list[str], cfg: Config, vocab: Vocabulary, name: str,
                         max_images: int | None = None) -> EvalSet:
    """An EvalSet from explicit shard files, e.g. a new dataset featurized with a model's tables."""
    skipped: list[str] = []
    images = list(itertools.islice(read_images(urls, cfg, vocab, skipped), max_images))
    if not images:
        raise ValueError(f"{name}: no usable image in {len(urls)} shard(s) (skipped: {skipped})")
    pairs = [pair for image in images for pair in image.pairs()]
    batch = collate(pairs)
    return EvalSet(pixels=batch.images, boxes=batch.boxes, box_image=batch.box_image,
                   fragments=batch.fragments, fragment_sentence=batch.fragment_pair,
                   sentence_image=batch.pair_image, image_ids=batch.image_ids,
                   captions=batch.captions, skipped=skipped)
