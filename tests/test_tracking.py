"""trainer/tracking.py on real MLflow stores: embedded sqlite files and a real `mlflow server`
(no mocks of MLflow). A fresh sqlite store costs seconds of schema migrations, so most tests copy
one empty store made once per session."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from mlflow import MlflowClient
from PIL import Image

from trainer.config import Config
from trainer.registry import download_model, save_model_folder, verify_model_folder
from trainer.tracking import HTTP_DEFAULTS, Tracker, TrackingUnavailable, flatten
from trainer.vocab import Vocabulary


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MLFLOW_TRACKING_URI from the caller's shell; HTTP settings restored after each test."""
    for name in ["MLFLOW_TRACKING_URI", *HTTP_DEFAULTS]:
        monkeypatch.setenv(name, "")  # records the original value for the teardown
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An sqlite file with MLflow's schema and no experiment of ours."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def copy_store(empty_store: Path, directory: Path) -> str:
    """A copy of the empty store in `directory`; its sqlite URI."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(empty_store, directory / "mlflow.db")
    return f"sqlite:///{directory / 'mlflow.db'}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tracker_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the tracker logged (MLflow logs its own errors too)."""
    return [r.getMessage() for r in caplog.records if r.name == "trainer.tracking"]


def picture() -> Image.Image:
    return Image.new("RGB", (32, 24), (200, 30, 30))


def test_run_in_embedded_store_logs_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"  # does not exist yet: the tracker creates it and the store
    config = Config()
    tracker = Tracker.start(config, run_dir, rank=0, run_name="unit")
    assert tracker.tracking_uri == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    for step in range(5):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "lr": 0.01}, step=step)
    tracker.log_metrics({"val_rsum": 123.5}, step=4)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    tracker.log_artifact(notes, "extra")
    tracker.log_image(picture(), "alignments/epoch-01.png")
    tracker.finish()

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit"
    assert run.data.params == {k: str(v) for k, v in flatten(config.to_dict()).items()}
    assert run.data.params["model.embed_dim"] == "1000"
    history = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert run.data.metrics["val_rsum"] == 123.5
    artifacts = run_dir / "mlartifacts"
    assert run.info.artifact_uri.startswith(artifacts.resolve().as_uri())
    logged = Path(run.info.artifact_uri.removeprefix("file://"))
    assert Config.from_dict(json.loads((logged / "config.json").read_text())) == config
    assert (logged / "extra" / "notes.txt").read_text() == "hello"
    with Image.open(logged / "alignments" / "epoch-01.png") as image:
        assert image.size == (32, 24) and image.getpixel((3, 3)) == (200, 30, 30)


def test_other_ranks_do_nothing(tmp_path: Path) -> None:
    tracker = Tracker.start(Config(), tmp_path / "run", rank=1)
    assert not tracker.enabled and tracker.run_id is None
    tracker.log_params(Config())
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.flush()
    tracker.log_artifact(tmp_path / "missing.txt")
    tracker.log_image(picture(), "x.png")
    assert tracker.register_model(tmp_path / "missing") is None
    tracker.finish()
    assert list(tmp_path.iterdir()) == []


def test_tracking_uri_is_honoured_and_a_run_resumes(
        tmp_path: Path, empty_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow puts this store's artifacts under ./mlruns
    uri = copy_store(empty_store, tmp_path / "shared")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    first = Tracker.start(Config(), tmp_path / "run", rank=0)
    assert first.tracking_uri == uri
    first.log_metrics({"loss": 2.0}, step=0)
    first.finish("FAILED")  # the job crashes; torchrun restarts it from its checkpoint
    assert not (tmp_path / "run" / "mlflow.db").exists()

    second = Tracker.start(Config(), tmp_path / "run", rank=0, resume_run_id=first.run_id)
    assert second.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    second.log_metrics({"loss": 1.0}, step=1)
    second.finish("KILLED")
    history = client.get_metric_history(first.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.0)]
    assert client.get_run(first.run_id).info.status == "KILLED"
    assert len(client.search_runs([client.get_experiment_by_name("defrag").experiment_id])) == 1

    with pytest.raises(TrackingUnavailable, match=f"{uri}: cannot resume run 0123 .*store"):
        Tracker.start(Config(), tmp_path / "run", rank=0, resume_run_id="0123")


def test_run_closed_by_context_manager_records_the_failure(tmp_path: Path,
                                                          empty_store: Path) -> None:
    copy_store(empty_store, tmp_path / "run")
    with pytest.raises(RuntimeError, match="diverged"), \
            Tracker.start(Config(), tmp_path / "run", rank=0) as tracker:
        raise RuntimeError("diverged")
    status = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id).info.status
    assert status == "FAILED"


