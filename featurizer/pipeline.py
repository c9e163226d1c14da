"""The featurizer run: source records -> shards per split (in parallel) -> vocabulary -> manifest.

1. Check the parser, box source and vocabulary inputs before any work (fail fast and clearly).
2. Select splits (and the first `limit` images of each, by image id); plan the shards.
3. Skip finished shards; write the rest in `workers` processes, each holding its own parser and
   box source, with one progress bar over images.
4. Build the vocabulary from the training split's shard counts (or reuse `--vocab`), then write
   `vocab.json` and `manifest.json` (both atomically).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from defrag.images import MAX_IMAGE_PIXELS
from defrag.shard_format import FORMAT_VERSION, MANIFEST, VOCAB, unsafe_path
from defrag.urls import redact
from defrag.vocab import Vocabulary
from featurizer.boxes import make_box_source
from featurizer.destinations import Destination, Folder, write_text
from featurizer.parsing import MAX_CAPTION_CHARS, Parser, make_parser
from featurizer.records import ImageRecord, Problem
from featurizer.shards import ShardSpec, clear_leftovers, finished, plan_shards, write_shard
from featurizer.sources import Source
from featurizer.vocabulary import build_vocabulary, coverage, reused_vocabulary

log = logging.getLogger(__name__)
PROBLEMS_LOGGED = 20  # skipped inputs printed one by one; all of them go to the manifest


@dataclass
class Settings:
    """Everything a run depends on besides its source (the CLI flags, one to one)."""

    out: Path | str  # a folder; the webdataset source also writes to s3:// and pipe: (destinations)
    parser: str = "stanza"
    parse_batch_size: int = 256
    max_caption_chars: int = MAX_CAPTION_CHARS  # longer captions are left out (caption_too_long)
    boxes: str = "selective_search"
    box_options: dict[str, Any] = field(default_factory=dict)
    shard_size: int | None = 1000  # None (webdataset only): one shard per input shard
    workers: int = 2
    splits: list[str] | None = None
    limit: int | None = None
    train_split: str = "train"
    min_word_count: int = 5
    relation_min_fraction: float = 0.01
    word_vectors: Path | None = None
    vocab: str | None = None  # a vocab.json, or a folder holding one; a path or an http(s) URL
    max_image_pixels: int = MAX_IMAGE_PIXELS  # larger images are skipped, counted as too_large
    command: str = ""


def featurize(source: Source, settings: Settings) -> dict:
    """Write the shards, vocabulary and manifest of `source` under `settings.out`; returns the
    manifest."""
    parser = make_parser(settings.parser, settings.parse_batch_size)
    parser.check()
    reused = checked_vocabulary(settings)
    box_source = make_box_source(settings.boxes, **settings.box_options)
    by_split = _select_splits(source.records, settings)
    if reused is None and settings.train_split not in by_split:
        raise ValueError(f"no {settings.train_split!r} split to build the vocabulary from: "
                         f"include it, name another with --train-split, or reuse a vocabulary "
                         f"with --vocab")
    left_out = {r.split for r in source.records} - set(by_split)
    problems = [p for p in source.problems if p.split not in left_out]
    log_problems(problems, "while reading the source")

    specs = _plan(by_split, settings, {"parser": parser.describe(),
                                       "boxes": box_source.describe()})
    sidecars = _complete(specs, settings, parser, box_source)
    shard_problems = [Problem.from_json(p) for sidecar in sidecars for p in sidecar["skipped"]]
    log_problems(shard_problems, "while writing shards")

    by_split_sidecars = {split: [sidecar for spec, sidecar in zip(specs, sidecars, strict=True)
                                 if spec.split == split] for split in by_split}
    return finish(settings, Folder(Path(settings.out)), parser.describe(),
                  box_source.describe(), reused, by_split_sidecars,
                  {split: summed_counts(shards) for split, shards in by_split_sidecars.items()},
                  problems + shard_problems)


def finish(settings: Settings, where: Destination, parser: dict, box_source: dict,
           reused: Vocabulary | None, by_split: dict[str, list[dict]],
           totals: dict[str, dict], problems: list[Problem]) -> dict:
    """Build the vocabulary from the training split's counts (`totals`, `summed_counts` of
    each split's shards) or take `reused`, put vocab.json and then manifest.json, the last file
    of a set; returns the manifest."""
    train_counts = totals.get(settings.train_split) or summed_counts([])
    vocab = reused if reused is not None else build_vocabulary(
        train_counts["relation_counts"], train_counts["word_counts"],
        min_fraction=settings.relation_min_fraction, min_count=settings.min_word_count,
        word_vectors=settings.word_vectors)
    write_text(where, VOCAB, vocab.to_json())
    manifest = build_manifest(settings, parser, box_source, vocab, reused is not None, by_split,
                              totals, problems)
    write_text(where, MANIFEST, json.dumps(manifest, ensure_ascii=False, indent=1))
    return manifest


def checked_vocabulary(settings: Settings) -> Vocabulary | None:
    """The vocabulary named by --vocab, checked up front (as is a word-vector file)."""
    if settings.vocab is not None and settings.word_vectors is not None:
        raise ValueError("--vocab reuses a whole vocabulary; it cannot be combined with "
                         "--word-vectors")
    if settings.word_vectors is not None and not Path(settings.word_vectors).is_file():
        raise FileNotFoundError(f"word-vector file {settings.word_vectors} does not exist")
    return reused_vocabulary(settings.vocab) if settings.vocab else None


def _select_splits(records: list[ImageRecord],
                   settings: Settings) -> dict[str, list[ImageRecord]]:
    """Records by split, in --splits order (default: sorted names), first `limit` by image id;
    a split name that cannot be one folder of --out (`unsafe_path`, or a '/') is refused."""
    found = sorted({r.split for r in records})
    names = settings.splits or found
    missing = [s for s in names if s not in found]
    if missing:
        raise ValueError(f"split(s) {missing} not in the source (it has {found})")
    selected = {}
    for name in names:
        if reason := ("a '/'" if "/" in name else unsafe_path(name)):
            raise ValueError(f"split {name!r} cannot name a folder of --out: it holds {reason}; "
                             f"rename it in the source (a JSONL \"split\", --split-file "
                             f"NAME=FILE, --split-map) or leave it out with --splits")
        chosen = sorted((r for r in records if r.split == name), key=lambda r: r.image_id)
        selected[name] = chosen[:settings.limit] if settings.limit is not None else chosen
    return selected


def _plan(by_split: dict[str, list[ImageRecord]], settings: Settings,
          fingerprint_settings: dict) -> list[ShardSpec]:
    """The shards of every split; clears what interrupted or larger earlier runs left behind."""
    specs: list[ShardSpec] = []
    for split, records in by_split.items():
        directory = Path(settings.out) / split
        planned = plan_shards(split, records, directory, settings.shard_size,
                              fingerprint_settings, settings.max_image_pixels,
                              settings.max_caption_chars)
        if directory.is_dir():
            clear_leftovers(directory, len(planned))
        specs += planned
    return specs


def _complete(specs: list[ShardSpec], settings: Settings, parser: Parser,
              box_source: Callable) -> list[dict]:
    """Sidecars of all `specs`: finished shards are kept, the others written now."""
    sidecars = [finished(spec) for spec in specs]
    todo = [i for i, sidecar in enumerate(sidecars) if sidecar is None]
    log.info("%d shard(s) planned, %d already finished, %d to write with %d worker(s)",
             len(specs), len(specs) - len(todo), len(todo), settings.workers)
    written = _write_shards([specs[i] for i in todo], settings, parser, box_source)
    for i, sidecar in zip(todo, written, strict=True):
        sidecars[i] = sidecar
    return sidecars


def log_problems(problems: list[Problem], when: str) -> None:
    for problem in problems[:PROBLEMS_LOGGED]:
        log.warning("skipped: %s", problem)
    if len(problems) > PROBLEMS_LOGGED:
        log.warning("... and %d more skipped %s (all listed in %s)",
                    len(problems) - PROBLEMS_LOGGED, when, MANIFEST)


def _write_shards(todo: list[ShardSpec], settings: Settings, parser: Parser,
                  box_source: Callable) -> list[dict]:
    """Sidecars of the written shards, in `todo` order."""
    with tqdm(total=sum(len(spec.records) for spec in todo), unit="img",
              desc="featurize") as bar:
        return in_workers(write_shard, todo, settings, parser, box_source, bar)


def in_workers(work: Callable, items: list, settings: Settings, parser: Parser,
               box_source: Callable, bar: tqdm) -> list:
    """`work(item, parser, box_source, progress)` of every item, in item order: here with
    `parser` and `box_source` for one worker (or one item), else in `settings.workers` processes,
    each holding its own parser and box source; `progress(n)` moves `bar` on."""
    if settings.workers <= 1 or len(items) <= 1:
        return [work(item, parser, box_source, bar.update) for item in items]
    context = mp.get_context("spawn")  # fresh interpreters: no forked torch/OpenMP state
    progress = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // settings.workers)
    init = (settings.parser, settings.parse_batch_size, settings.boxes, settings.box_options,
            threads, progress)
    with context.Pool(settings.workers, initializer=_init_worker, initargs=init) as pool:
        pending = [pool.apply_async(_in_worker, (work, item)) for item in items]
        while not all(result.ready() for result in pending):
            _drain(progress, bar, timeout=0.5)
            for result in pending:
                if result.ready() and not result.successful():
                    result.get()  # re-raises the worker's exception here
        _drain(progress, bar, timeout=0)
        return [result.get() for result in pending]


def _drain(progress: Any, bar: tqdm, timeout: float) -> None:
    try:
        bar.update(progress.get(timeout=timeout) if timeout else progress.get_nowait())
        while True:
            bar.update(progress.get_nowait())
    except queue.Empty:
        pass


_worker: tuple[Parser, Callable, Callable[[int], object]] | None = None


def _init_worker(parser: str, batch_size: int, boxes: str, box_options: dict, threads: int,
                 progress: Any) -> None:
    """Per worker process: share the cores, build the parser and box source once."""
    import cv2
    import torch

    global _worker
    torch.set_num_threads(threads)
    cv2.setNumThreads(threads)
    _worker = (make_parser(parser, batch_size), make_box_source(boxes, **box_options),
               progress.put)


def _in_worker(work: Callable, item: Any) -> Any:
    assert _worker is not None, "worker process not initialised"
    return work(item, *_worker)


def summed_counts(sidecars: list[dict]) -> dict:
    """Summed counts of a split's shards (relation and word counts as Counters)."""
    totals: dict[str, Any] = {key: 0 for key in ("samples", "captions", "triplets", "tokens")}
    totals["relation_counts"], totals["word_counts"] = Counter(), Counter()
    for sidecar in sidecars:
        add_counts(totals, sidecar)
    return totals


