"""End to end: real 2-process torchrun trainings over real shards (DDP and DeepSpeed), MLflow
tracking and registration, the evaluate command, and a worker killed mid-run under
`torchrun --max-restarts 1` that resumes and ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from trainer.checkpoint import latest_checkpoint, load_state
from trainer.registry import verify_model_folder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, shards: Path, **run: object) -> Path:
    config = {
        "model": {"embed_dim": 32, "word_dim": 16, "image_size": 64,
                  "train_word_vectors": True},
        "data": {"shards": str(shards), "workers": 1, "shuffle_buffer": 50},
        "optim": {"batch_size": 20, "lr": 0.005, "epochs": 2, "frozen_cnn_epochs": 1,
                  "anneal_last_epochs": 1},
        "run": {"run_dir": str(tmp_path / "run"), "log_every_steps": 2, **run},
    }
    path = tmp_path / "config.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(config))
    return path


def torchrun(config: Path, *extra: str, restarts: int = 0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--max-restarts", str(restarts), "-m", "trainer.main", "--config", str(config),
               *extra]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]
    return output


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    folder = latest_checkpoint(run_dir)
    assert load_state(folder).epoch == 2
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_two_process_training_tracks_and_registers(tmp_path, shards, engine):
    config = tiny_config(tmp_path, shards, engine=engine,
                         deepspeed_config=str(ROOT / "launch/deepspeed/zero2.json"))
    output = finish(torchrun(config))
    assert "Grad strides do not match" not in output  # tests/test_engines.py says why
    summary = json.loads(output.strip().splitlines()[-1])
    run_dir = tmp_path / "run"
    assert summary["registered"] == "models:/defrag@champion"
    verify_model_folder(run_dir / "best")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["run.engine"] == engine
    assert {"train/loss", "train/lr", "val/rsum", "val/i2t_r1"} <= set(run.data.metrics)
    assert client.get_model_version_by_alias("defrag", "champion").run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "val/rsum")) == 2

    evaluation = subprocess.run(
        [sys.executable, "-m", "trainer.evaluate", "--model", str(run_dir / "best"),
         "--shards", str(shards / "val" / "shard-{000000..000001}.tar")],
        cwd=ROOT, capture_output=True, text=True, check=True)
    metrics = json.loads(evaluation.stdout.strip().splitlines()[-1])
    assert metrics["rsum"] == pytest.approx(summary["best_val_rsum"], abs=1e-3)


def test_killed_worker_resumes_to_the_same_weights(tmp_path, shards):
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    finish(torchrun(tiny_config(uninterrupted, shards, checkpoint_every_steps=3)))

    killed = tmp_path / "killed"
    killed.mkdir()
    process = torchrun(tiny_config(killed, shards, checkpoint_every_steps=3), restarts=1)
    pointer = killed / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (pointer.is_file() and pointer.read_text().strip() >= "step-00000006"):
        assert process.poll() is None, "the run ended before the kill"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    workers = psutil.Process(process.pid).children(recursive=True)
    victim = next(p for p in workers if "trainer.main" in " ".join(p.cmdline()))
    os.kill(victim.pid, signal.SIGKILL)
    output = finish(process)
    assert "resumed from" in output

    want, got = final_weights(uninterrupted / "run"), final_weights(killed / "run")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
