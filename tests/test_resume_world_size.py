"""A resume on another number of ranks (trainer.training.checkpoint `resume_changes`): refused
mid-epoch, where the rest of the epoch is dealt by (rank, world size), and for DeepSpeed's ZeRO
partitions, which load only on the world size that wrote them; accepted at an epoch's end under
DDP."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.small_training import small_config
from trainer.config import Config, ConfigError
from trainer.main import train
from trainer.training.checkpoint import (
    TrainState,
    checkpoints_dir,
    latest_checkpoint,
    load_state,
    resume_changes,
)
from trainer.training.distributed import DistContext, end_process

ROOT = Path(__file__).resolve().parents[1]
CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def make_config(run_dir: Path, shards: Path, engine: str) -> Config:
    """One epoch of 10 steps of a tiny model, the CNN fixed, a checkpoint after step 5 and at
    the epoch's end."""
    return small_config(shards, run_dir, run={
        "run_dir": str(run_dir), "keep_checkpoints": 20, "checkpoint_every_steps": 5,
        "engine": engine, "deepspeed_config": str(ROOT / "launch/deepspeed/zero2.json")})


def two_ranks(rank: int, init_file: str, shards: str, run_dir: str, engine: str) -> None:
    """The whole epoch on 2 ranks: checkpoints step-5 (mid-epoch) and the epoch's end."""
    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets; DeepSpeed requires it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    train(make_config(Path(run_dir), Path(shards), engine),
          DistContext(rank, 2, rank, torch.device("cpu")), "none")
    end_process(0)


@pytest.fixture(autouse=True)
def embedded_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_a_resume_on_another_world_size(tmp_path: Path, shards: Path, engine: str) -> None:
    run_dir = tmp_path / "run"
    mp.spawn(two_ranks, args=(str(tmp_path / "store"), str(shards), str(run_dir), engine),
             nprocs=2)
    middle, end = checkpoints_dir(run_dir) / "step-00000005", latest_checkpoint(run_dir)
    assert load_state(middle).world_size == load_state(end).world_size == 2
    assert load_state(end).step_in_epoch == 0
    cfg = make_config(run_dir, shards, engine)
    with pytest.raises(ConfigError) as refused:
        train(cfg, CPU, str(middle))
    line = str(refused.value)
    assert "\n" not in line and f"cannot resume {middle}" in line
    assert "world size: 2 -> 1" in line and "--resume none" in line
    if engine == "ddp":  # the next epoch is dealt to this world size from its start
        assert train(cfg, CPU, "latest")["best_epoch"] == 0
    else:
        with pytest.raises(ConfigError, match=f"cannot resume {end} .*world size: 2 -> 1"):
            train(cfg, CPU, "latest")


def test_a_checkpoint_without_its_world_size_resumes(tmp_path: Path) -> None:
    """Written by an earlier version: the world size it was trained on is unknown."""
    Config().to_json(tmp_path / "config.json")
    assert resume_changes(tmp_path, TrainState(step_in_epoch=3), Config(), world_size=4) == []
