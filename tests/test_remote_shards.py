"""Shards read from real servers on 127.0.0.1 (tests/servers.py): a featurizer output folder
over HTTP (read with curl) and an S3 bucket (moto, read with `pipe:aws s3 cp ...`).

The loader yields the same batches from a server as from the local folder, reads each shard once
per epoch (the server's access log says so), survives a dropped connection by reading the shard
again from where it broke, and fails with a ShardError naming the URL and curl's error in words
when a shard stays unreadable (dropped, 404, stalled). Real torchrun trainings (one node of two
processes, and two single-process nodes meeting through a c10d rendezvous) from the server end
with the weights of the same training from the local folder.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch

from defrag.urls import ShardError
from defrag.vocab import Vocabulary
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from tests.servers import HttpFolder, s3_server, serve_folder
from tests.test_data import batch_pairs, make_config
from tests.test_train_e2e import ROOT, final_weights, finish, tiny_config, torchrun
from trainer.batch import Batch
from trainer.data.eval_set import load_eval_set
from trainer.data.shardset import load_vocabulary, vocab_url
from trainer.data.train_loader import TrainLoader

TRAIN = [f"/train/shard-{i:06d}.tar" for i in range(8)]  # the `shards` fixture's, as served
VAL = [f"/val/shard-{i:06d}.tar" for i in range(2)]
EPOCHS = 2  # tiny_config's optim.epochs (final_weights checks that the run ended there)
BATCH = 10  # pairs per rank in the loader tests


@pytest.fixture(scope="module")
def vocab(shards: Path) -> Vocabulary:
    return Vocabulary.load(shards / "vocab.json")


def epoch_batches(cfg_shards: str | Path, vocab: Vocabulary, world_size: int = 2,
                  **data: object) -> list[list[Batch]]:
    """Epoch 0 of every rank of a `world_size` job, read by TrainLoaders of `data.shards`."""
    cfg = make_config(cfg_shards, data)
    return [list(TrainLoader(cfg, vocab, BATCH, rank, world_size)) for rank in range(world_size)]


def assert_same_batches(got: list[list[Batch]], want: list[list[Batch]]) -> None:
    assert [len(rank) for rank in got] == [len(rank) for rank in want]
    for rank_got, rank_want in zip(got, want, strict=True):
        for step, (a, b) in enumerate(zip(rank_got, rank_want, strict=True)):
            assert batch_pairs(a) == batch_pairs(b), step
            for name in ("images", "boxes", "box_image", "sentence_image", "fragments",
                         "fragment_sentence", "image_key"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)


def requests(log: Iterable[str]) -> Counter:
    """GET requests by path."""
    return Counter(log)


# ---------------------------------------------------------------------------------------------
# HTTP: the loader


def test_http_folder_gives_the_local_batches_reading_each_shard_once(
        shards: Path, vocab: Vocabulary) -> None:
    """Two ranks of 2 loader processes each, from the server: the local batches, every train
    shard fetched once, nothing of the val split."""
    local = epoch_batches(shards, vocab, workers=2)
    with serve_folder(shards) as server:
        remote = epoch_batches(server.url, vocab, workers=2)
        log = list(server.log)
    assert_same_batches(remote, local)
    got = requests(log)
    assert {path: got[path] for path in TRAIN} == dict.fromkeys(TRAIN, 1)  # once, by one rank
    assert got["/manifest.json"] == 2  # one TrainLoader per rank lists the split
    assert set(got) == {*TRAIN, "/manifest.json"}  # no val shard, nothing else


# ---------------------------------------------------------------------------------------------
# HTTP: faults


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic set in 2 train shards of 20 images (~120 kB each, more than a pipe holds,
    so that a reader has taken samples from a shard when its transfer breaks) and 1 val shard."""
    root = tmp_path_factory.mktemp("big-shards")
    jsonl = generate(root / "source", 40, 10, seed=0)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=root, parser="spacy", boxes="given", shard_size=20, workers=1))
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["first sample", "mid-shard"])
def test_a_dropped_connection_is_read_again_from_where_it_broke(
        shards: Path, big_shards: Path, caplog: pytest.LogCaptureFixture, where: str) -> None:
    """The transfer of one shard breaks once: the reader opens it again and skips the samples
    it already gave (none when the break comes before curl's whole output has been read, as
    with a 30 kB shard; mid-shard, the server holds the cut connection for 2 s first, so that a
    reader slowed by a busy machine has read what came before the break), and the epoch's
    batches are the local ones."""
    folder = shards if where == "first sample" else big_shards
    shard = "train/shard-000001.tar"
    cut = 3000 if where == "first sample" else (folder / shard).stat().st_size * 3 // 4
    words = Vocabulary.load(folder / "vocab.json")
    local = epoch_batches(folder, words, world_size=1, workers=0)  # read here: caplog sees it
    delay = 0.0 if where == "first sample" else 2.0
    with serve_folder(folder, drop_after={shard: cut}, drop_times=1, drop_delay=delay) as server:
        with caplog.at_level("WARNING", logger="trainer.data.reader"):
            remote = epoch_batches(server.url, words, world_size=1, workers=0)
        log = list(server.log)
    assert_same_batches(remote, local)
    expected = {f"/train/{path.name}": 1 for path in (folder / "train").glob("*.tar")}
    expected[f"/{shard}"] = 2
    assert requests(path for path in log if path.startswith("/train/")) == expected
    (retry,) = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert f"{server.url}/{shard}: curl exit 18, connection closed mid-transfer" in retry, retry
    assert "attempt 2 of 4" in retry, retry
    delivered = int(re.search(r"after (\d+) samples", retry).group(1))
    assert (delivered == 0) if where == "first sample" else (0 < delivered < 20), retry


