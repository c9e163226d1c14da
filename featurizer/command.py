"""`defrag featurize SOURCE ...`: turn a captioned image dataset into training shards.

    defrag featurize flickr --root ../shared/flickr8k --out data/f8k --parser spacy \\
        --splits train dev
    defrag featurize karpathy --json dataset_coco.json --images coco/ --out data/coco \\
        --split-map restval=train
    defrag featurize jsonl --jsonl captions.jsonl --out data/mine --vocab data/f8k
    defrag featurize synthetic --out data/synthetic   # generated scenes, spaCy, given boxes
    defrag featurize webdataset --shards 'https://host/laion/{00000..00099}.tar' \
        --out s3://bucket/laion-defrag --boxes fullframe     # img2dataset shards, any URL
    defrag featurize merge --out s3://bucket/laion-defrag    # after every task of a job array
    defrag featurize wordvecs --shards data/f8k --out data/f8k/word2vec-200.txt

See featurizer/__init__.py for the output format.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from defrag.cli import add_debug_flag, one_line_errors
from defrag.images import add_pixel_limit_flag
from defrag.tasks import add_task_flags, task_from
from defrag.urls import redact
from featurizer.ingest import featurize_shards, merge
from featurizer.parsing import MAX_CAPTION_CHARS
from featurizer.pipeline import Settings, featurize
from featurizer.sources import (
    FLICKR8K_IMAGES,
    FLICKR8K_SPLIT_FILES,
    FLICKR8K_TOKEN_FILE,
    Source,
    read_flickr,
    read_jsonl,
    read_karpathy,
    rename_splits,
)
from featurizer.synthetic import DEFAULT_NUM_TRAIN, DEFAULT_NUM_VAL, generate
from featurizer.wordvecs import learn_word_vectors


def _pair(text: str) -> tuple[str, str]:
    """argparse type for NAME=VALUE."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _positive(text: str) -> int:
    """argparse type for a count that must be at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return int(text)


def _option_value(text: str) -> object:
    """A --box-option value: JSON when it parses (numbers, null, true), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _common_flags() -> argparse.ArgumentParser:
    """The flags every source takes: a new parser per source, so that one source's defaults
    (`set_defaults`) are not every source's (argparse shares a parent's flag objects)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--out", required=True,
                       help="output folder (shards, manifest); the webdataset source also "
                            "writes to s3://BUCKET/PREFIX or pipe:COMMAND {shard}")
    flags.add_argument("--parser", choices=("stanza", "spacy"), default="stanza",
                       help="dependency parser (default: stanza; spacy works offline)")
    flags.add_argument("--parse-batch-size", type=int, default=256,
                       help="captions per parser batch")
    flags.add_argument("--max-caption-chars", type=_positive, default=MAX_CAPTION_CHARS,
                       metavar="N", help=f"a longer caption is skipped unparsed, counted as "
                                         f"caption_too_long (default {MAX_CAPTION_CHARS})")
    flags.add_argument("--boxes", choices=("selective_search", "detector", "given", "fullframe"),
                       default="selective_search", help="box source (default: selective_search)")
    flags.add_argument("--max-boxes", type=int,
                       help="boxes per image besides the whole image (default: the source's, 19)")
    flags.add_argument("--detector-weights", help="state-dict file of the detector box source")
    flags.add_argument("--box-option", type=_pair, action="append", default=[],
                       metavar="KEY=VALUE", help="any other box-source option, e.g. mode=quality")
    flags.add_argument("--shard-size", type=_positive, default=1000,
                       help="images per shard (default 1000; webdataset: one output shard per "
                            "input shard and split unless given)")
    flags.add_argument("--workers", type=int, default=2, help="worker processes")
    flags.add_argument("--splits", nargs="+", help="splits to featurize (default: all found)")
    flags.add_argument("--limit", type=_positive,
                       help="only the first N images (by id) of each split")
    flags.add_argument("--train-split", default="train",
                       help="split whose captions build the vocabulary (default: train)")
    flags.add_argument("--min-word-count", type=int, default=5,
                       help="dictionary = training words seen this often (without --word-vectors)")
    flags.add_argument("--relation-min-fraction", type=float, default=0.01,
                       help="keep relation types with at least this share of training triplets")
    flags.add_argument("--word-vectors", type=Path,
                       help="GloVe/word2vec text file whose words form the dictionary")
    flags.add_argument("--vocab",
                       help="reuse vocab.json (or the folder of a featurized set or model; a "
                            "path or an http(s) URL)")
    add_pixel_limit_flag(flags)
    return flags


def build_parser() -> argparse.ArgumentParser:
    """`defrag featurize`'s parser: a subcommand per source, `merge` and `wordvecs`."""
    parser = argparse.ArgumentParser(prog="defrag featurize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="source", required=True)
    _add_file_sources(commands)
    _add_webdataset(commands)
    _add_synthetic(commands)
    _add_wordvecs(commands)
    for command in commands.choices.values():
        add_debug_flag(command)
    return parser


def _add_file_sources(commands: argparse._SubParsersAction) -> None:
    """The sources read from local files: flickr, karpathy and jsonl."""
    flickr = commands.add_parser("flickr", parents=[_common_flags()],
                                 help="Flickr8k/Flickr30k release (token file, split lists)")
    flickr.add_argument("--root", type=Path, required=True, help="release folder")
    flickr.add_argument("--token-file", default=FLICKR8K_TOKEN_FILE,
                        help="captions file, relative to --root")
    flickr.add_argument("--images", default=FLICKR8K_IMAGES,
                        help="image folder, relative to --root")
    flickr.add_argument("--split-file", type=_pair, action="append", metavar="SPLIT=FILE",
                        help="split list relative to --root, repeatable; replaces the Flickr8k "
                             f"defaults {FLICKR8K_SPLIT_FILES}")

    karpathy = commands.add_parser("karpathy", parents=[_common_flags()],
                                   help="Karpathy-split JSON")
    karpathy.add_argument("--json", type=Path, required=True, help="dataset_*.json")
    karpathy.add_argument("--images", type=Path, required=True,
                          help="folder the JSON's filepath/filename are relative to")

    jsonl = commands.add_parser("jsonl", parents=[_common_flags()],
                                help='JSONL of {"image", "captions", "split"}')
    jsonl.add_argument("--jsonl", type=Path, required=True)
    jsonl.add_argument("--images", type=Path,
                       help="folder relative image paths start from and every image must be "
                            "in (default: the JSONL's; see --allow-outside-images)")
    jsonl.add_argument("--default-split", default="train",
                       help='split of lines without "split" (default: train)')

    for command in (karpathy, jsonl):
        command.add_argument("--split-map", type=_pair, action="append", default=[],
                             metavar="OLD=NEW", help="rename a split, e.g. restval=train")
    for command in (flickr, karpathy, jsonl):
        command.add_argument("--allow-outside-images", action="store_true",
                             help="read images whose path leads outside the image folder "
                                  "(absolute, '..', a link out); by default each is skipped "
                                  "as outside_images")


def _add_webdataset(commands: argparse._SubParsersAction) -> None:
    """The img2dataset source, split over the tasks of a job, and the merge after them."""
    webdataset = commands.add_parser(
        "webdataset", parents=[_common_flags()],
        help="img2dataset shards (jpg/png/webp + txt/json) from any URL; one task of a job "
             "array under SLURM_ARRAY_TASK_ID/COUNT, RANK/WORLD_SIZE or --task/--tasks")
    webdataset.add_argument("--shards", required=True,
                            help="input shards: a path, brace range, http(s):// URL or pipe: "
                                 "command, as WebDataset takes them")
    webdataset.add_argument("--default-split", default="train",
                            help='split of samples whose json has no "split" (default: train)')
    webdataset.add_argument("--out-read", metavar="pipe:COMMAND",
                            help="with a pipe: --out, the command that reads a file back "
                                 "({shard} = its name); default: `cp - DEST` turned around")
    add_task_flags(webdataset)
    webdataset.set_defaults(shard_size=None)

    merge = commands.add_parser(
        "merge", help="after every task of `webdataset`: write the vocabulary and manifest")
    merge.add_argument("--out", required=True, help="the tasks' --out")
    merge.add_argument("--out-read", metavar="pipe:COMMAND", help="as for `webdataset`")
    merge.add_argument("--vocab", help="the vocabulary to reuse, instead of the tasks' --vocab "
                                       "(needed when that URL held a credential)")
    merge.add_argument("--word-vectors", help="instead of the tasks' --word-vectors")


def _add_synthetic(commands: argparse._SubParsersAction) -> None:
    synthetic = commands.add_parser(
        "synthetic", parents=[_common_flags()],
        help="generate a small synthetic dataset and featurize it (spaCy, given boxes)")
    synthetic.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN)
    synthetic.add_argument("--num-val", type=int, default=DEFAULT_NUM_VAL)
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.add_argument("--image-size", type=int, default=128, help="image side in pixels")
    synthetic.set_defaults(parser="spacy", boxes="given")


