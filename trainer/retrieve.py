"""Search with a trained model: sentence -> images and image -> sentences, and why (paper Fig. 4).

    python -m trainer.retrieve --model DIR --images FOLDER --query "a red circle on the left"
    python -m trainer.retrieve --model DIR --sentences FILE --query-image PATH --explain OUT.png

New inputs take the training code path: an image is read and checked like the featurizer reads
it (`featurizer.images.load_image`), boxed by a featurizer box source, then resized with its boxes
scaled by `trainer.reader.SampleDecoder`, exactly like a shard sample; a sentence is parsed by
`featurizer.parsing` and encoded with the model's own vocabulary (`Vocabulary.encode`). The box
source and parser are those of the model's training shards, which the model folder records
(`featurizer.json`; folders saved before it existed: the shards' manifest, when at hand);
otherwise selective search and the featurizer's default parser (`--boxes` and `--parser`
choose). Scores are eq. 6 as evaluation computes them
(`trainer.evaluate.score_matrix`, the model's smoothing).

The fragment embeddings of --images and --sentences are cached in --index-dir (default
FOLDER/.defrag-index, or beside the sentences file) as safetensors tensors plus a JSON
description, keyed by the model's checksums, the box source or parser, and each image file's name,
size and mtime (the sentences file's as a whole): a second query embeds only itself, a changed
model or box source rebuilds the index, a changed image file is embedded again.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from featurizer.boxes import BoxSource, rebuild_box_source
from featurizer.images import BadImage, load_image
from featurizer.parsing import Parser, make_parser
from featurizer.pipeline import Settings
from trainer.batch import CaptionedImage, owners, stack_pixels, unit_float
from trainer.cli import add_debug_flag, one_line_errors
from trainer.config import Config
from trainer.evaluate import score_matrix
from trainer.model import DeFragModel
from trainer.pictures import best_boxes, fragment_labels, render_alignment
from trainer.reader import BadSample, SampleDecoder
from trainer.registry import CHECKSUMS, FEATURIZER, load_model_folder, training_featurizer
from trainer.vocab import Vocabulary

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
INDEX_DIR = ".defrag-index"
INDEX_FORMAT = 1
IMAGE_BATCH = 16  # images per CNN pass while indexing
DEFAULT_BOXES = "selective_search"


class RetrievalError(ValueError):
    """A retrieval input that cannot be used; the message names it."""


# ---------------------------------------------------------------- fragments of many items


@dataclass
class FragmentSet:
    """Fragment embeddings of several items (images or sentences), grouped by item.

    Item k owns the consecutive rows `owner == k`. `detail` says what each fragment is: for
    images its box, float [N, 4] xyxy in the file's pixels; for sentences its (relation, w1, w2)
    word ids, long [N, 3].
    """

    items: list[str]  # image file names or sentences
    embeddings: torch.Tensor  # float [N, d]
    owner: torch.Tensor  # long [N]
    detail: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        """Fragments of each item [len(items)]."""
        return torch.bincount(self.owner, minlength=len(self.items))

    def of(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings and details of item k's fragments."""
        one = self.select([k])
        return one.embeddings, one.detail

    def select(self, keep: Sequence[int]) -> FragmentSet:
        """The items `keep`, in that order."""
        start = [0, *self.counts.cumsum(0).tolist()]
        rows = [torch.arange(start[k], start[k + 1]) for k in keep]
        index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return FragmentSet([self.items[k] for k in keep], self.embeddings[index],
                           owners([len(r) for r in rows]), self.detail[index])

    @staticmethod
    def concat(parts: Sequence[FragmentSet]) -> FragmentSet:
        """The items of all `parts` one after the other (at least one part)."""
        return FragmentSet([item for part in parts for item in part.items],
                           torch.cat([part.embeddings for part in parts]),
                           owners([n for part in parts for n in part.counts.tolist()]),
                           torch.cat([part.detail for part in parts]))


# ---------------------------------------------------------------- the recipe for new inputs


