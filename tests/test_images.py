"""One image decoder (defrag/images.py) behind every path that reads an image: the featurizer's
(`featurizer.images.load_image`: boxes), the trainer's reader (`trainer.data.reader.decode_image`:
training, evaluation, captioner) and the embedder's (`trainer.search.embedder.read_image`: index,
retrieval, pyfunc, web app uploads). Every mode PIL opens becomes the expected 8-bit RGB, each
of the eight EXIF orientations gives the pixels, size and boxes of the upright twin on every path,
and an image over the pixel bound (PIL's own 179 Mpx guard included) is refused from its header,
before decoding (tests/test_serve.py: the web app's 413)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import ExifTags, Image, ImageDraw

from defrag.vocab import Vocabulary
from featurizer.images import BadImage, load_image
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from trainer.config import Config, ModelConfig
from trainer.data.reader import (
    BadSample,
    ReadOptions,
    SampleDecoder,
    decode_image,
    image_chunks,
    read_images,
)
from trainer.data.shardset import locate_split
from trainer.model import DeFragModel
from trainer.search.embedder import Embedder, embed_images
from trainer.search.fragment_set import FragmentSet

WIDTH, HEIGHT = 16, 8
WHITE = 255  # defrag.images.BACKGROUND: transparent pixels are shown over white
COLUMNS = np.arange(WIDTH)


def rows(values: np.ndarray) -> np.ndarray:
    """One row of per-column values repeated HEIGHT times."""
    return np.repeat(values[None, :], HEIGHT, axis=0)


def grey(values: np.ndarray) -> np.ndarray:
    """Per-column grey levels as the RGB array they should decode to."""
    return np.repeat(rows(values.astype(np.uint8))[..., None], 3, axis=2)


def encoded(image: Image.Image, kind: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, kind, **options)
    return out.getvalue()


def sixteen_bit() -> np.ndarray:
    return COLUMNS * 4369  # 0 .. 65535 over the columns: a 16-bit gradient, white only at the end


def half_transparent(image: Image.Image) -> Image.Image:
    """`image` with its left half fully transparent and its right half opaque."""
    alpha = Image.fromarray(rows(np.where(COLUMNS < WIDTH // 2, 0, 255).astype(np.uint8)))
    image.putalpha(alpha)
    return image


def palette(mode: str) -> Image.Image:
    image = Image.fromarray(rows(np.where(COLUMNS < WIDTH // 2, 0, 1).astype(np.uint8)), "P")
    image.putpalette([0, 0, 0, 10, 200, 30])
    return half_transparent(image) if mode == "PA" else image


def halves(left: tuple[int, int, int], right: tuple[int, int, int]) -> np.ndarray:
    """RGB pixels: the left half one colour, the right half another."""
    return np.repeat(np.where(COLUMNS[:, None] < WIDTH // 2, left, right)[None], HEIGHT,
                     axis=0).astype(np.uint8)


def over_white(colour: tuple[int, int, int]) -> np.ndarray:
    """The expected pixels of a half-transparent image of one `colour`."""
    return halves((WHITE,) * 3, colour)


# name -> (file bytes, expected RGB pixels, tolerance): TIFF carries the modes JPEG and PNG cannot
WIDE = COLUMNS * 200_000_000 - 1_500_000_000  # a 32-bit range: stretched from min..max
MODES = {
    "I;16 PNG": (encoded(Image.fromarray(rows(sixteen_bit()).astype(np.uint16)), "PNG"),
                 grey(sixteen_bit() >> 8), 0),
    "I;16B TIFF": (encoded(Image.frombytes("I;16B", (WIDTH, HEIGHT), rows(sixteen_bit()).astype(
        ">u2").tobytes()), "TIFF"), grey(sixteen_bit() >> 8), 0),
    "I;16L TIFF": (encoded(Image.frombytes("I;16L", (WIDTH, HEIGHT), rows(sixteen_bit()).astype(
        "<u2").tobytes()), "TIFF"), grey(sixteen_bit() >> 8), 0),
    "I 16-bit values TIFF": (encoded(Image.fromarray(rows(sixteen_bit()).astype(np.int32)),
                                     "TIFF"), grey(sixteen_bit() >> 8), 0),
    "I 32-bit values TIFF": (encoded(Image.fromarray(rows(WIDE).astype(np.int32)), "TIFF"),
                             grey(np.rint((WIDE - WIDE.min()) * 255 / np.ptp(WIDE))), 0),
    "F 0..1 TIFF": (encoded(Image.fromarray(rows(COLUMNS / 15).astype(np.float32)), "TIFF"),
                    grey(np.rint(COLUMNS / 15 * 255)), 0),
    "LA PNG": (encoded(half_transparent(Image.new("L", (WIDTH, HEIGHT), 100)), "PNG"),
               over_white((100, 100, 100)), 0),
    "RGBA PNG": (encoded(half_transparent(Image.new("RGB", (WIDTH, HEIGHT), (200, 30, 40))),
                         "PNG"), over_white((200, 30, 40)), 0),
    "P with transparency PNG": (encoded(palette("P"), "PNG", transparency=0),
                                over_white((10, 200, 30)), 0),
    "PA TIFF": (encoded(palette("PA"), "TIFF"), over_white((10, 200, 30)), 0),
    "RGB with a transparent colour PNG": (
        encoded(Image.fromarray(halves((1, 2, 3), (70, 80, 90))), "PNG", transparency=(1, 2, 3)),
        over_white((70, 80, 90)), 0),
    "CMYK TIFF": (encoded(Image.new("CMYK", (WIDTH, HEIGHT), (0, 255, 0, 0)), "TIFF"),
                  np.full((HEIGHT, WIDTH, 3), (255, 0, 255), np.uint8), 0),
    "CMYK JPEG": (encoded(Image.new("CMYK", (WIDTH, HEIGHT), (0, 255, 0, 0)), "JPEG",
                          quality=95), np.full((HEIGHT, WIDTH, 3), (255, 0, 255), np.uint8), 3),
    "1 PNG": (encoded(Image.fromarray(rows(COLUMNS % 2 == 1)), "PNG"),
              grey(np.where(COLUMNS % 2 == 1, 255, 0)), 0),
    "L PNG": (encoded(Image.fromarray(rows(COLUMNS * 16).astype(np.uint8)), "PNG"),
              grey(COLUMNS * 16), 0),
}


def assert_close(pixels: np.ndarray, expected: np.ndarray, tolerance: int) -> None:
    assert pixels.dtype == np.uint8 and pixels.shape == expected.shape
    difference = np.abs(pixels.astype(int) - expected.astype(int)).max()
    assert difference <= tolerance, f"off by {difference}:\n{pixels[..., 0]}\n{expected[..., 0]}"


@pytest.mark.parametrize("name", MODES)
def test_every_mode_becomes_the_expected_8_bit_rgb(name: str, tmp_path: Path) -> None:
    data, expected, tolerance = MODES[name]
    # the reader decodes whatever a shard holds; at the image's own size nothing is resized
    pixels, size = decode_image(data, WIDTH)
    assert size == (WIDTH, HEIGHT)
    assert_close(pixels[:HEIGHT], np.asarray(Image.fromarray(expected).resize(
        (WIDTH, WIDTH), Image.Resampling.BILINEAR))[:HEIGHT], tolerance)
    if "TIFF" not in name:  # the featurizer (and the embedder, through it) takes JPEG and PNG
        path = tmp_path / "image"
        path.write_bytes(data)
        assert_close(np.asarray(load_image(path).image), expected, tolerance)


# ---------------------------------------------------------------- EXIF orientation


# EXIF orientation -> the stored pixels of an upright image, as the EXIF specification defines
# each by the side of the upright view the stored 0th row and 0th column are (not PIL's table)
STORED = {
    1: lambda upright: upright,  # 0th row top, 0th column left
    2: np.fliplr,  # top, right: mirrored left-right
    3: lambda upright: np.rot90(upright, 2),  # bottom, right: turned half round
    4: np.flipud,  # bottom, left: mirrored top-bottom
    5: lambda upright: upright.transpose(1, 0, 2),  # left, top: mirrored across the diagonal
    6: lambda upright: np.rot90(upright),  # right, top: a phone held upright, turned back
    7: lambda upright: np.rot90(upright, 2).transpose(1, 0, 2),  # right, bottom: the other one
    8: lambda upright: np.rot90(upright, -1),  # left, bottom
}
SIZE = 32  # the tiny model's image size (the reader's resize)


def tiny_embedder(boxes: dict) -> Embedder:
    """A real (untrained) model's embedder with the `boxes` source: what read_image needs."""
    vocab = Vocabulary(["dog"], ["nsubj"])
    model_cfg = ModelConfig(embed_dim=8, word_dim=4, pretrained=False, image_size=SIZE)
    model = DeFragModel.from_config(model_cfg, vocab, seed=0)
    return Embedder(model, Config(model=model_cfg), vocab, "key", boxes, "spacy")


