"""New images and sentences -> a model's embeddings (fragments, or one row per sentence for a
whole-sentence encoder), along the training code path.

An image is read and checked like the featurizer reads it (`featurizer.images.load_image`), boxed
by a featurizer box source, then resized with its boxes scaled by
`trainer.data.reader.SampleDecoder`, exactly like a shard sample; a sentence is parsed by
`featurizer.parsing` and encoded with the model's own vocabulary (`Vocabulary.encode`, or
`encode_words` for whole-sentence encoders). The box source and parser are those of the model's
training shards, which the model folder records (`featurizer.json`; folders saved before it existed:
the shards' manifest, when at hand); otherwise selective search and the featurizer's default parser
(`--boxes` and `--parser` choose).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from defrag.images import MAX_IMAGE_PIXELS
from defrag.vocab import Vocabulary
from featurizer.boxes import BoxSource, rebuild_box_source
from featurizer.images import BadImage, load_image
from featurizer.parsing import Parser, make_parser
from featurizer.pipeline import Settings
from featurizer.records import TOO_LARGE
from trainer.batch import CaptionedImage, owners, stack_pixels, tree_fields, unit_float
from trainer.config import Config
from trainer.data.reader import BadSample, SampleDecoder
from trainer.data.shardset import training_featurizer
from trainer.model import DeFragModel
from trainer.search.fragment_set import FragmentSet
from trainer.store.model_folder import FEATURIZER, ModelFolder

log = logging.getLogger(__name__)

IMAGE_BATCH = 16  # images per CNN pass
DEFAULT_BOXES = "selective_search"


class RetrievalError(ValueError):
    """A retrieval input that cannot be used; the message names it."""


class ImageTooLargeError(RetrievalError):
    """An image over the embedder's pixel bound, refused from its header (the web app: 413)."""


@dataclass
class Embedder:
    """A model with the featurizer steps that turn new inputs into its fragments: the box source
    (as a `describe()` dict) and the parser, chosen up front and built only when needed."""

    model: DeFragModel
    cfg: Config
    vocab: Vocabulary
    model_key: str  # sha256 of the model folder's checksums.json
    boxes: dict[str, Any]
    parser_name: str
    max_image_pixels: int = MAX_IMAGE_PIXELS  # larger images are refused before decoding

    @functools.cached_property
    def box_source(self) -> BoxSource:
        return rebuild_box_source(self.boxes)

    @functools.cached_property
    def parser(self) -> Parser:
        parser = make_parser(self.parser_name)
        parser.check()
        return parser

    @functools.cached_property
    def decoder(self) -> SampleDecoder:
        decoder = SampleDecoder.from_config(self.cfg, self.vocab)
        return dataclasses.replace(decoder, max_pixels=self.max_image_pixels)

    @classmethod
    def from_folder(cls, folder: ModelFolder, boxes: str | dict[str, Any] | None = None,
                    detector_weights: str | None = None, parser: str | None = None) -> Embedder:
        """The opened model folder's model, with its box source and parser chosen (see the
        module docstring); `boxes`: a box source's name (--boxes) or description (shards')."""
        cfg = folder.config
        if cfg.objective.score.startswith("scan"):  # no certified bound for cross attention
            raise RetrievalError(f"{folder.path}: a SCAN model (objective.score="
                                 f"{cfg.objective.score}) scores by cross attention, which "
                                 "search, retrieve and serve do not support: measure it with "
                                 "`defrag evaluate`")
        manifest = _training_featurizer(folder, cfg)
        return cls(folder.load_model(), cfg, folder.vocab, folder.checksums_key,
                   _choose_boxes(cfg, manifest, boxes, detector_weights),
                   _choose_parser(manifest, parser))


def _training_featurizer(folder: ModelFolder, cfg: Config) -> dict | None:
    """Parser and box source of the model's training shards: from the model folder (written at
    save time), else from the shards' manifest when this machine has it."""
    if folder.featurizer is not None:
        return folder.featurizer
    found = training_featurizer(cfg.data)
    if found is None:
        log.info("neither the model folder (%s) nor the manifest of its training shards (%s) is "
                 "here: box source and parser are not known from training", FEATURIZER,
                 cfg.data.shards)
    return found


