"""Search with a trained model: sentence -> images and image -> sentences, and why (paper Fig. 4).

    defrag retrieve --model DIR --images FOLDER --query "a red circle on the left"
    defrag retrieve --model DIR --sentences FILE --query-image PATH --explain OUT.png
    defrag retrieve --model DIR --images DIR --query-image X.jpg --minus blue --plus red

New inputs take the training code path: an image is read and checked like the featurizer reads
it (`featurizer.images.load_image`), boxed by a featurizer box source, then resized with its boxes
scaled by `trainer.data.reader.SampleDecoder`, exactly like a shard sample; a sentence is parsed by
`featurizer.parsing` and encoded with the model's own vocabulary (`Vocabulary.encode`). The box
source and parser are those of the model's training shards, which the model folder records
(`featurizer.json`; folders saved before it existed: the shards' manifest, when at hand);
otherwise selective search and the featurizer's default parser (`--boxes` and `--parser`
choose). Scores are the model's `objective.score` (eq. 6 by default) as evaluation computes them
(`trainer.objectives.score_matrix`, the model's smoothing).

--explain draws the first query against its top result: for the fragments sentence encoder each
sentence fragment linked to its best box (Figure 4, trainer.search.explain.explain); for a
whole-sentence encoder each word's contribution to the score, by leaving it out
(trainer.search.explain.explain_words). --minus / --plus make a --query-image rank the --images by
Kiros et al.'s multimodal vector arithmetic (trainer.search.arithmetic; linear encoder only).

--index INDEX searches a collection embedded once by `defrag index` (any size: a faiss first
stage, then the model's score over the items it could not rule out) instead of --images /
--sentences. Each query then says whether its top k is proven exact (`"exact"`: the certificate
of docs/design.md, "Certified search"; within --budget-s seconds), and --exact-scan scores every
item instead (the reference).

The fragment embeddings of --images and --sentences are cached in --index-dir (default
FOLDER/.defrag-index, or beside the sentences file) as safetensors tensors plus a JSON
description, keyed by the model's checksums, the box source or parser, and each image file's name,
size and mtime (the sentences file's as a whole): a second query embeds only itself, a changed
model or box source rebuilds the index, a changed image file is embedded again.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from defrag.cli import add_debug_flag, one_line_errors
from featurizer.pipeline import Settings
from trainer.search.arithmetic import arithmetic_scores, check_encoder, expression, term_vectors
from trainer.search.embedder import (
    DEFAULT_BOXES,
    Embedder,
    RetrievalError,
    embed_images,
    embed_sentences,
)
from trainer.search.embedding_cache import CACHE_DIR, image_embeddings, sentence_embeddings
from trainer.search.explain import explain, explain_words
from trainer.search.fragment_set import FragmentSet, rank, top_k
from trainer.search.index import BUDGET_S, SearchIndex
from trainer.search.retrieval_report import format_report
from trainer.store.model_folder import ModelFolder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrievalRequest:
    """What `defrag retrieve` is asked (its flags, as main checked them): the model (or
    ensemble) folder; what to search (a folder of `images`, a file of `sentences`, one a line,
    or an `index`); the sentences that rank the images (`query`), the images that rank the
    sentences (`query_image`), or with words taken from them and added to them the images
    (`minus`, `plus`: Kiros et al.'s eq. 15); the embedding cache (`index_dir`); where to draw
    Figure 4 (`explain`); the box source and parser (default: the model's training shards');
    with an index, whether to score every item (`exact_scan`) and for how long a search may
    widen its first stage (`budget_s`)."""

    model: Path
    images: Path | None = None
    sentences: Path | None = None
    index: Path | None = None
    query: Sequence[str] = ()
    query_image: Sequence[Path] = ()
    minus: Sequence[str] = ()
    plus: Sequence[str] = ()
    top_k: int = 5
    index_dir: Path | None = None
    explain: Path | None = None
    boxes: str | None = None
    detector_weights: str | None = None
    parser: str | None = None
    device: str = "cpu"
    exact_scan: bool = False
    budget_s: float = BUDGET_S

    @property
    def arithmetic(self) -> bool:
        return bool(self.minus or self.plus)


def search(request: RetrievalRequest) -> dict[str, Any]:
    """Build or refresh the embedding caches, answer the queries, explain the first one: the
    report."""
    check_request(request)
    folders, weights = zip(*ModelFolder.open(request.model).members, strict=True)
    if len(folders) > 1 and (request.explain or request.arithmetic):
        raise RetrievalError(f"{request.model} is an ensemble of {len(folders)} models; "
                             "--explain and --minus/--plus read one model: pass one of its "
                             f"members, e.g. --model {folders[0].path}")
    members = [Embedder.from_folder(folder, request.boxes, request.detector_weights,
                                    request.parser) for folder in folders]
    embedder = members[0]  # the one model, or the ensemble's first member (reports, checks)
    if request.arithmetic:
        check_encoder(embedder)
    for member in members:
        member.model.to(request.device)
    if request.arithmetic:  # before the indexes: a word outside the vocabulary fails at once
        minus = term_vectors(request.minus, "--minus", embedder, request.device)
        plus = term_vectors(request.plus, "--plus", embedder, request.device)
    index_dir = request.index_dir or (request.images or request.sentences.parent) / CACHE_DIR
    # an ensemble keeps one index per member, in a subfolder named after it
    index_dirs = [index_dir] if len(folders) == 1 else [index_dir / f.path.name for f in folders]
    member_images, member_sentences, lines = embed_collection(request, index_dirs, members)
    images = member_images[0] if member_images else None
    sentences = member_sentences[0] if member_sentences else None
    report: dict[str, Any] = {"model": str(request.model), "index_dir": str(index_dir),
                              "images": len(images.items) if images else 0,
                              "sentences": len(sentences.items) if sentences else 0,
                              "queries": []}
    if len(members) > 1:
        report["ensemble"] = [str(folder.path) for folder in folders]
    answered, pairs = sentence_queries(request, members, weights, member_images)
    if request.arithmetic:
        answered += [arithmetic_query(path, embedder, images, minus, plus, request)
                     for path in request.query_image]
    else:
        by_image, image_pairs = image_queries(request, members, weights, member_sentences,
                                              lines)
        answered, pairs = answered + by_image, pairs + image_pairs
    report["queries"] = answered
    if request.explain:
        report["explain"] = explain_pair(request, *pairs[0], embedder)
    return report


def check_request(request: RetrievalRequest) -> None:
    """RetrievalError unless the queries have something to rank: --query the --images,
    --query-image the --sentences (or, with --minus/--plus, the --images)."""
    if request.query and request.images is None:
        raise RetrievalError("--query ranks images: also pass --images FOLDER")
    if request.arithmetic and not (request.query_image and request.images):
        raise RetrievalError("--minus/--plus change a --query-image, which then ranks the "
                             "--images: pass --query-image PATH and --images FOLDER")
    if request.query_image and not request.arithmetic and request.sentences is None:
        raise RetrievalError("--query-image ranks sentences: also pass --sentences FILE")
    if request.explain and not (request.query or request.query_image and not request.arithmetic):
        raise RetrievalError("--explain draws a sentence against an image: pass a --query, or "
                             "a --query-image without --minus/--plus")


def embed_collection(request: RetrievalRequest, index_dirs: list[Path], members: list[Embedder]
                     ) -> tuple[list[FragmentSet], list[FragmentSet], list[int]]:
    """Each member's fragments of the --images and of the --sentences, from its cache in its
    index folder (refreshed first), and each sentence's line number in the file."""
    member_images = [image_embeddings(request.images, where, member, request.device)
                     for where, member in zip(index_dirs, members, strict=True)
                     if request.images]
    member_sentences, lines = [], []
    for where, member in zip(index_dirs, members, strict=True):
        if request.sentences:
            fragments, lines = sentence_embeddings(request.sentences, where, member,
                                                   request.device)
            member_sentences.append(fragments)
    return member_images, member_sentences, lines


def sentence_queries(request: RetrievalRequest, members: list[Embedder],
                     weights: Sequence[float], member_images: list[FragmentSet]
                     ) -> tuple[list[dict[str, Any]], list[tuple[Path, FragmentSet, FragmentSet]]]:
    """The images ranked for each --query: its report entries, and its top (image file, image,
    sentence), for --explain."""
    if not request.query:
        return [], []
    queries = [embed_sentences(request.query, member, request.device) for member in members]
    scores = ensemble_scores(members, weights, member_images, queries)
    images = member_images[0]
    # what the model reads of each: its fragments, or (one row each) its known words
    unit, sizes = (("words", queries[0].detail[:, 0])
                   if members[0].model.sentence.whole_sentence
                   else ("fragments", queries[0].counts))
    entries, pairs = [], []
    for q, text in enumerate(queries[0].items):
        best = top_k(scores[:, q], request.top_k)
        entries.append({
            "kind": "sentence", "query": text, unit: int(sizes[q]),
            "results": [{"rank": r, "score": score, "image": images.items[i]}
                        for r, (i, score) in enumerate(best, 1)]})
        pairs.append((request.images / images.items[best[0][0]], images.select([best[0][0]]),
                      queries[0].select([q])))
    return entries, pairs


def image_queries(request: RetrievalRequest, members: list[Embedder], weights: Sequence[float],
                  member_sentences: list[FragmentSet], lines: list[int]
                  ) -> tuple[list[dict[str, Any]], list[tuple[Path, FragmentSet, FragmentSet]]]:
    """The sentences ranked for each --query-image: its report entries, and its top (image
    file, image, sentence), for --explain."""
    entries, pairs = [], []
    for path in request.query_image:
        queries = [embed_images([path], member, skip_bad=False, device=request.device)[0]
                   for member in members]
        best = top_k(ensemble_scores(members, weights, queries, member_sentences)[0],
                     request.top_k)
        sentences = member_sentences[0]
        entries.append({
            "kind": "image", "query": str(path), "boxes": int(queries[0].counts[0]),
            "results": [{"rank": r, "score": score, "sentence": sentences.items[i],
                         "line": lines[i]} for r, (i, score) in enumerate(best, 1)]})
        pairs.append((path, queries[0], sentences.select([best[0][0]])))
    return entries, pairs


def explain_pair(request: RetrievalRequest, image_path: Path, image: FragmentSet,
                 sentence: FragmentSet, embedder: Embedder) -> dict[str, Any]:
    """Figure 4 for a query and its top result, drawn to --explain: what the report says of it."""
    whole_sentence = embedder.model.sentence.whole_sentence
    explained = {"image": str(image_path), "sentence": sentence.items[0]}
    if whole_sentence:
        picture, details = explain_words(image_path, image, sentence.items[0], embedder,
                                         request.device)
    else:
        picture, details = explain(image_path, image, sentence, embedder)
    if picture is not None:
        request.explain.parent.mkdir(parents=True, exist_ok=True)
        picture.save(request.explain)
    else:
        log.warning("%s not written", request.explain)
    explained.update({"picture": str(request.explain) if picture is not None else None,
                      "words" if whole_sentence else "fragments": details})
    return explained


def index_search(request: RetrievalRequest) -> dict[str, Any]:
    """The report of `search` answered from a search index (trainer.search.index): the
    certified top k of a collection of any size, embedded once."""
    if request.minus or request.plus or request.images or request.sentences:
        raise RetrievalError("--index holds the images and sentences to search: drop --images, "
                             "--sentences, --minus and --plus")
    if request.explain and not request.query:
        raise RetrievalError("with --index, --explain draws a --query against its top image")
    index = SearchIndex.open(request.index, request.model)
    whole_sentence = index.embedder.model.sentence.whole_sentence
    report: dict[str, Any] = {"model": str(request.model), "index_dir": str(request.index),
                              "images": len(index.image_names),
                              "sentences": len(index.sentences), "queries": []}
    for text in request.query:
        query = index.query_rows(text)
        unit, size = (("words", int(query.detail[0, 0])) if whole_sentence
                      else ("fragments", len(query.embeddings)))
        found = index.images_for_rows(query, request.top_k, request.exact_scan,
                                      request.budget_s)
        report["queries"].append({
            "kind": "sentence", "query": text, unit: size, **found.proof(),
            "results": [{"rank": r, "score": hit.score, "image": hit.item}
                        for r, hit in enumerate(found.hits, 1)]})
    origins = index.meta["sentence_origins"]
    for path in request.query_image:
        image, _ = embed_images([path], index.embedder, skip_bad=False, progress=False)
        found = index.sentences_for_rows(image, request.top_k, request.exact_scan,
                                         request.budget_s)
        report["queries"].append({
            "kind": "image", "query": str(path), "boxes": int(image.counts[0]), **found.proof(),
            "results": [{"rank": r, "score": hit.score, "sentence": hit.item,
                         "line": origins[hit.position]} for r, hit in enumerate(found.hits, 1)]})
    if request.explain:
        top = report["queries"][0]["results"][0]["image"]
        picture, details = index.explain(request.query[0], top)
        request.explain.parent.mkdir(parents=True, exist_ok=True)
        picture.save(request.explain)
        report["explain"] = {**details, "image": str(index.image_file(top)),
                             "picture": str(request.explain)}
    return report


def ensemble_scores(members: list[Embedder], weights: Sequence[float],
                    images: list[FragmentSet], sentences: list[FragmentSet]) -> torch.Tensor:
    """Scores [images, sentences]: each member's own (its `objective.score`, as the evaluation
    scores), summed with the ensemble's weights (one model: its scores)."""
    for part in (images, sentences):
        if any(other.items != part[0].items for other in part[1:]):
            raise RetrievalError("the ensemble's members read different images or sentences "
                                 "(other unusable files?): rebuild the index")
    return sum(weight * rank(i, s, member.cfg.objective.smooth, member.cfg.objective.score)
               for weight, member, i, s in zip(weights, members, images, sentences, strict=True))


def arithmetic_query(path: Path, embedder: Embedder, images: FragmentSet, minus: torch.Tensor,
                     plus: torch.Tensor, request: RetrievalRequest) -> dict[str, Any]:
    """The report of a --query-image with --minus/--plus: the --images ranked by Kiros et al.'s
    eq. 15 (trainer.search.arithmetic), and the rank of the query image itself when it is one of
    them (None otherwise), which shows whether the top results are just the query image."""
    query, _ = embed_images([path], embedder, skip_bad=False, device=request.device)
    order = top_k(arithmetic_scores(images, query, minus, plus), len(images.items))
    own = path.name if path.parent.resolve() == request.images.resolve() else None
    return {"kind": "arithmetic", "query": expression(str(path), request.minus, request.plus),
            "image": str(path), "minus": request.minus, "plus": request.plus,
            "boxes": int(query.counts[0]),
            "query_image_rank": next((r for r, (i, _) in enumerate(order, 1)
                                      if images.items[i] == own), None),
            "results": [{"rank": r, "score": score, "image": images.items[i]}
                        for r, (i, score) in enumerate(order[:request.top_k], 1)]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="defrag retrieve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="model folder (a run's best/ or a registry download), or an "
                             "ensemble folder: the weighted sum of its members' scores")
    parser.add_argument("--images", type=Path, help="folder of JPEG / PNG images to search")
    parser.add_argument("--sentences", type=Path, help="text file, one sentence per line")
    parser.add_argument("--index", type=Path,
                        help="a search index of the model (defrag index): the certified top k "
                             "of its images and sentences, instead of --images/--sentences")
    parser.add_argument("--query", action="append", default=[], metavar="SENTENCE",
                        help="rank the --images for this sentence (repeatable)")
    parser.add_argument("--query-image", action="append", default=[], type=Path,
                        metavar="PATH", help="rank the --sentences for this image (repeatable)")
    parser.add_argument("--minus", action="append", default=[], metavar="WORDS",
                        help="with --query-image: subtract these words from the image and rank "
                             "the --images (Kiros et al. eq. 15; linear encoder; repeatable)")
    parser.add_argument("--plus", action="append", default=[], metavar="WORDS",
                        help="with --query-image: add these words to the image and rank the "
                             "--images (repeatable)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--index-dir", type=Path,
                        help=f"index cache (default: IMAGES/{CACHE_DIR}, or beside SENTENCES)")
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
    parser.add_argument("--exact-scan", action="store_true",
                        help="with --index: score every item (the reference the certified "
                             "search is checked against; seconds at 100,000 images)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="with --index: seconds a query may widen its first stage to prove "
                             f"its top k exact (default {BUDGET_S:g}); then it answers "
                             '"exact": false with the gap left')
    add_debug_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`defrag retrieve ...`: a table (or --json) on stdout, progress on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.images is None and args.sentences is None and args.index is None:
        parser.error("pass --images FOLDER and/or --sentences FILE, or --index INDEX")
    if args.top_k < 1:
        parser.error(f"--top-k must be >= 1, got {args.top_k}")
    if not args.budget_s >= 0:
        parser.error(f"--budget-s must be >= 0, got {args.budget_s}")
    if args.exact_scan and not args.index:
        parser.error("--exact-scan needs --index (--images and --sentences score every item "
                     "already)")
    if args.boxes == "detector" and not args.detector_weights:
        parser.error("--boxes detector needs --detector-weights FILE (a Faster R-CNN state dict)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    request = RetrievalRequest(**{field.name: getattr(args, field.name)
                                  for field in fields(RetrievalRequest)})
    with one_line_errors(parser.prog, args.debug):
        report = index_search(request) if request.index else search(request)
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json
          else format_report(report))

