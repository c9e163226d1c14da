"""A training batch: B (image, caption) pairs with each distinct image once, and the variable
numbers of boxes, sentence fragments and words as flat tensors with owner indices
(docs/design.md section 4).

Images stay uint8 until `Batch.to(device)` makes them float in [0, 1] on the device: the pair
shuffle puts an image in several batches, and converting it for each on the CPU can cost more
than decoding it. An image whose frozen-CNN features are cached (trainer/data/feature_cache.py) is
not decoded at all: `Batch.decoded` says which are, and a batch of such images only has no `images`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class CaptionedImage:
    """One shard sample: the resized image (once decoded), its boxes and its encoded captions."""

    image_id: str
    image_key: int
    # uint8 [S, S, 3] as decoded: a numpy array (in a loader process), or a tensor on the model's
    # device (data.decode=device); None: not decoded (yet)
    pixels: np.ndarray | Tensor | None
    boxes: np.ndarray  # float32 [n_box, 4] xyxy in resized pixels; row 0 = the whole image
    captions: list[str]
    fragments: list[np.ndarray]  # per caption: int64 [n, 3] (relation, w1, w2) ids; n may be 0
    size: tuple[int, int]  # (width, height) of the original image, which the boxes were in
    words: list[np.ndarray]  # per caption: int64 [n] word ids in order (`Vocabulary.encode_words`)
    # per caption: int64 [n, 2] (head position among its words or -1, relation id) of each word
    # (`Vocabulary.encode_tree`); None unless the sentence encoder reads trees (SampleDecoder)
    trees: list[np.ndarray] | None = None

    def pairs(self) -> list[Pair]:
        return [Pair(self, index) for index in range(len(self.captions))]


@dataclass(frozen=True)
class Pair:
    """One (image, caption) pair: caption number `caption` of `image`."""

    image: CaptionedImage
    caption: int


@dataclass
class Batch:
    """B (image, sentence) pairs: one rank's share of a training step (or, for evaluation, a
    few images with every caption of each); the names are trainer/objectives.py's glossary.

    An image appears once even when several of the pairs share it; the boxes, sentence
    fragments and words of all pairs are flat tensors with owner indices.
    """

    images: Tensor | None  # [n_img, 3, S, S]: the distinct images, first-seen order; uint8
    #                        (0-255) from the loader, float32 in [0, 1] after `to(device)`;
    #                        None when no image is decoded (a feature-only batch)
    decoded: list[bool]  # [n_img]: False for an image not decoded (its row is zeros), whose
    #                      frozen-CNN features are cached
    boxes: Tensor  # float [N_box, 4] xyxy in resized pixels, grouped by image; row 0 = image
    box_image: Tensor  # long [N_box]: image row of each box
    sentence_image: Tensor  # long [B]: image row of each sentence (pair)
    fragments: Tensor  # long [Ns, 3]: (relation, w1, w2) of every sentence, one after another
    fragment_sentence: Tensor  # long [Ns]: sentence (pair) of each sentence fragment
    image_key: Tensor  # long [B]: stable key of each pair's image (equal for one image's pairs)
    image_ids: list[str]  # [n_img]: the dataset's name of each image row
    captions: list[str]  # [B]
    words: Tensor  # long [Nw]: every sentence's word ids in order, one sentence after another
    word_sentence: Tensor  # long [Nw]: sentence (pair) of each word
    # long [Nw]: row in `words` of each word's head in the dependency tree, -1 for a root; and
    # each word's relation id to it (`Vocabulary.encode_tree`). None unless every caption was
    # read with its tree (the tree encoders' `inputs`, shard format 2).
    word_head: Tensor | None = None
    word_relation: Tensor | None = None

    def pin_memory(self) -> Batch:
        """A copy in page-locked memory, for asynchronous host-to-GPU copies (images decoded on
        the GPU are there already)."""
        return self._map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" else t)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device`, its images float in [0, 1] there (converted after the copy:
        uint8 travels, 4x less to copy) and channels-last in memory, as decoded: the CNN's
        weights are channels-last too (trainer/model.py, ImageEncoder)."""
        moved = self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))
        if moved.images is None:
            return moved
        return dataclasses.replace(moved, images=unit_float(moved.images))

    def _map_tensors(self, fn) -> Batch:
        return dataclasses.replace(self, **{
            f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)})


