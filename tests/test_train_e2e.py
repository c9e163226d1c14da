"""End to end: real 2-process torchrun trainings over real shards (DDP and DeepSpeed), MLflow
tracking and registration, the evaluate command, a rank killed three times under
`torchrun --max-restarts 3` that ends with the uninterrupted run's weights (rank 0's run_dir lock
taken over by its restart), and a killed loader process that stops the run with its name.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import psutil
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from tests import DEFRAG
from trainer.evaluate import retrieval_metrics
from trainer.store.model_folder import ModelFolder
from trainer.training.checkpoint import latest_checkpoint, load_state
from trainer.training.run_lock import LOCK

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


def side_by_side(*commands: list[str]) -> list[str]:
    """The stdout of each command, all run at once from the repository (one core each: the
    suite's OMP_NUM_THREADS=1), each asserted to exit 0."""
    with ExitStack() as files:
        outputs = [(files.enter_context(tempfile.TemporaryFile("w+")),
                    files.enter_context(tempfile.TemporaryFile("w+"))) for _ in commands]
        processes = [subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True)
                     for command, (out, err) in zip(commands, outputs, strict=True)]
        texts = []
        for command, process, (out, err) in zip(commands, processes, outputs, strict=True):
            process.wait(timeout=600)
            out.seek(0), err.seek(0)
            texts.append(out.read())
            assert process.returncode == 0, f"{command}: {err.read()[-3000:]}"
    return texts


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    folder = latest_checkpoint(run_dir)
    assert load_state(folder).epoch == 2
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_two_process_training_tracks_and_registers(shards, engine, request):
    """The trainings are the session's `ddp_training` and `deepspeed_training`
    (tests/conftest.py)."""
    run_dir, output = request.getfixturevalue(f"{engine}_training")
    assert "Grad strides do not match" not in output  # tests/test_engines.py says why
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["registered"] == "models:/defrag@champion"
    ModelFolder.open(run_dir / "best")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["run.engine"] == engine
    assert {"train/loss", "train/lr", "val/rsum", "val/i2t_r1"} <= set(run.data.metrics)
    assert client.get_model_version_by_alias("defrag", "champion").run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "val/rsum")) == 2

    evaluation = subprocess.run(
        [DEFRAG, "evaluate", "--model", str(run_dir / "best"),
         "--shards", str(shards / "val" / "shard-{000000..000001}.tar")],
        cwd=ROOT, capture_output=True, text=True, check=True)
    metrics = json.loads(evaluation.stdout.strip().splitlines()[-1])
    assert metrics["rsum"] == pytest.approx(summary["best_val_rsum"], abs=1e-3)


def test_a_rank_killed_three_times_resumes_to_the_same_weights(tmp_path, shards, ddp_training):
    """A rank SIGKILLed at 3 random steps under `torchrun --max-restarts 3` (rank 1, then rank
    0, which holds the run_dir lock, then rank 1 of the run that took the lock over): each
    restart resumes from the newest checkpoint, the restarted rank 0 (a new pid) takes the lock
    of the one killed over, and the run releases it and ends with the uninterrupted run's
    weights (the session's `ddp_training`, which saves no checkpoint mid-epoch), bit for bit
    (the same trainings are bitwise reproducible: tests/test_remote_shards.py)."""
    killed = tmp_path / "killed"
    killed.mkdir()
    kills = 3
    process = torchrun(tiny_config(killed, shards, checkpoint_every_steps=2), restarts=kills)
    pointer = killed / "run" / "checkpoints" / "latest"
    chance, resumed_at, lock_holder = random.Random(0), 0, None
    for restart in range(kills):  # 20 steps of ~0.1-0.3 s in all, a checkpoint every 2
        deadline = time.monotonic() + 600
        while saved_step(pointer) <= resumed_at:  # the restarted run resumed and saved again
            assert process.poll() is None, "the run ended before the kill"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(chance.uniform(0.0, 0.15))  # then a random moment of the next step or two
        victim = rank_process(process, rank=0 if restart == 1 else 1, restart=restart)
        if restart == 1:
            lock_holder = victim.pid
        os.kill(victim.pid, signal.SIGKILL)
        rank_process(process, rank=1, restart=restart + 1)  # torchrun restarted both ranks
        resumed_at = saved_step(pointer)
    output = finish(process)
    assert output.count("resumed from") == 2 * kills  # both ranks of each restart
    assert (f"taking over the lock of host {socket.gethostname()} pid {lock_holder} "
            in output), output[-4000:]
    assert "that process no longer runs" in output
    assert not (killed / "run" / LOCK).exists()

    want, got = final_weights(ddp_training[0]), final_weights(killed / "run")
    assert want.keys() == got.keys()
    differ = {name: (got[name] - want[name]).abs().max().item() for name in want
              if not torch.equal(got[name], want[name])}
    assert not differ, differ


def saved_step(pointer: Path) -> int:
    """The step of the checkpoint `latest` names (0 before the first)."""
    return int(pointer.read_text().split("-")[1]) if pointer.is_file() else 0


