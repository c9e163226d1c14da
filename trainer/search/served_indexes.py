"""The search indexes a served model (trainer/search/pyfunc_model.py) opens for its clients: only
those its operator named, by a name of a configured set or as a folder under a configured root
(resolved with realpath, so `..`, `//` and links cannot leave it); the last few used stay open,
keyed by the resolved folder, so many spellings of one index open it once.

A client learns nothing of the server's disk: whatever the reason an index cannot be searched
(outside the root, missing, no index, built by another model), it gets the same one line, which
lists what the server searches; the server's log says why.

The operator configures it with the model's `model_config` (trainer.store.registry.PYFUNC_CONFIG,
set with `mlflow.pyfunc.load_model(uri, model_config={...})` or MLflow's
MLFLOW_PYFUNC_INFERENCE_CONFIG) or, at serve time, the environment, which wins:
- `index_root` / DEFRAG_INDEX_ROOT: a folder; a client names an index under it by its path
  relative to it (or its full path);
- `indexes` / DEFRAG_INDEXES: names for index folders anywhere ({"photos": "/data/idx"}, or
  `photos=/data/idx:faces=/data/faces-idx`, entries separated by os.pathsep);
- `cached_indexes` / DEFRAG_CACHED_INDEXES: how many indexes stay open (default 2; each holds
  its own copy of the model);
- `max_image_pixels` / DEFRAG_MAX_IMAGE_PIXELS: larger image rows are refused from their header,
  before decoding (default 40,000,000), whether embedded or searched with.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from defrag.images import MAX_IMAGE_PIXELS
from trainer.search.embedder import RetrievalError
from trainer.search.index import SearchIndex
from trainer.store.model_folder import ModelFolder
from trainer.store.registry import PYFUNC_CONFIG

log = logging.getLogger(__name__)

SETTINGS = {"index_root": "DEFRAG_INDEX_ROOT", "indexes": "DEFRAG_INDEXES",
            "cached_indexes": "DEFRAG_CACHED_INDEXES",
            "max_image_pixels": "DEFRAG_MAX_IMAGE_PIXELS"}  # model_config key: environment variable


class ServedIndexes:
    """The indexes a server may open (see the module doc), and those it holds open."""

    def __init__(self, names: dict[str, str], root: str | None, cached: int,
                 model: ModelFolder, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        self.names, self.model, self.cached = names, model, cached
        self.max_pixels = max_pixels  # the pixel bound of image rows
        self.root = Path(os.path.realpath(root)) if root else None
        self.cache: OrderedDict[Path, SearchIndex] = OrderedDict()  # least recently used first

    @classmethod
    def configure(cls, config: Mapping[str, Any], environ: Mapping[str, str],
                  model: ModelFolder) -> ServedIndexes:
        """From a model_config and the environment (which wins), for the opened model folder
        `model` (each index opens with it, not verified again); ValueError naming the key or
        variable at fault."""
        config = {**PYFUNC_CONFIG, **config}
        names = config["indexes"] or {}
        if not isinstance(names, Mapping) or not all(
                isinstance(v, str | os.PathLike) for v in names.values()):
            raise ValueError("model_config indexes must map names to index folders, as "
                             '{"photos": "/data/photos-index"}')
        names = {str(name): str(folder) for name, folder in names.items()}
        for entry in filter(None, environ.get(SETTINGS["indexes"], "").split(os.pathsep)):
            name, equals, folder = entry.partition("=")
            if not (name and equals and folder):
                raise ValueError(f"{SETTINGS['indexes']} entry {entry!r} is not NAME=FOLDER "
                                 f"(entries are separated by {os.pathsep!r})")
            names[name] = folder
        root = environ.get(SETTINGS["index_root"]) or config["index_root"]
        cached = environ.get(SETTINGS["cached_indexes"]) or config["cached_indexes"]
        if not str(cached).isdigit() or int(cached) < 1:
            raise ValueError(f"cached_indexes ({SETTINGS['cached_indexes']}) is {cached!r}: "
                             "give a whole number of indexes, 1 or more")
        pixels = environ.get(SETTINGS["max_image_pixels"]) or config["max_image_pixels"]
        if not str(pixels).isdigit() or int(pixels) < 1:
            raise ValueError(f"max_image_pixels ({SETTINGS['max_image_pixels']}) is {pixels!r}: "
                             "give a whole number of pixels, 1 or more")
        return cls(names, str(root) if root else None, int(cached), model, int(pixels))

    def offer(self) -> str:
        """What this server searches, in words a client can act on (no folder named)."""
        what = []
        if self.names:
            listed = sorted(self.names)
            what.append("the index " + repr(listed[0]) if len(listed) == 1 else
                        "the indexes " + ", ".join(map(repr, listed)))
        if self.root:
            what.append("an index folder under its index root (give its path relative to the "
                        "root)")
        if not what:
            return (f"no index: its operator names them with {SETTINGS['indexes']} or "
                    f"{SETTINGS['index_root']} (or the model_config keys indexes, index_root)")
        return " and ".join(what)

    def open(self, asked: str) -> SearchIndex:
        """The opened index a client names; RetrievalError in the one line of the module doc
        when it is not one this server searches or cannot be opened."""
        folder = self._resolve(asked)
        if folder in self.cache:
            self.cache.move_to_end(folder)
            return self.cache[folder]
        refused = RetrievalError(f"params index {asked!r} is not available: this server "
                                 f"searches {self.offer()}")
        if folder is None:
            log.warning("refused params index %r: neither a configured name nor under the "
                        "index root %s", asked, self.root)
            raise refused
        try:
            opened = SearchIndex.open(folder, model=self.model, max_image_pixels=self.max_pixels)
        except Exception as err:  # whatever it is, the client learns nothing of the disk
            log.warning("refused params index %r (%s): %s", asked, folder, err)
            raise refused from err
        self.cache[folder] = opened
        while len(self.cache) > self.cached:
            closed, _ = self.cache.popitem(last=False)
            log.info("closed index %s (the least recently used of %d)", closed, self.cached + 1)
        log.info("opened index %s", folder)
        return opened

    def _resolve(self, asked: str) -> Path | None:
        """The real folder `asked` names: a configured name's, or a path under the root; None
        for anything else."""
        if asked in self.names:
            return Path(os.path.realpath(self.names[asked]))
        if self.root is None or "\0" in asked:
            return None
        folder = Path(os.path.realpath(self.root / asked))
        return folder if folder.is_relative_to(self.root) else None
