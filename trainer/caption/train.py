"""Train the structure-content neural language model (Kiros et al. 2014, 2.5) on the training
captions, each conditioned on its own sentence vector from a trained Kiros encoder (text only,
as the paper trains it):

    torchrun --nproc_per_node N -m trainer.caption.train \\
        --config launch/configs/flickr8k-captioner.yaml

Each rank reads the captions of its share of the training shards (no image is decoded), embeds
them once with the encoder, and every epoch trains on its prediction windows in an order that is
a function of (seed, epoch, rank), the same number of steps on every rank (DDP). After each epoch
rank 0 measures dev perplexity; the captioner folder of the best epoch
(trainer/caption/captioner.py) is kept as best/ and registered. Checkpoints, resume (mid-epoch too)
and clean stops on request work as in trainer.main (trainer/training/run.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from trainer.caption.captioner import CaptionerParts, save_captioner
from trainer.caption.data import (
    NUM_TAGS,
    Caption,
    Windows,
    read_captions,
    scnlm_vocab_size,
    sentence_vectors,
)
from trainer.caption.scnlm import SCNLM
from trainer.config import Config, ConfigError
from trainer.data.reader import ReadOptions
from trainer.data.shardset import train_split, val_split
from trainer.store.model_folder import ModelFolder
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import TrainState, save_checkpoint
from trainer.training.distributed import DistContext
from trainer.training.engine import DDPEngine
from trainer.training.preemption import acknowledge, stop_requested
from trainer.training.run import fit_and_register, main_of
from trainer.training.schedule import learning_rate

log = logging.getLogger("trainer.caption.train")
EXPERIMENT = "defrag-captioner"
EVAL_BATCH = 4096  # windows per dev perplexity pass


def build_scnlm(cfg: Config, vocab_size: int, content_dim: int) -> SCNLM:
    c = cfg.caption
    return SCNLM(vocab_size, NUM_TAGS, content_dim, word_dim=c.word_dim,
                 attribute_dim=c.attribute_dim, factors=c.factors, context=c.context,
                 forward_tags=c.forward_tags, seed=cfg.seed)


def make_optimizer(model: SCNLM, cfg: Config) -> torch.optim.Optimizer:
    """`optim.optimizer` over every SC-NLM parameter (one group, as the engine expects)."""
    groups = [{"params": list(model.parameters()), "name": "scnlm", "lr_scale": 1.0}]
    if cfg.optim.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    return torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                           weight_decay=cfg.optim.weight_decay)


@torch.no_grad()
def perplexity(model: SCNLM, windows: Windows, vectors: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of every word of `windows` (eq. 10-11)."""
    was_training = model.training
    model.eval()
    device = model.output_bias.device
    total = 0.0
    for batch in windows.batches(torch.arange(len(windows)), EVAL_BATCH):
        logits = model(batch.context.to(device), batch.tags.to(device),
                       vectors[batch.caption].to(device))
        total += float(F.cross_entropy(logits, batch.targets.to(device), reduction="sum"))
    model.train(was_training)
    return math.exp(total / max(len(windows), 1))


