"""The model folder: a trained model as self-contained files, written atomically and opened once.

A model folder holds `weights.safetensors` (the state dict), `config.json` (the run's Config),
`vocab.json` (the Vocabulary), optionally `metrics.json` and `featurizer.json` (the training
shards' parser and box source), and `checksums.json` (sha256 and size of every other file).
Loading it never unpickles anything, and a folder that is incomplete, altered, padded with
unlisted files, linked to files outside it, or whose weights are not safetensors (a pickle, a
`torch.save` zip) is refused with a message naming the file.

An ensemble folder holds member model folders (member-0, ...) and `ensemble.json` (each member's
checksums.json sha256 and weight); its image-sentence score is the weighted sum of its members'
scores (by default their mean). A captioner folder holds `captioner.json` beside model folders
(its encoder): this module verifies its files and those model folders; the captioning part
(trainer/caption/captioner.py) checks what `captioner.json` records.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from defrag.files import (
    CHECKSUMS,
    replaced_atomically,
    sha256_file,
    verify_checksums,
    write_checksums,
)
from trainer.config import Config, ModelConfig

# torch and the model are imported inside the functions that save or build a model, so the
# registry's download and verify commands start in seconds.
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from defrag.vocab import Vocabulary
    from trainer.model import DeFragModel

MODEL_FORMAT = 1
MODEL_KIND, ENSEMBLE_KIND, CAPTIONER_KIND = "model", "ensemble", "captioner"  # ModelFolder.kind
ENSEMBLE = "ensemble.json"  # an ensemble folder: its members, whose scores are summed weighted
MEMBER = "member-{}"  # an ensemble's member folders, numbered from 0
CAPTIONER = "captioner.json"  # a captioner folder's record (trainer/caption/captioner.py)
CAPTIONER_ENCODER = "encoder"  # a captioner's one model subfolder, whose key the record holds
WEIGHTS, CONFIG, VOCAB, METRICS = "weights.safetensors", "config.json", "vocab.json", "metrics.json"
FEATURIZER = "featurizer.json"  # parser and box source of the training shards, when known
REQUIRED_FILES = (WEIGHTS, CONFIG, VOCAB)
WORD_VECTORS = "sentence.word_vectors"  # W_e in the state dict: its width is the word_dim
ADVICE = "download or export the model again"
NOT_SAFETENSORS = {  # first bytes -> what the file is
    b"PK\x03\x04": "a zip archive (torch.save's format, which unpickles)",
    b"\x80": "a pickle (plain, or torch.save's legacy format)",
    b"\x93NUMPY": "a NumPy array file", b"\x89HDF": "an HDF5 file", b"\x1f\x8b": "a gzip file"}


class ModelFolderError(ValueError):
    """A model folder that is missing, incomplete, altered or inconsistent."""


@dataclass(frozen=True, eq=False)
class ModelFolder:
    """A model folder verified once (`open`), answering what its callers ask of it: the config,
    vocabulary, model, training featurizer, checksums key, and an ensemble's weighted members."""

    path: Path
    checksums_key: str  # sha256 of its checksums.json: names these exact files
    kind: str  # MODEL_KIND, ENSEMBLE_KIND or CAPTIONER_KIND
    parts: dict[str, ModelFolder] = field(default_factory=dict)  # its model subfolders, verified
    member_weights: dict[str, float] = field(default_factory=dict)  # an ensemble's, by folder

    @classmethod
    def open(cls, path: str | Path) -> ModelFolder:
        """`path` verified whole (every file against its checksums, safetensors weights, no link
        out of it; an ensemble's or captioner's model subfolders too); else ModelFolderError."""
        path = Path(path)
        if not path.is_dir():
            raise ModelFolderError(f"{path}: no such model folder")
        if (path / ENSEMBLE).is_file():
            return cls._open_ensemble(path)
        if (path / CAPTIONER).is_file():
            return cls._open_captioner(path)
        listed = verify_checksums(path, ModelFolderError, "model folder", ADVICE,
                                  format=MODEL_FORMAT)["files"]
        for name in REQUIRED_FILES:
            if name not in listed:
                raise ModelFolderError(f"{path}: {CHECKSUMS} does not list {name}; {ADVICE}")
        what = _not_safetensors(path / WEIGHTS)
        if what:
            raise ModelFolderError(f"{path / WEIGHTS} is {what}; model weights are loaded from "
                                   "safetensors only, never unpickled: export the model again "
                                   "with trainer.store.model_folder.save_model_folder")
        return cls(path, _checksums_key(path), MODEL_KIND)

    @classmethod
    def _open_captioner(cls, path: Path) -> ModelFolder:
        """A captioner folder: its own files, then its one model subfolder, the encoder whose
        checksums key `captioner.json` records (the rest of the record: trainer/caption)."""
        verify_checksums(path, ModelFolderError, "model folder", ADVICE, subfolders=True,
                         format=MODEL_FORMAT)
        present = sorted(sub.name for sub in path.iterdir() if sub.is_dir())
        if present != [CAPTIONER_ENCODER]:
            raise ModelFolderError(f"{path} holds the folders {present}; a captioner holds only "
                                   f"{CAPTIONER_ENCODER}/; {ADVICE}")
        try:
            recorded = json.loads((path / CAPTIONER).read_text())["encoder_checksums_sha256"]
        except (ValueError, KeyError, TypeError) as err:
            raise ModelFolderError(f"{path / CAPTIONER} is malformed ({err!r}); {ADVICE}") from err
        encoder = cls.open(path / CAPTIONER_ENCODER)
        if encoder.checksums_key != recorded:
            raise ModelFolderError(f"{encoder.path} is not the encoder {CAPTIONER} records (other "
                                   f"checksums); {ADVICE}")
        return cls(path, _checksums_key(path), CAPTIONER_KIND, {CAPTIONER_ENCODER: encoder})

    @classmethod
    def _open_ensemble(cls, path: Path) -> ModelFolder:
        """An ensemble folder: its own files, then each member the one `ensemble.json` records
        (its checksums key), not an ensemble, verified; no folder that is not a member."""
        verify_checksums(path, ModelFolderError, "model folder", ADVICE, subfolders=True,
                         format=MODEL_FORMAT)
        try:
            entries = json.loads((path / ENSEMBLE).read_text())["members"]
            recorded = {entry["folder"]: entry["checksums_sha256"] for entry in entries}
            weights = {entry["folder"]: float(entry["weight"]) for entry in entries}
            if not all(weight > 0 for weight in weights.values()):
                raise ValueError("a weight is not positive")
        except (ValueError, KeyError, TypeError) as err:
            raise ModelFolderError(f"{path / ENSEMBLE} is malformed ({err!r}); {ADVICE}") from err
        present = {sub.name for sub in path.iterdir() if sub.is_dir()}
        if present != set(recorded) or any(Path(name).name != name for name in recorded):
            raise ModelFolderError(f"{path} holds the folders {sorted(present)} but {ENSEMBLE} "
                                   f"lists the members {sorted(recorded)}; {ADVICE}")
        parts = {}
        for name, key in recorded.items():
            if (path / name / ENSEMBLE).is_file():
                raise ModelFolderError(f"{path / name}: an ensemble member is an ensemble; "
                                       f"{ADVICE}")
            parts[name] = cls.open(path / name)
            if parts[name].checksums_key != key:
                raise ModelFolderError(f"{path / name} is not the member {ENSEMBLE} records "
                                       f"(other checksums); {ADVICE}")
        return cls(path, _checksums_key(path), ENSEMBLE_KIND, parts, weights)

    @property
    def is_ensemble(self) -> bool:
        return self.kind == ENSEMBLE_KIND

    @property
    def is_captioner(self) -> bool:
        return self.kind == CAPTIONER_KIND

    @property
    def members(self) -> list[tuple[ModelFolder, float]]:
        """Each model folder with its weight in the score: an ensemble's members, else this
        folder with weight 1."""
        if self.is_ensemble:
            return [(self.parts[name], weight) for name, weight in self.member_weights.items()]
        return [(self, 1.0)]

    @property
    def config(self) -> Config:
        """The training run's Config (a new one each time: a caller may change it)."""
        self._one_model()
        try:
            return Config.from_dict(json.loads((self.path / CONFIG).read_text()))
        except ValueError as err:
            raise ModelFolderError(f"{self.path / CONFIG}: not a valid config ({err})") from err

    @functools.cached_property
    def vocab(self) -> Vocabulary:
        from defrag.vocab import Vocabulary

        self._one_model()
        return Vocabulary.load(self.path / VOCAB)

    @functools.cached_property
    def featurizer(self) -> dict[str, Any] | None:
        """The parser and box source of the training shards (`featurizer.json`), when saved."""
        saved = self.path / FEATURIZER
        if self.kind != MODEL_KIND or not saved.is_file():
            return None
        return json.loads(saved.read_text())

    def load_model(self) -> DeFragModel:
        """A new model (eval mode) with the saved weights: no pretrained weights or word-vector
        files are needed, nothing is unpickled."""
        from safetensors.torch import load_file

        from trainer.model import DeFragModel

        config = self.config
        state = load_file(self.path / WEIGHTS)  # tensors only: nothing is unpickled or executed
        model = DeFragModel.from_config(_standalone(config.model, state), self.vocab)
        expected = model.state_dict()
        missing = sorted(expected.keys() - state.keys())
        unexpected = sorted(state.keys() - expected.keys())
        reshaped = sorted(k for k in expected.keys() & state.keys()
                          if expected[k].shape != state[k].shape)
        if missing or unexpected or reshaped:
            raise ModelFolderError(f"{self.path / WEIGHTS} does not fit {CONFIG} and {VOCAB}: "
                                   f"missing tensors {missing}, unexpected {unexpected}, other "
                                   f"shapes {reshaped}")
        model.load_state_dict(state)
        return model.eval()

    def _one_model(self) -> None:
        """ModelFolderError unless this is one retrieval model (not an ensemble, a captioner)."""
        if self.is_ensemble:
            raise ModelFolderError(f"{self.path} is an ensemble of {len(self.parts)} models, not "
                                   "one: load each of its members")
        if self.is_captioner:
            encoders = ", ".join(str(part.path) for part in self.parts.values())
            raise ModelFolderError(f"{self.path} is a captioner (defrag caption); its retrieval "
                                   f"model is {encoders}")


