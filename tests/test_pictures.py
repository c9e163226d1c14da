"""trainer/pictures.py: the fragment-to-box alignment and its Figure-4-style picture."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from trainer.pictures import (
    IMAGE_SIDE,
    MARGIN,
    PALETTE,
    PANEL_WIDTH,
    UNLINKED,
    best_boxes,
    render_alignment,
)

BACKGROUND = (90, 110, 90)
BOXES = [[0, 0, 250, 200], [20, 30, 120, 150], [100, 60, 240, 190], [5, 5, 40, 40]]


def test_best_boxes_matches_a_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    v, s = torch.randn(7, 5, generator=generator), torch.randn(9, 5, generator=generator)
    box, score = best_boxes(v, s)
    for j in range(9):
        scores = [float(v[i] @ s[j]) for i in range(7)]
        assert box[j] == max(range(7), key=lambda i: scores[i])
        assert score[j] == pytest.approx(max(scores), abs=1e-5)


def test_best_boxes_edge_cases() -> None:
    v = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    box, score = best_boxes(v, torch.tensor([[2.0, 0.0]]))
    assert box.tolist() == [0] and score.tolist() == [2.0]  # a tie goes to the first box
    box, score = best_boxes(v, torch.zeros(0, 2))
    assert box.shape == score.shape == (0,)
    with pytest.raises(ValueError, match="no image fragments"):
        best_boxes(torch.zeros(0, 2), torch.ones(1, 2))


def test_render_draws_image_boxes_and_fragments() -> None:
    image = Image.new("RGB", (250, 200), BACKGROUND)
    picture = render_alignment(
        image, BOXES, ["A brown dog runs on the grass.", "A dog outside."],
        ["(nsubj, runs, dog)", "(amod, dog, brown)", "(prep_on, runs, grass)"],
        triplet_box=[1, 1, 2], triplet_score=[0.9, 0.4, -0.1])
    scaled = (IMAGE_SIDE, round(200 * IMAGE_SIDE / 250))
    assert picture.size == (MARGIN + scaled[0] + PANEL_WIDTH, scaled[1] + 2 * MARGIN)
    colours = {c for _, c in picture.getcolors(maxcolors=1 << 20)}
    assert {PALETTE[0], PALETTE[1], UNLINKED, BACKGROUND} <= colours  # boxes 1, 2; 0 and 3 grey
    assert PALETTE[2] not in colours  # only two boxes are linked
    assert picture.getpixel((MARGIN + 20, MARGIN + scaled[1] - 20)) == BACKGROUND  # image
    assert picture.getpixel((picture.width - 5, 5)) == (255, 255, 255)  # text column


def test_render_takes_best_boxes_tensors() -> None:
    v = torch.eye(4)[:, :3] * 2  # box k has direction e_k (box 3 none)
    s = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    box, score = best_boxes(v, s)
    picture = render_alignment(Image.new("RGB", (250, 200), BACKGROUND), torch.tensor(BOXES),
                               ["a sentence"], ["(a, b, c)", "(d, e, f)"], box, score)
    colours = {c for _, c in picture.getcolors(maxcolors=1 << 20)}
    assert {PALETTE[0], PALETTE[1]} <= colours and PALETTE[2] not in colours


def test_render_grows_with_the_text() -> None:
    fragments = [f"(det, word{j}, a)" for j in range(40)]
    picture = render_alignment(Image.new("L", (64, 48)), [[0, 0, 64, 48]], ["a sentence"],
                               fragments, [0] * 40, [0.5] * 40)
    assert picture.height > IMAGE_SIDE + 2 * MARGIN and picture.mode == "RGB"


def test_render_checks_its_inputs() -> None:
    image = Image.new("RGB", (10, 10))
    with pytest.raises(ValueError, match="one of each per fragment"):
        render_alignment(image, BOXES, [], ["a"], [0, 1], [0.5])
    with pytest.raises(ValueError, match="outside 0..3"):
        render_alignment(image, BOXES, [], ["a"], [4], [0.5])