def test_unreachable_server_fails_fast_with_advice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    began = time.monotonic()
    with pytest.raises(TrackingUnavailable) as failure:
        Tracker.start(Config(), tmp_path / "run", rank=0)
    assert time.monotonic() - began < 5
    message = str(failure.value)
    assert f"MLflow tracking server {uri} cannot be used" in message
    assert "Connection refused" in message
    assert "Start the server" in message and "or unset it" in message
    assert list(tmp_path.iterdir()) == []


def test_store_failing_mid_run_never_raises(
        tmp_path: Path, empty_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Break the real store under a running tracker: its metrics table and its artifact folder."""
    run_dir = tmp_path / "run"
    copy_store(empty_store, run_dir)
    tracker = Tracker.start(Config(), run_dir, rank=0)
    tracker.flush_seconds = 0.0  # every log_metrics call sends
    tracker.log_metrics({"loss": 3.0}, step=0)
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        db.execute("ALTER TABLE metrics RENAME TO metrics_away")
    shutil.rmtree(run_dir / "mlartifacts")
    (run_dir / "mlartifacts").write_text("not a folder")

    caplog.set_level(logging.WARNING, logger="trainer.tracking")
    began = time.monotonic()
    for step in range(1, 6):
        tracker.log_metrics({"loss": 3.0 - step / 10}, step=step)
    tracker.log_artifact(run_dir / "mlflow.db")
    tracker.log_image(picture(), "a.png")
    tracker.log_image(picture(), "b.png")
    assert time.monotonic() - began < 10
    warnings = tracker_messages(caplog)
    assert len(warnings) == 3  # one per kind: metrics, artifacts, images
    assert all("training continues" in w for w in warnings)
    assert tracker._failures == {"metrics": 1, "artifacts": 1, "images": 2}  # then paused

    with sqlite3.connect(run_dir / "mlflow.db") as db:  # the store comes back
        db.execute("ALTER TABLE metrics_away RENAME TO metrics")
    tracker.finish()  # sends the buffered metrics, closes the run, reports the losses
    summary = tracker_messages(caplog)[-1]
    assert "failed calls {'metrics': 1, 'artifacts': 1, 'images': 2}" in summary
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == list(range(6))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_invalid_metrics_are_dropped_not_retried_forever(
        tmp_path: Path, empty_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    copy_store(empty_store, tmp_path / "run")
    tracker = Tracker.start(Config(), tmp_path / "run", rank=0)
    tracker.flush_seconds = tracker.pause_seconds = 0.0
    tracker.log_metrics({"bad name!": 1.0}, step=0)
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.finish()
    assert "bad name!" in tracker_messages(caplog)[0]
    assert "metrics never sent 1" in tracker_messages(caplog)[-1]
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [1]


@pytest.mark.slow
def test_server_dying_mid_run_never_raises(
        tmp_path: Path, empty_store: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A real `mlflow server` on a free port: track and register a model through it (artifacts
    proxied by the server), kill it, keep logging."""
    uri = f"http://127.0.0.1:{free_port()}"
    backend = copy_store(empty_store, tmp_path / "server")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
         "--artifacts-destination", str(tmp_path / "server" / "artifacts"),
         "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1], "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240  # slow on a loaded machine (~45 s seen)
        while True:
            try:
                requests.get(f"{uri}/health", timeout=5)
                break
            except requests.RequestException:
                assert server.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.5)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        tracker = Tracker.start(Config(), tmp_path / "run", rank=0)
        tracker.log_metrics({"loss": 1.0}, step=0)
        tracker.flush()
        tracker.log_image(picture(), "before.png")
        client = MlflowClient(tracking_uri=uri)
        assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [0]
        folder = save_model_folder(tmp_path / "model", torch.nn.Linear(2, 2), Config(),
                                   Vocabulary(words=["dog"], relations=["nsubj"]))
        assert tracker.register_model(folder) == "1"
        verify_model_folder(download_model("models:/defrag@champion", tmp_path / "dl", uri))
    finally:
        server.terminate()
        server.wait(timeout=60)

    caplog.set_level(logging.WARNING, logger="trainer.tracking")
    began = time.monotonic()
    tracker.log_metrics({"loss": 0.5}, step=1)
    tracker.flush()
    tracker.log_image(picture(), "after.png")
    tracker.finish()
    assert time.monotonic() - began < 30  # bounded retries, not MLflow's minutes of backoff
    messages = tracker_messages(caplog)
    assert any("metrics failed" in m and "training continues" in m for m in messages)
    assert any("images failed" in m for m in messages)
    assert "incomplete" in messages[-1]
