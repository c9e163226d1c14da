"""A small captioned dataset of shape scenes: the embedded default for the demo and the tests.

Each scene holds 2-4 coloured shapes (circle, square, triangle, diamond, star, cross) of two
size classes at different positions on a pale gradient background with small clutter. Five
English captions per image mention different subsets of its shapes, always binding a colour to
a shape ("A big red circle on the left.", "The star at the top is blue.", "A green square sits
above a small yellow disc."), so a dependency parser yields triplets such as (amod, circle, red).
Ground-truth boxes are the tight pixel boxes of the shapes.

Why a global colour histogram is not enough: scenes come in twins. A twin has exactly the colours
and colour areas of its partner (hence the same colour histogram, up to clutter) but every colour
sits on a different shape type and at a new position, so only the colour-shape binding tells the
captions of the two apart; colours and shapes are recombined freely across the other scenes.
"""

from __future__ import annotations

import colorsys
import io
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, ImageDraw

DEFAULT_NUM_TRAIN = 600  # demo size: a few minutes of training on 2 CPU processes
DEFAULT_NUM_VAL = 100

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220),
    "yellow": (245, 205, 20), "purple": (130, 50, 180), "orange": (245, 130, 20),
    "pink": (240, 100, 180), "black": (25, 25, 25),
}
# Shape type -> the nouns captions use for it.
SHAPES: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "circle", "disc"), "square": ("square", "square", "block", "box"),
    "triangle": ("triangle",), "diamond": ("diamond", "diamond", "rhombus"),
    "star": ("star",), "cross": ("cross",),
}
# Fraction of its bounding square a shape fills: sides are chosen so colour AREAS match sizes.
FILL = {"circle": 0.785, "square": 1.0, "triangle": 0.5, "diamond": 0.5, "star": 0.40,
        "cross": 0.64}
SIZE_WORDS = {"small": ("small", "small", "tiny", "little"), "large": ("large", "big", "big")}
AREA_SIDE = {"small": (17.0, 21.0), "large": (32.0, 38.0)}  # sqrt(area) at 128 px, uniform
GAP = 4  # minimum pixels between two shapes' boxes (and between shapes and clutter)


@dataclass
class Shape:
    """One drawn shape: its type, colour name, size class, side of its square, centre and box."""

    kind: str
    colour: str
    size: str
    side: float
    centre: tuple[int, int] = (0, 0)
    box: tuple[int, int, int, int] = (0, 0, 0, 0)  # tight pixel box, x2/y2 exclusive


@dataclass
class Scene:
    """Everything needed to draw an image and its captions; `mentions` lists, per caption, the
    indices of the shapes it talks about."""

    size: int
    shapes: list[Shape]
    background: tuple[tuple[int, int, int], tuple[int, int, int]]  # top and bottom colours
    clutter: list[tuple[str, tuple[int, ...], tuple[int, int, int]]] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    mentions: list[tuple[int, ...]] = field(default_factory=list)


def generate(out_dir: Path, num_train: int, num_val: int, seed: int,
             image_size: int = 128) -> Path:
    """Write PNG images under out_dir/images and a JSONL of {image, captions, split, boxes}.

    Image paths in the JSONL are relative to out_dir (the JSONL's folder). Same seed, same bytes.
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "synthetic.jsonl"
    with jsonl.open("w") as out:
        for split, count in (("train", num_train), ("val", num_val)):
            for index, scene in enumerate(make_scenes(count, seed, split, image_size)):
                name = f"images/{split}_{index:05d}.png"
                render(scene).save(out_dir / name, format="PNG")
                record = {"image": name, "captions": scene.captions, "split": split,
                          "boxes": [list(shape.box) for shape in scene.shapes]}
                out.write(json.dumps(record) + "\n")
    return jsonl


def write_img2dataset(out_dir: Path, count: int, per_shard: int, seed: int = 0,
                      image_size: int = 128, split: str | None = None) -> list[Path]:
    """`count` scenes as img2dataset writes downloaded images: shards `00000.tar`, ... of
    `per_shard` samples keyed `{shard:05d}{index:04d}`, each a JPEG, its first caption as `txt`
    and a json (url, key, status, sizes, caption; and `split` when given). Same seed, same bytes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for shard, start in enumerate(range(0, count, per_shard)):
        path = out_dir / f"{shard:05d}.tar"
        scenes = make_scenes(min(per_shard, count - start), seed * 1_000_000 + shard,
                             "img2dataset", image_size)
        with wds.TarWriter(str(path), encoder=False, mtime=0) as tar:
            for index, scene in enumerate(scenes):
                key = f"{shard:05d}{index:04d}"
                jpeg = io.BytesIO()
                render(scene).save(jpeg, format="JPEG", quality=90)
                meta = {"url": f"https://images.example/{key}.jpg", "key": key,
                        "status": "success", "error_message": None, "width": scene.size,
                        "height": scene.size, "original_width": scene.size,
                        "original_height": scene.size, "caption": scene.captions[0]}
                if split is not None:
                    meta["split"] = split
                tar.write({"__key__": key, "jpg": jpeg.getvalue(),
                           "txt": scene.captions[0].encode(), "json": json.dumps(meta).encode()})
        written.append(path)
    return written


