"""What a run's tracking store has not taken yet, kept on disk in the run folder until it is sent
(trainer/store/tracking.py): metrics as JSON lines, pictures as PNG files, the run's final status.
Nothing is pickled, and a write cut short by a kill loses at most that write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from PIL import Image

from defrag.files import TEMPORARY, replaced_atomically, write_atomically
from defrag.urls import redact

log = logging.getLogger(__name__)

SPOOL = "tracking-spool"  # <run dir>/tracking-spool/<run id>/: what the store has not taken yet
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit


class Spool:
    """What a run's store has not taken yet, in `<run dir>/tracking-spool/<run id>/` until sent:
    metrics.jsonl (JSON lines; metrics.sent: the bytes of it already sent), images/<artifact
    file> (PNG), end.json (the run's final status) and run.json (the run and its store)."""

    def __init__(self, run_dir: str | Path, run_id: str, tracking_uri: str) -> None:
        self.run_id, self.tracking_uri = run_id, tracking_uri
        self.folder = Path(run_dir) / SPOOL / run_id
        self.metrics, self.sent = self.folder / "metrics.jsonl", self.folder / "metrics.sent"
        self.images, self.end = self.folder / "images", self.folder / "end.json"

    @classmethod
    def found(cls, run_dir: str | Path) -> list[Spool]:
        """The spools in a run folder (one per MLflow run that trained into it)."""
        return [cls(run_dir, path.parent.name, json.loads(path.read_text())["tracking_uri"])
                for path in sorted((Path(run_dir) / SPOOL).glob("*/run.json"))]

    def empty(self) -> bool:
        return not (self.metrics.exists() or self.end.exists() or self.image_files())

    def image_files(self) -> list[Path]:
        """The pictures kept, not one being written."""
        return sorted(path for path in self.images.rglob("*")
                      if path.is_file() and TEMPORARY not in path.name)

    def add_metrics(self, metrics: list[Metric]) -> None:
        """Append metrics as JSON lines in one write: a kill mid-write cuts the last line only."""
        if not metrics:
            return
        self._open()
        if not self.metrics.exists():
            self.sent.unlink(missing_ok=True)  # stale: a kill between send_metrics' unlinks
        lines = "".join(json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp,
                                    "step": m.step}) + "\n" for m in metrics).encode()
        with self.metrics.open("a+b") as stream:
            end = stream.seek(0, os.SEEK_END)
            if end:
                stream.seek(end - 1)
                if stream.read(1) != b"\n":  # a line cut short: leave it on a line of its own
                    lines = b"\n" + lines
            stream.write(lines)

    def send_metrics(self, send: Callable[[list[Metric]], None]) -> int:
        """Send the spooled metrics in batches, oldest first, each marked sent once `send`
        returns (so never sent twice); raises what `send` raises. How many were sent."""
        if not self.metrics.exists():
            return 0
        sent = 0
        for batch, done in self._unsent_batches():
            send(batch)
            write_atomically(self.sent, str(done).encode())
            sent += len(batch)
        self.metrics.unlink()
        self.sent.unlink(missing_ok=True)
        return sent

    def unsent_metrics(self) -> Iterator[Metric]:
        """The spooled metrics not sent yet, oldest first."""
        for batch, _ in self._unsent_batches():
            yield from batch

    def _unsent_batches(self) -> Iterator[tuple[list[Metric], int]]:
        """The spooled metrics not sent yet, in batches, each with the offset after it."""
        if not self.metrics.exists():
            return
        start = int(self.sent.read_text()) if self.sent.exists() else 0
        with self.metrics.open("rb") as stream:
            stream.seek(start)
            yield from self._batches(stream, start)

    def _batches(self, stream: Any, offset: int) -> Iterator[tuple[list[Metric], int]]:
        """The metrics from `offset` on, in batches, each with the offset after it; a line that
        is not a complete record (a write cut short by a kill) is skipped with a warning."""
        batch: list[Metric] = []
        for line in stream:
            if line.strip():
                try:
                    record = json.loads(line)
                    batch.append(Metric(record["key"], float(record["value"]),
                                        int(record["timestamp"]), int(record["step"])))
                except (ValueError, KeyError, TypeError):
                    log.warning("tracking: %s: the line at byte %d is not a complete record "
                                "(a write cut short?); skipped", self.metrics, offset)
            offset += len(line)
            if len(batch) == MAX_METRICS_PER_BATCH:
                yield batch, offset
                batch = []
        if batch:
            yield batch, offset

    def add_image(self, image: Image.Image, name: str) -> None:
        """Keep a picture as images/<name>, a PNG file written whole, then renamed into place."""
        self._open()
        path = self.images / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as partial:
            image.save(partial, format="PNG")

    def add_end(self, status: str, error: str | None) -> None:
        self._open()
        write_atomically(self.end, json.dumps({"status": status, "error": error}).encode())

    def remove_if_empty(self) -> None:
        if self.empty():
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # the last run's spool

    def _open(self) -> None:
        """The folder, with run.json saying which run and store it is for (for `sync`; a
        password in the store's URI is masked there, so `sync --tracking-uri` gives it)."""
        identity = self.folder / "run.json"
        if not identity.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomically(identity, json.dumps({
                "run_id": self.run_id, "tracking_uri": redact(self.tracking_uri)}).encode())
