"""The training loop, as the paper's Section 3.4 describes it.

    for each epoch:
        phase 1 (the first `frozen_cnn_epochs`): objective C_0 (no MIL), CNN fixed
        phase 2: objective C_F (MIL) and the CNN finetuned end to end (its top
                 `model.finetune_blocks` blocks, on the cached maps of the blocks below)
        lr x lr_decay per epoch (1: none), x anneal_factor for the last `anneal_last_epochs`
        for each batch: embed fragments, C_F + beta C_G over the global batch, optimizer step
        validate (retrieval on the val split), keep the best model by val rsum, checkpoint
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from tqdm import tqdm

from defrag.vocab import Vocabulary
from trainer.batch import Batch, batches_on_device, unit_float
from trainer.config import Config
from trainer.data.eval_set import load_eval_set
from trainer.data.feature_cache import FeatureCache, feature_stamp, trunk_stamp
from trainer.data.shardset import training_featurizer
from trainer.data.train_loader import MIRROR, make_train_loader
from trainer.evaluate import evaluate_model
from trainer.model import DeFragModel
from trainer.objectives import DeFragLoss, same_group_entries, scan_settings
from trainer.pictures import alignment_figure
from trainer.store.model_folder import save_model_folder
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import TrainState, save_checkpoint
from trainer.training.distributed import DistContext
from trainer.training.engine import build_engine
from trainer.training.preemption import acknowledge, stop_requested
from trainer.training.schedule import describe_plan, epoch_plan, finetunes_cnn

log = logging.getLogger(__name__)


def image_fragments_per_pair(v_box: torch.Tensor, batch: Batch) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """Each pair owns the box embeddings of its image: the loss's (v [Nv, d], v_owner [Nv])."""
    pairs, boxes = same_group_entries(batch.sentence_image, batch.box_image)
    return v_box[boxes], pairs


