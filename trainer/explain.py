"""Why an image and a sentence match (paper Figure 4): each sentence fragment's best box, drawn
to a file and listed for the retrieval report."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from featurizer.images import BadImage, load_image
from trainer.embedder import Embedder, RetrievalError
from trainer.fragment_set import FragmentSet
from trainer.pictures import alignment_figure

log = logging.getLogger(__name__)


def explain(image_path: Path, image: FragmentSet, sentence: FragmentSet, embedder: Embedder,
            out: Path) -> list[dict[str, Any]]:
    """Figure 4 for one image and one sentence (one item each): every sentence fragment linked
    to its best box, drawn to `out`; returns the alignment, one entry per fragment."""
    v, boxes = image.of(0)
    s, ids = sentence.of(0)
    if not len(s):
        log.warning("nothing to explain: %r has no fragment the model knows; %s not written",
                    sentence.items[0], out)
        return []
    try:
        pixels = load_image(image_path).image
    except BadImage as err:
        raise RetrievalError(f"cannot draw the explanation: {err}") from err
    picture, alignment = alignment_figure(pixels, boxes, sentence.items[0], v, s, ids,
                                          embedder.vocab, embedder.cfg.model.fragment_mode)
    out.parent.mkdir(parents=True, exist_ok=True)
    picture.save(out)
    return [{"fragment": label, "box": b, "xyxy": [round(c, 1) for c in boxes[b].tolist()],
             "score": score} for label, b, score in alignment]