@dataclass
class Recipe:
    """How new inputs become fragments for one model: the box source (as a `describe()` dict)
    and the parser, chosen up front and built only when something needs embedding."""

    model: DeFragModel
    cfg: Config
    vocab: Vocabulary
    model_key: str  # sha256 of the model folder's checksums.json
    boxes: dict[str, Any]
    parser_name: str

    @functools.cached_property
    def box_source(self) -> BoxSource:
        return rebuild_box_source(self.boxes)

    @functools.cached_property
    def parser(self) -> Parser:
        parser = make_parser(self.parser_name)
        parser.check()
        return parser

    @functools.cached_property
    def decoder(self) -> SampleDecoder:
        return SampleDecoder.from_config(self.cfg, self.vocab)


def make_recipe(model_dir: Path, boxes: str | None, detector_weights: str | None,
                parser: str | None) -> Recipe:
    """Load the model folder and choose its box source and parser (see the module docstring)."""
    model, cfg, vocab = load_model_folder(model_dir)
    model_key = hashlib.sha256((model_dir / CHECKSUMS).read_bytes()).hexdigest()
    manifest = _training_featurizer(model_dir, cfg)
    return Recipe(model, cfg, vocab, model_key, _choose_boxes(cfg, manifest, boxes,
                                                              detector_weights),
                  _choose_parser(manifest, parser))


def _training_featurizer(model_dir: Path, cfg: Config) -> dict | None:
    """Parser and box source of the model's training shards: from the model folder (written at
    save time), else from the shards' manifest when this machine has it."""
    saved = model_dir / FEATURIZER
    if saved.is_file():
        return json.loads(saved.read_text())
    found = training_featurizer(cfg)
    if found is None:
        log.info("neither the model folder (%s) nor the manifest of its training shards (%s) is "
                 "here: box source and parser are not known from training", FEATURIZER,
                 cfg.data.shards)
    return found


def _choose_boxes(cfg: Config, manifest: dict | None, name: str | None,
                  detector_weights: str | None) -> dict[str, Any]:
    """The box source description: --boxes, else the training one (when new images can have
    it), else selective search. A fullframe-only model needs only the whole image."""
    if cfg.model.fullframe_only:
        log.info("boxes: the whole image only (a fullframe model uses no other box)")
        return {"name": "fullframe", "options": {}}
    if name is not None:
        options = {"weights": detector_weights} if name == "detector" else {}
        return {"name": name, "options": options}
    trained = (manifest or {}).get("box_source")
    if trained is not None and trained["name"] != "given":
        log.info("boxes: %s, as in the model's training shards", trained["name"])
        return trained
    if trained is not None:
        log.warning("boxes: the model was trained on %r boxes, which new images do not have: "
                    "using %s (choose with --boxes)", trained["name"], DEFAULT_BOXES)
    else:
        log.warning("boxes: using %s (choose with --boxes)", DEFAULT_BOXES)
    return {"name": DEFAULT_BOXES, "options": {}}


def _choose_parser(manifest: dict | None, name: str | None) -> str:
    """--parser, else the training shards' parser, else the featurizer's default."""
    if name is not None:
        return name
    trained = (manifest or {}).get("parser", {}).get("name")
    if trained is not None:
        log.info("parser: %s, as in the model's training shards", trained)
        return trained
    log.warning("parser: using %s, the featurizer's default (choose with --parser)",
                Settings.parser)
    return Settings.parser


# ---------------------------------------------------------------- embedding new inputs


def read_image(path: Path, recipe: Recipe) -> tuple[CaptionedImage, np.ndarray]:
    """One image file as the trainer sees it (a shard sample without captions), and its boxes
    in the file's pixels. BadImage / BadSample name the problem."""
    loaded = load_image(path)
    boxes, _ = recipe.box_source(loaded.image)
    meta = {"image_id": path.name, "width": loaded.image.width, "height": loaded.image.height,
            "boxes": boxes, "captions": []}
    image = recipe.decoder.decode({loaded.extension: loaded.data, "json": json.dumps(meta)})
    return image, np.asarray(boxes[:len(image.boxes)], dtype=np.float32).reshape(-1, 4)


