"""The registry: a model folder (trainer/store/model_folder.py) registered in MLflow, and
downloaded back.

    defrag registry download models:/defrag@champion --dst DIR [--tracking-uri URI]
    defrag registry verify DIR
    defrag registry register DIR --run-id ID --tracking-uri URI [--name N --alias A]
    defrag registry ensemble DIR DIR... --out DIR [--weights W W...] [--name N ...]

A registered version is an MLflow pyfunc model built from code (trainer/search/pyfunc_model.py,
nothing pickled): `MLmodel`, the code file and the environment files, with the model folder as its
artifact `model` (in `artifacts/<folder name>/`, as MLmodel records). So
`mlflow.pyfunc.load_model("models:/defrag@champion")` and `mlflow models serve -m
models:/defrag@champion --env-manager local` work, while `download` still gives the plain model
folder that `--model DIR` reads. An ensemble, trained by no one run, is registered from a new run
of ENSEMBLE_EXPERIMENT.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow.artifacts
import mlflow.pyfunc
import pandas as pd
from mlflow import MlflowClient
from mlflow.environment_variables import MLFLOW_TRACKING_URI
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

from defrag.cli import add_debug_flag, one_line_errors
from defrag.files import CHECKSUMS, sha256_file
from defrag.images import MAX_IMAGE_PIXELS
from trainer.store.model_folder import MEMBER, ModelFolder, ModelFolderError, save_ensemble
from trainer.store.tracking import FinishedRunError, Tracker, connect, experiment_id

ENSEMBLE_EXPERIMENT = "defrag-ensembles"  # the MLflow experiment whose runs register ensembles
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


class RegistrationFailed(FinishedRunError):
    """A model folder could not be registered; `command` registers it later. `summary` is the
    training's summary (set by the run that trained it) to print before exiting 1."""

    def __init__(self, error: str, command: str) -> None:
        super().__init__(f"the model is not registered: {error}\nregister it later with: {command}")
        self.error, self.command = error, command
        self.summary: dict[str, Any] = {}


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
    opened = ModelFolder.open(folder)
    if not client.list_artifacts(run_id, artifact_path):
        log_pyfunc_model(client, run_id, folder, artifact_path)
    elif not _logged_already(client, run_id, opened, artifact_path):
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


def register_ensemble(folder: Path, sources: Sequence[Path], name: str, alias: str,
                      tracking_uri: str | None) -> str:
    """Register an ensemble folder from a new run of ENSEMBLE_EXPERIMENT (an ensemble is not
    trained by one run), the model folders its members were copied from as parameters; returns
    the version."""
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
    for number, source in enumerate(sources):
        client.log_param(run_id, MEMBER.format(number), str(source))
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


def _logged_already(client: MlflowClient, run_id: str, folder: ModelFolder,
                    artifact_path: str) -> bool:
    """Whether the run's `artifact_path` holds `folder`'s files (same checksums key): as its
    pyfunc artifact, or (logged before the pyfunc) as the artifact_path itself."""
    with tempfile.TemporaryDirectory() as tmp:
        logged = _logged_file(client, run_id, f"{artifact_path}/{MLMODEL}", Path(tmp))
        inner = (f"{artifact_path}/{_artifact_path(logged)}" if logged is not None
                 else artifact_path)
        checksums = _logged_file(client, run_id, f"{inner}/{CHECKSUMS}", Path(tmp))
        return (checksums is not None
                and sha256_file(checksums) == folder.checksums_key)


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
        ModelFolder.open(local)
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
                version = register_ensemble(args.out, args.members, args.name, args.alias,
                                            args.tracking_uri or MLFLOW_TRACKING_URI.get())
                result = f"{result}\nmodels:/{args.name}/{version}"
        elif args.command == "register":
            version = register_model(connect(args.tracking_uri), args.run_id, args.folder,
                                     args.name, args.alias, args.artifact_path)
            result = f"models:/{args.name}/{version}"
        else:
            ModelFolder.open(args.folder)
            result = args.folder
    print(result)

