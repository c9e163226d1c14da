"""The one image decoder of the project: image bytes -> 8-bit RGB as a person sees the image.

The featurizer (boxes), the trainer's reader (training, evaluation, captioner), the embedder
(index, retrieval, pyfunc, web app uploads) and the pictures all decode through `decode`, so the
pixels a box was computed on are the pixels the model sees. Three things are done for every image:

- its size is read from the header and an image over `max_pixels` is refused (`ImageTooLarge`)
  before a single pixel is decoded: a small compressed file can hold gigabytes of pixels. This
  bound replaces PIL's own guard (`Image.MAX_IMAGE_PIXELS`), switched off on import: with both,
  an image over PIL's 179 Mpx was a bad image (DecompressionBombError), not a too large one;
- its EXIF orientation is applied (phone photos are stored sideways), and the size it reports is
  the oriented (width, height);
- every mode PIL opens becomes correct 8-bit RGB (`to_rgb`).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

MAX_IMAGE_PIXELS = 40_000_000  # the default bound: a 40 Mpx RGB image decodes to 120 MB
Image.MAX_IMAGE_PIXELS = None  # `open_checked` bounds every image, at any --max-image-pixels
# Bump it whenever `decode` gives other pixels for the same bytes: caches of features computed
# from decoded pixels (trainer/data/feature_cache.py feature_stamp) are keyed by it. 2: EXIF
# orientation applied, 16-bit images scaled (not clipped) to 8 bits.
DECODER_VERSION = 2

# Transparent pixels are shown over white: the web app's page, browsers and most image viewers
# show them so, and a transparent PNG (a logo, a product photo) is drawn for a light page.
BACKGROUND = (255, 255, 255)

_SIXTEEN_BIT = {"I;16", "I;16B", "I;16L", "I;16N"}
_ALPHA = {"LA", "La", "PA", "RGBA", "RGBa"}
_TRANSPOSED = {5, 6, 7, 8}  # EXIF orientations that swap the stored width and height


class ImageTooLarge(ValueError):
    """An image whose header gives more pixels than the limit; nothing of it was decoded."""

    def __init__(self, name: str, size: tuple[int, int], limit: int) -> None:
        width, height = size
        super().__init__(
            f"{name} is {width} x {height} pixels ({width * height / 1e6:.3g} megapixels), over "
            f"the limit of {limit} ({limit / 1e6:g} megapixels): scale it down, or raise the "
            f"limit (max_image_pixels)")
        self.size = size
        self.limit = limit


class UnsupportedFormat(ValueError):
    """An image whose format (from its header) is not one the caller takes; nothing decoded."""

    def __init__(self, kind: str | None) -> None:
        super().__init__(f"format {kind}")
        self.kind = kind


@dataclass
class Decoded:
    """What `decode` gives: the pixels, the image's own size and its file format."""

    image: Image.Image  # RGB, oriented, at the size asked for (else the oriented original)
    size: tuple[int, int]  # the oriented original (width, height), whatever was asked for
    format: str | None  # PIL's name of the file format ("JPEG", "PNG", ...)


def add_pixel_limit_flag(parser: argparse.ArgumentParser) -> None:
    """--max-image-pixels N: the bound of every command that decodes images it is given."""
    parser.add_argument("--max-image-pixels", type=_pixel_limit, default=MAX_IMAGE_PIXELS,
                        metavar="N", help=f"larger images are refused from their header, before "
                                          f"decoding (default {MAX_IMAGE_PIXELS})")


def _pixel_limit(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive whole number of pixels, got {text!r}")
    return int(text)


def open_checked(data: bytes, name: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The image of `data` opened (PIL reads only the header), refused if over `max_pixels`;
    UnidentifiedImageError naming `name` if PIL knows no format of it."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:  # PIL's text names the stream's memory address instead
        raise UnidentifiedImageError(f"{name} is not an image file PIL can identify") from None
    if image.width * image.height > max_pixels:
        raise ImageTooLarge(name, image.size, max_pixels)
    return image


def decode(data: bytes, name: str, size: tuple[int, int] | None = None,
           max_pixels: int = MAX_IMAGE_PIXELS,
           formats: Collection[str] | None = None) -> Decoded:
    """Image bytes -> 8-bit RGB, oriented, resized to `size` (width, height) when given; a
    format (PIL's name) not in `formats`, when given, raises UnsupportedFormat before decoding.

    Fast path kept from the trainer's reader: a JPEG at least twice `size` is decoded at 1/2,
    1/4 or 1/8 scale first (PIL's `draft`, DCT-domain downscaling), and an image already RGB,
    upright and at `size` is returned as decoded, without another copy.
    """
    image = open_checked(data, name, max_pixels)
    kind = image.format
    if formats is not None and kind not in formats:
        raise UnsupportedFormat(kind)
    orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    transposed = orientation in _TRANSPOSED
    original = image.size[::-1] if transposed else image.size
    if size is not None:
        image.draft("RGB", size[::-1] if transposed else size)
    image.load()
    ImageOps.exif_transpose(image, in_place=True)  # PIL's table of the eight; no copy if upright
    rgb = to_rgb(image)
    if size is not None and rgb.size != tuple(size):
        rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    return Decoded(rgb, original, kind)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode -> 8-bit RGB: deep modes scaled to 8 bits (`_eight_bit`), transparency
    composited over BACKGROUND, the rest (1, L, P, CMYK, YCbCr, ...) by PIL's conversion."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode in _SIXTEEN_BIT or image.mode in ("I", "F"):
        image = _eight_bit(image)
    if image.mode in _ALPHA or "transparency" in image.info:
        rgba = image.convert("RGBA")
        backdrop = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(backdrop, rgba).convert("RGB")
    return image.convert("RGB")


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit, 32-bit integer or float grey image as 8-bit grey (mode L), by its value range.

    16-bit (I;16*): the top 8 bits (v >> 8), so 0..65535 maps onto 0..255.
    32-bit integer (I): PIL also opens 16-bit files as I, so values within 0..65535 are scaled
    as 16-bit; other values are stretched from the image's own minimum..maximum onto 0..255.
    Float (F): values within 0..1 are read as intensities (v * 255); other values are
    stretched from the image's own minimum..maximum. Not-a-number counts as 0.
    """
    values = np.asarray(image)
    if image.mode in _SIXTEEN_BIT:
        return Image.fromarray((values >> 8).astype(np.uint8), "L")
    values = np.nan_to_num(values.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if image.mode == "I" and low >= 0 and high <= 65535:
        scaled = values / 256
    elif image.mode == "F" and low >= 0 and high <= 1:
        scaled = np.rint(values * 255)
    else:
        scaled = np.rint((values - low) * (255 / (high - low))) if high > low else values * 0
    return Image.fromarray(np.clip(scaled, 0, 255).astype(np.uint8), "L")
