"""trainer/store/tracking.py on real MLflow stores: embedded sqlite files and a real `mlflow server`
(no mocks of MLflow). A fresh sqlite store costs seconds of schema migrations, so most tests copy
one empty store made once per session."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.environment_variables import (
    MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_TIMEOUT,
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION,
    MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT,
)
from PIL import Image

from defrag.vocab import Vocabulary
from tests import DEFRAG
from trainer.config import Config
from trainer.store.model_folder import ModelFolder, save_model_folder
from trainer.store.registry import RegistrationFailed, download_model, register_from_run
from trainer.store.tracking import (
    HTTP_DEFAULTS,
    PROBE,
    Tracker,
    TrackingUnavailable,
    flatten,
    sync,
)
from trainer.training.checkpoint import latest_checkpoint, load_state
from trainer.training.distributed import DistContext
from trainer.training.preemption import REQUEST, Preempted

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MLFLOW_TRACKING_URI from the caller's shell; HTTP settings restored after each test."""
    for name in ["MLFLOW_TRACKING_URI", *HTTP_DEFAULTS]:
        monkeypatch.setenv(name, "")  # records the original value for the teardown
        monkeypatch.delenv(name)


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
    """What the tracker and its spool logged (MLflow logs its own errors too)."""
    return [r.getMessage() for r in caplog.records
            if r.name in ("trainer.store.tracking", "trainer.store.spool")]


def picture() -> Image.Image:
    return Image.new("RGB", (32, 24), (200, 30, 30))


class MlflowServer:
    """A real `mlflow server` on a free 127.0.0.1 port, its store and artifacts in `root`;
    `stop()` it and `start()` it again on the same port with the same store."""

    def __init__(self, root: Path, empty_store: Path) -> None:
        self.root, self.backend = root, copy_store(empty_store, root)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        # Without its job runner (MLflow 3's optional jobs, which the tracker never uses): ~8
        # more Python processes importing MLflow at each start, contending for the CPUs.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend,
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            env={**os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION.name: "false"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240  # slow on a loaded machine (~45 s seen)
        while True:
            try:
                requests.get(f"{self.uri}/health", timeout=5)
                return
            except requests.RequestException:
                assert self.process.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory,
                  empty_store: Path) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("server"), empty_store)
    yield server
    if server.process is not None:
        server.stop()


@pytest.fixture
def mlflow_server(module_server: MlflowServer) -> MlflowServer:
    """One server for this file's tests, running at each test's start (a test may stop it)."""
    module_server.start()
    return module_server


def training_config(run_dir: Path, shards: Path, **sections: dict) -> Config:
    """A tiny real training: 2 epochs of 10 steps on the synthetic shards, every step logged."""
    config = {
        "model": {"embed_dim": 16, "word_dim": 8, "image_size": 64, "train_word_vectors": True},
        "data": {"shards": str(shards), "workers": 0, "shuffle_buffer": 10},
        "optim": {"batch_size": 20, "epochs": 2, "frozen_cnn_epochs": 2},
        "run": {"run_dir": str(run_dir), "log_every_steps": 1, "nonfinite_loss": "stop"},
    }
    return Config.from_dict({k: {**v, **sections.get(k, {})} for k, v in config.items()})


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
    assert register_from_run(tracker, tmp_path / "missing") is None
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


def test_a_resumed_run_logs_each_step_once(tmp_path: Path) -> None:
    """A restart trains again the steps between the checkpoint and the failure: those the store
    or the spool already holds are not logged again, later ones and new keys are."""
    first = Tracker.start(Config(), tmp_path / "run", rank=0)
    for step in range(1, 6):
        first.log_metrics({"loss": float(step)}, step=step)
    first.flush()
    first.spool.add_metrics([Metric("loss", 6.0, 0, 6)])  # what a store that was down kept
    # killed here: no finish; resumed from the checkpoint of step 2
    second = Tracker.start(Config(), tmp_path / "run", rank=0, resume_run_id=first.run_id)
    for step in range(3, 9):
        second.log_metrics({"loss": 10.0 + step, "val": 1.0}, step=step)
    second.finish()
    client = MlflowClient(tracking_uri=first.tracking_uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "loss"))
    assert history == [(s, float(s)) for s in range(1, 7)] + [(7, 17.0), (8, 18.0)]
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "val")) == [
        3, 4, 5, 6, 7, 8]


