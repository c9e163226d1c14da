"""The registered model: a self-contained folder, its registration in MLflow, and its download.

A model folder holds `weights.safetensors` (the state dict), `config.json` (the run's Config),
`vocab.json` (the Vocabulary), optionally `metrics.json`, and `checksums.json` (sha256 and size of
every other file). Loading it never unpickles anything, and a folder that is incomplete, altered,
padded with unlisted files, linked to files outside it, or whose weights are not safetensors (a
pickle, a `torch.save` zip) is refused with a message naming the file.

    defrag registry download models:/defrag@champion --dst DIR [--tracking-uri URI]
    defrag registry verify DIR
    defrag registry register DIR --run-id ID --tracking-uri URI [--name N --alias A]
    defrag registry ensemble DIR DIR... --out DIR [--weights W W...] [--name N ...]

An ensemble folder holds member model folders (member-0, ...) and `ensemble.json` (each member's
checksums.json sha256 and weight); its image-sentence score is the weighted sum of its members'
scores (by default their mean). A captioner folder (trainer/caption/captioner.py) holds its
encoder's model folder (`encoder/`) beside `captioner.json` and the language model's files.

A registered version is an MLflow pyfunc model built from code (trainer/search/pyfunc_model.py,
nothing pickled): `MLmodel`, the code file and the environment files, with the model folder as its
artifact `model` (in `artifacts/<folder name>/`, as MLmodel records). So
`mlflow.pyfunc.load_model("models:/defrag@champion")` and `mlflow models serve -m
models:/defrag@champion --env-manager local` work, while `download` still gives the plain model
folder that `--model DIR` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shlex
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow.artifacts
import mlflow.pyfunc
import pandas as pd
from mlflow import MlflowClient
from mlflow.environment_variables import MLFLOW_TRACKING_URI
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

from defrag.cli import add_debug_flag, one_line_errors
from defrag.files import CHECKSUMS, verify_checksums, write_checksums
from defrag.images import MAX_IMAGE_PIXELS
from trainer.config import Config, ModelConfig
from trainer.store.tracking import RegistrationFailed, Tracker, connect, experiment_id

# torch and the model are imported inside the functions that save or build a model, so the
# download and verify commands start in seconds.
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from defrag.vocab import Vocabulary
    from trainer.model import DeFragModel

MODEL_FORMAT = 1
ENSEMBLE = "ensemble.json"  # an ensemble folder: its members, whose scores are summed weighted
CAPTIONER, CAPTIONER_ENCODER = "captioner.json", "encoder"  # a captioner folder's record, encoder
ENSEMBLE_EXPERIMENT = "defrag-ensembles"  # the MLflow experiment whose runs register ensembles
WEIGHTS, CONFIG, VOCAB, METRICS = "weights.safetensors", "config.json", "vocab.json", "metrics.json"
FEATURIZER = "featurizer.json"  # parser and box source of the training shards, when known
REQUIRED_FILES = (WEIGHTS, CONFIG, VOCAB)
WORD_VECTORS = "sentence.word_vectors"  # W_e in the state dict: its width is the word_dim
NOT_SAFETENSORS = {  # first bytes -> what the file is
    b"PK\x03\x04": "a zip archive (torch.save's format, which unpickles)",
    b"\x80": "a pickle (plain, or torch.save's legacy format)",
    b"\x93NUMPY": "a NumPy array file", b"\x89HDF": "an HDF5 file", b"\x1f\x8b": "a gzip file"}
MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))")
MLMODEL = "MLmodel"  # an MLflow model directory's description
PYFUNC_ARTIFACT = "model"  # the model folder's name among the pyfunc's artifacts
PACKAGE = "defrag-trainer"  # this code's distribution: the pyfunc's pip requirement
# the pyfunc's code (MLflow's models from code)
PYFUNC_CODE = Path(__file__).parents[1] / "search" / "pyfunc_model.py"
DEFAULT_K = 10  # results of a pyfunc search without params k
PYFUNC_CONFIG = {"index_root": "", "indexes": {}, "cached_indexes": 2,  # the model_config keys
                 "max_image_pixels": MAX_IMAGE_PIXELS}
# its operator may set at load or serve time (MLflow takes no others):
# trainer/search/served_indexes.py
SIGNATURE = ModelSignature(  # the params let `mlflow models serve` requests choose an index
    inputs=Schema([ColSpec("string", "sentence", required=False),
                   ColSpec("string", "image", required=False)]),
    params=ParamSchema([ParamSpec("index", "string", None), ParamSpec("k", "long", DEFAULT_K)]))
INPUT_EXAMPLE = pd.DataFrame({"sentence": ["a brown dog runs on the grass"]})  # MLflow shows it


class ModelFolderError(ValueError):
    """A model folder that is missing, incomplete, altered or inconsistent."""


# ---------------------------------------------------------------- the folder


def save_model_folder(folder: str | Path, model: torch.nn.Module, config: Config,
                      vocab: Vocabulary, metrics: dict[str, Any] | None = None,
                      featurizer: dict[str, Any] | None = None) -> Path:
    """Write the model folder atomically: built beside `folder`, then renamed over it.
    `featurizer`: the training shards' parser and box source (default: read from their
    manifest)."""
    from safetensors.torch import save_file

    def fill(staging: Path) -> None:
        # Copies: safetensors refuses tensors that share storage (tied or viewed weights).
        state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, staging / WEIGHTS, metadata={"format": str(MODEL_FORMAT)})
        config.to_json(staging / CONFIG)
        vocab.save(staging / VOCAB)
        if metrics is not None:
            (staging / METRICS).write_text(json.dumps(metrics, indent=2, sort_keys=True))
        found = featurizer or training_featurizer(config)
        if found is not None:  # so that new inputs are parsed and boxed alike anywhere
            (staging / FEATURIZER).write_text(json.dumps(found, indent=2, sort_keys=True))

    return write_folder(Path(folder), fill)


def save_ensemble(folder: str | Path, members: Sequence[str | Path],
                  weights: Sequence[float] | None = None,
                  metrics: dict[str, Any] | None = None) -> Path:
    """Write an ensemble folder: a copy of each member model folder (member-0, member-1, ...),
    `ensemble.json` naming them with their checksums and weights, `checksums.json`. Its
    image-sentence score is the weighted sum of its members' (by default their mean, as m-CNN
    and SCAN ensemble). Members with different `objective.score`s (e.g. cosine and eq. 6) have
    different scales: they need `weights`, chosen on a dev split."""
    members = [Path(member) for member in members]
    if len(members) < 2:
        raise ModelFolderError(f"an ensemble needs 2 or more member model folders: got "
                               f"{len(members)}")
    scores = {}
    for member in members:
        verify_model_folder(member)
        if is_ensemble(member):
            raise ModelFolderError(f"{member} is an ensemble itself: list its members instead")
        scores[str(member)] = json.loads((member / CONFIG).read_text())["objective"]["score"]
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
        for number, (member, weight) in enumerate(zip(members, weights, strict=True)):
            name = f"member-{number}"
            shutil.copytree(member, staging / name)
            entries.append({"folder": name, "source": str(member), "weight": weight,
                            "checksums_sha256": _sha256(member / CHECKSUMS)})
        (staging / ENSEMBLE).write_text(json.dumps(
            {"combine": "weighted sum of the members' image-sentence scores",
             "members": entries}, indent=2))
        if metrics is not None:
            (staging / METRICS).write_text(json.dumps(metrics, indent=2, sort_keys=True))

    return write_folder(Path(folder), fill)


def write_folder(folder: Path, fill: Callable[[Path], None]) -> Path:
    """Build a model folder beside `folder` with `fill`, add its checksums, then rename it over
    `folder`: a reader never sees a part."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        fill(staging)
        write_checksums(staging, format=MODEL_FORMAT)
        if folder.exists():  # replace an older model: move it aside, move the new one in
            retired = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
            folder.rename(retired)
            staging.rename(folder)
            shutil.rmtree(retired)
        else:
            staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def training_featurizer(config: Config) -> dict[str, Any] | None:
    """The parser and box source of the shards a model was trained on, from their manifest
    (None when the manifest is not on this machine)."""
    from defrag.urls import ShardError
    from trainer.data.shardset import training_manifest

    if config.data.shards is None:
        return None
    try:
        manifest = training_manifest(config.data)
    except (ShardError, ValueError):
        return None
    return {key: manifest[key] for key in ("parser", "box_source") if key in manifest}


