"""Stop on request (trainer/training/preemption.py): rank 0's request file or SIGTERM to any rank
decides for every rank, and a training run so stopped checkpoints, stops, and resumes from there to
the end, under torchrun too."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_train_e2e import finish, saved_step, tiny_config, torchrun
from trainer.config import Config
from trainer.training.checkpoint import latest_checkpoint, load_state
from trainer.training.distributed import DistContext, end_process
from trainer.training.preemption import (
    DONE,
    REQUEST,
    SIGTERM,
    Preempted,
    acknowledge,
    stop_on_sigterm,
    stop_requested,
)

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


def test_sigterm_asks_for_a_stop_after_the_step(tmp_path):
    """Inside stop_on_sigterm the signal only sets the flag the next check reads; outside it
    SIGTERM is its default again."""
    with stop_on_sigterm():
        assert stop_requested(tmp_path, CPU) is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested(tmp_path, CPU) == SIGTERM
        stop = acknowledge(tmp_path, CPU, 5, SIGTERM)
    assert str(stop).startswith("stopped on SIGTERM with a checkpoint at step 5;")
    assert stop.exit_code == 143 and (tmp_path / DONE).read_text() == "5\n"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    (tmp_path / REQUEST).touch()
    assert acknowledge(tmp_path, CPU, 6, stop_requested(tmp_path, CPU)).exit_code == 0


def ranks_agree(rank: int, world_size: int, init_file: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"))
    mine = Path(root) / f"rank{rank}"  # a folder per rank: only rank 0's may count
    mine.mkdir()
    answers = []
    with stop_on_sigterm():
        for requester in (1, 0):
            if rank == requester:
                (mine / REQUEST).touch()
            dist.barrier()
            answers.append(stop_requested(mine, ctx))
        if rank == 1:  # then rank 1 alone gets SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
        dist.barrier()
        answers.append(stop_requested(mine, ctx))
    assert answers == [None, REQUEST, SIGTERM], f"rank {rank}: {answers}"
    assert acknowledge(mine, ctx, 7, SIGTERM).exit_code == 128 + signal.SIGTERM
    assert (mine / DONE).is_file() == (rank == 0)
    end_process(0)  # destroys the group; gloo may abort at interpreter exit otherwise


@pytest.mark.slow
def test_rank_zero_decides_for_every_rank(tmp_path):
    mp.spawn(ranks_agree, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)


@pytest.mark.slow
def test_torchrun_sigtermed_mid_epoch_checkpoints_and_resumes(tmp_path, shards):
    """SIGTERM to torchrun and every process under it, as SLURM sends it at the time limit (and
    Kubernetes to torchrun alone, which sends it on): both ranks stop after the same step with a
    checkpoint, the MLflow run is KILLED, torchrun exits 1 as it always does after a SIGTERM
    (trainer/training/preemption.py says why), and the run resumes from there to the end of its
    one epoch."""
    from mlflow import MlflowClient

    config = tiny_config(tmp_path, shards, checkpoint_every_steps=2, log_every_steps=1)
    one_epoch = ["optim.epochs=1", "optim.anneal_last_epochs=0"]
    run_dir = tmp_path / "run"
    process = torchrun(config, *one_epoch)
    deadline = time.monotonic() + 600
    while saved_step(run_dir / "checkpoints" / "latest") < 2:  # in the middle of epoch 0
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    launcher = psutil.Process(process.pid)
    for member in [launcher, *launcher.children(recursive=True)]:  # loader processes too
        member.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)

    assert process.returncode == 1, output[-4000:]
    step = int((run_dir / DONE).read_text())
    assert f"stopped on SIGTERM with a checkpoint at step {step}" in output, output[-4000:]
    stopped = load_state(latest_checkpoint(run_dir))
    assert (stopped.epoch, stopped.global_step) == (0, step) and 2 < step < 10
    tracebacks = output.count("Traceback (most recent call last)")
    assert tracebacks == output.count("torch.distributed.elastic.multiprocessing.api."
                                      "SignalException: Process"), output[-4000:]  # torchrun's
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert client.get_run(stopped.mlflow_run_id).info.status == "KILLED"
    assert not (run_dir / "LOCK").exists()

    resumed = finish(torchrun(config, *one_epoch))
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:08d}'} " in resumed
    finished = load_state(latest_checkpoint(run_dir))
    assert finished.epoch == 1 and finished.mlflow_run_id == stopped.mlflow_run_id
    run = client.get_run(stopped.mlflow_run_id)
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps == list(range(1, finished.global_step + 1))  # none lost or repeated
