"""Alignment pictures in the style of the paper's Figure 4: which box each sentence fragment meets.

`best_boxes` aligns every sentence fragment with its highest-scoring image fragment (the inner
product v_i . s_j of the paper); `render_alignment` draws the image with its boxes and, beside it,
the sentences and each fragment with its box's colour tag and score; `alignment_figure` does both
for one image and sentence (the trainer's val picture, retrieval's --explain).
`word_contribution_figure` draws the same image beside a sentence's words, each with a bar for its
contribution to the score (retrieval's --explain for whole-sentence encoders). Plain PIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from PIL import Image, ImageDraw, ImageFont

from defrag.images import to_rgb

if TYPE_CHECKING:
    from defrag.vocab import Vocabulary

IMAGE_SIDE = 480  # the drawn image's longer side in pixels (Flickr images are ~500)
PANEL_WIDTH = 460  # the text column beside the image
MARGIN = 12
FONT_SIZE = 15
LINE_HEIGHT = FONT_SIZE + 6
UNLINKED = (150, 150, 150)  # boxes no fragment aligns to: thin grey outlines
RAISES, LOWERS = (60, 180, 75), (230, 25, 75)  # bars of words that raise / lower the score
WORD_COLUMN = 130  # width of the word column beside the bars
# Distinct colours for linked boxes (Trubetskoy's list, strongest first, grey left out).
PALETTE = [
    (230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180),
    (70, 240, 240), (240, 50, 230), (210, 245, 60), (0, 128, 128), (170, 110, 40),
    (128, 0, 0), (128, 128, 0), (0, 0, 128), (255, 225, 25), (250, 190, 212),
    (220, 190, 255), (170, 255, 195), (255, 215, 180), (255, 250, 200),
]


def best_boxes(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For fragments s [Ns, d] and boxes v [Nv, d]: the best box of each fragment [Ns] (first
    on ties) and its score v_i . s_j [Ns]."""
    if v.shape[0] == 0:
        raise ValueError("best_boxes: no image fragments to align to")
    score, box = (s.detach() @ v.detach().T).max(dim=1)
    return box, score


def fragment_labels(fragments: torch.Tensor, vocab: Vocabulary, mode: str) -> list[str]:
    """Readable names of sentence fragments [Ns, 3] of (relation, w1, w2) ids: `rel(w1, w2)`,
    with the mode's name in place of the relation for the BoW and bigram ablations."""
    words = vocab.words
    return [f"{vocab.relations[r] if mode == 'triplet' else mode}({words[a]}, {words[b]})"
            for r, a, b in fragments.tolist()]


def alignment_figure(image: Image.Image, boxes: torch.Tensor, sentence: str, v: torch.Tensor,
                     s: torch.Tensor, fragments: torch.Tensor, vocab: Vocabulary,
                     mode: str) -> tuple[Image.Image, list[tuple[str, int, float]]]:
    """Figure 4 for one image and one sentence: each fragment (ids `fragments` [Ns, 3], embedded
    `s`) linked to its best box (xyxy pixels `boxes` [Nv, 4], embedded `v`). Returns the
    picture and each fragment's (label, box, score); the trainer and `trainer.search.explain` draw
    it."""
    box, score = best_boxes(v, s)
    labels = fragment_labels(fragments, vocab, mode)
    picture = render_alignment(image, boxes.tolist(), [sentence], labels, box.tolist(),
                               score.tolist())
    return picture, list(zip(labels, box.tolist(), score.tolist(), strict=True))


def render_alignment(image: Image.Image, boxes: Sequence[Sequence[float]],
                     sentences: Sequence[str], triplet_labels: Sequence[str],
                     triplet_box: Sequence[int], triplet_score: Sequence[float]) -> Image.Image:
    """The image (scaled so its longer side is IMAGE_SIDE) with its xyxy pixel `boxes`, and a
    text column: the sentences, then each fragment `triplet_labels[j]` tagged with the colour and
    number of its box `triplet_box[j]` and its score. Tensors (e.g. from best_boxes) are fine."""
    boxes = [[float(c) for c in box] for box in boxes]
    triplet_box = [int(b) for b in triplet_box]
    triplet_score = [float(score) for score in triplet_score]
    if not len(triplet_labels) == len(triplet_box) == len(triplet_score):
        raise ValueError(f"{len(triplet_labels)} triplet labels, {len(triplet_box)} boxes and "
                         f"{len(triplet_score)} scores: expected one of each per fragment")
    if any(not 0 <= b < len(boxes) for b in triplet_box):
        raise ValueError(f"triplet box indices {list(triplet_box)} outside 0..{len(boxes) - 1}")
    font = ImageFont.load_default(size=FONT_SIZE)
    colour = {}  # box index -> colour, in order of first appearance among the fragments
    for b in triplet_box:
        colour.setdefault(b, PALETTE[len(colour) % len(PALETTE)])

    picture, scale = _scaled(image)
    draw = ImageDraw.Draw(picture)
    linked_last = sorted(range(len(boxes)), key=lambda b: b in colour)  # coloured boxes on top
    for b in linked_last:
        xyxy = [c * scale for c in boxes[b]]  # xyxy pixels of the drawn image
        if b in colour:
            draw.rectangle(xyxy, outline=colour[b], width=3)
            _tag(draw, (xyxy[0] + 3, xyxy[1] + 3), str(b), colour[b], font)
        else:
            draw.rectangle(xyxy, outline=UNLINKED, width=1)

    text_width = PANEL_WIDTH - 2 * MARGIN
    lines = [line for sentence in sentences for line in _wrap(sentence, font, text_width)]
    fragments = [(f"{label}  {score:.2f}", b)
                 for label, b, score in zip(triplet_labels, triplet_box, triplet_score,
                                            strict=True)]
    canvas, draw, (x, y) = _beside(picture, lines, len(fragments), font)
    for text, b in fragments:
        tag_right = _tag(draw, (x, y), str(b), colour[b], font)
        draw.text((tag_right + 6, y), text, fill="black", font=font)
        y += LINE_HEIGHT
    return canvas