def is_captioner(folder: str | Path) -> bool:
    """Whether `folder` is a captioner folder (trainer/caption/captioner.py): an encoder and a
    language model, not a retrieval model."""
    return (Path(folder) / CAPTIONER).is_file()


def is_ensemble(folder: str | Path) -> bool:
    """Whether `folder` is an ensemble folder (`save_ensemble`), not one model."""
    return (Path(folder) / ENSEMBLE).is_file()


def ensemble_members(folder: str | Path) -> list[tuple[Path, float]]:
    """Each model folder of `folder` with its weight in the score: an ensemble's members (its
    own files and member records checked here; each member is verified when
    `load_model_folder` loads it), else the folder itself with weight 1."""
    folder = Path(folder)
    if not is_ensemble(folder):
        return [(folder, 1.0)]
    entries = _check_ensemble(folder, "download or export the model again")
    return [(folder / entry["folder"], float(entry["weight"])) for entry in entries]


def verify_model_folder(folder: str | Path) -> None:
    """Raise ModelFolderError unless `folder` holds exactly the files its checksums list, intact,
    with safetensors weights and no link out of it (for an ensemble: each of its members)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: no such model folder")
    advice = "download or export the model again"
    if is_ensemble(folder):
        _verify_ensemble(folder, advice)
        return
    if is_captioner(folder):
        _verify_captioner(folder)
        return
    listed = verify_checksums(folder, ModelFolderError, "model folder", advice,
                              format=MODEL_FORMAT)["files"]
    for name in REQUIRED_FILES:
        if name not in listed:
            raise ModelFolderError(f"{folder}: {CHECKSUMS} does not list {name}; {advice}")
    what = _not_safetensors(folder / WEIGHTS)
    if what:
        raise ModelFolderError(f"{folder / WEIGHTS} is {what}; model weights are loaded from "
                               "safetensors only, never unpickled: export the model again with "
                               "trainer.store.registry.save_model_folder")


def _verify_ensemble(folder: Path, advice: str) -> None:
    """An ensemble folder whole: `_check_ensemble`, then each member folder intact."""
    for entry in _check_ensemble(folder, advice):
        verify_model_folder(folder / entry["folder"])


def _verify_captioner(folder: Path) -> None:
    """A captioner folder whole: `captioner_encoder`, then the encoder folder intact."""
    verify_model_folder(captioner_encoder(folder))


def captioner_encoder(folder: str | Path) -> Path:
    """The encoder folder of a captioner folder, once the captioner's own files are intact and
    the encoder is the one `captioner.json` records (the encoder's own files are verified when
    `load_model_folder` loads it)."""
    folder, advice = Path(folder), "download or export the model again"
    if not is_captioner(folder):
        raise ModelFolderError(f"{folder} is not a captioner folder (no {CAPTIONER}): train one "
                               "with trainer.caption.train")
    verify_checksums(folder, ModelFolderError, "model folder", advice, subfolders=True,
                     format=MODEL_FORMAT)
    encoder = folder / CAPTIONER_ENCODER
    present = sorted(path.name for path in folder.iterdir() if path.is_dir())
    if present != [CAPTIONER_ENCODER]:
        raise ModelFolderError(f"{folder} holds the folders {present}; a captioner holds only "
                               f"{CAPTIONER_ENCODER}/; {advice}")
    try:
        recorded = json.loads((folder / CAPTIONER).read_text())["encoder_checksums_sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise ModelFolderError(f"{folder / CAPTIONER} is malformed ({err!r}); {advice}") from err
    if not (encoder / CHECKSUMS).is_file() or _sha256(encoder / CHECKSUMS) != recorded:
        raise ModelFolderError(f"{encoder} is not the encoder {CAPTIONER} records (other or no "
                               f"checksums); {advice}")
    return encoder


def _check_ensemble(folder: Path, advice: str) -> list[dict[str, Any]]:
    """An ensemble folder's own files and its `ensemble.json` entries: each member the one
    recorded (the sha256 of its checksums.json), not an ensemble, and no folder that is not a
    member. The members' own files are not read here."""
    verify_checksums(folder, ModelFolderError, "model folder", advice, subfolders=True,
                     format=MODEL_FORMAT)
    try:
        entries = json.loads((folder / ENSEMBLE).read_text())["members"]
        recorded = {entry["folder"]: entry["checksums_sha256"] for entry in entries}
        if not all(float(entry["weight"]) > 0 for entry in entries):
            raise ValueError("a weight is not positive")
    except (ValueError, KeyError, TypeError) as err:
        raise ModelFolderError(f"{folder / ENSEMBLE} is malformed ({err!r}); {advice}") from err
    present = {path.name for path in folder.iterdir() if path.is_dir()}
    if present != set(recorded) or any(Path(name).name != name for name in recorded):
        raise ModelFolderError(f"{folder} holds the folders {sorted(present)} but {ENSEMBLE} "
                               f"lists the members {sorted(recorded)}; {advice}")
    for name, sha256 in recorded.items():
        if is_ensemble(folder / name):
            raise ModelFolderError(f"{folder / name}: an ensemble member is an ensemble; {advice}")
        checksums = folder / name / CHECKSUMS
        if not checksums.is_file() or _sha256(checksums) != sha256:
            raise ModelFolderError(f"{folder / name} is not the member {ENSEMBLE} records (other "
                                   f"or no checksums); {advice}")
    return entries


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def load_model_folder(folder: str | Path) -> tuple[DeFragModel, Config, Vocabulary]:
    """The verified model (eval mode), its training config and its vocabulary.

    No pretrained weights or word-vector files are needed: the saved weights replace them.
    """
    from safetensors.torch import load_file

    from defrag.vocab import Vocabulary
    from trainer.model import DeFragModel

    folder = Path(folder)
    verify_model_folder(folder)
    if is_ensemble(folder):
        raise ModelFolderError(f"{folder} is an ensemble of {len(ensemble_members(folder))} "
                               "models, not one: load each of registry.ensemble_members")
    if is_captioner(folder):
        raise ModelFolderError(f"{folder} is a captioner (defrag caption); its "
                               f"retrieval model is {folder / CAPTIONER_ENCODER}")
    try:
        config = Config.from_dict(json.loads((folder / CONFIG).read_text()))
    except ValueError as err:
        raise ModelFolderError(f"{folder / CONFIG}: not a valid config ({err})") from err
    vocab = Vocabulary.load(folder / VOCAB)
    state = load_file(folder / WEIGHTS)  # tensors only: nothing is unpickled or executed
    model = DeFragModel.from_config(_standalone(config.model, state), vocab)
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    reshaped = sorted(k for k in expected.keys() & state.keys()
                      if expected[k].shape != state[k].shape)
    if missing or unexpected or reshaped:
        raise ModelFolderError(f"{folder / WEIGHTS} does not fit {CONFIG} and {VOCAB}: missing "
                               f"tensors {missing}, unexpected {unexpected}, other shapes "
                               f"{reshaped}")
    model.load_state_dict(state)
    return model.eval(), config, vocab


