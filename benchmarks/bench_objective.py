"""Forward + backward time of DeFragLoss at paper scale against its matrix-product floor.

The floor is the matrix products no implementation can avoid, timed in the same run on the same
shapes: the fragment scores F = v s^T and the two products of its backward (dv = G s,
ds = G^T v). In the 8-worker case a rank computes its own rows (v_own s_all^T) and, for the
column-wise ranking term, all image fragments against its own sentences (v_all s_own^T).

    python benchmarks/bench_objective.py [--pairs 100] [--workers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from trainer.objectives import DeFragLoss


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_batch(pairs: int, image_frags: int, dim: int, generator: torch.Generator):
    """Paper-scale fragments: image_frags per image, 8-14 per sentence, unit-scale scores."""
    sentence_frags = torch.randint(8, 15, (pairs,), generator=generator)
    v_owner = torch.arange(pairs).repeat_interleave(image_frags)
    s_owner = torch.arange(pairs).repeat_interleave(sentence_frags)
    v = torch.randn(len(v_owner), dim, generator=generator) / dim**0.5
    s = torch.randn(len(s_owner), dim, generator=generator)
    image_key = torch.arange(pairs)
    image_key[1::5] = image_key[0::5][: len(image_key[1::5])]  # some pairs share an image
    return v, v_owner, s, s_owner, image_key


def matmul_floor(pairs_of_operands: list[tuple[torch.Tensor, torch.Tensor]], repeats: int):
    """Time of a @ b^T and of the two backward products, for every (a, b)."""

    def run():
        for a, b in pairs_of_operands:
            grad = a @ b.T
            grad @ b, grad.T @ a  # noqa: B018 -- the backward products dv and ds

    return median_time(run, repeats)


def bench_case(name: str, local_pairs: int, workers: int, args, generator) -> dict:
    v, v_owner, s, s_owner, image_key = make_batch(local_pairs * workers, args.image_frags,
                                                   args.dim, generator)
    own_pairs = torch.arange(len(image_key)) < local_pairs
    own_v, own_s = v[own_pairs[v_owner]], s[own_pairs[s_owner]]
    loss_fn = DeFragLoss()
    v.requires_grad_(True)
    s.requires_grad_(True)

    def step():  # one rank's terms, as DeFragLoss computes them on the gathered batch
        terms = loss_fn.rank_terms(v, v_owner, s, s_owner, image_key,
                                   None if workers == 1 else own_pairs)
        loss_fn.combine(terms, terms.label_counts)["loss"].backward()
        v.grad = s.grad = None

    seconds = median_time(step, args.repeats)
    with torch.no_grad():
        operands = [(own_v, s)] if workers == 1 else [(own_v, s), (v, own_s)]
        floor = matmul_floor(operands, args.repeats)
    return {"case": name, "image_fragments": len(v), "sentence_fragments": len(s),
            "seconds": seconds, "floor_seconds": floor, "ratio": seconds / floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100, help="pairs per rank (paper: 100)")
    parser.add_argument("--workers", type=int, default=8, help="ranks of the gathered case")
    parser.add_argument("--image-frags", type=int, default=20, help="19 boxes + whole image")
    parser.add_argument("--dim", type=int, default=1000, help="embedding size (paper: ~1000)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = [bench_case("local", args.pairs, 1, args, generator),
               bench_case(f"{args.workers}-worker", args.pairs, args.workers, args, generator)]
    for r in results:
        print(f"{r['case']:>9}: {r['image_fragments']} x {r['sentence_fragments']} fragments, "
              f"fwd+bwd {r['seconds'] * 1e3:.1f} ms, matmul floor {r['floor_seconds'] * 1e3:.1f} "
              f"ms, ratio {r['ratio']:.2f} (target <= 3)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