def add_counts(totals: dict, sidecar: dict) -> None:
    """Add a shard's counts to `totals` (a `summed_counts` result)."""
    for key, value in totals.items():
        if isinstance(value, Counter):
            value.update(sidecar[key])
        else:
            totals[key] += sidecar[key]


def build_manifest(settings: Settings, parser: dict, box_source: dict, vocab: Vocabulary,
                   reused: bool, sidecars: dict[str, list[dict]], totals: dict[str, dict],
                   problems: list[Problem]) -> dict:
    train_counts = totals.get(settings.train_split) or summed_counts([])
    splits = {}
    for split, shards in sidecars.items():
        counts = totals[split]
        split_problems = Counter(p.reason for p in problems if p.split == split)
        splits[split] = {
            "images": counts["samples"], "captions": counts["captions"],
            "triplets": counts["triplets"], "tokens": counts["tokens"],
            "triplets_per_caption": counts["triplets"] / max(1, counts["captions"]),
            "dictionary_coverage": coverage(vocab, counts["word_counts"]),
            "skipped": dict(sorted(split_problems.items())),
            "shards": [{"file": f"{split}/{s['file']}", "samples": s["samples"],
                        "captions": s["captions"], "bytes": s["bytes"], "sha256": s["sha256"]}
                       for s in shards],
        }
    return {
        "format": FORMAT_VERSION,
        "created_by": redact({"command": settings.command,  # credentials in URLs masked
                              "settings": jsonable(vars(settings))}),
        "parser": parser,
        "box_source": box_source,
        "vocabulary": {
            "file": VOCAB, "words": len(vocab.words), "relations": vocab.relations,
            "source": (f"reused from {redact(settings.vocab)}" if reused
                       else f"built from split {settings.train_split!r}"),
            "word_vectors": str(settings.word_vectors) if settings.word_vectors else None,
            "min_word_count": settings.min_word_count,
            "relation_min_fraction": settings.relation_min_fraction,
        },
        "train_relation_counts": dict(train_counts["relation_counts"].most_common()),
        "splits": splits,
        "skipped": {"count": len(problems),
                    "by_reason": dict(sorted(Counter(p.reason for p in problems).items())),
                    "items": [p.to_json() for p in problems]},
    }


def jsonable(values: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items() if k != "command"}
