"""Train DeFrag: `torchrun --nproc_per_node N -m trainer.main --config FILE [section.key=value]`.

Joins the process group, builds the model from the shards' vocabulary, resumes from the run's
latest checkpoint when there is one (so torchrun restarts and SLURM requeues continue), trains
(trainer/training/loop.py), and registers the best model in MLflow (the run's life, shared with
the captioner's training: trainer/training/run.py). Rank 0 holds the run folder's
lock for the whole run (trainer/training/run_lock.py). A run asked to stop (the PREEMPT file, or
SIGTERM: trainer/training/preemption.py) checkpoints and exits 0 (143 after SIGTERM) without
registering.
"""

from __future__ import annotations

import torch

from trainer.config import Config
from trainer.data.shardset import load_vocabulary
from trainer.model import DeFragModel
from trainer.training.distributed import DistContext
from trainer.training.loop import Trainer
from trainer.training.run import fit_and_register, main_of


def train(cfg: Config, ctx: DistContext, resume: str) -> dict:
    """Train DeFrag and register the best model; the run's summary."""
    torch.manual_seed(cfg.seed)
    vocab = load_vocabulary(cfg.data)
    model = DeFragModel.from_config(cfg.model, vocab, seed=cfg.seed).to(ctx.device)
    return fit_and_register(
        cfg, ctx, resume, lambda tracker, state: Trainer(cfg, ctx, model, vocab, tracker, state),
        best=lambda state: {"best_val_rsum": state.best_score})


main = main_of(train, "trainer.main", __doc__)

if __name__ == "__main__":
    main()