def _choose_boxes(cfg: Config, manifest: dict | None, name: str | dict[str, Any] | None,
                  detector_weights: str | None) -> dict[str, Any]:
    """The box source description: --boxes (or the indexed shards' description), else the
    training one (when new images can have it), else selective search. A fullframe-only model
    needs only the whole image."""
    if cfg.model.fullframe_only:
        log.info("boxes: the whole image only (a fullframe model uses no other box)")
        return {"name": "fullframe", "options": {}}
    if isinstance(name, dict):
        log.info("boxes: %s, as in the shards indexed", name["name"])
        return name
    if name is not None:
        options = {"weights": detector_weights} if name == "detector" else {}
        return {"name": name, "options": options}
    trained = (manifest or {}).get("box_source")
    if trained is not None and trained["name"] != "given":
        log.info("boxes: %s, as in the model's training shards", trained["name"])
        return trained
    if trained is not None:
        log.warning("boxes: the model was trained on %r boxes, which new images do not have: "
                    "using %s (choose with --boxes)", trained["name"], DEFAULT_BOXES)
    else:
        log.warning("boxes: using %s (choose with --boxes)", DEFAULT_BOXES)
    return {"name": DEFAULT_BOXES, "options": {}}


def _choose_parser(manifest: dict | None, name: str | None) -> str:
    """--parser, else the training shards' parser, else the featurizer's default."""
    if name is not None:
        return name
    trained = (manifest or {}).get("parser", {}).get("name")
    if trained is not None:
        log.info("parser: %s, as in the model's training shards", trained)
        return trained
    log.warning("parser: using %s, the featurizer's default (choose with --parser)",
                Settings.parser)
    return Settings.parser


def read_image(path: Path, embedder: Embedder) -> tuple[CaptionedImage, np.ndarray]:
    """One image file as the trainer sees it (a shard sample without captions), and its boxes
    in the file's pixels. BadImage / BadSample name the problem."""
    loaded = load_image(path, embedder.max_image_pixels)
    boxes, _ = embedder.box_source(loaded.image)
    meta = {"image_id": path.name, "width": loaded.image.width, "height": loaded.image.height,
            "boxes": boxes, "captions": []}
    image = embedder.decoder.decode({loaded.extension: loaded.data, "json": json.dumps(meta)})
    return image, np.asarray(boxes[:len(image.boxes)], dtype=np.float32).reshape(-1, 4)


@torch.no_grad()
def embed_images(paths: Sequence[Path], embedder: Embedder, skip_bad: bool,
                 device: str = "cpu", progress: bool = True
                 ) -> tuple[FragmentSet, dict[str, str]]:
    """Image fragments of `paths`, IMAGE_BATCH images per CNN pass (with a progress bar), and
    the unusable files' problems by name: each is skipped with a warning naming the file
    (`skip_bad`), else an error."""
    parts = [FragmentSet([], torch.zeros(0, embedder.cfg.model.embed_dim),
                         torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))]
    problems: dict[str, str] = {}
    with tqdm(total=len(paths), desc="embed images", unit="img",
              disable=not (paths and progress)) as bar:
        for first in range(0, len(paths), IMAGE_BATCH):
            images, names, boxes = [], [], []
            for path in paths[first:first + IMAGE_BATCH]:
                try:
                    image, file_boxes = read_image(path, embedder)
                except (BadImage, BadSample) as err:
                    problem = str(err) if isinstance(err, BadImage) else f"{path}: {err}"
                    if not skip_bad:
                        too_large = isinstance(err, BadImage) and err.reason == TOO_LARGE
                        error = ImageTooLargeError if too_large else RetrievalError
                        raise error(f"unusable image: {problem}") from err
                    log.warning("skipped an unusable image: %s", problem)
                    problems[path.name] = problem
                else:
                    images.append(image)
                    names.append(path.name)
                    boxes.append(torch.from_numpy(file_boxes))
                bar.update()
            if images:
                parts.append(FragmentSet(names, image_fragments(embedder.model, images, device),
                                         owners([len(b) for b in boxes]), torch.cat(boxes)))
    return FragmentSet.concat(parts), problems