@dataclass
class Twins:
    """An upright PNG (no EXIF) and the same picture stored sideways, mirrored, ... (`STORED`)
    with each EXIF orientation: once oriented, all nine have the same pixels."""

    upright: np.ndarray
    folder: Path  # upright.png and 1.png .. 8.png
    embedder: Embedder  # selective-search boxes: boxes that move with the picture
    boxes: list[list[float]]  # the upright twin's boxes
    fragments: FragmentSet  # its embedding (index, retrieval, pyfunc, web app uploads)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Twins:
    """Three shapes off-centre on a 64 x 48 picture: every turn and mirror of it differs."""
    picture = Image.new("RGB", (64, 48), (200, 205, 190))
    draw = ImageDraw.Draw(picture)
    draw.ellipse((4, 6, 26, 28), fill=(220, 30, 30))
    draw.rectangle((36, 8, 58, 20), fill=(30, 70, 220))
    draw.polygon([(30, 30), (46, 46), (14, 46)], fill=(30, 160, 50))
    folder = tmp_path_factory.mktemp("orientations")
    picture.save(folder / "upright.png")
    upright = np.asarray(picture)
    for orientation, stored in STORED.items():
        exif = Image.Exif()
        exif[ExifTags.Base.Orientation] = orientation
        Image.fromarray(stored(upright)).save(folder / f"{orientation}.png", exif=exif)
    embedder = tiny_embedder({"name": "selective_search", "options": {"score_size": 64}})
    boxes, _ = embedder.box_source(picture)
    fragments, _ = embed_images([folder / "upright.png"], embedder, skip_bad=False,
                                progress=False)
    return Twins(upright, folder, embedder, boxes, fragments)