def make_scenes(count: int, seed: int, split: str, image_size: int = 128) -> list[Scene]:
    """`count` scenes of one split, built in twins (scene 2k+1 is the twin of scene 2k)."""
    if image_size < 64:
        raise ValueError(f"image_size must be at least 64 pixels, got {image_size}: smaller "
                         f"shapes would not stay visible and apart")
    rng = random.Random(f"defrag-synthetic/{seed}/{split}")
    scenes: list[Scene] = []
    while len(scenes) < count:
        scene = _random_scene(rng, image_size)
        scenes.append(scene)
        if len(scenes) < count:
            scenes.append(_twin(rng, scene))
    for scene in scenes:
        _add_clutter(rng, scene)
        _add_captions(rng, scene)
    return scenes


def render(scene: Scene) -> Image.Image:
    """Draw a scene: gradient background, clutter, then the shapes on top."""
    top, bottom = (np.array(c, dtype=np.float64) for c in scene.background)
    ramp = np.linspace(0.0, 1.0, scene.size)[:, None, None]
    rows = np.rint(top * (1 - ramp) + bottom * ramp).astype(np.uint8)
    image = Image.fromarray(np.repeat(rows, scene.size, axis=1), mode="RGB")
    draw = ImageDraw.Draw(image)
    for kind, coords, colour in scene.clutter:
        if kind == "dot":
            draw.ellipse(coords, fill=colour)
        else:
            draw.line(coords, fill=colour, width=1)
    for shape in scene.shapes:
        _draw_shape(draw, shape, COLOURS[shape.colour])
    return image


# ---- scene layout --------------------------------------------------------------------------

def _random_scene(rng: random.Random, image_size: int) -> Scene:
    """2-4 shapes with distinct colours, random types, at most two large ones, placed apart."""
    while True:
        count = rng.randint(2, 4)
        colours = rng.sample(sorted(COLOURS), count)
        large = rng.randint(1, min(2, count - 1))
        sizes = ["large"] * large + ["small"] * (count - large)
        rng.shuffle(sizes)
        shapes = []
        for colour, size in zip(colours, sizes, strict=True):
            side = rng.uniform(*AREA_SIDE[size]) * image_size / 128
            shapes.append(Shape(rng.choice(sorted(SHAPES)), colour, size, side))
        scene = Scene(image_size, shapes, _background(rng))
        if _place(rng, scene):
            return scene


def _twin(rng: random.Random, scene: Scene) -> Scene:
    """Same colours, size classes and colour areas; a new shape type per colour, new places."""
    while True:
        shapes = [Shape(rng.choice([k for k in sorted(SHAPES) if k != s.kind]), s.colour, s.size,
                        s.side) for s in scene.shapes]
        twin = Scene(scene.size, shapes, _background(rng))
        if _place(rng, twin):
            return twin


