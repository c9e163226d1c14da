"""A registered DeFrag model as an MLflow pyfunc, built from code (MLflow's "models from code"):
`trainer.store.registry.register_model` logs this file with the model folder as the artifact
`model`, so `mlflow.pyfunc.load_model("models:/defrag@champion")` and `mlflow models serve` work and
nothing is pickled (the weights load from safetensors, their checksums verified).

`predict` takes a DataFrame whose rows each hold a `sentence` (text) or an `image` (the bytes of
a JPEG, PNG or WebP file, base64-encoded) and answers one row per input row:
- without params: `fragments`, the row's fragment vectors [n][d] (a whole-sentence encoder's
  sentence: its one row); `mean`, their mean [d] (zeros without fragments); `boxes`, an image's
  fragment boxes [n][4] (x1, y1, x2, y2 in the image's pixels; null for a sentence);
- with params {"index": "photos", "k": 10} (an index built by `defrag index` with
  this model, one its operator named: trainer/search/served_indexes.py): `hits`, the k best images
  of the index for a sentence, or its k best sentences for an image, each {"item", "score",
  "position"}, best first; `exact`, whether they are proven to be the exact top k (the
  certificate of docs/design.md, "Certified search"), `gap`, the bound left when not, and
  `scored`, how many items the model scored.

No error names the server's temporary files (an image row is row-N) or says what exists on disk.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.protos.databricks_pb2 import NOT_IMPLEMENTED
from mlflow.pyfunc import PythonModel, PythonModelContext

from featurizer.parsing import ParserUnavailable
from trainer.search.embedder import Embedder, RetrievalError, embed_images, embed_sentences
from trainer.search.fragment_set import FragmentSet
from trainer.search.served_indexes import ServedIndexes
from trainer.store.model_folder import ModelFolder
from trainer.store.registry import DEFAULT_K, PYFUNC_ARTIFACT

log = logging.getLogger(__name__)
FAILED = {"image": "the image cannot be read", "sentence": "the sentence cannot be embedded"}


class DeFragPyfunc(PythonModel):
    """A model folder's embeddings of sentences and images, and searches of its indexes (see the
    module docstring). One request at a time: the parsers are not known to be thread-safe."""

    def load_context(self, context: PythonModelContext) -> None:
        """Open and verify the artifact model folder, and load its model unless it is an
        ensemble or a captioner (`predict` says what to use instead). The indexes it may search
        come from the model_config and the environment (trainer/search/served_indexes.py)."""
        self.folder = ModelFolder.open(context.artifacts[PYFUNC_ARTIFACT])
        self.indexes = ServedIndexes.configure(context.model_config or {}, os.environ,
                                               self.folder)
        self.lock = threading.Lock()
        self.embedder: Embedder | None = None
        if self.folder.is_ensemble:
            self.unsupported = (f"an ensemble of {len(self.folder.members)} models",
                                "defrag retrieve or defrag evaluate")
        elif self.folder.is_captioner:
            self.unsupported = ("a captioner", "defrag caption")
        else:
            self.embedder = dataclasses.replace(Embedder.from_folder(self.folder),
                                                max_image_pixels=self.indexes.max_pixels)

    def predict(self, context: PythonModelContext, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> pd.DataFrame:
        """One output row per input row (see the module docstring)."""
        if self.embedder is None:
            what, tool = self.unsupported
            raise MlflowException(f"this model is {what}: its pyfunc neither embeds nor searches; "
                                  "download it (defrag registry download) and use "
                                  f"{tool}", NOT_IMPLEMENTED)
        params = params or {}
        k = DEFAULT_K if params.get("k") is None else int(params["k"])
        if k < 1:
            raise MlflowException.invalid_parameter_value(f"k is {k}: ask for 1 or more results")
        rows = [_query(number, row) for number, row in enumerate(model_input.to_dict("records"))]
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            try:
                images = _image_files(rows, Path(tmp))
                if params.get("index"):
                    return self._search(rows, images, str(params["index"]), k)
                return self._embed(rows, images)
            except RetrievalError as err:  # an image row's file is called row-N, not its path
                raise MlflowException.invalid_parameter_value(
                    str(err).replace(f"{tmp}{os.sep}", "")) from err
            except ParserUnavailable as err:  # the server's set-up: its message says what to do
                raise MlflowException(str(err)) from err

    def _embed(self, rows: list[tuple[str, Any]], images: dict[int, Path]) -> pd.DataFrame:
        """Each row's fragments, their mean and (images) their boxes."""
        found: dict[int, tuple[FragmentSet, int, bool]] = {}  # row -> its embedded set, item
        sentences = [number for number, (kind, _) in enumerate(rows) if kind == "sentence"]
        if sentences:
            with _naming_rows(sentences, "sentence"):
                embedded = embed_sentences([rows[n][1] for n in sentences], self.embedder)
            found |= {n: (embedded, item, False) for item, n in enumerate(sentences)}
        if images:
            with _naming_rows(list(images), "image"):
                embedded, _ = embed_images(list(images.values()), self.embedder, skip_bad=False,
                                           progress=False)
            found |= {n: (embedded, item, True) for item, n in enumerate(images)}
        return pd.DataFrame([_vectors(*found[number]) for number in range(len(rows))])

    def _search(self, rows: list[tuple[str, Any]], images: dict[int, Path], index: str,
                k: int) -> pd.DataFrame:
        """Each row's k best hits in the index: images for a sentence, sentences for an image."""
        opened = self.indexes.open(index)
        rankings = []
        for number, (kind, value) in enumerate(rows):
            with _naming_rows([number], kind):
                rankings.append(opened.images_for(value, k) if kind == "sentence"
                                else opened.sentences_for_file(images[number], k))
        return pd.DataFrame({"hits": [[{"item": hit.item, "score": hit.score,
                                        "position": hit.position} for hit in found.hits]
                                      for found in rankings],
                             "exact": [found.exact for found in rankings],
                             "gap": [found.gap for found in rankings],
                             "scored": [found.scored for found in rankings]})


