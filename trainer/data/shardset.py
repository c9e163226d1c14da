"""Where a featurized set lives: its manifest, its vocabulary and the shard URLs of each split.

`data.shards` (and `--shards` of the command-line tools) is one of:

- a local folder written by `defrag featurize ... --out FOLDER`;
- the `http(s)://` URL of such a folder on a web server, or its `s3://BUCKET/PREFIX` in an S3
  bucket (`manifest.json` and `vocab.json` are fetched from there, a shard is
  `<url>/<split>/shard-NNNNNN.tar`);
- a WebDataset shard list, written as WebDataset users write them: brace ranges, `::`-joined
  lists, `pipe:` commands (`pipe:aws s3 cp s3://bucket/f8k/train/shard-{000000..000023}.tar -`),
  with the manifest given by path or URL (`data.manifest`; default: two folders above the first
  shard when that is a plain path or http URL). Each listed URL must keep the featurizer's
  `<split>/shard-NNNNNN.tar` name, which ties it to its manifest entry (sample count, sha256).

URLs are opened by `defrag.urls` (webdataset's `gopen`, curl with a timeout for http(s)).
Nothing here reads a shard's contents: listing a split costs the same for 1k or 100M samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import webdataset as wds

from defrag.shard_format import (
    FORMAT_VERSION,
    MANIFEST,
    READABLE_FORMATS,
    SHARD_NAME,
    TREE_FORMAT,
    VOCAB,
    unsafe_path,
)
from defrag.urls import ShardError, is_remote, join_url, parent, read_url, redact
from defrag.vocab import Vocabulary
from trainer.config import DataConfig

NOT_SET = ("data.shards is not set: point it at the output folder of `defrag featurize ...` "
           "(a path or an http(s) URL) or at a shard list")


def damaged_shard(url: str, detail: str) -> str:
    """The one message for a shard that is not what its manifest says."""
    return (f"shard {redact(url)}: {detail}. It is damaged or incomplete: re-run the featurizer "
            f"command of its manifest (created_by) with the same --out, which rewrites shards "
            f"that no longer match their checksum, then copy it again wherever it is served from")


# ---------------------------------------------------------------------------------------------
# Splits


@dataclass(frozen=True)
class Shard:
    """One shard of a split: where to read it and what its manifest promises."""

    url: str
    samples: int  # images the featurizer wrote into it
    sha256: str | None

    @property
    def local(self) -> bool:
        return not is_remote(self.url)


@dataclass
class SplitShards:
    """The shards of one split (manifest order) and the split's counts."""

    name: str
    shards: list[Shard]
    images: int
    captions: int  # = (image, caption) pairs
    manifest_url: str
    format: int = FORMAT_VERSION  # the manifest's shard format (see READABLE_FORMATS)

    @property
    def urls(self) -> list[str]:
        return [shard.url for shard in self.shards]

    def require_trees(self, what: str) -> None:
        """Refuse shards without dependency trees (format 1) for `what` (e.g. "the dtrnn
        sentence encoder"); see `require_trees`."""
        require_trees(self.format, parent(self.manifest_url), what)


def require_trees(manifest_format: int, folder: str, what: str) -> None:
    """Raise a one-line ShardError if shards of `manifest_format` lack the captions' dependency
    trees and POS tags ("tree"), which `what` needs; `folder` is the featurizer output folder
    (the manifest's folder), named in the message."""
    if manifest_format < TREE_FORMAT:
        raise ShardError(f"{what} needs the captions' dependency trees and part-of-speech tags "
                         f"(shard format {TREE_FORMAT}), but {folder} holds format "
                         f"{manifest_format} shards: re-run the featurizer command of its "
                         f"manifest (created_by) with the same --out to rewrite them")


def is_folder(spec: str) -> bool:
    """A featurizer output folder (local or http) rather than a shard list."""
    if spec.startswith("pipe:") or "::" in spec or "{" in spec or spec.endswith(".tar"):
        return False
    return spec.startswith(("http://", "https://", "s3://")) or Path(spec).is_dir()


