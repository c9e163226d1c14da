"""The featurizer (`defrag featurize`): captioned images -> the WebDataset shards the trainer
streams.

Modules, in the order data flows: `sources` (read a dataset into `records`), `img2dataset` (the
`webdataset` source: img2dataset shards streamed from any URL), `images` (read and check one
image), `parsing` (captions -> tokens and dependency triplets), `boxes` (image -> region boxes),
`shards` (one shard written atomically), `vocabulary` (dictionary and relation table rules),
`destinations` (where a set is written: a folder, s3://, pipe:), `pipeline` (the parallel,
resumable run and its manifest), `ingest` (the webdataset source's run, split over tasks, and its
merge), `synthetic` (generated demo data, also as img2dataset shards), `command` (the CLI,
`defrag featurize`).

Output layout (format version `defrag.shard_format.FORMAT_VERSION`):

    OUT/manifest.json            counts per split, shard list (samples, captions, bytes, sha256),
                                 parser, box source, vocabulary summary and relation table, the
                                 training split's counts of every relation type, every skipped
                                 input (file, line, item, reason, detail) and the command
    OUT/vocab.json               defrag.vocab.Vocabulary.save: words and kept relation types
    OUT/<split>/shard-000000.tar one WebDataset sample per image, samples sorted by image id
    OUT/<split>/shard-000000.json its sidecar: counts, sha256, input fingerprint (resumption)

The `webdataset` source (featurizer/ingest.py) writes to a folder, `s3://BUCKET/PREFIX` or
`pipe:COMMAND {shard}`: input shard u (of `--shards`) becomes `<split>/shard-<u:06d>.tar` (with
`--shard-size K`, pieces `<split>/shard-<u:06d>-<j:04d>.tar`), samples in the input's order, keyed
by the img2dataset key, "file" = `<input shard name>/<key>`; instead of sidecars, each input shard
has its part `parts/<u:06d>.json` (its shards' counts and sha256, its skipped inputs) and the run
its `parts/plan.json`; `featurize merge` writes vocab.json and manifest.json from them.

The manifest's "skipped" has one item per distinct input left out, so `count` = the sum of
`by_reason` = the number of `items`, and a split's "skipped" counts that split's items (an item
whose split is unknown, e.g. a line that is not UTF-8, counts only in the totals). An item is
- a whole image (`missing_image`, `bad_image`, `unsupported_format`, `duplicate_image`,
  `bad_boxes`, `no_captions`, `outside_images`): an image left without a usable caption is ONE
  `no_captions` item, whose detail names the captions it lost; an image whose path leads outside
  the image folder (absolute, `..`, a symbolic link out) is `outside_images` unless the command
  is given `--allow-outside-images`; `unexpected_error` when its box source or its reading
  failed in a way nothing else names;
- a caption left out of an image that was written (`empty_caption`, `no_words`, `not_utf8`,
  `caption_too_long`: over `--max-caption-chars`, never parsed; `unexpected_error`: its parse
  failed);
- or a line, entry or file read as neither (`malformed`, `odd_key`, `duplicate_key`, `not_utf8`,
  `missing_split_file`).
Each is logged as `FILE:LINE [ITEM]: reason: detail` (the first 20 of a run) and listed in full.

A sample's key is the image id (`records.image_key` of the image's normalised path relative to the
image folder): only [A-Za-z0-9_-], one key per path and one path per key, so `dup.jpg` and
`dup.png` are two images and `dup.jpg` listed again (or as `./dup.jpg`) is a `duplicate_image`.
A plain path keeps its words (`val2014/COCO_1.jpg` -> `val2014__COCO_1_jpg`), any other gets its
words and a hash (`my pics/a.jpg` -> `my_pics_a_jpg-1f0c2a9e`). Its entries are `jpg`, `png`
or `webp` (the ORIGINAL file bytes, extension from the decoded format) and `json`:

    {"image_id", "split", "width", "height", "file": path relative to the image folder,
     "captions": [{"text", "tokens": [word, ...], "triplets": [[rel, governor, dependent], ...],
                   "tree": {"heads": [int, ...], "relations": [rel, ...], "pos": [tag, ...]}}],
     "boxes": [[x1, y1, x2, y2], ...] (pixels; row 0 = the whole image), "box_scores": [...],
     "box_source": name}

Tokens and triplets are lowercased, without punctuation, and keep EVERY relation type: the
vocabulary (built after parsing, from the training split) decides what the trainer uses, through
`Vocabulary.encode`. So a new split can be featurized with `--vocab` of an existing training set
or model and be encoded exactly like it.

A caption's "tree" is its whole dependency parse over the same words, in sentence order: three
lists aligned with "tokens" (one entry per token). `heads[i]` is the index in "tokens" of token
i's head, -1 for a root; `relations[i]` its relation to that head, lowercased as in the triplets
("root" for a sentence's root); `pos[i]` its universal part-of-speech tag (spaCy `pos_`, stanza
`upos`).
Example, "A dog runs on the grass .":

    "tokens": ["a", "dog", "runs", "on", "the", "grass"],
    "tree": {"heads": [1, 2, -1, 2, 5, 3],
             "relations": ["det", "nsubj", "root", "prep", "det", "pobj"],
             "pos": ["DET", "NOUN", "VERB", "ADP", "DET", "NOUN"]}

The heads form a forest: a caption parsed as several sentences has one root per sentence, and a
word whose head is punctuation (rare) hangs on its nearest kept ancestor (a root if none), with
its own relation (`parsing` has the details). The triplets are unchanged by the tree: an edge
that touches punctuation is still left out of them.

Format versions: 1 = without "tree" (still read by the trainer, enough for the fragment
encoder; encoders that need trees refuse it through `trainer.data.shardset.require_trees`); 2 = with
"tree". A re-run over an output folder of another format rewrites every shard.
"""