def word_contribution_figure(image: Image.Image, sentence: str,
                             words: Sequence[tuple[str, float | None]], score: float,
                             score_name: str) -> Image.Image:
    """The image (scaled like `render_alignment`'s) beside the sentence, its `score` with the
    image (named `score_name`), and one row per word: a bar for its contribution to the score
    (green to the right: the word raises it; red to the left: lowers it; scaled to the largest),
    or, for a contribution of None, "not in the vocabulary"."""
    font = ImageFont.load_default(size=FONT_SIZE)
    picture, _ = _scaled(image)
    width = PANEL_WIDTH - 2 * MARGIN
    lines = [*_wrap(sentence, font, width), "",
             *_wrap(f"score {score:.4f} ({score_name}); a bar is the score minus the score "
                    f"without the word", font, width)]
    canvas, draw, (x, y) = _beside(picture, lines, len(words), font)
    values = [abs(value) for _, value in words if value is not None]
    largest = max(values, default=0.0) or 1.0
    half = (width - WORD_COLUMN - 70) / 2  # the bars' half width; the value text after them
    axis = x + WORD_COLUMN + half
    draw.line((axis, y, axis, y + len(words) * LINE_HEIGHT), fill=UNLINKED)
    for word, value in words:
        draw.text((x, y), word, fill="black" if value is not None else UNLINKED, font=font)
        if value is None:
            draw.text((x + WORD_COLUMN, y), "not in the vocabulary", fill=UNLINKED, font=font)
        else:
            end = axis + half * value / largest
            draw.rectangle((min(axis, end), y + 3, max(axis, end), y + FONT_SIZE),
                           fill=RAISES if value >= 0 else LOWERS)
            draw.text((axis + half + 6, y), f"{value:+.4f}", fill="black", font=font)
        y += LINE_HEIGHT
    return canvas


def _scaled(image: Image.Image) -> tuple[Image.Image, float]:
    """The image in 8-bit RGB (`defrag.images.to_rgb`, any mode) with its longer side
    IMAGE_SIDE, and the scale factor."""
    scale = IMAGE_SIDE / max(image.size)
    size = (round(image.width * scale), round(image.height * scale))
    return to_rgb(image).resize(size, Image.Resampling.BICUBIC), scale


def _beside(picture: Image.Image, lines: Sequence[str], rows: int,
            font: ImageFont.FreeTypeFont) -> tuple[Image.Image, ImageDraw.ImageDraw,
                                                   tuple[int, int]]:
    """A white canvas with `picture` on the left and a text column holding `lines`, a blank
    line and room for `rows` more lines: the canvas, its drawer and where the rows start."""
    panel_height = (len(lines) + rows + 1) * LINE_HEIGHT
    height = max(picture.height, panel_height) + 2 * MARGIN
    canvas = Image.new("RGB", (MARGIN + picture.width + PANEL_WIDTH, height), "white")
    canvas.paste(picture, (MARGIN, MARGIN))
    draw = ImageDraw.Draw(canvas)
    x, y = MARGIN + picture.width + MARGIN, MARGIN
    for line in lines:
        draw.text((x, y), line, fill="black", font=font)
        y += LINE_HEIGHT
    return canvas, draw, (x, y + LINE_HEIGHT)  # a blank line before the rows


def _tag(draw: ImageDraw.ImageDraw, corner: tuple[float, float], text: str,
         colour: tuple[int, int, int], font: ImageFont.FreeTypeFont) -> float:
    """A filled `colour` label with `text` at `corner`; returns its right edge."""
    left, top, right, bottom = draw.textbbox(corner, text, font=font)
    draw.rectangle((left - 3, top - 2, right + 3, bottom + 2), fill=colour)
    luminance = 0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2]
    draw.text(corner, text, fill="black" if luminance > 140 else "white", font=font)
    return right + 3


def _wrap(text: str, font: ImageFont.FreeTypeFont, width: float) -> list[str]:
    """Greedy word wrap of `text` into lines at most `width` pixels wide (long words overflow)."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines
