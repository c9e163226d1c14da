"""launch/flickr8k.py: every row is a valid config, every ensemble can be scored, and the tables
show what ran."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from trainer.config import Config

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("flickr8k", ROOT / "launch" / "flickr8k.py")
flickr8k = importlib.util.module_from_spec(spec)
sys.modules["flickr8k"] = flickr8k  # dataclasses look their module up there
spec.loader.exec_module(flickr8k)


@pytest.mark.parametrize("name", list(flickr8k.ROWS))
def test_every_row_is_a_valid_config(name: str) -> None:
    row = flickr8k.ROWS[name]
    cfg = Config.load(ROOT / row.config, row.overrides)
    assert cfg.data.val_split == "dev"  # hyper-parameters are chosen on dev only
    assert cfg.data.shards == row.shards  # trained and evaluated on the same shards
    assert row.shards in flickr8k.FEATURIZE
    if name == "devise":
        assert cfg.model.mean_pool and not cfg.objective.use_fragment


def test_table_lists_our_figures_beside_the_papers() -> None:
    dev = {k: float(i + 1) for i, k in enumerate(flickr8k.METRICS)}
    table = flickr8k.table({"full": {"dev": dev, "train_wall_s": 600}})
    row = table.splitlines()[-1]
    assert row.startswith("| Our model († + MIL) | 1.0 / 2.0 / 3.0, 4 | 5.0 / 6.0 / 7.0, 8 |")
    assert "12.6 / 32.9 / 44, 14" in row and row.endswith("| 10 min |")


@pytest.mark.parametrize("name", list(flickr8k.ENSEMBLES))
def test_every_ensemble_is_made_of_rows_that_can_be_averaged(name: str) -> None:
    """The members' mean is meaningful only for one score; a fused row gets a weight on dev."""
    ensemble = flickr8k.ENSEMBLES[name]
    configs = {row: Config.load(ROOT / flickr8k.ROWS[row].config, flickr8k.ROWS[row].overrides)
               for row in [*ensemble.members, *ensemble.fused]}
    scores = {configs[row].objective.score for row in ensemble.members}
    assert len(scores) == 1
    # one eval split for all: whole-image rows read the whole-image box of a region row's shards
    assert len({flickr8k.ROWS[row].shards for row in configs} - {flickr8k.WHOLE_SHARDS}) <= 1
    assert all(configs[row].objective.score not in scores for row in ensemble.fused)
    pushed = [n for n, e in flickr8k.ENSEMBLES.items() if e.register_name == "defrag-flickr8k"]
    assert len(pushed) == 1  # one name a user can find


def test_fused_rows_get_their_weights_on_dev_one_after_the_other(tmp_path, monkeypatch) -> None:
    """A fused row that knows the answers gets a weight and lifts rsum; pure noise gets 0."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    generator = torch.Generator().manual_seed(0)
    sentence_image = torch.arange(50).repeat_interleave(5)
    truth = torch.zeros(50, 250)
    truth[sentence_image, torch.arange(250)] = 1.0
    rows = {"member": truth + 2.0 * torch.randn(50, 250, generator=generator),
            "oracle": 100.0 * truth + torch.randn(50, 250, generator=generator),
            "noise": 1000.0 * torch.randn(50, 250, generator=generator)}
    for row, scores in rows.items():
        (tmp_path / row).mkdir()
        save_file({"scores": scores, "sentence_image": sentence_image},
                  tmp_path / row / flickr8k.DEV_SCORES)
    monkeypatch.setattr(flickr8k, "RUNS", tmp_path)
    alone = flickr8k.score_on_dev(flickr8k.Ensemble("member", ["member"]))
    fused = flickr8k.score_on_dev(flickr8k.Ensemble("fused", ["member"], ("oracle", "noise")))
    oracle_weight, noise_weight = fused["fused_weights"]
    assert oracle_weight > 0 and noise_weight == 0
    assert fused["rsum"] == fused["fusion_rsum"]["noise"]["0"] > alone["rsum"] + 100


def test_quality_table_lists_rows_and_ensembles() -> None:
    dev = {**{k: float(i + 1) for i, k in enumerate(flickr8k.METRICS)}, "rsum": 42.0}
    table = flickr8k.quality_table({
        "gru": {"title": "GRU", "dev": dev, "train_wall_s": 600},
        "ensemble": {"title": "Ensemble", "dev": dev, "train_wall_s": 1200}})
    assert table.splitlines()[-2:] == [
        "| GRU | 1.0 / 2.0 / 3.0, 4 | 5.0 / 6.0 / 7.0, 8 | 42.0 | 10 min |",
        "| Ensemble | 1.0 / 2.0 / 3.0, 4 | 5.0 / 6.0 / 7.0, 8 | 42.0 | 20 min |"]
