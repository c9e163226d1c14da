"""Peak memory of the search web app (trainer/search/serve.py) while clients post worst-case images
at the same moment, against a floor measured in the same run: the server's idle RSS plus an
allowance. Exits 1 when a phase's peak is over its floor.

Three phases, each with --clients clients released together (a barrier) on POST /api/sentences:
- hostile: a 12000 x 12000 PNG (144 Mpx of zeros, ~420 KB: under the 10 MiB upload limit and
  PIL's bomb limit). The bound refuses it from its header: floor = idle + --allowance-mb.
- largest: the largest square PNG under the pixel bound (--max-image-pixels), which the server
  decodes, --upload-slots at a time: floor = idle + --allowance-mb + slots x BYTES_PER_PIXEL x
  its pixels.
- bodies: a PNG of noise of 9.6 MiB, just under the 10 MiB upload limit, whose body each slot
  reads and holds while it is decoded: floor = idle + --allowance-mb + slots x (2 x its bytes +
  BYTES_PER_PIXEL x its pixels). The bodies of uploads waiting for a slot must not be read.
The peak is the server process's VmHWM (/proc/PID/status), reset before each phase
(/proc/PID/clear_refs); idle is its RSS after a first ordinary upload (parser and model loaded);
"after" is its RSS a second after a phase's last answer (what the allocator kept).
Without --index the tests' small world is built (tests/search_world.py) under --work, or reused.
--code runs the server from another project tree (e.g. `git worktree add /tmp/old b8cefef`) to
measure older code; --bare passes it no flags (code older than the bound, the slots and
--workers, b8cefef; its floor counts every client as a slot); --phases chooses which phases run.

    python benchmarks/bench_upload_memory.py [--index INDEX] [--clients 8] [--allowance-mb 100]
                                             [--max-image-pixels 40000000] [--upload-slots 2]
                                             [--code DIR] [--bare]
                                             [--phases hostile largest bodies]
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

import numpy as np
import psutil
import requests
from bench_serve import free_port, small_world, start_server
from PIL import Image

HOSTILE_SIDE = 12000
NOISE_SIDE = 1831  # a PNG of RGB noise this side is 9.6 MiB (noise does not compress)
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


def png_of_noise(side: int, cache: Path) -> bytes:
    """A side x side RGB PNG of seeded noise (about 3 bytes a pixel), made once under `cache`."""
    path = cache / f"noise-{side}.png"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "PNG")
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
    time.sleep(1)
    after = psutil.Process(pid).memory_info().rss
    result = {"phase": name, "image": f"{side} x {side} PNG, {len(body) / 1024:.0f} KB",
              "clients": clients, "codes": sorted(codes), "seconds": round(seconds, 2),
              "peak_mb": round(peak / MIB), "growth_mb": round((peak - idle) / MIB),
              "floor_mb": round(floor / MIB), "after_mb": round(after / MIB),
              "within": peak <= floor, "answer": answer[:300]}
    print(f"  {name}: {clients} x {result['image']}: answers {sorted(set(codes))} in "
          f"{seconds:.1f} s; server peak {result['peak_mb']} MiB (+{result['growth_mb']} over "
          f"idle), floor {result['floor_mb']} MiB: {'ok' if result['within'] else 'OVER'}; "
          f"{result['after_mb']} MiB a second after")
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
                        help="the server's uploads decoded at once (default 2; the server's is 1)")
    parser.add_argument("--code", type=Path, help="project tree the server runs from")
    parser.add_argument("--bare", action="store_true",
                        help="pass the server no flags (--code older than them)")
    parser.add_argument("--phases", nargs="+", choices=("hostile", "largest", "bodies"),
                        default=["hostile", "largest", "bodies"])
    args = parser.parse_args()

    index = args.index or small_world(args.work)
    largest = math.isqrt(args.max_image_pixels)
    images = {"hostile": (png_of_zeros(HOSTILE_SIDE, args.work), HOSTILE_SIDE),
              "largest": (png_of_zeros(largest, args.work), largest),
              "bodies": (png_of_noise(NOISE_SIDE, args.work), NOISE_SIDE)}
    slots = args.clients if args.bare else min(args.clients, args.upload_slots)
    held = {"hostile": 0, "largest": slots * BYTES_PER_PIXEL * largest**2,  # what slots hold
            "bodies": slots * (BYTES_PER_PIXEL * NOISE_SIDE**2 + 2 * len(images["bodies"][0]))}
    options = [] if args.bare else ["--max-image-pixels", str(args.max_image_pixels),
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
                         idle + int(args.allowance_mb * MIB) + held[name])
                   for name in args.phases]
    finally:  # killed: a graceful stop of an old server after 200 uploads took over 30 s
        server.kill()
        server.wait()
    print(json.dumps({"index": str(index), "idle_mb": round(idle / MIB),
                      "allowance_mb": args.allowance_mb, "phases": results}))
    if not all(result["within"] for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