@pytest.mark.timeout(120)
def test_a_connection_that_always_drops_is_a_shard_error(shards: Path,
                                                         vocab: Vocabulary) -> None:
    """Read by a loader process (one of two): its ShardError reaches the training process."""
    shard = "train/shard-000001.tar"
    with serve_folder(shards, drop_after={shard: 3000}, drop_times=1000) as server:
        started = time.monotonic()
        with pytest.raises(ShardError) as failure:
            epoch_batches(server.url, vocab, world_size=1, workers=2, io_retries=1)
        message = str(failure.value)
        assert requests(server.log)[f"/{shard}"] == 2
    assert time.monotonic() - started < 60
    assert f"cannot read shard {server.url}/{shard} after 2 attempts" in message, message
    assert "curl exit 18, connection closed mid-transfer" in message, message


@pytest.mark.timeout(120)
def test_a_missing_shard_is_a_shard_error_naming_the_url(shards: Path,
                                                         vocab: Vocabulary) -> None:
    shard = "train/shard-000006.tar"
    with serve_folder(shards, missing={shard}) as server:
        with pytest.raises(ShardError) as failure:
            epoch_batches(server.url, vocab, world_size=1, workers=1, io_retries=1)
        message = str(failure.value)
        assert requests(server.log)[f"/{shard}"] == 2
    assert f"{server.url}/{shard} after 2 attempts" in message, message
    assert "curl exit 22, HTTP 404 Not Found" in message, message


@pytest.mark.timeout(120)
def test_a_stalled_transfer_times_out_naming_the_url(shards: Path, vocab: Vocabulary) -> None:
    shard = "train/shard-000003.tar"
    with serve_folder(shards, stall={shard}, stall_after=0) as server:
        started = time.monotonic()
        with pytest.raises(ShardError) as failure:
            epoch_batches(server.url, vocab, world_size=1, workers=1, io_timeout=2,
                          io_retries=1)
        elapsed = time.monotonic() - started
        message = str(failure.value)
    # 2 attempts of ~2 s (curl's low-speed check: under 1 B/s for 2 s; no body byte is sent,
    # whose burst would keep curl's speed, an average over its last ~5 s, up for ~8 s), 1 s
    # between them
    assert elapsed < 30, elapsed
    assert f"{server.url}/{shard} after 2 attempts" in message, message
    assert "curl exit 28, timed out" in message, message


