"""The `webdataset` source: img2dataset-layout WebDataset shards, streamed from any URL.

img2dataset writes one sample per downloaded image, keyed `{shard:05d}{index:04d}` (any key
webdataset groups by is read): `{key}.jpg` (or `.jpeg`, `.png`, `.webp`), `{key}.txt` (the
caption) and `{key}.json` (url, width, height, status, ..., and `caption` when it had one).
A sample's captions are its `txt`, else the json's `captions` list (several captions per image,
as Flickr and COCO have), else its `caption`; its split is the json's `split`, else
`--default-split`. A shard is opened by `defrag.urls.open_url`, the trainer's opener: a path,
brace-expanded list entry, `http(s)://` (curl, with a timeout) or `pipe:` command.

Each sample that cannot be used is a `Problem` named by shard URL (credentials masked) and key:
no image entry (`missing_image`), no caption (`no_captions`), a caption that is not UTF-8
(`not_utf8`), a json that does not parse or a split that cannot name a folder (`malformed`), a key
already read from this shard (`duplicate_image`), a file that would take its sample's files
past MAX_SAMPLE_BYTES (`malformed`, never read into memory: only the entries a sample is read
for are, SOURCE_IMAGES, txt and json), links or other special files in place of a sample's
files (`malformed`), any other failure on the sample (`unexpected_error`); a shard that ends
early or has a damaged member header is one `malformed` problem and the samples before it are
kept (stream-mode tarfile would take such a header for the end of the archive:
`_StrictTarInfo`). Images are decoded later, one at a time, by the unit that writes them
(featurizer/ingest.py).
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

from webdataset.tariterators import base_plus_ext, group_by_keys

from defrag.shard_format import MANIFEST, VOCAB
from defrag.urls import open_url, redact
from featurizer.records import (
    DUPLICATE_IMAGE,
    MALFORMED,
    MISSING_IMAGE,
    NO_CAPTIONS,
    NOT_UTF8,
    UNEXPECTED_ERROR,
    Origin,
    Problem,
    image_key,
    shown_text,
)

SOURCE_IMAGES = ("jpg", "jpeg", "png", "webp")  # entries read as the image, the first one found
# A split from a sample names one output folder: a plain name, not "."/"..", nor a file of the set.
SPLIT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
RESERVED = {MANIFEST, VOCAB, "parts"}
MAX_SAMPLE_BYTES = 256 << 20  # of a sample's files: one that would pass it is left out unread
READ = {*SOURCE_IMAGES, "txt", "json"}  # the entries a sample is read for; others stay unread
_KEY = re.compile(r"[A-Za-z0-9_-]+")


class UnreadableInput(OSError):
    """The input stream itself failed (unreachable, refused, cut): `cause` says how."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Sample:
    """One img2dataset sample: its key (unique in its shard; the output's image id is
    `<input shard>-<key>`, featurizer/ingest.py), image bytes and captions."""

    key: str
    image: bytes
    captions: list[str]
    split: str
    origin: Origin
    lost: list[Problem] = field(default_factory=list)  # captions left out (not UTF-8)


def read_samples(url: str, default_split: str, timeout: float) -> Iterator[Sample | Problem]:
    """The samples of the shard at `url`, in tar order, and a Problem for each one left out.
    UnreadableInput when the stream itself fails: the caller retries."""
    where = redact(url)
    seen: set[str] = set()
    problems: list[Problem] = []  # met while reading members: given before the next sample

    def repeated(err: Exception) -> bool:
        if not (isinstance(err, ValueError) and "duplicate file name" in str(err)):
            raise err
        problems.append(Problem(Origin(where), MALFORMED,
                                f"{_shown(str(err.args[0]))}: the later file left out"))
        return True

    try:
        with open_url(url, timeout) as stream:
            for entries in group_by_keys(_members(stream, where, problems), handler=repeated):
                yield from problems
                problems.clear()
                sample = _guarded_sample(entries, where, default_split)
                if isinstance(sample, Sample):
                    if sample.key in seen:
                        sample = Problem(sample.origin, DUPLICATE_IMAGE,
                                         f"key {sample.origin.item} already read from {where}",
                                         sample.split)
                    else:
                        seen.add(sample.key)
                yield sample
            yield from problems
    except OSError as err:
        raise UnreadableInput(err) from err


class _StrictTarInfo(tarfile.TarInfo):
    """A member header that is cut short, empty or fails its checksum is damage (ReadError): in
    stream mode tarfile takes it for the end of the archive, which ends with a zero block."""

    @classmethod
    def fromtarfile(cls, archive: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(archive)
        except tarfile.EOFHeaderError:
            raise
        except tarfile.HeaderError as err:
            raise tarfile.ReadError(f"bad member header at byte {archive.offset} ({err})"
                                    ) from None


@dataclass
class _Key:
    """The members of one key read so far: its files' bytes and its links."""

    name: str | None = None
    files: int = 0
    size: int = 0
    links: list[str] = field(default_factory=list)


def _members(stream, where: str, problems: list[Problem]) -> Iterator[dict]:
    """The files of a tar stream as webdataset's grouping takes them (`_entry`); a key with
    links or other special files is a problem; damage ends the stream with a problem (the files
    before it still grouped into samples)."""
    files = 0
    key = _Key()
    try:
        with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_StrictTarInfo) as archive:
            for member in archive:
                archive.members = []  # a stream of millions of members keeps none of them
                name = base_plus_ext(member.name)[0]
                if member.isdir() or name is None or member.name.startswith("__"):
                    continue
                if name != key.name:
                    _report_links(key, where, problems)
                    key = _Key(name)
                entry = _entry(archive, member, key, where, problems)
                if entry is not None:
                    yield entry
                    files += 1
            _report_links(key, where, problems)
    except (tarfile.TarError, EOFError) as err:
        problems.append(Problem(Origin(where), MALFORMED,
                                f"the shard ends early or is damaged after {files} files "
                                f"({type(err).__name__}: {redact(str(err))}); the samples "
                                f"before kept"))