@contextmanager
def _naming_rows(numbers: list[int], kind: str) -> Iterator[None]:
    """Any error but the client's own (RetrievalError, ...) of embedding rows `numbers` logged
    here and answered in one line naming the rows: its text may hold the server's temp paths."""
    try:
        yield
    except (RetrievalError, ParserUnavailable, MlflowException):
        raise
    except Exception as err:
        log.exception("embedding %s rows %s failed", kind, numbers)
        named = {int(n) for n in re.findall(r"\brow-(\d+)\b", str(err))} & set(numbers)
        rows = ", ".join(f"row-{n}" for n in sorted(named or numbers))
        raise MlflowException(f"{rows}: {FAILED[kind]} (the server's log says why)") from None


def _query(number: int, row: dict[str, Any]) -> tuple[str, Any]:
    """("sentence", text) or ("image", file bytes) of one input row, or a clear error."""
    given = {name: row[name] for name in ("sentence", "image")
             if name in row and isinstance(row[name], str)}
    if len(given) != 1:
        raise MlflowException.invalid_parameter_value(
            f"row {number} holds {sorted(given) or 'neither'}: give each row a sentence or an "
            "image (base64 of a JPEG, PNG or WebP file)")
    kind, value = next(iter(given.items()))
    if kind == "image":
        try:
            value = base64.b64decode(value, validate=True)
        except binascii.Error as err:
            raise MlflowException.invalid_parameter_value(
                f"row {number}: the image is not base64 ({err})") from err
    return kind, value


def _image_files(rows: list[tuple[str, Any]], folder: Path) -> dict[int, Path]:
    """The image rows' bytes written to files in `folder` (the embedder reads files), by row."""
    files = {}
    for number, (kind, value) in enumerate(rows):
        if kind == "image":
            files[number] = folder / f"row-{number}"
            with _naming_rows([number], "image"):
                files[number].write_bytes(value)
    return files


def _vectors(fragments: FragmentSet, item: int, image: bool) -> dict[str, Any]:
    """An item's output row: its fragment vectors, their mean, its boxes (images only)."""
    embeddings, detail = fragments.of(item)
    mean = embeddings.mean(0) if len(embeddings) else embeddings.new_zeros(embeddings.shape[1])
    return {"fragments": embeddings.tolist(), "mean": mean.tolist(),
            "boxes": detail.tolist() if image else None}


set_model(DeFragPyfunc())
