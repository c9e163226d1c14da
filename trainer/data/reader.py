"""The one shard reader: training, evaluation and the frozen-CNN feature pass all read through it.

A shard is streamed once, front to back, through webdataset's tar iterator (`open_url` opens it):
its samples become `CaptionedImage`s (JSON parsed, captions encoded, image decoded and resized)
in the process that reads it, normally a loader process (trainer/data/loader_processes.py), which
hands them over `CHUNK_IMAGES` at a time.

Nothing is lost silently (the shard format is in featurizer/__init__.py):
- a sample that cannot be used (image that does not decode, broken JSON) is skipped, named by
  shard and key, and reported as a `DataProblem`;
- after each shard, the samples read are compared with its manifest count: a bad tar header (which
  tarfile takes for the end of the archive) or a truncated shard is reported with the samples lost;
- a local shard is checked against its manifest sha256 before its first use (`data.verify_shards`);
  a shard that differs is skipped whole and reported;
- a remote read that fails (refused, 404, stalled for `data.io_timeout` s, dropped mid-shard) is
  retried `data.io_retries` times from the start of the shard, skipping the samples already
  delivered, then fails with the URL and the error (ShardError).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import tarfile
import time
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from webdataset.tariterators import group_by_keys, tar_file_iterator

from defrag.files import sha256_stream
from defrag.images import MAX_IMAGE_PIXELS, ImageTooLarge, decode
from defrag.shard_format import IMAGE_ENTRIES, image_entry
from defrag.urls import ShardError, describe_error, open_url, redact
from defrag.vocab import Vocabulary
from trainer.batch import CaptionedImage
from trainer.config import Config, DataConfig
from trainer.data.device_decode import Encoded, for_device
from trainer.data.shardset import Shard, SplitShards, damaged_shard
from trainer.encoders import encoder_class

log = logging.getLogger(__name__)

CHUNK_IMAGES = 8  # decoded images a loader process hands over at a time
PREFETCH_CHUNKS = 4  # chunks a loader process decodes ahead (a batch of 100 pairs needs ~20)


class BadSample(ValueError):
    """A shard sample that cannot be used (undecodable image, broken metadata)."""


@dataclass(frozen=True)
class DataProblem:
    """Data that could not be used: one sample skipped, or the samples a damaged shard lost."""

    kind: str  # "sample" | "shard"
    message: str  # names the shard URL (and the sample's key)
    lost: int = 1  # samples lost


@dataclass
class Notes:
    """What a reader tells the training process beside the images: problems met, shards whose
    checksum it verified (not verified again in later passes)."""

    problems: list[DataProblem] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)

    def report(self, problem: DataProblem) -> None:
        self.problems.append(problem)
        log.warning("%s", problem.message)

    def take(self) -> Notes:
        """The notes gathered so far; this object goes on empty (a reader reporting into it
        keeps the same object across chunks)."""
        taken = Notes(self.problems, self.verified)
        self.problems, self.verified = [], []
        return taken


@dataclass(frozen=True)
class ReadOptions:
    """How shards are opened and checked (data.io_timeout, data.io_retries, data.verify_shards)."""

    timeout: float = 60.0
    retries: int = 3
    verify: str = "local"  # local: check local shards' sha256 | all | none

    @classmethod
    def from_config(cls, data: DataConfig) -> ReadOptions:
        """data.io_timeout, data.io_retries and data.verify_shards (checked by Config)."""
        return cls(data.io_timeout, data.io_retries, data.verify_shards)

    def verifies(self, shard: Shard) -> bool:
        return shard.sha256 is not None and (
            self.verify == "all" or (self.verify == "local" and shard.local))


# ---------------------------------------------------------------------------------------------
# One sample -> a CaptionedImage


def decode_image(data: bytes, size: int, max_pixels: int = MAX_IMAGE_PIXELS
                 ) -> tuple[np.ndarray, tuple[int, int]]:
    """Image bytes -> RGB uint8 [size, size, 3] (aspect ratio not kept), and the original
    (width, height), both oriented, by `defrag.images.decode` (the featurizer's decoder: JPEG
    `draft` downscaling, no copy of an RGB image at size). Channels move first in `collate`,
    which copies the pixels anyway. ImageTooLarge over `max_pixels`, before decoding."""
    decoded = decode(data, "the image", (size, size), max_pixels)
    return np.asarray(decoded.image), decoded.size


def image_key(image_id: str) -> int:
    """A stable int64 id of an image: the same in every process and run (unlike `hash`)."""
    digest = hashlib.blake2b(image_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class SampleDecoder:
    """How a shard sample becomes a CaptionedImage: image size, boxes kept, fragment mode, and
    whether the captions' dependency trees are read (`trees`: for an encoder whose `inputs`
    include `word_head`; a caption then needs its "tree", shard format 2)."""

    vocab: Vocabulary
    image_size: int
    max_boxes: int  # boxes kept per image, the whole image (row 0) included
    fragment_mode: str
    trees: bool = False
    max_pixels: int = MAX_IMAGE_PIXELS  # larger images are skipped (data.max_image_pixels)
    # JPEGs the model's device decodes are handed over undecoded (trainer/data/device_decode.py)
    on_device: bool = False

    @classmethod
    def from_config(cls, cfg: Config, vocab: Vocabulary, on_device: bool = False
                    ) -> SampleDecoder:
        """model.image_size / fragment_mode / fullframe_only / sentence_encoder and
        data.max_boxes / max_image_pixels; `on_device` for the training loader with
        data.decode=device."""
        max_boxes = 1 if cfg.model.fullframe_only else cfg.data.max_boxes
        return cls(vocab, cfg.model.image_size, max_boxes, cfg.model.fragment_mode,
                   reads_trees(cfg), cfg.data.max_image_pixels, on_device)

    def decode(self, sample: dict, pixels: bool = True) -> CaptionedImage:
        """The CaptionedImage of one shard sample (its pixels left undecoded unless `pixels`);
        BadSample if it cannot be used."""
        entry = image_entry(sample)
        if entry is None or "json" not in sample:
            raise BadSample(f"needs a json and a {'/'.join(IMAGE_ENTRIES)} entry (entries: "
                            f"{sorted(k for k in sample if not k.startswith('__'))})")
        image = self.describe(sample["json"])
        return (dataclasses.replace(image, pixels=self.pixels_of(image, sample[entry])) if pixels
                else image)

    def describe(self, meta_json: bytes | str) -> CaptionedImage:
        """A sample's metadata as a CaptionedImage whose pixels are not decoded yet: boxes kept
        and scaled to the decoded size, captions encoded (fragments and words in order);
        BadSample if it cannot be used."""
        try:
            meta = json.loads(meta_json)
            width, height = int(meta["width"]), int(meta["height"])
            image_id = str(meta["image_id"])
            boxes = np.asarray(meta["boxes"][:self.max_boxes], dtype=np.float32).reshape(-1, 4)
            captions = [c["text"] for c in meta["captions"]]
            fragments = [self.vocab.encode_array(c, self.fragment_mode)
                         for c in meta["captions"]]
            words = [self.vocab.encode_words(c) for c in meta["captions"]]
            trees = ([self.vocab.encode_tree(c) for c in meta["captions"]] if self.trees
                     else None)
        except (KeyError, ValueError, TypeError) as err:
            raise BadSample(f"unusable metadata ({type(err).__name__}: {err})") from None
        if len(boxes) == 0:
            raise BadSample("no boxes (row 0 should be the whole image)")
        if width < 1 or height < 1:
            raise BadSample(f"metadata gives the image size {width} x {height}")
        scale = np.array([self.image_size / width, self.image_size / height] * 2, np.float32)
        return CaptionedImage(image_id, image_key(image_id), None,
                              np.clip(boxes * scale, 0, self.image_size), captions, fragments,
                              (width, height), words, trees)

    def pixels_of(self, image: CaptionedImage, data: bytes, where: str = "the image"
                  ) -> np.ndarray | Encoded:
        """The pixels of `image` decoded from `data` (read at `where`), or with `on_device` the
        JPEG bytes the device decodes; BadSample if the bytes do not decode to an image of the
        size its metadata gives."""
        if self.on_device and (encoded := for_device(data, image.size, self.max_pixels,
                                                       where)) is not None:
            return encoded
        try:
            pixels, size = decode_image(data, self.image_size, self.max_pixels)
        except ImageTooLarge as err:
            raise BadSample(str(err)) from None
        except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, ...
            raise BadSample(f"cannot decode the image ({type(err).__name__}: {err})") from None
        if size != image.size:
            raise BadSample(f"the image is {size[0]} x {size[1]} pixels, its metadata (and "
                            f"boxes) say {image.size[0]} x {image.size[1]}")
        return pixels


def reads_trees(cfg: Config) -> bool:
    """Whether the sentence encoder of `cfg` reads the captions' dependency trees."""
    return "word_head" in encoder_class(cfg.model.sentence_encoder).inputs