def _checksums_key(path: Path) -> str:
    """The sha256 of a folder's checksums.json: it names every file of the folder."""
    return sha256_file(path / CHECKSUMS)


def _not_safetensors(path: Path) -> str | None:
    """What a file is, sniffed from its first bytes, when it is not safetensors; else None."""
    with path.open("rb") as stream:
        head = stream.read(9)
    for magic, what in NOT_SAFETENSORS.items():
        if head.startswith(magic):
            return f"{what}, not safetensors"
    header_size = int.from_bytes(head[:8], "little")
    if head[8:] != b"{" or header_size > path.stat().st_size - 8:
        return f"not a safetensors file (it starts with {head!r}, not a safetensors header)"
    return None


def _standalone(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> ModelConfig:
    """`cfg` without external files (ImageNet weights, word vectors) and with the saved W_e's
    width (a word-vector file may have overridden `word_dim` in training)."""
    word_vectors = state.get(WORD_VECTORS)
    word_dim = cfg.word_dim if word_vectors is None else word_vectors.shape[1]
    return dataclasses.replace(cfg, pretrained=False, backbone_weights=None, word_vectors=None,
                               word_dim=word_dim)


# ---------------------------------------------------------------- writing


def save_model_folder(folder: str | Path, model: torch.nn.Module, config: Config,
                      vocab: Vocabulary, metrics: dict[str, Any] | None = None,
                      featurizer: dict[str, Any] | None = None) -> Path:
    """Write the model folder atomically (`write_folder`). `featurizer`: the training shards'
    parser and box source (trainer.data.shardset.training_featurizer), when known."""
    from safetensors.torch import save_file

    def fill(staging: Path) -> None:
        # Copies: safetensors refuses tensors that share storage (tied or viewed weights).
        state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, staging / WEIGHTS, metadata={"format": str(MODEL_FORMAT)})
        config.to_json(staging / CONFIG)
        vocab.save(staging / VOCAB)
        if metrics is not None:
            (staging / METRICS).write_text(json.dumps(metrics, indent=2, sort_keys=True))
        if featurizer is not None:  # so that new inputs are parsed and boxed alike anywhere
            (staging / FEATURIZER).write_text(json.dumps(featurizer, indent=2, sort_keys=True))

    return write_folder(Path(folder), fill)


