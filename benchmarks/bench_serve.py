"""Queries per second of the search web app (trainer/search/serve.py) with concurrent clients on
localhost, against one client's rate measured in the same run (the floor a server must keep).

The server runs as `defrag serve` in its own process; each client is a thread of this
one with a keep-alive connection, sending GET /api/search for the index's sentences in turn.
Each phase stops at --queries queries or --seconds seconds, whichever comes first. Latency is
per request at the client (p50, p95); the server's CPU time shows how many cores it kept busy.
Without --index the tests' small world is built (tests/search_world.py: ~30 s, a trained model
and an index of 8 photos and 40 sentences) under --work, or reused from there.

    python benchmarks/bench_serve.py [--index INDEX] [--clients 8] [--queries 200]
                                     [--seconds 30] [--k 10] [--work /tmp/defrag-bench-serve]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

DEFRAG = str(Path(sys.executable).with_name("defrag"))  # the `defrag` command

WARM_UP = 5  # queries before timing: the server loads its parser on the first one


def small_world(work: Path) -> Path:
    """The tests' index under `work`: built once, then reused."""
    if (work / "index" / "index.json").is_file():
        print(f"reusing the index in {work}")
        return work / "index"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.search_world import build_world

    work.mkdir(parents=True)
    return build_world(work).index


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(index: Path, port: int, *options: str, code: Path | None = None
                 ) -> subprocess.Popen:
    """`defrag serve` on `port` with `options`, once /api/info answers; `code`: the
    project tree it runs from (default: this one's, as installed)."""
    env = None if code is None else {**os.environ, "PYTHONPATH": str(code)}
    server = subprocess.Popen([DEFRAG, "serve", "--index", str(index),
                               "--port", str(port), *options], stderr=subprocess.PIPE, text=True,
                              env=env, cwd=code)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited ({server.returncode}): {server.stderr.read()[-2000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/api/info", timeout=5).ok:
                return server
        except requests.ConnectionError:
            time.sleep(0.2)
    server.kill()
    sys.exit("the server did not answer within 300 s")


def phase(url: str, queries: list[str], k: int, clients: int, count: int, seconds: float,
          server: psutil.Process) -> dict:
    """`clients` threads share `count` searches (at most `seconds`): rate, latencies, CPU."""
    taken, lock = itertools.count(), threading.Lock()
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    def client() -> None:
        with requests.Session() as session:
            while time.monotonic() < deadline:
                with lock:
                    i = next(taken)
                if i >= count:
                    return
                started = time.perf_counter()
                answer = session.get(url, params={"q": queries[i % len(queries)], "k": k})
                elapsed = time.perf_counter() - started
                if answer.status_code != 200:
                    sys.exit(f"search failed ({answer.status_code}): {answer.text}")
                with lock:
                    latencies.append(elapsed)

    cpu = sum(server.cpu_times()[:2])
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(client) for _ in range(clients)]:
            done.result()
    wall = time.perf_counter() - started
    busy = (sum(server.cpu_times()[:2]) - cpu) / wall
    p95 = statistics.quantiles(latencies, n=20)[18] if len(latencies) > 1 else latencies[0]
    result = {"clients": clients, "queries": len(latencies), "seconds": round(wall, 3),
              "queries_per_s": len(latencies) / wall,
              "p50_ms": statistics.median(latencies) * 1000, "p95_ms": p95 * 1000,
              "server_cores_busy": busy}
    print(f"  {clients} client(s): {len(latencies)} queries in {wall:.1f} s: "
          f"{result['queries_per_s']:.1f} q/s, p50 {result['p50_ms']:.0f} ms, "
          f"p95 {result['p95_ms']:.0f} ms, server busy on {busy:.2f} cores")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=Path, help="a search index (default: the tests' world)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-serve"),
                        help="where the tests' world is built without --index")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--queries", type=int, default=200, help="searches per phase, at most")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds per phase, at most")
    parser.add_argument("--k", type=int, default=10, help="images per search")
    args = parser.parse_args()

    index = args.index or small_world(args.work)
    queries = json.loads((index / "index.json").read_text())["sentences"]
    if not queries:
        sys.exit(f"{index} has no sentences to search with: build it with --sentences FILE")
    port = free_port()
    server = start_server(index, port)
    try:
        url = f"http://127.0.0.1:{port}/api/search"
        process = psutil.Process(server.pid)
        print(f"server pid {server.pid} on port {port}: {len(queries)} query sentences, "
              f"k = {args.k}, {os.cpu_count()} CPUs, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        phase(url, queries, args.k, 1, WARM_UP, args.seconds, process)
        floor = phase(url, queries, args.k, 1, args.queries, args.seconds, process)
        loaded = phase(url, queries, args.k, args.clients, args.queries, args.seconds, process)
    finally:
        server.terminate()
        server.wait(timeout=30)
    ratio = loaded["queries_per_s"] / floor["queries_per_s"]
    print(f"{args.clients} clients: {loaded['queries_per_s']:.1f} q/s, {ratio:.2f} x one "
          f"client's {floor['queries_per_s']:.1f} q/s (target >= 1: concurrency costs nothing); "
          f"p95 {loaded['p95_ms']:.0f} ms")
    print(json.dumps({"index": str(index), "k": args.k, "one_client": floor, "clients": loaded,
                      "ratio": ratio}))


if __name__ == "__main__":
    main()