def collate(pairs: Sequence[Pair]) -> Batch:
    """A Batch of `pairs`: each distinct image once, boxes, fragments and words flattened with
    owners."""
    image_row: dict[str, int] = {}
    images: list[CaptionedImage] = []
    for pair in pairs:
        if pair.image.image_id not in image_row:
            image_row[pair.image.image_id] = len(images)
            images.append(pair.image)
    fragments = [pair.image.fragments[pair.caption] for pair in pairs]
    words = [pair.image.words[pair.caption] for pair in pairs]
    word_head = word_relation = None
    if pairs and all(pair.image.trees is not None for pair in pairs):
        word_head, word_relation = tree_fields(
            [pair.image.trees[pair.caption] for pair in pairs])  # type: ignore[index]
    return Batch(
        images=stack_pixels(images),
        decoded=[image.pixels is not None for image in images],
        boxes=torch.from_numpy(np.concatenate([image.boxes for image in images])),
        box_image=owners([len(image.boxes) for image in images]),
        sentence_image=torch.tensor([image_row[pair.image.image_id] for pair in pairs]),
        fragments=torch.from_numpy(np.concatenate(fragments)),
        fragment_sentence=owners([len(f) for f in fragments]),
        image_key=torch.tensor([pair.image.image_key for pair in pairs], dtype=torch.long),
        image_ids=[image.image_id for image in images],
        captions=[pair.image.captions[pair.caption] for pair in pairs],
        words=torch.from_numpy(np.concatenate(words)),
        word_sentence=owners([len(w) for w in words]),
        word_head=word_head,
        word_relation=word_relation,
    )


def tree_fields(trees: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
    """`Batch.word_head` and `word_relation` of sentences with these `Vocabulary.encode_tree`
    rows, one sentence after another: head positions become rows of the flat `words`."""
    counts = np.array([len(tree) for tree in trees], dtype=np.int64)
    rows = np.concatenate([np.zeros((0, 2), np.int64), *trees])
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    heads = np.where(rows[:, 0] >= 0, rows[:, 0] + starts, -1)
    return torch.from_numpy(heads), torch.from_numpy(np.ascontiguousarray(rows[:, 1]))


def stack_pixels(images: Sequence[CaptionedImage]) -> Tensor | None:
    """uint8 [n, 3, S, S] of the images, stored channels-last: each image is one plain copy of
    its decoded rows (an image is collated into several batches, and moving its channels first
    here cost the training process 0.3 ms per image; the CNN runs channels-last).
    An image left undecoded (its features are cached, see trainer.data.feature_cache) is zeros;
    None when no image is decoded. Pixels decoded on the device are stacked there."""
    decoded = [image.pixels for image in images if image.pixels is not None]
    if not decoded:
        return None
    if isinstance(decoded[0], Tensor):  # data.decode=device
        zeros = torch.zeros_like(decoded[0])
        return torch.stack([zeros if image.pixels is None else image.pixels
                            for image in images]).permute(0, 3, 1, 2)
    size = len(decoded[0])
    pixels = np.empty((len(images), size, size, 3), np.uint8)
    for row, image in enumerate(images):
        pixels[row] = 0 if image.pixels is None else image.pixels
    return torch.from_numpy(pixels).permute(0, 3, 1, 2)


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


def owners(counts: list[int]) -> Tensor:
    """Owner index of each flat row, owner k holding counts[k] rows (numpy: torch's thread pool
    makes such small ops slow in a busy training process)."""
    return torch.from_numpy(np.repeat(np.arange(len(counts)), counts))