def test_run_closed_by_context_manager_records_the_failure(tmp_path: Path,
                                                          empty_store: Path) -> None:
    copy_store(empty_store, tmp_path / "run")
    with pytest.raises(RuntimeError, match="diverged"), \
            Tracker.start(Config(), tmp_path / "run", rank=0) as tracker:
        raise RuntimeError("diverged")
    run = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "RuntimeError: diverged"


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

    caplog.set_level(logging.WARNING, logger="trainer.store.tracking")
    began = time.monotonic()
    for step in range(1, 6):
        tracker.log_metrics({"loss": 3.0 - step / 10}, step=step)
    tracker.log_artifact(run_dir / "mlflow.db")
    tracker.log_image(picture(), "a.png")
    tracker.log_image(picture(), "b.png")
    assert time.monotonic() - began < 10
    warnings = tracker_messages(caplog)
    assert len(warnings) == 2  # one per kind: metrics, artifacts
    assert all("training continues" in w for w in warnings)
    assert tracker._failures == {"metrics": 1, "artifacts": 1}  # then paused
    images = run_dir / "tracking-spool" / tracker.run_id / "images"
    assert sorted(p.name for p in images.iterdir()) == ["a.png", "b.png"]  # wait, not tried

    with sqlite3.connect(run_dir / "mlflow.db") as db:  # the store comes back
        db.execute("ALTER TABLE metrics_away RENAME TO metrics")
    tracker.finish()  # sends the metrics, closes the run; the pictures cannot go yet
    summary = tracker_messages(caplog)[-1]
    assert "failed calls {'metrics': 1, 'artifacts': 1, 'images': 1}" in summary
    assert f"defrag tracking sync {run_dir.resolve()}` sends it" in summary
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == list(range(6))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"

    (run_dir / "mlartifacts").unlink()  # the artifact store comes back too
    assert sync(run_dir) == [f"run {tracker.run_id} in {tracker.tracking_uri}: sent metrics 0, "
                             "pictures 2, status unchanged"]
    assert {a.path for a in client.list_artifacts(tracker.run_id)} >= {"a.png", "b.png"}


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



def test_spool_skips_a_line_cut_short_and_sends_the_rest(
        tmp_path: Path, empty_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Metrics the store refuses wait in the run folder as JSON lines; a line that a kill cut
    short is skipped with a warning, the records around it are sent, each once."""
    run_dir = tmp_path / "run"
    copy_store(empty_store, run_dir)
    tracker = Tracker.start(Config(), run_dir, rank=0)
    tracker.flush_seconds = tracker.pause_seconds = 0.0
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        db.execute("ALTER TABLE metrics RENAME TO metrics_away")
    tracker.log_metrics({"loss": 1.0}, step=0)
    spooled = run_dir / "tracking-spool" / tracker.run_id / "metrics.jsonl"
    first_line = spooled.read_text()
    with spooled.open("a") as stream:
        stream.write('{"key": "loss", "val')  # the process was killed mid-write
    tracker.log_metrics({"loss": 0.5}, step=1)
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        db.execute("ALTER TABLE metrics_away RENAME TO metrics")
    tracker.finish()
    assert any(f"{spooled}: the line at byte {len(first_line)} is not a complete record" in m
               for m in tracker_messages(caplog))
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [0, 1]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not (run_dir / "tracking-spool").exists()


@pytest.mark.slow
def test_server_dying_mid_run_spools_what_it_could_not_send(
        tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Track and register a model through a real `mlflow server` (artifacts proxied by it), stop
    it, keep logging: what was not sent waits in the run folder, and `sync` sends it later."""
    uri, run_dir = mlflow_server.uri, tmp_path / "run"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = Tracker.start(Config(), run_dir, rank=0)
    assert {name: os.environ[name] for name in HTTP_DEFAULTS} == HTTP_DEFAULTS  # none set before
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.flush()
    tracker.log_image(picture(), "before.png")
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [0]
    folder = save_model_folder(tmp_path / "model", torch.nn.Linear(2, 2), Config(),
                               Vocabulary(words=["dog"], relations=["nsubj"]))
    version = register_from_run(tracker, folder)
    ModelFolder.open(download_model(f"models:/defrag/{version}", tmp_path / "dl", uri))
    mlflow_server.stop()

    caplog.set_level(logging.WARNING, logger="trainer.store.tracking")
    began = time.monotonic()
    tracker.log_metrics({"loss": 0.5}, step=1)
    tracker.flush()
    tracker.log_image(picture(), "after.png")
    tracker.finish()
    assert time.monotonic() - began < 30  # bounded retries, not MLflow's minutes of backoff
    messages = tracker_messages(caplog)
    assert any("metrics failed" in m and "training continues" in m for m in messages)
    assert f"defrag tracking sync {run_dir.resolve()}" in messages[-1]
    assert (run_dir / "tracking-spool" / tracker.run_id / "images" / "after.png").is_file()

    mlflow_server.start()
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    assert sync(run_dir) == [f"run {tracker.run_id} in {uri}: sent metrics 1, pictures 1, "
                             "status FINISHED"]
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [0, 1]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(tracker.run_id)} >= {"before.png", "after.png"}
    assert sync(run_dir) == [f"{run_dir}: nothing spooled"]