def save_ensemble(folder: str | Path, members: Sequence[str | Path],
                  weights: Sequence[float] | None = None,
                  metrics: dict[str, Any] | None = None) -> Path:
    """Write an ensemble folder: a copy of each member model folder (member-0, member-1, ...),
    `ensemble.json` naming them with their checksums and weights, `checksums.json`. Its
    image-sentence score is the weighted sum of its members' (by default their mean, as m-CNN
    and SCAN ensemble). Members with different `objective.score`s (e.g. cosine and eq. 6) have
    different scales: they need `weights`, chosen on a dev split."""
    if len(members) < 2:
        raise ModelFolderError(f"an ensemble needs 2 or more member model folders: got "
                               f"{len(members)}")
    opened = [ModelFolder.open(member) for member in members]
    for member in opened:
        if member.is_ensemble:
            raise ModelFolderError(f"{member.path} is an ensemble itself: list its members "
                                   "instead")
    scores = {str(member.path): member.config.objective.score for member in opened}
    if weights is None and len(set(scores.values())) > 1:
        raise ModelFolderError(f"the members score differently ({scores}): their scales differ, "
                               "so a plain mean is meaningless; give each a weight (chosen on "
                               "dev), or choose members with one objective.score")
    weights = [1 / len(members)] * len(members) if weights is None else list(weights)
    if len(weights) != len(members) or not all(w > 0 for w in weights):
        raise ModelFolderError(f"ensemble weights {weights}: expected one positive weight per "
                               f"member ({len(members)})")

    def fill(staging: Path) -> None:
        entries = []
        for number, (member, weight) in enumerate(zip(opened, weights, strict=True)):
            name = MEMBER.format(number)
            shutil.copytree(member.path, staging / name)
            entries.append({"folder": name, "source": str(member.path), "weight": weight,
                            "checksums_sha256": member.checksums_key})
        (staging / ENSEMBLE).write_text(json.dumps(
            {"combine": "weighted sum of the members' image-sentence scores",
             "members": entries}, indent=2))
        if metrics is not None:
            (staging / METRICS).write_text(json.dumps(metrics, indent=2, sort_keys=True))

    return write_folder(Path(folder), fill)


def write_folder(folder: Path, fill: Callable[[Path], None]) -> Path:
    """Build a model folder beside `folder` with `fill`, add its checksums, then rename it over
    `folder` (`replaced_atomically`): a reader never sees a part."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(folder) as staging:
        staging.mkdir()
        fill(staging)
        write_checksums(staging, format=MODEL_FORMAT)
    return folder
