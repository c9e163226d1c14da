"""This rank's training batches, streamed from its own shards (docs/design.md sections 7 and 8).

Each rank, and each of its `data.workers` loader processes, reads only its own shards, once per
pass, front to back (trainer/data/reader.py); nothing is read when the loader is made, so start-up
costs the same for 1k or 100M samples. The training process receives decoded images with their
metadata (with data.decode=device, JPEGs' bytes, which it decodes on the model's device as each
chunk arrives: trainer/data/device_decode.py), expands each image into one `Pair` per caption,
shuffles the pairs in a buffer and collates `batch_size` of them into a `Batch`.

Every rank yields exactly `steps_per_epoch` batches of `batch_size` pairs per epoch, so no DDP
rank waits at an epoch's end:

- exact epochs (default, small data): each epoch the split's shards are permuted with
  (seed, epoch) and dealt to the world_size x workers loader processes, each of which reads its
  own shards once. steps_per_epoch = floor(pairs of the split / (batch_size x world_size)), from
  the manifest's counts. A pair is seen AT MOST ONCE per epoch, except on a rank whose shards hold
  fewer than steps_per_epoch x batch_size usable pairs (uneven shards, damaged ones): that rank
  fills its last batches from a second, reshuffled pass over its own shards.
- resampled (large data): each loader process draws shards with replacement, endlessly; an
  epoch is steps_per_epoch = floor(epoch_pairs / (batch_size x world_size)) batches per rank.

With the same shards, batch size and data settings, a rank's batches depend only on (seed, epoch,
rank, world_size). A run resumed mid-epoch goes on with the same batches: the loader streams the
epoch again and draws the done steps' pairs without collating them (their images are read and
decoded again, see README "Resuming").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import random
from collections.abc import Container, Iterator

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds

from defrag.urls import ShardError
from defrag.vocab import Vocabulary
from trainer.batch import Batch, CaptionedImage, Pair, collate
from trainer.config import Config
from trainer.data.device_decode import decode_chunk
from trainer.data.loader_processes import run_in_processes
from trainer.data.reader import (
    CHUNK_IMAGES,
    PREFETCH_CHUNKS,
    DataProblem,
    ReadOptions,
    SampleDecoder,
    check_trees,
    image_chunks,
    with_pixels,
)
from trainer.data.shardset import Shard, train_split

log = logging.getLogger(__name__)
MIRROR = "|mirror"  # suffix of the image id of a mirrored view (`data.hflip`)


class TrainLoader:
    """This rank's training batches: `steps_per_epoch` Batches of `batch_size` pairs per
    iteration, in the order of (seed, epoch); `set_epoch` before each epoch."""

    def __init__(self, cfg: Config, vocab: Vocabulary, batch_size: int | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 epoch: int = 0, device: torch.device | str = "cpu") -> None:
        data = cfg.data
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.batch_size = (cfg.optim.per_rank_batch(self.world_size) if batch_size is None
                           else batch_size)
        if self.batch_size < 1 or data.workers < 0 or data.shuffle_buffer < 0:
            raise ValueError(f"need batch_size >= 1 (got {self.batch_size}), data.workers >= 0 "
                             f"(got {data.workers}) and data.shuffle_buffer >= 0 "
                             f"(got {data.shuffle_buffer})")
        self.split = train_split(cfg.data)
        check_trees(cfg, self.split)
        self.decoder = SampleDecoder.from_config(cfg, vocab, on_device=data.decode == "device")
        self.device = torch.device(device)  # where data.decode=device decodes JPEGs
        self.options = ReadOptions.from_config(data)
        self.workers, self.shuffle_buffer, self.resampled = (data.workers, data.shuffle_buffer,
                                                             data.resampled)
        self.hflip = data.hflip
        self.seed = cfg.seed if data.seed is None else data.seed
        self.epoch = epoch
        self.skip_pixels: Container[str] = frozenset()
        self.problems: dict[str, DataProblem] = {}  # every problem met so far, by message
        self.verified: set[str] = set()  # shards whose sha256 this rank has checked
        processes = self.world_size * max(1, data.workers)
        if not data.resampled and len(self.split.shards) < processes:
            raise ValueError(
                f"split {data.train_split!r} has {len(self.split.shards)} shards, fewer than the "
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

    def set_epoch(self, epoch: int, skip_pixels: Container[str] = frozenset()) -> None:
        """Iterate epoch `epoch` next: its shard deal and shuffles. Images whose id is in
        `skip_pixels` (their frozen-CNN features are cached) are not decoded."""
        self.epoch = epoch
        self.skip_pixels = skip_pixels

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
                                 f"{[s.url for s in self._shards()]}: every sample was skipped "
                                 f"(see the warnings)")

    def _pass(self, seed: str) -> Iterator[Pair]:
        """The pairs of one pass of this rank's loader processes, in the order they arrive."""
        source = functools.partial(_chunks_of_process, self._shards(), seed, self.resampled,
                                   self.decoder, self.options, self.skip_pixels,
                                   frozenset(self.verified))
        size = self.decoder.image_size
        chunks = run_in_processes(source, self.workers, CHUNK_IMAGES, (size, size, 3),
                                  PREFETCH_CHUNKS)
        try:
            for images, pixels, notes in chunks:
                self.verified.update(notes.verified)
                self.problems.update((p.message, p) for p in notes.problems)
                if self.decoder.on_device:
                    images, pixels = self._decoded_on_device(images, pixels)
                for image in with_pixels(images, pixels):
                    if self.hflip and mirrored(seed, image.image_id):
                        image = mirror_view(image, size)
                    yield from image.pairs()
        finally:
            chunks.close()  # stops the loader processes

    def _decoded_on_device(self, images: list[CaptionedImage], pixels: list
                           ) -> tuple[list[CaptionedImage], list[torch.Tensor | None]]:
        """A chunk's images with their pixels on the device (trainer/data/device_decode.py),
        those that do not decode reported and left out."""
        decoded, failed = decode_chunk(pixels, self.decoder.image_size, self.device)
        for message in failed.values():
            log.warning("%s", message)
            self.problems[message] = DataProblem("sample", message)
        kept = [row for row in range(len(images)) if row not in failed]
        return [images[row] for row in kept], [decoded[row] for row in kept]

    def _shards(self) -> list[Shard]:
        """Every shard (resampled), or this rank's share of the epoch's deal (exact)."""
        if self.resampled:
            return self.split.shards
        deal = self.split.shards.copy()
        random.Random(f"{self.seed}:{self.epoch}").shuffle(deal)
        return deal[self.rank::self.world_size]


