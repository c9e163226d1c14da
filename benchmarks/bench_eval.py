"""Time and peak memory of score_matrix on a Flickr-size test set against its matrix-product floor.

Memory (target: bounded): score_matrix runs on test sets of each of --memory-images images (as
many sentences per image as --sentences / --images). Its peak is the kernel's high-water mark of
resident memory (VmHWM), reset through /proc/self/clear_refs just before the call (Linux), less
the resident memory before it (the inputs); its working memory is that peak less the score
matrix it returns (images x sentences float32). The working memory of the smallest set is the
floor (it should span a few full blocks: 250 images x 1250 sentences are 4 x 3 blocks): a larger
set's must stay within --memory-limit (1.2) times it, else the script exits 1.
glibc's malloc gets a fixed mmap threshold (128 KiB) first: with its default, moving threshold
a freed block of up to 32 MiB stays in the heap, and the high-water mark then counts whatever
slack earlier calls left there (tens of MiB, varying from call to call), not the call's own. An
unmeasured first call on the smallest set absorbs the one-time allocations of a first call.

Time (target: <= 2x the floor): the floor is the block products v_block @ s_block^T alone
(results discarded) over the same blocks of the --images set, timed in the same run. Times are
the best of --repeats runs, floor and score_matrix alternating so that load drift on a shared
machine hits both alike; wall-clock and process CPU seconds (all threads) are both reported, CPU
time being the steadier one under contention.

Evaluation memory (target: bounded beyond the arrays that grow with the split): the real
`defrag evaluate --model DIR --shards DIR --split val` process (streaming, decoding,
CNN, embedding, scoring, metrics) on featurizer-made synthetic splits of each of --eval-images
images (5 captions each, given boxes), made once under --eval-cache with an untrained model folder
of the default sizes. Its peak is the child's ru_maxrss from wait4 (the largest of it and its
loader processes); its working memory is that less the arrays inherent to the split: the score
matrix (images x sentences float32) and the embeddings it is computed from (image fragments and
sentence fragments x embed_dim float32, with their owner indices). The smallest split's working
memory is the floor: a larger split's must stay within --eval-limit (1.2) times it; and as that
floor is ~1.6 GiB (torch, the model), which lets ~300 MiB grow, the peak's growth from the
smallest split to the largest, beyond the inherent arrays', must stay under --eval-per-image-kib
(64) KiB per added image; else exit 1. The default splits span 1,500 images, so the peak's
run-to-run variation (+-80 MiB) is +-55 KiB an image; across 300 it would be +-270 KiB.

    python benchmarks/bench_eval.py [--images 1000] [--sentences 5000] [--chunk-images 64]
        [--chunk-sentences 512] [--shuffle] [--repeats 1] [--memory-images 250,500]
        [--memory-limit 1.2] [--eval-images 100,400,1600] [--eval-limit 1.2]
        [--eval-per-image-kib 64] [--eval-cache /tmp/defrag-bench-eval]

The default run takes about three minutes on a 2-core machine (the first more: it makes the
synthetic splits, 2,100 images); --repeats 3 gives steadier times; --eval-images '' skips the
evaluation.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from defrag.vocab import Vocabulary
from trainer.config import Config
from trainer.data.shardset import training_featurizer
from trainer.model import DeFragModel
from trainer.objectives import score_matrix
from trainer.store.model_folder import save_model_folder

DEFRAG = str(Path(sys.executable).with_name("defrag"))  # the `defrag` command

GIB, MIB = 2**30, 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def make_test_set(args: argparse.Namespace, images: int,
                  sentences: int) -> tuple[torch.Tensor, ...]:
    """Seeded random float32 fragments: image_frags per image, a uniform count per sentence."""
    g = torch.Generator().manual_seed(args.seed)
    v_count = torch.full((images,), args.image_frags)
    s_count = torch.randint(args.min_sentence_frags, args.max_sentence_frags + 1,
                            (sentences,), generator=g)
    v_owner = torch.arange(images).repeat_interleave(v_count)
    s_owner = torch.arange(sentences).repeat_interleave(s_count)
    v = torch.randn(len(v_owner), args.dim, generator=g) / args.dim**0.5
    s = torch.randn(len(s_owner), args.dim, generator=g)
    return v, v_owner, v_count, s, s_owner, s_count


def block_products(v: torch.Tensor, v_count: torch.Tensor, s: torch.Tensor,
                   s_count: torch.Tensor, chunk_images: int, chunk_sentences: int) -> None:
    """The floor: score_matrix's block products alone, on owner-sorted fragments."""
    v_start = [0, *v_count.cumsum(0).tolist()]
    s_start = [0, *s_count.cumsum(0).tolist()]
    for k0 in range(0, len(v_count), chunk_images):
        k1 = min(k0 + chunk_images, len(v_count))
        for l0 in range(0, len(s_count), chunk_sentences):
            l1 = min(l0 + chunk_sentences, len(s_count))
            v[v_start[k0]:v_start[k1]] @ s[s_start[l0]:s_start[l1]].T  # noqa: B018


def resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size


def given_fragments(args: argparse.Namespace, v: torch.Tensor, v_owner: torch.Tensor,
                    s: torch.Tensor, s_owner: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What score_matrix gets: the fragments as made, or in random owner order (--shuffle)."""
    if not args.shuffle:
        return v, v_owner, s, s_owner
    perm_v, perm_s = torch.randperm(len(v)), torch.randperm(len(s))
    return v[perm_v], v_owner[perm_v], s[perm_s], s_owner[perm_s]


def score_memory(args: argparse.Namespace, given: tuple[torch.Tensor, ...], images: int,
                 sentences: int) -> dict:
    """Time and peak resident memory of one score_matrix call, the peak both as VmHWM and above
    the memory before the call, and that less the score matrix it returns (working memory)."""
    before = resident_bytes("VmRSS")
    reset_peak()
    wall = time.perf_counter()
    scores = score_matrix(*given, images, sentences, chunk_images=args.chunk_images,
                          chunk_sentences=args.chunk_sentences)
    wall = time.perf_counter() - wall
    peak = resident_bytes("VmHWM")
    matrix = scores.numel() * scores.element_size()
    return {"images": images, "sentences": sentences, "seconds": wall, "rss_before_bytes": before,
            "peak_rss_bytes": peak, "peak_increase_bytes": peak - before,
            "score_matrix_bytes": matrix, "working_bytes": peak - before - matrix}


def smaller_set_memory(args: argparse.Namespace, images: int) -> dict:
    """score_memory on a test set of `images` images (sentences in the --images set's ratio)."""
    sentences = round(images * args.sentences / args.images)
    v, v_owner, _, s, s_owner, _ = make_test_set(args, images, sentences)
    return score_memory(args, given_fragments(args, v, v_owner, s, s_owner), images, sentences)


def within_floor(rows: list[dict], limit: float, line: Callable[[dict], str]) -> bool:
    """Each set's working memory as a ratio of the smallest set's (the floor), printed with
    `line(row)`; all within `limit` times it?"""
    floor = rows[0]["working_bytes"]
    for row in rows:
        row["ratio"] = row["working_bytes"] / floor
        print(f"{line(row)} ({row['ratio']:.3f} x the floor; limit {limit})")
    return all(row["ratio"] <= limit for row in rows)


def score_memory_line(row: dict) -> str:
    return (f"  memory, {row['images']:>5} images x {row['sentences']:>5} sentences: peak "
            f"+{row['peak_increase_bytes'] / MIB:.0f} MiB = score matrix "
            f"{row['score_matrix_bytes'] / MIB:.1f} MiB + working "
            f"{row['working_bytes'] / MIB:.1f} MiB")


def evaluate_memory_line(row: dict) -> str:
    return (f"  trainer.evaluate, {row['images']:>4} images x {row['sentences']:>4} sentences "
            f"({row['seconds']:.0f} s): peak {row['peak_rss_bytes'] / MIB:.0f} MiB = score "
            f"matrix {row['score_matrix_bytes'] / MIB:.1f} MiB + embeddings "
            f"{row['embedding_bytes'] / MIB:.1f} MiB + working {row['working_bytes'] / MIB:.0f}"
            f" MiB")


def synthetic_split(cache: Path, images: int, vocab: Path | None) -> Path:
    """Featurizer-made synthetic shards with `images` val images, made once under `cache`
    (`vocab`: another split's vocab.json, so that one model reads them all)."""
    out = cache / f"val-{images}"
    if not (out / "manifest.json").is_file():
        command = [DEFRAG, "featurize", "synthetic", "--num-train", "20",
                   "--num-val", str(images), "--shard-size", "50", "--parser", "spacy",
                   "--boxes", "given", "--workers", "1", "--out", str(out)]
        made = subprocess.run(command + (["--vocab", str(vocab)] if vocab else []),
                              capture_output=True, text=True)
        if made.returncode:
            sys.exit(f"featurizer synthetic failed for {out}: {made.stderr.strip()[-500:]}")
    return out


def untrained_model(cache: Path, shards: Path) -> tuple[Path, int]:
    """A model folder of the default sizes (untrained, no pretrained CNN download) made once
    under `cache`, and its embed_dim."""
    cfg = Config.from_dict({"data": {"shards": str(shards)}, "model": {"pretrained": False}})
    folder = cache / "model"
    if not folder.is_dir():
        vocab = Vocabulary.load(shards / "vocab.json")
        save_model_folder(folder, DeFragModel.from_config(cfg.model, vocab, seed=0), cfg, vocab,
                          featurizer=training_featurizer(cfg.data))
    return folder, cfg.model.embed_dim


def inherent_bytes(shards: Path, dim: int) -> dict:
    """The val split's sizes and the bytes of the arrays that grow with it: the score matrix and
    the embeddings (boxes from the shards' JSON, sentence fragments = the manifest's triplets,
    the fragments encoder's rows), each row with its int64 owner."""
    split = json.loads((shards / "manifest.json").read_text())["splits"]["val"]
    boxes = 0
    for shard in split["shards"]:
        with tarfile.open(shards / shard["file"]) as tar:
            boxes += sum(len(json.load(tar.extractfile(member))["boxes"]) for member in tar
                         if member.name.endswith(".json"))
    images, sentences, triplets = split["images"], split["captions"], split["triplets"]
    matrix = images * sentences * 4
    embeddings = (boxes + triplets) * (dim * 4 + 8) + sentences * 8
    return {"images": images, "sentences": sentences, "image_fragments": boxes,
            "sentence_fragments": triplets, "score_matrix_bytes": matrix,
            "embedding_bytes": embeddings, "inherent_bytes": matrix + embeddings}


def evaluate_peak(model: Path, shards: Path, dim: int) -> dict:
    """Peak resident memory and wall time of `defrag evaluate` on the val split of
    `shards`, with the split's inherent bytes; exits when the evaluation fails."""
    command = [DEFRAG, "evaluate", "--model", str(model), "--shards",
               str(shards), "--split", "val"]
    with tempfile.TemporaryFile("w+") as output:
        wall = time.perf_counter()
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - wall
        child.returncode = os.waitstatus_to_exitcode(status)
        output.seek(0)
        lines = output.read().splitlines()
    if child.returncode:
        sys.exit(f"defrag evaluate failed on {shards} (exit {child.returncode}): "
                 f"{lines[-1] if lines else 'no output'}")
    row = {**inherent_bytes(shards, dim), "seconds": wall, "peak_rss_bytes": usage.ru_maxrss * 1024}
    row["working_bytes"] = row["peak_rss_bytes"] - row["inherent_bytes"]
    return row


def beyond_inherent(rows: list[dict]) -> float:
    """Bytes per added image by which the peak grew beyond the inherent arrays, from the
    smallest split (rows[0]) to the largest (rows[-1])."""
    grown = rows[-1]["peak_rss_bytes"] - rows[0]["peak_rss_bytes"]
    inherent = rows[-1]["inherent_bytes"] - rows[0]["inherent_bytes"]
    return (grown - inherent) / (rows[-1]["images"] - rows[0]["images"])


def evaluate_failure(rows: list[dict], limit: float, per_image_kib: float) -> str | None:
    """Why trainer.evaluate's memory is not bounded (None: it is): a working memory over `limit`
    times the smallest split's, or a growth beyond the inherent arrays over `per_image_kib`."""
    floor = rows[0]["working_bytes"]
    if any(row["working_bytes"] > limit * floor for row in rows):
        return (f"trainer.evaluate's working memory grows with the split: over {limit} x the "
                f"{rows[0]['images']}-image split's (see the trainer.evaluate lines)")
    beyond = beyond_inherent(rows) / 1024
    if beyond > per_image_kib:
        return (f"trainer.evaluate's peak grows {beyond:.0f} KiB per image beyond the score "
                f"matrix and embeddings from {rows[0]['images']} to {rows[-1]['images']} "
                f"images, over --eval-per-image-kib {per_image_kib:g}: something is kept per "
                f"image (see the trainer.evaluate lines)")
    return None


def evaluate_memory(args: argparse.Namespace) -> tuple[dict, str | None]:
    """evaluate_peak on each --eval-images split, smallest first, checked by evaluate_failure;
    the rows and limits for the JSON result, and the failure line (None: bounded)."""
    sizes = sorted(int(images) for images in args.eval_images.split(","))
    if len(sizes) < 2:
        sys.exit(f"--eval-images {args.eval_images}: give two sizes or more (the smallest is the "
                 f"floor), or '' to skip the trainer.evaluate check")
    cache = Path(args.eval_cache)
    splits = [synthetic_split(cache, sizes[0], None)]
    splits += [synthetic_split(cache, images, splits[0] / "vocab.json") for images in sizes[1:]]
    model, dim = untrained_model(cache, splits[0])
    rows = [evaluate_peak(model, shards, dim) for shards in splits]
    within_floor(rows, args.eval_limit, evaluate_memory_line)
    grown = rows[-1]["peak_rss_bytes"] - rows[0]["peak_rss_bytes"]
    inherent = rows[-1]["inherent_bytes"] - rows[0]["inherent_bytes"]
    extra = rows[-1]["images"] - rows[0]["images"]
    beyond = beyond_inherent(rows)
    print(f"  trainer.evaluate: peak +{grown / MIB:.1f} MiB for {extra} more images "
          f"({grown / extra / 1024:.0f} KiB per image; inherent arrays "
          f"{inherent / extra / 1024:.0f} KiB per image; beyond them {beyond / 1024:+.0f} KiB "
          f"per image, limit {args.eval_per_image_kib:g})")
    failure = evaluate_failure(rows, args.eval_limit, args.eval_per_image_kib)
    return {"evaluate_memory": rows, "eval_limit": args.eval_limit,
            "eval_per_image_kib": args.eval_per_image_kib,
            "evaluate_beyond_inherent_bytes_per_image": beyond,
            "evaluate_bounded": failure is None}, failure


def timed(fn) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000, help="test images (paper: 1,000)")
    parser.add_argument("--sentences", type=int, default=5000, help="test sentences (5 each)")
    parser.add_argument("--image-frags", type=int, default=20, help="19 boxes + whole image")
    parser.add_argument("--min-sentence-frags", type=int, default=8)
    parser.add_argument("--max-sentence-frags", type=int, default=14)
    parser.add_argument("--dim", type=int, default=1000, help="embedding size (paper: ~1000)")
    parser.add_argument("--chunk-images", type=int, default=64)
    parser.add_argument("--chunk-sentences", type=int, default=512)
    parser.add_argument("--shuffle", action="store_true",
                        help="give score_matrix the fragments in random owner order")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-images", default="250,500",
                        help="comma-separated sizes of the smaller test sets of the memory check "
                             "(the --images set is the largest)")
    parser.add_argument("--memory-limit", type=float, default=1.2,
                        help="largest working memory, in multiples of the smallest set's")
    parser.add_argument("--eval-images", default="100,400,1600",
                        help="comma-separated val sizes of the trainer.evaluate memory check "
                             "('' skips it)")
    parser.add_argument("--eval-limit", type=float, default=1.2,
                        help="largest trainer.evaluate working memory, in multiples of the "
                             "smallest split's")
    parser.add_argument("--eval-per-image-kib", type=float, default=64,
                        help="largest growth of trainer.evaluate's peak per added image beyond "
                             "the score matrix and embeddings, in KiB")
    parser.add_argument("--eval-cache", default="/tmp/defrag-bench-eval",
                        help="folder of the synthetic splits and the model (made once)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def time_and_memory(args: argparse.Namespace, given: tuple[torch.Tensor, ...], v: torch.Tensor,
                    v_count: torch.Tensor, s: torch.Tensor, s_count: torch.Tensor
                    ) -> tuple[list[dict], bool, tuple[float, ...]]:
    """score_matrix's working memory at each --memory-images size and the full set (whether it
    stays within --memory-limit of the smallest's), and the best of --repeats runs' wall and CPU
    seconds of the floor and of score_matrix."""

    def scores() -> None:
        score_matrix(*given, args.images, args.sentences, chunk_images=args.chunk_images,
                     chunk_sentences=args.chunk_sentences)

    def floor() -> None:
        block_products(v, v_count, s, s_count, args.chunk_images, args.chunk_sentences)

    with torch.no_grad():
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        sizes = sorted(int(images) for images in args.memory_images.split(","))
        smaller_set_memory(args, sizes[0])
        memory = [smaller_set_memory(args, images) for images in sizes]
        memory.append(score_memory(args, given, args.images, args.sentences))  # and warm-up
        bounded = within_floor(memory, args.memory_limit, score_memory_line)
        print(f"  warm-up: score_matrix {memory[-1]['seconds']:.2f} s")
        runs = []
        for _ in range(args.repeats):
            runs.append((*timed(floor), *timed(scores)))
            print("  run: floor {:.2f} s ({:.2f} s CPU), score_matrix {:.2f} s ({:.2f} s CPU)"
                  .format(*runs[-1]))
    return memory, bounded, tuple(min(column) for column in zip(*runs, strict=True))


