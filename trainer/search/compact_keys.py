"""A flat first stage's keys at one byte a dimension (docs/design.md section 11): each key x = k - c
(c: the collection's mean key) as int8 codes a times a per-row float32 scale s, the query rows q
the same (codes b, scale t), so one integer matrix product, exact in int32, gives every product
of a query with every key; what the codes and the scaling round is in the bounds.

A pair's bound. k and q are the key and the query row as the exact rescoring computes them in
float64 (a fragment row: fp16 times its scale; or an item's mean row); e_k = x - s a. The query
row is coded twice: q = t1 b1 + t2 b2 + e_q, b2 the codes of q - t1 b1. Then
    k . q = c . q + s t1 (a . b1) + s t2 (a . b2) + (s a) . e_q + e_k . q,
    |(s a) . e_q| <= N_k E_q and |e_k . q| <= E_k Q   (Cauchy-Schwarz),
with E_k >= |e_k| and N_k >= |s a| stored per key, E_q >= |e_q| and Q >= |q| per query row
(each measured in float64 against the exact rows, widened by MARGIN, rounded up to float32).
a . b = I is an exact int32 (|I| <= 127^2 d < 2^31 for d <= MOST_DIMS); each pass returns
yi = fl(fl(fl(Ii) ti) s), three float32 roundings (|s ti Ii - yi| <= SCALING |yi|, + TINY for an
underflow), and y = fl(y1 + y2). As |y1| + |y2| <= (1 + 2u) |y| + 2 |y2| and
|y2| <= (1 + SCALING) N_k (E_q1 + E_q2) (E_q1 >= |q - t1 b1|), the passes' roundings are within
PASS_ROUNDING |y| + 2.5 SCALING N_k (E_q1 + E_q2) (+ 3 TINY). C = fl64(c . q) is within
d 2^-52 |c| |q| of c . q. Hence the pair bound, with E_q' = E_q + 2.5 SCALING (E_q1 + E_q),
    k . q <= y + C + PASS_ROUNDING |y| + E_k Q + N_k E_q' + d 2^-52 |c| Q + 3 TINY,
plus MARGIN of the terms' size for the float64 arithmetic of the bound itself. Both passes are
one integer product (the query's two codes side by side); the second takes the query's rounding
(~0.8% of |q|, as large as the key's) out of the bound.

Every pair bounded in one pass (`pair_bounds`). In the bound, only PASS_ROUNDING |y| and the
MARGIN terms are not linear in y, E_k and N_k; with |y| <= (1 + 2^-20) N_max (|t1 b1| + |t2 b2|)
=: Y_j (Cauchy-Schwarz on each pass, then the roundings) and the largest E_k, N_k there, the
bound is at most y + E_k Q_j + N_k E_q'_j + B_j, B_j a constant of the query row. float32
computes z = fl(y + E_k Q_j + N_k E_q'_j + B_j) within 5u of |y| + E_k Q_j + N_k E_q'_j + |B_j|,
so 8u of Y_j + E_max Q_j + N_max E_q'_j + |B_j| (+ 8 x 2^-126 for subnormals flushed to zero)
is added to B_j: z >= k . q. Eq. 6's share of a key, sum_j max(0, k . q_j), is then at most the
float32 sum of max(0, z_j) widened by its own rounding (m terms in any order): Z (1 + 2 (m + 1) u)
+ 2 (m + 1) 2^-126 (`key_bounds`). An item's bound is w(n) times its keys' (float64, widened by
MARGIN): every item is bounded by the pass, none by a row's `unseen`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

LEVELS = 127  # codes in [-127, 127]
MOST_DIMS = (2**31 - 1) // LEVELS**2  # 133,144: a . b fits int32 (more: no int8 keys written)
UNIT = 2**-24  # float32's unit roundoff
SCALING = 4 * UNIT  # gamma_3 / (1 - gamma_3) <= 4 UNIT: a pass's three float32 roundings
PASS_ROUNDING = 6 * UNIT  # >= u + SCALING (1 + 2u): the two passes' sum (module doc)
MARGIN = 2**-30  # relative: the float64 arithmetic of codes' errors and bounds (2^-53 an op)
TINY = 2**-100  # absolute: a float32 underflow of the scaled products (2^-149 a rounding)
BLOCK = 1 << 13  # keys encoded at a time (float64 copies)
SCAN_BLOCK = 1 << 14  # keys a pass scans at a time (its products stay in the cache)
COLUMNS = 16  # query code columns padded to a multiple of this: the int8 product over 2, 16
# or 32 columns took 0.7-1.0 ms a block of keys here, over 20 or 24 columns 1.2-1.3 ms
SMALLEST = 2**-126  # float32's least normal: what a flushed subnormal loses


def round_up(x: np.ndarray) -> np.ndarray:
    """The least float32 >= each float64 of x."""
    y = x.astype(np.float32)
    return np.where(y < x, np.nextafter(y, np.float32(np.inf)), y)


def encode(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows (float64, exact) as int8 `codes` [n, d] times a float32 `scale` [n] (the largest
    magnitude / 127), with `error` >= |row - scale codes| and `norm` >= |scale codes|, float32
    rounded up (the error is measured, so any rounding of scale or codes is counted)."""
    scale = (rows.abs().amax(dim=1) / LEVELS).float().clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(rows / scale.double()[:, None]).clamp(-LEVELS, LEVELS).to(torch.int8)
    coded = scale.double()[:, None] * codes.double()  # exact: 24 + 8 bits
    error = torch.linalg.vector_norm(rows - coded, dim=1).numpy()
    size = torch.linalg.vector_norm(rows, dim=1).numpy()
    norm = torch.linalg.vector_norm(coded, dim=1).numpy()
    return {"codes": codes, "scale": scale,
            "error": torch.from_numpy(round_up((error + MARGIN * size) * (1 + MARGIN))),
            "norm": torch.from_numpy(round_up(norm * (1 + MARGIN)))}


