"""MLflow tracking of a training run: params, metrics, artifacts and pictures, from rank 0 only.

The store is `MLFLOW_TRACKING_URI` when set (e.g. a shared `mlflow server`), else an embedded
sqlite database `<run dir>/mlflow.db` with artifacts in `<run dir>/mlartifacts`. Three rules:
a store that cannot be reached fails fast at start-up with a message saying what to do; once
the run has started a tracking failure is logged and counted but never stops the training; and
what the store does not take (metrics, pictures, the run's end) waits on disk in the run folder
(`Spool`) until a later flush, the end of the run, or

    defrag tracking sync RUN_DIR [--tracking-uri URI]

sends it. An error once the run's work is done (FinishedRunError, e.g. a model that could not be
registered: trainer.store.registry.RegistrationFailed) ends the run FINISHED, the error as its tag.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.environment_variables import (
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR,
    MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_TIMEOUT,
    MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT,
    MLFLOW_TRACKING_URI,
)
from mlflow.exceptions import MlflowException
from PIL import Image

from defrag.cli import add_debug_flag, one_line_errors
from defrag.urls import redact
from trainer.config import Config
from trainer.store.spool import MAX_METRICS_PER_BATCH, Spool

log = logging.getLogger(__name__)

# MLflow's HTTP client retries a failed request 7 times with exponential backoff (minutes) and
# waits 120 s for an answer; a training step must not hang that long on a tracking call. These
# are set only where the user has not set them (their values win).
HTTP_DEFAULTS = {
    MLFLOW_HTTP_REQUEST_MAX_RETRIES.name: "2",  # ~3 s before a refused connection is a failure
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.name: "1",
    MLFLOW_HTTP_REQUEST_TIMEOUT.name: "20",
}
# The start-up probe of an http(s) server: one try, a short wait.
PROBE = {MLFLOW_HTTP_REQUEST_MAX_RETRIES.name: "0", MLFLOW_HTTP_REQUEST_TIMEOUT.name: "5"}
MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limits
MAX_PENDING_METRICS = 100_000  # metrics kept in memory when they can be neither sent nor spooled
ERROR_TAG, MAX_ERROR_LENGTH = "error", 5000  # the exception that ended a run, as its tag

T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be used at start-up (the run should not start without it)."""


class FinishedRunError(RuntimeError):
    """An error raised once the run's work is done (e.g. its model's registration): the run
    still ends FINISHED, with the error as its tag."""