@pytest.mark.slow
def test_a_password_in_the_tracking_uri_is_never_printed(
        tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """MLflow prints the link of each run it ends, under its store's URL as given (a password in
    it too) unless told not to: the tracker tells it when the URL holds a credential."""
    secret = "pw-4b1d9e"
    monkeypatch.setenv(MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.name, "")  # restored after the test
    monkeypatch.delenv(MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri.replace("//", f"//u:{secret}@"))
    Tracker.start(Config(), tmp_path / "run", rank=0).finish()
    printed = "".join(capfd.readouterr())
    assert "View run" not in printed and secret not in printed


@pytest.mark.slow
def test_server_that_never_answers_costs_timeouts_not_a_hang(
        tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's port taken over by a socket that accepts connections and never answers:
    one request's timeouts, then short probes; everything waits in the run folder. The user's
    1 s request timeout (their HTTP settings win over HTTP_DEFAULTS' 20 s) keeps it short; the
    20 s default itself is asserted as set, not waited out (test_server_dying_mid_run_...), and
    so are the probe's single try and 5 s at most, waited out at 1 s."""
    uri, run_dir = mlflow_server.uri, tmp_path / "run"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv(MLFLOW_HTTP_REQUEST_TIMEOUT.name, "1")
    assert PROBE[MLFLOW_HTTP_REQUEST_MAX_RETRIES.name] == "0"
    assert float(PROBE[MLFLOW_HTTP_REQUEST_TIMEOUT.name]) <= 5
    monkeypatch.setitem(PROBE, MLFLOW_HTTP_REQUEST_TIMEOUT.name, "1")
    tracker = Tracker.start(Config(), run_dir, rank=0)
    assert os.environ[MLFLOW_HTTP_REQUEST_TIMEOUT.name] == "1"
    tracker.flush_seconds = 0.0  # every log_metrics call would send
    tracker.log_metrics({"loss": 1.0}, step=0)
    folder = save_model_folder(tmp_path / "model", torch.nn.Linear(2, 2), Config(),
                               Vocabulary(words=["dog"], relations=["nsubj"]))
    mlflow_server.stop()
    with socket.socket() as hole:
        hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hole.bind(("127.0.0.1", mlflow_server.port))
        hole.listen(100)
        began = time.monotonic()
        for step in range(1, 50):
            tracker.log_metrics({"loss": 1.0 - step / 100}, step=step)
        tracker.log_image(picture(), "alignments/epoch-000.png")
        with pytest.raises(RegistrationFailed, match="timed out"):
            register_from_run(tracker, folder)
        tracker.finish()
        # one log_batch: 3 tries of 1 s and ~3 s of backoff (HTTP_DEFAULTS' retries), then two
        # 1 s probes (PROBE), ~8 s; without the pause and the probes: one call a step, ~6 s each
        assert time.monotonic() - began < 20

    mlflow_server.start()
    assert sync(run_dir) == [f"run {tracker.run_id} in {uri}: sent metrics 49, pictures 1, "
                             "status FINISHED"]
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == list(range(50))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(tracker.run_id, "alignments")] == [
        "alignments/epoch-000.png"]


def runs_of(client: MlflowClient, run_dir: Path) -> list:
    """The MLflow runs that trained into `run_dir` (its param run.run_dir)."""
    experiment = client.get_experiment_by_name("defrag").experiment_id
    return client.search_runs([experiment], f"params.`run.run_dir` = '{run_dir}'")


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["lr 1e20", "a checkpoint of another model"])
def test_failed_training_ends_its_run_failed_with_the_error(
        failure: str, tmp_path: Path, shards: Path, mlflow_server: MlflowServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception after the tracker started closes the run FAILED, the error as its tag; a
    preempted run stays KILLED."""
    from trainer.main import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    client, run_dir = MlflowClient(tracking_uri=mlflow_server.uri), tmp_path / "run"
    if failure == "lr 1e20":  # the first update overflows; run.nonfinite_loss=stop
        cfg = training_config(run_dir, shards, optim={"lr": 1e20})
    else:  # one step, a checkpoint, preempted; then resumed with a wider model from it as an
        run_dir.mkdir()  # earlier version wrote it (no config.json to compare, no checksums)
        (run_dir / REQUEST).touch()
        with pytest.raises(Preempted):
            train(training_config(run_dir, shards), CPU, resume="latest")
        [preempted] = runs_of(client, run_dir)
        assert preempted.info.status == "KILLED"
        checkpoint = latest_checkpoint(run_dir)
        for name in ("config.json", "checksums.json"):
            (checkpoint / name).unlink()
        cfg = training_config(run_dir, shards, model={"embed_dim": 32})
    with pytest.raises(Exception) as failed:
        train(cfg, CPU, resume="latest")
    [run] = runs_of(client, run_dir)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["error"] == f"{type(failed.value).__name__}: {failed.value}"[:5000]


@pytest.mark.slow
def test_registration_failing_at_the_end_is_reported_and_can_be_done_later(
        tmp_path: Path, shards: Path, mlflow_server: MlflowServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stops after epoch 0 of 2: the training goes on, what it could not send waits in
    the run folder, and the registration fails loudly with the command that does it later."""
    from trainer.main import train
    from trainer.training.loop import Trainer

    end_epoch = Trainer.end_epoch

    def end_epoch_then_stop_the_server(self: Trainer, epoch: int, train_seconds: float) -> None:
        end_epoch(self, epoch, train_seconds)
        if epoch == 0:
            mlflow_server.stop()

    monkeypatch.setattr(Trainer, "end_epoch", end_epoch_then_stop_the_server)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    uri, run_dir = mlflow_server.uri, tmp_path / "run"
    with pytest.raises(RegistrationFailed) as failed:
        train(training_config(run_dir, shards), CPU, resume="none")
    summary = failed.value.summary
    run_id, later = summary["mlflow_run_id"], summary["register_later"]
    assert summary["registered"] is None and "Connection refused" in summary["registration_error"]
    assert later.startswith(f"defrag registry register {run_dir.resolve() / 'best'} ")
    assert later in str(failed.value)
    assert (run_dir / "tracking-spool" / run_id / "images" / "alignments" /
            "epoch-001.png").is_file()

    mlflow_server.start()
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run([DEFRAG, "tracking", "sync", str(run_dir)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"run {run_id} in {uri}: sent metrics \d+, pictures 1, status FINISHED",
                        done.stdout.strip()), done.stdout
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["error"].startswith("RegistrationFailed: ")
    last_step = load_state(latest_checkpoint(run_dir)).global_step
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(1, last_step + 1))  # each step once, none lost
    assert [a.path for a in client.list_artifacts(run_id, "alignments")] == [
        "alignments/epoch-000.png", "alignments/epoch-001.png"]

    done = subprocess.run([DEFRAG, *shlex.split(later)[1:]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    version = client.get_registered_model("defrag").aliases["champion"]
    assert done.stdout.strip() == f"models:/defrag/{version}"
    champion = download_model("models:/defrag@champion", tmp_path / "champion", uri)
    assert ((champion / "weights.safetensors").read_bytes()
            == (run_dir / "best" / "weights.safetensors").read_bytes())
