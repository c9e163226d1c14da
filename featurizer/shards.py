"""One shard = one independent unit of work: its images parsed, boxed and written to a tar.

Records of a split are sorted by image id and cut into shards of `shard_size` images, so shard k
always holds the same images and any worker process can write it alone. A shard is written with
webdataset's `TarWriter` to a temporary name and renamed only when complete; then its sidecar
`shard-NNNNNN.json` (counts, sha256, the fingerprint of its inputs and settings, skipped inputs)
is renamed into place. A shard counts as finished only when its sidecar matches the current
fingerprint and the tar's size and sha256, so a re-run redoes half-written or stale shards and
skips the rest. (`ShardWriter` names shards by a running counter as it writes one stream, so it
cannot give each parallel worker its own shard index and an atomic rename.)

Tar members have a fixed mtime, owner and mode, and samples are written in image-id order, so the
same inputs give byte-identical shards. A shard's captions are parsed first, then its images are
read, boxed and appended one at a time: it holds one decoded image, whatever their size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import webdataset as wds

from defrag.files import TEMPORARY, replaced_atomically, sha256_file, write_atomically
from defrag.images import MAX_IMAGE_PIXELS
from defrag.shard_format import FORMAT_VERSION
from featurizer.images import BadImage, LoadedImage, load_image
from featurizer.parsing import MAX_CAPTION_CHARS, ParsedCaption, Parser, Unparsed, parse_captions
from featurizer.records import (
    NO_WORDS,
    UNEXPECTED_ERROR,
    Caption,
    ImageRecord,
    Problem,
    no_captions,
    shown_text,
)


@dataclass
class ShardSpec:
    """Shard `index` of `split`: which records go in, and the fingerprint of inputs + settings."""

    split: str
    index: int
    directory: Path
    records: list[ImageRecord]
    fingerprint: str
    max_image_pixels: int = MAX_IMAGE_PIXELS  # larger images are skipped (too_large)
    max_caption_chars: int = MAX_CAPTION_CHARS  # longer captions are left out (caption_too_long)

    @property
    def tar_path(self) -> Path:
        return self.directory / f"shard-{self.index:06d}.tar"

    @property
    def sidecar_path(self) -> Path:
        return self.directory / f"shard-{self.index:06d}.json"


def plan_shards(split: str, records: list[ImageRecord], directory: Path, shard_size: int,
                settings: dict, max_image_pixels: int = MAX_IMAGE_PIXELS,
                max_caption_chars: int = MAX_CAPTION_CHARS) -> list[ShardSpec]:
    """Cut a split's records (sorted by image id) into shards of `shard_size` images; the pixel
    and caption bounds are part of the fingerprint (they decide what is kept)."""
    if shard_size < 1:
        raise ValueError(f"shard size must be positive, got {shard_size}")
    ordered = sorted(records, key=lambda r: r.image_id)
    settings = {**settings, "max_image_pixels": max_image_pixels,
                "max_caption_chars": max_caption_chars}
    return [ShardSpec(split, index, directory, chunk, _fingerprint(chunk, settings),
                      max_image_pixels, max_caption_chars)
            for index, chunk in enumerate(ordered[start:start + shard_size]
                                          for start in range(0, len(ordered), shard_size))]


def _fingerprint(records: list[ImageRecord], settings: dict) -> str:
    """Hash of what determines a shard's bytes: format, settings, and each record's inputs."""
    payload = {"format": FORMAT_VERSION, "settings": settings, "records": [
        [r.image_id, r.file, _file_size(r.path), [c.text for c in r.captions], r.boxes,
         [str(p) for p in r.dropped]]
        for r in records]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


# A sidecar of another FORMAT_VERSION never counts as finished (the format is also in the
# fingerprint), so a re-run over an older output folder rewrites every shard.
def finished(spec: ShardSpec) -> dict | None:
    """The sidecar of `spec` if its shard is complete and current, else None."""
    try:
        sidecar = json.loads(spec.sidecar_path.read_text())
        complete = (sidecar.get("format") == FORMAT_VERSION
                    and sidecar.get("fingerprint") == spec.fingerprint
                    and spec.tar_path.stat().st_size == sidecar.get("bytes")
                    and sha256_file(spec.tar_path) == sidecar.get("sha256"))
    except (OSError, ValueError):
        return None
    return sidecar if complete else None


def clear_leftovers(directory: Path, num_shards: int) -> None:
    """Remove temporary files of interrupted runs and shards beyond the current plan."""
    for path in directory.glob("shard-*"):
        index = path.name.split(".")[0].removeprefix("shard-")
        if TEMPORARY in path.name or not index.isdigit() or int(index) >= num_shards:
            path.unlink()


def write_shard(spec: ShardSpec, parser: Parser, boxes: Callable,
                progress: Callable[[int], object]) -> dict:
    """Parse, box and write the images of `spec`; returns its sidecar. `boxes` is a box source;
    `progress(1)` is called once per image. The captions are parsed first, then each image is
    read, boxed and written before the next is read: a shard holds one decoded image at a time,
    whatever the images weigh."""
    problems: list[Problem] = []
    parsed = iter(parse_captions(parser, [c.text for record in spec.records
                                          for c in record.captions], spec.max_caption_chars))
    metas = []
    spec.directory.mkdir(parents=True, exist_ok=True)
    spec.sidecar_path.unlink(missing_ok=True)
    with replaced_atomically(spec.tar_path) as tmp:
        with tmp.open("wb") as stream:
            writer = wds.TarWriter(stream, encoder=False, mtime=0)
            for record in spec.records:
                captions = [(c, next(parsed)) for c in record.captions]
                sample = _read_sample(record, captions, spec.max_image_pixels, boxes, problems)
                if sample is not None:
                    key, extension, data, meta = sample
                    writer.write({"__key__": key, extension: data,
                                  "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")})
                    metas.append(meta)
                progress(1)
            writer.close()
            stream.flush()
            os.fsync(stream.fileno())
        sidecar = _sidecar(spec, tmp, metas, problems)
    write_atomically(spec.sidecar_path, json.dumps(sidecar, ensure_ascii=False, indent=1))
    return sidecar


def _read_sample(record: ImageRecord, captions: list[tuple[Caption, ParsedCaption | Unparsed]],
                 max_pixels: int, boxes: Callable,
                 problems: list[Problem]) -> tuple[str, str, bytes, dict] | None:
    """`sample_of` a record, its image read now; None, reported in `problems`, when the image
    cannot be used or no caption can."""
    try:
        image = load_image(record.path, max_pixels)
    except BadImage as bad:
        problems.append(Problem(record.origin, bad.reason, bad.detail, record.split))
        return None
    kept = usable_captions(record, captions, problems)
    return sample_of(record, image, kept, boxes, problems) if kept else None


def usable_captions(record: ImageRecord,
                    parsed: list[tuple[Caption, ParsedCaption | Unparsed]],
                    problems: list[Problem]) -> list[dict]:
    """Captions parsed into at least one word, as stored. Reports the others with those the
    source dropped, or, when none is left, the image alone (one `no_captions` naming them)."""
    captions, dropped = [], list(record.dropped)
    for caption, fragments in parsed:
        if isinstance(fragments, Unparsed):
            dropped.append(Problem(caption.origin, fragments.reason, fragments.detail,
                                   record.split))
        elif fragments.tokens:
            captions.append(fragments.caption(caption.text))
        else:
            dropped.append(Problem(caption.origin, NO_WORDS,
                                   f"caption {shown_text(caption.text)} has no words",
                                   record.split))
    problems.extend(dropped if captions else [no_captions(record, dropped)])
    return captions


def sample_of(record: ImageRecord, image: LoadedImage, captions: list[dict], boxes: Callable,
              problems: list[Problem]) -> tuple[str, str, bytes, dict] | None:
    """(key, image extension, image bytes, JSON metadata) of one image; None, reported in
    `problems`, when the box source fails on it (that image's problem, not the run's)."""
    try:
        rows, scores = boxes(image.image, record.boxes)
    except Exception as err:  # any failure of a box source on one image
        problems.append(Problem(record.origin, UNEXPECTED_ERROR, f"{record.file}: the box "
                                f"source failed ({type(err).__name__}: "
                                f"{shown_text(str(err), 200)}); image skipped", record.split))
        return None
    width, height = image.image.size
    meta = {"image_id": record.image_id, "split": record.split, "width": width,
            "height": height, "file": record.file, "captions": captions, "boxes": rows,
            "box_scores": scores, "box_source": boxes.name}
    return record.image_id, image.extension, image.data, meta


def _sidecar(spec: ShardSpec, tar: Path, metas: list[dict], problems: list[Problem]) -> dict:
    return {"format": FORMAT_VERSION, "fingerprint": spec.fingerprint, "split": spec.split,
            "file": spec.tar_path.name, **summary(tar, metas),
            "skipped": [p.to_json() for p in problems]}


def summary(tar: Path, metas: list[dict]) -> dict:
    """What the manifest and vocabulary need of a written shard: its size and sha256, and the
    counts of its samples' (`metas`) captions, triplets, words and relations."""
    captions = [c for meta in metas for c in meta["captions"]]
    return {
        "bytes": tar.stat().st_size, "sha256": sha256_file(tar),
        "samples": len(metas), "captions": len(captions),
        "triplets": sum(len(c["triplets"]) for c in captions),
        "tokens": sum(len(c["tokens"]) for c in captions),
        "relation_counts": dict(Counter(t[0] for c in captions for t in c["triplets"])),
        "word_counts": dict(Counter(w for c in captions for w in c["tokens"])),
    }