@pytest.mark.parametrize("orientation", STORED)
def test_exif_orientation_gives_the_upright_pixels_and_boxes_on_every_path(
        orientation: int, twins: Twins) -> None:
    """The featurizer's and the reader's pixels and the embedder's boxes and vectors of a file
    with EXIF orientation 1..8 are those of its upright twin (the featurizer's boxes: below)."""
    path = twins.folder / f"{orientation}.png"
    featurized = load_image(path).image  # the pixels the featurizer computes boxes on
    assert np.array_equal(np.asarray(featurized), twins.upright)

    pixels, original = decode_image(path.read_bytes(), SIZE)  # training and evaluation
    assert original == (64, 48)
    assert np.array_equal(pixels, np.asarray(Image.fromarray(twins.upright).resize(
        (SIZE, SIZE), Image.Resampling.BILINEAR)))

    # index, retrieval, pyfunc and web app uploads: boxes and vectors of the upright twin
    fragments, _ = embed_images([path], twins.embedder, skip_bad=False, progress=False)
    assert fragments.detail.tolist() == twins.boxes
    torch.testing.assert_close(fragments.embeddings, twins.fragments.embeddings)


def test_the_featurizer_and_the_shard_reader_orient_all_eight(twins: Twins,
                                                               tmp_path: Path) -> None:
    """`featurize` of the nine twins: every shard sample has the upright twin's size and
    boxes, and the shard reader decodes the upright twin's pixels from each."""
    jsonl = tmp_path / "twins.jsonl"
    jsonl.write_text("".join(json.dumps({"image": path.name, "captions": ["A red dog runs ."]})
                             + "\n" for path in sorted(twins.folder.glob("*.png"))))
    featurize(read_jsonl(jsonl, twins.folder, "train"), Settings(
        out=tmp_path / "shards", parser="spacy", boxes="selective_search", workers=1,
        box_options=twins.embedder.boxes["options"], min_word_count=1))
    decoder = SampleDecoder(Vocabulary.load(tmp_path / "shards" / "vocab.json"), SIZE, 20,
                            "triplet")
    images = list(read_images(locate_split(str(tmp_path / "shards"), "train").shards, decoder))
    [upright] = [image for image in images if image.image_id.startswith("upright")]
    scale = np.asarray([SIZE / 64, SIZE / 48] * 2, np.float32)
    assert np.array_equal(upright.boxes, np.asarray(twins.boxes, np.float32) * scale)
    assert {image.image_id: (image.size, image.boxes.tolist()) for image in images} == {
        f"{name}_png": ((64, 48), upright.boxes.tolist()) for name in ["upright", *STORED]}
    assert [image.image_id for image in images
            if not np.array_equal(image.pixels, upright.pixels)] == []


