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
MANIFEST = "manifest.json"  # beside the split folders
VOCAB = "vocab.json"
SHARD_NAME = re.compile(r"([^/\s:]+/shard-\d+\.tar)")  # "<split>/shard-NNNNNN.tar" in a URL