@torch.no_grad()
def embed_images(paths: Sequence[Path], recipe: Recipe, skip_bad: bool,
                 device: str = "cpu") -> tuple[FragmentSet, dict[str, str]]:
    """Image fragments of `paths`, IMAGE_BATCH images per CNN pass, with a progress bar, and
    the unusable files' problems by name: each is skipped with a warning naming the file
    (`skip_bad`), else an error."""
    parts = [FragmentSet([], torch.zeros(0, recipe.cfg.model.embed_dim),
                         torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))]
    problems: dict[str, str] = {}
    with tqdm(total=len(paths), desc="embed images", unit="img", disable=not paths) as bar:
        for first in range(0, len(paths), IMAGE_BATCH):
            images, names, boxes = [], [], []
            for path in paths[first:first + IMAGE_BATCH]:
                try:
                    image, file_boxes = read_image(path, recipe)
                except (BadImage, BadSample) as err:
                    problem = str(err) if isinstance(err, BadImage) else f"{path}: {err}"
                    if not skip_bad:
                        raise RetrievalError(f"unusable image: {problem}") from err
                    log.warning("skipped an unusable image: %s", problem)
                    problems[path.name] = problem
                else:
                    images.append(image)
                    names.append(path.name)
                    boxes.append(torch.from_numpy(file_boxes))
                bar.update()
            if images:
                parts.append(FragmentSet(names, _image_fragments(recipe.model, images, device),
                                         owners([len(b) for b in boxes]), torch.cat(boxes)))
    return FragmentSet.concat(parts), problems


def _image_fragments(model: DeFragModel, images: list[CaptionedImage],
                     device: str) -> torch.Tensor:
    """v [N_box, d] of decoded images, as the evaluation embeds an image batch."""
    pixels = stack_pixels(images)
    boxes = torch.from_numpy(np.concatenate([image.boxes for image in images]))
    box_image = owners([len(image.boxes) for image in images])
    v = model.image(unit_float(pixels.to(device)), boxes.to(device),
                    box_image.to(device))
    return v.float().cpu()


@torch.no_grad()
def embed_sentences(texts: Sequence[str], recipe: Recipe, device: str = "cpu") -> FragmentSet:
    """Sentence fragments of `texts`; a sentence with no fragment the model knows is warned
    about (it scores 0 with every image, eq. 6)."""
    mode = recipe.cfg.model.fragment_mode
    parsed = recipe.parser.parse(list(texts)) if texts else []
    ids = [recipe.vocab.encode(p.caption(text), mode) for text, p in zip(texts, parsed,
                                                                          strict=True)]
    for text, fragments in zip(texts, ids, strict=True):
        if not len(fragments):
            log.warning("%r has no fragment the model knows (no %s with every word and relation "
                        "in its vocabulary of %d words): it scores 0 with everything", text,
                        "triplet" if mode == "triplet" else f"{mode} fragment",
                        len(recipe.vocab.words))
    fragments = torch.cat(ids) if ids else torch.zeros(0, 3, dtype=torch.long)
    sentence = owners([len(f) for f in ids])
    s = recipe.model.sentence(fragments.to(device), sentence.to(device)).float().cpu()
    return FragmentSet(list(texts), s, sentence, fragments)


# ---------------------------------------------------------------- the cached index


def _save(directory: Path, stem: str, fragments: FragmentSet, meta: dict[str, Any]) -> None:
    """`stem`.safetensors (tensors) and `stem`.json (meta + items), each written atomically;
    a shared token tells a matching pair from a half-written one."""
    token = uuid.uuid4().hex
    tensors = {"embeddings": fragments.embeddings, "owner": fragments.owner,
               "detail": fragments.detail}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{stem}.safetensors.tmp-{token[:8]}"
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"token": token})
        os.replace(tmp, directory / f"{stem}.safetensors")
        tmp = directory / f".{stem}.json.tmp-{token[:8]}"
        tmp.write_text(json.dumps({"format": INDEX_FORMAT, "token": token, **meta,
                                   "items": fragments.items}, ensure_ascii=False, indent=1))
        os.replace(tmp, directory / f"{stem}.json")
    except OSError as err:
        log.warning("cannot write the index cache in %s (%s): the next query embeds again",
                    directory, err)


def _load(directory: Path, stem: str) -> tuple[FragmentSet, dict[str, Any]] | None:
    """The cached fragments and meta of `stem`, or None (missing, unreadable, mismatched)."""
    meta_path, tensor_path = directory / f"{stem}.json", directory / f"{stem}.safetensors"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        with safe_open(tensor_path, framework="pt") as tensors:
            token = (tensors.metadata() or {}).get("token")
            fragments = FragmentSet(list(meta["items"]), tensors.get_tensor("embeddings"),
                                    tensors.get_tensor("owner"), tensors.get_tensor("detail"))
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        log.warning("index cache %s is unreadable (%s): rebuilding it", meta_path, err)
        return None
    if meta.get("format") != INDEX_FORMAT or meta.get("token") != token:
        log.warning("index cache %s does not match its tensors: rebuilding it", meta_path)
        return None
    return fragments, meta


