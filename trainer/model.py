"""The image fragment encoder of DeFrag (paper Section 3.2) and the model that holds it with a
sentence encoder of trainer/encoders (`model.sentence_encoder`).

Image fragments are boxes embedded by eq. 2, `v = W_m CNN(I_b) + b_m`; the sentence side is
DeFrag's fragments (eq. 1, the default) or a whole-sentence encoder (Kiros et al.'s LSTM or
linear map). Both land in one `embed_dim`-sized space where the objectives
(trainer/objectives.py) score them (`objective.score`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torchvision
from torch import nn

from defrag.backbones import Backbone, build_backbone
from defrag.vocab import Vocabulary
from trainer.config import ModelConfig
from trainer.encoders import encoder_class
from trainer.encoders.base import SentenceEncoderBase, mean_by_owner
from trainer.encoders.fragments import SentenceEncoder
from trainer.wordvecs import embedding_matrix

__all__ = ["DeFragModel", "ImageEncoder", "SentenceEncoder", "mean_by_owner"]

REGION_MODES = ("roi", "crop")
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def cnn_batch_size(rows: int) -> int:
    """`rows` rounded up to three significant bits (at most 12.5% more): the batch sizes a CNN
    pass is padded to on CUDA. cuDNN prepares its kernels for every new input shape, and the
    number of images (or crops) per step varies: on an H200 each new size cost 4-5 s in
    EfficientNet-Lite0's forward + backward, against 12-22 ms once prepared
    (benchmarks/README.md, "GPU checks")."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


@torch.no_grad()
def roi_cell_weights(boxes: torch.Tensor, height: int, width: int, output_size: int,
                     spatial_scale: float) -> torch.Tensor:
    """[Nv, height * width]: how much each cell of a feature map weighs in the mean of a box's
    RoIAlign grid. RoIAlign is linear in the map, so it is torchvision's RoIAlign of every box
    on one map whose channel c is the one-hot map of cell c, averaged over the grid."""
    cells = torch.eye(height * width, dtype=torch.float32, device=boxes.device)
    rois = torch.cat([boxes.new_zeros(len(boxes), 1), boxes], dim=1).float()
    grid = torchvision.ops.roi_align(cells.view(1, -1, height, width), rois, output_size,
                                     spatial_scale=spatial_scale, aligned=True)
    return grid.mean((2, 3))


def pooled_roi_align(fmap: torch.Tensor, boxes: torch.Tensor, box_image: torch.Tensor,
                     output_size: int, spatial_scale: float) -> torch.Tensor:
    """The mean of each box's RoIAlign grid on its image's map [Nv, C] (RoIAlign, then average
    pooling), as one weighted sum of the map's cells per box: a batched matrix product, forward
    and backward (torchvision's CPU RoIAlign backward scatters sample by sample on one core:
    2.1 s of a 3.4 s step at 448 px, benchmarks/README.md)."""
    num_images, channels, height, width = fmap.shape
    weights = roi_cell_weights(boxes, height, width, output_size, spatial_scale)
    # each box's slot among its image's boxes, for one [images, slots, cells] weight tensor
    order = torch.argsort(box_image, stable=True)
    counts = torch.bincount(box_image, minlength=num_images)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(box_image)
    slot[order] = torch.arange(len(box_image), device=box_image.device) - starts[box_image[order]]
    padded = weights.new_zeros(num_images, int(counts.max()) if len(counts) else 0,
                               height * width)
    padded[box_image, slot] = weights
    cells = fmap.flatten(2).transpose(1, 2)  # [images, cells, C]
    pooled = torch.bmm(padded.to(cells.dtype), cells)  # [images, slots, C]
    return pooled[box_image, slot]


