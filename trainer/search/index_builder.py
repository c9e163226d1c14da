"""Build a search index (trainer/search/index.py): embed a folder of images or a split of shards
in several processes, resumably, then write the index's files.

    defrag index --model DIR --images FOLDER --out INDEX [--sentences FILE]
    defrag index --model DIR --shards URL --split val --out INDEX
    defrag index ... --task I --tasks N    (or in a SLURM array task, a torchrun rank)
    defrag index --merge --out INDEX       (once every task has run)
    defrag index ... [--merge] --parts N   (INDEX/part-0 ... part-(N-1): a split index)

The work is cut into units (256 files of a folder, or one shard); each finished unit is a
part file in INDEX/parts/, so a rerun of the same command resumes from them (a file changed since
is embedded again with its unit); the parts are merged in unit order into the index's files and
removed once index.json is written. The images of a --shards collection are written to
INDEX/files/ (a folder collection is served from its folder). The sentences are those of a
--sentences file, else the captions of --shards.

Split into N tasks (defrag/tasks.py), task I embeds the units u with u % N = I and records the
build in INDEX/parts/build.json; `--merge` then writes the index from the parts, as one process
does after embedding them all (launch/README.md, "Index on SLURM or torchrun").

With --parts N the merge writes N ordinary indexes instead of one, INDEX/part-0 ... part-(N-1),
each of a consecutive slice of the images and of the sentences (its index.json's `split` records
the slices' offsets), and INDEX/split.json listing them: each part is served by its own `defrag
serve --index`, and a `defrag serve --parts URL,...` in front answers as the whole index would
(trainer/search/split.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, save
from tqdm import tqdm

from defrag.cli import add_debug_flag, one_line_errors
from defrag.files import TEMPORARY, sha256_file, write_atomically
from defrag.images import DECODER_VERSION
from defrag.shard_format import image_entry
from defrag.tasks import WHOLE_JOB, Task, add_task_flags, task_from
from defrag.urls import redact
from trainer.batch import owners
from trainer.data.reader import BadSample, Notes, ReadOptions, shard_samples
from trainer.data.shardset import Shard, locate_split, read_manifest
from trainer.search.embedder import (
    IMAGE_BATCH,
    Embedder,
    RetrievalError,
    embed_images,
    embed_parsed,
    embed_sentences,
    image_fragments,
)
from trainer.search.embedding_cache import IMAGE_SUFFIXES, list_images, read_sentences
from trainer.search.fragment_set import FragmentSet
from trainer.search.index import (
    INDEX_FORMAT,
    IndexMismatch,
    StoredFragments,
    load_one_model,
    memory_map,
    write_collection,
)
from trainer.store.model_folder import ModelFolder

log = logging.getLogger(__name__)

UNIT_FILES = 256  # images of a folder per unit of work (a part file, a resume point)
BUILD_FLAGS = ("model", "images", "shards", "split", "manifest", "sentences", "follow_links",
               "boxes", "detector_weights", "parser", "task", "tasks")  # what --merge reads


@dataclass(frozen=True)
class Unit:
    """A unit of work of the builder: some files of a folder, or one shard."""

    number: int
    files: tuple[tuple[str, int, int], ...] = ()  # (name, size, mtime_ns): a changed file is new
    shard: Shard | None = None

    @property
    def size(self) -> int:
        return self.shard.samples if self.shard else len(self.files)

    def describe(self) -> dict[str, Any]:
        """What the unit's part records (credentials in its URL masked)."""
        return ({"shard": redact(dataclasses.asdict(self.shard))} if self.shard
                else {"files": [list(stamp) for stamp in self.files]})

    @property
    def digest(self) -> str:
        return _digest(self.describe())


