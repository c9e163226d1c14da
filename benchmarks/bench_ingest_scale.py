"""Featurizing img2dataset shards end to end at growing sizes: wall time, images/s and peak
memory per task, which must not grow with the data. Exits 1 when it does.

For each size N (`--sizes`), the first N images of a generated img2dataset set (1,000 per
shard, `--image-size` px JPEGs, `featurizer.synthetic.write_img2dataset`, made once under
`--cache` and reused) are featurized by the real command, as a job would run it:

    python -m featurizer webdataset --shards DIR/{00000..K}.tar --out OUT --boxes fullframe \
        --parser spacy --workers 1 --task I --tasks T        (T tasks at once, one core each)
    python -m featurizer merge --out OUT

into a fresh OUT. A task's peak memory is `ru_maxrss` from `wait4` (the largest of the task
and its child processes); each size's largest task peak must stay within `--memory-ratio` x
the smallest size's, and the manifest must count N images.

    python benchmarks/bench_ingest_scale.py [--sizes 10000,100000] [--tasks 2]
        [--image-size 128] [--cache /tmp/defrag-bench-ingest/img2dataset-128px]
        [--work /tmp/defrag-bench-ingest] [--memory-ratio 1.2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from featurizer.synthetic import write_img2dataset

PER_SHARD = 1000
MIB = 2**20


def shard_set(cache: Path, count: int, image_size: int) -> Path:
    """The folder of a generated img2dataset set of at least `count` images (`count` rounded
    up to whole shards), made under `cache` unless a complete one is there."""
    stamp = cache / "complete.json"
    made = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if made.get("images", 0) >= count and made.get("image_size") == image_size:
        return cache
    stamp.unlink(missing_ok=True)
    started = time.perf_counter()
    write_img2dataset(cache, count, PER_SHARD, image_size=image_size)
    stamp.write_text(json.dumps({"images": count, "image_size": image_size}))
    print(f"generated {count} images into {cache} in {time.perf_counter() - started:.0f} s",
          flush=True)
    return cache


def run_process(command: list[str], log: Path) -> dict:
    """Run `command` (its output into `log`): exit status, wall time, peak RSS (it or a child)."""
    started = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return {"exit": process.returncode, "wall_s": time.perf_counter() - started,
            "peak_rss_mib": usage.ru_maxrss * 1024 / MIB, "log": str(log)}


def featurize(shards: Path, count: int, out: Path, tasks: int) -> dict:
    """The job over the first `count` images of `shards`: `tasks` tasks at once, then merge."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    url = str(shards / f"{{00000..{count // PER_SHARD - 1:05d}}}.tar")
    base = [sys.executable, "-m", "featurizer"]
    results: list[dict] = [{} for _ in range(tasks)]

    def task(index: int) -> None:
        results[index] = run_process(
            [*base, "webdataset", "--shards", url, "--out", str(out / "set"), "--boxes",
             "fullframe", "--parser", "spacy", "--workers", "1", "--task", str(index),
             "--tasks", str(tasks)], out / f"task-{index}.log")

    started = time.perf_counter()
    threads = [threading.Thread(target=task, args=(index,)) for index in range(tasks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    merged = run_process([*base, "merge", "--out", str(out / "set")], out / "merge.log")
    wall = time.perf_counter() - started
    for result in [*results, merged]:
        if result["exit"] != 0:
            sys.exit(f"the {count}-image run failed (exit {result['exit']}): see {result['log']}")
    manifest = json.loads((out / "set" / "manifest.json").read_text())
    images = sum(split["images"] for split in manifest["splits"].values())
    if images != count:
        sys.exit(f"the {count}-image run's manifest counts {images} images")
    parts = [json.loads(path.read_text()) for path in (out / "set" / "parts").glob("0*.json")]
    for index, result in enumerate(results):
        result["images"] = sum(shard["samples"] for part in parts if part["unit"] % tasks == index
                               for shard in part["shards"])
        result["images_per_s"] = result["images"] / result["wall_s"]
    return {"images": count, "tasks": results, "merge": merged, "wall_s": wall,
            "images_per_s": count / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000",
                        help="comma-separated image counts, multiples of 1000")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-ingest"))
    parser.add_argument("--cache", type=Path,
                        help="where the generated set is kept (default WORK/img2dataset-SIZEpx)")
    parser.add_argument("--memory-ratio", type=float, default=1.2)
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))
    if any(size <= 0 or size % PER_SHARD for size in sizes):
        sys.exit(f"--sizes {args.sizes}: each a positive multiple of {PER_SHARD}")
    os.environ["OMP_NUM_THREADS"] = "1"  # each task one core
    cache = args.cache or args.work / f"img2dataset-{args.image_size}px"
    shards = shard_set(cache, sizes[-1], args.image_size)
    runs = []
    for size in sizes:
        load = os.getloadavg()[0]
        run = featurize(shards, size, args.work / f"out-{size}", args.tasks)
        run["load_average"] = round(load, 1)
        runs.append(run)
        print(f"{size} images, {args.tasks} tasks at once (load average {load:.1f} before): "
              f"{run['wall_s']:.0f} s with the merge, {run['images_per_s']:.0f} images/s")
        for index, task in enumerate(run["tasks"]):
            print(f"  task {index}: {task['images']} images in {task['wall_s']:.0f} s, "
                  f"{task['images_per_s']:.0f} images/s, peak RSS {task['peak_rss_mib']:.0f} MiB")
        print(f"  merge: {run['merge']['wall_s']:.1f} s, peak RSS "
              f"{run['merge']['peak_rss_mib']:.0f} MiB", flush=True)
    floor = max(task["peak_rss_mib"] for task in runs[0]["tasks"])
    failed = False
    for run in runs:
        run["peak_ratio"] = max(task["peak_rss_mib"] for task in run["tasks"]) / floor
        ok = run["peak_ratio"] <= args.memory_ratio
        failed |= not ok
        print(f"{run['images']} images: largest task peak / the {sizes[0]}-image run's "
              f"{run['peak_ratio']:.3f} (limit {args.memory_ratio}) "
              f"{'ok' if ok else 'FAILED: memory grows with the data'}")
    print(json.dumps({"image_size": args.image_size, "tasks": args.tasks, "runs": runs}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
