"""Reading and checking one image file: the shards keep its original bytes, boxes need pixels.

A file that is missing, unreadable, truncated, not JPEG/PNG/WebP or over the pixel bound raises
`BadImage` with a reason code, so the caller can report and skip it. The pixels come from
`defrag.images.decode`, the trainer's decoder too: oriented 8-bit RGB, so boxes and the pixels
the trainer decodes from the same bytes agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from defrag.images import MAX_IMAGE_PIXELS, ImageTooLarge, UnsupportedFormat, decode
from featurizer.records import BAD_IMAGE, MISSING_IMAGE, TOO_LARGE, UNSUPPORTED_FORMAT

# PIL format -> WebDataset extension the trainer decodes; the bytes are stored as they are.
EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


class BadImage(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class LoadedImage:
    data: bytes  # the file's bytes, not re-encoded
    extension: str  # "jpg", "png" or "webp", from the decoded format (not the file name)
    image: Image.Image  # fully decoded 8-bit RGB pixels, EXIF orientation applied


def load_image(path: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> LoadedImage:
    """Read and fully decode `path` (a truncated file fails here, not later in training); an
    image over `max_pixels` is refused from its header."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise BadImage(MISSING_IMAGE, f"{path} does not exist") from None
    except OSError as err:
        raise BadImage(BAD_IMAGE, f"cannot read {path} ({err})") from None
    return decode_image(data, str(path), max_pixels)


def decode_image(data: bytes, name: str, max_pixels: int = MAX_IMAGE_PIXELS) -> LoadedImage:
    """`load_image` of bytes already read (a shard sample's), named `name` in problems."""
    try:
        decoded = decode(data, name, max_pixels=max_pixels, formats=EXTENSIONS)
    except UnsupportedFormat as err:
        raise BadImage(UNSUPPORTED_FORMAT, f"{name} is {err.kind}, not JPEG, PNG or WebP"
                       ) from None
    except ImageTooLarge as err:
        raise BadImage(TOO_LARGE, str(err)) from None
    except UnidentifiedImageError:
        raise BadImage(BAD_IMAGE, f"{name} is not an image file PIL can identify") from None
    except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, ... on bad files
        raise BadImage(BAD_IMAGE, f"cannot decode {name} ({type(err).__name__}: {err})") from None
    return LoadedImage(data=data, extension=EXTENSIONS[decoded.format], image=decoded.image)
