"""Damaged checkpoints (trainer/training/checkpoint.py) with real tiny trainings: every checkpoint
carries checksums written last; `--resume latest` skips a damaged newest checkpoint, saying which
and why, and resumes the newest intact one; an explicit damaged `--resume DIR` fails with one line
naming the file; a disk that fills up while a checkpoint is written leaves the previous one
`latest`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import trainer.training.loop
from trainer.config import Config
from trainer.main import train
from trainer.training.checkpoint import (
    CheckpointError,
    checkpoints_dir,
    latest_checkpoint,
    load_state,
)
from trainer.training.distributed import DistContext
from trainer.training.preemption import REQUEST, Preempted
from trainer.training.run import find_checkpoint

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
FILES = ["model.safetensors", "optimizer.pt", "state.json", "config.json", "checksums.json"]


def make_config(run_dir: Path, shards: Path, **run: object) -> Config:
    return Config.from_dict({
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64, "train_word_vectors": True},
        "data": {"shards": str(shards), "workers": 0, "shuffle_buffer": 10},
        "optim": {"batch_size": 20, "epochs": 1, "frozen_cnn_epochs": 1},
        "run": {"run_dir": str(run_dir), "keep_checkpoints": 3, **run},
    })


def train_one_step(cfg: Config, resume: str = "latest") -> None:
    """Train from `resume` with a stop requested: one step, its checkpoint, then Preempted."""
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run.run_dir) / REQUEST).touch()
    with pytest.raises(Preempted):
        train(cfg, CPU, resume)


def step(run_dir: Path, number: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{number:08d}"


def truncate(path: Path) -> None:
    with path.open("r+b") as stream:
        stream.truncate(path.stat().st_size // 2)


@pytest.fixture(autouse=True)
def embedded_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, shards: Path) -> Path:
    """A run stopped twice: checkpoints step-1 and step-2 (`latest`), and their copy."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        for _ in range(2):
            train_one_step(make_config(run_dir, shards))
    shutil.copytree(checkpoints_dir(run_dir), run_dir.with_name("pristine"))
    return run_dir


@pytest.fixture
def run(trained: Path, shards: Path) -> Config:
    """The trained run with its checkpoints as they were stopped, which the test may damage (in
    place: MLflow's store keeps the run and its run_dir)."""
    shutil.rmtree(checkpoints_dir(trained))
    shutil.copytree(trained.with_name("pristine"), checkpoints_dir(trained))
    return make_config(trained, shards)


def test_checksums_cover_every_file(run: Config) -> None:
    folder = latest_checkpoint(run.run.run_dir)
    listed = json.loads((folder / "checksums.json").read_text())["files"]
    assert sorted(listed) == sorted(FILES[:4]) == sorted(p.name for p in folder.iterdir()
                                                         if p.name != "checksums.json")