class CaptionTrainer:
    """The epochs of one SC-NLM run on one rank; rank 0 measures dev perplexity and saves."""

    def __init__(self, cfg: Config, ctx: DistContext, tracker: Tracker, state: TrainState,
                 run_dir: Path) -> None:
        self.cfg, self.ctx, self.tracker, self.state, self.run_dir = cfg, ctx, tracker, state, \
            run_dir
        if cfg.caption.encoder is None:
            raise ConfigError("caption.encoder is not set: give the model folder of a trained "
                              "Kiros encoder (e.g. runs/table2/kiros_lstm_tuned/best)")
        self.encoder_dir = Path(cfg.caption.encoder)
        opened = ModelFolder.open(self.encoder_dir)
        encoder, self.vocab = opened.load_model(), opened.vocab
        if not encoder.sentence.whole_sentence:
            raise ConfigError(f"caption.encoder {self.encoder_dir} has the fragments encoder; "
                              f"the SC-NLM is conditioned on one vector per sentence: train a "
                              f"Kiros encoder (model.sentence_encoder=lstm)")
        options = ReadOptions.from_config(cfg.data)
        split = train_split(cfg.data)
        split.require_trees("the captioner (it reads the captions' part-of-speech tags)")
        mine = split.shards[ctx.rank::ctx.world_size]
        self.captions = read_captions(mine, self.vocab, options, "train")
        self.vectors = sentence_vectors(encoder.sentence, self.vocab,
                                        [c.tokens for c in self.captions], ctx.is_main)
        self.windows = Windows.of(self.captions, self.vocab, cfg.caption.context,
                                  cfg.caption.forward_tags)
        self.per_rank = cfg.optim.per_rank_batch(ctx.world_size)
        self.steps = self.common_steps()
        self.model = build_scnlm(cfg, scnlm_vocab_size(self.vocab),
                                 self.vectors.shape[1]).to(ctx.device)
        self.engine = DDPEngine(self.model, make_optimizer(self.model, cfg), ctx.device,
                                ctx.world_size, cfg.optim.grad_clip)
        self.dev: tuple[Windows, torch.Tensor] | None = None
        self.parts: CaptionerParts | None = None
        all_captions, all_vectors = self.gathered_captions()
        if ctx.is_main:
            dev = read_captions(val_split(cfg.data).shards, self.vocab, options, "dev")
            self.dev = (Windows.of(dev, self.vocab, cfg.caption.context,
                                   cfg.caption.forward_tags),
                        sentence_vectors(encoder.sentence, self.vocab, [c.tokens for c in dev]))
            self.parts = CaptionerParts.build(all_captions, all_vectors)

    def common_steps(self) -> int:
        """Steps per epoch: every rank takes as many as the rank with the fewest windows can
        (the rest of a rank's windows wait for a later epoch's order)."""
        steps = torch.tensor([len(self.windows) // self.per_rank])
        if self.ctx.world_size > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        if int(steps) == 0:
            raise ValueError(f"{len(self.windows)} training words on rank {self.ctx.rank} "
                             f"(its {len(self.captions)} captions) make no batch of "
                             f"{self.per_rank}: lower optim.batch_size, or run fewer processes "
                             f"than the training split has shards")
        return int(steps)

    def gathered_captions(self) -> tuple[list[Caption], torch.Tensor]:
        """Every rank's training captions and their vectors, on rank 0 (the captioner folder's
        sentences and language model are built from all of them)."""
        if self.ctx.world_size == 1:
            return self.captions, self.vectors
        mine = (self.captions, self.vectors)
        parts: list | None = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(mine, parts, dst=0)
        if not parts:
            return [], self.vectors[:0]
        return ([c for captions, _ in parts for c in captions],
                torch.cat([vectors for _, vectors in parts]))

    def resume(self, folder: Path) -> None:
        self.engine.load(folder, with_optimizer=True)
        log.info("resumed from %s (epoch %d, step %d)", folder, self.state.epoch,
                 self.state.global_step)

    def fit(self) -> TrainState:
        for epoch in range(self.state.epoch, self.cfg.optim.epochs):
            self.state.epoch = epoch
            started = time.perf_counter()
            train_nll = self.train_epoch(epoch)
            self.end_epoch(epoch, train_nll, time.perf_counter() - started)
            stop = stop_requested(self.run_dir, self.ctx)  # e.g. a SIGTERM during dev perplexity
            if stop:  # the end-of-epoch checkpoint is the stop's
                raise acknowledge(self.run_dir, self.ctx, self.state.global_step, stop)
        return self.state

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's windows for `epoch`: a permutation drawn from (seed, epoch, rank), cut to
        the common number of steps."""
        seed = np.random.SeedSequence([self.cfg.seed, epoch, self.ctx.rank]).generate_state(1)
        generator = torch.Generator().manual_seed(int(seed[0]))
        return torch.randperm(len(self.windows), generator=generator)[:self.steps * self.per_rank]

    def train_epoch(self, epoch: int) -> float:
        """One epoch of cross-entropy steps; the mean training negative log-likelihood per word
        over every rank (of the steps this process ran)."""
        lr = learning_rate(epoch, self.cfg)
        self.engine.set_lr(lr)
        self.model.train()
        done = self.state.step_in_epoch
        order = self.epoch_order(epoch)[done * self.per_rank:]
        total = torch.zeros(2, dtype=torch.float64)  # summed nll, words
        with tqdm(total=self.steps, initial=done, desc=f"epoch {epoch}",
                  disable=not self.ctx.is_main, dynamic_ncols=True) as bar:
            for index, batch in enumerate(self.windows.batches(order, self.per_rank), start=done):
                logits = self.engine(batch.context.to(self.ctx.device),
                                     batch.tags.to(self.ctx.device),
                                     self.vectors[batch.caption].to(self.ctx.device))
                loss = F.cross_entropy(logits, batch.targets.to(self.ctx.device))
                value = loss.item()
                if not math.isfinite(value):
                    raise FloatingPointError(f"non-finite loss at step {self.state.global_step} "
                                             f"(epoch {epoch}): lower optim.lr, then resume")
                self.engine.backward(loss)
                self.engine.step()
                total += torch.tensor([value * len(batch), len(batch)], dtype=torch.float64)
                self.state.step_in_epoch, self.state.global_step = index + 1, \
                    self.state.global_step + 1
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}")
                if self.state.global_step % self.cfg.run.log_every_steps == 0:
                    self.tracker.log_metrics({"train/loss": value, "train/lr": lr},
                                             step=self.state.global_step)
                stop = stop_requested(self.run_dir, self.ctx)
                if stop:
                    self.checkpoint()
                    raise acknowledge(self.run_dir, self.ctx, self.state.global_step, stop)
                every = self.cfg.run.checkpoint_every_steps
                if every and self.state.global_step % every == 0 and index + 1 < self.steps:
                    self.checkpoint()
        if self.ctx.world_size > 1:
            dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] else float("nan")

    def end_epoch(self, epoch: int, train_nll: float, train_seconds: float) -> None:
        """Dev perplexity (rank 0, shared with every rank), the best captioner folder, the
        epoch's record, then a checkpoint (all ranks)."""
        started = time.perf_counter()
        dev_perplexity = torch.zeros(1, dtype=torch.float64)
        if self.ctx.is_main:
            dev_perplexity[0] = perplexity(self.model, *self.dev)
        if self.ctx.world_size > 1:
            dist.broadcast(dev_perplexity, src=0)
        stop_requested(self.run_dir, self.ctx)  # a lock lost meanwhile: RunDirLost, no writes
        metrics = {"perplexity": float(dev_perplexity[0]),
                   "train_perplexity": math.exp(train_nll)}
        self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
        best = -metrics["perplexity"] > self.state.best_score
        if best:
            self.state.best_score, self.state.best_epoch = -metrics["perplexity"], epoch
        if self.ctx.is_main:
            times = {"train_s": round(train_seconds, 1),
                     "val_s": round(time.perf_counter() - started, 1)}
            log.info("epoch %d: train perplexity %.2f, dev perplexity %.2f%s", epoch,
                     metrics["train_perplexity"], metrics["perplexity"], " (best)" if best else "")
            self.tracker.log_metrics({"train/perplexity": metrics["train_perplexity"],
                                      "val/perplexity": metrics["perplexity"],
                                      **{f"time/{k}": v for k, v in times.items()}},
                                     step=self.state.global_step)
            with (self.run_dir / "history.jsonl").open("a") as history:
                history.write(json.dumps({"epoch": epoch, **times, **metrics}) + "\n")
            if best:
                save_captioner(self.run_dir / "best", self.encoder_dir, self.model, self.cfg,
                               self.parts, {**metrics, "epoch": epoch})
        self.checkpoint()

    def checkpoint(self) -> None:
        self.state.mlflow_run_id = self.tracker.run_id
        save_checkpoint(self.engine, self.state, self.run_dir, self.ctx.rank,
                        self.cfg.run.keep_checkpoints, self.cfg)


def train(cfg: Config, ctx: DistContext, resume: str) -> dict:
    """Train and register the best captioner; the run's summary (trainer/training/run.py)."""
    torch.manual_seed(cfg.seed)
    return fit_and_register(
        cfg, ctx, resume,
        lambda tracker, state: CaptionTrainer(cfg, ctx, tracker, state, Path(cfg.run.run_dir)),
        best=lambda state: {"best_dev_perplexity": -state.best_score}, experiment=EXPERIMENT)


main = main_of(train, "trainer.caption.train", __doc__)

if __name__ == "__main__":
    main()