def check_trees(cfg: Config, split: SplitShards) -> None:
    """A one-line ShardError if the sentence encoder reads trees and `split`'s shards have none
    (format 1); nothing for the other encoders."""
    if reads_trees(cfg):
        split.require_trees(f"the {cfg.model.sentence_encoder} sentence encoder")


# ---------------------------------------------------------------------------------------------
# One shard -> its samples


def shard_samples(shard: Shard, options: ReadOptions, notes: Notes,
                  verified: Container[str] = ()) -> Iterator[dict]:
    """The samples of `shard` in one sequential read, checked as the module doc says."""
    if options.verifies(shard) and shard.url not in verified:
        try:
            digest = _sha256(shard, options)
        except (OSError, ValueError) as err:
            digest = f"unreadable ({describe_error(err)})"
        if digest != shard.sha256:
            notes.report(DataProblem("shard", damaged_shard(
                shard.url, f"its sha256 is {digest}, the manifest says {shard.sha256}; "
                           f"skipped, {shard.samples} samples lost"), shard.samples))
            return
        notes.verified.append(shard.url)
    seen, attempts = 0, 1 if shard.local else options.retries + 1
    for attempt in range(1, attempts + 1):
        stream = None
        try:
            stream = open_url(shard.url, options.timeout)
            for number, sample in enumerate(_tar_samples(stream, shard.url)):
                if number == seen:  # after a retry, the samples already delivered are skipped
                    seen += 1
                    yield sample
            stream.close()  # a pipe's command (curl, aws) that failed raises here
            break
        except (OSError, ValueError, tarfile.TarError) as err:
            error = (_close_error(stream) if stream is not None else None) or describe_error(err)
            if shard.local:
                lost = max(0, shard.samples - seen)
                notes.report(DataProblem("shard", damaged_shard(
                    shard.url, f"unreadable after {seen} samples ({error}): {lost} lost"), lost))
                return
            if attempt == attempts:
                raise ShardError(f"cannot read shard {redact(shard.url)} after {attempts} attempts "
                                 f"({error}); {seen} of its {shard.samples} samples were read: "
                                 f"check that the server or bucket serves it (data.io_timeout, "
                                 f"data.io_retries)") from err
            log.warning("shard %s: %s after %d samples; attempt %d of %d", redact(shard.url),
                        error, seen, attempt + 1, attempts)
            time.sleep(min(2.0 ** (attempt - 1), 10.0))
        except GeneratorExit:
            if stream is not None:
                _close_error(stream)
            raise
    if seen != shard.samples:
        lost = max(0, shard.samples - seen)
        notes.report(DataProblem("shard", damaged_shard(
            shard.url, f"{seen} samples read, its manifest says {shard.samples}: {lost} lost "
                       f"(a bad tar header or a truncated file ends a tar stream early)"),
            lost))