def _entry(archive: tarfile.TarFile, member: tarfile.TarInfo, key: _Key, where: str,
           problems: list[Problem]) -> dict | None:
    """A regular file as webdataset groups it: its bytes when the sample is read for them and
    they keep its files within MAX_SAMPLE_BYTES (else a problem, None), empty when it is not
    (never read); None for a link or special file (noted in `key`)."""
    if not member.isreg():
        key.links.append(_shown(member.name))
        return None
    key.files += 1
    if base_plus_ext(member.name)[1].lower() not in READ:
        return {"fname": member.name, "data": b"", "__url__": where}
    if key.size + member.size > MAX_SAMPLE_BYTES:
        problems.append(Problem(Origin(where, item=_shown(member.name)), MALFORMED,
                                f"{member.size} bytes, which would take its sample's files past "
                                f"the bound of {MAX_SAMPLE_BYTES} bytes; left out"))
        return None
    key.size += member.size
    return {"fname": member.name, "data": archive.extractfile(member).read(), "__url__": where}


def _report_links(key: _Key, where: str, problems: list[Problem]) -> None:
    """One problem for a key's links or special files, which are never read (a sample of them
    alone would vanish uncounted)."""
    if key.links:
        problems.append(Problem(Origin(where, item=_shown(str(key.name))), MALFORMED,
                                f"{', '.join(key.links)}: links or other special files, not "
                                f"files; {'left out' if key.files else 'sample skipped'}"))


def _guarded_sample(entries: dict, where: str, default_split: str) -> Sample | Problem:
    """`_sample`, any failure of it on one sample (a json nested too deep to decode, ...) that
    sample's problem, not the shard's."""
    try:
        return _sample(entries, where, default_split)
    except Exception as err:  # one sample's surprise is its own problem
        return Problem(Origin(where, item=_shown(entries["__key__"])), UNEXPECTED_ERROR,
                       f"{type(err).__name__}: {shown_text(str(err), 200)}; sample skipped")


def _shown(text: str) -> str:
    """`text` (a tar member's name, bytes that were not UTF-8 kept as surrogates) as UTF-8."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _sample(entries: dict, where: str, default_split: str) -> Sample | Problem:
    raw_key = _shown(entries["__key__"])
    key = raw_key if _KEY.fullmatch(raw_key) else image_key(raw_key)
    origin = Origin(where, item=raw_key)
    meta: dict = {}
    if "json" in entries:
        try:
            meta = json.loads(entries["json"])
            if not isinstance(meta, dict):
                raise ValueError(f"a JSON {type(meta).__name__}, not an object")
        except ValueError as err:
            return Problem(origin, MALFORMED, f"its json does not parse ({err}); sample skipped")
    split = meta.get("split", default_split)
    if not isinstance(split, str) or not SPLIT_NAME.fullmatch(split) or split in RESERVED:
        return Problem(origin, MALFORMED, f"split {split!r} cannot name a folder of the set (a "
                                          f"word of [A-Za-z0-9_.-], not starting with '.', "
                                          f"not {', '.join(sorted(RESERVED))}); sample skipped")
    image = next((entries[name] for name in SOURCE_IMAGES if name in entries), None)
    if image is None:
        return Problem(origin, MISSING_IMAGE, f"no image entry ({', '.join(SOURCE_IMAGES)}); "
                                              f"it has {_entry_names(entries)}", split)
    texts, lost = _captions(entries, meta, origin, split)
    if not texts:
        why = "; ".join(p.detail for p in lost) or f"no txt entry or json caption(s) (it has " \
                                                     f"{_entry_names(entries)})"
        return Problem(origin, NO_CAPTIONS, f"{raw_key}: no usable caption ({why})", split)
    return Sample(key, image, texts, split, origin, lost)


def _captions(entries: dict, meta: dict, origin: Origin,
              split: str) -> tuple[list[str], list[Problem]]:
    """The non-empty captions of a sample (txt, else json caption or captions) and the
    problems of those that are not text."""
    if "txt" in entries:
        raw = [entries["txt"]]
    elif isinstance(meta.get("captions"), list):
        raw = meta["captions"]
    else:
        raw = [meta.get("caption")] if meta.get("caption") is not None else []
    texts, lost = [], []
    for number, value in enumerate(raw):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as err:
                lost.append(Problem(origin, NOT_UTF8, f"caption {number} is not UTF-8 (byte "
                                                      f"0x{value[err.start]:02x})", split))
                continue
        if not isinstance(value, str):
            lost.append(Problem(origin, MALFORMED, f"caption {number} is {value!r}, not text",
                                split))
        elif value.strip():
            texts.append(value.strip())
    return texts, lost


def _entry_names(entries: dict) -> str:
    return ", ".join(sorted(k for k in entries if not k.startswith("__"))) or "no entries"