def manifest_url(spec: str | None, manifest: str | None = None) -> str:
    """The manifest of `spec`: given, inside a folder, or two folders above a listed shard."""
    if manifest:
        return manifest
    if not spec:
        raise ValueError(NOT_SET)
    if is_folder(spec):
        return join_url(spec, MANIFEST)
    first = wds.shardlists.expand_urls(spec)[0]
    if first.startswith("pipe:"):
        raise ValueError(f"shard list {spec!r}: with pipe: commands give the manifest's path or "
                         f"URL too (data.manifest, or --manifest)")
    return join_url(parent(parent(first)), MANIFEST)


def read_manifest(url: str, timeout: float = 60.0, retries: int = 3) -> dict[str, Any]:
    """The manifest at `url`, checked to be one this code reads."""
    try:
        manifest = json.loads(read_url(url, timeout, retries))
    except (ShardError, ValueError) as err:
        raise ShardError(f"cannot read the manifest {redact(url)} ({err}): data.shards must be the "
                         f"output folder of `defrag featurize ...` or a shard list with "
                         f"data.manifest") from err
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if type(found) is not int or found not in READABLE_FORMATS:  # not True, 1.0 or "1"
        raise ShardError(f"{redact(url)}: shard format {found!r}, this code reads formats "
                         f"{' and '.join(map(str, READABLE_FORMATS))}; re-run this code's "
                         f"featurizer (the manifest's created_by command) to rewrite the set")
    _check_shard_names(manifest, url)
    return manifest


def _check_shard_names(manifest: dict[str, Any], url: str) -> None:
    """Raise a one-line ShardError for a shard "file" that could lead outside the set's folder
    (`unsafe_path`): shard URLs are built from them, and a remote manifest is not to be trusted."""
    for split, entry in manifest.get("splits", {}).items():
        for number, shard in enumerate(entry.get("shards", [])):
            name = shard.get("file") if isinstance(shard, dict) else shard
            reason = unsafe_path(name) if isinstance(name, str) else "no text"
            if reason:
                raise ShardError(
                    f"the manifest {redact(url)} lists shard {redact(name)!r} (split {split!r}, "
                    f"entry {number}), which holds {reason}: a shard name is a path inside the "
                    f"set's folder; re-run the featurizer command of the manifest (created_by) "
                    f"with the same --out, or fetch the set from a source you trust")


def locate_split(spec: str | None, split: str, manifest: str | None = None,
                 timeout: float = 60.0, retries: int = 3) -> SplitShards:
    """The shards of `split` from a folder, a folder URL or a shard list (see the module doc);
    local shards are checked to exist (a stat each, no read)."""
    if not spec:
        raise ValueError(NOT_SET)
    where = manifest_url(spec, manifest)
    entries = read_manifest(where, timeout, retries)
    splits = entries.get("splits", {})
    if split not in splits:
        raise ValueError(f"split {split!r} is not in {where}, which has {sorted(splits)}; set "
                         f"data.train_split / data.val_split (or --split)")
    listed = {entry["file"]: entry for entry in splits[split]["shards"]}
    if is_folder(spec):
        base = spec
        chosen = [(join_url(base, file), entry) for file, entry in listed.items()]
    else:
        chosen = _listed_shards(spec, split, listed, splits, where)
    shards = [Shard(url, int(entry["samples"]), entry.get("sha256")) for url, entry in chosen]
    if not shards:
        raise ValueError(f"split {split!r} of {where} has no shards")
    missing = [shard.url for shard in shards
               if shard.local and not Path(shard.url).is_file()]
    if missing:
        raise ShardError(f"{len(missing)} of the {len(shards)} shards of split {split!r} are "
                         f"missing, e.g. {missing[:3]}: re-run the featurizer command of "
                         f"{where} (created_by) with the same --out to rewrite them")
    images, captions = _counts(splits[split], [entry for _, entry in chosen], where, spec)
    return SplitShards(split, shards, images, captions, where, entries["format"])