def _stamp(path: Path) -> dict[str, Any]:
    """What identifies a file's content cheaply: name, size and modification time."""
    stat = path.stat()
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def list_images(folder: Path) -> list[Path]:
    """The JPEG / PNG files of `folder` (not its subfolders), by name; an error when none."""
    if not folder.is_dir():
        raise RetrievalError(f"--images {folder}: no such folder")
    paths = sorted(p for p in folder.iterdir()
                   if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                   and not p.name.startswith("."))
    if not paths:
        raise RetrievalError(f"--images {folder}: no {', '.join(IMAGE_SUFFIXES)} image in it")
    return paths


def image_index(folder: Path, index_dir: Path, recipe: Recipe, device: str) -> FragmentSet:
    """The fragments of every usable image of `folder`: cached ones whose file is unchanged, the
    others embedded now; the cache is rewritten when anything changed. Unusable files are
    remembered as such (and warned about again) until they change."""
    paths = list_images(folder)
    stamps = {path.name: _stamp(path) for path in paths}
    key = {"model": recipe.model_key, "boxes": recipe.boxes}
    cached, meta = _load(index_dir, "images") or (None, {})
    if cached is not None and any(meta.get(k) != value for k, value in key.items()):
        what = "model" if meta.get("model") != recipe.model_key else "box source"
        log.info("image index %s: built with another %s: rebuilding", index_dir, what)
        cached, meta = None, {}
    known = {stamp["name"]: k for k, stamp in enumerate(meta.get("stamps", []))
             if stamps.get(stamp["name"]) == stamp}
    unusable = {entry["stamp"]["name"]: entry for entry in meta.get("unusable", [])
                if stamps.get(entry["stamp"]["name"]) == entry["stamp"]}
    for entry in unusable.values():
        log.warning("skipped an unusable image (cached verdict): %s", entry["reason"])
    todo = [path for path in paths if path.name not in known and path.name not in unusable]
    if cached is not None and not todo and (len(known), len(unusable)) == (
            len(meta["stamps"]), len(meta["unusable"])):  # nothing new, changed or removed
        log.info("image index %s: all %d images cached, up to date", index_dir, len(known))
        return _usable(cached, folder, len(paths))
    if cached is not None:
        changed = sorted({p.name for p in todo} & set(cached.items))
        log.info("image index %s: %d images cached, %d new, %d changed %s, %d removed",
                 index_dir, len(known), len(todo) - len(changed), len(changed), changed,
                 len(cached.items) - len(known) - len(changed))
    fresh, problems = embed_images(todo, recipe, skip_bad=True, device=device)
    merged = fresh if cached is None else FragmentSet.concat(
        [cached.select(list(known.values())), fresh])
    position = {name: k for k, name in enumerate(merged.items)}
    merged = merged.select([position[p.name] for p in paths if p.name in position])
    unusable.update({name: {"stamp": stamps[name], "reason": reason}
                     for name, reason in problems.items()})
    _save(index_dir, "images", merged, {**key, "stamps": [stamps[n] for n in merged.items],
                                        "unusable": list(unusable.values())})
    log.info("image index %s: %d images written", index_dir, len(merged.items))
    return _usable(merged, folder, len(paths))


def _usable(images: FragmentSet, folder: Path, files: int) -> FragmentSet:
    """`images`, unless there is none: an error."""
    if not images.items:
        raise RetrievalError(f"--images {folder}: none of its {files} images is usable (see "
                             f"the warnings)")
    return images


