"""Readers of captioned image datasets: each returns the images it found and the inputs it skipped.

- `read_flickr`: the original Flickr8k / Flickr30k text releases — a token file of
  `<image>.jpg#<n><TAB><caption>` lines, one list of image names per split, an image folder.
- `read_karpathy`: Karpathy-split JSON (`dataset_flickr8k.json`, `dataset_flickr30k.json`,
  `dataset_coco.json`): `{"images": [{"filepath"?, "filename", "split", "sentences": [{"raw"}]}]}`.
- `read_jsonl`: one `{"image": path, "captions": [...], "split": ..., "boxes"?: [[x1,y1,x2,y2]]}`
  per line; relative image paths are relative to the images folder, which holds every image.

An image path leading outside the image folder (absolute, `..`, a symbolic link out) is an
`outside_images` problem unless the reader is given `allow_outside=True`. An image's key comes
from its normalised path (`records.image_key`), so `a.jpg` and `./a.jpg` are one image and
`a.jpg` and `a.png` two.

Every file is UTF-8, a leading byte-order mark ignored. Bad entries (odd or duplicate keys,
malformed lines, lines that are not UTF-8) become `Problem`s with their file and line, one per
skipped input; a caption the source cannot use goes with its image (`ImageRecord.dropped`), so an
image left without captions is one `no_captions` problem. A JSON document is decoded with its bad
bytes kept aside; they, and JSON escapes of half a surrogate pair (`"\\udce9"`: valid JSON, not
writable as UTF-8), make the caption, sentence or entry that holds them `not_utf8`, named by line
or item path. Only a missing token/JSON file or an explicitly requested split that does not exist
is an error. Image files are opened later, by the shard writers.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from featurizer.records import (
    BAD_BOXES,
    DUPLICATE_IMAGE,
    DUPLICATE_KEY,
    EMPTY_CAPTION,
    MALFORMED,
    MISSING_SPLIT_FILE,
    NOT_UTF8,
    ODD_KEY,
    OUTSIDE_IMAGES,
    Caption,
    ImageRecord,
    Origin,
    Problem,
    image_key,
    no_captions,
)

# Flickr8k release names, relative to its root; Flickr30k's release uses the same token format.
FLICKR8K_TOKEN_FILE = "Flickr8k_text/Flickr8k.token.txt"
FLICKR8K_IMAGES = "Flicker8k_Dataset"
FLICKR8K_SPLIT_FILES = {
    "train": "Flickr8k_text/Flickr_8k.trainImages.txt",
    "dev": "Flickr8k_text/Flickr_8k.devImages.txt",
    "test": "Flickr8k_text/Flickr_8k.testImages.txt",
}
_TOKEN_KEY = re.compile(r"^(?P<name>[^#\t]+\.(?:jpe?g|png))#(?P<index>\d+)$", re.IGNORECASE)
# A lone surrogate: a byte that was not UTF-8 (decoded "surrogateescape", U+DC80..U+DCFF) or a
# JSON escape of half a surrogate pair; neither can be written as UTF-8.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_RESAVE = ("the file must be UTF-8, without \\uXXXX escapes of half a surrogate pair: fix it "
           "there, or convert a file that is all Latin-1 with iconv -f latin1 -t utf-8")


@dataclass
class Source:
    """What a reader found: images (any order) and skipped inputs (in file order)."""

    records: list[ImageRecord] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def add(self, record: ImageRecord, seen: dict[str, Origin]) -> None:
        """Keep `record` unless an earlier record has the same image id (then report it)."""
        if record.image_id in seen:
            self.problems.append(Problem(
                record.origin, DUPLICATE_IMAGE,
                f"image {record.file} (id {record.image_id}) already listed at "
                f"{seen[record.image_id]}", record.split))
            return
        seen[record.image_id] = record.origin
        self.records.append(record)


def _text_lines(path: Path, source: Source,
                split: str | None = None) -> Iterator[tuple[Origin, str]]:
    """The non-blank lines of a UTF-8 text file with their origins (a leading byte-order mark
    ignored); a line that is not UTF-8 is reported and left out, the others are read on."""
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, start=1):
            origin = Origin(str(path), number)
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                source.problems.append(Problem(
                    origin, NOT_UTF8, f"byte 0x{raw[err.start]:02x} (offset {err.start} in the "
                                      f"line) is not UTF-8; line skipped ({_RESAVE})", split))
                continue
            if line.strip():
                yield origin, line


def _located(images_dir: Path, name: str, origin: Origin, split: str | None,
             allow_outside: bool) -> tuple[Path, str] | Problem:
    """The path of image `name` (relative to `images_dir`, or absolute) and its key, or the
    problem of a path that leads outside `images_dir` when that is not allowed."""
    path = images_dir / name
    root, target = images_dir.resolve(), path.resolve()
    if not (allow_outside or target.is_relative_to(root)):
        return Problem(origin, OUTSIDE_IMAGES,
                       f"image {name!r} is {target}, outside the image folder {root}; skipped "
                       f"(move it into the folder, or pass --allow-outside-images)", split)
    folder = Path(os.path.normpath(images_dir.absolute()))
    normalised = Path(os.path.normpath(folder / name))
    inside = normalised.is_relative_to(folder)
    return path, image_key((normalised.relative_to(folder) if inside else normalised).as_posix())


def read_flickr(token_file: Path, images_dir: Path, split_files: dict[str, Path],
                splits: Iterable[str] | None = None, allow_outside: bool = False) -> Source:
    """Read a Flickr8k/30k-style release. `splits` (default: every split whose list exists)
    selects split lists; a requested split whose list file is missing is an error."""
    requested = list(splits) if splits is not None else None
    unknown = sorted(set(requested or ()) - set(split_files))
    if unknown:
        raise ValueError(f"split(s) {unknown} have no split list: known {sorted(split_files)} "
                         f"(add one with --split-file NAME=FILE)")
    source = Source()
    members: dict[str, tuple[str, Origin]] = {}  # image name -> (split, where it is listed)
    for split, path in split_files.items():
        if requested is not None and split not in requested:
            continue
        if not path.is_file():
            if requested is not None:
                raise FileNotFoundError(f"split {split!r}: split list {path} does not exist (give "
                                        f"its path with --split-file {split}=FILE or leave "
                                        f"{split!r} out of --splits)")
            source.problems.append(Problem(Origin(str(path)), MISSING_SPLIT_FILE,
                                           "split list not found; split left out", split))
            continue
        _read_split_list(path, split, members, source)
    if not members:
        raise ValueError(f"no images: none of the split lists {list(split_files.values())} "
                         f"exists or lists an image")
    captions, dropped = _read_token_file(token_file, members, source)
    seen: dict[str, Origin] = {}
    for name, (split, origin) in members.items():
        located = _located(images_dir, name, origin, split, allow_outside)
        if isinstance(located, Problem):
            source.problems.append(located)
            continue
        indexed = sorted(captions.get(name, {}).items())
        _add_with_captions(source, seen, ImageRecord(
            image_id=located[1], split=split, path=located[0], file=name, origin=origin,
            captions=[caption for _, caption in indexed], dropped=dropped.get(name, [])))
    return source


def _read_split_list(path: Path, split: str, members: dict[str, tuple[str, Origin]],
                     source: Source) -> None:
    for origin, line in _text_lines(path, source, split):
        name = line.strip()
        if name in members:
            other_split, other = members[name]
            source.problems.append(Problem(origin, DUPLICATE_IMAGE,
                                           f"{name} already listed in split {other_split!r} at "
                                           f"{other}", split))
            continue
        members[name] = (split, origin)


def _read_token_file(
        path: Path, members: dict[str, tuple[str, Origin]], source: Source,
) -> tuple[dict[str, dict[int, Caption]], dict[str, list[Problem]]]:
    """Captions of the listed images by image name and caption number, and their empty ones."""
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist (set it with --token-file)")
    captions: dict[str, dict[int, Caption]] = {}
    dropped: dict[str, list[Problem]] = {}
    seen_keys: dict[str, int | None] = {}
    for origin, line in _text_lines(path, source):
        key, tab, text = line.partition("\t")
        if not tab:
            source.problems.append(Problem(origin, MALFORMED, "no TAB between key and caption"))
            continue
        key = key.strip()
        match = _TOKEN_KEY.match(key)
        if match is None:
            source.problems.append(Problem(origin, ODD_KEY, f"key {key!r} is not "
                                                            f"<image>.jpg#<number>"))
            continue
        name = match["name"]
        split = members[name][0] if name in members else None
        if key in seen_keys:
            source.problems.append(Problem(origin, DUPLICATE_KEY, f"key {key!r} already at line "
                                                                  f"{seen_keys[key]}", split))
            continue
        seen_keys[key] = origin.line
        if split is None:
            continue
        if not text.strip():
            dropped.setdefault(name, []).append(Problem(origin, EMPTY_CAPTION,
                                                        f"{key}: empty caption", split))
            continue
        captions.setdefault(name, {})[int(match["index"])] = Caption(text.strip(), origin)
    return captions, dropped


def read_karpathy(json_file: Path, images_dir: Path, allow_outside: bool = False) -> Source:
    """Read a Karpathy-split JSON file; image paths are `images_dir/filepath/filename`."""
    try:
        data = json.loads(Path(json_file).read_bytes().decode("utf-8-sig", "surrogateescape"))
    except (OSError, json.JSONDecodeError, RecursionError) as err:  # too deep a nesting
        raise ValueError(f"{json_file}: cannot read the Karpathy-split JSON ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{json_file}: not a Karpathy-split file (no top-level 'images' list)")
    source = Source()
    seen: dict[str, Origin] = {}
    for i, image in enumerate(data["images"]):
        origin = Origin(str(json_file), item=f"images[{i}]")
        if not (isinstance(image, dict) and isinstance(image.get("filename"), str)
                and isinstance(image.get("split"), str)
                and isinstance(image.get("sentences"), list)):
            source.problems.append(Problem(origin, MALFORMED,
                                           "needs 'filename', 'split' and 'sentences'"))
            continue
        file = "/".join(part for part in (image.get("filepath", ""), image["filename"]) if part)
        split = image["split"]
        if bad := _not_utf8(origin, {"file": file, "split": split}, "image"):
            source.problems.append(bad)
            continue
        located = _located(images_dir, file, origin, split, allow_outside)
        if isinstance(located, Problem):
            source.problems.append(located)
            continue
        captions, dropped = [], []
        for j, sentence in enumerate(image["sentences"]):
            where = Origin(str(json_file), item=f"images[{i}].sentences[{j}]")
            text = _sentence_text(sentence)
            if not text:
                dropped.append(Problem(where, EMPTY_CAPTION, f"sentence {j} is empty", split))
            elif bad := _not_utf8(where, {f"sentence {j}": text}, "sentence", split):
                dropped.append(bad)
            else:
                captions.append(Caption(text, where))
        _add_with_captions(source, seen, ImageRecord(
            image_id=located[1], split=split, path=located[0], file=file, origin=origin,
            captions=captions, dropped=dropped))
    return source


def _not_utf8(origin: Origin, texts: dict[str, str], skipped: str,
              split: str | None = None) -> Problem | None:
    """A `not_utf8` problem naming the first of `texts` (by label) that holds a lone surrogate."""
    for label, text in texts.items():
        if _LONE_SURROGATE.search(text):
            return Problem(origin, NOT_UTF8, f"{label} {_shown(text)} is not UTF-8; {skipped} "
                                             f"skipped ({_RESAVE})", split)
    return None


def _shown(text: str) -> str:
    """`text` quoted, its bytes that were not UTF-8 written as \\xNN, other lone surrogates as
    \\uXXXX (so a report can be written as UTF-8)."""
    def escape(match: re.Match) -> str:
        code = ord(match[0])
        return f"\\x{code - 0xdc00:02x}" if code >= 0xdc80 else f"\\u{code:04x}"
    return "'" + _LONE_SURROGATE.sub(escape, text) + "'"


def _sentence_text(sentence: object) -> str:
    """The raw text of a Karpathy sentence entry, else its tokens joined by spaces."""
    if not isinstance(sentence, dict):
        return ""
    raw = sentence.get("raw")
    if isinstance(raw, str) and raw.strip():
        return raw.strip()
    tokens = sentence.get("tokens")
    if isinstance(tokens, list):
        return " ".join(t for t in tokens if isinstance(t, str)).strip()
    return ""


def read_jsonl(jsonl_file: Path, images_dir: Path, default_split: str,
               allow_outside: bool = False) -> Source:
    """Read a JSONL file; a line without "split" goes to `default_split`."""
    if not jsonl_file.is_file():
        raise FileNotFoundError(f"JSONL file {jsonl_file} does not exist")
    source = Source()
    seen: dict[str, Origin] = {}
    for origin, line in _text_lines(jsonl_file, source):
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:  # too deep a nesting
            source.problems.append(Problem(origin, MALFORMED, f"invalid JSON ({err})"))
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("image"), str)
                and isinstance(entry.get("captions"), list)
                and isinstance(entry.get("split", default_split), str)):
            source.problems.append(Problem(origin, MALFORMED,
                                           'needs "image" (a path) and "captions" (a list)'))
            continue
        split = entry.get("split", default_split)
        if bad := _not_utf8(origin, {"image": entry["image"], "split": split}, "line"):
            source.problems.append(bad)
            continue
        located = _located(images_dir, entry["image"], origin, split, allow_outside)
        if isinstance(located, Problem):
            source.problems.append(located)
            continue
        boxes = entry.get("boxes")
        if boxes is not None and not _valid_boxes(boxes):
            source.problems.append(Problem(origin, BAD_BOXES, '"boxes" must be a list of '
                                                              '[x1, y1, x2, y2] numbers', split))
            continue
        captions, dropped = [], []
        for j, text in enumerate(entry["captions"]):
            where = replace(origin, item=f"captions[{j}]")
            if not (isinstance(text, str) and text.strip()):
                dropped.append(Problem(where, EMPTY_CAPTION, f"caption {text!r} is empty", split))
            elif bad := _not_utf8(where, {f"caption {j}": text}, "caption", split):
                dropped.append(bad)
            else:
                captions.append(Caption(text.strip(), where))
        _add_with_captions(source, seen, ImageRecord(
            image_id=located[1], split=split, path=located[0], file=entry["image"],
            origin=origin, captions=captions, dropped=dropped,
            boxes=[[float(v) for v in box] for box in boxes] if boxes is not None else None))
    return source


def _valid_boxes(boxes: object) -> bool:
    return isinstance(boxes, list) and all(
        isinstance(box, list) and len(box) == 4
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in box)
        for box in boxes)


def _add_with_captions(source: Source, seen: dict[str, Origin], record: ImageRecord) -> None:
    if record.captions:
        source.add(record, seen)
    else:
        source.problems.append(no_captions(record, record.dropped))


def rename_splits(source: Source, mapping: dict[str, str]) -> Source:
    """Rename splits, e.g. {"restval": "train"} to train on COCO's restval images too."""
    for item in (*source.records, *source.problems):
        if item.split in mapping:
            item.split = mapping[item.split]
    return source
