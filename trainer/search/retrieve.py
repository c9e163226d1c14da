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

--index INDEX searches a collection embedded once by `defrag index` (any size: a
faiss first stage, then eq. 6 over its candidates) instead of --images / --sentences.

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
    load_embedder,
)
from trainer.search.embedding_cache import CACHE_DIR, image_embeddings, sentence_embeddings
from trainer.search.explain import explain, explain_words
from trainer.search.fragment_set import FragmentSet, rank, top_k
from trainer.search.index import SearchIndex
from trainer.search.retrieval_report import format_report
from trainer.store.registry import ensemble_members

log = logging.getLogger(__name__)


def search(args: argparse.Namespace) -> dict[str, Any]:
    """Build or refresh the indexes, answer the queries, explain the first one: the report."""
    arithmetic = bool(args.minus or args.plus)
    if args.query and args.images is None:
        raise RetrievalError("--query ranks images: also pass --images FOLDER")
    if arithmetic and not (args.query_image and args.images):
        raise RetrievalError("--minus/--plus change a --query-image, which then ranks the "
                             "--images: pass --query-image PATH and --images FOLDER")
    if args.query_image and not arithmetic and args.sentences is None:
        raise RetrievalError("--query-image ranks sentences: also pass --sentences FILE")
    if args.explain and not (args.query or args.query_image and not arithmetic):
        raise RetrievalError("--explain draws a sentence against an image: pass a --query, or "
                             "a --query-image without --minus/--plus")
    folders, weights = zip(*ensemble_members(args.model), strict=True)
    if len(folders) > 1 and (args.explain or arithmetic):
        raise RetrievalError(f"{args.model} is an ensemble of {len(folders)} models; --explain "
                             "and --minus/--plus read one model: pass one of its members, e.g. "
                             f"--model {folders[0]}")
    members = [load_embedder(folder, args.boxes, args.detector_weights, args.parser)
               for folder in folders]
    embedder = members[0]  # the one model, or the ensemble's first member (reports, checks)
    if arithmetic:
        check_encoder(embedder)
    for member in members:
        member.model.to(args.device)
    if arithmetic:  # before the indexes: a word outside the vocabulary fails at once
        minus = term_vectors(args.minus, "--minus", embedder, args.device)
        plus = term_vectors(args.plus, "--plus", embedder, args.device)
    index_dir = args.index_dir or (args.images or args.sentences.parent) / CACHE_DIR
    # an ensemble keeps one index per member, in a subfolder named after it
    index_dirs = [index_dir] if len(folders) == 1 else [index_dir / f.name for f in folders]
    member_images = [image_embeddings(args.images, where, member, args.device)
                     for where, member in zip(index_dirs, members, strict=True)
                     if args.images]
    member_sentences, lines = [], []  # lines: each sentence's line number in the file
    for where, member in zip(index_dirs, members, strict=True):
        if args.sentences:
            fragments, lines = sentence_embeddings(args.sentences, where, member, args.device)
            member_sentences.append(fragments)
    images = member_images[0] if member_images else None
    sentences = member_sentences[0] if member_sentences else None
    report: dict[str, Any] = {"model": str(args.model), "index_dir": str(index_dir),
                              "images": len(images.items) if images else 0,
                              "sentences": len(sentences.items) if sentences else 0,
                              "queries": []}
    if len(members) > 1:
        report["ensemble"] = [str(folder) for folder in folders]
    pairs = []  # (image file, image, sentence) of each query's top result, for --explain
    if args.query:
        queries = [embed_sentences(args.query, member, args.device) for member in members]
        scores = ensemble_scores(members, weights, member_images, queries)
        # what the model reads of each: its fragments, or (one row each) its known words
        unit, sizes = (("words", queries[0].detail[:, 0])
                       if embedder.model.sentence.whole_sentence
                       else ("fragments", queries[0].counts))
        for q, text in enumerate(queries[0].items):
            best = top_k(scores[:, q], args.top_k)
            report["queries"].append({
                "kind": "sentence", "query": text, unit: int(sizes[q]),
                "results": [{"rank": r, "score": score, "image": images.items[i]}
                            for r, (i, score) in enumerate(best, 1)]})
            pairs.append((args.images / images.items[best[0][0]], images.select([best[0][0]]),
                          queries[0].select([q])))
    for path in args.query_image:
        query, _ = embed_images([path], embedder, skip_bad=False, device=args.device)
        if arithmetic:
            report["queries"].append(arithmetic_query(path, query, images, minus, plus, args))
            continue
        queries = [query] + [embed_images([path], member, skip_bad=False, device=args.device)[0]
                             for member in members[1:]]
        best = top_k(ensemble_scores(members, weights, queries, member_sentences)[0], args.top_k)
        report["queries"].append({
            "kind": "image", "query": str(path), "boxes": int(query.counts[0]),
            "results": [{"rank": r, "score": score, "sentence": sentences.items[i],
                         "line": lines[i]} for r, (i, score) in enumerate(best, 1)]})
        pairs.append((path, query, sentences.select([best[0][0]])))
    if args.explain:
        image_path, image, sentence = pairs[0]
        report["explain"] = {"image": str(image_path), "sentence": sentence.items[0]}
        if embedder.model.sentence.whole_sentence:
            picture, details = explain_words(image_path, image, sentence.items[0], embedder,
                                             args.device)
        else:
            picture, details = explain(image_path, image, sentence, embedder)
        if picture is not None:
            args.explain.parent.mkdir(parents=True, exist_ok=True)
            picture.save(args.explain)
        else:
            log.warning("%s not written", args.explain)
        report["explain"].update({
            "picture": str(args.explain) if picture is not None else None,
            "words" if embedder.model.sentence.whole_sentence else "fragments": details})
    return report