def _standalone(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> ModelConfig:
    """`cfg` without external files (ImageNet weights, word vectors) and with the saved W_e's
    width (a word-vector file may have overridden `word_dim` in training)."""
    word_vectors = state.get(WORD_VECTORS)
    word_dim = cfg.word_dim if word_vectors is None else word_vectors.shape[1]
    return dataclasses.replace(cfg, pretrained=False, backbone_weights=None, word_vectors=None,
                               word_dim=word_dim)


# ---------------------------------------------------------------- the registry


def register_from_run(tracker: Tracker, folder: str | Path, name: str = "defrag",
                      alias: str = "champion", artifact_path: str = "model") -> str | None:
    """Register a model folder from the tracker's run: its version (None on a disabled tracker).
    Raises RegistrationFailed, with the command that registers it later. A run that registers
    several models (e.g. each new best) passes a distinct artifact_path."""
    if not tracker.enabled:
        return None
    try:
        tracker.check_store()
        return register_model(tracker.client, tracker.run_id, folder, name, alias, artifact_path)
    except Exception as err:
        command = shlex.join([
            "defrag", "registry", "register", str(Path(folder).resolve()),
            "--run-id", tracker.run_id, "--tracking-uri", tracker.tracking_uri, "--name", name,
            "--alias", alias, "--artifact-path", artifact_path])
        raise RegistrationFailed(f"{type(err).__name__}: {err}", command) from err


def register_model(client: MlflowClient, run_id: str, folder: str | Path, name: str = "defrag",
                   alias: str = "champion", artifact_path: str = "model") -> str:
    """Log `folder` as the run's `artifact_path` MLflow model (`log_pyfunc_model`), register it
    as a new version of `name` and point `alias` at it; returns the version. The same files
    registered again from the same run (a finished run resumed, a job requeued after
    registering) reuse their version, or their logged artifacts under another `name`."""
    verify_model_folder(folder)
    if not client.list_artifacts(run_id, artifact_path):
        log_pyfunc_model(client, run_id, folder, artifact_path)
    elif not _logged_already(client, run_id, folder, artifact_path):
        raise ValueError(f"run {run_id} already has other files under {artifact_path!r}; a "
                         "new version must not share (and overwrite) an older version's: "
                         "register it under another --artifact-path")
    else:  # these files, logged before: their version of `name`, or a new one of them
        version = _registered_before(client, run_id, name, artifact_path)
        if version is not None:
            client.set_registered_model_alias(name, alias, version)
            return version
    try:
        client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_registered_model(name, description="DeFrag fragment embeddings: an MLflow "
                                       "pyfunc (from code) of a model folder: safetensors "
                                       "weights, JSON config and vocabulary")
    version = client.create_model_version(name, source=f"runs:/{run_id}/{artifact_path}",
                                          run_id=run_id).version
    client.set_registered_model_alias(name, alias, version)
    return str(version)


def register_ensemble(folder: Path, name: str, alias: str, tracking_uri: str | None) -> str:
    """Register an ensemble folder from a new run of ENSEMBLE_EXPERIMENT (an ensemble is not
    trained by one run), its members' sources as parameters; returns the version."""
    if not tracking_uri:
        raise ValueError(f"--name registers into a tracking store: pass --tracking-uri or set "
                         f"{MLFLOW_TRACKING_URI.name}")
    client = connect(tracking_uri)
    # a sqlite store keeps the artifacts beside it, as a run's embedded store (MLflow's default
    # would be ./mlruns of wherever the command runs)
    artifacts = (Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts"
                 if tracking_uri.startswith("sqlite:///") else None)
    experiment = experiment_id(client, ENSEMBLE_EXPERIMENT,
                               artifacts.as_uri() if artifacts else None)
    run_id = client.create_run(experiment, run_name=folder.name).info.run_id
    members = json.loads((folder / ENSEMBLE).read_text())["members"]
    for entry in members:
        client.log_param(run_id, entry["folder"], entry["source"])
    try:
        version = register_model(client, run_id, folder, name, alias)
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id)
    return version