def _digest(description: dict[str, Any]) -> str:
    """A unit's description in 64 characters (parts/build.json lists every unit's)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


_WORKER: dict[str, Any] = {}  # a builder process's embedder and settings (`_start_worker`)


def _start_worker(model: ModelFolder, boxes: dict, parser: str, out: Path,
                  image_folder: Path | None, options: ReadOptions, threads: int) -> None:
    """A builder process: its threads, its own copy of the model (`_use`) from the folder the
    builder opened."""
    torch.set_num_threads(threads)
    embedder = load_one_model(model, None, None, parser)
    _use(dataclasses.replace(embedder, boxes=boxes), out, image_folder, options)


def _use(embedder: Embedder, out: Path, image_folder: Path | None,
         options: ReadOptions) -> None:
    """What `_embed_unit` embeds with and where it writes, in this process."""
    _WORKER.update(embedder=embedder, out=out, image_folder=image_folder, options=options)


def _embed_unit(unit: Unit) -> tuple[int, int]:
    """Embed one unit into parts/ (tensors, then the JSON that marks it done); its number and
    size, for the progress bar."""
    embedder, out = _WORKER["embedder"], _WORKER["out"]
    if unit.shard:
        images, sentences, origins, problems = _shard_unit(unit.shard, embedder, out / "files",
                                                           _WORKER["options"])
    else:
        paths = [_WORKER["image_folder"] / name for name, _, _ in unit.files]
        images, bad = embed_images(paths, embedder, skip_bad=True, progress=False)
        sentences, origins, problems = None, [], list(bad.values())
    parts = out / "parts"
    tensors = {"rows": images.embeddings, "owner": images.owner, "detail": images.detail}
    if sentences is not None:
        tensors.update(s_rows=sentences.embeddings, s_owner=sentences.owner,
                       s_detail=sentences.detail)
    data = save({k: v.contiguous() for k, v in tensors.items()})
    write_atomically(parts / f"{unit.number:06d}.st", data)
    write_atomically(parts / f"{unit.number:06d}.json", json.dumps({
        "unit": unit.describe(), "tensors": {"bytes": len(data),
                                             "sha256": hashlib.sha256(data).hexdigest()},
        "images": images.items, "problems": redact(problems),
        "sentences": sentences.items if sentences is not None else None,
        "sentence_origins": origins}))
    return unit.number, unit.size


def _shard_unit(shard: Shard, embedder: Embedder, files: Path, options: ReadOptions
                ) -> tuple[FragmentSet, FragmentSet, list[str], list[str]]:
    """One shard streamed through the shard reader: its images embedded and written to `files`
    (boxes back in the file's pixels), its captions embedded as the collection's sentences
    with the image each describes, and the problems met."""
    notes, problems = Notes(), []
    decoded, captions, origins, parts = [], [], [], []

    def embed_decoded() -> None:
        v = image_fragments(embedder.model, decoded, "cpu")
        boxes = [torch.from_numpy(image.boxes * np.array(
            [image.size[0], image.size[1]] * 2, np.float32) / embedder.decoder.image_size)
            for image in decoded]
        parts.append(FragmentSet([image.image_id for image in decoded], v,
                                 owners([len(b) for b in boxes]), torch.cat(boxes)))
        decoded.clear()

    for sample in shard_samples(shard, options, notes):
        try:
            image = embedder.decoder.decode(sample)
        except BadSample as err:
            problems.append(f"{shard.url}: sample {sample.get('__key__')!r} skipped: {err}")
            continue
        extension = image_entry(sample)
        name = image.image_id.replace("/", "_")
        if Path(name).suffix.lower() not in IMAGE_SUFFIXES:
            name = f"{name}.{extension}"
        image = dataclasses.replace(image, image_id=name)
        write_atomically(files / name, sample[extension])
        decoded.append(image)
        for caption in json.loads(sample["json"])["captions"]:
            captions.append(caption)
            origins.append(name)
        if len(decoded) == IMAGE_BATCH:
            embed_decoded()
    if decoded:
        embed_decoded()
    problems += [problem.message for problem in notes.problems]
    images = FragmentSet.concat([_no_images(embedder), *parts])
    return images, embed_parsed(captions, embedder, warn=False), origins, problems


def _no_images(embedder: Embedder) -> FragmentSet:
    """An empty image FragmentSet (FragmentSet.concat needs one part)."""
    return FragmentSet([], torch.zeros(0, embedder.cfg.model.embed_dim),
                       torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))


def build(model: Path, out: Path, *, images: Path | None = None, shards: str | None = None,
          split: str = "val", manifest: str | None = None, sentences: Path | None = None,
          follow_links: bool = False, workers: int = 1, boxes: str | None = None,
          detector_weights: str | None = None, parser: str | None = None,
          task: Task = WHOLE_JOB, index_parts: int = 1) -> dict[str, Any]:
    """Embed `task`'s units of the folder `images`, or of the `split` of `shards`, with `model`
    into the index folder `out` (resuming from its parts/); then, when `task` is the whole job,
    write the index (else `merge` does, once every task has run); its summary. `sentences`: a
    file of sentences to index instead of the shards' captions; `index_parts`: the index split
    into that many (module doc); the rest as the flags'."""
    opened = ModelFolder.open(model)
    out = Path(out)
    if images:
        folder = Path(images).resolve()
        paths, links, skipped = _images_in(folder, follow_links)
        stamps = [(path.name, stat.st_size, stat.st_mtime_ns)
                  for path in paths for stat in [path.stat()]]
        units = [Unit(u, tuple(stamps[first:first + UNIT_FILES]))
                 for u, first in enumerate(range(0, len(stamps), UNIT_FILES))]
        source, image_folder = {"images": str(folder)}, folder
    else:
        located = locate_split(shards, split, manifest)
        units = [Unit(u, shard=shard) for u, shard in enumerate(located.shards)]
        boxes = read_manifest(located.manifest_url).get("box_source", boxes)  # the rows' boxes
        source = {"shards": redact(shards), "split": split}
        image_folder = (out / "files").resolve()
        links, skipped = {}, []
    embedder = load_one_model(opened, boxes, detector_weights, parser)
    key = {"model": embedder.model_key, "boxes": embedder.boxes, "parser": embedder.parser_name,
           "decoder": DECODER_VERSION, "source": source}
    record = {"key": key, "model": str(Path(model).resolve()), "boxes": boxes,
              "detector_weights": detector_weights,
              "sentences": str(Path(sentences).resolve()) if sentences else None,
              "image_folder": str(image_folder), "links": links, "skipped": skipped,
              "tasks": task.count, "units": [[unit.size, unit.digest] for unit in units]}
    parts = _parts_folder(out, record, replace_other=task.count == 1)
    (out / "files").mkdir(exist_ok=True)
    mine = [unit for unit in units if task.owns(unit.number)]
    todo = [unit for unit in mine if _redo(parts, unit)]
    if len(todo) < len(mine):
        log.info("resuming: %d of %d units embedded already", len(mine) - len(todo), len(mine))
    _embed_units(mine, todo, workers, opened, embedder, out, image_folder)
    if task.count > 1:
        log.info("task %d of %d: its %d units are embedded; `defrag index --merge --out %s` "
                 "writes the index once every task has run", task.index, task.count, len(mine),
                 out)
        return {"index": str(out), "task": task.index, "tasks": task.count, "units": len(mine),
                "embedded": len(todo)}
    return _merge(out, record, embedder, index_parts)


def _embed_units(mine: list[Unit], todo: list[Unit], workers: int, opened: ModelFolder,
                 embedder: Embedder, out: Path, image_folder: Path) -> None:
    """Embed the units `todo` (of a task's `mine`) into out/parts, in this process or in a pool
    of `workers` processes, with a progress bar over the task's images."""
    options = ReadOptions(verify="local")
    with tqdm(total=sum(unit.size for unit in mine), initial=sum(
            unit.size for unit in mine if unit not in todo), desc="index images",
            unit="img") as bar:
        if workers <= 1 or len(todo) <= 1:
            _use(embedder, out, image_folder, options)
            for unit in todo:
                bar.update(_embed_unit(unit)[1])
            return
        threads = max(1, (os.cpu_count() or 1) // workers)
        context = multiprocessing.get_context("spawn")
        settings = (opened, embedder.boxes, embedder.parser_name, out, image_folder, options,
                    threads)
        with context.Pool(workers, _start_worker, settings) as pool:
            for _, size in pool.imap_unordered(_embed_unit, todo):
                bar.update(size)
            pool.close()  # the workers exit on their own, their locks released (a terminated
            pool.join()  # worker's are reported leaked at exit by the resource tracker)


def merge(out: Path, index_parts: int = 1) -> dict[str, Any]:
    """Write the index of the build whose tasks embedded their units into out/parts/, with the
    settings they recorded there (parts/build.json: --sentences parsed by their parser), split
    into `index_parts` indexes (module doc); its summary."""
    stamp = Path(out) / "parts" / "build.json"
    if not stamp.is_file():
        raise RetrievalError(f"no task of a build has run in {out} (no parts/build.json): run "
                             "its tasks first")
    record = json.loads(stamp.read_text())
    embedder = load_one_model(ModelFolder.open(Path(record["model"])), record["boxes"],
                              record["detector_weights"], record["key"]["parser"])
    if embedder.model_key != record["key"]["model"]:
        raise IndexMismatch(f"{record['model']} has changed since the tasks embedded with it "
                            f"(checksums key {embedder.model_key[:16]}..., theirs "
                            f"{record['key']['model'][:16]}...): run the build again")
    return _merge(Path(out), record, embedder, index_parts)


def _merge(out: Path, record: dict[str, Any], embedder: Embedder,
           index_parts: int = 1) -> dict[str, Any]:
    """`_write_index` once every unit `record` lists is embedded; else one line naming the
    units missing and the tasks that own them."""
    tasks, missing, damaged = record["tasks"], {}, []
    for number, (_, digest) in enumerate(record["units"]):
        fault = _part_fault(out / "parts", number, digest, whole=False)
        if fault is not None:
            missing.setdefault(number % tasks, []).append(number)
            damaged += [fault] if fault else []
    if missing:
        named = "; ".join(f"unit{'s' * (len(units) > 1)} {', '.join(map(str, units[:10]))}"
                          f"{', ...' * (len(units) > 10)} (task {task} of {tasks})"
                          for task, units in sorted(missing.items()))
        raise RetrievalError(f"{out}: {sum(map(len, missing.values()))} of "
                             f"{len(record['units'])} units are not embedded yet: {named}"
                             f"{''.join(f'; {fault}' for fault in damaged[:5])}: run those "
                             "tasks again (each skips the units it finished), then the merge")
    return _write_index(out, record, embedder, index_parts)


def _images_in(folder: Path, follow_links: bool) -> tuple[list[Path], dict[str, str], list[str]]:
    """The images of `folder` to index; where those that are links leading out of it lead
    (indexed with --follow-links); and one line for each such link skipped without it (the web
    app serves an indexed file: a link out would serve whatever it leads to)."""
    kept, links, skipped = [], {}, []
    for path in list_images(folder):
        target = Path(os.path.realpath(path))
        if target.is_relative_to(folder) or follow_links:
            kept.append(path)
            if not target.is_relative_to(folder):
                links[path.name] = str(target)
            continue
        skipped.append(f"{path} is a link to {target}, outside {folder}: pass --follow-links "
                       "to index such links")
        log.warning("skipped a link out of the folder: %s", skipped[-1])
    return kept, links, skipped


def _parts_folder(out: Path, record: dict[str, Any], replace_other: bool) -> Path:
    """out/parts for the build `record` describes (written into its build.json): kept when it
    holds this build's parts (an earlier run's, other tasks'); another build's are removed
    when `replace_other` (one process does the whole build), else refused: a task cannot tell
    them from those of another task of a new build that started at the same moment."""
    parts = out / "parts"
    if replace_other and parts.exists() and _build_key(parts) != record["key"]:
        log.info("%s holds parts of another build (model, boxes, parser or source): "
                 "starting again", parts)
        shutil.rmtree(parts)
    if not parts.exists():
        _create_parts(parts, record)
    if _build_key(parts) != record["key"]:
        raise RetrievalError(f"{parts} holds the parts of another build (model, boxes, parser "
                             "or source): remove it, or build into another --out")
    if replace_other:  # one process: its settings (e.g. a new --sentences) are the build's
        write_atomically(parts / "build.json", json.dumps(record))
    elif json.loads((parts / "build.json").read_text()) != json.loads(json.dumps(record)):
        raise RetrievalError(f"{parts}/build.json records other settings of this build than "
                             "this task's (--sentences, --tasks, --detector-weights, or files "
                             "changed since): give every task the same flags and files")
    return parts


def _create_parts(parts: Path, record: dict[str, Any]) -> None:
    """parts/ created whole, its build.json in it (a task never sees it without one); the
    first of the tasks starting at the same moment creates it, the others find it."""
    fresh = parts.with_name(f"{parts.name}{TEMPORARY}{uuid.uuid4().hex[:8]}")
    fresh.mkdir(parents=True)
    (fresh / "build.json").write_text(json.dumps(record))
    try:
        fresh.rename(parts)  # fails onto a folder with files: another task's came first
    except OSError:
        shutil.rmtree(fresh)
        if not parts.exists():
            raise


def _build_key(parts: Path) -> dict[str, Any] | None:
    """The key (model, boxes, parser, decoder, source) of the build parts/ holds."""
    stamp = parts / "build.json"
    return json.loads(stamp.read_text()).get("key") if stamp.is_file() else None


def _redo(parts: Path, unit: Unit) -> bool:
    """Whether `unit` is to be embedded (again): not done, or its part damaged (said)."""
    fault = _part_fault(parts, unit.number, unit.digest, whole=True)
    if fault:
        log.warning("%s: embedding unit %d again", fault, unit.number)
    return fault is not None


def _part_fault(parts: Path, number: int, digest: str, whole: bool) -> str | None:
    """None when unit `number` is embedded as `digest` describes it (its JSON, written last,
    says so) and its tensors are there at the size and, when `whole` (a read), the sha256 the
    JSON records; '' when it is not embedded; else what is wrong, naming the file."""
    done, tensors = parts / f"{number:06d}.json", parts / f"{number:06d}.st"
    try:
        meta = json.loads(done.read_text()) if done.is_file() else {}
    except ValueError:
        return f"{done} is damaged"
    recorded = meta.get("tensors")
    if recorded is None or _digest(meta["unit"]) != digest:
        return ""
    size = tensors.stat().st_size if tensors.is_file() else None
    if size != recorded["bytes"]:
        return (f"{tensors} is missing" if size is None else
                f"{tensors} has {size} bytes, not the {recorded['bytes']} {done.name} records")
    if whole and sha256_file(tensors) != recorded["sha256"]:
        return _altered(tensors, done)
    return None


def _altered(tensors: Path, done: Path) -> str:
    return f"{tensors} is not what its unit wrote (its sha256 is not the one {done.name} records)"


def _load_part(parts: Path, number: int, recorded: dict[str, Any],
               tasks: int) -> dict[str, torch.Tensor]:
    """Unit `number`'s tensors, read once and checked against the sha256 its JSON records."""
    data = (parts / f"{number:06d}.st").read_bytes()
    if hashlib.sha256(data).hexdigest() != recorded["sha256"]:
        raise RetrievalError(_embed_again(parts, number, tasks))
    return load(data)


def _unit_shapes(parts: Path, number: int, recorded: dict[str, Any],
                 tasks: int) -> dict[str, tuple]:
    """Unit `number`'s tensors' shapes and dtypes, from its safetensors header once the file's
    sha256 is the one its JSON records (the merge sizes its arrays by them)."""
    if sha256_file(parts / f"{number:06d}.st") != recorded["sha256"]:
        raise RetrievalError(_embed_again(parts, number, tasks))
    return {name: (array.shape, array.dtype)
            for name, array in memory_map(parts / f"{number:06d}.st").items()}


def _embed_again(parts: Path, number: int, tasks: int) -> str:
    """The line for a unit's tensors altered after its JSON: the task to rerun."""
    return (f"{_altered(parts / f'{number:06d}.st', parts / f'{number:06d}.json')}: run task "
            f"{number % tasks} of {tasks} again (it embeds the unit again), then the merge")


def _write_index(out: Path, record: dict[str, Any], embedder: Embedder,
                 split: int = 1) -> dict[str, Any]:
    """Merge the parts (in unit order) into the index files, or into `split` indexes of slices
    (`_write_split`); index.json last, parts removed. `record`: the build (parts/build.json),
    with the followed links out of the folder and their targets (`links`) and a line for each
    link not followed (`skipped`)."""
    problems, origins = list(record["skipped"]), []
    metas = [json.loads((out / "parts" / f"{number:06d}.json").read_text())
             for number in range(len(record["units"]))]
    shard_of: dict[str, str] = {}
    _refuse_repeated([name for meta in metas for name in _repeated_names(meta, shard_of)])
    sentence_file = record["sentences"]
    images, sentences = _stored_units(out / "parts", metas, record["tasks"],
                                      embedder.cfg.model.embed_dim, captions=not sentence_file)
    for meta in metas:
        problems += meta["problems"]
        origins += meta["sentence_origins"]
    if not images.items:
        raise RetrievalError(f"none of the {sum(size for size, _ in record['units'])} images "
                             f"could be used ({problems[:3]}...)")
    if sentence_file:
        texts, lines = read_sentences(Path(sentence_file))
        sentences = StoredFragments.of(_embed_sentence_file(texts, embedder), "sentences")
        origins = [f"{Path(sentence_file).name}:{line}" for line in lines]
    score = embedder.cfg.objective.score
    meta = {"format": INDEX_FORMAT, **record["key"], "model_dir": record["model"],
            "image_folder": record["image_folder"], "links": record["links"], "score": score,
            "images": images.items,
            "sentences": sentences.items if sentences is not None else [],
            "sentence_origins": origins, "problems": problems}
    if split > 1:
        return _write_split(out, meta, images, sentences, split)
    write_collection(out, "images", images, score)
    if sentences is not None:
        write_collection(out, "sentences", sentences, score)
    write_atomically(out / "index.json", json.dumps(meta, ensure_ascii=False))
    shutil.rmtree(out / "parts")
    return {"index": str(out), "images": len(images.items),
            "sentences": len(meta["sentences"]), "problems": len(problems)}


def _stored_units(parts: Path, metas: list[dict[str, Any]], tasks: int, dims: int,
                  captions: bool) -> tuple[StoredFragments, StoredFragments | None]:
    """The units' image fragments, and for --shards their captions' unless `captions` is
    False (a --sentences file replaces them), as the index stores them: sized from the units'
    checked headers, then each unit read (and checked) once and appended."""
    shapes = [_unit_shapes(parts, number, meta["tensors"], tasks)
              for number, meta in enumerate(metas)]
    images = _room([name for meta in metas for name in meta["images"]], shapes, "", dims)
    captioned = [number for number, meta in enumerate(metas)
                 if captions and meta["sentences"] is not None]
    sentences = _room([text for number in captioned for text in metas[number]["sentences"]],
                      [shapes[number] for number in captioned], "s_", dims) if captioned else None
    for number, meta in enumerate(tqdm(metas, desc="merge units", unit="unit",
                                       disable=len(metas) < 8)):
        tensors = _load_part(parts, number, meta["tensors"], tasks)
        try:
            images.append(FragmentSet(meta["images"], tensors["rows"], tensors["owner"],
                                      tensors["detail"]), "images")
            if sentences is not None and meta["sentences"] is not None:
                sentences.append(FragmentSet(meta["sentences"], tensors["s_rows"],
                                             tensors["s_owner"], tensors["s_detail"]),
                                 "sentences")
        except RetrievalError as err:  # fragments that are not finite: name the unit
            raise RetrievalError(f"{parts / f'{number:06d}.st'} (unit {number}, task "
                                 f"{number % tasks} of {tasks}): {err}") from err
    return images, sentences


def _room(items: list[str], shapes: list[dict[str, tuple]], prefix: str,
          dims: int) -> StoredFragments:
    """Room for `items`' fragments, the rows that `shapes` (the units' headers) list."""
    rows = sum(shape[f"{prefix}rows"][0][0] for shape in shapes)
    width, dtype = shapes[0][f"{prefix}detail"] if shapes else ((0, 4), np.float32)
    return StoredFragments.room(items, rows, dims,
                                torch.from_numpy(np.zeros((0, *width[1:]), dtype)))


def _write_split(out: Path, meta: dict[str, Any], images: StoredFragments,
                 sentences: StoredFragments | None, split: int) -> dict[str, Any]:
    """out/part-0 ... part-(split - 1): each an ordinary index of the next slice of the images
    and of the sentences, its index.json's `split` naming its slices' offsets; then
    out/split.json listing them, all with the split's id (new at each merge: a front refuses
    parts of two merges); parts/ removed."""
    counts = {"images": len(images.items), "sentences": len(meta["sentences"])}
    for side, count in counts.items():
        if count and count < split:
            raise RetrievalError(f"--parts {split} is more than the {count} {side} of the "
                                 f"collection: give at most {count}")
    key = uuid.uuid4().hex
    listed = []
    for number in range(split):
        folder = out / f"part-{number}"
        folder.mkdir(exist_ok=True)
        (first, end), (s_first, s_end) = (
            (count * number // split, count * (number + 1) // split) for count in counts.values())
        names = set(meta["images"][first:end])
        part = {**meta, "images": meta["images"][first:end],
                "sentences": meta["sentences"][s_first:s_end],
                "sentence_origins": meta["sentence_origins"][s_first:s_end],
                "links": {name: target for name, target in meta["links"].items()
                          if name in names},
                "problems": [],  # the build's are in split.json
                "split": {"id": key, "part": number, "parts": split, "images_from": first,
                          "sentences_from": s_first}}
        write_collection(folder, "images", images.between(first, end), meta["score"])
        if sentences is not None:
            write_collection(folder, "sentences", sentences.between(s_first, s_end),
                             meta["score"])
        write_atomically(folder / "index.json", json.dumps(part, ensure_ascii=False))
        listed.append({"folder": folder.name, "images": [first, end],
                       "sentences": [s_first, s_end]})
    write_atomically(out / "split.json", json.dumps(
        {"id": key, "parts": listed, **counts, "problems": meta["problems"]}))
    shutil.rmtree(out / "parts")
    return {"index": str(out), "parts": split, **counts, "problems": len(meta["problems"])}


def _repeated_names(meta: dict[str, Any], shard_of: dict[str, str]) -> list[str]:
    """Add a unit's image names (its files in files/) to `shard_of`, with the shard they came
    from; those already there, each with the shards that hold it."""
    shard = meta["unit"].get("shard", {}).get("url", "the image folder")
    repeated = []
    for name in meta["images"]:
        if name in shard_of:
            repeated.append(f"{name!r} ({shard_of[name]}" + (
                f" and {shard})" if shard_of[name] != shard else " twice)"))
        shard_of[name] = shard
    return repeated


def _refuse_repeated(repeated: list[str]) -> None:
    """One line naming the image names of two samples (shards featurized before image ids
    were made unique per input shard, or made by hand): files/ keeps one picture per name."""
    if repeated:
        raise RetrievalError(
            f"{len(repeated)} image name(s) belong to two samples: {'; '.join(repeated[:5])}"
            f"{' ...' * (len(repeated) > 5)}: files/ keeps one picture per name, so the index "
            "would show the wrong one; give each sample its own image_id (featurize img2dataset "
            "shards again: ids are now <input shard>-<key>), then build the index again")


def _embed_sentence_file(texts: list[str], embedder: Embedder) -> FragmentSet:
    """The sentences of a --sentences file, parsed and embedded 256 at a time."""
    parts = []
    for first in tqdm(range(0, len(texts), 256), desc="index sentences", unit="x256"):
        parts.append(embed_sentences(texts[first:first + 256], embedder))
    return FragmentSet.concat(parts)


def main(argv: list[str] | None = None) -> None:
    """`defrag index ...`: build an index, a task's share of one, or merge the tasks' parts; a
    summary line of JSON."""
    parser = argparse.ArgumentParser(prog="defrag index", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model folder")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--images", type=Path, help="folder of JPEG / PNG images")
    where.add_argument("--shards", help="featurizer output folder, its URL, or a shard list")
    parser.add_argument("--split", help="split of --shards (default: val)")
    parser.add_argument("--manifest", help="the shards' manifest.json (path or URL)")
    parser.add_argument("--sentences", type=Path, help="text file, one sentence per line")
    parser.add_argument("--follow-links", action="store_true",
                        help="also index --images links that lead out of the folder (skipped "
                             "by default: the web app serves what an indexed link leads to)")
    parser.add_argument("--out", required=True, type=Path, help="the index folder")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="embedding processes")
    parser.add_argument("--boxes", choices=("selective_search", "detector", "fullframe"),
                        help="box source for --images (default: the model's training shards')")
    parser.add_argument("--detector-weights", help="state-dict file for --boxes detector")
    parser.add_argument("--parser", choices=("stanza", "spacy"), help="dependency parser")
    add_task_flags(parser)
    parser.add_argument("--merge", action="store_true",
                        help="write the index of a build split into tasks once every task has "
                             "run, with the settings they recorded (give it only --out and "
                             "--parts)")
    parser.add_argument("--parts", type=int, default=1, metavar="N",
                        help="write the index as N indexes of consecutive slices of the images "
                             "and sentences, INDEX/part-0 ... part-(N-1), and INDEX/split.json, "
                             "each served by a defrag serve --index and fronted by a defrag "
                             "serve --parts (default 1: one index)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.merge and any(getattr(args, name) not in (None, False) for name in BUILD_FLAGS):
        parser.error("--merge reads the build's settings from INDEX/parts/build.json: give it "
                     "only --out")
    if args.shards and (args.boxes or args.detector_weights):
        parser.error("--boxes and --detector-weights are for --images: an index of --shards "
                     "keeps the boxes of the shards (their manifest's box source)")
    if not args.merge and not (args.model and (args.images or args.shards)):
        parser.error("--model and one of --images / --shards are required (or --merge)")
    try:
        task = WHOLE_JOB if args.merge else task_from(args.task, args.tasks)
    except ValueError as err:
        parser.error(str(err))
    if args.parts < 1:
        parser.error(f"--parts must be >= 1, got {args.parts}")
    if args.parts > 1 and task.count > 1:
        parser.error("--parts is for the merge (or a build in one process): a task of --tasks "
                     "N only embeds its units")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with one_line_errors(parser.prog, args.debug):
        summary = merge(args.out, args.parts) if args.merge else build(
            args.model, args.out, images=args.images, shards=args.shards,
            split=args.split or "val", manifest=args.manifest, sentences=args.sentences,
            follow_links=args.follow_links, workers=args.workers, boxes=args.boxes,
            detector_weights=args.detector_weights, parser=args.parser, task=task,
            index_parts=args.parts)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