def _tar_samples(stream, url: str) -> Iterator[dict]:
    """webdataset's tar iterator and key grouping over one open stream."""
    files = ({**member, "__url__": url} for member in tar_file_iterator(stream))
    return group_by_keys(files)


def _close_error(stream) -> str | None:
    """Close a stream read in part; the error its command exited with, if any."""
    try:
        stream.close()
    except Exception as err:  # noqa: BLE001 - the command's failure, reported by the caller
        process = getattr(stream, "proc", None)  # a webdataset Pipe whose command hangs
        if process is not None:
            process.kill()
        return describe_error(err)
    return None


def _sha256(shard: Shard, options: ReadOptions) -> str:
    with open_url(shard.url, options.timeout) as stream:
        return sha256_stream(stream)


# ---------------------------------------------------------------------------------------------
# Shards -> decoded images, a chunk at a time (what a loader process runs)


Chunk = tuple[list[CaptionedImage], list[np.ndarray | Encoded | None], Notes]


def image_chunks(shards: list[Shard], order: Iterable[int], decoder: SampleDecoder,
                 options: ReadOptions, skip_pixels: Container[str] = (),
                 verified: Container[str] = ()) -> Iterator[Chunk]:
    """The usable images of shards[i] for i in `order`, up to CHUNK_IMAGES at a time: each
    image's metadata (pixels None) and its pixels (None for an id in `skip_pixels`,
    whose features are cached; Encoded for a JPEG the device decodes), with the notes gathered
    since the previous chunk. A chunk's samples are read and described first, then decoded one
    after another (the decoder stays warm in the CPU's caches: ~3% faster than alternating)."""
    notes, described = Notes(), []
    for number in order:
        shard = shards[number]
        for sample in shard_samples(shard, options, notes, verified):
            try:
                described.append((decoder.decode(sample, pixels=False), sample, shard.url))
            except BadSample as err:
                notes.report(_skipped(shard.url, sample, err))
            if len(described) == CHUNK_IMAGES:
                yield _decoded(described, decoder, skip_pixels, notes)
                described = []
    yield _decoded(described, decoder, skip_pixels, notes)


