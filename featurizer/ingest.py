"""The webdataset source's run: input shards -> output shards, split over tasks, then merged.

Unit u of the work is input shard u (of the list `--shards` expands to) and belongs to task
u % N (defrag/tasks.py: a SLURM array task, a torchrun rank, `--task I --tasks N`, or the whole
job). A unit streams its shard (featurizer/img2dataset.py) CHUNK samples at a time: their captions
parsed, then each image decoded, boxed and appended to its split's output shard
`<split>/shard-<u>.tar` (with `--shard-size K`, pieces of K images `<split>/shard-<u>-<j>.tar`),
each put whole once complete (featurizer/destinations.py); a sample's image id is
`<prefix>-<key>`, the prefix naming its input shard apart from the job's others (`_prefixes`),
as img2dataset numbers each download's keys from 0. The unit's part, `parts/<u>.json`
(its shards with their counts and sizes, its skipped inputs, the settings that decide the set),
is put last: a unit whose part matches the run's settings and whose shards are there at their
sizes is finished, and a rerun skips it (a part that differs only in the merge's settings takes
the task's). Each task also puts `parts/plan.json` (the units and settings). Memory holds a
chunk, at most CHUNK samples and CHUNK_BYTES of their images and captions (a sample that passes
the bound ends its chunk), the previous chunk until the next is read, and one shard's metadata
per split, whatever the size or count of the data.

`merge` reads the plan and every part, builds the vocabulary from the training split's counts
(every token is kept in the shards, so the counts the units recorded are all it needs) or reuses
`--vocab`, then puts vocab.json and manifest.json, last. It refuses, naming them, parts of other
settings than the plan's and shards missing or of another size than their part records, so a
manifest never names a missing shard (a `pipe:` output cannot tell a size without reading the
shard: there each shard's first tar block is read, so a lost one is found, one cut short is not).
The same input shards give the same output bytes in any number of tasks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import webdataset as wds
from tqdm import tqdm

from defrag.shard_format import FORMAT_VERSION
from defrag.tasks import Task
from defrag.urls import MASK, HttpError, ShardError, describe_error, redact
from featurizer.boxes import make_box_source
from featurizer.destinations import Destination, destination, write_text
from featurizer.images import BadImage, decode_image
from featurizer.img2dataset import Sample, UnreadableInput, read_samples
from featurizer.parsing import Parser, make_parser, parse_captions
from featurizer.pipeline import (
    Settings,
    add_counts,
    checked_vocabulary,
    finish,
    in_workers,
    jsonable,
    log_problems,
    summed_counts,
)
from featurizer.records import Caption, ImageRecord, Problem
from featurizer.shards import sample_of, summary, usable_captions

log = logging.getLogger(__name__)
MANIFEST_FIELDS = ("split", "file", "samples", "captions", "bytes", "sha256")  # of a shard
CHUNK = 256  # samples parsed together (the parser's batch); their images decoded one at a time
CHUNK_BYTES = 64 << 20  # ... holding at most this many bytes of images and captions
PLAN = "parts/plan.json"
TIMEOUT = 60.0  # seconds an input read may stall
RETRIES = 3  # reads of an input shard that fails midway, from its start
NOT_OUTPUT = ("out", "workers", "parse_batch_size", "splits", "limit", "box_options")  # how fast
# or where, not what (box_options: in the box source's description; splits, limit: refused)
MERGE_ONLY = ("train_split", "min_word_count", "relation_min_fraction", "word_vectors", "vocab")


@dataclass(frozen=True)
class Unit:
    """Input shard `index` and everything a worker process needs to turn it into output."""

    index: int
    url: str
    name: str  # the input's file name: the shard's samples' "file" is `<name>/<key>`
    prefix: str  # of its samples' image ids, `<prefix>-<key>`: unique in the job (`_prefixes`)
    fingerprint: str  # of the settings that decide the output bytes, and of the input's name
    out: str
    out_read: str | None
    default_split: str
    shard_size: int | None
    max_image_pixels: int
    settings: dict  # those that decide the set (`_output_settings`), recorded in its part
    max_caption_chars: int

    @property
    def part(self) -> str:
        return f"parts/{self.index:06d}.json"


def featurize_shards(shards: str, out_read: str | None, default_split: str, settings: Settings,
                     task: Task) -> dict:
    """Task `task` of featurizing the img2dataset shards `shards` into `settings.out` (one task of
    one: the whole job, merged too). Returns what it did: units, finished, written, skipped."""
    parser = make_parser(settings.parser, settings.parse_batch_size)
    parser.check()
    checked_vocabulary(settings)  # a --vocab or --word-vectors that cannot be read fails now
    box_source = make_box_source(settings.boxes, **settings.box_options)
    where = destination(str(settings.out), out_read)
    inputs = wds.shardlists.expand_urls(shards)
    if not inputs:
        raise ValueError(f"--shards {redact(shards)} names no shard")
    output_settings = _output_settings(settings, default_split, parser, box_source)
    units = _plan(inputs, out_read, default_split, settings, output_settings)
    write_text(where, PLAN, json.dumps({
        "format": FORMAT_VERSION, "parser": parser.describe(), "box_source": box_source.describe(),
        "settings": redact(jsonable(vars(settings))), "command": redact(settings.command),
        "output_settings": output_settings,
        "units": [{"input": unit.name, "fingerprint": unit.fingerprint} for unit in units],
    }, ensure_ascii=False, indent=1))
    if _read_json(where, PLAN) is None:
        raise ShardError(f"{PLAN} was written to {where.location} but cannot be read back"
                         f"{_why(where)}: tasks could not skip finished work nor the merge read "
                         f"the parts; fix the read (--out-read for a pipe: output)")

    mine = [unit for unit in units if task.owns(unit.index)]
    todo = [unit for unit in mine if not _finished(unit, where)]
    log.info("task %d of %d: %d of %d input shards are this task's, %d already finished, %d to "
             "write with %d worker(s) into %s", task.index, task.count, len(mine), len(units),
             len(mine) - len(todo), len(todo), settings.workers, where.location)
    with tqdm(unit="img", desc=f"featurize task {task.index}/{task.count}") as bar:
        parts = in_workers(featurize_unit, todo, settings, parser, box_source, bar)
    failed = [part["failed"] for part in parts if "failed" in part]
    if failed:
        for line in failed:
            log.error("%s", line)
        raise ShardError(f"{len(failed)} of the task's {len(todo)} input shards failed, e.g. "
                         f"{failed[0]}; run the task again once they can be read: it redoes "
                         f"only what it has not finished")
    problems = [Problem.from_json(p) for part in parts for p in part["skipped"]]
    log_problems(problems, "while writing shards")
    done = {"task": task.index, "tasks": task.count, "units": len(units), "mine": len(mine),
            "finished_before": len(mine) - len(todo), "written": len(todo),
            "samples": sum(part["samples"] for part in parts),
            "skipped": len(problems)}
    if task.count == 1:
        done["manifest"] = merge(str(settings.out), out_read, settings.vocab,
                                 settings.word_vectors and str(settings.word_vectors))
    return done


def _output_settings(settings: Settings, default_split: str, parser: Parser,
                     box_source: Any) -> dict:
    """The settings that decide the set, its bytes or its vocabulary (credentials masked): what
    each part records and the merge compares."""
    chosen = {key: value for key, value in jsonable(vars(settings)).items()
              if key not in NOT_OUTPUT}
    return redact({**chosen, "parser": parser.describe(), "boxes": box_source.describe(),
                   "default_split": default_split})


def _plan(inputs: list[str], out_read: str | None, default_split: str, settings: Settings,
          output_settings: dict) -> list[Unit]:
    """One unit per input shard; its fingerprint covers the input's name (not its URL, whose
    signature may change) and the settings that decide its bytes (all but the merge's)."""
    decisive = {"format": FORMAT_VERSION, **{key: value for key, value in output_settings.items()
                                             if key not in MERGE_ONLY}}
    units = []
    for index, (url, prefix) in enumerate(zip(inputs, _prefixes(inputs), strict=True)):
        name = _input_path(url, index)[-1]
        payload = json.dumps({**decisive, "unit": index, "input": name, "prefix": prefix},
                             sort_keys=True)
        units.append(Unit(index, url, name, prefix, hashlib.sha256(payload.encode()).hexdigest(),
                          str(settings.out), out_read, default_split, settings.shard_size,
                          settings.max_image_pixels, output_settings,
                          settings.max_caption_chars))
    return units


def _input_path(url: str, index: int) -> list[str]:
    """The folders and file name of an input shard URL, query left out (`pipe:aws s3 cp
    s3://b/00003.tar -` -> s3:, '', b, 00003.tar)."""
    words = [word.split("?")[0] for word in url.split() if ".tar" in word.rsplit("/", 1)[-1]]
    return words[-1].split("/") if words else [f"input-{index:06d}"]


def _prefixes(inputs: list[str]) -> list[str]:
    """Each input's image-id prefix: its file name without `.tar`, after as many of its folders
    as tell all the job's inputs apart (two img2dataset downloads both number keys from 0:
    `dl1__00000`, `dl2__00000`), words of [A-Za-z0-9] joined by `_`, folders by `__` (no `-`:
    `<prefix>-<key>` is one image of one input). One line naming an input listed twice."""
    paths = []  # each input's words, file name first
    for index, url in enumerate(inputs):
        *folders, name = _input_path(url, index)
        words = (re.sub(r"[^A-Za-z0-9]+", "_", part).strip("_")
                 for part in (name.split(".tar")[0], *reversed(folders)))
        paths.append([word for word in words if word] or [f"input_{index:06d}"])
    for depth in range(1, max(map(len, paths)) + 1):
        prefixes = ["__".join(reversed(path[:depth])) for path in paths]
        if len(set(prefixes)) == len(prefixes):
            return prefixes
    first: dict[tuple[str, ...], int] = {}
    twice = next((first[tuple(path)], index) for index, path in enumerate(paths)
                 if first.setdefault(tuple(path), index) != index)
    raise ValueError(f"--shards lists one input shard twice: {redact(inputs[twice[0]])} (input "
                     f"{twice[0]}) and {redact(inputs[twice[1]])} (input {twice[1]}); its images "
                     f"would be featurized twice: list each input once")


def _finished(unit: Unit, where: Destination) -> bool:
    """Whether the unit's part is there, of these settings, with each of its shards at its size
    (when the destination can tell sizes); a finished part whose merge settings differ takes
    this task's (they change no byte of its shards)."""
    part = _read_json(where, unit.part)
    if not isinstance(part, dict) or part.get("fingerprint") != unit.fingerprint:
        return False
    if damage := _damaged(part, where):
        log.warning("%s (unit %d): %s; writing it again", unit.name, unit.index, damage)
        return False
    if part.get("settings") != unit.settings:
        write_text(where, unit.part, json.dumps({**part, "settings": unit.settings},
                                                ensure_ascii=False))
    return True


def _damaged(part: dict, where: Destination) -> str | None:
    """The first of the part's shards that is not there at the size it records, as a line;
    None when all are (a `pipe:` command tells only whether each is there, not its size)."""
    for shard in part["shards"]:
        name, size = f"{shard['split']}/{shard['file']}", shard["bytes"]
        if not where.sizes_known:
            if not where.present(name):
                return f"{name} is missing"
            continue
        found = where.size(name)
        if found != size:
            return (f"{name} is missing" if found is None
                    else f"{name} has {found} bytes, not the {size} its part records")
    return None


def featurize_unit(unit: Unit, parser: Parser, boxes: Callable,
                   progress: Callable[[int], object]) -> dict:
    """Write the output shards and then the part of `unit`; returns its samples and skipped
    inputs (not its counts: a task holds no more for 1,000 units than for one), or
    {"failed": why} (the other units go on). A read that fails midway is retried from the
    start, RETRIES times."""
    where = destination(unit.out, unit.out_read)
    for attempt in itertools.count():
        scratch = where.scratch(f"unit-{unit.index:06d}")
        try:
            part = _write_unit(unit, parser, boxes, progress, where, scratch)
            return {"samples": sum(shard["samples"] for shard in part["shards"]),
                    "skipped": part["skipped"]}
        except UnreadableInput as err:
            cause = err.cause
            if (isinstance(cause, HttpError) and cause.permanent) or attempt == RETRIES:
                return {"failed": f"cannot read {redact(unit.url)} ({describe_error(cause)})"}
            log.warning("reading %s failed (%s); again from its start", redact(unit.url),
                        describe_error(cause))
            time.sleep(min(2.0 ** attempt, 10.0))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    raise AssertionError("unreachable")


def _write_unit(unit: Unit, parser: Parser, boxes: Callable, progress: Callable[[int], object],
                where: Destination, scratch: Path) -> dict:
    outputs: dict[str, _Output] = {}
    shards: list[dict] = []
    problems: list[Problem] = []
    stream = read_samples(unit.url, unit.default_split, TIMEOUT)
    for chunk in _chunks(stream):
        samples = [item for item in chunk if not isinstance(item, Problem)]
        problems += [item for item in chunk if isinstance(item, Problem)]
        progress(len(chunk) - len(samples))
        parsed = iter(parse_captions(parser, [text for sample in samples
                                              for text in sample.captions],
                                     unit.max_caption_chars))
        for sample in samples:
            record = ImageRecord(f"{unit.prefix}-{sample.key}", sample.split, Path(),
                                 f"{unit.name}/{sample.key}",
                                 sample.origin, [Caption(text, sample.origin)
                                                 for text in sample.captions],
                                 dropped=sample.lost)
            captions = [(caption, next(parsed)) for caption in record.captions]
            try:
                image = decode_image(sample.image, f"{redact(unit.url)} [{sample.key}]",
                                     unit.max_image_pixels)
            except BadImage as bad:
                problems.append(Problem(record.origin, bad.reason, bad.detail, record.split))
                progress(1)
                continue
            kept = usable_captions(record, captions, problems)
            sample_data = kept and sample_of(record, image, kept, boxes, problems)
            if sample_data:
                if record.split not in outputs:
                    outputs[record.split] = _Output(unit, record.split, scratch)
                shards += outputs[record.split].add(*sample_data, where)
            progress(1)
    for output in outputs.values():
        shards += output.close(where)
    part = {"format": FORMAT_VERSION, "fingerprint": unit.fingerprint,
            "settings": unit.settings, "unit": unit.index,
            "input": unit.name, "shards": shards, "skipped": [p.to_json() for p in problems]}
    write_text(where, unit.part, json.dumps(part, ensure_ascii=False))
    return part


def _chunks(stream: Iterator[Sample | Problem]) -> Iterator[list[Sample | Problem]]:
    """`stream` in chunks of at most CHUNK items and CHUNK_BYTES of image and caption bytes (the
    sample that passes the bound ends its chunk): the bytes in flight are bounded, not the
    count, whatever a shard's images or captions weigh."""
    chunk: list[Sample | Problem] = []
    size = 0
    for item in stream:
        chunk.append(item)
        if isinstance(item, Sample):
            size += len(item.image) + sum(map(len, item.captions))
        if len(chunk) == CHUNK or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _Output:
    """The output shards of one split of a unit: samples appended to a local tar, which is put
    whole when it is full (`shard_size`) or the unit ends."""

    def __init__(self, unit: Unit, split: str, scratch: Path) -> None:
        self.unit, self.split, self.scratch = unit, split, scratch
        self.piece = 0
        self._open()

    def _open(self) -> None:
        index = self.unit.index
        self.file = (f"shard-{index:06d}.tar" if self.unit.shard_size is None
                     else f"shard-{index:06d}-{self.piece:04d}.tar")
        self.path = self.scratch / f"{self.split}-{self.file}"
        self.stream = self.path.open("wb")
        self.writer = wds.TarWriter(self.stream, encoder=False, mtime=0)
        self.metas: list[dict] = []

    def add(self, key: str, extension: str, data: bytes, meta: dict,
            where: Destination) -> list[dict]:
        """Append a sample; the shard put when full (its sidecar returned), else []."""
        self.writer.write({"__key__": key, extension: data,
                           "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")})
        self.metas.append(meta)
        if self.unit.shard_size is None or len(self.metas) < self.unit.shard_size:
            return []
        done = self.close(where)
        self.piece += 1
        self._open()
        return done

    def close(self, where: Destination) -> list[dict]:
        """Put the current shard (if it holds a sample) and return its sidecar."""
        self.writer.close()
        self.stream.close()
        if not self.metas:
            self.path.unlink()
            return []
        sidecar = {"split": self.split, "file": self.file, **summary(self.path, self.metas)}
        where.put(f"{self.split}/{self.file}", self.path)
        return [sidecar]


