"""Peak memory of one `featurize webdataset` task (one worker) on inputs that decide it, and of
`featurize jsonl` on large images, each run alone in a fresh process: the peak is the process's
maximum resident set size (ru_maxrss of wait4), in MiB.

- hostile: a .tar.gz of ten samples, each a 200 MB jpg of zeros (2 GB that gzip makes ~2 MB) and
  a caption, which the decoder refuses (bad_image), then one sample of the normal shard;
- long_caption: the normal shard with its first caption made 200,000 characters long;
- long_captions: the normal shard with its first 256 captions (one parse batch) made 2,000
  characters long each, under the caption limit;
- normal: --images generated img2dataset samples (`write_img2dataset`, 256 px JPEGs);
- jsonl_large: a JSONL of 100 images of 2,500 x 2,000 pixels (15 MB each decoded), one shard.

Target: every input within --allowance-mb of normal (exit 1 otherwise): the default, 1 GiB,
holds what the featurizer may keep of one input at once, the previous chunk of samples
(CHUNK_BYTES, and the sample that passed it: MAX_SAMPLE_BYTES), the sample being read (twice,
while tarfile joins its pieces) and one parse batch (MAX_BATCH_CHARS); a file source's shard
holds one decoded image at a time. --code DIR runs another
tree of the project with this one's virtualenv, to measure older code: `git archive COMMIT |
tar -x -C DIR`.

    python benchmarks/bench_featurize_memory.py [--work /tmp/defrag-bench-featurize-memory]
        [--images 1000] [--allowance-mb 1024] [--code DIR]
        [--cases hostile long_caption long_captions jsonl_large normal]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from featurizer.synthetic import write_img2dataset  # noqa: E402

HOSTILE_SAMPLES, HOSTILE_BYTES = 10, 200_000_000
LONG_CAPTION, LONG_CAPTIONS = 200_000, (256, 2_000)  # one caption; count and length
LARGE_IMAGES, LARGE_SIZE = 100, (2500, 2000)
WORDS = "a brown dog runs across the green grass near a small red house . "


class Zeros(io.RawIOBase):
    """`size` zero bytes, read in pieces (the hostile members are never held whole here)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


def add(archive: tarfile.TarFile, name: str, data: bytes | None = None, size: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if data is not None else size
    archive.addfile(info, io.BytesIO(data) if data is not None else Zeros(size))


def words(length: int) -> bytes:
    return (WORDS * (length // len(WORDS) + 1))[:length].encode()


def with_captions(normal: Path, target: Path, count: int, length: int) -> None:
    """`target`: the `normal` shard with its first `count` captions `length` characters long."""
    long = {f"{index:09d}.txt" for index in range(count)}
    with tarfile.open(normal) as source, tarfile.open(target, "w") as copy:
        for member in source:
            data = source.extractfile(member).read()
            add(copy, member.name, words(length) if member.name in long else data)


def large_images(jsonl: Path) -> None:
    """`jsonl` listing LARGE_IMAGES links to one JPEG of LARGE_SIZE pixels (a gradient)."""
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    width, height = LARGE_SIZE
    gradient = np.linspace(0, 255, width * height * 3, dtype=np.float32)
    image = Image.fromarray(gradient.astype(np.uint8).reshape(height, width, 3))
    image.save(jsonl.parent / "0.jpg", quality=90)
    for index in range(1, LARGE_IMAGES):
        (jsonl.parent / f"{index}.jpg").unlink(missing_ok=True)
        os.link(jsonl.parent / "0.jpg", jsonl.parent / f"{index}.jpg")
    jsonl.write_text("".join(json.dumps({"image": f"{index}.jpg", "captions": [WORDS]}) + "\n"
                             for index in range(LARGE_IMAGES)))


def make_inputs(work: Path, images: int) -> dict[str, Path]:
    """The inputs under `work`, made once."""
    inputs = {"hostile": work / "hostile.tar.gz", "long_caption": work / "long_caption.tar",
              "long_captions": work / "long_captions.tar",
              "jsonl_large": work / "large" / "data.jsonl",
              "normal": work / "normal" / "00000.tar"}
    if not inputs["normal"].is_file():
        write_img2dataset(work / "normal", count=images, per_shard=images, image_size=256)
    if not inputs["long_caption"].is_file():
        with_captions(inputs["normal"], inputs["long_caption"], 1, LONG_CAPTION)
    if not inputs["long_captions"].is_file():
        with_captions(inputs["normal"], inputs["long_captions"], *LONG_CAPTIONS)
    if not inputs["jsonl_large"].is_file():
        large_images(inputs["jsonl_large"])
    if not inputs["hostile"].is_file():
        with tarfile.open(inputs["normal"]) as source:
            good = [(member.name, source.extractfile(member).read())
                    for member in source if member.name.startswith("000000000.")]
        with tarfile.open(inputs["hostile"], "w:gz") as archive:
            for index in range(HOSTILE_SAMPLES):
                add(archive, f"zeros{index:04d}.jpg", size=HOSTILE_BYTES)
                add(archive, f"zeros{index:04d}.txt", b"A dog runs on the grass .")
            for name, data in good:
                add(archive, name, data)
    return inputs


def peak_mib(code: Path, source: Path, out: Path) -> tuple[float, int]:
    """ru_maxrss of `featurize jsonl` (a .jsonl) or `featurize webdataset` of `source` run from
    the tree `code`, and its exit status."""
    given = (["jsonl", "--jsonl", str(source)] if source.suffix == ".jsonl"
             else ["webdataset", "--shards", str(source)])
    command = [sys.executable, "-m", "featurizer", *given, "--out", str(out), "--parser", "spacy",
               "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.DEVNULL,
                                   stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code:
            errors.seek(0)
            print(errors.read().decode()[-2000:], file=sys.stderr)
    return usage.ru_maxrss / 1024, exit_code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/defrag-bench-featurize-memory"))
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--allowance-mb", type=float, default=1024)
    parser.add_argument("--code", type=Path, default=ROOT)
    parser.add_argument("--cases", nargs="+",
                        default=["hostile", "long_caption", "long_captions", "jsonl_large",
                                 "normal"])
    args = parser.parse_args()
    inputs = make_inputs(args.work, args.images)
    peaks = {}
    print(f"code: {args.code}\n| input | size | peak RSS (MiB) | exit |\n|---|---|---|---|")
    for case in args.cases:
        out = args.work / "out" / case
        subprocess.run(["rm", "-rf", str(out)], check=True)
        peaks[case], code = peak_mib(args.code.resolve(), inputs[case], out)
        print(f"| {case} | {inputs[case].stat().st_size / 2**20:.1f} MiB | {peaks[case]:.0f} | "
              f"{code} |", flush=True)
    if "normal" not in peaks:
        return 0
    over = {case: peak - peaks["normal"] for case, peak in peaks.items()
            if peak - peaks["normal"] > args.allowance_mb}
    for case, extra in over.items():
        print(f"{case}: {extra:.0f} MiB over the normal shard's peak, more than the allowance "
              f"of {args.allowance_mb:.0f} MiB")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