def _add_wordvecs(commands: argparse._SubParsersAction) -> None:
    wordvecs = commands.add_parser(
        "wordvecs", help="learn word2vec vectors from a featurized set's training captions")
    wordvecs.add_argument("--shards", type=Path, required=True, help="featurizer output folder")
    wordvecs.add_argument("--out", type=Path, required=True, help="word2vec text file to write")
    wordvecs.add_argument("--dim", type=int, default=200, help="vector size (paper: 200)")
    wordvecs.add_argument("--epochs", type=int, default=10, help="passes over the captions")
    wordvecs.add_argument("--seed", type=int, default=0)


def read_source(args: argparse.Namespace) -> Source:
    """Read the dataset the subcommand names (generating it first for `synthetic`)."""
    if args.source == "flickr":
        split_files = dict(args.split_file) if args.split_file else FLICKR8K_SPLIT_FILES
        return read_flickr(args.root / args.token_file, args.root / args.images,
                           {name: args.root / file for name, file in split_files.items()},
                           args.splits, args.allow_outside_images)
    if args.source == "karpathy":
        source = read_karpathy(args.json, args.images, args.allow_outside_images)
    elif args.source == "jsonl":
        source = read_jsonl(args.jsonl, args.images or args.jsonl.parent, args.default_split,
                            args.allow_outside_images)
    else:
        jsonl_file = generate(Path(args.out) / "source", args.num_train, args.num_val, args.seed,
                              args.image_size)
        return read_jsonl(jsonl_file, jsonl_file.parent, "train")
    return rename_splits(source, dict(args.split_map))