def read_sentences(path: Path) -> tuple[list[str], list[int]]:
    """The non-blank lines of a sentences file and their 1-based line numbers."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RetrievalError(f"--sentences {path}: cannot read it ({err})") from err
    numbered = [(line.strip(), n) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise RetrievalError(f"--sentences {path}: no sentence in it (one per line)")
    return [text for text, _ in numbered], [n for _, n in numbered]


def sentence_index(path: Path, index_dir: Path, recipe: Recipe,
                   device: str) -> tuple[FragmentSet, list[int]]:
    """The fragments of every sentence of `path` and their line numbers, cached as a whole."""
    key = {"model": recipe.model_key, "parser": recipe.parser_name,
           "file": {**_stamp(path), "path": str(path.resolve())}}
    cached = _load(index_dir, "sentences")
    if cached is not None and {k: cached[1].get(k) for k in key} == key:
        log.info("sentence index %s: all %d sentences cached, up to date", index_dir,
                 len(cached[0].items))
        return cached[0], cached[1]["lines"]
    if cached is not None:
        log.info("sentence index %s: the model, parser or sentences file changed: rebuilding",
                 index_dir)
    texts, lines = read_sentences(path)
    fragments = embed_sentences(texts, recipe, device)
    _save(index_dir, "sentences", fragments, {**key, "lines": lines})
    log.info("sentence index %s: %d sentences written", index_dir, len(texts))
    return fragments, lines


# ---------------------------------------------------------------- ranking and explaining


def rank(images: FragmentSet, sentences: FragmentSet, smooth: float) -> torch.Tensor:
    """Eq. 6 scores S [images, sentences], as trainer.evaluate scores a test set."""
    return score_matrix(images.embeddings, images.owner, sentences.embeddings, sentences.owner,
                        len(images.items), len(sentences.items), smooth)


def top_k(scores: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k best (index, score) of a score vector, best first (the first index on ties)."""
    order = torch.argsort(scores, descending=True, stable=True)[:k]
    return [(int(i), float(scores[i])) for i in order]


def explain(image_path: Path, image: FragmentSet, sentence: FragmentSet, recipe: Recipe,
            out: Path) -> list[dict[str, Any]]:
    """Figure 4 for one image and one sentence (one item each): every sentence fragment linked
    to its best box, drawn to `out`; returns the alignment, one entry per fragment."""
    v, boxes = image.of(0)
    s, ids = sentence.of(0)
    if not len(s):
        log.warning("nothing to explain: %r has no fragment the model knows; %s not written",
                    sentence.items[0], out)
        return []
    box, score = best_boxes(v, s)
    labels = fragment_labels(ids, recipe.vocab, recipe.cfg.model.fragment_mode)
    try:
        pixels = load_image(image_path).image
    except BadImage as err:
        raise RetrievalError(f"cannot draw the explanation: {err}") from err
    picture = render_alignment(pixels, boxes.tolist(), sentence.items, labels, box.tolist(),
                               score.tolist())
    out.parent.mkdir(parents=True, exist_ok=True)
    picture.save(out)
    return [{"fragment": label, "box": int(b), "xyxy": [round(c, 1) for c in boxes[b].tolist()],
             "score": float(sc)} for label, b, sc in zip(labels, box, score, strict=True)]


# ---------------------------------------------------------------- command line


