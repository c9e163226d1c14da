"""Fixtures shared by the test files: a small real shard set of the synthetic dataset, an empty
MLflow store.

DEFRAG_TEST_SHARDS names such a set made beforehand (the command below), for a machine without
the featurizer's parser, such as a GPU machine running tests/test_cuda.py."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate

if TYPE_CHECKING:
    from tests.cluster import NamespaceCluster

NUM_TRAIN, NUM_VAL, SHARD_SIZE = 40, 10, 5  # 8 train shards of 25 pairs, 2 val shards
MEMORY_TEMPROOT = Path("/dev/shm")
MEMORY_TEMPROOT_FREE = 8 << 30


def pytest_configure(config: pytest.Config) -> None:
    """pytest's temporary folders under /dev/shm (tmpfs) when it is writable with 8 GiB free
    (a full run's folders, kept until its end, reach a few GiB), unless the caller chose a
    root: a fresh MLflow sqlite store there takes ~1 s instead of ~5 s of fsyncs on this
    machine's disk, and every training and shard writer of the suite makes one or fsyncs."""
    if ("PYTEST_DEBUG_TEMPROOT" not in os.environ and config.option.basetemp is None
            and os.access(MEMORY_TEMPROOT, os.W_OK)
            and shutil.disk_usage(MEMORY_TEMPROOT).free >= MEMORY_TEMPROOT_FREE):
        os.environ["PYTEST_DEBUG_TEMPROOT"] = str(MEMORY_TEMPROOT)


@pytest.fixture(autouse=True)
def kept_threads() -> Iterator[None]:
    """Each test leaves torch's and faiss' thread counts as it found them: a command run in the
    test process (`serve.main` sets its CPUs' worth, as a server should) once left 2 threads to
    every later test, whose CNN then rounded an upload's rows otherwise than a 1-thread part's."""
    import faiss
    import torch

    threads, faiss_threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    yield
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(faiss_threads)


def synthetic_shards(root: Path, num_train: int, num_val: int, shard_size: int) -> Path:
    """`defrag featurize synthetic` of that many scenes (seed 0) into `root`."""
    jsonl = generate(root / "source", num_train, num_val, seed=0)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=root, parser="spacy", boxes="given", shard_size=shard_size,
                       workers=1))
    return root


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An sqlite file with MLflow's schema and no experiment of ours (its schema made once:
    seconds; tests/test_tracking.py copy_store copies it)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`defrag featurize synthetic --num-train 40 --num-val 10 --shard-size 5`, once."""
    if os.environ.get("DEFRAG_TEST_SHARDS"):
        return Path(os.environ["DEFRAG_TEST_SHARDS"])
    return synthetic_shards(tmp_path_factory.mktemp("synthetic"), NUM_TRAIN, NUM_VAL, SHARD_SIZE)


@pytest.fixture(scope="session")
def scenes_200(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 training and 40 val scenes in shards of 25, once: enough for the captioner to learn
    colours (the 40 of `shards` are too few) and for a loader process to outlive its rank's
    first steps (40 fit in its read-ahead)."""
    return synthetic_shards(tmp_path_factory.mktemp("scenes200"), 200, 40, 25)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node SLURM cluster on this host (tests/cluster.py), started once for the SLURM
    tests of test_featurize_at_scale, test_index_build and test_slurm: the environment of its
    commands."""
    from tests.cluster import one_node, require, slurm_missing

    require(slurm_missing(), "SLURM test", "DEFRAG_REQUIRE_SLURM")
    yield from one_node(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NamespaceCluster]:
    """Two SLURM nodes made of Linux namespaces on this host (tests/cluster.py), for the
    `cluster`-marked tests; removed at the end whatever happened, its logs and job outputs kept
    in the session's temporary folder. Skipped without root, `ip netns` or SLURM, unless
    DEFRAG_REQUIRE_CLUSTER=1."""
    from tests.cluster import namespace_cluster, namespaces_missing, require

    require(namespaces_missing(), "namespace cluster", "DEFRAG_REQUIRE_CLUSTER")
    yield from namespace_cluster(2, tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="session")
def ddp_training(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """tests/test_train_e2e.py's 2-process torchrun training of `tiny_config` (DDP), once: its
    run folder and output, which the tracking test checks and the kill and remote-shard tests
    compare their final weights with."""
    from tests.test_train_e2e import finish, tiny_config, torchrun

    root = tmp_path_factory.mktemp("ddp-training")
    return root / "run", finish(torchrun(tiny_config(root, shards)))


@pytest.fixture(scope="session")
def deepspeed_training(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The same training with DeepSpeed ZeRO-2, once: its run folder and output, which the
    tracking test checks and tests/test_checkpoint_integrity.py damages a copy of a checkpoint
    of (each rank writes its own optimizer partition)."""
    from tests.test_train_e2e import ROOT, finish, tiny_config, torchrun

    root = tmp_path_factory.mktemp("deepspeed-training")
    config = tiny_config(root, shards, engine="deepspeed",
                         deepspeed_config=str(ROOT / "launch/deepspeed/zero2.json"))
    return root / "run", finish(torchrun(config))
