"""Trainer step throughput: 1 and 2 CPU processes (or one GPU), CNN frozen (phase 1),
finetuned whole (phase 2) and finetuned in its top K blocks on cached trunk maps
(`model.finetune_blocks`), and the finetuning step's overhead over the bare CNN forward +
backward on the same boxes.

The floor is measured in the same run: RoIAlign region features of the batch's boxes, summed and
backpropagated through the CNN (the work a finetuning step cannot avoid). The step adds the
sentence encoder, W_m, the gather, the objective and the SGD update.

    python benchmarks/bench_train.py [--shards DIR --val-split dev] [--batch 100]
        [--image-size 224] [--steps 6] [--processes 1 2] [--finetune-blocks 1 2 3]
        [--device cuda [--bf16]] [--json PATH]

On a GPU (--device cuda: one process) the step also runs under bf16 autocast with --bf16, as
run.bf16 does, and every timed region ends with a device synchronization. Target: the
finetuning step within 1.2x the bare CNN pass. Each row also says the CNN, its region mode and
whether its weights and the batch's images are channels-last (the layout the trainer uses).
For each K of --finetune-blocks: the step on cached maps, the cache's build time (the lower
blocks' forward pass) and its size in memory and on disk, per cached image view.
The JSON line's rows are also written to --json PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from trainer.config import Config
from trainer.data.shardset import load_vocabulary
from trainer.data.train_loader import make_train_loader
from trainer.model import DeFragModel
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import TrainState
from trainer.training.distributed import DistContext
from trainer.training.loop import Trainer

TARGET = 1.2


def make_config(shards: str, batch: int, image_size: int, val_split: str, device: str,
                bf16: bool) -> Config:
    return Config.from_dict({
        "model": {"embed_dim": 1000, "image_size": image_size},
        "data": {"shards": shards, "workers": 0, "val_split": val_split},
        "optim": {"batch_size": batch, "lr": 0.001, "frozen_cnn_epochs": 1, "epochs": 2},
        "run": {"device": device, "bf16": bf16},
    })


def seconds(fn, batch) -> float:
    start = time.perf_counter()
    fn(batch)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_seconds(fn, batches) -> float:
    fn(batches[0])  # warm-up (and, in phase 1, fills the feature cache)
    return statistics.median(seconds(fn, batch) for batch in batches[1:])


def measure(rank: int, world_size: int, shards: str, args, results: dict) -> None:
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    cfg = make_config(shards, args.batch, args.image_size, args.val_split, args.device, args.bf16)
    vocab = load_vocabulary(cfg.data)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    ctx = DistContext(rank, world_size, rank, device)
    trainer = Trainer(cfg, ctx, DeFragModel.from_config(cfg.model, vocab).to(device), vocab,
                      Tracker(None, None, None), TrainState())
    loader, _ = make_train_loader(cfg, vocab, rank, world_size)
    batches = [b.to(device) for _, b in zip(range(args.steps + 1), loader, strict=False)]
    out = {"processes": world_size, "device": str(device), "bf16": cfg.run.bf16,
           "backbone": cfg.model.backbone, "region_mode": cfg.model.region_mode,
           "image_size": args.image_size, "pairs_per_step": args.batch,
           "images_per_step": sum(len(b.image_ids) for b in batches) / len(batches) * world_size}
    trainer.start_epoch(0)  # phase 1, a later epoch: every box's features are cached
    trainer.model.train()
    for batch in batches:
        trainer.cache.lookup(trainer.model, batch.images, batch.boxes, batch.box_image,
                             batch.image_ids, batch.decoded)
    out["frozen_step_s"] = median_seconds(lambda b: trainer.train_step(b, 0), batches)
    out["frozen_steps_per_s"] = 1 / out["frozen_step_s"]
    out["frozen_images_per_s"] = out["images_per_step"] / out["frozen_step_s"]
    if args.whole_cnn:
        out.update(whole_cnn(trainer, batches, cfg, device, out["images_per_step"]))
    out["top_blocks"] = [top_blocks(cfg, ctx, vocab, batches, k) for k in args.finetune_blocks]
    if rank == 0:
        results.update(out)
    if world_size > 1:
        dist.destroy_process_group()


def whole_cnn(trainer: Trainer, batches, cfg: Config, device: torch.device,
              images_per_step: float) -> dict:
    """Phase 2 finetuning the whole CNN: the step, and its overhead over the bare CNN."""
    trainer.start_epoch(1)  # phase 2: MIL, CNN finetuned
    trainer.model.train()
    layout = torch.channels_last
    out = {"channels_last": {  # the finetuned CNN's first convolution, and the images
        "weights": trainer.model.image.backbone.features[0].weight.is_contiguous(
            memory_format=layout),
        "images": all(b.images.is_contiguous(memory_format=layout) for b in batches)}}

    def bare_cnn(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.run.bf16):
            features = trainer.model.image.region_features(batch.images, batch.boxes,
                                                           batch.box_image)
        features.float().sum().backward()
        trainer.model.zero_grad(set_to_none=True)

    # Finetuning steps and bare CNN passes alternate batch by batch, so a slower or faster
    # stretch of a shared machine weighs on both; the overhead is the median of the ratios.
    step, bare = [], []
    trainer.train_step(batches[0], 1)  # warm-up
    for batch in batches[1:]:
        step.append(seconds(lambda b: trainer.train_step(b, 1), batch))
        bare.append(seconds(bare_cnn, batch))
    out["finetune_step_s"], out["bare_cnn_s"] = statistics.median(step), statistics.median(bare)
    out["overhead"] = statistics.median(s / b for s, b in zip(step, bare, strict=True))
    out["finetune_steps_per_s"] = 1 / out["finetune_step_s"]
    out["finetune_images_per_s"] = images_per_step / out["finetune_step_s"]
    return out


def top_blocks(cfg: Config, ctx: DistContext, vocab, batches, k: int) -> dict:
    """Phase 2 finetuning the top `k` blocks on the cached maps of the blocks below: the
    cache's build time and size per image view, and the step once every map is cached."""
    model = dataclasses.replace(cfg.model, finetune_blocks=k)
    with tempfile.TemporaryDirectory() as folder:
        run = dataclasses.replace(cfg.run, feature_cache=folder)
        cfg = dataclasses.replace(cfg, model=model, run=run)
        trainer = Trainer(cfg, ctx, DeFragModel.from_config(model, vocab).to(ctx.device), vocab,
                          Tracker(None, None, None), TrainState())
        trainer.start_epoch(1)
        trainer.model.train()
        cache = trainer.trunk_cache
        build = sum(seconds(lambda b: cache.lookup(trainer.model, b.images, b.boxes,
                                                   b.box_image, b.image_ids, b.decoded), batch)
                    for batch in batches)
        cache.save()
        views = len(cache.features)
        disk = sum(path.stat().st_size for path in cache.folder.iterdir())
        memory = sum(t.numel() * t.element_size() for t in cache.features.values())
        step = median_seconds(lambda b: trainer.train_step(b, 1), batches)
    return {"finetune_blocks": k, "map_shape": list(next(iter(cache.features.values())).shape),
            "build_s_per_image": build / views, "memory_mb_per_image": memory / views / 2**20,
            "disk_mb_per_image": disk / views / 2**20, "step_s": step,
            "trained_parameters": sum(p.numel() for p in trainer.model.image.cnn_parameters())}


