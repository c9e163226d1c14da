"""Write a large collection of real images to measure search on (issue 30): the Flickr8k train +
dev JPEGs and deterministic variants of each (crop, flip, rescale, small rotation, brightness).

    .venv/bin/python benchmarks/search_collection.py --count 100000 \
        [--root ../shared/flickr8k] [--out /work/collections/flickr8k-100000] [--workers 2]
    .venv/bin/defrag index --model MODEL --images OUT/images --sentences OUT/sentences.txt \
        --out INDEX --workers 2

OUT/images holds the originals (copied byte for byte), then variant 1 of every image
(<stem>-v1.jpg), variant 2, ... up to --count images; a variant is a random crop of 60-95% of
each side, flipped or not, rescaled, turned by up to 8 degrees and brightened or darkened,
seeded by its name and saved as a 224 x 224 JPEG. OUT/sentences.txt: every train and dev
caption, one per line; OUT/queries.txt: the first caption of each dev image (the text queries of
`bench_search.py certify`). Keep OUT outside the repository; a rerun skips the files written.
"""

from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import random
import re
from pathlib import Path

from PIL import Image, ImageEnhance, ImageOps
from tqdm import tqdm

from defrag.files import write_atomically
from defrag.images import decode

SPLITS = ("Flickr_8k.trainImages.txt", "Flickr_8k.devImages.txt")  # train, then dev
CAPTION_KEY = re.compile(r"^(?P<image>[^#\s]+\.jpg)#\d+$")
SIDE = 224  # the variants' size (the CNN's input)
QUALITY = 90


def split_images(text: Path) -> list[list[str]]:
    """The image names of the train and of the dev split, in their files' order."""
    return [[line.strip() for line in (text / name).read_text().splitlines() if line.strip()]
            for name in SPLITS]


def captions(text: Path, images: list[str]) -> dict[str, list[str]]:
    """The captions of `images` from Flickr8k.token.txt, in the file's order (keys that are not
    <image>.jpg#<n>, a few lines of the file, are left out)."""
    found: dict[str, list[str]] = {name: [] for name in images}
    for line in (text / "Flickr8k.token.txt").read_text(encoding="utf-8").splitlines():
        key, _, caption = line.partition("\t")
        match = CAPTION_KEY.match(key)
        if match and match["image"] in found and caption.strip():
            found[match["image"]].append(caption.strip())
    return found


def variant(image: Image.Image, seed: str) -> Image.Image:
    """One deterministic variant of `image` (seeded by `seed`), SIDE x SIDE."""
    rng = random.Random(seed)
    width, height = image.size
    w, h = round(width * rng.uniform(0.6, 0.95)), round(height * rng.uniform(0.6, 0.95))
    left, top = rng.randint(0, width - w), rng.randint(0, height - h)
    image = image.crop((left, top, left + w, top + h))
    angle = rng.uniform(-8, 8)
    image = image.rotate(angle, resample=Image.Resampling.BILINEAR)
    cos, sin = math.cos(math.radians(angle)), abs(math.sin(math.radians(angle)))
    inside = min(w / (w * cos + h * sin), h / (w * sin + h * cos))  # no corner left blank
    w, h = round(w * inside), round(h * inside)
    image = image.crop(((image.width - w) // 2, (image.height - h) // 2,
                        (image.width + w) // 2, (image.height + h) // 2))
    if rng.random() < 0.5:
        image = ImageOps.mirror(image)
    scale = rng.uniform(0.4, 1.0)  # a rescale: detail lost below SIDE, then brought back
    image = image.resize((max(16, round(SIDE * scale)),) * 2, Image.Resampling.BILINEAR)
    image = image.resize((SIDE, SIDE), Image.Resampling.BICUBIC)
    return ImageEnhance.Brightness(image).enhance(rng.uniform(0.75, 1.25))


def write_image(job: tuple[Path, Path, int]) -> None:
    """Write variant `k` of the original `source` into `target` (k = 0: the original itself)."""
    source, target, k = job
    data = source.read_bytes()
    if k == 0:
        write_atomically(target, data)
        return
    encoded = io.BytesIO()
    variant(decode(data, source.name).image, target.name).save(encoded, "JPEG", quality=QUALITY)
    write_atomically(target, encoded.getvalue())


def jobs(originals: list[Path], folder: Path, count: int) -> list[tuple[Path, Path, int]]:
    """The first `count` files of the collection: the originals, then variant 1 of each, ..."""
    planned = []
    for k in range(count // len(originals) + 1):
        for source in originals:
            name = source.name if k == 0 else f"{source.stem}-v{k}.jpg"
            planned.append((source, folder / name, k))
    return planned[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000, help="images in the collection")
    parser.add_argument("--root", type=Path, default=Path("../shared/flickr8k"),
                        help="Flickr8k: Flicker8k_Dataset/ and Flickr8k_text/")
    parser.add_argument("--out", type=Path, help="default /work/collections/flickr8k-<count>")
    parser.add_argument("--workers", type=int, default=2, help="processes writing images")
    args = parser.parse_args()
    out = args.out or Path(f"/work/collections/flickr8k-{args.count}")
    text, dataset = args.root / "Flickr8k_text", args.root / "Flicker8k_Dataset"
    train, dev = split_images(text)
    missing = [name for name in train + dev if not (dataset / name).is_file()]
    if missing:
        parser.error(f"--root {args.root}: {len(missing)} images of the train and dev splits "
                     f"are not in {dataset} (e.g. {missing[0]}): point --root at Flickr8k")
    found = captions(text, train + dev)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "sentences.txt",
                     "".join(f"{c}\n" for name in train + dev for c in found[name]))
    write_atomically(out / "queries.txt", "".join(f"{found[name][0]}\n" for name in dev
                                                  if found[name]))
    folder = out / "images"
    folder.mkdir(exist_ok=True)
    todo = [job for job in jobs([dataset / name for name in train + dev], folder, args.count)
            if not job[1].is_file()]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for _ in tqdm(pool.imap_unordered(write_image, todo, chunksize=16), total=args.count,
                      initial=args.count - len(todo), desc="collection", unit="img"):
            pass
    print(f"{out}: {args.count} images in {folder}, {sum(map(len, found.values()))} sentences "
          f"in {out / 'sentences.txt'}, {len(dev)} queries in {out / 'queries.txt'}")


if __name__ == "__main__":
    main()