def mirrored(seed: str, image_id: str) -> bool:
    """Whether a pass (`seed`) shows the mirrored view of an image: a coin per (pass, image),
    the same in whatever order the loader processes hand their images over."""
    return hashlib.blake2b(f"{seed}:{image_id}".encode(), digest_size=1).digest()[0] < 128


def mirror_view(image: CaptionedImage, size: int) -> CaptionedImage:
    """The image flipped left to right with its boxes (pixels [size, size, 3]), under its own id
    (id + MIRROR): the frozen CNN's features of the view are cached apart from the image's."""
    boxes = image.boxes.copy()
    boxes[:, [0, 2]] = size - image.boxes[:, [2, 0]]
    pixels = image.pixels
    if isinstance(pixels, torch.Tensor):  # decoded on the device (data.decode=device)
        pixels = pixels.flip(1)
    elif pixels is not None:
        pixels = np.ascontiguousarray(pixels[:, ::-1])
    return dataclasses.replace(image, image_id=image.image_id + MIRROR, pixels=pixels,
                               boxes=boxes)


def _chunks_of_process(shards: list[Shard], seed: str, resampled: bool, decoder: SampleDecoder,
                       options: ReadOptions, skip_pixels: Container[str],
                       verified: Container[str], process: int, processes: int):
    """The chunks of loader process `process` of `processes`: its share of `shards` in a seeded
    order (exact), or shards drawn with replacement, endlessly (resampled)."""
    rng = random.Random(f"{seed}:{process}")
    if resampled:
        order = (rng.randrange(len(shards)) for _ in itertools.count())
    else:
        order = list(range(len(shards)))[process::processes]
        rng.shuffle(order)
    return image_chunks(shards, order, decoder, options, skip_pixels, verified)


def make_train_loader(cfg: Config, vocab: Vocabulary, rank: int | None = None,
                      world_size: int | None = None, epoch: int = 0,
                      batch_size: int | None = None, device: torch.device | str = "cpu"
                      ) -> tuple[TrainLoader, int]:
    """The loader of epoch `epoch` on this rank and its steps per epoch (the same on every rank).

    `batch_size` is pairs per rank (default `cfg.optim.per_rank_batch`); `rank` and
    `world_size` default to the process group's (see `rank_and_world_size`); `device` is the
    model's, where data.decode=device decodes the JPEGs.
    """
    loader = TrainLoader(cfg, vocab, batch_size, rank, world_size, epoch, device)
    return loader, loader.steps_per_epoch


def rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
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
