"""Phase 2 with `model.finetune_blocks`: a real training run finetunes the CNN's top blocks on
the cached maps of the blocks below them, which stay as loaded; validation on the cached fp16
maps measures what the trained weights give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from defrag.vocab import Vocabulary
from tests.small_training import small_config
from trainer.data.eval_set import load_eval_set
from trainer.data.feature_cache import FeatureCache, feature_stamp, trunk_stamp
from trainer.evaluate import embed_eval_set, evaluate_model
from trainer.main import train
from trainer.model import DeFragModel
from trainer.training.checkpoint import latest_checkpoint
from trainer.training.distributed import DistContext

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.slow
def test_phase_two_trains_the_top_blocks_on_cached_trunk_maps(
        tmp_path: Path, shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    cfg = small_config(shards, run_dir, model={"finetune_blocks": 2},
                       optim={"epochs": 2, "frozen_cnn_epochs": 1, "lr": 0.05},
                       run={"feature_cache": str(cache_dir)})
    train(cfg, CPU, "latest")

    vocab = Vocabulary.load(shards / "vocab.json")
    model = DeFragModel.from_config(cfg.model, vocab, seed=cfg.seed)
    loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.load_state_dict(load_file(str(latest_checkpoint(run_dir) / "model.safetensors")))
    top = {id(p) for p in model.image.cnn_parameters()}  # the top 2 blocks, BN excluded
    changed = {name for name, p in model.image.backbone.named_parameters()
               if not torch.equal(p, loaded[f"image.backbone.{name}"])}
    assert changed == {f"features.{name}" for name, p in model.image.backbone.features
                       .named_parameters() if id(p) in top} and changed

    # The trunk maps on disk: fp16, one per image and view (train and val), apart from the
    # frozen features of phase 1.
    trunk = FeatureCache(cache_dir, trunk_stamp(cfg), trunk=True)
    assert trunk.folder != FeatureCache(cache_dir, feature_stamp(cfg)).folder
    with safe_open(trunk.folder / "rank-0.safetensors", framework="pt") as handle:
        keys = handle.keys()  # a safe_open handle is not iterable
        shapes = {tuple(handle.get_slice(key).get_shape()) for key in keys}
        dtypes = {handle.get_slice(key).get_dtype() for key in keys}
    count = len(keys)
    assert dtypes == {"F16"} and shapes == {(1, 192, 2, 2)} and count == 50  # 40 train, 10 val

    # The last validation (on those maps) is what the trained weights give on them; the CNN's
    # own fp32 maps give the same fragments up to the maps' fp16 rounding.
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    eval_set = load_eval_set(cfg, vocab, rank=0, world_size=1)
    metrics, _ = evaluate_model(model, eval_set, cfg, cache=trunk)
    assert metrics["rsum"] == pytest.approx(history[-1]["rsum"])
    cached, computed = embed_eval_set(model, eval_set, cache=trunk), embed_eval_set(model,
                                                                                    eval_set)
    torch.testing.assert_close(cached.v, computed.v, atol=2e-3, rtol=1e-2)
