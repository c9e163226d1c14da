"""What the sources hand to the shard writers: images with their captions, and problems found.

Every record and every problem carries its `Origin` (file, line, or item inside a JSON document),
so a skipped input can always be reported as `file:line: reason`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Reason codes of skipped inputs (the manifest counts them per split).
MALFORMED = "malformed"
ODD_KEY = "odd_key"
DUPLICATE_KEY = "duplicate_key"
DUPLICATE_IMAGE = "duplicate_image"
EMPTY_CAPTION = "empty_caption"
NO_WORDS = "no_words"
NO_CAPTIONS = "no_captions"
MISSING_SPLIT_FILE = "missing_split_file"
MISSING_IMAGE = "missing_image"
BAD_IMAGE = "bad_image"
UNSUPPORTED_FORMAT = "unsupported_format"
TOO_LARGE = "too_large"  # more pixels than the bound (defrag.images), refused from the header
BAD_BOXES = "bad_boxes"
NOT_UTF8 = "not_utf8"
OUTSIDE_IMAGES = "outside_images"
CAPTION_TOO_LONG = "caption_too_long"  # over --max-caption-chars: left out unparsed
UNEXPECTED_ERROR = "unexpected_error"  # any other failure on one caption or sample (its parse,
# its boxes, its reading): that input's problem, not the run's

# A path whose key can keep its words one to one: names of [A-Za-z0-9-] words joined by single
# "_", "/" between folders, one "." before an [A-Za-z0-9] extension (see `image_key`).
_PLAIN_NAME = r"[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*"
_PLAIN_PATH = re.compile(
    rf"(?P<folders_and_stem>{_PLAIN_NAME}(?:/{_PLAIN_NAME})*)\.(?P<extension>[A-Za-z0-9]+)")


@dataclass(frozen=True)
class Origin:
    """Where an input came from: a file, its 1-based line, or an item path inside a JSON file."""

    file: str
    line: int | None = None
    item: str = ""

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where} [{self.item}]" if self.item else where


@dataclass
class Problem:
    """One skipped input: where, a reason code (see the constants above) and a readable detail."""

    origin: Origin
    reason: str
    detail: str
    split: str | None = None

    def __str__(self) -> str:
        return f"{self.origin}: {self.reason}: {self.detail}"

    def to_json(self) -> dict:
        return {**asdict(self.origin), "reason": self.reason, "detail": self.detail,
                "split": self.split}

    @classmethod
    def from_json(cls, data: dict) -> Problem:
        origin = Origin(data["file"], data["line"], data["item"])
        return cls(origin, data["reason"], data["detail"], data["split"])


@dataclass
class Caption:
    text: str
    origin: Origin


@dataclass
class ImageRecord:
    """One image of a split with its captions; `boxes` are ground-truth boxes when the source has
    them (used by the "given" box source). `dropped` are the problems of the captions the source
    could not use: reported when the image is written, else named in its one `no_captions`."""

    image_id: str
    split: str
    path: Path
    file: str
    origin: Origin
    captions: list[Caption] = field(default_factory=list)
    boxes: list[list[float]] | None = None
    dropped: list[Problem] = field(default_factory=list)


def shown_text(text: str, limit: int = 60) -> str:
    """`text` quoted, cut after `limit` characters (a caption may be megabytes long)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def no_captions(record: ImageRecord, dropped: list[Problem]) -> Problem:
    """The one problem of an image left without a usable caption: the `dropped` captions' problems
    are named in its detail, not counted again."""
    why = f" ({'; '.join(p.detail for p in dropped)})" if dropped else ""
    return Problem(record.origin, NO_CAPTIONS, f"{record.file}: no usable caption{why}",
                   record.split)


def image_key(name: str) -> str:
    """The WebDataset key of an image path: only [A-Za-z0-9_-] (a dot would split the key, a
    slash make a folder inside the tar), the same for the same path and never for two paths.

    A plain path keeps its words, folders joined by "__" and the extension by "_"
    (`val2014/COCO_1.jpg` -> `val2014__COCO_1_jpg`); any other path gets its words and 8 hex
    digits of its hash (`my pics/a.jpg` -> `my_pics_a_jpg-1f0c2a9e`)."""
    plain = _PLAIN_PATH.fullmatch(name)
    if plain:
        return f"{plain['folders_and_stem'].replace('/', '__')}_{plain['extension']}"
    words = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "image"
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{words}-{digest}"
