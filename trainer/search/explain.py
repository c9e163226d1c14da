"""Why an image and a sentence match, drawn and listed (retrieval's report, the web app): each
sentence fragment's best box (paper Figure 4, the fragments encoder), or each word's contribution
to the score (whole-sentence encoders, which have no fragments to align)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from PIL import Image

from featurizer.images import BadImage, load_image
from trainer.pictures import alignment_figure, word_contribution_figure
from trainer.search.embedder import Embedder, RetrievalError, embed_captions, parse_captions
from trainer.search.fragment_set import FragmentSet, rank

log = logging.getLogger(__name__)

# A token no vocabulary holds (parser tokens and word-vector file entries have no spaces).
LEFT_OUT = "<left out>"


def explain(image_path: Path, image: FragmentSet, sentence: FragmentSet, embedder: Embedder
            ) -> tuple[Image.Image | None, list[dict[str, Any]]]:
    """Figure 4 for one image and one sentence (one item each): every sentence fragment linked
    to its best box. The picture (None: nothing to draw) and the alignment, one entry per
    fragment."""
    v, boxes = image.of(0)
    s, ids = sentence.of(0)
    if not len(s):
        log.warning("nothing to explain: %r has no fragment the model knows", sentence.items[0])
        return None, []
    picture, alignment = alignment_figure(_pixels(image_path, embedder), boxes, sentence.items[0],
                                          v, s, ids, embedder.vocab,
                                          embedder.cfg.model.fragment_mode)
    return picture, [{"fragment": label, "box": b,
                      "xyxy": [round(c, 1) for c in boxes[b].tolist()], "score": score}
                     for label, b, score in alignment]


def explain_words(image_path: Path, image: FragmentSet, sentence: str, embedder: Embedder,
                  device: str = "cpu") -> tuple[Image.Image | None, list[dict[str, Any]]]:
    """A whole-sentence encoder's score of one image (one item) and `sentence`, word by word:
    each word's contribution is score(image, sentence) - score(image, sentence without the
    word) (occlusion), with the model's own objective.score, so it applies to every encoder.
    The word is left out the way the vocabulary drops an unknown word (a tree encoder hangs its
    children on its head, `Vocabulary.encode_tree`). The picture (None: no known word) and one
    entry per word, contribution None for a word the vocabulary drops."""
    caption = parse_captions([sentence], embedder)[0]
    tokens = caption["tokens"]
    known = [i for i, word in enumerate(tokens) if word in embedder.vocab.word_index]
    if not known:
        log.warning("nothing to explain: no word of %r is in the model's vocabulary", sentence)
        return None, []
    variants = [caption, *({**caption, "tokens": [LEFT_OUT if j == i else word
                                                  for j, word in enumerate(tokens)]}
                           for i in known)]
    objective = embedder.cfg.objective
    scores = rank(image, embed_captions(variants, embedder, device), objective.smooth,
                  objective.score)[0]
    contribution = dict(zip(known, (scores[0] - scores[1:]).tolist(), strict=True))
    words = [(word, contribution.get(i)) for i, word in enumerate(tokens)]
    picture = word_contribution_figure(_pixels(image_path, embedder), sentence, words,
                                       float(scores[0]), objective.score)
    return picture, [{"word": word, "contribution": value} for word, value in words]


def _pixels(image_path: Path, embedder: Embedder) -> Image.Image:
    """The image file to draw on, decoded as the embedder decodes it (bound included)."""
    try:
        return load_image(image_path, embedder.max_image_pixels).image
    except BadImage as err:
        raise RetrievalError(f"cannot draw the explanation: {err}") from err

