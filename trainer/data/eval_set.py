"""The eval set: every usable image of a split once, with all its captions as sentences, streamed
through the shard reader in bounded memory (trainer/data/reader.py).

It arrives as `Batch`es of a few images holding every caption of those images as sentences
(`fragment_sentence`, `sentence_image`, as in training), so an eval set of any size never holds
more decoded images than one batch and the loader's prefetch.
With several ranks, rank r reads shards r, r + world_size, ... of the split (trainer/evaluate.py
gathers their embeddings). An image_id this rank read before in the pass is a problem naming both
shards, and that image is skipped.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from defrag.urls import redact
from defrag.vocab import Vocabulary
from trainer.batch import Batch, CaptionedImage, collate
from trainer.config import Config
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
from trainer.data.shardset import Shard, SplitShards, val_split
from trainer.data.train_loader import rank_and_world_size

log = logging.getLogger(__name__)


class IncompleteSplit(ValueError):
    """An eval split with fewer (or more) usable images than its manifest promises."""


@dataclass
class EvalSet:
    """A split to evaluate on: this rank's share of its shards, read anew by each `batches`."""

    split: SplitShards
    decoder: SampleDecoder
    options: ReadOptions
    workers: int = 0  # loader processes (0: read in this process)
    rank: int = 0
    world_size: int = 1
    max_images: int | None = None  # only the first N usable images (one rank only)
    first: CaptionedImage | None = None  # the first image read (with pixels), for pictures
    problems: list[DataProblem] = field(default_factory=list)  # of the last pass
    images_read: int = 0  # usable images of the last pass

    @property
    def shards(self) -> list[Shard]:
        """This rank's share of the split's shards."""
        return self.split.shards[self.rank::self.world_size]

    @property
    def expected_images(self) -> int:
        """Images the manifest promises in this rank's shards."""
        return sum(shard.samples for shard in self.shards)

    def batches(self, images_per_batch: int = 32) -> Iterator[Batch]:
        """This rank's images, `images_per_batch` at a time with every caption of each."""
        self.problems, self.images_read = [], 0
        source = functools.partial(_chunks_of_process, self.shards, self.decoder, self.options)
        size = self.decoder.image_size
        chunks = run_in_processes(source, self.workers, CHUNK_IMAGES, (size, size, 3),
                                  PREFETCH_CHUNKS)
        images = itertools.islice(self._images(chunks), self.max_images)
        try:
            while chunk := list(itertools.islice(images, images_per_batch)):
                if self.first is None:
                    self.first = chunk[0]
                self.images_read += len(chunk)
                yield collate([pair for image in chunk for pair in image.pairs()])
        finally:
            chunks.close()  # stops the loader processes

    def _images(self, chunks) -> Iterator[CaptionedImage]:
        """The images of the pass; an image_id read before is a problem, that image skipped
        (a batch keeps one image per id: the second's captions would go to the first)."""
        shard_of: dict[str, str] = {}
        for images, pixels, (notes, url) in chunks:
            self.problems.extend(notes.problems)
            for image in with_pixels(images, pixels):
                if image.image_id not in shard_of:
                    shard_of[image.image_id] = url
                    yield image
                    continue
                self.problems.append(DataProblem("sample", (
                    f"{redact(url)}: image_id {image.image_id!r} skipped: already read from "
                    f"{redact(shard_of[image.image_id])}; give each sample its own image_id")))
                log.warning("%s", self.problems[-1].message)


def _chunks_of_process(shards: list[Shard], decoder: SampleDecoder, options: ReadOptions,
                       process: int, processes: int):
    """Loader process `process` reads shards process, process + processes, ... in order; each
    chunk's notes come with the URL of its shard."""
    for number in range(process, len(shards), processes):
        for images, pixels, notes in image_chunks(shards, [number], decoder, options):
            yield images, pixels, (notes, shards[number].url)


def load_eval_set(cfg: Config, vocab: Vocabulary, split: str | None = None,
                  max_images: int | None = None, rank: int | None = None,
                  world_size: int | None = None) -> EvalSet:
    """The eval set of `split` (default data.val_split; data.val_shards or data.shards), this
    rank's share; nothing is read until `batches`."""
    rank, world_size = rank_and_world_size(rank, world_size)
    shards = val_split(cfg.data, split)
    check_trees(cfg, shards)
    return EvalSet(shards, SampleDecoder.from_config(cfg, vocab),
                   ReadOptions.from_config(cfg.data), cfg.data.workers, rank, world_size,
                   max_images)


def check_complete(split: SplitShards, images: int, sentences: int,
                   problems: list[DataProblem], allow_incomplete: bool) -> str:
    """One line saying what was evaluated out of what the manifest promises; IncompleteSplit
    when images are missing, unless `allow_incomplete`."""
    line = (f"{images} of the {split.images} images and {sentences} of the {split.captions} "
            f"sentences of split {split.name!r} ({len(problems)} data problems)")
    if images != split.images and not allow_incomplete:
        shown = "; ".join(problem.message for problem in problems[:3])
        raise IncompleteSplit(f"evaluated {line}: {shown or 'see the warnings'}. Recall over an "
                              f"incomplete split is not comparable: fix the shards, or pass "
                              f"--allow-incomplete (eval.allow_incomplete=true) to go on")
    return line
