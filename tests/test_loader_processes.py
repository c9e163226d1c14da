"""trainer/data/loader_processes.py: chunks handed over through the shared ring arrive whole and in
DataLoader's order; a failing, killed or abandoned loader process is reported or cleaned up; and a
TrainLoader with a loader process yields exactly the batches it yields in one process."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from defrag.urls import ShardError
from defrag.vocab import Vocabulary
from trainer.config import Config
from trainer.data.loader_processes import Chunk, run_in_processes
from trainer.data.train_loader import TrainLoader

SHAPE = (5, 4, 3)
CHUNKS = {0: 5, 1: 2, 2: 0}  # chunks each of 3 processes generates: they finish apart


def numbered_chunks(process: int, processes: int) -> Iterator[Chunk]:
    """Chunk k of `process`: k % 4 images (an empty chunk included), pixels naming each."""
    for number in range(CHUNKS[process] if processes == 3 else 7):
        rows = [(process, number, row) for row in range(number % 4)]
        pixels = [np.full(SHAPE, 60 * process + 10 * number + row, np.uint8)
                  for _, _, row in rows]
        yield rows, pixels, [f"skipped by {process} in chunk {number}"] * (number == 1)


def test_chunks_arrive_whole_in_dataloader_order() -> None:
    got = list(run_in_processes(numbered_chunks, 3, chunk_images=3, image_shape=SHAPE,
                                prefetch=2))
    # One chunk from each running process in turn; process 2 has none, process 1 stops after 2.
    expected = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (0, 3), (0, 4)]
    assert [(rows[0][0], rows[0][1]) if rows else None for rows, _, _ in got] == [
        None if number % 4 == 0 else (process, number) for process, number in expected]
    for (process, number), (rows, pixels, skipped) in zip(expected, got, strict=True):
        assert len(pixels) == len(rows) == number % 4
        for (_, _, row), image in zip(rows, pixels, strict=True):
            np.testing.assert_array_equal(image, np.full(SHAPE, 60 * process + 10 * number + row))
        assert skipped == [f"skipped by {process} in chunk 1"] * (number == 1)
    assert multiprocessing.active_children() == []


def test_no_processes_runs_the_source_here() -> None:
    got = list(run_in_processes(numbered_chunks, 0, chunk_images=3, image_shape=SHAPE,
                                prefetch=2))
    assert [rows for rows, _, _ in got] == [rows for rows, _, _ in numbered_chunks(0, 1)]


def failing_chunks(process: int, processes: int) -> Iterator[Chunk]:
    yield from numbered_chunks(process, processes)
    raise ShardError(f"shard of process {process} is gone")


def killed_chunks(process: int, processes: int) -> Iterator[Chunk]:
    yield from numbered_chunks(process, processes)
    os.kill(os.getpid(), signal.SIGKILL)


def test_an_error_in_a_loader_process_is_raised_here() -> None:
    with pytest.raises(ShardError, match="shard of process 0 is gone") as raised:
        list(run_in_processes(failing_chunks, 1, chunk_images=3, image_shape=SHAPE, prefetch=2))
    assert "in loader process 0" in str(raised.value.__cause__)
    assert "failing_chunks" in str(raised.value.__cause__)  # the traceback there
    assert multiprocessing.active_children() == []


def test_a_killed_loader_process_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"loader process 0 \(pid \d+\) exited unexpectedly "
                                           r"with exit code -9"):
        list(run_in_processes(killed_chunks, 1, chunk_images=3, image_shape=SHAPE, prefetch=2))
    assert multiprocessing.active_children() == []


def test_a_loader_process_outlives_a_sigterm() -> None:
    """SLURM sends SIGTERM to every process of a job at its time limit: the loader processes go
    on, so their training process reaches the step where it stops
    (trainer/training/preemption.py)."""
    chunks = run_in_processes(numbered_chunks, 1, chunk_images=3, image_shape=SHAPE, prefetch=2)
    first = next(chunks)
    [child] = multiprocessing.active_children()
    os.kill(child.pid, signal.SIGTERM)
    assert [rows for rows, _, _ in [first, *chunks]] == [
        rows for rows, _, _ in numbered_chunks(0, 1)]
    assert multiprocessing.active_children() == []


def endless_chunks(process: int, processes: int) -> Iterator[Chunk]:
    while True:
        yield from numbered_chunks(process, processes)


def test_stopping_early_ends_the_loader_processes() -> None:
    chunks = run_in_processes(endless_chunks, 2, chunk_images=3, image_shape=SHAPE, prefetch=2)
    next(chunks)
    assert len(multiprocessing.active_children()) == 2
    chunks.close()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_loader_processes_exit_when_the_training_process_dies(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import multiprocessing, os
        from tests.test_loader_processes import SHAPE, endless_chunks
        from trainer.data.loader_processes import run_in_processes
        chunks = run_in_processes(endless_chunks, 2, chunk_images=3, image_shape=SHAPE,
                                  prefetch=2)
        next(chunks)
        print(*(child.pid for child in multiprocessing.active_children()), flush=True)
        os._exit(0)  # no clean-up: as if the training process were killed
    """)
    repository = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=repository, capture_output=True,
                          text=True, timeout=120, check=True)
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie: the orphans' new parent reaps them)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def loader_config(shards: Path, workers: int) -> Config:
    return Config.from_dict({"data": {"shards": str(shards), "workers": workers},
                             "model": {"image_size": 64}})


def test_a_loader_process_yields_the_batches_of_one_process(shards: Path) -> None:
    vocab = Vocabulary.load(shards / "vocab.json")
    here, there = (list(TrainLoader(loader_config(shards, workers), vocab, batch_size=10))
                   for workers in (0, 1))
    assert len(here) == len(there) == 20
    for a, b in zip(here, there, strict=True):
        assert a.image_ids == b.image_ids and a.captions == b.captions
        assert torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes)
    assert multiprocessing.active_children() == []  # the epoch's end stopped the process


def test_a_shard_removed_during_an_epoch_is_named(shards: Path, tmp_path: Path) -> None:
    """Its samples are counted as lost, and the rank fills its epoch from its other shards."""
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("source"))
    loader = TrainLoader(loader_config(copy, 2), Vocabulary.load(copy / "vocab.json"),
                         batch_size=10)
    removed = copy / "train/shard-000002.tar"
    removed.unlink()
    assert len(list(loader)) == 20
    (problem,) = loader.problems.values()
    assert problem.kind == "shard" and problem.lost == 5
    assert str(removed) in problem.message and "re-run the featurizer" in problem.message
    assert multiprocessing.active_children() == []
