"""A resume checks the checkpoint's config against the new one (trainer.training.checkpoint
`resume_changes`, trainer/config.py RESUME_FIXED): a change of what the checkpoint means is
refused in one line before the MLflow run is touched; a safe change is accepted, logged and
tagged; and a finished run trained further registers its new best as a new version."""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import typing
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal

import pytest
import torch
from mlflow import MlflowClient

from tests import DEFRAG
from tests.small_training import small_config
from trainer.config import (
    RESUME_CHANGEABLE,
    RESUME_FIXED,
    RESUME_FIXED_MID_EPOCH,
    Config,
    ConfigError,
)
from trainer.store.registry import RegistrationFailed, download_model
from trainer.store.tracking import flatten
from trainer.training.checkpoint import TrainState, latest_checkpoint, resume_changes
from trainer.training.distributed import DistContext

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
ROOT = Path(__file__).resolve().parents[1]


def config(run_dir: Path, shards: Path, **sections: dict) -> Config:
    """small_config with lr 0.003 (epoch 1 beats epoch 0) and the CNN fixed for 5 epochs."""
    optim = {"lr": 0.003, "frozen_cnn_epochs": 5, "anneal_last_epochs": 0,
             **sections.pop("optim", {})}
    return small_config(shards, run_dir, optim=optim, **sections)


def finished_run(run_dir: Path, shards: Path) -> dict:
    """A training run that ended FINISHED and registered its best as `defrag` version 1."""
    from trainer.main import train

    summary = train(config(run_dir, shards), CPU, resume="latest")
    assert summary["version"] == "1"
    return summary


@pytest.fixture(autouse=True)
def embedded_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, shards: Path) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        return finished_run(tmp_path_factory.mktemp("finished") / "run", shards)


def record(summary: dict) -> tuple:
    """What the store holds of the run: status, end time, params and tags."""
    run = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"])
    return run.info.status, run.info.end_time, run.data.params, run.data.tags


@pytest.mark.slow
@pytest.mark.parametrize(("change", "listed"), [
    ({"optim": {"batch_size": 10}}, ["optim.batch_size: 20 -> 10"]),
    ({"model": {"embed_dim": 32, "sentence_encoder": "lstm"},
      "objective": {"use_fragment": False}},
     ["model.embed_dim: 16 -> 32", "model.sentence_encoder: fragments -> lstm",
      "objective.use_fragment: True -> False"]),
])
def test_a_change_of_what_the_checkpoint_means_is_refused_and_the_run_left_as_it_was(
        finished: dict, shards: Path, change: dict, listed: list[str]) -> None:
    from trainer.main import train

    run_dir = Path(finished["run_dir"])
    before, history = record(finished), (run_dir / "history.jsonl").read_text()
    assert before[0] == "FINISHED"
    with pytest.raises(ConfigError) as refused:
        train(config(run_dir, shards, **change), CPU, resume="latest")
    line = str(refused.value)
    assert "\n" not in line and "load_state_dict" not in line and "size mismatch" not in line
    assert f"cannot resume {latest_checkpoint(run_dir)}" in line
    for item in listed:
        assert item in line, line
    assert "run.run_dir" in line and "--resume none" in line
    assert record(finished) == before  # still FINISHED, same end, params and tags
    assert (run_dir / "history.jsonl").read_text() == history