def _background(rng: random.Random) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Two pale tints of random hues (light, unsaturated: never mistaken for a shape colour)."""
    def tint() -> tuple[int, int, int]:
        r, g, b = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.05, 0.25),
                                      rng.uniform(0.85, 1.0))
        return round(r * 255), round(g * 255), round(b * 255)
    return tint(), tint()


def _place(rng: random.Random, scene: Scene, tries: int = 60) -> bool:
    """Random centres, large shapes first, keeping boxes inside the image and GAP apart."""
    placed: list[Shape] = []
    for shape in sorted(scene.shapes, key=lambda s: -s.side):
        for _ in range(tries):
            half = math.ceil(_extent(shape) / 2) + 1
            if 2 * half >= scene.size:
                return False
            shape.centre = (rng.randint(half, scene.size - half),
                            rng.randint(half, scene.size - half))
            shape.box = _shape_box(shape, scene.size)
            if all(_apart(shape.box, other.box, GAP) for other in placed):
                placed.append(shape)
                break
        else:
            return False
    return True


def _add_clutter(rng: random.Random, scene: Scene) -> None:
    """3-8 tiny dots and short thin lines in shape colours or grey, away from every shape."""
    greys = [(110, 110, 110), (160, 160, 160)]
    for _ in range(rng.randint(3, 8)):
        colour = rng.choice([*COLOURS.values(), *greys])
        x, y = rng.randrange(scene.size), rng.randrange(scene.size)
        if rng.random() < 0.5:
            r = rng.randint(1, 2)
            item = ("dot", (x - r, y - r, x + r, y + r), colour)
        else:
            angle, length = rng.uniform(0, math.pi), rng.randint(5, 12)
            x2, y2 = round(x + length * math.cos(angle)), round(y + length * math.sin(angle))
            item = ("line", (x, y, x2, y2), colour)
        xs, ys = item[1][0::2], item[1][1::2]
        box = (min(xs), min(ys), max(xs) + 1, max(ys) + 1)
        if all(_apart(box, shape.box, GAP) for shape in scene.shapes):
            scene.clutter.append(item)


def _apart(a: tuple[int, ...], b: tuple[int, ...], gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


# ---- drawing ---------------------------------------------------------------------------------

def _extent(shape: Shape) -> float:
    """Side of the square the shape is drawn in: its area is side^2 * FILL = the target area."""
    return shape.side / math.sqrt(FILL[shape.kind])


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, fill: tuple[int, ...] | int) -> None:
    cx, cy = shape.centre
    h = _extent(shape) / 2
    if shape.kind == "circle":
        draw.ellipse((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif shape.kind == "square":
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif shape.kind == "triangle":
        draw.polygon([(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)], fill=fill)
    elif shape.kind == "diamond":
        draw.polygon([(cx, cy - h), (cx + h, cy), (cx, cy + h), (cx - h, cy)], fill=fill)
    elif shape.kind == "star":
        radii = [1.05 * h, 0.5 * h] * 5  # outer and inner points, centred on the box
        points = [(cx + r * math.sin(i * math.pi / 5), cy + 0.1 * h - r * math.cos(i * math.pi / 5))
                  for i, r in enumerate(radii)]
        draw.polygon(points, fill=fill)
    else:  # cross: two bars 40% of the side thick
        t = 0.4 * h
        draw.rectangle((cx - h, cy - t, cx + h, cy + t), fill=fill)
        draw.rectangle((cx - t, cy - h, cx + t, cy + h), fill=fill)


def _shape_box(shape: Shape, image_size: int) -> tuple[int, int, int, int]:
    """The tight box of the shape's pixels, read from a mask drawn exactly like the image."""
    mask = Image.new("L", (image_size, image_size), 0)
    _draw_shape(ImageDraw.Draw(mask), shape, 255)
    box = mask.getbbox()
    assert box is not None, "a placed shape is inside the image"
    return box


# ---- captions --------------------------------------------------------------------------------

def _add_captions(rng: random.Random, scene: Scene, count: int = 5) -> None:
    """Five captions; caption i is about shape i (cycling through a shuffled order), plus
    maybe a partner or all shapes, so the captions mention different subsets."""
    order = list(range(len(scene.shapes)))
    rng.shuffle(order)
    for i in range(count):
        focus = order[i % len(order)]
        for _ in range(20):  # draw again when the caption repeats an earlier one
            kind = rng.choices(["one", "two", "all"], weights=[4, 4, 1])[0]
            if kind == "one":
                text, mentioned = _caption_one(rng, scene, focus), (focus,)
            elif kind == "two":
                partner = rng.choice([j for j in order if j != focus])
                text, mentioned = _caption_two(rng, scene, focus, partner), (focus, partner)
            else:
                text, mentioned = _caption_all(rng, scene), tuple(range(len(scene.shapes)))
            text = text[0].upper() + text[1:]
            if text not in scene.captions:
                break
        scene.captions.append(text)
        scene.mentions.append(mentioned)


