"""A split index (`defrag index --parts N`) served as it runs for users: every part a `defrag
serve --index SPLIT/part-P` process and a `defrag serve --parts` front, all on 127.0.0.1; text
queries sent to the front over HTTP, checked against the exact scan of the one-part index of the
same collection (opened in this process), then the last part killed and the queries sent again.

    python benchmarks/bench_split.py --split SPLIT --whole INDEX --query-file QUERIES
                                     [--queries 300] [--checked N] [--top 10] [--part-timeout 2]
                                     [--threads 1] [--killed-queries 20]

Prints, for the whole split: the share of answers certified ("exact": true), the share whose top
k is the exact scan's (same images, same order), the latency per query at the front (p50 / p95:
each part parses the query, the parts search at once, the front merges), each process's memory
(RSS); then, with the last part killed, how long the answers take and what they say.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import requests
import torch
from bench_serve import DEFRAG, free_port
from tqdm import tqdm

from trainer.search.index import SearchIndex

GIB = 2**30


def start(parts: int, split: Path, threads: int, part_timeout: float,
          logs: Path) -> tuple[list[subprocess.Popen], str]:
    """The parts' servers and the front (a process each, logs in `logs`): the processes (the
    front last) and the front's URL, once it answers."""
    logs.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(parts + 1)]
    commands = [[DEFRAG, "serve", "--index", str(split / f"part-{p}"), "--port", str(ports[p]),
                 "--workers", "1", "--threads", str(threads)] for p in range(parts)]
    commands.append([DEFRAG, "serve", "--parts", ",".join(
        f"http://127.0.0.1:{port}" for port in ports[:parts]), "--port", str(ports[-1]),
        "--part-timeout", str(part_timeout)])
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                  stderr=(logs / f"{name}.log").open("w"))
                 for command, name in zip(commands, [*(f"part-{p}" for p in range(parts)),
                                                      "front"], strict=True)]
    front = f"http://127.0.0.1:{ports[-1]}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if requests.get(f"{front}/api/info", timeout=5).ok:
                return processes, front
        except requests.ConnectionError:
            pass
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            for process in processes:
                process.kill()
            sys.exit(f"the split's servers did not start: see {logs}")
        time.sleep(0.5)


def ask(session: requests.Session, front: str, text: str, top: int) -> tuple[float, dict]:
    """The front's answer to a text query and the seconds it took."""
    started = time.perf_counter()
    answer = session.get(f"{front}/api/search", params={"q": text, "k": top}, timeout=120)
    answer.raise_for_status()
    return time.perf_counter() - started, answer.json()


def memory_gib(processes: list[subprocess.Popen]) -> list[float]:
    return [psutil.Process(p.pid).memory_info().rss / GIB for p in processes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", type=Path, required=True, help="defrag index --parts N's")
    parser.add_argument("--whole", type=Path, required=True,
                        help="the one-part index of the same collection (the reference)")
    parser.add_argument("--query-file", type=Path, required=True)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--checked", type=int, default=None,
                        help="queries checked against the exact scan (the first N; default all: "
                             "~10 s each at 1,000,000 images)")
    parser.add_argument("--part-timeout", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="each part's threads")
    parser.add_argument("--killed-queries", type=int, default=20,
                        help="queries sent once the last part is killed")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/defrag-bench-split"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    listed = json.loads((args.split / "split.json").read_text())["parts"]
    texts = [line.strip() for line in args.query_file.read_text().splitlines()
             if line.strip()][:args.queries]
    whole = SearchIndex.open(args.whole)
    processes, front = start(len(listed), args.split, args.threads, args.part_timeout, args.logs)
    session = requests.Session()
    try:
        for text in texts[:5]:  # warm up: the parsers, the first touch of the pages
            ask(session, front, text, args.top)
        rows = []
        for number, text in enumerate(tqdm(texts, desc="queries", unit="q", leave=False)):
            seconds, answer = ask(session, front, text, args.top)
            rows.append({"seconds": seconds, "exact": answer["exact"],
                         "missing": len(answer["missing_parts"])})
            if args.checked is None or number < args.checked:
                reference = whole.images_for(text, args.top, exact_scan=True)
                rows[-1]["same"] = ([hit["image"] for hit in answer["results"]]
                                    == [whole.image_names[hit.position] for hit in reference.hits])
        rss = memory_gib(processes)
        last = processes[len(listed) - 1]
        last.send_signal(signal.SIGKILL)
        last.wait()
        killed = [ask(session, front, text, args.top) for text in texts[:args.killed_queries]]
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            process.wait(timeout=60)
    ms = 1000 * np.array([row["seconds"] for row in rows])
    certified = statistics.mean(row["exact"] for row in rows)
    checked = [row["same"] for row in rows if "same" in row]
    same = statistics.mean(checked)
    killed_ms = 1000 * np.array([seconds for seconds, _ in killed])
    named = statistics.mean(not answer["exact"] and [m["part"] for m in answer["missing_parts"]]
                            == [len(listed) - 1] for _, answer in killed)
    print(f"split {args.split}: {len(listed)} parts, {len(whole.image_names)} images; "
          f"{len(rows)} text queries at the front, top {args.top}:")
    print(f"  certified {100 * certified:.1f}%, the exact scan's top {args.top} "
          f"{100 * same:.1f}% of {len(checked)} checked, parts missing in "
          f"{sum(r['missing'] > 0 for r in rows)}; "
          f"p50 {np.median(ms):.1f} ms, p95 {np.percentile(ms, 95):.1f} ms")
    print(f"  memory (RSS): parts {', '.join(f'{g:.2f}' for g in rss[:-1])} GiB, front "
          f"{rss[-1]:.2f} GiB")
    print(f"  part {len(listed) - 1} killed: {len(killed)} queries answered, p50 "
          f"{np.median(killed_ms):.1f} ms, max {killed_ms.max():.1f} ms; 'exact': false and the "
          f"part named in {100 * named:.0f}%")
    print(json.dumps({"split": str(args.split), "parts": len(listed),
                      "images": len(whole.image_names), "queries": len(rows), "top": args.top,
                      "certified": certified, "checked": len(checked),
                      "same_as_exact_scan": same,
                      "p50_ms": float(np.median(ms)), "p95_ms": float(np.percentile(ms, 95)),
                      "rss_gib": rss, "killed_p50_ms": float(np.median(killed_ms)),
                      "killed_max_ms": float(killed_ms.max()), "killed_named": named}))


if __name__ == "__main__":
    main()