def main() -> None:
    args = parse_args()
    evaluation, eval_failure = evaluate_memory(args) if args.eval_images else ({}, None)

    v, v_owner, v_count, s, s_owner, s_count = make_test_set(args, args.images, args.sentences)
    given = given_fragments(args, v, v_owner, s, s_owner)
    input_bytes = sum(t.numel() * t.element_size() for t in given)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.images} images x "
          f"{args.sentences} sentences, {len(v)} x {len(s)} fragments, d = {args.dim}, chunks "
          f"{args.chunk_images} x {args.chunk_sentences}, inputs {input_bytes / GIB:.2f} GiB")
    memory, bounded, (floor_wall, floor_cpu, wall, cpu) = time_and_memory(
        args, given, v, v_count, s, s_count)
    rss_before, peak = memory[-1]["rss_before_bytes"], memory[-1]["peak_rss_bytes"]

    result = {
        "images": args.images, "sentences": args.sentences, "image_fragments": len(v),
        "sentence_fragments": len(s), "dim": args.dim, "chunk_images": args.chunk_images,
        "chunk_sentences": args.chunk_sentences, "shuffle": args.shuffle,
        "threads": torch.get_num_threads(), "seconds": wall, "floor_seconds": floor_wall,
        "ratio": wall / floor_wall, "cpu_seconds": cpu, "floor_cpu_seconds": floor_cpu,
        "cpu_ratio": cpu / floor_cpu,
        "floor_gflops": 2 * len(v) * len(s) * args.dim / floor_wall / 1e9,
        "input_bytes": input_bytes, "rss_before_bytes": rss_before, "peak_rss_bytes": peak,
        "peak_increase_bytes": peak - rss_before, "memory": memory,
        "memory_limit": args.memory_limit, "memory_bounded": bounded, **evaluation,
    }
    print(f"score_matrix {wall:.2f} s, floor {floor_wall:.2f} s "
          f"({result['floor_gflops']:.0f} GFLOP/s), ratio {result['ratio']:.2f} (CPU time "
          f"{result['cpu_ratio']:.2f}; target <= 2); peak RSS {peak / GIB:.2f} GiB (target < 4), "
          f"{(peak - rss_before) / GIB:.2f} GiB above the {rss_before / GIB:.2f} GiB before the "
          f"call (inputs {input_bytes / GIB:.2f} GiB)")
    print(json.dumps(result))
    if not bounded:
        sys.exit(f"working memory grows with the test set: over {args.memory_limit} x the "
                 f"{memory[0]['images']}-image set's (see the memory lines)")
    if eval_failure:
        sys.exit(eval_failure)


if __name__ == "__main__":
    main()
