"""Peak memory of the search web app (trainer/search/serve.py) while clients post worst-case images
at the same moment, against a floor measured in the same run: the server's idle RSS plus an
allowance. Exits 1 when a phase's peak is over its floor.

Two phases, each with --clients clients released together (a barrier) on POST /api/sentences:
- hostile: a 12000 x 12000 PNG (144 Mpx of zeros, ~420 KB: under the 10 MiB upload limit and
  PIL's bomb limit). The bound refuses it from its header: floor = idle + --allowance-mb.
- largest: the largest square PNG under the pixel bound (--max-image-pixels), which the server
  decodes, --upload-slots at a time: floor = idle + --allowance-mb + slots x BYTES_PER_PIXEL x
  its pixels.
The peak is the server process's VmHWM (/proc/PID/status), reset before each phase
(/proc/PID/clear_refs); idle is its RSS after a first ordinary upload (parser and model loaded).
Without --index the tests' small world is built (tests/search_world.py) under --work, or reused.
--code runs the server from another project tree (e.g. `git worktree add /tmp/old b8cefef`) to
measure older code, without the bound and slot flags (its floor counts every client as a slot);
--phases chooses which phases run.

    python benchmarks/bench_upload_memory.py [--index INDEX] [--clients 8] [--allowance-mb 100]
                                             [--max-image-pixels 40000000] [--upload-slots 2]
                                             [--code DIR]
                                             [--phases hostile largest]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import threading
import time
from pathlib import Path

import psutil
import requests
from bench_serve import free_port, small_world, start_server
from PIL import Image

HOSTILE_SIDE = 12000
# Memory an accepted upload may hold per pixel: three full RGB decodes (3 bytes a pixel each),
# for the two it holds at once (the featurizer's, whose boxes need the full image, and the
# reader's, the pixels the model sees, decoded from the same bytes) and PIL's working memory.
BYTES_PER_PIXEL = 9
MIB = 2**20


def png_of_zeros(side: int, cache: Path) -> bytes:
    """A side x side RGB PNG of zeros (compresses ~1000:1), made once under `cache`."""
    path = cache / f"zeros-{side}.png"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        out = io.BytesIO()
        Image.new("RGB", (side, side)).save(out, "PNG")
        path.write_bytes(out.getvalue())
    return path.read_bytes()


def peak_rss(pid: int) -> int:
    """VmHWM of `pid` in bytes: its peak resident memory since start or the last reset."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS


def post_together(url: str, body: bytes, clients: int) -> tuple[list[int], float, str]:
    """`clients` threads post `body` at once: their status codes, the wall time, one answer."""
    barrier, codes, answers = threading.Barrier(clients), [], []

    def client() -> None:
        barrier.wait()
        answer = requests.post(url, data=body, headers={"Content-Type": "image/png"},
                               timeout=600)
        codes.append(answer.status_code)
        answers.append(answer.text)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return codes, time.perf_counter() - started, answers[0]


def phase(name: str, url: str, body: bytes, side: int, clients: int, pid: int, idle: int,
          floor: int) -> dict:
    reset_peak(pid)
    codes, seconds, answer = post_together(url, body, clients)
    peak = peak_rss(pid)
    result = {"phase": name, "image": f"{side} x {side} PNG, {len(body) / 1024:.0f} KB",
              "clients": clients, "codes": sorted(codes), "seconds": round(seconds, 2),
              "peak_mb": round(peak / MIB), "growth_mb": round((peak - idle) / MIB),
              "floor_mb": round(floor / MIB), "within": peak <= floor, "answer": answer[:300]}
    print(f"  {name}: {clients} x {result['image']}: answers {sorted(set(codes))} in "
          f"{seconds:.1f} s; server peak {result['peak_mb']} MiB (+{result['growth_mb']} over "
          f"idle), floor {result['floor_mb']} MiB: {'ok' if result['within'] else 'OVER'}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=Path, help="a search index (default: the tests' world)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-serve"),
                        help="where the tests' world and the images are made")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--allowance-mb", type=float, default=100.0,
                        help="memory over idle a phase may use besides its decodes (default 100)")
    parser.add_argument("--max-image-pixels", type=int, default=40_000_000,
                        help="the server's bound (default: its default, 40000000)")
    parser.add_argument("--upload-slots", type=int, default=2,
                        help="the server's uploads decoded at once (default: its default, 2)")
    parser.add_argument("--code", type=Path, help="project tree the server runs from")
    parser.add_argument("--phases", nargs="+", choices=("hostile", "largest"),
                        default=["hostile", "largest"])
    args = parser.parse_args()

    index = args.index or small_world(args.work)
    largest = math.isqrt(args.max_image_pixels)
    images = {"hostile": (png_of_zeros(HOSTILE_SIDE, args.work), HOSTILE_SIDE),
              "largest": (png_of_zeros(largest, args.work), largest)}
    slots = args.clients if args.code else min(args.clients, args.upload_slots)
    decoded = {"hostile": 0, "largest": slots * BYTES_PER_PIXEL * largest**2}
    options = [] if args.code else ["--max-image-pixels", str(args.max_image_pixels),
                                    "--upload-slots", str(args.upload_slots), "--workers", "1"]
    port = free_port()
    server = start_server(index, port, *options, code=args.code)
    try:
        url = f"http://127.0.0.1:{port}/api/sentences"
        codes, _, answer = post_together(url, png_of_zeros(64, args.work), 1)
        if codes != [200]:
            sys.exit(f"an ordinary upload failed ({codes[0]}): {answer[:300]}")
        idle = psutil.Process(server.pid).memory_info().rss
        print(f"server pid {server.pid} ({args.code or 'this tree'}): idle RSS "
              f"{idle / MIB:.0f} MiB after one ordinary upload; {psutil.cpu_count()} CPUs, "
              f"{psutil.virtual_memory().total / 2**30:.0f} GiB")
        results = [phase(name, url, *images[name], args.clients, server.pid, idle,
                         idle + int(args.allowance_mb * MIB) + decoded[name])
                   for name in args.phases]
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps({"index": str(index), "idle_mb": round(idle / MIB),
                      "allowance_mb": args.allowance_mb, "phases": results}))
    if not all(result["within"] for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