@pytest.mark.slow
def test_a_safe_change_is_accepted_logged_and_tagged(finished: dict, shards: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from trainer.main import train

    run_dir = Path(finished["run_dir"])
    checkpoint = latest_checkpoint(run_dir)
    caplog.set_level(logging.INFO)
    summary = train(config(run_dir, shards, optim={"lr": 0.006}), CPU, resume="latest")
    assert summary["version"] == "1"  # nothing trained: the same best, its version
    change = "optim.lr: 0.003 -> 0.006"
    lines = [r.getMessage() for r in caplog.records if change in r.getMessage()]
    assert lines == [f"resuming {checkpoint} with a changed config: {change}"]
    status, _, params, tags = record(finished)
    assert status == "FINISHED" and params["optim.lr"] == "0.003"  # params: the run's start
    assert tags[f"resumed/{checkpoint.name}"] == change


@pytest.mark.slow
def test_a_finished_run_trained_further_registers_each_new_best(tmp_path: Path,
                                                                shards: Path) -> None:
    """Version 1 after epoch 0; resumed for epoch 1: version 2, the new best's files; resumed
    for epoch 2 while its artifact path cannot be written: the command it prints registers
    version 3 once it can; resumed again with nothing to train: version 3 again."""
    from trainer.main import train

    run_dir = tmp_path / "run"
    first = finished_run(run_dir, shards)
    summary = train(config(run_dir, shards, optim={"epochs": 2}), CPU, resume="latest")
    uri = summary["tracking_uri"]
    assert summary["mlflow_run_id"] == first["mlflow_run_id"]
    assert summary["best_epoch"] == 1 and summary["version"] == "2"
    assert weights(download_model("models:/defrag@champion", tmp_path / "v2", uri)) == weights(
        run_dir / "best")
    assert weights(download_model("models:/defrag/1", tmp_path / "v1", uri)) != weights(
        run_dir / "best")

    client = MlflowClient(uri)
    artifacts = Path(client.get_run(first["mlflow_run_id"]).info.artifact_uri[len("file://"):])
    blocker = artifacts / "model-epoch-002"  # a file where the new best's folder goes
    blocker.write_text("")
    with pytest.raises(RegistrationFailed) as failed:
        train(config(run_dir, shards, optim={"epochs": 3}), CPU, resume="latest")
    assert failed.value.summary["best_epoch"] == 2
    assert client.get_run(first["mlflow_run_id"]).info.status == "FINISHED"
    blocker.unlink()
    later = shlex.split(failed.value.command)
    assert later[0] == "defrag"
    done = subprocess.run([DEFRAG, *later[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "models:/defrag/3"
    assert weights(download_model("models:/defrag@champion", tmp_path / "v3", uri)) == weights(
        run_dir / "best")

    again = train(config(run_dir, shards, optim={"epochs": 3}), CPU, resume="latest")
    assert again["version"] == "3"  # the same files from the same run: their version


def weights(folder: Path) -> bytes:
    return (folder / "weights.safetensors").read_bytes()


def test_keys_that_order_an_epoch_are_fixed_only_mid_epoch(tmp_path: Path) -> None:
    """A checkpoint taken mid-epoch resumes by skipping the steps done in the epoch's order;
    at an epoch's end the order of the next one may change."""
    folder = tmp_path / "step-00000003"
    folder.mkdir()
    Config().to_json(folder / "config.json")
    changed = Config.from_dict({"data": {"workers": 4}, "seed": 7, "optim": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"data\.workers: 2 -> 4, seed: 0 -> 7;"):
        resume_changes(folder, TrainState(epoch=1, step_in_epoch=3), changed, world_size=1)
    assert resume_changes(folder, TrainState(epoch=1), changed, world_size=1) == [
        "data.workers: 2 -> 4", "optim.lr: 0.01 -> 0.5", "seed: 0 -> 7"]


def test_every_config_key_is_either_fixed_or_changeable_on_resume() -> None:
    """A new key is classified when it is added: in exactly one of the three sets."""
    keys = set(flatten(Config().to_dict()))
    classes = [RESUME_FIXED, RESUME_FIXED_MID_EPOCH, RESUME_CHANGEABLE]
    unclassified = keys.difference(*classes)
    assert not unclassified, (f"{sorted(unclassified)}: add each to RESUME_FIXED, "
                              "RESUME_FIXED_MID_EPOCH or RESUME_CHANGEABLE (trainer/config.py)")
    twice = [key for key in keys if sum(key in keys_ for keys_ in classes) > 1]
    assert not twice, f"{twice}: in more than one of the resume classes"
    assert set().union(*classes) <= keys, "a resume class names a key the config has not"


# The checkpoint's config in the per-key tests: defaults, but C_F off, so that
# model.sentence_encoder may change to a whole-sentence encoder on its own
SAVED = {"objective": {"use_fragment": False}}


def another_value(key: str) -> tuple[Any, Any]:
    """The key's value in SAVED, and another value the key's annotation allows."""
    section, _, name = key.rpartition(".")
    owner = type(getattr(Config(), section)) if section else Config
    hint = typing.get_type_hints(owner, include_extras=True)[name]
    old = flatten(Config.from_dict(SAVED).to_dict())[key]
    union = typing.get_origin(hint) in (typing.Union, UnionType)
    kinds = [typing.get_args(arg)[0] if typing.get_origin(arg) is Annotated else arg
             for arg in (typing.get_args(hint) if union else [hint])]
    kind = next(arg for arg in kinds if arg is not type(None))
    if typing.get_origin(kind) is Literal:
        return old, next(choice for choice in typing.get_args(kind) if choice != old)
    if old is None:
        return old, kind(1) if kind is not str else "other"
    return old, {bool: lambda: not old, int: lambda: old + 1, float: lambda: old * 2 + 1,
                 str: lambda: f"{old}-other"}[kind]()


def resumed_with(folder: Path, key: str, new: Any, state: TrainState) -> list[str]:
    """resume_changes of the checkpoint in `folder` (SAVED) with `key` changed to `new`."""
    Config.from_dict(SAVED).to_json(folder / "config.json")
    section, _, name = key.rpartition(".")
    changed = {**SAVED, section: {**SAVED.get(section, {}), name: new}} if section else {
        **SAVED, name: new}
    return resume_changes(folder, state, Config.from_dict(changed), world_size=1)


@pytest.mark.parametrize("key", sorted(RESUME_FIXED))
def test_a_change_of_each_fixed_key_is_refused_in_one_line_naming_it(tmp_path: Path,
                                                                      key: str) -> None:
    old, new = another_value(key)
    with pytest.raises(ConfigError) as refused:
        resumed_with(tmp_path, key, new, TrainState(epoch=1))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"cannot resume {tmp_path} with this config: {key}: {old} -> {new}; ")


@pytest.mark.parametrize("key", sorted(RESUME_FIXED_MID_EPOCH))
def test_a_change_of_each_key_that_orders_an_epoch_is_refused_mid_epoch_only(tmp_path: Path,
                                                                             key: str) -> None:
    old, new = another_value(key)
    with pytest.raises(ConfigError, match=f"with this config: {re.escape(key)}: "):
        resumed_with(tmp_path, key, new, TrainState(epoch=1, step_in_epoch=3))
    assert resumed_with(tmp_path, key, new, TrainState(epoch=1)) == [f"{key}: {old} -> {new}"]


@pytest.mark.parametrize("key", sorted(RESUME_CHANGEABLE))
def test_a_change_of_each_changeable_key_is_accepted_even_mid_epoch(tmp_path: Path,
                                                                   key: str) -> None:
    old, new = another_value(key)
    assert resumed_with(tmp_path, key, new, TrainState(epoch=1, step_in_epoch=3)) == [
        f"{key}: {old} -> {new}"]


def test_a_checkpoint_without_its_config_resumes_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Written by an earlier version: nothing to compare with, said once."""
    folder = tmp_path / "step-00000003"
    folder.mkdir()
    assert resume_changes(folder, TrainState(), Config(), world_size=1) == []
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {folder} has no config.json (written by an earlier version): resuming "
        "without comparing its config with this one"]