def log_pyfunc_model(client: MlflowClient, run_id: str, folder: str | Path,
                     artifact_path: str) -> None:
    """Log `folder` as the run's `artifact_path`: an MLflow pyfunc model from code
    (trainer/search/pyfunc_model.py) whose artifact `model` is the folder. Its pip requirements are
    this package and its own, so MLflow infers nothing (inference imports the model, may ask
    PyPI)."""
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "pyfunc"
        mlflow.pyfunc.save_model(
            path=staging, python_model=str(PYFUNC_CODE), artifacts={PYFUNC_ARTIFACT: str(folder)},
            signature=SIGNATURE, input_example=INPUT_EXAMPLE, model_config=PYFUNC_CONFIG,
            pip_requirements=_pip_requirements())
        client.log_artifacts(run_id, str(staging), artifact_path)


def _pip_requirements() -> list[str]:
    """This package pinned, then its own (pinned) dependencies, from the installed metadata."""
    from importlib import metadata

    needs = [need for need in metadata.requires(PACKAGE) or [] if "extra ==" not in need]
    return [f"{PACKAGE}=={metadata.version(PACKAGE)}", *needs]


def pyfunc_folder(model_dir: Path) -> Path:
    """The model folder of an MLflow model directory (its pyfunc artifact `model`); `model_dir`
    itself when it has no MLmodel (a version registered before the pyfunc)."""
    if not (model_dir / MLMODEL).is_file():
        return model_dir
    return model_dir / _artifact_path(model_dir / MLMODEL)


