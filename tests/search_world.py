"""A small photo collection to search, for the web app's tests and benchmark
(trainer/search/serve.py): generated scenes, a fragments model really trained on them by the
project's Trainer (about 20 s on one thread), its search index, and a caption the model ranks its
own image first for.

The collection is one scene of each twin pair of the val split (a twin has the same colours on
other shapes), so a caption is told from the other images by more than its colour-shape binding.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn

import trainer.search.index_builder
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from tests.small_training import train_small
from tests.test_arithmetic import one_thread
from trainer.data.shardset import training_featurizer
from trainer.model import DeFragModel
from trainer.search.embedder import Embedder, embed_images, embed_sentences
from trainer.search.fragment_set import rank
from trainer.store.model_folder import ModelFolder, save_model_folder

NUM_TRAIN, NUM_VAL, EPOCHS = 300, 16, 10
MIN_MARGIN = 0.5  # the chosen caption's own image beats the next one by this much (eq. 6)


@dataclass
class SearchWorld:
    """The folders of the collection and the query the tests search for."""

    model_dir: Path
    other_model_dir: Path  # the same architecture, other weights: another checksums key
    photos: Path  # the indexed images
    index: Path
    captions: dict[str, list[str]]  # each indexed image's captions (the index's sentences)
    query: str  # a caption whose own image the model ranks first ...
    expected: str  # ... this one
    margin: float  # by this much over the next image


def build_world(root: Path) -> SearchWorld:
    """Scenes, a trained model, another model, the index and the query (see module doc)."""
    with one_thread():
        jsonl = generate(root / "source", NUM_TRAIN, NUM_VAL, seed=0, image_size=64)
        shards = root / "shards"
        featurize(read_jsonl(jsonl, jsonl.parent, "train"),
                  Settings(out=shards, parser="spacy", boxes="fullframe", shard_size=100,
                           workers=1))
        model_dir = train_fragments(shards, root / "run")
        trained = ModelFolder.open(model_dir)
        cfg, vocab = trained.config, trained.vocab
        other = save_model_folder(root / "other", DeFragModel.from_config(cfg.model, vocab, seed=1),
                                  cfg, vocab, featurizer=training_featurizer(cfg.data))
        photos = root / "photos"
        photos.mkdir()
        captions = {}
        val = [r for r in map(json.loads, jsonl.read_text().splitlines()) if r["split"] == "val"]
        for record in val[::2]:  # one scene of each twin pair
            path = jsonl.parent / record["image"]
            shutil.copy2(path, photos / path.name)
            captions[path.name] = record["captions"]
        sentences = root / "sentences.txt"
        sentences.write_text("".join(f"{c}\n" for cs in captions.values() for c in cs))
        trainer.search.index_builder.main(["--model", str(model_dir), "--images", str(photos),
                                           "--sentences", str(sentences), "--out",
                                           str(root / "index"), "--workers", "1"])
        query, expected, margin = clearest_caption(model_dir, photos, captions)
    if margin < MIN_MARGIN:
        raise RuntimeError(f"the trained model tells no caption's image from the others by "
                           f"{MIN_MARGIN} (best: {margin:.3f} for {query!r}): training changed?")
    return SearchWorld(model_dir, other, photos, root / "index", captions, query, expected,
                       margin)


def train_fragments(shards: Path, run_dir: Path) -> Path:
    """The paper's fragments model (eq. 6 scores) trained with the CNN fixed; its best folder."""
    return train_small(shards, run_dir, EPOCHS, lr=0.01)


def clearest_caption(model_dir: Path, photos: Path, captions: dict[str, list[str]]
                     ) -> tuple[str, str, float]:
    """The caption whose own image the model (an exact scan, not the index) ranks first by the
    widest margin: the caption, its image and the margin."""
    embedder = Embedder.from_folder(ModelFolder.open(model_dir))
    images, _ = embed_images(sorted(photos.iterdir()), embedder, skip_bad=False)
    texts = [(text, name) for name, cs in captions.items() for text in cs]
    scores = rank(images, embed_sentences([text for text, _ in texts], embedder),
                  embedder.cfg.objective.smooth, embedder.cfg.objective.score)
    best = (float("-inf"), "", "")
    for q, (text, name) in enumerate(texts):
        own = images.items.index(name)
        others = torch.cat([scores[:own, q], scores[own + 1:, q]])
        best = max(best, (float(scores[own, q] - others.max()), text, name))
    margin, text, name = best
    return text, name, margin


_WORLDS: dict[Path, SearchWorld] = {}


def search_world(root: Path) -> SearchWorld:
    """The world under `root`, built once per process (test modules and runs share it)."""
    if root not in _WORLDS:
        root.mkdir(parents=True, exist_ok=True)
        _WORLDS[root] = build_world(root)
    return _WORLDS[root]


@contextmanager
def serving(app, timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 at a free port, in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