def compact_keys(keys: Callable[[slice], torch.Tensor], total: int,
                 center: torch.Tensor) -> dict[str, torch.Tensor]:
    """The safetensors entries of `total` keys (`keys(slice)`: float64 rows, the model's)
    minus `center`: `int8_codes`, `int8_scale`, `int8_error`, `int8_norm` (`encode`), a block
    at a time into arrays made once (no second copy of the codes: 2 GB at 2,000,000 keys)."""
    kinds = encode(torch.zeros(0, len(center), dtype=torch.float64))  # each entry's dtype
    coded = {name: value.new_empty((total, *value.shape[1:])) for name, value in kinds.items()}
    for begin in range(0, total, BLOCK):
        for name, value in encode(keys(slice(begin, begin + BLOCK)) - center.double()).items():
            coded[name][begin:begin + len(value)] = value
    return {f"int8_{name}": value for name, value in coded.items()}


class CompactKeys:
    """The compact keys of an opened index (`int8_codes` memory-mapped) and their pass."""

    def __init__(self, arrays: dict[str, np.ndarray], center: torch.Tensor) -> None:
        with warnings.catch_warnings():  # a read-only memory map, which nothing writes
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            self.codes = torch.from_numpy(arrays["int8_codes"])  # int8 [N, d]
        self.scale = torch.from_numpy(np.array(arrays["int8_scale"]))
        self.error = torch.from_numpy(np.array(arrays["int8_error"]))  # float32, rounded up
        self.norm = torch.from_numpy(np.array(arrays["int8_norm"]))
        self.center = center.double()
        self.most_error = float(self.error.max()) if len(self) else 0.0
        self.most_norm = float(self.norm.max()) if len(self) else 0.0

    def __len__(self) -> int:
        return len(self.codes)

    def scan(self, exact: torch.Tensor) -> Scan:
        """The query rows (float64 [m, d], the model's) coded twice, their codes and the codes
        of what those leave out (so that the query's own rounding all but leaves the bound),
        and each row's terms of the pair bound (module doc)."""
        first = encode(exact)
        second = encode(exact - first["scale"].double()[:, None] * first["codes"].double())
        size = torch.linalg.vector_norm(exact, dim=1).numpy() * (1 + MARGIN)  # Q
        left = second["error"].numpy().astype(np.float64)
        error = left + 2.5 * SCALING * (first["error"].numpy() + left)  # E_q'
        shift = (exact @ self.center).numpy()  # C
        shift_error = (len(self.center) * 2**-52 * size
                       * float(torch.linalg.vector_norm(self.center)) * (1 + MARGIN))
        most = ((1 + 2**-20) * self.most_norm * (first["norm"] + second["norm"]).double().numpy()
                + TINY)  # >= |y|
        size, error = round_up(size), round_up(error)
        rest = PASS_ROUNDING * most + shift_error + 3 * TINY
        widest = size * self.most_error + error * self.most_norm
        constant = shift + rest + MARGIN * (most + np.abs(shift) + rest + widest)
        rounding = 8 * UNIT * (most + widest + np.abs(constant)) + 8 * SMALLEST
        return Scan(first, second, torch.from_numpy(size), torch.from_numpy(error),
                    torch.from_numpy(round_up(constant + rounding)))

    def pair_bounds(self, scan: Scan, keys: slice | np.ndarray) -> torch.Tensor:
        """float32 [K, m]: a bound on k . q_j of each of `keys` and each query row,
        z = fl(y + E_k Q_j + N_k E_q'_j + B_j) (module doc)."""
        z = scan.products(self.codes[keys], self.scale[keys])
        z.addcmul_(self.error[keys][:, None], scan.size).addcmul_(self.norm[keys][:, None],
                                                                  scan.error)
        return z.add_(scan.constant)

    def key_bounds(self, scan: Scan, positive: bool) -> np.ndarray:
        """float64 [N]: for every key, a bound on sum_j max(0, k . q_j) over the query rows
        (`positive`: eq. 6's share of the key; the float32 sum widened by its rounding), else
        on k . q of the one query row: one pass over the keys, a block at a time."""
        bounds, m = np.empty(len(self)), len(scan.size)
        for begin in range(0, len(self), SCAN_BLOCK):
            block = slice(begin, begin + SCAN_BLOCK)
            z = self.pair_bounds(scan, block)
            if positive:
                summed = z.clamp_(min=0).sum(dim=1).double().numpy()
                bounds[block] = summed * (1 + 2 * (m + 1) * UNIT) + 2 * (m + 1) * SMALLEST
            else:
                bounds[block] = z[:, 0].double().numpy()
        return bounds


