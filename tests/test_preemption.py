"""Stop on request (trainer/preemption.py): rank 0's request file decides for every rank, and a
training run that sees it checkpoints, stops, and resumes from there to the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.checkpoint import latest_checkpoint, load_state
from trainer.config import Config
from trainer.distributed import DistContext, end_process
from trainer.preemption import DONE, REQUEST, Preempted, acknowledge, stop_requested

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_training_stops_with_a_checkpoint_and_resumes_to_the_end(tmp_path, shards, monkeypatch):
    from mlflow import MlflowClient  # imported here, not by the spawned ranks below

    from trainer.main import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = Config.from_dict({
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64, "train_word_vectors": True},
        "data": {"shards": str(shards), "workers": 0, "shuffle_buffer": 10},
        "optim": {"batch_size": 20, "epochs": 1, "frozen_cnn_epochs": 1},
        "run": {"run_dir": str(tmp_path / "run"), "log_every_steps": 1},
    })
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / REQUEST).touch()
    with pytest.raises(Preempted):
        train(cfg, CPU, resume="latest")
    stopped = load_state(latest_checkpoint(run_dir))
    assert (stopped.epoch, stopped.step_in_epoch, stopped.global_step) == (0, 1, 1)
    assert (run_dir / DONE).read_text() == "1\n" and not (run_dir / REQUEST).exists()
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert client.get_run(stopped.mlflow_run_id).info.status == "KILLED"

    summary = train(cfg, CPU, resume="latest")
    finished = load_state(latest_checkpoint(run_dir))
    assert finished.epoch == 1 and finished.global_step > 1
    assert summary["mlflow_run_id"] == stopped.mlflow_run_id
    run = client.get_run(stopped.mlflow_run_id)
    assert run.info.status == "FINISHED" and "val/rsum" in run.data.metrics
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps == list(range(1, finished.global_step + 1))  # none lost at the stop


def ranks_agree(rank: int, world_size: int, init_file: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"))
    mine = Path(root) / f"rank{rank}"  # a folder per rank: only rank 0's may count
    mine.mkdir()
    answers = []
    for requester in (1, 0):
        if rank == requester:
            (mine / REQUEST).touch()
        dist.barrier()
        answers.append(stop_requested(mine, ctx))
    assert answers == [False, True], f"rank {rank}: {answers}"
    assert isinstance(acknowledge(mine, ctx, 7), Preempted)
    assert (mine / DONE).is_file() == (rank == 0)
    end_process(0)  # destroys the group; gloo may abort at interpreter exit otherwise


@pytest.mark.slow
def test_rank_zero_decides_for_every_rank(tmp_path):
    mp.spawn(ranks_agree, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
