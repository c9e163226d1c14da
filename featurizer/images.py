"""Reading and checking one image file: the shards keep its original bytes, boxes need pixels.

A file that is missing, unreadable, truncated or not JPEG/PNG raises `BadImage` with a reason
code, so the caller can report and skip it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from featurizer.records import BAD_IMAGE, MISSING_IMAGE, UNSUPPORTED_FORMAT

# PIL format -> WebDataset extension the trainer decodes; the bytes are stored as they are.
EXTENSIONS = {"JPEG": "jpg", "PNG": "png"}


class BadImage(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class LoadedImage:
    data: bytes  # the file's bytes, not re-encoded
    extension: str  # "jpg" or "png", from the decoded format (not the file name)
    image: Image.Image  # fully decoded RGB pixels


def load_image(path: Path) -> LoadedImage:
    """Read and fully decode `path` (a truncated file fails here, not later in training)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise BadImage(MISSING_IMAGE, f"{path} does not exist") from None
    except OSError as err:
        raise BadImage(BAD_IMAGE, f"cannot read {path} ({err})") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
            if kind not in EXTENSIONS:
                raise BadImage(UNSUPPORTED_FORMAT, f"{path} is {kind}, not JPEG or PNG")
            image.load()
            pixels = image.convert("RGB")
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(BAD_IMAGE, f"{path} is not an image file PIL can identify") from None
    except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, ... on bad files
        raise BadImage(BAD_IMAGE, f"cannot decode {path} ({type(err).__name__}: {err})") from None
    return LoadedImage(data=data, extension=EXTENSIONS[kind], image=pixels)