def settings_from(args: argparse.Namespace, argv: list[str]) -> Settings:
    options = {key: _option_value(value) for key, value in args.box_option}
    if args.max_boxes is not None:
        options["max_boxes"] = args.max_boxes
    if args.detector_weights is not None:
        options["weights"] = args.detector_weights
    return Settings(
        out=args.out if args.source == "webdataset" else Path(args.out), parser=args.parser,
        parse_batch_size=args.parse_batch_size, max_caption_chars=args.max_caption_chars,
        boxes=args.boxes, box_options=options, shard_size=args.shard_size,
        workers=args.workers, splits=args.splits, limit=args.limit, train_split=args.train_split,
        min_word_count=args.min_word_count, relation_min_fraction=args.relation_min_fraction,
        word_vectors=args.word_vectors, vocab=args.vocab, max_image_pixels=args.max_image_pixels,
        command=shlex.join(["defrag", "featurize", *argv]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with one_line_errors(f"{parser.prog} {args.source}", args.debug):
        run(args, argv)
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> None:
    """The subcommand's work, and its summary on stdout."""
    if args.source == "wordvecs":
        count = learn_word_vectors(args.shards, args.out, args.dim, epochs=args.epochs,
                                   seed=args.seed)
        print(f"{count} word vectors of size {args.dim} written to {args.out}")
        return
    if args.source == "merge":
        _summarize(merge(args.out, args.out_read, args.vocab, args.word_vectors), args.out)
        return
    if args.source == "webdataset":
        if args.limit is not None or args.splits:
            raise ValueError("--limit and --splits do not apply to the webdataset source: it "
                             "writes every sample of its input shards (choose them with --shards)")
        done = featurize_shards(args.shards, args.out_read, args.default_split,
                                settings_from(args, argv), task_from(args.task, args.tasks))
        manifest = done.pop("manifest", None)
        print(f"task {done['task']} of {done['tasks']}: {done['mine']} of {done['units']} input "
              f"shards, {done['finished_before']} finished before, {done['written']} written "
              f"({done['samples']} images, {done['skipped']} inputs skipped)")
        if manifest is None:
            print(f"after every task: defrag featurize merge --out {redact(args.out)}")
        else:
            _summarize(manifest, args.out)
        return
    _summarize(featurize(read_source(args), settings_from(args, argv)), args.out)


def _summarize(manifest: dict, out: str) -> None:
    for split, counts in manifest["splits"].items():
        print(f"{split}: {counts['images']} images, {counts['captions']} captions, "
              f"{counts['triplets']} triplets, {len(counts['shards'])} shards, "
              f"skipped {counts['skipped'] or 'nothing'}")
    vocab = manifest["vocabulary"]
    print(f"vocabulary: {vocab['words']} words, relations {vocab['relations']}; "
          f"{manifest['skipped']['count']} inputs skipped; manifest in {redact(out)}")

