"""What a training run tells its user as it goes: one log line per change of phase, objective,
CNN training or lr, a progress bar over every long pass (the epoch's steps, the validation
images, the score matrix), and each epoch's plan in `history.jsonl`."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from trainer.config import Config
from trainer.training.distributed import DistContext

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.slow
def test_phase_and_lr_changes_are_logged_and_kept_in_the_history(
        tmp_path, shards, monkeypatch, caplog, capfd) -> None:
    from trainer.main import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = Config.from_dict({
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64},
        "data": {"shards": str(shards), "workers": 0, "resampled": True, "epoch_pairs": 40},
        "optim": {"batch_size": 20, "lr": 0.005, "epochs": 4, "frozen_cnn_epochs": 2,
                  "anneal_last_epochs": 1, "cnn_lr_scale": 0.1},
        "run": {"run_dir": str(tmp_path / "run")},
    })
    with caplog.at_level(logging.INFO, logger="trainer"):
        train(cfg, CPU, resume="none")
    plans = [r.getMessage() for r in caplog.records if ": phase " in r.getMessage()]
    assert plans == [
        "epoch 0: phase 1: objective C_0 (eq. 4), CNN fixed, lr 0.005",
        "epoch 2: phase 2: objective C_F with MIL (eq. 5), CNN finetuned (lr x 0.1), lr 0.005",
        "epoch 3: phase 2: objective C_F with MIL (eq. 5), CNN finetuned (lr x 0.1), lr 0.0005",
    ]
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").open()]
    assert [(h["epoch"], h["phase"], h["mil"], h["finetunes_cnn"]) for h in history] == [
        (0, 1, False, False), (1, 1, False, False), (2, 2, True, True), (3, 2, True, True)]
    assert [h["lr"] for h in history] == pytest.approx([0.005, 0.005, 0.005, 0.0005])
    assert all("rsum" in h and "val_s" in h for h in history)
    bars = capfd.readouterr().err
    for bar in ("epoch 0", "epoch 3", "embed val", "score matrix"):
        assert f"{bar}: 100%" in bars, bar


def test_lr_decays_every_epoch_and_anneals_at_the_end() -> None:
    """lr x lr_decay ** epoch (Kiros 4.1), x anneal_factor for the last epochs (paper 3.4)."""
    from trainer.training.schedule import learning_rate

    cfg = Config.from_dict({"optim": {"lr": 1.0, "lr_decay": 0.5, "epochs": 4,
                                      "anneal_last_epochs": 1, "anneal_factor": 0.1}})
    assert [learning_rate(e, cfg) for e in range(4)] == pytest.approx([1, 0.5, 0.25, 0.0125])


def test_hardest_negatives_start_after_the_warm_up() -> None:
    """VSE++: summed hinges before objective.hardest_negative_from_epoch, the hardest after."""
    from trainer.training.schedule import describe_plan, epoch_plan

    cfg = Config.from_dict({"objective": {"hardest_negative": True,
                                          "hardest_negative_from_epoch": 2}})
    assert [epoch_plan(e, cfg)["hardest_negative"] for e in range(4)] == [False, False, True,
                                                                         True]
    assert describe_plan(epoch_plan(2, cfg), cfg).endswith(", hardest negatives (VSE++)")
    off = Config.from_dict({"objective": {"hardest_negative_from_epoch": 2}})
    assert not any(epoch_plan(e, off)["hardest_negative"] for e in range(4))


@pytest.mark.parametrize("name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam)])
def test_optimizer_is_the_configured_one_with_head_and_cnn_groups(name, cls) -> None:
    from defrag.vocab import Vocabulary
    from trainer.model import DeFragModel
    from trainer.training.engine import optimizer_for_phase

    cfg = Config.from_dict({"model": {"embed_dim": 8, "word_dim": 4, "pretrained": False},
                            "optim": {"optimizer": name, "lr": 0.5, "cnn_lr_scale": 0.1}})
    model = DeFragModel.from_config(cfg.model, Vocabulary(words=["a", "b"], relations=["x"]))
    optimizer = optimizer_for_phase(model, cfg, finetune_cnn=True)
    assert type(optimizer) is cls
    assert [(g["name"], g["lr_scale"]) for g in optimizer.param_groups] == [("head", 1.0),
                                                                            ("cnn", 0.1)]
