"""Two training engines behind one small interface: plain DDP, or DeepSpeed (ZeRO 0/1/2).

The training loop only calls `engine(...)` (the wrapped model's forward), `backward`, `step`,
`skip_step`, `set_lr`, `save` and `load`. An engine is built per phase (paper 3.4): phase 1
trains the heads with the CNN fixed, phase 2 adds the CNN; both engines register the
parameters that require gradients when they are built, so the phase switch rebuilds the engine
and its optimizer (`optim.optimizer`: its momentum or moments restart at the switch,
identically for both engines).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import Config
from trainer.model import DeFragModel


def optimizer_for_phase(model: DeFragModel, cfg: Config,
                        finetune_cnn: bool) -> torch.optim.Optimizer:
    """`optim.optimizer` (SGD with momentum, paper 3.4, or Adam): a head group, plus the CNN
    group in phase 2."""
    groups = [{"params": model.head_parameters(), "name": "head", "lr_scale": 1.0}]
    if finetune_cnn:
        groups.append({"params": model.cnn_parameters(), "name": "cnn",
                       "lr_scale": cfg.optim.cnn_lr_scale})
    if cfg.optim.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    return torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                           weight_decay=cfg.optim.weight_decay)


class DDPEngine:
    """torch DistributedDataParallel (or the bare model in a single process) + its optimizer."""

    def __init__(self, model: DeFragModel, optimizer: torch.optim.Optimizer,
                 device: torch.device, world_size: int, grad_clip: float | None) -> None:
        self.module = model
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        self.wrapped: nn.Module = model
        if world_size > 1:
            device_ids = [device] if device.type == "cuda" else None
            # Gradients live in DDP's all-reduce buckets: no copy in and out of them per step.
            self.wrapped = DistributedDataParallel(model, device_ids=device_ids,
                                                   gradient_as_bucket_view=True)

    def __call__(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if self.grad_clip:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]

    def save(self, folder: Path, rank: int) -> None:
        """Weights as safetensors, optimizer state with torch.save (loaded weights_only)."""
        if rank == 0:
            state = {k: v.detach().contiguous() for k, v in self.module.state_dict().items()}
            save_file(state, str(folder / "model.safetensors"))
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, folder: Path, with_optimizer: bool) -> None:
        self.module.load_state_dict(load_file(str(folder / "model.safetensors")))
        if with_optimizer:
            state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state)


class DeepSpeedEngine:
    """deepspeed.initialize over the same model and torch optimizer; ZeRO from the JSON file."""

    def __init__(self, model: DeFragModel, optimizer: torch.optim.Optimizer, cfg: Config,
                 per_rank_batch: int, bf16: bool) -> None:
        import deepspeed

        ds_config = json.loads(Path(cfg.run.deepspeed_config).read_text())
        ds_config["train_micro_batch_size_per_gpu"] = per_rank_batch
        ds_config["gradient_accumulation_steps"] = 1
        ds_config.pop("train_batch_size", None)
        ds_config["bf16"] = {"enabled": bf16}
        ds_config["gradient_clipping"] = cfg.optim.grad_clip or 0.0  # DeepSpeed's default: 1.0
        self.module = model
        model.to(memory_format=torch.contiguous_format)  # ZeRO flattens the parameters it holds
        self.wrapped, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)

    def __call__(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.wrapped.backward(loss)

    def step(self) -> None:
        self.wrapped.step()  # also zeroes the gradients

    def skip_step(self) -> None:
        self.wrapped.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def save(self, folder: Path, rank: int) -> None:
        """Every rank writes its own ZeRO partition (DeepSpeed requires all ranks to call it)."""
        self.wrapped.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)

    def load(self, folder: Path, with_optimizer: bool) -> None:
        path, _ = self.wrapped.load_checkpoint(str(folder.parent), tag=folder.name,
                                               load_module_only=not with_optimizer)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {folder}")


def build_engine(model: DeFragModel, cfg: Config, finetune_cnn: bool, device: torch.device,
                 world_size: int) -> DDPEngine | DeepSpeedEngine:
    """The configured engine for one phase, with a fresh optimizer over that phase's parameters."""
    model.image.set_cnn_trainable(finetune_cnn)
    optimizer = optimizer_for_phase(model, cfg, finetune_cnn)
    if cfg.run.engine == "ddp":
        return DDPEngine(model, optimizer, device, world_size, cfg.optim.grad_clip)
    bf16 = cfg.run.bf16 and device.type == "cuda"
    return DeepSpeedEngine(model, optimizer, cfg, cfg.optim.per_rank_batch(world_size), bf16)