def merge(out: str, out_read: str | None = None, vocab: str | None = None,
          word_vectors: str | None = None) -> dict:
    """Put the vocabulary and the manifest of the set at `out` from its plan and every unit's
    part; one line naming the unfinished input shards if any is. `vocab` / `word_vectors`
    replace the tasks' (the plan keeps them with credentials masked). Holds the counts summed
    per split, not every part's."""
    where = destination(out, out_read)
    plan = _read_json(where, PLAN)
    if not isinstance(plan, dict):
        raise ValueError(f"{where.location} has no {PLAN}{_why(where)}: run `featurize "
                         f"webdataset ... --out {where.location}` (every task of it) before the "
                         f"merge")
    settings = Settings(**{**plan["settings"], "command": plan["command"]})
    if vocab is not None or word_vectors is not None:
        settings.vocab, settings.word_vectors = vocab, word_vectors
    if MASK in (settings.vocab or ""):
        raise ValueError(f"the tasks' --vocab {settings.vocab} held a credential, which the plan "
                         f"keeps masked: give it to the merge again (--vocab)")
    by_split: dict[str, list[dict]] = {}
    totals: dict[str, dict] = {}
    problems = []
    for part in _finished_parts(where, plan):
        for shard in part["shards"]:
            add_counts(totals.setdefault(shard["split"], summed_counts([])), shard)
            by_split.setdefault(shard["split"], []).append(
                {key: shard[key] for key in MANIFEST_FIELDS})
        problems += [Problem.from_json(p) for p in part["skipped"]]
    reused = checked_vocabulary(settings)
    if reused is None and settings.train_split not in by_split:
        raise ValueError(f"no {settings.train_split!r} samples to build the vocabulary from (the "
                         f"shards hold {sorted(by_split) or 'nothing'}): featurize with "
                         f"--default-split {settings.train_split} or --train-split NAME, or "
                         f"reuse a vocabulary with --vocab")
    return finish(settings, where, plan["parser"], plan["box_source"], reused,
                  dict(sorted(by_split.items())), totals, problems)


