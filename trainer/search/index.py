"""A collection embedded once for search: every image's fragments (and sentences') on disk, and
a faiss first stage over them; what the web app, the retrieval CLI and the MLflow pyfunc search.
`defrag index` builds one (trainer/search/index_builder.py).

The folder INDEX holds (safetensors + JSON + faiss's own format; nothing pickled):
- `index.json`: what was embedded with what (the model folder's checksums key, box source,
  parser, image decoder version, the collection's source), the items; written last.
- `images.safetensors`: the fragments, each image's consecutive: `rows` fp16 [N, d] times
  `scale` float32 [N] (each row's largest magnitude: fp16 keeps ~3 digits of any row); `start`
  int64 [n + 1] (image k owns rows start[k]:start[k + 1]); `detail` float32 [N, 4], the boxes
  in the file's pixels; the first stage's `key_item` (each key's image) and projection
  (`center`, `basis`). Memory-mapped at search.
- `images.faiss`: the first stage over the projected keys (`build_first_stage`).
- `sentences.safetensors`, `sentences.faiss`: the same for the sentences (`detail`: each
  fragment's word ids, or a whole-sentence row's count of known words), when there are any: a
  --sentences file, else the captions of --shards.
- `files/`: the images of a --shards collection (a folder collection is served from its folder).
- `parts/`: while building, each finished unit (trainer/search/index_builder.py).

Search is two-stage (docs/design.md section 11): the first stage's keys are the fragment rows
for eq. 6 (each query fragment finds its KEY_CANDIDATES best, an item scores the thresholded
sum of those it owns) or each item's mean row for the cosine and inner scores (their inner
product is the model's score); the CANDIDATES best items are then ranked by the model's own
score (`trainer.search.fragment_set.rank`, as evaluation computes it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from tqdm import tqdm

from defrag.images import DECODER_VERSION, MAX_IMAGE_PIXELS
from trainer.batch import owners
from trainer.objectives import owner_means
from trainer.search.embedder import (
    Embedder,
    RetrievalError,
    embed_images,
    embed_parsed,
    parse_captions,
)
from trainer.search.explain import explain, explain_words
from trainer.search.fragment_set import FragmentSet, rank, top_k
from trainer.store.model_folder import ModelFolder

log = logging.getLogger(__name__)

INDEX_FORMAT = 1
FIRST_STAGE_DIMS = 256  # principal directions of the first stage's keys (+ 1 column)
PROJECTION_SAMPLE = 50_000  # keys the projection is fitted on
IVF_FROM = 200_000  # keys from which the first stage is an IVF index instead of an exact scan
SQ8_FROM = 5_000_000  # keys from which the IVF keeps 8-bit codes instead of float32
IVF_PROBE = 32  # lists an IVF first stage searches
KEY_CANDIDATES = 1000  # keys each query row finds (eq. 6; benchmarks/bench_search.py)
CANDIDATES = 50  # items re-scored exactly (benchmarks/bench_search.py)
EXACT_SENTENCES = 20_000  # sentence sets up to this size are scanned exactly (no first stage)
MAX_QUERY_CHARS = 1000


class IndexMismatch(RetrievalError):
    """An index opened with another model than the one that built it."""


@dataclass
class Hit:
    """One search result: an image's file name or a sentence, its score, its row in the index."""

    item: str
    score: float
    position: int


# ---------------------------------------------------------------- one side of an index


def first_stage_keys(fragments: FragmentSet, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What the first stage indexes, [N_key, d], and each key's item [N_key]: for eq. 6 every
    fragment row (its threshold acts on each fragment pair, so an item's mean row ranks badly:
    benchmarks/README.md), else each item's mean row (of unit length for the cosine score),
    whose inner product with the query's is the model's score."""
    if score == "eq6":
        return fragments.embeddings, fragments.owner
    means = owner_means(fragments.embeddings.float(), fragments.owner, len(fragments.items))
    keys = torch.nn.functional.normalize(means, dim=1) if score == "cosine" else means
    return keys, torch.arange(len(fragments.items))


def fit_projection(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean key and its FIRST_STAGE_DIMS principal directions [d, r] (of a sample)."""
    sample = keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(0))[
        :PROJECTION_SAMPLE]].float()
    center = sample.mean(0)
    basis = torch.linalg.svd(sample - center, full_matrices=False).Vh[:FIRST_STAGE_DIMS].T
    return center, basis.contiguous()