class Scan:
    """One query's rows coded twice (`encode`s), side by side for one integer product, and the
    rows' terms of the pair bound: Q_j (`size`), E_q'_j (`error`), B_j (`constant`)."""

    def __init__(self, first: dict[str, torch.Tensor], second: dict[str, torch.Tensor],
                 size: torch.Tensor, error: torch.Tensor, constant: torch.Tensor) -> None:
        codes = torch.cat([first["codes"], second["codes"]])  # [2m, d], then zero rows
        padding = torch.zeros(-len(codes) % COLUMNS, codes.shape[1], dtype=torch.int8)
        # a new tensor's row-major strides: for d = 1, .contiguous() would keep the [1, n]
        # transpose's strides (1, 1), for which torch._int_mm returns memory it never wrote
        self.codes = torch.cat([codes, padding]).T.clone(memory_format=torch.contiguous_format)
        self.scales = torch.cat([first["scale"], second["scale"]])
        self.rows = len(first["codes"])
        self.size, self.error, self.constant = size, error, constant

    def products(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """y = fl(y1 + y2) [K, m] of keys' codes a (int8 [K, d]) and scales s [K], each pass
        yi = fl(fl(fl(a . bi) ti) s) (a . bi exact in int32)."""
        m = self.rows
        if not len(codes):
            return torch.zeros(0, m)
        y = torch._int_mm(codes, self.codes)[:, :2 * m].float()  # the padding left out
        y.mul_(self.scales).mul_(scale[:, None])
        return y[:, :m].add_(y[:, m:])


@functools.cache
def int8_products_exact() -> bool:
    """Whether this CPU's int8 matrix product is exact on the codes' extremes (int16 pair sums
    saturate on some CPUs without VNNI); if not, the first stage scans the float32 keys."""
    pattern = torch.tensor([LEVELS, -LEVELS, LEVELS, LEVELS, -LEVELS, -LEVELS, 0, LEVELS])
    rows = torch.stack([pattern.roll(shift) * sign for shift in range(8) for sign in (1, -1)])
    rows = rows.repeat(1, 130).to(torch.int8)  # 16 rows of 1040: the queries' shape
    keys = rows.repeat(256, 1)  # and 4096 keys, as a pass's
    if torch.equal(torch._int_mm(keys, rows.T.contiguous()).long(),
                   keys.long() @ rows.long().T):
        return True
    log.warning("this CPU's int8 matrix product is not exact: the first stage scans float32 keys")
    return False
