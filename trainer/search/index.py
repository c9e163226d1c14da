"""A collection embedded once for search: every image's fragments (and sentences') on disk, and
a faiss first stage over them; what the web app, the retrieval CLI and the MLflow pyfunc search.
`defrag index` builds one (trainer/search/index_builder.py).

The folder INDEX holds (safetensors + JSON + faiss's own format; nothing pickled):
- `index.json`: what was embedded with what (the model folder's checksums key, box source,
  parser, image decoder version, the collection's source), the items; written last.
- `images.safetensors`: the fragments, each image's consecutive: `rows` fp16 [N, d] times
  `scale` float32 [N] (each row's largest magnitude: fp16 keeps ~3 digits of any row); `start`
  int64 [n + 1] (image k owns rows start[k]:start[k + 1]); `detail` float32 [N, 4], the boxes
  in the file's pixels; the first stage's `key_item` (each key's image), projection (`center`,
  `basis`) and what the certificate's bounds need (`first_stage_bounds`); the keys also as
  int8 codes with their errors (`int8_codes`, `int8_scale`, `int8_error`, `int8_norm`:
  trainer/search/compact_keys.py), which search scans. Memory-mapped.
- `images.faiss`: the faiss first stage over the projected keys (`build_first_stage`), which
  indexes of format 2 and any index where int8 products are not exact search instead.
- `sentences.safetensors`, `sentences.faiss`: the same for the sentences (`detail`: each
  fragment's word ids, or a whole-sentence row's count of known words), when there are any: a
  --sentences file, else the captions of --shards.
- `files/`: the images of a --shards collection (a folder collection is served from its folder).
- `parts/`: while building, each finished unit (trainer/search/index_builder.py).

Search returns the exact top k by the model's own score (`trainer.search.fragment_set.rank`,
as evaluation computes it), certified (docs/design.md section 11, trainer/search/certificate.py):
the first stage's keys are the fragment rows for eq. 6 or each item's mean row for the cosine
and inner scores; one pass over their int8 codes bounds every item's score (or the faiss first
stage returns each query fragment's KEY_CANDIDATES best and bounds the rest), and only the items
whose bounds the k-th exact score does not beat are scored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import psutil
import torch
from PIL import Image
from safetensors.torch import save_file
from tqdm import tqdm

from defrag.images import DECODER_VERSION, MAX_IMAGE_PIXELS
from trainer.batch import owners
from trainer.objectives import owner_means
from trainer.search.certificate import (
    Candidates,
    Ranking,
    Retrieved,
    certified_top_k,
    full_scan,
    item_bounds,
)
from trainer.search.compact_keys import (
    MARGIN,
    MOST_DIMS,
    CompactKeys,
    compact_keys,
    int8_products_exact,
)
from trainer.search.embedder import (
    Embedder,
    RetrievalError,
    embed_images,
    embed_parsed,
    parse_captions,
)
from trainer.search.explain import explain, explain_words
from trainer.search.fragment_set import FragmentSet, rank
from trainer.store.model_folder import ModelFolder

log = logging.getLogger(__name__)

INDEX_FORMAT = 3  # 2: the certificate's bounds (first_stage_bounds); 3: a flat first
READS = (2, 3)  # stage's int8 keys (format 2 is searched through its float32 keys)
FIRST_STAGE_DIMS = 256  # principal directions of an IVF first stage's keys (+ 1 column)
PROJECTION_SAMPLE = 50_000  # keys the projection is fitted on
IVF_FROM = 500_000  # keys from which the first stage is an IVF index instead of an exact scan
SQ8_FROM = 5_000_000  # keys from which the IVF keeps 8-bit codes instead of float32
IVF_PROBE = 32  # lists an IVF first stage searches
KEY_CANDIDATES = 1000  # keys each query row finds first (eq. 6; benchmarks/bench_search.py)
CANDIDATES = 50  # items the first stage finds first for the cosine and inner scores
BUDGET_S = 0.5  # a search widens its first stage only while it would end within this
UNIT = 2**-24  # float32's unit roundoff: a first-stage product of r + 1 columns (each side
# rotated, then multiplied) is within 3 (r + 3) UNIT |q| max |k| of the exact k . q
BLOCK = 1 << 16  # keys projected at a time
MAX_QUERY_CHARS = 1000


class IndexMismatch(RetrievalError):
    """An index opened with another model than the one that built it."""


# ---------------------------------------------------------------- one side of an index


def first_stage_keys(fragments: FragmentSet, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What the first stage indexes, [N_key, d], and each key's item [N_key]: for eq. 6 every
    fragment row (its threshold acts on each fragment pair, so an item's mean row ranks badly:
    benchmarks/README.md), else each item's mean row (of unit length for the cosine score),
    whose inner product with the query's is the model's score. float64 rows give float64
    keys: the model's own, as the exact rescoring computes them."""
    if score == "eq6":
        return fragments.embeddings, fragments.owner
    return item_keys(fragments.embeddings, fragments.owner, len(fragments.items),
                     score), torch.arange(len(fragments.items))


