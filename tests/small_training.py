"""A small model trained by the project's own Trainer for tests that need a really trained one."""

from __future__ import annotations

from pathlib import Path

import torch

from defrag.vocab import Vocabulary
from trainer.config import Config
from trainer.model import DeFragModel
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import TrainState
from trainer.training.distributed import DistContext
from trainer.training.loop import Trainer


def small_config(shards: Path, run_dir: Path, **sections: dict) -> Config:
    """One epoch of 10 steps (batch 20) of a 16-d model on 64 px images with the CNN fixed;
    `sections` (e.g. `optim={"epochs": 2}`) override keys of their section."""
    base = {
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64, "train_word_vectors": True},
        "data": {"shards": str(shards), "workers": 0, "shuffle_buffer": 10},
        "optim": {"batch_size": 20, "epochs": 1, "frozen_cnn_epochs": 1},
        "run": {"run_dir": str(run_dir)},
    }
    return Config.from_dict({key: {**base.get(key, {}), **sections.get(key, {})}
                             for key in base.keys() | sections.keys()})


def train_small(shards: Path, run_dir: Path, epochs: int, lr: float, model: dict | None = None,
                objective: dict | None = None) -> Path:
    """Train on `shards` in this process with the CNN fixed and no tracking (64-d embeddings of
    64 px images unless `model` says otherwise); the best model folder."""
    cfg = Config.from_dict({
        "model": {"embed_dim": 64, "word_dim": 32, "image_size": 64, "train_word_vectors": True,
                  **(model or {})},
        "objective": objective or {},
        "data": {"shards": str(shards), "workers": 0, "shuffle_buffer": 200},
        "optim": {"batch_size": 20, "lr": lr, "epochs": epochs, "frozen_cnn_epochs": epochs,
                  "anneal_last_epochs": 0},
        "run": {"run_dir": str(run_dir)},
    })
    run_dir.mkdir(parents=True)
    torch.manual_seed(cfg.seed)
    vocab = Vocabulary.load(shards / "vocab.json")
    network = DeFragModel.from_config(cfg.model, vocab, seed=cfg.seed)
    Trainer(cfg, DistContext(0, 1, 0, torch.device("cpu")), network, vocab,
            Tracker(None, None, None), TrainState()).fit()
    return run_dir / "best"
