"""Queries per second of the search web app (trainer/search/serve.py) with 1, 8 and 64 concurrent
clients on localhost, for each number of server worker processes (`defrag serve --workers`):
how the rate scales with workers, against one worker's in the same run.

The server runs as `defrag serve --workers W` in its own processes; each client is a thread of
this one with a keep-alive connection, sending GET /api/search for the index's sentences in turn.
Each phase stops at --queries queries or --seconds seconds, whichever comes first. Latency is
per request at the client (p50, p95); the CPU time of the server's processes shows how many
cores they kept busy, this process's how many the clients took. Without --index the tests' small
world is built (tests/search_world.py: ~30 s, a trained model and an index of 8 photos and 40
sentences) under --work, or reused from there.

    python benchmarks/bench_serve.py [--index INDEX] [--workers 1 2] [--threads N]
                                     [--clients 1 8 64] [--queries 400] [--seconds 30]
                                     [--k 10] [--work /tmp/defrag-bench-serve]
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

WARM_UP = 5  # queries per worker before timing: each worker's first searches are slower


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
    """`defrag serve` on `port` with `options`, once /api/info answers (its access log, on
    stdout, discarded); `code`: the project tree it runs from (default: this one's, as
    installed)."""
    env = None if code is None else {**os.environ, "PYTHONPATH": str(code)}
    server = subprocess.Popen([DEFRAG, "serve", "--index", str(index),
                               "--port", str(port), *options], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=code)
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


def cpu_seconds(server: psutil.Process) -> float:
    """User and system CPU time of `server` and its worker processes so far."""
    return sum(sum(process.cpu_times()[:2])
               for process in [server, *server.children(recursive=True)])


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

    cpu, client_cpu = cpu_seconds(server), sum(psutil.Process().cpu_times()[:2])
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(client) for _ in range(clients)]:
            done.result()
    wall = time.perf_counter() - started
    busy = (cpu_seconds(server) - cpu) / wall
    client_busy = (sum(psutil.Process().cpu_times()[:2]) - client_cpu) / wall
    p95 = statistics.quantiles(latencies, n=20)[18] if len(latencies) > 1 else latencies[0]
    result = {"clients": clients, "queries": len(latencies), "seconds": round(wall, 3),
              "queries_per_s": len(latencies) / wall,
              "p50_ms": statistics.median(latencies) * 1000, "p95_ms": p95 * 1000,
              "server_cores_busy": busy, "client_cores_busy": client_busy}
    print(f"  {clients} client(s): {len(latencies)} queries in {wall:.1f} s: "
          f"{result['queries_per_s']:.1f} q/s, p50 {result['p50_ms']:.0f} ms, "
          f"p95 {result['p95_ms']:.0f} ms, server busy on {busy:.2f} cores, "
          f"clients on {client_busy:.2f}")
    return result


def measure(index: Path, workers: int, queries: list[str], args: argparse.Namespace
            ) -> list[dict]:
    """One phase per --clients count against `defrag serve --workers workers`."""
    port = free_port()
    threads = ["--threads", str(args.threads)] if args.threads else []
    server = start_server(index, port, "--workers", str(workers), *threads)
    try:
        url = f"http://127.0.0.1:{port}/api/search"
        process = psutil.Process(server.pid)
        print(f"{workers} worker(s), server pid {server.pid} on port {port}:")
        phase(url, queries, args.k, workers, WARM_UP * workers, args.seconds, process)
        return [{"workers": workers, **phase(url, queries, args.k, clients, args.queries,
                                             args.seconds, process)}
                for clients in args.clients]
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=Path, help="a search index (default: the tests' world)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-serve"),
                        help="where the tests' world is built without --index")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="server worker processes, one server each (default 1 2)")
    parser.add_argument("--threads", type=int,
                        help="torch and faiss threads per worker (default: the server's, CPUs / "
                             "workers)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64],
                        help="concurrent clients, one phase each (default 1 8 64)")
    parser.add_argument("--queries", type=int, default=400, help="searches per phase, at most")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds per phase, at most")
    parser.add_argument("--k", type=int, default=10, help="images per search")
    args = parser.parse_args()

    index = args.index or small_world(args.work)
    queries = json.loads((index / "index.json").read_text())["sentences"]
    if not queries:
        sys.exit(f"{index} has no sentences to search with: build it with --sentences FILE")
    print(f"{len(queries)} query sentences, k = {args.k}, {len(os.sched_getaffinity(0))} CPUs, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    rows = [row for workers in args.workers for row in measure(index, workers, queries, args)]
    one_worker = {row["clients"]: row["queries_per_s"] for row in rows if row["workers"] == 1}
    print("| workers | clients | queries/s | p50 | p95 | server busy on | clients busy on |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        scale = (f" ({row['queries_per_s'] / one_worker[row['clients']]:.2f}x 1 worker)"
                 if row["clients"] in one_worker and row["workers"] != 1 else "")
        print(f"| {row['workers']} | {row['clients']} | {row['queries_per_s']:.1f}{scale} | "
              f"{row['p50_ms']:.0f} ms | {row['p95_ms']:.0f} ms | "
              f"{row['server_cores_busy']:.2f} cores | {row['client_cores_busy']:.2f} cores |")
    print(json.dumps({"index": str(index), "k": args.k, "threads": args.threads, "phases": rows}))


if __name__ == "__main__":
    main()