def synthetic_shards(root: Path) -> str:
    jsonl = generate(root / "source", 200, 20, seed=0)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=root, parser="spacy", boxes="given", shard_size=50, workers=1))
    return str(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="featurizer output (default: generated synthetic)")
    parser.add_argument("--val-split", default="val", help="the shards' validation split")
    parser.add_argument("--batch", type=int, default=100, help="global pairs per step (paper: 100)")
    parser.add_argument("--image-size", type=int, default=224, help="the CNN's input size")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--whole-cnn", action=argparse.BooleanOptionalAction, default=True,
                        help="measure finetuning the whole CNN (at 448 px and 100 pairs its "
                             "activations outgrow 24 GiB)")
    parser.add_argument("--finetune-blocks", type=int, nargs="*", default=[1, 2, 3],
                        help="the K of model.finetune_blocks to measure (none: skip)")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA only)")
    parser.add_argument("--json", help="also write the JSON line's rows to this file")
    args = parser.parse_args()
    if args.device == "cuda" and args.processes != [1]:
        parser.error("--device cuda measures one process on one GPU: add --processes 1")
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards or synthetic_shards(Path(tmp))
        rows = []
        for world_size in args.processes:
            results = mp.Manager().dict()
            mp.spawn(measure, args=(world_size, shards, args, results), nprocs=world_size)
            rows.append(dict(results))
    for r in rows:
        whole = (f"finetune {r['finetune_steps_per_s']:.2f} steps/s "
                 f"{r['finetune_images_per_s']:.1f} img/s; step / bare CNN fwd+bwd = "
                 f"{r['overhead']:.2f} (target <= {TARGET})" if "overhead" in r
                 else "whole CNN not measured")
        print(f"{r['processes']} process(es) on {r['device']}{' bf16' if r['bf16'] else ''}, "
              f"{r['pairs_per_step']} pairs ({r['images_per_step']:.0f} images)/step: frozen "
              f"{r['frozen_steps_per_s']:.2f} steps/s {r['frozen_images_per_s']:.1f} img/s; "
              f"{whole}")
        for top in r["top_blocks"]:
            print(f"  top {top['finetune_blocks']} block(s) on cached maps "
                  f"{top['map_shape']}: step {top['step_s']:.3f} s "
                  f"({top['step_s'] / r['frozen_step_s']:.1f}x the frozen step"
                  + (f", {r['finetune_step_s'] / top['step_s']:.1f}x faster than the whole CNN"
                     if "finetune_step_s" in r else "") + "), "
                  f"cache {top['build_s_per_image'] * 1000:.0f} ms to build, "
                  f"{top['memory_mb_per_image']:.3f} MB in memory, "
                  f"{top['disk_mb_per_image']:.3f} MB on disk per image view")
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