def _finished_parts(where: Destination, plan: dict) -> Iterator[dict]:
    """Every unit's part, checked to be of the plan's settings and input with its shards there
    at their sizes; after the last, one line naming each unit that is not and what to do."""
    ours, count = plan.get("output_settings", {}), len(plan["units"])
    if not where.sizes_known:
        log.warning("the shards of %s are looked up, not their sizes (a command cannot tell a "
                    "file's size without reading it): one cut short is found when read; remove "
                    "its unit's part (parts/<u>.json) and run its task again", where.location)
    other, missing = [], []
    for index, unit in enumerate(plan["units"]):
        named = f"{unit['input']} (unit {index}"
        part = _read_json(where, f"parts/{index:06d}.json")
        if not isinstance(part, dict):
            missing.append(f"{named})")
        elif differing := _differing(part.get("settings") or {}, ours):
            other.append(f"{named}: {differing})")
        elif part.get("fingerprint") != unit["fingerprint"]:
            missing.append(f"{named})")
        elif damage := _damaged(part, where):
            missing.append(f"{named}: {damage})")
        else:
            yield part
    if other:
        raise ValueError(f"{len(other)} of the {count} input shards were featurized with other "
                         f"settings than the last task to start ({PLAN}): {_listed(other)}; give "
                         f"every task the same flags and run them again (a unit that differs "
                         f"only in the vocabulary's settings is kept), then merge again")
    if missing:
        raise ValueError(f"{len(missing)} of the {count} input shards are not finished in "
                         f"{where.location}{_why(where)}: {_listed(missing)}; run the job's tasks "
                         f"again (each redoes only what it has not finished: unit u is task "
                         f"u % N's), then merge again")


def _differing(theirs: dict, ours: dict) -> str:
    """The settings (as flags) whose values differ between a part's and the plan's."""
    return ", ".join(f"--{key.replace('_', '-')} {json.dumps(theirs.get(key))} (plan: "
                     f"{json.dumps(ours.get(key))})" for key in sorted(ours.keys() | theirs.keys())
                     if theirs.get(key) != ours.get(key))


def _listed(units: list[str]) -> str:
    return f"{', '.join(units[:5])}{' ...' if len(units) > 5 else ''}"


def _read_json(where: Destination, name: str) -> Any:
    """The JSON file `name` of the set, None when it is missing or damaged."""
    try:
        return json.loads(where.read(name) or b"null")
    except ValueError:
        return None


def _why(where: Destination) -> str:
    """What the last failed read-back command said, if any (a `pipe:` output)."""
    said = getattr(where, "said", None)
    return f" (reading it back: {said})" if said else ""
