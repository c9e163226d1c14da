"""launch/flickr8k.py: every Table 2 row is a valid config, and the table shows what it ran."""

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