def rank_process(torchrun_process: subprocess.Popen, rank: int,
                 restart: int = 0) -> psutil.Process:
    """The training process of `rank` in torchrun's `restart`-th start of the workers, once
    started (a rank's loader processes share its command and environment, but not its parent,
    except orphans a killed rank left, whose restart count is an older one)."""
    wanted = {"RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart)}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for child in psutil.Process(torchrun_process.pid).children(recursive=True):
            try:
                environ = child.environ()
                if ("trainer.main" in " ".join(child.cmdline())
                        and all(environ.get(k) == v for k, v in wanted.items())
                        and child.ppid() == torchrun_process.pid):
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} process under torchrun")


def test_a_killed_loader_process_stops_the_run_with_its_name(tmp_path, scenes_200):
    """One rank's loader process SIGKILLed: that rank names it and fails, torchrun stops the
    other rank, and the run ends (non-zero) instead of hanging. 200 training images: the loader
    process then outlives its first steps (it waits for the training process to free a slot)."""
    process = torchrun(tiny_config(tmp_path, scenes_200, checkpoint_every_steps=1))
    pointer = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not pointer.is_file():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    rank = rank_process(process, rank=1)
    loaders = [p for p in rank.children() if p.cmdline() == rank.cmdline()]  # forked
    assert loaders, "rank 1 has no loader process"
    os.kill(loaders[0].pid, signal.SIGKILL)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0
    assert (f"trainer.main: error: loader process 0 (pid {loaders[0].pid}) exited unexpectedly "
            f"with exit code -9") in output, output[-3000:]


def chance_rsum(sentence_image: torch.Tensor, draws: int = 200) -> float:
    """The mean rsum of random scores over the same images and sentences."""
    generator = torch.Generator().manual_seed(0)
    num_images = int(sentence_image.max()) + 1
    return sum(retrieval_metrics(torch.rand(num_images, len(sentence_image),
                                            generator=generator), sentence_image)["rsum"]
               for _ in range(draws)) / draws


@pytest.mark.parametrize("encoder,score,margin", [
    ("lstm", "cosine", 0.2), ("dtrnn", "cosine", 0.2)])
def test_whole_sentence_encoder_trains_evaluates_and_retrieves(tmp_path, shards, encoder, score,
                                                               margin):
    """A sequence encoder (Kiros's LSTM) and a tree encoder (Socher's DT-RNN) through the normal
    commands: a 2-process training (C_G alone, the CNN fixed; cosine scores: with Socher's inner
    product this tiny run does not beat chance at lr 0.05) beats chance on val, and the model
    folder alone tells trainer.evaluate and trainer.search.retrieve what it is. linear and sdtrnn
    share all but their forward with these (tests/test_encoders.py tests it), and keep CI short."""
    config = tiny_config(tmp_path, shards)
    overrides = [f"model.sentence_encoder={encoder}", "objective.use_fragment=false",
                 f"objective.score={score}", f"objective.margin={margin}", "optim.epochs=3",
                 "optim.frozen_cnn_epochs=3", "optim.lr=0.05", "optim.anneal_last_epochs=0"]
    summary = json.loads(finish(torchrun(config, *overrides)).strip().splitlines()[-1])
    best = tmp_path / "run" / "best"
    assert json.loads((best / "config.json").read_text())["model"]["sentence_encoder"] == encoder
    # 10 val images, 5 captions: chance ~282; val rsum after epochs 1-4 (lstm, dtrnn):
    # 322 342 386 366, 408 426 398 410 (a 4th epoch's best is the 3rd's)
    chance = chance_rsum(torch.arange(10).repeat_interleave(5))
    assert summary["best_val_rsum"] > chance + 40, (summary["best_val_rsum"], chance)

    images = tmp_path / "images"
    images.mkdir()
    for source in sorted((shards / "source" / "images").glob("*"))[:4]:
        (images / source.name).write_bytes(source.read_bytes())
    retrieve = [DEFRAG, "retrieve", "--model", str(best), "--images",
                str(images), "--query", "a red star", "--json"]
    picture = tmp_path / "words.png"  # --explain: each word's contribution to the score
    evaluation, retrieved, explanation = side_by_side(
        [DEFRAG, "evaluate", "--model", str(best), "--shards",
         str(shards / "val" / "shard-{000000..000001}.tar")],
        retrieve, [*retrieve, "--explain", str(picture)])
    metrics = json.loads(evaluation.strip().splitlines()[-1])
    assert metrics["rsum"] == pytest.approx(summary["best_val_rsum"], abs=1e-3)

    report = json.loads(retrieved)
    assert len(report["queries"][0]["results"]) == 4
    explained = json.loads(explanation)
    known = set(json.loads((best / "vocab.json").read_text())["words"])
    assert [(w["word"], w["contribution"] is not None) for w in explained["explain"]["words"]] \
        == [(word, word in known) for word in ("a", "red", "star")]
    assert explained["explain"]["picture"] == str(picture) and picture.is_file()