def _artifact_path(mlmodel: Path) -> str:
    """Where in its MLflow model directory an MLmodel file puts the pyfunc artifact `model`."""
    from mlflow.models import Model

    try:
        relative = Model.load(mlmodel).flavors["python_function"]["artifacts"][PYFUNC_ARTIFACT][
            "path"]
    except (KeyError, TypeError) as err:
        raise ModelFolderError(f"{mlmodel} names no pyfunc artifact {PYFUNC_ARTIFACT!r}: not a "
                               "DeFrag model registered by trainer.store.registry") from err
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise ModelFolderError(f"{mlmodel}: the artifact {PYFUNC_ARTIFACT!r} is at {relative}, "
                               "outside the model")
    return relative


def _logged_already(client: MlflowClient, run_id: str, folder: str | Path,
                    artifact_path: str) -> bool:
    """Whether the run's `artifact_path` holds `folder`'s files (same checksums.json): as its
    pyfunc artifact, or (logged before the pyfunc) as the artifact_path itself."""
    with tempfile.TemporaryDirectory() as tmp:
        logged = _logged_file(client, run_id, f"{artifact_path}/{MLMODEL}", Path(tmp))
        inner = (f"{artifact_path}/{_artifact_path(logged)}" if logged is not None
                 else artifact_path)
        checksums = _logged_file(client, run_id, f"{inner}/{CHECKSUMS}", Path(tmp))
        return (checksums is not None
                and checksums.read_bytes() == (Path(folder) / CHECKSUMS).read_bytes())