def connect(tracking_uri: str) -> MlflowClient:
    """An MlflowClient for `tracking_uri`, after checking that an http(s) server answers.

    The check is one MLflow request without retries (so MLflow's own auth and TLS settings
    apply); it raises TrackingUnavailable naming the URI. Later requests get HTTP_DEFAULTS.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    if tracking_uri.startswith(("http://", "https://")):
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if redact(tracking_uri) != tracking_uri:  # MLflow prints each ended run's link, under
            os.environ[MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.name] = "true"  # the URL as given
        try:
            _probe(client)
        except MlflowException as err:
            raise TrackingUnavailable(
                f"MLflow tracking server {tracking_uri} cannot be used: {err}\nStart the server "
                f"(mlflow server --host ... --port ...), fix {MLFLOW_TRACKING_URI.name}, or "
                "unset it to track into the run directory's embedded store "
                "(sqlite:///<run dir>/mlflow.db).") from err
    return client


def _probe(client: MlflowClient) -> None:
    """One request to the store, without retries and with a short timeout (PROBE)."""
    with _environment(PROBE):
        client.search_experiments(max_results=1)


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Environment variables set to `values` inside the block, restored after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config sections as flat `section.key` entries (MLflow params are flat)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix=f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _tolerant(kind: str) -> Callable[[Callable[..., T]], Callable[..., T | None]]:
    """Decorator of the Tracker's store calls: nothing on a disabled tracker, and a failure is
    warned about and counted, never raised (the training goes on without this record)."""

    def decorate(method: Callable[..., T]) -> Callable[..., T | None]:
        @functools.wraps(method)
        def call(self: Tracker, *args: Any, **kwargs: Any) -> T | None:
            if not self.enabled:
                return None
            try:
                return method(self, *args, **kwargs)
            except Exception as err:  # any store, network or disk error: keep training
                self._failed(kind, err)
                return None

        return call

    return decorate


class Tracker:
    """One MLflow run seen from the trainer. Built by `Tracker.start`; on ranks other than 0 it
    is disabled and every method does nothing, so the trainer calls it unconditionally.

    Step metrics are buffered and sent in batches every `flush_seconds`. After a failed call,
    metrics and pictures wait in the run folder's `spool` and the next automatic send waits
    `pause_seconds`, then starts with one short request (PROBE): a store that is down or never
    answers costs one failed call per pause, not one per step, and a restarted one gets them all.
    """

    def __init__(self, client: MlflowClient | None, run_id: str | None,
                 tracking_uri: str | None, spool: Spool | None = None,
                 flush_seconds: float = 10.0, pause_seconds: float = 60.0) -> None:
        self.client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.spool = spool  # required with a client
        self.flush_seconds = flush_seconds
        self.pause_seconds = pause_seconds
        self._pending: list[Metric] = []
        self._last_flush = time.monotonic()
        self._paused_until = 0.0
        self._failures: Counter[str] = Counter()
        self._dropped_metrics = 0
        self._finished = False
        self.logged: dict[str, int] = {}  # a resumed run's last step of each metric (`held`)

    @property
    def enabled(self) -> bool:
        return self.client is not None

    @classmethod
    def start(cls, config: Config, run_dir: str | Path, rank: int, run_name: str | None = None,
              experiment: str = "defrag", resume_run_id: str | None = None) -> Tracker:
        """Open the run (a new one, or `resume_run_id` after a restart) and log `config`.

        Rank != 0 gets a disabled tracker and touches nothing. Raises TrackingUnavailable when
        the store cannot be reached or the run cannot be opened.
        """
        if rank != 0:
            return cls(client=None, run_id=None, tracking_uri=None)
        run_dir = Path(run_dir).resolve()
        tracking_uri = MLFLOW_TRACKING_URI.get()
        artifact_location = None
        if not tracking_uri:
            run_dir.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{run_dir / 'mlflow.db'}"
            artifact_location = (run_dir / "mlartifacts").as_uri()
        client = connect(tracking_uri)
        try:
            if resume_run_id is None:
                run = client.create_run(experiment_id(client, experiment, artifact_location),
                                        run_name=run_name)
                run_id = run.info.run_id
            else:
                run_id = client.get_run(resume_run_id).info.run_id
                client.update_run(run_id, status="RUNNING")
        except Exception as err:
            what = (f"resume run {resume_run_id} (it must be in the store the run started in)"
                    if resume_run_id else f"start a run in experiment {experiment!r}")
            raise TrackingUnavailable(f"MLflow tracking store {tracking_uri}: cannot {what}: "
                                      f"{err}") from err
        tracker = cls(client, run_id, tracking_uri, Spool(run_dir, run_id, tracking_uri))
        tracker.spool.end.unlink(missing_ok=True)  # resumed: RUNNING again until its own end
        log.info("tracking: MLflow run %s in %s", run_id, tracking_uri)
        if resume_run_id is None:  # MLflow's params are immutable: a resumed run keeps those it
            tracker.log_params(config)  # started with (trainer.main tags what a resume changed)
        else:
            tracker.logged = tracker.held() or {}
        return tracker

    @_tolerant("params")
    def log_params(self, config: Config) -> None:
        """The full config as flat `section.key` params, and config.json as an artifact,
        credentials masked."""
        params = [Param(key, str(value))
                  for key, value in flatten(redact(config.to_dict())).items()]
        for first in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id,
                                  params=params[first:first + MAX_PARAMS_PER_BATCH])
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "config.json"
            config.to_json(path)
            self.client.log_artifact(self.run_id, str(path))

    @_tolerant("tags")
    def set_tag(self, key: str, value: str) -> None:
        """Tag the run, credentials in `value` masked."""
        self.client.set_tag(self.run_id, key, redact(value))

    @_tolerant("metrics")
    def held(self) -> dict[str, int]:
        """The last step of each metric the run already holds, in its store or its spool. A
        resumed run trains again the steps between its checkpoint and the failure; `log_metrics`
        skips those the attempt before logged, so that each step is in the history once."""
        last = {}
        for key in self.client.get_run(self.run_id).data.metrics:
            last[key] = max(m.step for m in self.client.get_metric_history(self.run_id, key))
        for metric in self.spool.unsent_metrics():
            last[metric.key] = max(last.get(metric.key, metric.step), metric.step)
        if last:
            log.info("tracking: run %s holds steps up to %d; steps trained again after the "
                     "checkpoint are not logged twice", self.run_id, max(last.values()))
        return last

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue metrics (floats or 0-d tensors) at `step`, but none at a step the resumed run
        already holds for its key; sent every `flush_seconds`."""
        if not self.enabled:
            return
        timestamp = int(time.time() * 1000)
        self._pending.extend(Metric(key, float(value), timestamp, step)
                             for key, value in metrics.items()
                             if step > self.logged.get(key, -1))
        if len(self._pending) > MAX_PENDING_METRICS:
            excess = len(self._pending) - MAX_PENDING_METRICS
            del self._pending[:excess]
            self._dropped_metrics += excess
        now = time.monotonic()
        due = (now - self._last_flush >= self.flush_seconds
               or len(self._pending) >= MAX_METRICS_PER_BATCH)
        if due and now >= self._paused_until:
            self.flush()

    @_tolerant("metrics")
    def flush(self) -> None:
        """Send the spooled metrics, the queued ones, then the spooled pictures (e.g. after a
        validation). What the store does not take waits in the spool for the next send."""
        self._last_flush = time.monotonic()
        self._send_metrics()
        self._flush_images()

    def _send_metrics(self) -> int:
        """The spooled metrics, then the queued ones, which are spooled when the store fails;
        raises its error. How many were sent."""
        try:
            if not self.spool.empty():
                _probe(self.client)  # a store still down costs one short request
            sent = self.spool.send_metrics(self._log_batch)
            while self._pending:
                batch = self._pending[:MAX_METRICS_PER_BATCH]
                self._log_batch(batch)
                del self._pending[:len(batch)]
                sent += len(batch)
        except Exception:
            self.spool.add_metrics(self._pending)
            self._pending.clear()
            raise
        return sent

    def _log_batch(self, metrics: list[Metric]) -> None:
        """Send metrics; those the store refuses as invalid are dropped (a retry cannot help)."""
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except MlflowException as err:
            if err.error_code != "INVALID_PARAMETER_VALUE":  # e.g. a malformed metric name
                raise
            self._dropped_metrics += len(metrics)
            self._failed("metrics", err)

    def _send_images(self) -> int:
        """Send the spooled pictures, each removed once sent; raises the store's error."""
        files = self.spool.image_files()
        for path in files:
            with Image.open(path) as image:
                self.client.log_image(self.run_id, image, artifact_file=path.relative_to(
                    self.spool.images).as_posix())
            path.unlink()
        return len(files)

    _flush_images = _tolerant("images")(_send_images)

    @_tolerant("artifacts")
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file or a folder into the run's artifacts (under `artifact_path`)."""
        if Path(path).is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    @_tolerant("images")
    def log_image(self, image: Image.Image, name: str) -> None:
        """Save a picture as the artifact file `name`, e.g. "alignments/epoch-03.png". After a
        failure (paused, or something spooled) it goes to the spool, sent by a later flush."""
        if time.monotonic() < self._paused_until or not self.spool.empty():
            self.spool.add_image(image, name)
            return
        try:
            self.client.log_image(self.run_id, image, artifact_file=name)
        except Exception:
            self.spool.add_image(image, name)
            raise

    def check_store(self) -> None:
        """After a failure of the store, one short request to it before a long one (a model
        upload): a store still down fails in seconds."""
        if not self.spool.empty():
            _probe(self.client)

    def finish(self, status: str = "FINISHED", error: str | None = None) -> None:
        """Send what is queued or spooled and close the run as FINISHED, FAILED or KILLED (once),
        with `error` as its tag; what the store does not take waits in the spool for `sync`."""
        if not self.enabled or self._finished:
            return
        self._finished = True
        error = redact(error)
        self.flush()
        if self.spool.metrics.exists():  # the store did not take them: no other call now
            self.spool.add_end(status, error)
        else:
            self._end(status, error)
        self.spool.remove_if_empty()
        left = "" if self.spool.empty() else (
            f"; what it did not take is in {self.spool.folder}: `defrag tracking sync "
            f"{self.spool.folder.parents[1]}` sends it")
        if self._failures or self._dropped_metrics or self._pending or left:
            log.warning("tracking: run %s in %s is incomplete: failed calls %s, metrics never "
                        "sent %d%s", self.run_id, self.tracking_uri, dict(self._failures),
                        self._dropped_metrics + len(self._pending), left)

    @_tolerant("finish")
    def _end(self, status: str, error: str | None) -> None:
        try:
            self._close(status, error)
        except Exception:
            self.spool.add_end(status, error)
            raise

    def _close(self, status: str, error: str | None) -> None:
        if error:
            self.client.set_tag(self.run_id, ERROR_TAG, error[:MAX_ERROR_LENGTH])
        self.client.set_terminated(self.run_id, status=status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 _: object) -> None:
        """FINISHED on success, KILLED on Ctrl-C, FAILED on any other exception, which becomes
        the `error` tag (a FinishedRunError too, on a FINISHED run: the training finished)."""
        if kind is None:
            self.finish("FINISHED")
        elif issubclass(kind, KeyboardInterrupt):
            self.finish("KILLED")
        else:
            self.finish("FINISHED" if issubclass(kind, FinishedRunError) else "FAILED",
                        f"{kind.__name__}: {error}")

    def _failed(self, kind: str, err: Exception) -> None:
        self._failures[kind] += 1
        self._paused_until = time.monotonic() + self.pause_seconds
        if self._failures[kind] == 1:
            log.warning("tracking: %s failed for run %s in %s (%s: %s); training continues; "
                        "further %s failures are only counted (summary at the end)",
                        kind, self.run_id, self.tracking_uri, type(err).__name__, err, kind)


def experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, created (with `artifact_location`) when it does not exist."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location)


def sync(run_dir: str | Path, tracking_uri: str | None = None) -> list[str]:
    """Send what the runs of `run_dir` left spooled (metrics, pictures, their end) to their store
    or `tracking_uri`; one line per run says what was sent. Raises the store's error."""
    lines = []
    for spool in Spool.found(run_dir):
        uri = tracking_uri or spool.tracking_uri
        tracker = Tracker(connect(uri), spool.run_id, uri, spool)
        metrics, pictures = tracker._send_metrics(), tracker._send_images()
        end = json.loads(spool.end.read_text()) if spool.end.exists() else {"status": None}
        if end["status"]:
            tracker._close(end["status"], end["error"])
            spool.end.unlink()
        spool.remove_if_empty()
        lines.append(f"run {spool.run_id} in {uri}: sent metrics {metrics}, pictures {pictures}, "
                     f"status {end['status'] or 'unchanged'}")
    return lines or [f"{run_dir}: nothing spooled"]


def main(argv: list[str] | None = None) -> None:
    """`sync RUN_DIR`: send what a run's tracking store did not take (see Spool)."""
    parser = argparse.ArgumentParser(prog="defrag tracking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("sync", help="send a run folder's spooled metrics, pictures "
                                  "and final status (once its training has ended)")
    command.add_argument("run_dir", type=Path)
    command.add_argument("--tracking-uri", help="default: the store the run tracked into (give "
                         "it when its URI held a password, which the spool masks)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with (one_line_errors(f"{parser.prog} {args.command}", args.debug),
          contextlib.redirect_stdout(sys.stderr)):  # MLflow prints a link to each run it ends
        lines = sync(args.run_dir, args.tracking_uri)
    print("\n".join(lines))

