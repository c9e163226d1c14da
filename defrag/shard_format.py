"""The shard set's names and format versions: what the featurizer writes and the trainer reads.

A featurized set is a folder (or URL) holding `manifest.json`, `vocab.json` and
`<split>/shard-NNNNNN.tar` WebDataset shards (the sample layout: featurizer/__init__.py).
"""

from __future__ import annotations

import re

FORMAT_VERSION = 2  # what the featurizer writes
# Formats the trainer reads: 1 has each caption's tokens and triplets, all the fragment encoder
# needs; 2 adds its dependency tree and POS tags.
READABLE_FORMATS = (1, 2)  # FORMAT_VERSION among them (a test checks)
TREE_FORMAT = 2  # the first format whose captions have a "tree"
IMAGE_ENTRIES = ("jpg", "png", "webp")  # a sample's image, stored as the source's bytes
MANIFEST = "manifest.json"  # beside the split folders
VOCAB = "vocab.json"
# "<split>/shard-NNNNNN.tar" in a URL; "shard-NNNNNN-JJJJ.tar" is piece J of input shard N of the
# webdataset source (featurizer/ingest.py)
SHARD_NAME = re.compile(r"([^/\s:]+/shard-\d+(?:-\d+)?\.tar)")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|pipe:")


def unsafe_path(name: str) -> str | None:
    """What in `name`, a path joined to a set's folder or URL (a manifest's shard "file", a split
    folder), could lead outside it or into a command; None when nothing does."""
    if any(ord(char) < 0x20 or char == "\x7f" for char in name):
        return "a control character"
    if name.startswith("/"):
        return "an absolute path"
    if _SCHEME.match(name):
        return "a URL scheme or a pipe: command"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "an empty, '.' or '..' path part"
    return None


def image_entry(sample: dict) -> str | None:
    """The name of a shard sample's image entry (`IMAGE_ENTRIES`), None if it has none."""
    return next((name for name in IMAGE_ENTRIES if name in sample), None)