def _logged_file(client: MlflowClient, run_id: str, path: str, tmp: Path) -> Path | None:
    """The run's artifact file `path` downloaded into `tmp`; None when the run has none (e.g. an
    upload cut short)."""
    parent = path.rpartition("/")[0]
    if path not in {entry.path for entry in client.list_artifacts(run_id, parent)}:
        return None
    return Path(client.download_artifacts(run_id, path, str(tmp)))


def _registered_before(client: MlflowClient, run_id: str, name: str,
                       artifact_path: str) -> str | None:
    """The newest version of `name` registered from the run's `artifact_path`, if any."""
    try:
        found = client.search_model_versions(f"name = '{name}'")
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        found = []
    versions = [v for v in found
                if v.run_id == run_id and v.source.rstrip("/").endswith(f"/{artifact_path}")]
    return str(max(int(v.version) for v in versions)) if versions else None


def download_model(uri: str, dst: str | Path, tracking_uri: str | None = None) -> Path:
    """Download `models:/NAME@ALIAS` or `models:/NAME/VERSION` into the new folder `dst`, verified.

    `dst` is the plain model folder (a version's pyfunc artifact, `pyfunc_folder`; a version
    registered before the pyfunc is that folder already), so every `--model DIR` reads it as
    before; the MLflow files around it are for `mlflow.pyfunc.load_model` and are not kept.
    The store is `tracking_uri`, else MLFLOW_TRACKING_URI. The files land beside `dst` first and
    are renamed into place only once they verify, so `dst` never holds a partial model.
    """
    tracking_uri = tracking_uri or MLFLOW_TRACKING_URI.get()
    if not tracking_uri:
        raise ValueError(f"no tracking store: pass --tracking-uri or set {MLFLOW_TRACKING_URI.name}"
                         " (a run's embedded store is sqlite:///<run dir>/mlflow.db)")
    sqlite_file = Path(tracking_uri.removeprefix("sqlite:///"))
    if tracking_uri.startswith("sqlite:///") and not sqlite_file.is_file():
        raise FileNotFoundError(f"{tracking_uri}: no such sqlite tracking store")
    match = MODEL_URI.fullmatch(uri)
    if match is None:
        raise ValueError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty folder; choose a new --dst")
    client = connect(tracking_uri)
    name, version = match["name"], _resolve_version(client, match, tracking_uri)
    source = client.get_model_version_download_uri(name, version)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.with_name(f".{dst.name}.download-{uuid.uuid4().hex[:8]}")
    try:
        local = pyfunc_folder(Path(mlflow.artifacts.download_artifacts(
            artifact_uri=source, dst_path=str(staging), tracking_uri=tracking_uri)))
        verify_model_folder(local)
        local.rename(dst)  # replaces an empty dst folder
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst


def _resolve_version(client: MlflowClient, match: re.Match[str], tracking_uri: str) -> str:
    """The version a parsed model URI names, with an error listing what exists when it does not."""
    name = match["name"]
    try:
        model = client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        known = sorted(m.name for m in client.search_registered_models())
        raise LookupError(f"no registered model {name!r} in {tracking_uri}; registered: "
                          f"{known or 'none'}") from err
    if match["alias"] is not None:
        if match["alias"] not in model.aliases:
            raise LookupError(f"model {name!r} has no alias {match['alias']!r}; aliases: "
                              f"{sorted(model.aliases) or 'none'}")
        return str(model.aliases[match["alias"]])
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    if int(match["version"]) not in versions:
        raise LookupError(f"model {name!r} has no version {match['version']}; versions: "
                          f"{versions or 'none'}")
    return match["version"]


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    """`download` a registered model into a verified folder, `verify` a folder, or `register`
    one."""
    parser = argparse.ArgumentParser(prog="defrag registry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    download = commands.add_parser("download", help="download and verify a registered model")
    download.add_argument("uri", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    download.add_argument("--dst", required=True, type=Path, help="new (or empty) folder")
    download.add_argument("--tracking-uri", help=f"default: ${MLFLOW_TRACKING_URI.name}")
    verify = commands.add_parser("verify", help="check a model folder against its checksums")
    verify.add_argument("folder", type=Path)
    register = commands.add_parser("register", help="register a model folder from its run, "
                                   "e.g. a run's best/ after its registration failed")
    register.add_argument("folder", type=Path)
    register.add_argument("--run-id", required=True, help="the MLflow run that trained it")
    register.add_argument("--tracking-uri", required=True, help="that run's store")
    register.add_argument("--name", default="defrag", help="registered model (default: defrag)")
    register.add_argument("--alias", default="champion", help="set to the new version")
    register.add_argument("--artifact-path", default="model", help="where in the run's "
                          "artifacts (it must not hold files yet)")
    ensemble = commands.add_parser("ensemble", help="one model folder of several trained "
                                   "models whose scores are averaged; registered under a new run "
                                   "with --name")
    ensemble.add_argument("members", nargs="+", type=Path, help="model folders (2 or more)")
    ensemble.add_argument("--out", required=True, type=Path, help="the ensemble folder")
    ensemble.add_argument("--weights", type=float, nargs="+", help="one per member (default: "
                          "equal); needed when the members' objective.score differ")
    ensemble.add_argument("--name", help="register it as this model (in a new run of the "
                          f"experiment {ENSEMBLE_EXPERIMENT!r})")
    ensemble.add_argument("--alias", default="champion", help="set to the new version")
    ensemble.add_argument("--tracking-uri", help=f"with --name; default: "
                          f"${MLFLOW_TRACKING_URI.name}")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    with one_line_errors(f"{parser.prog} {args.command}", args.debug):
        if args.command == "download":
            result = download_model(args.uri, args.dst, args.tracking_uri)
        elif args.command == "ensemble":
            result = save_ensemble(args.out, args.members, args.weights)
            if args.name:
                version = register_ensemble(args.out, args.name, args.alias,
                                            args.tracking_uri or MLFLOW_TRACKING_URI.get())
                result = f"{result}\nmodels:/{args.name}/{version}"
        elif args.command == "register":
            version = register_model(connect(args.tracking_uri), args.run_id, args.folder,
                                     args.name, args.alias, args.artifact_path)
            result = f"models:/{args.name}/{version}"
        else:
            verify_model_folder(args.folder)
            result = args.folder
    print(result)