# ---------------------------------------------------------------- the pixel bound


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height RGB but whose pixel data is a few bytes: it can
    only be refused from its header, never decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                                0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_the_featurizer_reads_an_image_header_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The format check and the decode share one opening; another format is refused from it."""
    Image.new("RGB", (8, 6), (200, 10, 10)).save(tmp_path / "a.png")
    Image.new("P", (8, 6)).save(tmp_path / "a.gif")
    opened, real_open = [], Image.open
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: (
        opened.append(args[0]), real_open(*args, **kwargs))[1])
    assert load_image(tmp_path / "a.png").image.size == (8, 6)
    assert len(opened) == 1
    with pytest.raises(BadImage) as refused:
        load_image(tmp_path / "a.gif")
    assert (refused.value.reason, str(refused.value)) == (
        "unsupported_format", f"{tmp_path / 'a.gif'} is GIF, not JPEG, PNG or WebP")
    assert len(opened) == 2


@pytest.mark.parametrize(("width", "height", "megapixels"), [
    (7000, 7000, "49"),  # over the default 40 Mpx
    (14000, 13000, "182"),  # over PIL's own guard too (179 Mpx: DecompressionBombError)
])
def test_an_image_over_the_pixel_bound_is_refused_before_decoding(
        width: int, height: int, megapixels: str, tmp_path: Path) -> None:
    path = tmp_path / "huge.png"
    path.write_bytes(png_header(width, height))
    with pytest.raises(BadImage) as refused:
        load_image(path)
    assert refused.value.reason == "too_large"
    assert str(refused.value) == (
        f"{path} is {width} x {height} pixels ({megapixels} megapixels), over the limit of "
        f"40000000 (40 megapixels): scale it down, or raise the limit (max_image_pixels)")
    decoder = SampleDecoder(Vocabulary(["dog"], ["nsubj"]), 32, 20, "triplet")
    with pytest.raises(BadSample, match=rf"{width} x {height} pixels .* over the limit of 4000"):
        decoder.pixels_of(decoder.describe(json.dumps({
            "image_id": "huge", "width": width, "height": height,
            "boxes": [[0, 0, width, height]], "captions": []})), path.read_bytes())


def test_the_featurizer_and_the_shard_reader_count_and_skip_an_image_over_the_bound(
        tmp_path: Path) -> None:
    (tmp_path / "small.png").write_bytes(encoded(Image.new("RGB", (40, 30), "red"), "PNG"))
    (tmp_path / "large.png").write_bytes(encoded(Image.new("1", (100, 100)), "PNG"))
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"image": name, "captions": ["A red dog runs ."]}) + "\n"
                             for name in ("small.png", "large.png")))

    def featurized(out: str, **bound: int) -> dict:
        return featurize(read_jsonl(jsonl, tmp_path, "train"), Settings(
            out=tmp_path / out, parser="spacy", boxes="fullframe", workers=1, min_word_count=1,
            **bound))

    manifest = featurized("bounded", max_image_pixels=5000)
    assert manifest["splits"]["train"]["images"] == 1
    assert manifest["skipped"]["by_reason"] == {"too_large": 1}
    [item] = manifest["skipped"]["items"]
    assert item["line"] == 2 and "large.png is 100 x 100 pixels" in item["detail"]

    assert featurized("all")["splits"]["train"]["images"] == 2  # under the default bound
    split = locate_split(str(tmp_path / "all"), "train")
    decoder = SampleDecoder(Vocabulary.load(tmp_path / "all" / "vocab.json"), 32, 20, "triplet",
                            max_pixels=5000)
    chunks = list(image_chunks(split.shards, range(len(split.shards)), decoder, ReadOptions()))
    assert [image.size for images, _, _ in chunks for image in images] == [(40, 30)]
    [problem] = [problem for _, _, notes in chunks for problem in notes.problems]
    assert problem.kind == "sample" and "is 100 x 100 pixels (0.01 megapixels), over the limit " \
        "of 5000" in problem.message