def project(x: torch.Tensor, center: torch.Tensor, basis: torch.Tensor,
            queries: bool) -> np.ndarray:
    """Keys as [(k - c) B, 1] and queries as [q B, q . c]: their inner product is k . q up to
    the directions left out (r + 1 float32 columns)."""
    x = x.float()
    last = x @ center if queries else torch.ones(len(x))
    return torch.cat([(x if queries else x - center) @ basis, last[:, None]], 1).numpy()


def build_first_stage(keys: torch.Tensor, center: torch.Tensor,
                      basis: torch.Tensor) -> faiss.Index:
    """An inner-product faiss index of the projected keys: exact below IVF_FROM keys, else IVF
    with 2 sqrt(N) lists found through HNSW, trained on a sample of 40 keys per list, the keys
    kept as float32 (the fastest scan) or, from SQ8_FROM keys, as 8-bit codes (a quarter of the
    memory, ~4x slower to scan); keys projected a block at a time."""
    total, dims = len(keys), basis.shape[1] + 1
    blocks = range(0, total, 1 << 16)
    if total < IVF_FROM:
        first = faiss.IndexFlatIP(dims)
    else:
        lists = int(2 * np.sqrt(total))
        quantizer = faiss.IndexHNSWFlat(dims, 32, faiss.METRIC_INNER_PRODUCT)
        first = (faiss.IndexIVFFlat(quantizer, dims, lists, faiss.METRIC_INNER_PRODUCT)
                 if total < SQ8_FROM else faiss.IndexIVFScalarQuantizer(
                     quantizer, dims, lists, faiss.ScalarQuantizer.QT_8bit,
                     faiss.METRIC_INNER_PRODUCT))
        first.cp.niter = 10
        sample = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:40 * lists]
        first.train(project(keys[sample.sort().values], center, basis, queries=False))
    for begin in tqdm(blocks, desc="first stage", unit="block", disable=len(blocks) < 8):
        first.add(project(keys[begin:begin + (1 << 16)], center, basis, queries=False))
    return first


def write_collection(folder: Path, stem: str, fragments: FragmentSet, score: str) -> None:
    """`stem`.safetensors and `stem`.faiss of one side of the index (see module doc)."""
    keys, key_item = first_stage_keys(fragments, score)
    center, basis = fit_projection(keys)
    start = torch.zeros(len(fragments.items) + 1, dtype=torch.long)
    start[1:] = fragments.counts.cumsum(0)
    scale = torch.ones(len(fragments.embeddings))  # each row's largest magnitude
    rows = torch.empty(fragments.embeddings.shape, dtype=torch.float16)
    for first in range(0, len(rows), 1 << 16):  # bounded float32 copies
        block = fragments.embeddings[first:first + (1 << 16)].float()
        peak = block.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        scale[first:first + len(block)] = peak
        rows[first:first + len(block)] = (block / peak[:, None]).half()
    save_file({"rows": rows, "scale": scale, "start": start,
               "detail": fragments.detail.contiguous(), "key_item": key_item,
               "center": center, "basis": basis}, folder / f"{stem}.safetensors")
    faiss.write_index(build_first_stage(keys, center, basis), str(folder / f"{stem}.faiss"))


