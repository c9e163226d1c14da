"""The fragment embeddings of an image folder and of a sentences file, cached on disk.

The cache (--index-dir; default FOLDER/.defrag-index, or beside the sentences file) holds
safetensors tensors plus a JSON description, keyed by the model's checksums, the box source and
decoder (defrag.images.DECODER_VERSION) or parser, and each image file's name, size and mtime
(the sentences file's as a whole): a second query embeds only itself, a changed model, box source
or decoder rebuilds it, a changed image file is embedded again.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import defrag.images
from defrag.files import replaced_atomically, write_atomically
from trainer.search.embedder import Embedder, RetrievalError, embed_images, embed_sentences
from trainer.search.fragment_set import FragmentSet

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
CACHE_DIR = ".defrag-index"
CACHE_FORMAT = 1


def _save(directory: Path, stem: str, fragments: FragmentSet, meta: dict[str, Any]) -> None:
    """`stem`.safetensors (tensors) and `stem`.json (meta + items), each written atomically;
    a shared token tells a matching pair from a half-written one."""
    token = uuid.uuid4().hex
    tensors = {"embeddings": fragments.embeddings, "owner": fragments.owner,
               "detail": fragments.detail}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(directory / f"{stem}.safetensors") as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                      metadata={"token": token})
        write_atomically(directory / f"{stem}.json", json.dumps(
            {"format": CACHE_FORMAT, "token": token, **meta, "items": fragments.items},
            ensure_ascii=False, indent=1))
    except OSError as err:
        log.warning("cannot write the index cache in %s (%s): the next query embeds again",
                    directory, err)


def _load(directory: Path, stem: str) -> tuple[FragmentSet, dict[str, Any]] | None:
    """The cached fragments and meta of `stem`, or None (missing, unreadable, mismatched)."""
    meta_path, tensor_path = directory / f"{stem}.json", directory / f"{stem}.safetensors"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        with safe_open(tensor_path, framework="pt") as tensors:
            token = (tensors.metadata() or {}).get("token")
            fragments = FragmentSet(list(meta["items"]), tensors.get_tensor("embeddings"),
                                    tensors.get_tensor("owner"), tensors.get_tensor("detail"))
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        log.warning("index cache %s is unreadable (%s): rebuilding it", meta_path, err)
        return None
    if meta.get("format") != CACHE_FORMAT or meta.get("token") != token:
        log.warning("index cache %s does not match its tensors: rebuilding it", meta_path)
        return None
    return fragments, meta


def _stamp(path: Path) -> dict[str, Any]:
    """What identifies a file's content cheaply: name, size and modification time."""
    stat = path.stat()
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def list_images(folder: Path) -> list[Path]:
    """The JPEG / PNG files of `folder` (not its subfolders), by name; an error when none."""
    if not folder.is_dir():
        raise RetrievalError(f"--images {folder}: no such folder")
    paths = sorted(p for p in folder.iterdir()
                   if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                   and not p.name.startswith("."))
    if not paths:
        raise RetrievalError(f"--images {folder}: no {', '.join(IMAGE_SUFFIXES)} image in it")
    return paths


def image_embeddings(folder: Path, cache_dir: Path, embedder: Embedder,
                     device: str) -> FragmentSet:
    """The fragments of every usable image of `folder`: cached ones whose file is unchanged, the
    others embedded now; the cache is rewritten when anything changed. Unusable files are
    remembered as such (and warned about again) until they change."""
    paths = list_images(folder)
    stamps = {path.name: _stamp(path) for path in paths}
    key = {"model": embedder.model_key, "boxes": embedder.boxes,
           "decoder": defrag.images.DECODER_VERSION}  # another decoder gives other pixels
    cached, meta = _load(cache_dir, "images") or (None, {})
    if cached is not None and any(meta.get(k) != value for k, value in key.items()):
        what = next(name for k, name in [("model", "model"), ("decoder", "decoder"),
                                         ("boxes", "box source")] if meta.get(k) != key[k])
        log.info("image index %s: built with another %s: rebuilding", cache_dir, what)
        cached, meta = None, {}
    known = {stamp["name"]: k for k, stamp in enumerate(meta.get("stamps", []))
             if stamps.get(stamp["name"]) == stamp}
    unusable = {entry["stamp"]["name"]: entry for entry in meta.get("unusable", [])
                if stamps.get(entry["stamp"]["name"]) == entry["stamp"]}
    for entry in unusable.values():
        log.warning("skipped an unusable image (cached verdict): %s", entry["reason"])
    todo = [path for path in paths if path.name not in known and path.name not in unusable]
    if cached is not None and not todo and (len(known), len(unusable)) == (
            len(meta["stamps"]), len(meta["unusable"])):  # nothing new, changed or removed
        log.info("image index %s: all %d images cached, up to date", cache_dir, len(known))
        return _usable(cached, folder, len(paths))
    if cached is not None:
        changed = sorted({p.name for p in todo} & set(cached.items))
        log.info("image index %s: %d images cached, %d new, %d changed %s, %d removed",
                 cache_dir, len(known), len(todo) - len(changed), len(changed), changed,
                 len(cached.items) - len(known) - len(changed))
    fresh, problems = embed_images(todo, embedder, skip_bad=True, device=device)
    merged = fresh if cached is None else FragmentSet.concat(
        [cached.select(list(known.values())), fresh])
    position = {name: k for k, name in enumerate(merged.items)}
    merged = merged.select([position[p.name] for p in paths if p.name in position])
    unusable.update({name: {"stamp": stamps[name], "reason": reason}
                     for name, reason in problems.items()})
    _save(cache_dir, "images", merged, {**key, "stamps": [stamps[n] for n in merged.items],
                                        "unusable": list(unusable.values())})
    log.info("image index %s: %d images written", cache_dir, len(merged.items))
    return _usable(merged, folder, len(paths))


def _usable(images: FragmentSet, folder: Path, files: int) -> FragmentSet:
    """`images`, unless there is none: an error."""
    if not images.items:
        raise RetrievalError(f"--images {folder}: none of its {files} images is usable (see "
                             f"the warnings)")
    return images


def read_sentences(path: Path) -> tuple[list[str], list[int]]:
    """The non-blank lines of a sentences file and their 1-based line numbers."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RetrievalError(f"--sentences {path}: cannot read it ({err})") from err
    numbered = [(line.strip(), n) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise RetrievalError(f"--sentences {path}: no sentence in it (one per line)")
    return [text for text, _ in numbered], [n for _, n in numbered]


def sentence_embeddings(path: Path, cache_dir: Path, embedder: Embedder,
                        device: str) -> tuple[FragmentSet, list[int]]:
    """The fragments of every sentence of `path` and their line numbers, cached as a whole."""
    key = {"model": embedder.model_key, "parser": embedder.parser_name,
           "file": {**_stamp(path), "path": str(path.resolve())}}
    cached = _load(cache_dir, "sentences")
    if cached is not None and {k: cached[1].get(k) for k in key} == key:
        log.info("sentence index %s: all %d sentences cached, up to date", cache_dir,
                 len(cached[0].items))
        return cached[0], cached[1]["lines"]
    if cached is not None:
        log.info("sentence index %s: the model, parser or sentences file changed: rebuilding",
                 cache_dir)
    texts, lines = read_sentences(path)
    fragments = embed_sentences(texts, embedder, device)
    _save(cache_dir, "sentences", fragments, {**key, "lines": lines})
    log.info("sentence index %s: %d sentences written", cache_dir, len(texts))
    return fragments, lines