def _noun(rng: random.Random, shape: Shape) -> str:
    return rng.choice(SHAPES[shape.kind])


def _phrase(rng: random.Random, shape: Shape, size_p: float = 0.5) -> str:
    """'a big red circle' / 'an orange star': size word with probability size_p."""
    words = [rng.choice(SIZE_WORDS[shape.size])] if rng.random() < size_p else []
    text = " ".join([*words, shape.colour, _noun(rng, shape)])
    return ("an " if text[0] in "aeiou" else "a ") + text


def _where(rng: random.Random, shape: Shape, image_size: int) -> str:
    """Position words from the centre's third of the image: 'on the left', 'at the top', ..."""
    cx, cy = shape.centre
    col = "left" if cx < image_size / 3 else "right" if cx > 2 * image_size / 3 else ""
    row = "top" if cy < image_size / 3 else "bottom" if cy > 2 * image_size / 3 else ""
    if row and col:
        return rng.choice([f"in the {row} {col} corner", f"at the {row} {col}"])
    if col:
        return rng.choice([f"on the {col}", f"on the {col} side", f"at the {col}"])
    if row:
        return rng.choice([f"at the {row}", f"near the {row}"])
    return rng.choice(["in the middle", "in the centre", "in the center"])


def _relation(rng: random.Random, a: Shape, b: Shape) -> str:
    """Where a is with respect to b: 'to the left of', 'next to', 'above', 'below', ..."""
    dx, dy = b.centre[0] - a.centre[0], b.centre[1] - a.centre[1]
    if abs(dx) >= abs(dy):
        side = "left" if dx > 0 else "right"
        return rng.choice([f"to the {side} of", "next to", "beside"])
    return rng.choice(["above", "over"] if dy > 0 else ["below", "under", "beneath"])


def _caption_one(rng: random.Random, scene: Scene, i: int) -> str:
    shape = scene.shapes[i]
    where = _where(rng, shape, scene.size)
    verb = rng.choice(["is", "sits", "appears", "is drawn", "is shown", "can be seen"])
    size = rng.choice(SIZE_WORDS[shape.size])
    templates = [
        lambda: f"{_phrase(rng, shape, 0.7)} {where}.",
        lambda: f"{_phrase(rng, shape)} {verb} {where}.",
        lambda: f"there is {_phrase(rng, shape)} {where}.",
        lambda: f"the {_noun(rng, shape)} {where} is {shape.colour}.",
        lambda: f"a {size} {_noun(rng, shape)} painted {shape.colour} {where}.",
        lambda: f"someone drew {_phrase(rng, shape, 0.8)} on a "
                f"{rng.choice(['pale', 'plain', 'light'])} background.",
    ]
    return rng.choice(templates)()


def _caption_two(rng: random.Random, scene: Scene, i: int, j: int) -> str:
    a, b = scene.shapes[i], scene.shapes[j]
    relation = _relation(rng, a, b)
    verb = rng.choice(["is", "sits", "lies", "is placed", "stands"])
    templates = [
        lambda: f"{_phrase(rng, a)} {verb} {relation} {_phrase(rng, b)}.",
        lambda: f"{relation} {_phrase(rng, b)} there is {_phrase(rng, a)}.",
        lambda: f"{rng.choice(['the picture shows', 'this image contains', 'we can see'])} "
                f"{_phrase(rng, a)} and {_phrase(rng, b)}.",
        lambda: f"{_phrase(rng, a)} and {_phrase(rng, b)} {rng.choice(['on', 'against'])} a "
                f"{rng.choice(['pale', 'plain', 'light'])} background.",
    ]
    if a.size != b.size:
        comparative = "bigger" if a.size == "large" else "smaller"
        templates.append(lambda: f"the {a.colour} {_noun(rng, a)} is {comparative} than the "
                                 f"{b.colour} {_noun(rng, b)}.")
    return rng.choice(templates)()


def _caption_all(rng: random.Random, scene: Scene) -> str:
    phrases = [_phrase(rng, shape) for shape in scene.shapes]
    listed = ", ".join(phrases[:-1]) + " and " + phrases[-1]
    number = ["two", "three", "four"][len(phrases) - 2]
    return rng.choice([f"{number} shapes: {listed}.", f"there are {number} shapes, {listed}."])