class ImageEncoder(nn.Module):
    """Eq. 2: a CNN over each box, then the linear map W_m into the fragment space.

    The CNN runs in two parts, `trunk` (its lower blocks) then `top_features` (its top
    `finetune_blocks` blocks, RoIAlign or pooling): with the lower blocks fixed, a trainer caches
    the trunk's maps and finetunes only the top (phase 2 of the paper, Section 3.4)."""

    def __init__(self, backbone: Backbone, embed_dim: int, region_mode: str = "roi",
                 crop_size: int = 224, roi_output_size: int = 7,
                 freeze_batchnorm: bool = True, mean_pool: bool = False,
                 finetune_blocks: int | None = None) -> None:
        super().__init__()
        if region_mode not in REGION_MODES:
            raise ValueError(f"region mode {region_mode!r}: expected one of {REGION_MODES}")
        # Channels-last weights, as the images arrive (trainer/batch.py): a convolution's weight
        # gradient then has its weight's layout (DDP's gradient layout contract; otherwise DDP
        # warns "Grad strides do not match" and copies), and oneDNN and cuDNN take their faster
        # NHWC kernels (a finetuning step ~25% faster on CPU than channels-first).
        self.backbone = backbone.to(memory_format=torch.channels_last)
        self.region_mode = region_mode
        self.crop_size = crop_size
        self.roi_output_size = roi_output_size
        self.freeze_batchnorm = freeze_batchnorm
        self.mean_pool = mean_pool
        self.finetune_blocks = finetune_blocks
        # (lower, top) share the backbone's layers; a tuple is not registered, so the state dict
        # keeps the backbone's names
        self.parts = self.backbone.split(finetune_blocks)
        self.pad_batches: bool | None = None  # pad CNN passes to cnn_batch_size; None: on CUDA
        self.cnn_trainable = True
        # The ImageNet classifier is not part of eq. 2: never trained (DDP would wait for its
        # gradients forever).
        backbone.classifier.requires_grad_(False)
        self.projection = nn.Linear(backbone.feature_dim, embed_dim)  # W_m, b_m
        # LeCun init (no nonlinearity follows): v keeps the CNN features' per-dimension scale.
        nn.init.normal_(self.projection.weight, std=backbone.feature_dim ** -0.5)
        nn.init.zeros_(self.projection.bias)
        self.set_cnn_trainable(True)

    def forward(self, images: torch.Tensor, boxes: torch.Tensor,
                box_image: torch.Tensor) -> torch.Tensor:
        """Image fragments v [Nv, embed_dim] of the boxes (see `region_features`)."""
        return self.project(self.region_features(images, boxes, box_image), box_image)

    def region_features(self, images: torch.Tensor, boxes: torch.Tensor,
                        box_image: torch.Tensor) -> torch.Tensor:
        """CNN(I_b) [Nv, feature_dim] for boxes [Nv, 4] (xyxy pixels) of images [B, 3, H, W].

        `box_image` [Nv] is the batch index of each box's image; pixels are floats in [0, 1].
        Split from `project` so a trainer can cache the features of a frozen CNN.
        """
        return self.top_features(self.trunk(images, boxes, box_image), boxes, box_image)

    def trunk(self, images: torch.Tensor, boxes: torch.Tensor,
              box_image: torch.Tensor) -> torch.Tensor:
        """The lower blocks' maps: one per image in `roi` mode [B, C, h, w], one per box in
        `crop` mode [Nv, C, h, w] (the normalised pixels when every block is finetuned)."""
        if boxes.shape[0] != box_image.shape[0]:
            raise ValueError(f"{boxes.shape[0]} boxes but {box_image.shape[0]} box_image rows")
        pixels = self.backbone.normalize(images)
        if self.region_mode == "crop":
            # the paper: every box warped to crop_size x crop_size pixels, one CNN pass each
            pixels = torchvision.ops.roi_align(pixels, self._rois(boxes, box_image),
                                               output_size=self.crop_size, aligned=True)
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return self._cnn(self.parts[0], pixels)

    def top_features(self, maps: torch.Tensor, boxes: torch.Tensor,
                     box_image: torch.Tensor) -> torch.Tensor:
        """CNN(I_b) [Nv, feature_dim] from the `trunk`'s maps (e.g. cached, fp16): the top
        blocks, then RoIAlign of each box on its image's feature map (`roi`, one CNN pass per
        image: ~20x cheaper than crops) or each crop's pooled map (`crop`)."""
        maps = maps.to(self.projection.weight.dtype).contiguous(memory_format=torch.channels_last)
        fmap = self._cnn(self.parts[1], maps)
        if self.region_mode == "roi":  # RoIAlign, then the backbone's average pooling
            return pooled_roi_align(fmap, boxes, box_image, self.roi_output_size,
                                    1.0 / self.backbone.stride)
        return self.backbone.pool(fmap)

    @staticmethod
    def _rois(boxes: torch.Tensor, box_image: torch.Tensor) -> torch.Tensor:
        """torchvision's RoI rows [Nv, 5]: (batch index, x1, y1, x2, y2)."""
        return torch.cat([box_image.to(boxes.dtype).unsqueeze(1), boxes], dim=1)

    def _cnn(self, layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        """`layers` (a part of the CNN) on `x`, passed padded with zero rows to
        `cnn_batch_size` rows where `pad_batches` says so (never while a BatchNorm layer uses
        batch statistics, which the padding would change)."""
        rows = len(x)
        pad = cnn_batch_size(rows) - rows
        wanted = x.is_cuda if self.pad_batches is None else self.pad_batches
        if (not len(layers) or not wanted or pad == 0
                or any(module.training for module in self._batchnorms())):
            return layers(x)
        padded = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return layers(padded.contiguous(memory_format=torch.channels_last))[:rows]

    def project(self, features: torch.Tensor, box_image: torch.Tensor) -> torch.Tensor:
        """W_m features + b_m (eq. 2): CNN features [Nv, feature_dim] -> [Nv, embed_dim].

        With `mean_pool`, every box of an image gets the image's mean (W_m is affine: the
        projection of its mean region feature)."""
        v = self.projection(features)
        return mean_by_owner(v, box_image) if self.mean_pool else v

    def set_cnn_trainable(self, flag: bool) -> None:
        """Train (phase 2) or fix (phase 1) the CNN's top blocks; the blocks below them stay
        fixed either way.

        Frozen BatchNorm affine parameters stay fixed either way, and a fixed CNN (or lower
        part) also keeps its BatchNorm statistics, so its output is a pure function of the
        pixels (cacheable).
        """
        self.cnn_trainable = flag
        self.backbone.features.requires_grad_(False)
        for parameter in self.cnn_parameters():
            parameter.requires_grad_(flag)
        self.train(self.training)

    def train(self, mode: bool = True) -> ImageEncoder:
        """nn.Module.train, except fixed BatchNorm layers stay in eval mode (running stats)."""
        super().train(mode)
        fixed = self._batchnorms() if self.freeze_batchnorm or not self.cnn_trainable else (
            m for m in self.parts[0].modules() if isinstance(m, BATCHNORMS))
        for module in fixed:
            module.eval()
        return self

    def cnn_parameters(self) -> list[nn.Parameter]:
        """The top blocks' parameters that can ever train (all but frozen BatchNorm affine
        ones).

        Independent of the current `set_cnn_trainable` state, so one optimizer built at the start
        covers both phases.
        """
        frozen = set()
        if self.freeze_batchnorm:
            frozen = {id(p) for module in self._batchnorms() for p in module.parameters()}
        return [p for p in self.parts[1].parameters() if id(p) not in frozen]

    def _batchnorms(self) -> Iterator[nn.Module]:
        return (m for m in self.backbone.modules() if isinstance(m, BATCHNORMS))


class DeFragModel(nn.Module):
    """A sentence encoder (trainer/encoders) and the image encoder (eq. 2) into one space."""

    def __init__(self, sentence: SentenceEncoderBase, image: ImageEncoder) -> None:
        super().__init__()
        if sentence.embed_dim != image.projection.out_features:
            raise ValueError(f"sentence embed_dim {sentence.embed_dim} != image embed_dim "
                             f"{image.projection.out_features}")
        self.sentence = sentence
        self.image = image

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab: Vocabulary, seed: int = 0) -> DeFragModel:
        """Build the model of `cfg` for `vocab`; `seed` fixes every random initialisation."""
        word_vectors = embedding_matrix(vocab.words, cfg.word_vectors, cfg.word_dim, seed=seed)
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            torch.manual_seed(seed)
            backbone = build_backbone(cfg.backbone, cfg.pretrained, cfg.backbone_weights)
            sentence = encoder_class(cfg.sentence_encoder).from_config(cfg, vocab, word_vectors)
            image = ImageEncoder(backbone, cfg.embed_dim, cfg.region_mode, cfg.crop_size,
                                 cfg.roi_output_size, cfg.freeze_batchnorm, cfg.mean_pool,
                                 cfg.finetune_blocks)
        return cls(sentence, image)

    def forward(self, images: torch.Tensor | None, boxes: torch.Tensor, box_image: torch.Tensor,
                *sentence_inputs: torch.Tensor, features: torch.Tensor | None = None,
                maps: torch.Tensor | None = None,
                num_sentences: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Image fragments v [Nv, embed_dim] (eq. 2) and sentence rows s [Ns, embed_dim]: the
        sentence encoder of `sentence_inputs` (its `inputs` fields of the Batch) for
        `num_sentences` sentences; see ImageEncoder.region_features for the image inputs.
        Given `features` (the boxes' CNN features, e.g. cached from a frozen CNN), the CNN is
        skipped; given `maps` (the trunk's, e.g. cached), only its top blocks run. Either way
        `images` may be None (a feature-only batch, trainer/batch.py)."""
        if maps is not None:
            features = self.image.top_features(maps, boxes, box_image)
        elif features is None:
            features = self.image.region_features(images, boxes, box_image)
        s = self.sentence(*sentence_inputs, num_sentences=num_sentences)
        return self.image.project(features, box_image), s

    def cnn_parameters(self) -> list[nn.Parameter]:
        """The CNN's parameters (its own optimizer group: lr scale, phase-2 finetuning)."""
        return self.image.cnn_parameters()

    def head_parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter outside the CNN: the sentence encoder's (W_e if trained),
        W_m, b_m."""
        cnn = {id(p) for p in self.image.backbone.parameters()}
        return [p for p in self.parameters() if p.requires_grad and id(p) not in cnn]
