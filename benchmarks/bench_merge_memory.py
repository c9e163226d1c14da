"""Peak memory of writing one side of an index as `defrag index --merge` writes it: units of
--unit-images images (--fragments rows each, --dims dimensions, random rows) appended into
`StoredFragments` (each unit quantized as it comes, the way the merge reads its parts), then
`write_collection` (first stage, int8 keys, bounds, the file). Resident memory is sampled
every 50 ms and printed per stage.

Floor: what the index must hold at once, measured in the same process: its resident memory
before anything is made plus the stored rows (fp16 + scale, owner, detail), the int8 keys and
the faiss keys (float32 of the first stage's columns). Target: peak <= 1.5 x floor.

    python benchmarks/bench_merge_memory.py [--rows 2000000] [--dims 1000] [--fragments 20]
        [--unit-images 256] [--out NEW_FOLDER (default: a temporary one)]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import trainer.search.index as index  # noqa: E402
from trainer.batch import owners  # noqa: E402
from trainer.search.fragment_set import FragmentSet  # noqa: E402

STAGES = ("fit_projection", "build_first_stage", "compact_keys", "first_stage_bounds",
          "save_file")


class Peak:
    """The process's largest resident set size since `reset`, sampled every 50 ms."""

    def __init__(self) -> None:
        self.process, self.most = psutil.Process(), 0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.most = max(self.most, self.process.memory_info().rss)
            time.sleep(0.05)

    def reset(self) -> int:
        """The peak so far (then forgotten), in bytes."""
        most, self.most = max(self.most, self.process.memory_info().rss), 0
        return most


def timed_stages(peak: Peak, peaks: dict[str, int]) -> None:
    """Record each write stage's peak (the functions write_collection calls, wrapped)."""
    def staged(name: str, call: Callable) -> Callable:
        def run(*args, **kwargs):
            peak.reset()
            result = call(*args, **kwargs)
            peaks[name] = peak.reset()
            return result
        return run
    for name in STAGES:
        setattr(index, name, staged(name, getattr(index, name)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dims", type=int, default=1000)
    parser.add_argument("--fragments", type=int, default=20, help="rows an image")
    parser.add_argument("--unit-images", type=int, default=256)
    parser.add_argument("--out", type=Path, help="a folder that does not exist yet")
    args = parser.parse_args()
    if args.out is not None and args.out.exists():
        parser.error(f"--out {args.out} exists: give a new folder (it is removed at the end)")
    out = args.out or Path(tempfile.mkdtemp(prefix="defrag-bench-merge-"))
    peak, peaks = Peak(), {}
    base = peak.reset()
    images = args.rows // args.fragments
    rows = images * args.fragments
    started = time.perf_counter()
    stored = index.StoredFragments.room([f"image-{k}" for k in range(images)], rows, args.dims,
                                        torch.zeros(0, 4))
    generator = torch.Generator().manual_seed(0)
    for first in range(0, images, args.unit_images):
        count = min(args.unit_images, images - first)
        stored.append(FragmentSet(stored.items[first:first + count],
                                  torch.randn(count * args.fragments, args.dims,
                                              generator=generator),
                                  owners([args.fragments] * count),
                                  torch.zeros(count * args.fragments, 4)), "images")
    peaks["append units"] = peak.reset()
    timed_stages(peak, peaks)
    out.mkdir(parents=True, exist_ok=True)
    index.write_collection(out, "images", stored, "eq6")
    seconds = time.perf_counter() - started
    columns = args.dims + 1 if rows < index.IVF_FROM else index.FIRST_STAGE_DIMS + 1
    floor = (base + rows * (2 * args.dims + 4 + 8 + 16)  # fp16 rows, scale, owner, detail
             + rows * (args.dims + 12)  # int8 codes, their scale, error, norm
             + rows * 4 * columns)  # faiss keys
    top = max(peaks.values())
    gib = 2**30
    for name, value in peaks.items():
        print(f"{name:>20}: peak {value / gib:6.2f} GiB")
    print(f"{rows:,} rows x {args.dims}: peak {top / gib:.2f} GiB, floor {floor / gib:.2f} GiB "
          f"(before anything {base / gib:.2f}), ratio {top / floor:.2f} (target <= 1.5), "
          f"{seconds:.0f} s, faiss {faiss.__version__}")
    print(json.dumps({"rows": rows, "dims": args.dims, "peak_gib": round(top / gib, 2),
                      "floor_gib": round(floor / gib, 2), "ratio": round(top / floor, 2),
                      "seconds": round(seconds), "stages_gib": {
                          name: round(value / gib, 2) for name, value in peaks.items()}}))
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
