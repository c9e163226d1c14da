"""Box sources: the row-0-is-the-image contract, NMS, clipping, detector loading and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image, ImageDraw
from torchvision.ops import box_iou

from featurizer.boxes import BoxSource, make_box_source

DETECTOR = "fasterrcnn_mobilenet_v3_large_320_fpn"  # the smallest Faster R-CNN: fast on CPU


def _scene(width: int = 160, height: int = 120, shift: int = 0) -> Image.Image:
    """A non-square image with three coloured shapes (catches width/height mix-ups)."""
    image = Image.new("RGB", (width, height), (200, 205, 190))
    draw = ImageDraw.Draw(image)
    draw.ellipse((10 + shift, 15, 60 + shift, 65), fill=(220, 30, 30))
    draw.rectangle((90, 20, 140, 50), fill=(30, 70, 220))
    draw.polygon([(70, 70), (110, 115), (30, 115)], fill=(30, 160, 50))
    return image


def _check_contract(boxes: list[list[float]], scores: list[float], image: Image.Image,
                    max_boxes: int, nms_iou: float | None = None) -> None:
    width, height = image.size
    assert boxes[0] == [0.0, 0.0, float(width), float(height)] and scores[0] == 1.0
    assert len(boxes) == len(scores) <= max_boxes + 1
    assert scores[1:] == sorted(scores[1:], reverse=True)
    for x1, y1, x2, y2 in boxes:
        assert 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height
    if nms_iou is not None and len(boxes) > 2:
        iou = box_iou(torch.tensor(boxes[1:]), torch.tensor(boxes[1:]))
        assert (iou.triu(diagonal=1) <= nms_iou + 1e-6).all()
    json.dumps([boxes, scores])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as in each featurizer worker: 4x faster on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def selective_search():
    return make_box_source("selective_search", max_boxes=6)


def test_selective_search_contract_and_nms(selective_search) -> None:
    for image in (_scene(), _scene(96, 128, shift=5)):
        boxes, scores = selective_search(image)
        assert len(boxes) >= 3  # the image, then proposals (the shapes at least)
        assert all(0 < s <= 1 for s in scores)
        _check_contract(boxes, scores, image, max_boxes=6, nms_iou=0.3)


def test_selective_search_finds_the_shapes() -> None:
    """With room for 19 boxes, every drawn shape is covered by some box at IoU >= 0.5."""
    boxes, _ = make_box_source("selective_search")(_scene())
    shapes = torch.tensor([[10, 15, 61, 66], [90, 20, 141, 51], [30, 70, 111, 116]],
                          dtype=torch.float)
    assert (box_iou(shapes, torch.tensor(boxes[1:])).amax(dim=1) >= 0.5).all()


def test_a_thin_image_is_scored_at_a_bounded_size(selective_search) -> None:
    """A strip's map is bounded (a 1 x 300 px image is not scored at 448 x 134,400 px); an
    ordinary image's shorter side is `score_size`."""
    assert selective_search.score_shape(400, 300) == (448, 597)
    assert selective_search.score_shape(1, 300) == (1792, 6)
    strip = Image.new("RGB", (12, 120), (200, 30, 30))
    strip.paste((20, 20, 200), (0, 40, 12, 80))
    boxes, scores = selective_search(strip)
    _check_contract(boxes, scores, strip, max_boxes=6, nms_iou=0.3)


def test_selective_search_is_deterministic(selective_search) -> None:
    image = _scene()
    first = selective_search(image)
    assert selective_search(image) == first
    assert selective_search(image.copy()) == first


def test_crop_scoring_keeps_the_contract() -> None:
    source = make_box_source("selective_search", scoring="crop", crop_size=64, max_proposals=12,
                             max_boxes=4, nms_iou=0.5)
    image = _scene()
    boxes, scores = source(image)
    _check_contract(boxes, scores, image, max_boxes=4, nms_iou=0.5)
    assert source.describe()["options"]["scoring"] == "crop"


def test_given_boxes_are_clipped_and_kept_in_order() -> None:
    image = _scene()  # 160 x 120
    source = make_box_source("given", max_boxes=3)
    given = [[-10, 5, 50, 300], [100, 10, 100, 40], [0, 0, 160, 120], [20, 30, 40.5, 50],
             [1, 2, 3, 4], [5, 6, 7, 8]]
    boxes, scores = source(image, given)
    # the empty box and the copy of the whole image are dropped; the rest keep record order
    assert boxes == [[0, 0, 160, 120], [0, 5, 50, 120], [20, 30, 40.5, 50], [1, 2, 3, 4]]
    assert scores == [1.0] * 4
    assert source(image, None) == ([[0.0, 0.0, 160.0, 120.0]], [1.0])
    with pytest.raises(ValueError, match="x1, y1, x2, y2"):
        source(image, [[1, 2, 3]])


def test_fullframe_is_the_whole_image_only() -> None:
    image = _scene(200, 100)
    source = make_box_source("fullframe")
    assert source(image, [[1, 2, 30, 40]]) == ([[0.0, 0.0, 200.0, 100.0]], [1.0])
    assert source(image) == BoxSource.__call__(source, image)  # its shortcut: select_boxes' rows
    assert source.describe()["name"] == "fullframe"


@pytest.fixture(scope="module")
def random_detector_state() -> dict[str, torch.Tensor]:
    """Randomly initialised weights: only to test loading and the output contract."""
    torch.manual_seed(0)
    net = torchvision.models.get_model(DETECTOR, weights=None, weights_backbone=None)
    return net.state_dict()


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_detector_loads_weights_from_a_file(tmp_path: Path, random_detector_state,
                                            suffix: str) -> None:
    path = tmp_path / f"detector{suffix}"
    if suffix == ".pth":
        torch.save(random_detector_state, path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in random_detector_state.items()}, str(path))
    source = make_box_source("detector", model=DETECTOR, weights=str(path), score_thresh=0.0,
                             max_boxes=5)
    image = _scene()
    boxes, scores = source(image)
    _check_contract(boxes, scores, image, max_boxes=5)
    assert source(image) == (boxes, scores)
    description = source.describe()
    assert description["options"]["weights"] == str(path)
    assert description["options"]["model"] == DETECTOR
    json.dumps(description)


def test_detector_without_weights_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs weights"):
        make_box_source("detector", model=DETECTOR)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_box_source("detector", model=DETECTOR, weights="/nonexistent/detector.pth")
    with pytest.raises(ValueError, match="not a torchvision Faster R-CNN"):
        make_box_source("detector", model="resnet50", weights="x.pth")


def test_detector_hub_weights_offline_say_what_to_do(monkeypatch) -> None:
    def offline(*args, **kwargs):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.models, "get_model", offline)
    with pytest.raises(RuntimeError, match="weights=PATH"):
        make_box_source("detector", model=DETECTOR, weights="DEFAULT")


def test_unknown_source_or_option_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown box source"):
        make_box_source("edge_boxes")
    with pytest.raises(ValueError, match="nms_threshold"):
        make_box_source("selective_search", nms_threshold=0.5)