# ---------------------------------------------------------------------------------------------
# S3 (moto) through `pipe:aws s3 cp`


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s3_shard_lists_give_the_local_batches(shards: Path, vocab: Vocabulary,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    local = epoch_batches(shards, vocab, workers=2)
    local_val = list(load_eval_set(make_config(shards), vocab, rank=0, world_size=1).batches(4))
    with s3_server() as s3:
        s3.upload_folder(shards, "flickr", prefix="f8k/")
        for name, value in s3.env.items():
            monkeypatch.setenv(name, value)
        train = "pipe:aws s3 cp s3://flickr/f8k/train/shard-{000000..000007}.tar -"
        data = {"val_shards": "pipe:aws s3 cp s3://flickr/f8k/val/shard-{000000..000001}.tar -",
                "manifest": str(shards / "manifest.json")}
        remote = epoch_batches(train, vocab, workers=2, **data)
        eval_set = load_eval_set(make_config(train, data), vocab, rank=0, world_size=1)
        remote_val = list(eval_set.batches(4))
    assert_same_batches(remote, local)
    assert [s.url for s in eval_set.split.shards] == [
        f"pipe:aws s3 cp s3://flickr/f8k/val/shard-00000{i}.tar -" for i in range(2)]
    assert_same_batches([remote_val], [local_val])
    assert not eval_set.problems


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_s3_folder_gives_the_local_batches(shards: Path, vocab: Vocabulary,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """data.shards = s3://BUCKET/PREFIX: manifest, vocabulary and shards read with boto3."""
    local = epoch_batches(shards, vocab, workers=2)
    with s3_server() as s3:
        s3.upload_folder(shards, "flickr", prefix="f8k/")
        for name, value in s3.env.items():
            monkeypatch.setenv(name, value)
        remote = epoch_batches("s3://flickr/f8k", vocab, workers=2)
        assert load_vocabulary(make_config("s3://flickr/f8k").data) == vocab
        s3.client().delete_object(Bucket="flickr", Key="f8k/train/shard-000006.tar")
        with pytest.raises(ShardError) as failure:
            epoch_batches("s3://flickr/f8k", vocab, world_size=1, workers=1, io_retries=1)
    assert_same_batches(remote, local)
    message = str(failure.value)
    assert "s3://flickr/f8k/train/shard-000006.tar after 2 attempts" in message, message
    assert "S3 NoSuchKey, HTTP 404 Not Found" in message, message


def test_the_vocabulary_beside_a_manifest_read_by_a_command() -> None:
    manifest = "pipe:aws s3 cp s3://bucket/f8k/manifest.json -"
    assert vocab_url(None, manifest) == "pipe:aws s3 cp s3://bucket/f8k/vocab.json -"
    assert vocab_url(None, manifest, "v.json") == "v.json"
    with pytest.raises(ValueError, match="give the vocabulary's too"):
        vocab_url(None, "pipe:curl -s https://host/set-description")


# ---------------------------------------------------------------------------------------------
# Trainings from the server


def assert_read_once_per_epoch(log: list[str], world_size: int = 2) -> None:
    """Each train and val shard fetched once per epoch by the ranks together (each rank reads
    its share of both splits); the vocabulary once per rank and the manifest a few times per
    rank, all before the first shard."""
    got = requests(log)
    assert {path: got[path] for path in TRAIN + VAL} == dict.fromkeys(TRAIN + VAL, EPOCHS), got
    assert set(got) == {*TRAIN, *VAL, "/vocab.json", "/manifest.json"}, got
    first_shard = min(log.index(path) for path in TRAIN + VAL)
    startup, later = log[:first_shard], log[first_shard:]
    assert startup.count("/vocab.json") == world_size and "/vocab.json" not in later, log
    # Each rank lists the train and the val split and fingerprints the shards (feature cache);
    # rank 0 also reads the parser and box source its model folders record.
    assert world_size <= startup.count("/manifest.json") <= 3 * world_size + 1, log
    assert "/manifest.json" not in later, log


def assert_same_weights(got: dict, want: dict) -> None:
    """Bitwise equal. Both runs do the same float operations in the same order: one thread per
    process (OMP_NUM_THREADS=1), the same batches on the same ranks, and gloo all-reduces over
    2 ranks, which add exactly two operands (IEEE addition is commutative, so which process
    holds which operand cannot matter); all-gathers concatenate in rank order."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.fixture(scope="module")
def server(shards: Path) -> Iterator[HttpFolder]:
    """The `shards` folder over HTTP for the trainings of this module."""
    with serve_folder(shards) as folder:
        yield folder


@pytest.fixture(scope="module")
def http_training(server: HttpFolder, shards: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str]]:
    """A one-node, 2-process torchrun training from the server (tiny_config: 2 epochs, the
    second finetuning the CNN): its final weights, and the server's access log during it."""
    tmp = tmp_path_factory.mktemp("http-training")
    start = len(server.log)
    finish(torchrun(tiny_config(tmp, server.url)))
    return final_weights(tmp / "run"), server.log[start:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_from_http_ends_with_the_local_weights(
        ddp_training: tuple[Path, str], http_training: tuple[dict, list[str]]) -> None:
    """The local training is the session's `ddp_training` (tests/conftest.py)."""
    weights, log = http_training
    assert_same_weights(weights, final_weights(ddp_training[0]))
    assert_read_once_per_epoch(log)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node(config: Path, rendezvous: str, run_id: str) -> subprocess.Popen:
    """The torchrun agent of one node (one process) of a 2-node job meeting at `rendezvous`,
    with `torchrun`'s environment (one thread per process, the run's own MLflow store). Both
    agents find the endpoint on their machine: the first binds the c10d store, the other falls
    back to being its client, as on the node named by a real job's --rdzv-endpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous,
               "--rdzv-id", run_id, "--max-restarts", "0",
               "-m", "trainer.main", "--config", str(config)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def stop(agent: subprocess.Popen) -> None:
    """End an agent still running (a failed test): SIGTERM, on which torchrun stops its worker
    (in a session of its own) before exiting; SIGKILL if it does not."""
    if agent.poll() is None:
        agent.terminate()
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_nodes_end_with_the_one_node_weights(
        server: HttpFolder, tmp_path: Path, http_training: tuple[dict, list[str]]) -> None:
    """Two nodes of one process each, started together, sharing one run_dir as nodes share a
    filesystem: global rank 0 (on whichever node the rendezvous puts it) writes the run's
    files, checkpoints and MLflow store; rank 1 only reads the checkpoint pointer at start-up."""
    config = tiny_config(tmp_path, server.url)
    start = len(server.log)
    rendezvous, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    agents = [node(config, rendezvous, run_id) for _ in range(2)]
    pool = ThreadPoolExecutor(2)  # both agents' output drained at once
    try:
        running = [pool.submit(finish, agent) for agent in agents]
        wait(running, timeout=350, return_when=FIRST_EXCEPTION)
        outputs = [future.result(timeout=0) for future in running]  # a failure, re-raised
    finally:
        for agent in agents:
            stop(agent)
        pool.shutdown()
    summaries = [output for output in outputs if '"mlflow_run_id"' in output]
    assert len(summaries) == 1  # rank 0 ran on one node, rank 1 on the other
    weights, _ = http_training
    assert_same_weights(final_weights(tmp_path / "run"), weights)
    assert_read_once_per_epoch(server.log[start:])