def index_search(args: argparse.Namespace) -> dict[str, Any]:
    """The report of `search` answered from a search index (trainer.search.index): two-stage search
    of a collection of any size, embedded once."""
    if args.minus or args.plus or args.images or args.sentences:
        raise RetrievalError("--index holds the images and sentences to search: drop --images, "
                             "--sentences, --minus and --plus")
    if args.explain and not args.query:
        raise RetrievalError("with --index, --explain draws a --query against its top image")
    index = SearchIndex.open(args.index, args.model)
    whole_sentence = index.embedder.model.sentence.whole_sentence
    report: dict[str, Any] = {"model": str(args.model), "index_dir": str(args.index),
                              "images": len(index.image_names),
                              "sentences": len(index.sentences), "queries": []}
    for text in args.query:
        query = index.query_rows(text)
        unit, size = (("words", int(query.detail[0, 0])) if whole_sentence
                      else ("fragments", len(query.embeddings)))
        hits = index.images_for_rows(query, args.top_k)
        report["queries"].append({
            "kind": "sentence", "query": text, unit: size,
            "results": [{"rank": r, "score": hit.score, "image": hit.item}
                        for r, hit in enumerate(hits, 1)]})
    origins = index.meta["sentence_origins"]
    for path in args.query_image:
        image, _ = embed_images([path], index.embedder, skip_bad=False, progress=False)
        hits = index.sentences_for_rows(image, args.top_k)
        report["queries"].append({
            "kind": "image", "query": str(path), "boxes": int(image.counts[0]),
            "results": [{"rank": r, "score": hit.score, "sentence": hit.item,
                         "line": origins[hit.position]} for r, hit in enumerate(hits, 1)]})
    if args.explain:
        top = report["queries"][0]["results"][0]["image"]
        picture, details = index.explain(args.query[0], top)
        args.explain.parent.mkdir(parents=True, exist_ok=True)
        picture.save(args.explain)
        report["explain"] = {**details, "image": str(index.image_file(top)),
                             "picture": str(args.explain)}
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


def arithmetic_query(path: Path, query: FragmentSet, images: FragmentSet, minus: torch.Tensor,
                     plus: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """The report of a --query-image with --minus/--plus: the --images ranked by Kiros et al.'s
    eq. 15 (trainer.search.arithmetic), and the rank of the query image itself when it is one of
    them (None otherwise), which shows whether the top results are just the query image."""
    order = top_k(arithmetic_scores(images, query, minus, plus), len(images.items))
    own = path.name if path.parent.resolve() == args.images.resolve() else None
    return {"kind": "arithmetic", "query": expression(str(path), args.minus, args.plus),
            "image": str(path), "minus": args.minus, "plus": args.plus,
            "boxes": int(query.counts[0]),
            "query_image_rank": next((r for r, (i, _) in enumerate(order, 1)
                                      if images.items[i] == own), None),
            "results": [{"rank": r, "score": score, "image": images.items[i]}
                        for r, (i, score) in enumerate(order[:args.top_k], 1)]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="defrag retrieve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="model folder (a run's best/ or a registry download), or an "
                             "ensemble folder: the weighted sum of its members' scores")
    parser.add_argument("--images", type=Path, help="folder of JPEG / PNG images to search")
    parser.add_argument("--sentences", type=Path, help="text file, one sentence per line")
    parser.add_argument("--index", type=Path,
                        help="a search index of the model (defrag index): search its "
                             "images and sentences in two stages instead of --images/--sentences")
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
    if args.boxes == "detector" and not args.detector_weights:
        parser.error("--boxes detector needs --detector-weights FILE (a Faster R-CNN state dict)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with one_line_errors(parser.prog, args.debug):
        report = index_search(args) if args.index else search(args)
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json
          else format_report(report))