class Trainer:
    """Runs the epochs of one training run on one rank; rank 0 validates, logs and saves."""

    def __init__(self, cfg: Config, ctx: DistContext, model: DeFragModel, vocab: Vocabulary,
                 tracker: Tracker, state: TrainState) -> None:
        self.cfg, self.ctx, self.model, self.vocab = cfg, ctx, model, vocab
        self.tracker, self.state = tracker, state
        self.run_dir = Path(cfg.run.run_dir)
        objective = cfg.objective
        self.loss_fn = DeFragLoss(objective.beta, objective.margin, objective.smooth,
                                  objective.mil, objective.balance, objective.use_fragment,
                                  objective.use_global, objective.hardest_negative,
                                  ctx.world_size, cfg.run.global_negatives, objective.score,
                                  scan=scan_settings(objective))
        caching = cfg.run.cache_frozen_features
        self.cache = (FeatureCache(cfg.run.feature_cache, feature_stamp(cfg), ctx.rank)
                      if caching else None)
        # phase 2 with model.finetune_blocks: the maps of the fixed blocks below the top ones
        self.trunk_cache = (FeatureCache(cfg.run.feature_cache, trunk_stamp(cfg), ctx.rank,
                                         trunk=True)
                            if caching and cfg.model.finetune_blocks else None)
        self.loader, self.steps = make_train_loader(cfg, vocab, ctx.rank, ctx.world_size,
                                                    device=ctx.device)
        self.eval_set = load_eval_set(cfg, vocab, rank=ctx.rank, world_size=ctx.world_size)
        self.featurizer = training_featurizer(cfg.data) if ctx.is_main else None  # read once
        self.engine = None
        self.engine_finetunes: bool | None = None
        self.nonfinite_streak = 0  # non-finite losses in a row
        self.plan: dict[str, int | bool | float] | None = None  # the current epoch's

    def start_epoch(self, epoch: int) -> None:
        """Set up this epoch's plan: the engine built (or rebuilt at the phase switch), the
        objective's MIL on or off; one log line when the plan changes (and for the first epoch
        this process runs)."""
        plan = epoch_plan(epoch, self.cfg)
        if plan != self.plan and self.ctx.is_main:
            log.info("epoch %d: %s", epoch, describe_plan(plan, self.cfg))
        self.plan = plan
        if self.engine is None or plan["finetunes_cnn"] != self.engine_finetunes:
            self.engine = build_engine(self.model, self.cfg, plan["finetunes_cnn"],
                                       self.ctx.device, self.ctx.world_size)
            self.engine_finetunes = plan["finetunes_cnn"]
        self.loss_fn.mil = plan["mil"]
        self.loss_fn.hardest_negative = plan["hardest_negative"]

    def resume(self, folder: Path) -> None:
        """Continue from a checkpoint: the weights, and the optimizer unless the phase changed."""
        self.start_epoch(self.state.epoch)
        same_phase = self.engine_finetunes == self.state.finetunes_cnn
        self.engine.load(folder, with_optimizer=same_phase)
        log.info("resumed from %s (epoch %d, step %d)", folder, self.state.epoch,
                 self.state.global_step)

    def fit(self) -> TrainState:
        for epoch in range(self.state.epoch, self.cfg.optim.epochs):
            self.start_epoch(epoch)
            self.state.epoch = epoch
            started = time.perf_counter()
            self.train_epoch(epoch)
            self.end_epoch(epoch, train_seconds=time.perf_counter() - started)
            self.stop_if_requested(saved=True)  # e.g. a SIGTERM during the validation
        return self.state

    def stop_if_requested(self, saved: bool = False) -> None:
        """Collective: on a requested stop, checkpoint (unless `saved` just did) and raise
        Preempted on every rank."""
        stop = stop_requested(self.run_dir, self.ctx)  # e.g. SLURM's time limit
        if stop:
            if not saved:
                self.checkpoint()
            raise acknowledge(self.run_dir, self.ctx, self.state.global_step, stop)

    def train_epoch(self, epoch: int) -> None:
        lr = self.plan["lr"]
        self.engine.set_lr(lr)
        self.model.train()
        self.loader.set_epoch(epoch, skip_pixels=self.cached_images(epoch))
        steps, done = self.steps, self.state.step_in_epoch
        started, pairs_seen = time.perf_counter(), 0
        batches = batches_on_device(self.loader.batches(skip=done), self.ctx.device)
        # closed however the epoch ends (a preemption, an error): no bar left to print at exit
        with tqdm(total=steps, initial=done, desc=f"epoch {epoch}",
                  disable=not self.ctx.is_main, dynamic_ncols=True) as bar:
            for index, batch in enumerate(batches, start=done):
                losses = self.train_step(batch, epoch)
                self.state.step_in_epoch = index + 1
                self.state.global_step += 1
                pairs_seen += len(batch.image_key) * self.ctx.world_size
                bar.update(1)
                bar.set_postfix(loss=f"{losses['loss']:.4f}")
                if self.state.global_step % self.cfg.run.log_every_steps == 0:
                    rate = pairs_seen / (time.perf_counter() - started)
                    self.tracker.log_metrics({**{f"train/{k}": v for k, v in losses.items()},
                                              "train/lr": lr, "train/pairs_per_s": rate},
                                             step=self.state.global_step)
                self.stop_if_requested()
                every = self.cfg.run.checkpoint_every_steps
                if every and self.state.global_step % every == 0 and index + 1 < steps:
                    self.checkpoint()

    def frozen_cache(self, finetuning: bool) -> FeatureCache | None:
        """The cache of what the CNN's fixed part computes in a phase: the boxes' features of
        the fixed CNN, or, while its top blocks finetune, the maps of the blocks below them
        (None: nothing is cached, or the whole CNN finetunes)."""
        return self.trunk_cache if finetuning else self.cache

    def cached_images(self, epoch: int) -> frozenset[str]:
        """Images whose pixels this epoch need not decode: their features (or trunk maps) are
        in this rank's cache (from a previous epoch, or the disk cache)."""
        cache = self.frozen_cache(finetunes_cnn(epoch, self.cfg))
        if cache is None:
            return frozenset()
        cached = cache.features  # with data.hflip, a pass may show either view
        return frozenset(key for key in cached
                         if not self.cfg.data.hflip or key + MIRROR in cached)

    def train_step(self, batch: Batch, epoch: int) -> dict[str, float]:
        """One optimizer step on the global batch (forward, loss, backward, step): the global
        loss terms."""
        cached = {}
        cache = self.frozen_cache(finetunes_cnn(epoch, self.cfg))
        if cache is not None:
            rows = cache.lookup(self.model, batch.images, batch.boxes, batch.box_image,
                                batch.image_ids, batch.decoded)
            cached = {"maps" if cache.trunk else "features": rows}
        inputs, pairs = self.model.sentence.batch_inputs(batch), len(batch.image_key)
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16,
                            enabled=self.cfg.run.bf16 and self.ctx.device.type == "cuda"):
            v_box, s = self.engine(batch.images, batch.boxes, batch.box_image, *inputs,
                                   **cached, num_sentences=pairs)
        v, v_owner = image_fragments_per_pair(v_box.float(), batch)
        out = self.loss_fn(v, v_owner, s.float(), self.model.sentence.owners(inputs, pairs),
                           batch.image_key)
        losses = self.loss_fn.mean_over_ranks(out)
        if not all(map(math.isfinite, losses.values())):
            return self.nonfinite_loss(losses)
        self.nonfinite_streak = 0
        self.engine.backward(out["loss"])
        self.engine.step()
        return losses

    def nonfinite_loss(self, losses: dict[str, float]) -> dict[str, float]:
        """A NaN / inf loss: every rank sees the same all-reduced value and acts alike. Skipped
        steps in a row mean the weights themselves are no longer finite: the run stops."""
        message = (f"non-finite loss {list(losses.values())} at step {self.state.global_step} "
                   f"(epoch {self.state.epoch}); the last checkpoint is untouched")
        self.nonfinite_streak += 1
        if self.cfg.run.nonfinite_loss == "stop":
            raise FloatingPointError(message + "; stopping (run.nonfinite_loss=stop)")
        if self.nonfinite_streak >= self.cfg.run.max_nonfinite_steps:
            raise FloatingPointError(
                f"{message}; stopping after {self.nonfinite_streak} non-finite losses in a row "
                f"(run.max_nonfinite_steps): the weights have diverged (see train/loss before "
                f"it), lower optim.lr or set optim.grad_clip, then resume from the checkpoint")
        log.warning("%s; skipping the step (run.nonfinite_loss=skip)", message)
        self.engine.skip_step()
        return losses

    def end_epoch(self, epoch: int, train_seconds: float) -> None:
        """Validate, note a new best val rsum in the state, record the epoch (rank 0), then
        checkpoint (all ranks)."""
        started = time.perf_counter()
        metrics = self.validate(epoch)
        stop_requested(self.run_dir, self.ctx)  # a lock lost meanwhile: RunDirLost, no writes
        times = {"train_s": round(train_seconds, 1),
                 "val_s": round(time.perf_counter() - started, 1)}
        self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
        best = metrics["rsum"] > self.state.best_score
        if best:
            self.state.best_score, self.state.best_epoch = metrics["rsum"], epoch
        if self.ctx.is_main:
            self.record_epoch(epoch, times, metrics, best)
        self.checkpoint()

    def record_epoch(self, epoch: int, times: dict[str, float], metrics: dict[str, float],
                     best: bool) -> None:
        """Rank 0's record of an epoch: its timings as metrics, a `history.jsonl` line (plan,
        timings, val metrics), and the model folder `best/` when val rsum is the best so far."""
        self.tracker.log_metrics({f"time/{k}": v for k, v in times.items()},
                                 step=self.state.global_step)
        with (self.run_dir / "history.jsonl").open("a") as history:
            history.write(json.dumps({"epoch": epoch, **self.plan, **times, **metrics}) + "\n")
        if best:
            save_model_folder(self.run_dir / "best", self.model, self.cfg, self.vocab,
                              {**metrics, "epoch": epoch}, self.featurizer)

    def validate(self, epoch: int) -> dict[str, float]:
        """Retrieval metrics of the val split: every rank embeds its share of the val shards,
        rank 0 scores them; every rank learns the val rsum."""
        rsum = torch.zeros(1)
        frozen = self.frozen_cache(bool(self.engine_finetunes))
        result = evaluate_model(self.model, self.eval_set, self.cfg, self.ctx.device,
                                progress=self.ctx.is_main, cache=frozen)
        metrics: dict[str, float] = {}
        if result is not None:
            metrics, line = result
            rsum[0] = metrics["rsum"]
            self.tracker.log_metrics({f"val/{k}": v for k, v in metrics.items()},
                                     step=self.state.global_step)
            log.info("epoch %d val (%s): %s", epoch, line,
                     " ".join(f"{k}={v:.1f}" for k, v in metrics.items()))
            if "fragments" in self.model.sentence.inputs:  # Figure 4 aligns triplet fragments
                self.tracker.log_image(self.alignment_picture(),
                                       f"alignments/epoch-{epoch:03d}.png")
        self.log_data_problems()
        if self.ctx.world_size > 1:
            dist.broadcast(rsum, src=0)
        return {**metrics, "rsum": float(rsum[0])}

    def log_data_problems(self) -> None:
        """Rank 0 logs the distinct data problems every rank's loader met so far: skipped
        samples and samples lost to damaged shards (metrics, and `data_problems.txt`)."""
        problems = list(self.loader.problems.values())
        if self.ctx.world_size > 1:
            gathered: list[list] = [[] for _ in range(self.ctx.world_size)]
            dist.all_gather_object(gathered, problems)
            # one shard can be dealt to several ranks over the epochs: each problem once
            problems = list({p.message: p for part in gathered for p in part}.values())
        if not self.ctx.is_main:
            return
        self.tracker.log_metrics({
            "data/skipped_samples": sum(p.kind == "sample" for p in problems),
            "data/lost_samples": sum(p.lost for p in problems if p.kind == "shard")},
            step=self.state.global_step)
        if problems:
            path = self.run_dir / "data_problems.txt"
            path.write_text("".join(f"{p.message}\n" for p in problems))  # masked at the source
            self.tracker.log_artifact(path)

    @torch.no_grad()
    def alignment_picture(self) -> Image.Image:
        """Paper Figure 4 for the first val image: each fragment of its first caption linked to
        its best box."""
        first, device = self.eval_set.first, self.ctx.device
        boxes = torch.from_numpy(first.boxes)
        fragments = torch.from_numpy(first.fragments[0])
        image = unit_float(torch.tensor(first.pixels).permute(2, 0, 1)[None])  # channels-last
        image = image.to(device)
        was_training = self.model.training
        self.model.eval()
        v = self.model.image(image, boxes.to(device), torch.zeros(len(boxes), dtype=torch.long,
                                                                   device=device))
        s = self.model.sentence(fragments.to(device),
                                torch.zeros(len(fragments), dtype=torch.long, device=device))
        self.model.train(was_training)
        picture, _ = alignment_figure(Image.fromarray(first.pixels), boxes, first.captions[0], v,
                                      s, fragments, self.vocab, self.cfg.model.fragment_mode)
        return picture

    def checkpoint(self) -> None:
        for cache in (self.cache, self.trunk_cache):
            if cache is not None:
                cache.save()
        self.state.mlflow_run_id = self.tracker.run_id
        self.state.finetunes_cnn = bool(self.engine_finetunes)
        save_checkpoint(self.engine, self.state, self.run_dir, self.ctx.rank,
                        self.cfg.run.keep_checkpoints, self.cfg)