@torch.no_grad()
def image_fragments(model: DeFragModel, images: list[CaptionedImage],
                     device: str) -> torch.Tensor:
    """v [N_box, d] of decoded images (shard samples or `read_image`), as the evaluation embeds
    an image batch."""
    pixels = stack_pixels(images)
    boxes = torch.from_numpy(np.concatenate([image.boxes for image in images]))
    box_image = owners([len(image.boxes) for image in images])
    v = model.image(unit_float(pixels.to(device)), boxes.to(device),
                    box_image.to(device))
    return v.float().cpu()


def parse_captions(texts: Sequence[str], embedder: Embedder) -> list[dict]:
    """The captions of `texts` as shards store them (tokens, triplets, tree), parsed by the
    model's parser."""
    parsed = embedder.parser.parse(list(texts)) if texts else []
    return [p.caption(text) for text, p in zip(texts, parsed, strict=True)]


@torch.no_grad()
def embed_sentences(texts: Sequence[str], embedder: Embedder,
                    device: str = "cpu") -> FragmentSet:
    """The sentence rows of `texts` (see FragmentSet.detail); a sentence with no fragment, or
    no word, the model knows is warned about (it scores 0 with every image, eq. 6)."""
    return embed_parsed(parse_captions(texts, embedder), embedder, device)


@torch.no_grad()
def embed_parsed(captions: Sequence[dict], embedder: Embedder, device: str = "cpu",
                 warn: bool = True) -> FragmentSet:
    """`embed_sentences` of captions parsed already (`parse_captions`, or a shard's captions);
    `warn`: about each sentence the model cannot read (off for whole collections)."""
    texts = [caption["text"] for caption in captions]
    if embedder.model.sentence.whole_sentence:
        sentences = embed_captions(captions, embedder, device)
        for text, words in zip(texts, sentences.detail[:, 0].tolist(), strict=True):
            if warn and not words:
                log.warning("%r has no word in the model's vocabulary of %d words: it scores 0 "
                            "with everything", text, len(embedder.vocab.words))
        return sentences
    mode = embedder.cfg.model.fragment_mode
    ids = [embedder.vocab.encode(caption, mode) for caption in captions]
    for text, fragments in zip(texts, ids, strict=True):
        if warn and not len(fragments):
            log.warning("%r has no fragment the model knows (no %s with every word and relation "
                        "in its vocabulary of %d words): it scores 0 with everything", text,
                        "triplet" if mode == "triplet" else f"{mode} fragment",
                        len(embedder.vocab.words))
    fragments = torch.cat(ids) if ids else torch.zeros(0, 3, dtype=torch.long)
    fragment_sentence = owners([len(f) for f in ids])
    s = embedder.model.sentence(fragments.to(device), fragment_sentence.to(device)).float().cpu()
    return FragmentSet(list(texts), s, fragment_sentence, fragments)


@torch.no_grad()
def embed_captions(captions: Sequence[dict], embedder: Embedder,
                   device: str = "cpu") -> FragmentSet:
    """A whole-sentence encoder's row of each parsed caption (`parse_captions`), from its words
    in order (`Vocabulary.encode_words`; a tree encoder also reads `encode_tree`)."""
    ids = [embedder.vocab.encode_words(caption) for caption in captions]
    fields = {"words": torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *ids])),
              "word_sentence": owners([len(w) for w in ids])}
    encoder = embedder.model.sentence
    if "word_head" in encoder.inputs:  # a tree encoder: the parse's tree over the same words
        fields["word_head"], fields["word_relation"] = tree_fields(
            [embedder.vocab.encode_tree(caption) for caption in captions])
    s = encoder(*(fields[name].to(device) for name in encoder.inputs),
                num_sentences=len(captions)).float().cpu()
    counts = torch.tensor([[len(w)] for w in ids], dtype=torch.long).reshape(-1, 1)
    return FragmentSet([caption["text"] for caption in captions], s,
                       torch.arange(len(captions)), counts)