def item_keys(rows: torch.Tensor, owner: torch.Tensor, count: int, score: str) -> torch.Tensor:
    """The `count` items' mean rows (of unit length for the cosine score), float32 or float64."""
    means = owner_means(rows if rows.dtype == torch.float64 else rows.float(), owner, count)
    return torch.nn.functional.normalize(means, dim=1) if score == "cosine" else means


def quantize(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as stored: fp16 of unit largest magnitude, times each row's scale (float32)."""
    block = block.float()
    scale = block.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    return (block / scale[:, None]).half(), scale


def fit_projection(keys: torch.Tensor, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean key and its `dims` principal directions [d, dims] (of a sample)."""
    sample = keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(0))[
        :PROJECTION_SAMPLE]].float()
    center = sample.mean(0)
    basis = torch.linalg.svd(sample - center, full_matrices=False).Vh[:dims].T
    return center, basis.contiguous()


def project(x: torch.Tensor, center: torch.Tensor, basis: torch.Tensor,
            queries: bool) -> np.ndarray:
    """Keys as [(k - c) B, 1] and queries as [q B, q . c]: their inner product is k . q up to
    the directions left out (r + 1 float32 columns)."""
    x = x.float()
    last = x @ center if queries else torch.ones(len(x))
    return torch.cat([(x if queries else x - center) @ basis, last[:, None]], 1).numpy()


def left_out(x: torch.Tensor, basis: torch.Tensor, center: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The length of each row's part outside the basis' span (of x - center for keys): by
    Cauchy-Schwarz, k . q exceeds the projected inner product by at most |k_out| |q_out|.
    Zero for a basis of all d directions (a rotation: its rounding is within `_bounded`'s)."""
    if basis.shape[0] == basis.shape[1]:
        return torch.zeros(len(x))
    x = x.float() - (center if center is not None else 0)
    return torch.linalg.vector_norm(x - (x @ basis) @ basis.T, dim=1)


def build_first_stage(keys: torch.Tensor, center: torch.Tensor,
                      basis: torch.Tensor) -> faiss.Index:
    """An inner-product faiss index of the projected keys: exact below IVF_FROM keys, else IVF
    with 2 sqrt(N) lists found through HNSW, trained on a sample of 40 keys per list, the keys
    kept as float32 (the fastest scan) or, from SQ8_FROM keys, as 8-bit codes (a quarter of the
    memory, ~4x slower to scan); keys projected a block at a time."""
    total, dims = len(keys), basis.shape[1] + 1
    blocks = range(0, total, BLOCK)
    if total < IVF_FROM:
        first = faiss.IndexFlatIP(dims)
    else:
        lists = int(2 * np.sqrt(total))
        quantizer = faiss.IndexHNSWFlat(dims, 32, faiss.METRIC_INNER_PRODUCT)
        first = (faiss.IndexIVFFlat(quantizer, dims, lists, faiss.METRIC_INNER_PRODUCT)
                 if total < SQ8_FROM else faiss.IndexIVFScalarQuantizer(
                     quantizer, dims, lists, faiss.ScalarQuantizer.QT_8bit,
                     faiss.METRIC_INNER_PRODUCT, False))  # codes of the keys themselves
        first.cp.niter = 10
        sample = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:40 * lists]
        first.train(project(keys[sample.sort().values], center, basis, queries=False))
    for begin in tqdm(blocks, desc="first stage", unit="block", disable=len(blocks) < 8):
        first.add(project(keys[begin:begin + BLOCK], center, basis, queries=False))
    return first


def first_stage_bounds(first: faiss.Index, keys: torch.Tensor, center: torch.Tensor,
                       basis: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the certificate needs of a first stage (trainer/search/certificate.py): each key's
    part left out by the projection (`residual`), the largest projected key, the largest error
    of 8-bit codes, and each IVF list's centre and radius (no key of the list lies farther
    from its centre, so an unsearched list's keys score at most q . centre + |q| radius)."""
    residual = torch.cat([left_out(keys[b:b + BLOCK], basis, center)
                          for b in range(0, len(keys), BLOCK)])
    lists = first.nlist if isinstance(first, faiss.IndexIVF) else 0
    centers = (first.quantizer.reconstruct_n(0, lists) if lists
               else np.zeros((0, first.d), np.float32))
    radius, largest, code_error = np.zeros(lists, np.float32), 0.0, 0.0
    home = np.zeros(len(keys), np.int64)  # each key's list
    for number in range(lists):
        size = first.invlists.list_size(number)
        if size:  # an empty list has no ids array
            home[faiss.rev_swig_ptr(first.invlists.get_ids(number), size).copy()] = number
    for begin in range(0, len(keys), BLOCK):
        projected = project(keys[begin:begin + BLOCK], center, basis, queries=False)
        largest = max(largest, float(np.linalg.norm(projected, axis=1).max()))
        if lists:
            own = home[begin:begin + len(projected)]
            np.maximum.at(radius, own, np.linalg.norm(projected - centers[own], axis=1))
        if isinstance(first, faiss.IndexIVFScalarQuantizer):
            decoded = first.sq.decode(first.sq.compute_codes(projected))
            code_error = max(code_error, float(np.linalg.norm(decoded - projected, axis=1).max()))
    most = float(residual.max()) if len(residual) else 0.0  # the largest part left out
    return {"residual": residual, "list_center": torch.from_numpy(centers),
            "list_radius": torch.from_numpy(radius),
            "key_stats": torch.tensor([largest, code_error, most])}


class StoredRows:
    """The stored rows (fp16 times their scale) in float32, a block at a time: what search
    reads back and scores, so the first stage's keys are built from them and its bounds hold."""

    def __init__(self, rows: torch.Tensor, scale: torch.Tensor) -> None:
        self.rows, self.scale = rows, scale

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        return self.rows[index].float() * self.scale[index][:, None]


def exact_keys(stored: StoredRows, start: torch.Tensor,
               score: str) -> Callable[[slice], torch.Tensor]:
    """The keys of a block of key numbers in float64, as the exact rescoring computes them: the
    stored rows (eq. 6), or the mean rows of a block of items."""
    if score == "eq6":
        return lambda block: stored[block].double()

    def keys(block: slice) -> torch.Tensor:
        first, last = block.start, min(block.stop, len(start) - 1)
        counts = (start[first + 1:last + 1] - start[first:last]).tolist()
        rows = stored[int(start[first]):int(start[last])].double()
        return item_keys(rows, owners(counts), len(counts), score)
    return keys


@dataclasses.dataclass
class StoredFragments:
    """One side's fragments as an index stores them (rows fp16 times each row's `scale`), made
    once at full size and filled in order, so a merge holds no part twice and, for eq. 6, no
    float32 rows (2,000,000 region rows: 4 GB, not 16; the cosine and inner scores' first stage
    takes a float32 copy to average each item's rows)."""

    items: list[str]
    rows: torch.Tensor  # float16 [N, d], each row of largest magnitude 1
    scale: torch.Tensor  # float32 [N]
    owner: torch.Tensor  # long [N]
    detail: torch.Tensor  # boxes, float [N, 4], or word ids, long [N, 3] or [N, 1]
    filled: tuple[int, int] = (0, 0)  # rows and items appended so far

    @staticmethod
    def room(items: list[str], rows: int, dims: int, detail: torch.Tensor) -> StoredFragments:
        """Room for `rows` rows of `items` (`detail`: any tensor of the details' dtype and
        width), filled in order by `append`."""
        return StoredFragments(items, torch.empty(rows, dims, dtype=torch.float16),
                               torch.ones(rows), torch.empty(rows, dtype=torch.long),
                               detail.new_empty((rows, *detail.shape[1:])))

    @staticmethod
    def of(fragments: FragmentSet, stem: str) -> StoredFragments:
        """`fragments` as stored (see `append`)."""
        stored = StoredFragments.room(fragments.items, *fragments.embeddings.shape,
                                      fragments.detail)
        stored.append(fragments, stem)
        return stored

    def append(self, fragments: FragmentSet, stem: str) -> None:
        """The next items' fragments, quantized a block at a time; refused with one line naming
        them if some are not finite (no bound would hold)."""
        finite = torch.isfinite(fragments.embeddings).all(dim=1)
        if not finite.all():
            bad = sorted(set(fragments.owner[~finite].tolist()))
            named = ", ".join(str(fragments.items[b]) for b in bad[:3])
            raise RetrievalError(f"{len(bad)} of the {len(fragments.items)} {stem} have "
                                 f"fragments that are not finite (NaN or inf), e.g. {named}: "
                                 "the model gives them for these inputs; check the model, or "
                                 "leave them out")
        row, item = self.filled
        for first in range(0, len(fragments.embeddings), BLOCK):  # bounded float32 copies
            at = slice(row + first, row + min(first + BLOCK, len(fragments.embeddings)))
            self.rows[at], self.scale[at] = quantize(fragments.embeddings[first:first + BLOCK])
        end = row + len(fragments.embeddings)
        self.owner[row:end] = fragments.owner + item
        self.detail[row:end] = fragments.detail
        self.filled = end, item + len(fragments.items)

    def between(self, first: int, end: int) -> StoredFragments:
        """Items first:end (their rows are consecutive)."""
        start = self.start.tolist()
        rows = slice(start[first], start[end])
        return StoredFragments(self.items[first:end], self.rows[rows], self.scale[rows],
                               self.owner[rows] - first, self.detail[rows],
                               (rows.stop - rows.start, end - first))

    @property
    def start(self) -> torch.Tensor:
        """int64 [n + 1]: item k owns rows start[k]:start[k + 1]."""
        start = torch.zeros(len(self.items) + 1, dtype=torch.long)
        start[1:] = torch.bincount(self.owner, minlength=len(self.items)).cumsum(0)
        return start


def write_collection(folder: Path, stem: str, fragments: FragmentSet | StoredFragments,
                     score: str) -> None:
    """`stem`.safetensors and `stem`.faiss of one side of the index (see module doc)."""
    side = (fragments if isinstance(fragments, StoredFragments)
            else StoredFragments.of(fragments, stem))
    if side.filled != (len(side.rows), len(side.items)):  # never an index of unfilled rows
        raise RuntimeError(f"{folder}: only {side.filled[1]} of the {len(side.items)} {stem} "
                           "were appended before the write")
    start, stored = side.start, StoredRows(side.rows, side.scale)
    if score == "eq6":
        keys, key_item = stored, side.owner
    else:
        keys, key_item = first_stage_keys(FragmentSet(
            side.items, stored[0:len(stored)], side.owner, side.detail), score)
    center, basis = fit_projection(keys, side.rows.shape[1]
                                   if len(keys) < IVF_FROM else FIRST_STAGE_DIMS)
    first = build_first_stage(keys, center, basis)
    compact = (compact_keys(exact_keys(stored, start, score), len(keys), center)
               if len(center) <= MOST_DIMS else {})
    save_file({"rows": side.rows, "scale": side.scale, "start": start,
               "detail": side.detail.contiguous(), "key_item": key_item,
               "center": center, "basis": basis, **compact,
               **first_stage_bounds(first, keys, center, basis)}, folder / f"{stem}.safetensors")
    faiss.write_index(first, str(folder / f"{stem}.faiss"))


def consecutive(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """first[0], ..., first[0] + counts[0] - 1, first[1], ...: the rows (or keys) of items."""
    return np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def memory_map(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only memory maps (the format is an 8-byte
    header size, a JSON header, then the raw little-endian arrays), nothing read up front;
    RetrievalError naming the file when it is cut short (a copy that did not finish)."""
    dtypes = {"F16": np.float16, "F32": np.float32, "I64": np.int64, "I8": np.int8}
    rebuild = "the file is truncated or damaged: rebuild the index with defrag index"
    with path.open("rb") as stream:
        size = int.from_bytes(stream.read(8), "little")
        try:
            header = json.loads(stream.read(size))
        except ValueError as err:
            raise RetrievalError(f"{path}: its header cannot be read ({err}): {rebuild}") from err
    length = path.stat().st_size
    arrays = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if 8 + size + end > length:
            raise RetrievalError(f"{path} has {length} bytes, but its tensor {name!r} ends at "
                                 f"byte {8 + size + end}: {rebuild}")
        shape, dtype = tuple(entry["shape"]), dtypes[entry["dtype"]]
        arrays[name] = (np.zeros(shape, dtype) if begin == end else
                        np.memmap(path, dtype, "r", offset=8 + size + begin, shape=shape))
    return arrays


def extent(array: np.ndarray) -> tuple[Path, int, int]:
    """A memory-mapped array's file, offset and bytes (an empty array: none)."""
    if not isinstance(array, np.memmap):
        return Path(os.devnull), 0, 0
    return Path(array.filename), array.offset, array.nbytes


def prefetch(extents: Sequence[tuple[Path, int, int]]) -> int:
    """Ask the kernel to read these byte ranges into the page cache (posix_fadvise WILLNEED),
    in order while they fit in half the memory available; the bytes asked for (0 where the
    platform has no posix_fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    budget, asked = psutil.virtual_memory().available // 2, 0
    for path, offset, length in extents:
        if asked + length > budget:
            break
        if not length:  # an empty array (0 would mean "to the end of the file")
            continue
        try:
            with path.open("rb") as stream:
                os.posix_fadvise(stream.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        except OSError as err:  # a file system without it: an optimisation only
            log.warning("%s cannot be read ahead (%s): the first searches read it as they go",
                        path, err)
            continue
        asked += length
    return asked


class Collection:
    """One side of an opened index: its items, memory-mapped rows and first stage. `norm` is
    eq. 6's factor of an item with n rows: 1 / n for images, 1 / (n + smooth) for sentences."""

    def __init__(self, folder: Path, stem: str, items: list[str], score: str,
                 norm: Callable[[np.ndarray], np.ndarray]) -> None:
        arrays = memory_map(folder / f"{stem}.safetensors")
        self.items, self.score, self.norm = items, score, norm
        self.rows, self.scale = arrays["rows"], arrays["scale"]
        self.detail, self.start = arrays["detail"], arrays["start"]
        self.key_item = np.asarray(arrays["key_item"])
        self.counts = np.diff(self.start)  # rows of each item
        self.center = torch.from_numpy(np.array(arrays["center"]))
        self.basis = torch.from_numpy(np.array(arrays["basis"]))
        self.residual = arrays["residual"]
        self.list_center = np.array(arrays["list_center"])
        self.list_radius = np.array(arrays["list_radius"]).astype(np.float64)
        self.largest_key, self.code_error, self.largest_residual = (
            float(x) for x in arrays["key_stats"])
        self.first = faiss.read_index(str(folder / f"{stem}.faiss"),  # pages shared by
                                      faiss.IO_FLAG_MMAP_IFC)  # every server worker
        self.lists = self.first.nlist if isinstance(self.first, faiss.IndexIVF) else 0
        self.compact = (CompactKeys(arrays, self.center)
                        if "int8_codes" in arrays and int8_products_exact() else None)
        faiss_file = folder / f"{stem}.faiss"
        self.key_extent = (extent(arrays["int8_codes"]) if self.compact is not None else
                           (faiss_file, 0, faiss_file.stat().st_size))  # what each search reads
        self.row_extent = extent(self.rows)  # what rescoring reads
        self.key_candidates, self.probe = KEY_CANDIDATES, IVF_PROBE
        self._reach: float | None = None  # max_n n norm(n) over the items (`reach`)
        self._keys: torch.Tensor | None = None  # a flat first stage's keys (`_flat_keys`)
        self._searching = threading.Lock()  # an IVF's nprobe, set per search
        if len(self.start) != len(items) + 1 or self.first.ntotal != len(self.key_item):
            raise RetrievalError(f"index {folder}: {stem} files do not match index.json "
                                 f"({len(items)} items): rebuild it with defrag index")

    def reach(self, query_norm: float) -> tuple[Callable[[np.ndarray], np.ndarray], float]:
        """eq. 6's weight w(n) of an item of n rows against this query (the item's factor
        times the query's), and max_n n w(n) over the collection's items."""
        if self._reach is None:
            counts = np.unique(self.counts[self.counts > 0]).astype(np.float64)
            self._reach = float(np.max(counts * self.norm(counts), initial=0.0))
        return (lambda n: self.norm(np.maximum(n, 1)) * query_norm), self._reach * query_norm

    def first_stage(self, query: FragmentSet) -> Callable[[int, int], Retrieved]:
        """The first stage opened for `query` (one item): `search(keys, probe)` returns each
        query key's `keys` best keys (in the `probe` best lists of an IVF), each returned pair
        with an upper bound on its exact inner product, and the bound on every pair not
        returned (trainer/search/certificate.py). A flat first stage computes every product
        once (one pass over the keys) and widens by keeping more of them."""
        q, _ = first_stage_keys(query, self.score)
        q = q.float()
        probes = project(q, self.center, self.basis, queries=True)
        lengths = np.linalg.norm(probes, axis=1).astype(np.float64)
        outside = left_out(q, self.basis).numpy().astype(np.float64)
        total = self.first.ntotal
        if self.lists:
            def search_lists(keys: int, probe: int) -> Retrieved:
                if keys >= total and probe >= self.lists:  # everything: score every item
                    return Retrieved(*(np.zeros(0, dtype) for dtype in (
                        np.int64, np.int64, np.float64)), np.full(len(probes), -np.inf),
                        total, True, np.zeros(0, np.int64))
                scores, ids, beyond = self._ivf_search(probes, lengths, min(keys, total),
                                                       min(probe, self.lists))
                full = (ids[:, -1] >= 0) & (keys < total)  # rows with keys left unreturned
                return self._bounded(scores, ids, np.where(full, scores[:, -1], -np.inf),
                                     beyond, False, lengths, outside, min(keys, total))
            return search_lists
        products = torch.from_numpy(probes) @ self._flat_keys().T  # [m, N]: every product once

        def search(keys: int, probe: int) -> Retrieved:
            best = torch.topk(products, min(keys, total), dim=1)
            last = best.values[:, -1].numpy() if keys < total else np.full(len(probes), -np.inf)
            every = self._keys_of(np.unique(self.key_item[best.indices.numpy()]))
            return self._bounded(products[:, every].numpy(), np.broadcast_to(
                every, (len(probes), len(every))), last, np.full(len(probes), -np.inf),
                keys >= total, lengths, outside, min(keys, total))
        return search

    def candidates(self, query: FragmentSet, weight: Callable[[np.ndarray], np.ndarray],
                   reach: float) -> Callable[[int, int], Candidates]:
        """The first stage as the certificate takes it: `search(count, probe)` returns items
        with a bound on each one's score and the bound on every other item's. Over int8 keys,
        one pass bounds every item (eq. 6: w(n) times its keys' bounds on sum_j max(0, k . q_j);
        else its key's) and the `count` highest are returned; else `first_stage`'s pairs bound
        the items (certificate.item_bounds)."""
        eq6 = self.score == "eq6"
        if self.compact is None:
            first = self.first_stage(query)
            return lambda keys, probe: item_bounds(first(keys, probe), eq6, self.counts,
                                                   weight, reach)
        keys = self.compact.key_bounds(self.compact.scan(first_stage_keys(dataclasses.replace(
            query, embeddings=query.embeddings.double()), self.score)[0]), eq6)  # the model's
        every = (np.bincount(self.key_item, keys, len(self.items)) * weight(self.counts)
                 * (1 + MARGIN) if eq6 else keys)  # cosine, inner: key k is item k's
        ranked = torch.from_numpy(every)

        def search(count: int, probe: int) -> Candidates:
            count = min(count, len(every))
            best = torch.topk(ranked, min(count + 1, len(every)))
            outside = float(best.values[count]) if count < len(every) else -np.inf
            return Candidates(best.indices[:count].numpy(), best.values[:count].numpy(),
                              outside, count, count == len(every))
        return search

    def _keys_of(self, items: np.ndarray) -> np.ndarray:
        """Every key of `items` (an item's keys are consecutive), in their order: a flat first stage
        returns all of a found item's products, so its bound is its score's."""
        first = np.searchsorted(self.key_item, items)
        return consecutive(first, np.searchsorted(self.key_item, items, side="right") - first)

    def _flat_keys(self) -> torch.Tensor:
        """The keys a flat first stage holds [N, r + 1], without a copy."""
        if self._keys is None:
            dims = self.first.d
            self._keys = torch.from_numpy(faiss.rev_swig_ptr(
                self.first.get_xb(), self.first.ntotal * dims).reshape(-1, dims))
        return self._keys

    def _ivf_search(self, probes: np.ndarray, lengths: np.ndarray, found: int,
                    probe: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An IVF first stage's search of the `probe` lists whose centres score highest (found
        exactly from the stored centres: the HNSW quantizer may miss some), and the bound on
        the keys of the lists it did not search: q . centre + |q| radius (the farthest key)."""
        centres = probes @ self.list_center.T  # [m, lists]
        lists = np.argpartition(-centres, probe - 1, axis=1)[:, :probe]
        near = np.take_along_axis(centres, lists, axis=1)
        with self._searching:  # nprobe is the index's: one search at a time sets it
            self.first.nprobe = probe
            scores, ids = self.first.search_preassigned(probes, found, lists, near)
        unsearched = centres + lengths[:, None] * self.list_radius
        np.put_along_axis(unsearched, lists, -np.inf, axis=1)
        return scores, ids, unsearched.max(axis=1, initial=-np.inf)

    def _bounded(self, scores: np.ndarray, ids: np.ndarray, last: np.ndarray,
                 beyond: np.ndarray, complete: bool, lengths: np.ndarray, outside: np.ndarray,
                 found: int) -> Retrieved:
        """A first-stage answer with its bounds: a returned pair's projected product plus what
        the codes and the projection leave out and the rounding; an unreturned pair's, the
        `last` product of its row's best (-inf: none left) or `beyond`, plus the same with the
        largest part any key leaves out."""
        slack = 3 * (self.first.d + 2) * UNIT * lengths * self.largest_key  # rounding
        unseen = (np.maximum(last + self.code_error * lengths, beyond)
                  + self.largest_residual * outside + slack)
        row, column = np.nonzero(ids >= 0)
        key = ids[row, column]
        upper = (scores[row, column] + self.code_error * lengths[row] + slack[row]
                 + self.residual[key] * outside[row])
        return Retrieved(self.key_item[key], row, upper, unseen, found, complete, key)

    def scorer(self, query: FragmentSet, image_side: bool,
               rank_fn: Callable[[FragmentSet, FragmentSet], torch.Tensor]
               ) -> Callable[[np.ndarray], np.ndarray]:
        """Exact scores of positions (sorted) against `query`: the model's score, as the exact
        scan and trainer.evaluate compute it, in float64 rounded to float32, so an item scores
        the same whichever batch it is scored in (float32 products depend on the batch's
        shape by an ulp, which would reorder identical sentences)."""
        query = dataclasses.replace(query, embeddings=query.embeddings.double())

        def score(positions: np.ndarray) -> np.ndarray:
            items = self.select(positions.tolist())
            items = dataclasses.replace(items, embeddings=items.embeddings.double())
            scores = rank_fn(items, query)[:, 0] if image_side else rank_fn(query, items)[0]
            return scores.float().numpy().astype(np.float64)
        return score

    def select(self, positions: Sequence[int]) -> FragmentSet:
        """The items at `positions` with their rows in float32, read from the memory map."""
        positions = np.asarray(positions, np.int64)
        counts = self.counts[positions]
        rows = consecutive(self.start[positions], counts)
        return FragmentSet([self.items[p] for p in positions.tolist()],
                           torch.from_numpy(self.rows[rows].astype(np.float32)
                                            * self.scale[rows][:, None]),
                           owners(counts.tolist()),
                           torch.from_numpy(np.array(self.detail[rows])))


def search(collection: Collection, query: FragmentSet, k: int, image_side: bool, smooth: float,
           score: str, exact_scan: bool = False, budget_s: float | None = BUDGET_S) -> Ranking:
    """`collection`'s exact top k for `query` (one sentence against images when `image_side`,
    else one image against sentences) by the model's score: certified
    (trainer/search/certificate.py), or every item scored (`exact_scan`, the reference)."""
    exact = collection.scorer(query, image_side, lambda images, sentences: rank(
        images, sentences, smooth, score))
    if exact_scan:
        return full_scan(exact, collection.items, k)
    started = time.monotonic()  # the budget counts the first stage's products too
    m = len(query.embeddings)  # eq. 6's factor of the query: 1 / (m + smooth) or 1 / m
    weight, reach = collection.reach(1 / (m + smooth) if image_side else 1 / max(m, 1))
    return certified_top_k(
        collection.candidates(query, weight, reach), exact, collection.items, k,
        keys=collection.key_candidates if score == "eq6" else max(k, CANDIDATES),
        probe=collection.probe,
        budget_s=None if budget_s is None else budget_s - (time.monotonic() - started))


def load_one_model(model: ModelFolder, boxes: str | dict[str, Any] | None,
                   detector_weights: str | None, parser: str | None) -> Embedder:
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
                                        lambda n: 1 / (n + objective.smooth))
                             if meta["sentences"] else None)
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
        if meta.get("format") not in READS:
            raise RetrievalError(f"index {folder} has format {meta.get('format')!r}, this code "
                                 f"reads formats {' and '.join(map(str, READS))}: rebuild it with "
                                 "defrag index")
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
        boxes = meta["boxes"] if meta["boxes"]["name"] != "given" else embedder.boxes  # rows
        # of shards with given boxes: a new image has none, it gets the model's choice
        return cls(folder, meta, dataclasses.replace(embedder, boxes=boxes,
                                                     max_image_pixels=max_image_pixels),
                   model.path)

    def warm_up(self) -> None:
        """Load the parser now (seconds), not at the first query."""
        with self._parse:
            parse_captions(["a dog"], self.embedder)

    def read_ahead(self) -> int:
        """Have the kernel read what every search reads (the first stage's keys) and then what
        rescoring reads (the rows) while they fit in memory, so a server's first queries do not
        wait on the disk; the bytes asked for. It may block at disk speed: `defrag serve` calls
        it once, in a thread of its own."""
        sides = [side for side in (self.images, self.sentence_set) if side is not None]
        asked = prefetch([side.key_extent for side in sides] + [side.row_extent for side in sides])
        log.info("asked the kernel to read %.2f GiB of %s into the page cache", asked / 2**30,
                 self.folder)
        return asked

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

    def images_for(self, text: str, k: int = 10, exact_scan: bool = False) -> Ranking:
        """The k best images for a sentence."""
        return self.images_for_rows(self.query_rows(text), k, exact_scan)

    def sentences_for_image(self, name: str, k: int = 10, exact_scan: bool = False) -> Ranking:
        """The k best sentences of the index for one of its images."""
        return self.sentences_for_rows(self.images.select([self.position_of(name)]), k,
                                       exact_scan)

    def sentences_for_file(self, path: Path, k: int = 10, exact_scan: bool = False) -> Ranking:
        """The k best sentences of the index for a new image file (e.g. an upload)."""
        return self.sentences_for_rows(self.embed_file(path), k, exact_scan)

    def embed_file(self, path: Path) -> FragmentSet:
        """A new image file's fragments, as the model embeds it."""
        return embed_images([path], self.embedder, skip_bad=False, progress=False)[0]

    def images_for_rows(self, query: FragmentSet, k: int = 10, exact_scan: bool = False,
                        budget_s: float | None = BUDGET_S) -> Ranking:
        """The exact top k images for an embedded sentence (one item), certified
        (trainer/search/certificate.py); `exact_scan` scores every image instead."""
        objective = self.embedder.cfg.objective
        return search(self.images, query, k, True, objective.smooth, objective.score,
                      exact_scan, budget_s)

    def sentences_for_rows(self, image: FragmentSet, k: int = 10, exact_scan: bool = False,
                           budget_s: float | None = BUDGET_S) -> Ranking:
        """The exact top k sentences for an embedded image (one item), as `images_for_rows`."""
        if self.sentence_set is None:
            raise RetrievalError("this index has no sentences: rebuild it with --sentences FILE")
        objective = self.embedder.cfg.objective
        return search(self.sentence_set, image, k, False, objective.smooth, objective.score,
                      exact_scan, budget_s)

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

