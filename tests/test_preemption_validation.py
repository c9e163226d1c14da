"""A SIGTERM during an epoch's validation (trainer/training/loop.py): the run stops with the
end-of-epoch checkpoint instead of starting the next epoch, and the resumed run records each epoch
once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.small_training import small_config
from trainer.main import train
from trainer.training.checkpoint import latest_checkpoint, load_state
from trainer.training.distributed import DistContext
from trainer.training.loop import Trainer
from trainer.training.preemption import DONE, SIGTERM_EXIT, Preempted, stop_on_sigterm

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.slow
def test_sigterm_during_validation_stops_with_the_epochs_checkpoint(
        tmp_path: Path, shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    cfg = small_config(shards, run_dir, optim={"epochs": 2, "frozen_cnn_epochs": 2})
    validate = Trainer.validate

    def sigterm_first(self: Trainer, epoch: int) -> dict[str, float]:
        os.kill(os.getpid(), signal.SIGTERM)  # as torchrun forwards it, mid-validation
        return validate(self, epoch)

    monkeypatch.setattr(Trainer, "validate", sigterm_first)
    with stop_on_sigterm(), pytest.raises(Preempted) as stopped:
        train(cfg, CPU, "latest")
    assert stopped.value.exit_code == SIGTERM_EXIT
    state = load_state(latest_checkpoint(run_dir))
    assert (state.epoch, state.step_in_epoch, state.global_step) == (1, 0, 10)
    assert (run_dir / DONE).read_text() == "10\n"
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert client.get_run(state.mlflow_run_id).info.status == "KILLED"

    monkeypatch.setattr(Trainer, "validate", validate)
    assert train(cfg, CPU, "latest")["mlflow_run_id"] == state.mlflow_run_id
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in history] == [0, 1]
