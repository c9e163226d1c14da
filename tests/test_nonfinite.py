"""A NaN / inf loss (here: a real divergence, lr 1e20) is reported; the step is skipped or the run
stops (run.nonfinite_loss), checkpoints keep the last good weights, and a run whose losses stay
non-finite stops instead of skipping forever (run.max_nonfinite_steps)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import Config
from trainer.training.checkpoint import latest_checkpoint, load_state
from trainer.training.distributed import DistContext

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def diverging_config(tmp_path, shards, **run) -> Config:
    """Step 1 is finite; its update at lr 1e20 makes every later loss overflow."""
    return Config.from_dict({
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64},
        "data": {"shards": str(shards), "workers": 0, "shuffle_buffer": 10},
        "optim": {"batch_size": 20, "epochs": 1, "frozen_cnn_epochs": 1, "lr": 1e20},
        "run": {"run_dir": str(tmp_path / "run"), "checkpoint_every_steps": 1,
                "keep_checkpoints": 3, **run},
    })


def weights(step: int, run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def test_stop_keeps_the_last_good_checkpoint(tmp_path, shards, monkeypatch) -> None:
    from trainer.main import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = diverging_config(tmp_path, shards, nonfinite_loss="stop")
    with pytest.raises(FloatingPointError, match=r"non-finite loss .* at step 1 \(epoch 0\); "
                                                 r"the last checkpoint is untouched; stopping"):
        train(cfg, CPU, resume="none")
    run_dir = tmp_path / "run"
    assert load_state(latest_checkpoint(run_dir)).global_step == 1
    assert all(torch.isfinite(w).all() for w in weights(1, run_dir).values())


def test_skipped_steps_leave_the_weights_then_a_streak_stops_the_run(tmp_path, shards,
                                                                    monkeypatch, caplog) -> None:
    from trainer.main import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = diverging_config(tmp_path, shards, nonfinite_loss="skip", max_nonfinite_steps=3)
    with pytest.raises(FloatingPointError, match="after 3 non-finite losses in a row .* lower "
                                                 "optim.lr or set optim.grad_clip"):
        train(cfg, CPU, resume="none")
    run_dir = tmp_path / "run"
    skipped = [r.getMessage() for r in caplog.records if "skipping the step" in r.getMessage()]
    assert len(skipped) == 2 and "at step 1 (epoch 0)" in skipped[0]
    assert load_state(latest_checkpoint(run_dir)).global_step == 3
    good = weights(1, run_dir)
    for step in (2, 3):  # skipped steps did not touch the weights
        assert all(torch.equal(good[k], w) for k, w in weights(step, run_dir).items())