def _decoded(described: list[tuple[CaptionedImage, dict, str]], decoder: SampleDecoder,
             skip_pixels: Container[str], notes: Notes) -> Chunk:
    """A chunk of described samples with their pixels decoded (unusable ones reported)."""
    images, pixels = [], []
    for image, sample, url in described:
        if image.image_id in skip_pixels:
            pixels.append(None)
        else:
            try:
                pixels.append(decoder.pixels_of(image, sample[image_entry(sample)],
                                                _where(url, sample)))
            except BadSample as err:
                notes.report(_skipped(url, sample, err))
                continue
        images.append(image)
    return images, pixels, notes.take()


def _skipped(url: str, sample: dict, err: BadSample) -> DataProblem:
    return DataProblem("sample", f"{_where(url, sample)}: {err}")


def _where(url: str, sample: dict) -> str:
    """The shard (password and signed-URL tokens redacted) and key of a sample."""
    return f"{redact(url)} sample {sample['__key__']!r}"


def read_images(shards: list[Shard], decoder: SampleDecoder,
                options: ReadOptions | None = None) -> Iterator[CaptionedImage]:
    """The usable images of `shards` in order, read and decoded in this process."""
    for images, pixels, _ in image_chunks(shards, range(len(shards)), decoder,
                                          options or ReadOptions()):
        yield from with_pixels(images, pixels)


def with_pixels(images: list[CaptionedImage],
                pixels: list[np.ndarray | torch.Tensor | None]) -> list[CaptionedImage]:
    """A chunk's images with their pixels in place (None: not decoded)."""
    return [image if rows is None else dataclasses.replace(image, pixels=rows)
            for image, rows in zip(images, pixels, strict=True)]