@pytest.mark.parametrize("name", FILES)
def test_latest_skips_a_damaged_checkpoint_and_says_why(run: Config, name: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    run_dir = Path(run.run.run_dir)
    truncate(step(run_dir, 2) / name)
    caplog.set_level(logging.INFO)
    train_one_step(run)
    messages = [r.getMessage() for r in caplog.records]
    skipped = [m for m in messages if m.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and str(step(run_dir, 2) / name) in skipped[0], messages
    assert "resuming from step-00000001" in skipped[0]
    assert any(m.startswith(f"resumed from {step(run_dir, 1)} ") for m in messages)
    assert load_state(latest_checkpoint(run_dir)).global_step == 2  # trained again, intact


def test_a_checkpoint_of_an_earlier_version_resumes_unverified(
        run: Config, caplog: pytest.LogCaptureFixture) -> None:
    """Written before checkpoints carried checksums (a run upgraded mid-way, `make demo` run
    again): resumed, with a warning, not refused."""
    run_dir = Path(run.run.run_dir)
    (step(run_dir, 2) / "checksums.json").unlink()
    caplog.set_level(logging.INFO)
    train_one_step(run)
    messages = [r.getMessage() for r in caplog.records]
    assert any("has no checksums.json (written by an earlier version): resuming from it "
               "unverified" in m for m in messages), messages
    assert any(m.startswith(f"resumed from {step(run_dir, 2)} ") for m in messages)
    assert load_state(latest_checkpoint(run_dir)).global_step == 3


def test_explicit_damaged_checkpoint_fails_naming_the_file(run: Config) -> None:
    damaged = step(Path(run.run.run_dir), 2)
    truncate(damaged / "optimizer.pt")
    with pytest.raises(CheckpointError) as error:
        train(run, CPU, resume=str(damaged))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{damaged / 'optimizer.pt'} does not match its checksum")


def test_no_intact_checkpoint_is_one_clear_error(run: Config) -> None:
    run_dir = Path(run.run.run_dir)
    for number in (1, 2):
        truncate(step(run_dir, number) / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        train(run, CPU, resume="latest")
    message = str(error.value)
    assert "\n" not in message and "no intact checkpoint" in message
    assert "--resume none" in message


def test_symlink_out_of_a_checkpoint_is_refused(run: Config, tmp_path: Path) -> None:
    run_dir = Path(run.run.run_dir)
    link = step(run_dir, 2) / "optimizer.pt"
    outside = tmp_path / "optimizer.pt"
    shutil.move(link, outside)
    link.symlink_to(outside)  # same bytes: only the link is wrong
    assert find_checkpoint("latest", run_dir) == step(run_dir, 1)
    with pytest.raises(CheckpointError, match=f"{link} is a link to {outside}, outside"):
        find_checkpoint(str(step(run_dir, 2)), run_dir)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 MiB tmpfs (needs root, or the permission to mount); without it the test is
    skipped, unless DEFRAG_REQUIRE_MOUNT=1 (set by .ci/run, which runs as root) fails it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)],
                       check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        problem = f"cannot mount a tmpfs to fill ({getattr(err, 'stderr', '') or err})".strip()
        if os.environ.get("DEFRAG_REQUIRE_MOUNT") == "1":
            pytest.fail(f"{problem} (DEFRAG_REQUIRE_MOUNT=1)")
        pytest.skip(problem)
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)  # MLflow's sqlite may be open


def test_a_full_disk_keeps_the_previous_checkpoint_latest(small_disk: Path, shards: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_config(small_disk / "run", shards, checkpoint_every_steps=1)
    real_save = trainer.training.loop.save_checkpoint

    def save_then_fill(engine, state, run_dir, rank, keep, config) -> Path:
        """After the first checkpoint, fill the disk but for half a checkpoint's bytes."""
        folder = real_save(engine, state, run_dir, rank, keep, config)
        if state.global_step == 1:
            size = sum(p.stat().st_size for p in folder.iterdir())
            with (small_disk / "filler").open("wb") as filler:
                for _ in range((shutil.disk_usage(small_disk).free - size // 2) >> 20):
                    filler.write(bytes(1 << 20))
        return folder

    monkeypatch.setattr(trainer.training.loop, "save_checkpoint", save_then_fill)
    with pytest.raises(CheckpointError) as error:
        train(cfg, CPU, resume="none")
    message = str(error.value)
    assert "\n" not in message, message
    assert f"cannot write checkpoint {step(small_disk / 'run', 2)}" in message
    assert "the disk is full" in message and "latest is still step-00000001" in message
    assert not list(checkpoints_dir(small_disk / "run").glob("tmp-*"))  # its space is freed
    assert latest_checkpoint(small_disk / "run") == step(small_disk / "run", 1)

    (small_disk / "filler").unlink()
    monkeypatch.setattr(trainer.training.loop, "save_checkpoint", real_save)
    caplog.set_level(logging.INFO)
    train_one_step(cfg)
    assert any(r.getMessage().startswith(f"resumed from {step(small_disk / 'run', 1)} ")
               for r in caplog.records)
    assert latest_checkpoint(small_disk / "run") == step(small_disk / "run", 2)


@pytest.mark.slow
def test_deepspeed_partitions_are_covered(tmp_path: Path,
                                          deepspeed_training: tuple[Path, str]) -> None:
    """A copy of the newest checkpoint of the session's 2-process DeepSpeed ZeRO-2 training
    (tests/conftest.py): rank 1's optimizer partition is listed and verified."""
    newest = latest_checkpoint(deepspeed_training[0])
    run_dir = tmp_path / "run"
    folder = checkpoints_dir(run_dir) / newest.name
    shutil.copytree(newest, folder)
    (folder.parent / "latest").write_text(newest.name)
    listed = json.loads((folder / "checksums.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in folder.iterdir() if p.name != "checksums.json")
    partition = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # written by rank 1
    assert partition.name in listed
    truncate(partition)
    with pytest.raises(CheckpointError, match=f"{partition} does not match its checksum"):
        find_checkpoint("latest", run_dir)
