"""Fixtures shared by the test files: a small real shard set of the synthetic dataset.

DEFRAG_TEST_SHARDS names such a set made beforehand (the command below), for a machine without
the featurizer's parser, such as a GPU machine running tests/test_cuda.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate

NUM_TRAIN, NUM_VAL, SHARD_SIZE = 40, 10, 5  # 8 train shards of 25 pairs, 2 val shards


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`defrag featurize synthetic --num-train 40 --num-val 10 --shard-size 5`, once."""
    if os.environ.get("DEFRAG_TEST_SHARDS"):
        return Path(os.environ["DEFRAG_TEST_SHARDS"])
    root = tmp_path_factory.mktemp("synthetic")
    jsonl = generate(root / "source", NUM_TRAIN, NUM_VAL, seed=0)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=root, parser="spacy", boxes="given", shard_size=SHARD_SIZE,
                       workers=1))
    return root


@pytest.fixture(scope="session")
def ddp_training(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """tests/test_train_e2e.py's 2-process torchrun training of `tiny_config` (DDP), once: its
    run folder and output, which the tracking test checks and the kill and remote-shard tests
    compare their final weights with."""
    from tests.test_train_e2e import finish, tiny_config, torchrun

    root = tmp_path_factory.mktemp("ddp-training")
    return root / "run", finish(torchrun(tiny_config(root, shards)))