def _listed_shards(spec: str, split: str, listed: dict[str, dict], splits: dict,
                   where: str) -> list[tuple[str, dict]]:
    """The URLs of a shard list that belong to `split`, each with its manifest entry."""
    known = {entry["file"] for entries in splits.values() for entry in entries["shards"]}
    chosen = []
    for url in wds.shardlists.expand_urls(spec):
        names = [name for name in SHARD_NAME.findall(url) if name in known]
        if not names:
            raise ValueError(f"shard {url} is not in the manifest {where}: a listed shard must "
                             f"keep the featurizer's <split>/shard-NNNNNN.tar name")
        if names[-1] in listed:
            chosen.append((url, listed[names[-1]]))
    if not chosen:
        raise ValueError(f"the shard list {spec!r} holds no shard of split {split!r}: give that "
                         f"split its own list (data.val_shards for validation)")
    return chosen


def _counts(entry: dict, chosen: list[dict], where: str, spec: str) -> tuple[int, int]:
    """(images, captions) of the chosen shards of a split: the split's totals when all of them
    are chosen, else the sums of the shards' own counts."""
    if len(chosen) == len(entry["shards"]):
        return int(entry["images"]), int(entry["captions"])
    if any("captions" not in shard for shard in chosen):
        raise ValueError(f"{spec!r} lists {len(chosen)} of the {len(entry['shards'])} shards of "
                         f"a split, and {where} has no per-shard caption counts: list them all, "
                         f"or re-run the featurizer to write them")
    return (sum(int(shard["samples"]) for shard in chosen),
            sum(int(shard["captions"]) for shard in chosen))


def vocab_url(spec: str | None, manifest: str | None = None, vocab: str | None = None) -> str:
    """The vocabulary of a set: given, else beside its manifest (in a `pipe:` command that reads
    the manifest, the same command with the file's name changed)."""
    if vocab:
        return vocab
    where = manifest_url(spec, manifest)
    if where.startswith("pipe:"):
        if where.count(MANIFEST) != 1:
            raise ValueError(f"data.manifest {redact(where)!r} is a command that does not name "
                             f"{MANIFEST} once: give the vocabulary's too (data.vocab, or --vocab)")
        return where.replace(MANIFEST, VOCAB)
    return join_url(parent(where), VOCAB)



def train_split(data: DataConfig) -> SplitShards:
    """The training split of data.shards."""
    return locate_split(data.shards, data.train_split, data.manifest, data.io_timeout,
                        data.io_retries)


def val_split(data: DataConfig, split: str | None = None) -> SplitShards:
    """The validation split (or `split`): from data.val_shards when given, else data.shards."""
    return locate_split(data.val_shards or data.shards, split or data.val_split, data.manifest,
                        data.io_timeout, data.io_retries)


def load_vocabulary(data: DataConfig) -> Vocabulary:
    """The vocabulary of the training shards (data.vocab, else beside the manifest)."""
    url = vocab_url(data.shards, data.manifest, data.vocab)
    return Vocabulary.from_json(read_url(url, data.io_timeout, data.io_retries), url)


def training_manifest(data: DataConfig) -> dict[str, Any]:
    """The manifest of the training shards."""
    return read_manifest(manifest_url(data.shards, data.manifest), data.io_timeout,
                         data.io_retries)


def training_featurizer(data: DataConfig) -> dict[str, Any] | None:
    """The parser and box source of the training shards, from their manifest (None when the
    manifest is not on this machine): what a model folder records as its featurizer."""
    if data.shards is None:
        return None
    try:
        manifest = training_manifest(data)
    except (ShardError, ValueError):
        return None
    return {key: manifest[key] for key in ("parser", "box_source") if key in manifest}
