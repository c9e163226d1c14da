"""JPEG decoding on the model's device (`data.decode=device`, docs/data-path.md "Decoding on the
device"): the loader processes hand a JPEG's bytes over, the training process decodes them.

A GPU decodes JPEGs many times faster than the cores that feed it (torchvision's batched nvJPEG
decoder: > 8,000 Flickr-sized images/s on an A100, against ~300 per core with PIL), so a loader
process that only reads the shards and parses each image's header keeps a GPU fed with a few cores.

- In a loader process, `for_device` reads the header only: a JPEG the device decoder takes
  (JPEG, RGB or grey, upright, of the size its metadata gives, within data.max_image_pixels,
  ending with its end-of-image marker) travels as `Encoded`; anything else (PNG and the other
  formats, CMYK, an EXIF-rotated or a likely truncated JPEG, a size that disagrees) is decoded
  there as with `data.decode=loader` (fallback per image), which also reports what is damaged.
- In the training process, `decode_chunk` decodes a chunk's `Encoded` images in one call of
  torchvision's batched decoder on the model's device (nvJPEG on a GPU, libjpeg-turbo on the CPU)
  and resizes each there to S x S, antialiased bilinear as PIL's resize in the loader path. An
  image the batch call fails on is decoded alone, then by the loader's decoder on the CPU; one
  that none decodes is reported and skipped, as the loader path skips it.

Each image is decoded once, when its chunk arrives, not once per batch: an image's pairs reach
about five batches (one per caption) through the shuffle buffer, which then holds its pixels on
the device (S x S x 3 bytes each, ~150 kB at 224 px).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.io
from PIL import ExifTags
from torchvision.transforms.v2 import functional as tvf

from defrag.images import decode, open_checked

_UPRIGHT = (None, 1)  # EXIF orientations that leave the stored pixels as they are
_EOI = b"\xff\xd9"  # the end-of-image marker that closes a complete JPEG


@dataclass(frozen=True)
class Encoded:
    """A JPEG handed over undecoded, and where it was read (shard and sample key), which names
    it if it does not decode."""

    data: bytes
    where: str


def for_device(data: bytes, size: tuple[int, int], max_pixels: int, where: str
               ) -> Encoded | None:
    """`data` as an Encoded JPEG if the device decoder takes it and it is `size` (width,
    height) pixels; None if the loader process should decode it (see the module doc), which
    also refuses an image over `max_pixels`. Reads the header only."""
    try:
        image = open_checked(data, where, max_pixels)
    except Exception:  # noqa: BLE001 - PIL raises many kinds; the loader's decoder names it
        return None
    takes = (image.format == "JPEG" and image.mode in ("RGB", "L") and image.size == size
             and image.getexif().get(ExifTags.Base.Orientation) in _UPRIGHT
             and data.rstrip(b"\0").endswith(_EOI))
    return Encoded(data, where) if takes else None


def decode_chunk(pixels: list[np.ndarray | Encoded | None], size: int, device: torch.device
                 ) -> tuple[list[torch.Tensor | None], dict[int, str]]:
    """A chunk's pixels on `device` as uint8 [size, size, 3] tensors: Encoded JPEGs decoded
    there (in one batched call), arrays decoded by the loader copied there, None (features
    cached) kept. Also the rows that did not decode, each with its one-line problem."""
    rows = [row for row, item in enumerate(pixels) if isinstance(item, Encoded)]
    decoded = _decode_all([pixels[row] for row in rows], size, device)
    out: list[torch.Tensor | None] = [
        torch.tensor(item, device=device) if isinstance(item, np.ndarray) else None
        for item in pixels]
    failed = {}
    for row, image in zip(rows, decoded, strict=True):
        if isinstance(image, str):
            failed[row] = image
        else:
            out[row] = image
    return out, failed


def _decode_all(images: list[Encoded], size: int, device: torch.device
                ) -> list[torch.Tensor | str]:
    """Each image as uint8 [size, size, 3] on `device`, or the line saying why it did not
    decode: one batched call, then one image at a time if the batch failed."""
    if not images:
        return []
    try:
        return [_resized(image, size) for image in _jpeg_decoder(images, device)]
    except RuntimeError:  # no partial results: find the image at fault
        if len(images) == 1:
            return [_decoded_by_loader(images[0], size, device)]
        return [result for image in images for result in _decode_all([image], size, device)]


def _jpeg_decoder(images: list[Encoded], device: torch.device) -> list[torch.Tensor]:
    """torchvision's batched JPEG decoder: RGB [3, H, W] uint8 on `device` per image."""
    data = [torch.frombuffer(bytearray(image.data), dtype=torch.uint8) for image in images]
    with warnings.catch_warnings():  # deprecated in favour of TorchCodec, pinned here
        warnings.simplefilter("ignore", DeprecationWarning)
        return torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB,
                                          device=device)


def _resized(image: torch.Tensor, size: int) -> torch.Tensor:
    """[3, H, W] -> [size, size, 3] uint8 (aspect ratio not kept, as the loader path)."""
    if image.shape[1:] != (size, size):
        image = tvf.resize(image, [size, size], antialias=True)
    return image.permute(1, 2, 0)


def _decoded_by_loader(image: Encoded, size: int, device: torch.device) -> torch.Tensor | str:
    """The loader's decoder on the CPU for a JPEG the device decoder refused (it tolerates
    more damage, as libjpeg's warnings), or the line that skips it."""
    try:
        pixels = decode(image.data, image.where, (size, size)).image
    except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, ...
        return f"{image.where}: cannot decode the image ({type(err).__name__}: {err})"
    return torch.from_numpy(np.asarray(pixels).copy()).to(device)