def memory_map(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only memory maps (the format is an 8-byte
    header size, a JSON header, then the raw little-endian arrays), nothing read up front."""
    dtypes = {"F16": np.float16, "F32": np.float32, "I64": np.int64}
    with path.open("rb") as stream:
        size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(size))
    arrays = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shape, dtype = tuple(entry["shape"]), dtypes[entry["dtype"]]
        arrays[name] = (np.zeros(shape, dtype) if begin == end else
                        np.memmap(path, dtype, "r", offset=8 + size + begin, shape=shape))
    return arrays


class Collection:
    """One side of an opened index: its items, memory-mapped rows and first stage. `norm` is
    eq. 6's factor of an item with n rows: 1 / n for images, 1 / (n + smooth) for sentences."""

    def __init__(self, folder: Path, stem: str, items: list[str], score: str,
                 norm: Callable[[np.ndarray], np.ndarray], exact_up_to: int = 0) -> None:
        arrays = memory_map(folder / f"{stem}.safetensors")
        self.items, self.score, self.norm = items, score, norm
        self.rows, self.scale = arrays["rows"], arrays["scale"]
        self.detail, self.start = arrays["detail"], arrays["start"]
        self.key_item = np.asarray(arrays["key_item"])
        self.counts = np.diff(self.start)  # rows of each item
        self.center = torch.from_numpy(np.array(arrays["center"]))
        self.basis = torch.from_numpy(np.array(arrays["basis"]))
        self.first = faiss.read_index(str(folder / f"{stem}.faiss"))
        if isinstance(self.first, faiss.IndexIVF):
            self.first.nprobe = IVF_PROBE
        self.key_candidates = KEY_CANDIDATES
        self.exact_up_to = exact_up_to  # up to this many items: every item is a candidate
        self._everything: FragmentSet | None = None  # float32 rows of an exact collection
        if len(self.start) != len(items) + 1 or self.first.ntotal != len(self.key_item):
            raise RetrievalError(f"index {folder}: {stem} files do not match index.json "
                                 f"({len(items)} items): rebuild it with defrag index")

    def candidates(self, query: FragmentSet, k: int) -> np.ndarray:
        """Positions of the k items the first stage scores highest for `query` (one item), in
        index order (the exact scan's tie order). For eq. 6 each query row finds its
        key_candidates best keys (fragment rows), and an item scores the thresholded sum of
        those it owns, normalised as eq. 6; otherwise the query's mean row finds k items.
        A collection of at most `exact_up_to` items returns every item."""
        if len(self.items) <= self.exact_up_to:
            return np.arange(len(self.items))
        keys, _ = first_stage_keys(query, self.score)
        probes = project(keys, self.center, self.basis, queries=True)
        found = min(self.key_candidates if self.score == "eq6" else k, self.first.ntotal)
        scores, keys = self.first.search(probes, found)
        keep = keys >= 0
        items, scores = self.key_item[keys[keep]], scores[keep]
        if self.score == "eq6":
            items, owner = np.unique(items, return_inverse=True)
            scores = np.bincount(owner, np.maximum(scores, 0)) * self.norm(self.counts[items])
        best = np.argsort(-scores, kind="stable")[:k]
        return np.sort(items[best])

    def select(self, positions: Sequence[int]) -> FragmentSet:
        """The items at `positions` with their rows in float32 (all of an exact collection's
        rows are kept in memory once read)."""
        if len(self.items) <= self.exact_up_to and len(positions) == len(self.items):
            if self._everything is None:
                self._everything = self._read(positions)
            return self._everything
        return self._read(positions)

    def _read(self, positions: Sequence[int]) -> FragmentSet:
        rows = (np.concatenate([np.arange(self.start[p], self.start[p + 1]) for p in positions])
                if len(positions) else np.zeros(0, np.int64))
        return FragmentSet([self.items[p] for p in positions],
                           torch.from_numpy(self.rows[rows].astype(np.float32)
                                            * self.scale[rows][:, None]),
                           owners([int(self.counts[p]) for p in positions]),
                           torch.from_numpy(np.array(self.detail[rows])))


def load_one_model(model: ModelFolder, boxes: str | None, detector_weights: str | None,
                   parser: str | None) -> Embedder:
    """`Embedder.from_folder`, with a clear error for an ensemble folder (one model per index)."""
    if model.is_ensemble:
        members = ", ".join(str(member.path) for member, _ in model.members)
        raise RetrievalError(f"{model.path} is an ensemble; an index holds one model's "
                             f"fragments: index one of its members ({members})")
    return Embedder.from_folder(model, boxes, detector_weights, parser)


# ---------------------------------------------------------------- searching


class SearchIndex:
    """An index opened for search with its model: sentence -> images, image -> sentences, and
    Figure 4 for a pair. Bad input raises RetrievalError with one line for the user."""

    def __init__(self, folder: Path, meta: dict[str, Any], embedder: Embedder,
                 model_dir: Path) -> None:
        self.folder, self.meta, self.embedder, self.model_dir = folder, meta, embedder, model_dir
        objective = embedder.cfg.objective
        self.images = Collection(folder, "images", meta["images"], objective.score,
                                 lambda n: 1 / n)
        self.sentence_set = (Collection(folder, "sentences", meta["sentences"], objective.score,
                                        lambda n: 1 / (n + objective.smooth), EXACT_SENTENCES)
                             if meta["sentences"] else None)
        self.candidates = CANDIDATES
        self.position = {name: k for k, name in enumerate(meta["images"])}
        self._parse = threading.Lock()  # the parser is not known to be thread-safe

    @classmethod
    def open(cls, folder: Path, model: Path | ModelFolder | None = None,
             max_image_pixels: int = MAX_IMAGE_PIXELS) -> SearchIndex:
        """The index in `folder`, with `model` (a model folder, or one opened already; default:
        the model folder that built it, as recorded); IndexMismatch when the model is not that
        one. Query images over `max_image_pixels` are refused before decoding."""
        folder = Path(folder)
        try:
            meta = json.loads((folder / "index.json").read_text())
        except (OSError, ValueError) as err:
            raise RetrievalError(f"{folder} is not a search index ({err}): build one with "
                                 "defrag index") from err
        if meta.get("format") != INDEX_FORMAT:
            raise RetrievalError(f"index {folder} has format {meta.get('format')!r}, this code "
                                 f"reads {INDEX_FORMAT}: rebuild it with defrag index")
        if not isinstance(model, ModelFolder):
            model = ModelFolder.open(model or meta["model_dir"])
        embedder = load_one_model(model, None, None, meta["parser"])
        if embedder.model_key != meta["model"]:
            raise IndexMismatch(f"index {folder} was built with the model whose checksums key is "
                                f"{meta['model'][:16]} ({meta['model_dir']}), not with "
                                f"{model.path} "
                                f"({embedder.model_key[:16]}): rebuild the index with this "
                                "model, or open it with its own")
        if meta.get("decoder") != DECODER_VERSION:  # indexes before the version have none
            log.warning("index %s was built by an earlier image decoder (version %s, this code "
                        "decodes with %d: EXIF orientation, 16-bit and transparent images are "
                        "read differently): rebuild it with defrag index", folder,
                        meta.get("decoder", 1), DECODER_VERSION)
        return cls(folder, meta, dataclasses.replace(embedder, boxes=meta["boxes"],
                                                     max_image_pixels=max_image_pixels),
                   model.path)

    def warm_up(self) -> None:
        """Load the parser now (seconds), not at the first query."""
        with self._parse:
            parse_captions(["a dog"], self.embedder)

    @property
    def image_names(self) -> list[str]:
        return self.images.items

    @property
    def sentences(self) -> list[str]:
        return self.sentence_set.items if self.sentence_set else []

    def position_of(self, name: str) -> int:
        """The row of the indexed image `name`; RetrievalError for any other name."""
        if name not in self.position:
            raise RetrievalError(f"{name!r} is not an image of this index")
        return self.position[name]

    def image_file(self, name: str) -> Path:
        """The file of the indexed image `name`, resolved now: only indexed names have one (no
        path is ever built from anything else), and only while it is in the indexed folder or
        (--follow-links) where its link led when indexed. Otherwise one line naming no path,
        the same for a file gone and a link re-pointed (the web app's 404); the log says which."""
        self.position_of(name)
        folder = Path(self.meta["image_folder"])
        path = Path(os.path.realpath(folder / name))
        if path.is_file() and (path.is_relative_to(os.path.realpath(folder))
                               or str(path) == self.meta.get("links", {}).get(name)):
            return path
        log.warning("indexed image %r is not served: %s is no file, or leads out of %s "
                    "(re-linked since it was indexed?)", name, path, folder)
        raise RetrievalError(f"image {name!r} is not available")

    def images_for(self, text: str, k: int = 10) -> list[Hit]:
        """The k best images for a sentence."""
        return self.images_for_rows(self.query_rows(text), k)

    def sentences_for_image(self, name: str, k: int = 10) -> list[Hit]:
        """The k best sentences of the index for one of its images."""
        return self.sentences_for_rows(self.images.select([self.position_of(name)]), k)

    def sentences_for_file(self, path: Path, k: int = 10) -> list[Hit]:
        """The k best sentences of the index for a new image file (e.g. an upload)."""
        image, _ = embed_images([path], self.embedder, skip_bad=False, progress=False)
        return self.sentences_for_rows(image, k)

    def images_for_rows(self, query: FragmentSet, k: int = 10,
                        candidates: int | None = None) -> list[Hit]:
        """The k best images for an embedded sentence (one item): the first stage's
        `candidates` (default self.candidates), then the model's score."""
        found = self.images.candidates(query, max(k, candidates or self.candidates))
        scores = self._rank(self.images.select(found), query)[:, 0]
        return [Hit(self.images.items[found[i]], score, int(found[i]))
                for i, score in top_k(scores, k)]

    def sentences_for_rows(self, image: FragmentSet, k: int = 10,
                           candidates: int | None = None) -> list[Hit]:
        """The k best sentences for an embedded image (one item), as `images_for_rows`."""
        if self.sentence_set is None:
            raise RetrievalError("this index has no sentences: rebuild it with --sentences FILE")
        found = self.sentence_set.candidates(image, max(k, candidates or self.candidates))
        scores = self._rank(image, self.sentence_set.select(found))[0]
        return [Hit(self.sentence_set.items[found[i]], score, int(found[i]))
                for i, score in top_k(scores, k)]

    def explain(self, text: str, name: str) -> tuple[Image.Image, dict[str, Any]]:
        """Figure 4 for a sentence and an indexed image, drawn now, and what it shows."""
        path, query = self.image_file(name), self.query_rows(text)
        image = self.images.select([self.position[name]])
        if self.embedder.model.sentence.whole_sentence:
            picture, words = explain_words(path, image, text, self.embedder)
            return picture, {"image": name, "sentence": text, "words": words}
        picture, fragments = explain(path, image, query, self.embedder)
        return picture, {"image": name, "sentence": text, "fragments": fragments}

    def query_rows(self, text: str) -> FragmentSet:
        """A query sentence embedded, or RetrievalError saying why it cannot be searched."""
        text = " ".join(text.split())
        if not text:
            raise RetrievalError("the query is empty: type a sentence")
        if len(text) > MAX_QUERY_CHARS:
            raise RetrievalError(f"the query has {len(text)} characters; at most "
                                 f"{MAX_QUERY_CHARS} are searched: shorten it")
        with self._parse:
            caption = parse_captions([text], self.embedder)
        query = embed_parsed(caption, self.embedder, warn=False)
        words = len(self.embedder.vocab.words)
        if self.embedder.model.sentence.whole_sentence and not query.detail[0, 0]:
            raise RetrievalError(f"no word of the query is in the model's vocabulary of {words} "
                                 "words: rephrase it")
        if not len(query.embeddings):
            raise RetrievalError(f"the query has no fragment the model knows (a dependency "
                                 f"triplet whose words and relation are in its vocabulary of "
                                 f"{words} words): rephrase it")
        return query

    def _rank(self, images: FragmentSet, sentences: FragmentSet) -> torch.Tensor:
        objective = self.embedder.cfg.objective
        return rank(images, sentences, objective.smooth, objective.score)