def search(args: argparse.Namespace) -> dict[str, Any]:
    """Build or refresh the indexes, answer the queries, explain the first one: the report."""
    if args.query and args.images is None:
        raise RetrievalError("--query ranks images: also pass --images FOLDER")
    if args.query_image and args.sentences is None:
        raise RetrievalError("--query-image ranks sentences: also pass --sentences FILE")
    recipe = make_recipe(args.model, args.boxes, args.detector_weights, args.parser)
    recipe.model.to(args.device)
    index_dir = args.index_dir or (args.images or args.sentences.parent) / INDEX_DIR
    images = image_index(args.images, index_dir, recipe, args.device) if args.images else None
    sentences, lines = (sentence_index(args.sentences, index_dir, recipe, args.device)
                        if args.sentences else (None, []))
    report: dict[str, Any] = {"model": str(args.model), "index_dir": str(index_dir),
                              "images": len(images.items) if images else 0,
                              "sentences": len(sentences.items) if sentences else 0,
                              "queries": []}
    pairs = []  # (image file, image, sentence) of each query's top result, for --explain
    smooth = recipe.cfg.objective.smooth
    if args.query:
        queries = embed_sentences(args.query, recipe, args.device)
        scores = rank(images, queries, smooth)
        for q, text in enumerate(queries.items):
            best = top_k(scores[:, q], args.top_k)
            report["queries"].append({
                "kind": "sentence", "query": text, "fragments": int(queries.counts[q]),
                "results": [{"rank": r, "score": score, "image": images.items[i]}
                            for r, (i, score) in enumerate(best, 1)]})
            pairs.append((args.images / images.items[best[0][0]], images.select([best[0][0]]),
                          queries.select([q])))
    for path in args.query_image:
        query, _ = embed_images([path], recipe, skip_bad=False, device=args.device)
        best = top_k(rank(query, sentences, smooth)[0], args.top_k)
        report["queries"].append({
            "kind": "image", "query": str(path), "boxes": int(query.counts[0]),
            "results": [{"rank": r, "score": score, "sentence": sentences.items[i],
                         "line": lines[i]} for r, (i, score) in enumerate(best, 1)]})
        pairs.append((path, query, sentences.select([best[0][0]])))
    if args.explain and pairs:
        image_path, image, sentence = pairs[0]
        alignment = explain(image_path, image, sentence, recipe, args.explain)
        report["explain"] = {"image": str(image_path), "sentence": sentence.items[0],
                             "picture": str(args.explain) if alignment else None,
                             "fragments": alignment}
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as readable tables."""
    lines = [f"model {report['model']}: {report['images']} images, {report['sentences']} "
             f"sentences indexed in {report['index_dir']}"]
    for query in report["queries"]:
        if query["kind"] == "sentence":
            lines += ["", f"{query['query']!r} ({query['fragments']} fragments) -> images",
                      f"{'rank':>4}  {'score':>8}  image"]
            lines += [f"{r['rank']:>4}  {r['score']:8.4f}  {r['image']}" for r in query["results"]]
        else:
            lines += ["", f"{query['query']} ({query['boxes']} boxes) -> sentences",
                      f"{'rank':>4}  {'score':>8}  {'line':>5}  sentence"]
            lines += [f"{r['rank']:>4}  {r['score']:8.4f}  {r['line']:>5}  {r['sentence']}"
                      for r in query["results"]]
    if "explain" in report:
        explained = report["explain"]
        lines += ["", f"explain {explained['sentence']!r} on {explained['image']} -> "
                      f"{explained['picture']}",
                  f"{'fragment':<32} {'box':>3}  {'score':>7}  box xyxy (pixels)"]
        lines += [f"{f['fragment']:<32} {f['box']:>3}  {f['score']:7.3f}  {f['xyxy']}"
                  for f in explained["fragments"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.retrieve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="model folder (a run's best/ or a registry download)")
    parser.add_argument("--images", type=Path, help="folder of JPEG / PNG images to search")
    parser.add_argument("--sentences", type=Path, help="text file, one sentence per line")
    parser.add_argument("--query", action="append", default=[], metavar="SENTENCE",
                        help="rank the --images for this sentence (repeatable)")
    parser.add_argument("--query-image", action="append", default=[], type=Path,
                        metavar="PATH", help="rank the --sentences for this image (repeatable)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--index-dir", type=Path,
                        help=f"index cache (default: IMAGES/{INDEX_DIR}, or beside SENTENCES)")
    parser.add_argument("--explain", type=Path, metavar="OUT.png",
                        help="draw the first query's alignment with its top result (Figure 4)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--boxes", choices=("selective_search", "detector", "fullframe"),
                        help="box source (default: the training shards', else "
                             f"{DEFAULT_BOXES})")
    parser.add_argument("--detector-weights", help="state-dict file for --boxes detector")
    parser.add_argument("--parser", choices=("stanza", "spacy"),
                        help="dependency parser (default: the training shards', else "
                             f"{Settings.parser})")
    parser.add_argument("--device", default="cpu")
    add_debug_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.retrieve ...`: a table (or --json) on stdout, progress on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.images is None and args.sentences is None:
        parser.error("pass --images FOLDER and/or --sentences FILE")
    if args.top_k < 1:
        parser.error(f"--top-k must be >= 1, got {args.top_k}")
    if args.boxes == "detector" and not args.detector_weights:
        parser.error("--boxes detector needs --detector-weights FILE (a Faster R-CNN state dict)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with one_line_errors(parser.prog, args.debug):
        report = search(args)
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json
          else format_report(report))


if __name__ == "__main__":
    main()
