"""One training step over 2 and 3 real gloo processes, with DDP and with DeepSpeed ZeRO, gives
the same parameters as one process stepping on the concatenated batch (docs/design.md section 7),
for every sentence encoder with its paper's score.

The step is the trainer's own (`Trainer.train_step`: real EfficientNet-Lite0, RoIAlign regions,
global-negative gather, loss scaling, engine backward and optimizer step) on real synthetic
shards. The fragment encoder steps in both phases (cached frozen CNN features with C_0, then MIL
and finetuning: the whole CNN, and its top 2 blocks on cached trunk maps); the other encoders in
phase 1, where their own parameters are what differs (the image side and the gather are the same
code).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from defrag.vocab import Vocabulary
from trainer.batch import collate
from trainer.config import Config
from trainer.data.reader import SampleDecoder, read_images
from trainer.data.shardset import locate_split
from trainer.model import DeFragModel
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import TrainState
from trainer.training.distributed import DistContext, end_process
from trainer.training.loop import Trainer

# (image, caption) of the global batch; images 0 and 2 have captions on different ranks.
PAIRS = [(0, 0), (0, 1), (1, 0), (2, 0), (2, 3), (3, 1), (1, 2)]
SPLITS = {2: [3, 4], 3: [2, 3, 2]}  # pairs per rank


# A whole-sentence encoder trains with Kiros et al.'s objective: cosine scores, C_G alone.
KIROS = {"use_fragment": False, "score": "cosine", "margin": 0.2}
# The tree encoders with Socher et al.'s: inner-product scores, C_G alone.
SOCHER = {"use_fragment": False, "score": "inner", "margin": 3.0}
# SCAN's word encoder with its text-to-image score and VSE++'s hardest-negative hinge.
SCAN = {"use_fragment": False, "score": "scan_t2i", "margin": 0.2, "hardest_negative": True}


def make_config(shards, engine: str, stage: int, encoder: str = "fragments",
                finetune_blocks: int | None = None) -> Config:
    return Config.from_dict({
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64, "train_word_vectors": True,
                  "sentence_encoder": encoder, "finetune_blocks": finetune_blocks},
        "objective": ({} if encoder == "fragments" else SCAN if encoder == "bigru" else
                      SOCHER if encoder in ("dtrnn", "sdtrnn") else KIROS),
        "data": {"shards": str(shards), "workers": 0},
        "optim": {"lr": 0.5, "batch_size": len(PAIRS), "frozen_cnn_epochs": 1, "epochs": 2},
        "run": {"engine": engine, "deepspeed_config": f"launch/deepspeed/zero{stage}.json"},
    })


def step_parameters(cfg: Config, ctx: DistContext, pair_ids: list[tuple[int, int]],
                    epoch: int) -> list[torch.Tensor]:
    """The model's parameters after one trainer step on `pair_ids` (seeded init)."""
    vocab = Vocabulary.load(f"{cfg.data.shards}/vocab.json")
    first_shard = locate_split(cfg.data.shards, "train").shards[:1]
    images = list(read_images(first_shard, SampleDecoder.from_config(cfg, vocab)))
    batch = collate([images[i].pairs()[c] for i, c in pair_ids])
    model = DeFragModel.from_config(cfg.model, vocab, seed=0).to(ctx.device)  # as trainer.main
    trainer = Trainer(cfg, ctx, model, vocab, Tracker(None, None, None), TrainState())
    trainer.start_epoch(epoch)
    trainer.model.train()
    trainer.train_step(batch.to(ctx.device), epoch)
    return [p.detach().clone() for p in model.parameters()]


# (sentence encoder, model.finetune_blocks)
ENCODERS = (("fragments", None), ("fragments", 2), ("lstm", None), ("linear", None),
            ("dtrnn", None), ("sdtrnn", None), ("bigru", None))


def phases(encoder: str, finetune_blocks: int | None) -> tuple[int, ...]:
    """The epochs stepped: phase 1 (cached frozen CNN features, C_0) and, for the fragment
    encoder, phase 2 (MIL, finetuning; only phase 2 differs with finetune_blocks)."""
    if encoder != "fragments":
        return (0,)
    return (0, 1) if finetune_blocks is None else (1,)


@pytest.fixture(scope="module")
def single_process_steps(shards, tmp_path_factory) -> str:
    """One process stepping on the whole batch, for every encoder and phase: a file of the
    parameters after the step, which every distributed test compares with."""
    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    steps = {(*case, epoch): step_parameters(make_config(shards, "ddp", 0, *case), cpu, PAIRS,
                                             epoch)
             for case in ENCODERS for epoch in phases(*case)}
    path = tmp_path_factory.mktemp("single") / "steps.pt"
    torch.save(steps, path)
    return str(path)


def worker(rank: int, world_size: int, init_file: str, shards: str, engine: str,
           stage: int, single_steps: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets; DeepSpeed requires it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    start = sum(SPLITS[world_size][:rank])
    mine = PAIRS[start:start + SPLITS[world_size][rank]]
    wanted = torch.load(single_steps)
    for case in ENCODERS:
        cfg = make_config(shards, engine, stage, *case)
        for epoch in phases(*case):
            got = step_parameters(cfg, DistContext(rank, world_size, rank, torch.device("cpu")),
                                  mine, epoch)
            for a, b in zip(got, wanted[(*case, epoch)], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, c=case: f"{c}: {m}")
    end_process(0)  # destroys the group; gloo may abort at interpreter exit otherwise


@pytest.mark.slow
@pytest.mark.parametrize("engine,stage,world_size", [
    ("ddp", 0, 2), ("ddp", 0, 3), ("deepspeed", 1, 2), ("deepspeed", 2, 3)])
def test_distributed_step_equals_single_process_step(tmp_path, shards, single_process_steps,
                                                     engine, stage, world_size):
    mp.spawn(worker, args=(world_size, str(tmp_path / "store"), str(shards), engine, stage,
                           single_process_steps), nprocs=world_size)


@pytest.mark.parametrize("region_mode", ["roi", "crop"])
def test_gradients_have_their_parameters_layout(shards, region_mode) -> None:
    """DDP's gradient layout contract: a gradient with other strides than its parameter makes DDP
    warn "Grad strides do not match bucket view strides" on every rank and copy it each step
    (EfficientNet-Lite's 1x1 convolutions did: channels-first weights, channels-last images)."""
    cfg = make_config(shards, "ddp", 1)
    cfg.model.region_mode, cfg.model.crop_size = region_mode, 32
    vocab = Vocabulary.load(f"{cfg.data.shards}/vocab.json")
    first_shard = locate_split(cfg.data.shards, "train").shards[:1]
    images = list(read_images(first_shard, SampleDecoder.from_config(cfg, vocab)))
    batch = collate([images[i].pairs()[c] for i, c in PAIRS]).to("cpu")
    model = DeFragModel.from_config(cfg.model, vocab, seed=0)
    model.image.set_cnn_trainable(True)
    v_box, s = model(batch.images, batch.boxes, batch.box_image, batch.fragments,
                     batch.fragment_sentence)
    (v_box.sum() + s.sum()).backward()
    learned = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    assert len(learned) > 40  # the CNN's convolutions included (batch norm stays fixed)
    assert [(name, p.grad.stride(), p.stride()) for name, p in learned
            if p.grad.stride() != p.stride()] == []
