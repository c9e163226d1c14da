"""Generated captions scored against their images' reference captions with the COCO caption
evaluation's own scorers (pycocoevalcap): BLEU-1..4, CIDEr (its CIDEr-D variant, the one COCO
reports) and METEOR 1.5, all corpus-level.

Candidates and references are tokenized alike here (lowercase words, punctuation dropped) rather
than by COCO's Java PTB tokenizer. METEOR runs offline: its jar and paraphrase table ship in the
pycocoevalcap wheel; it needs only `java` (10 s to start, then about 5 s per 1000 images).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Mapping, Sequence

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor

log = logging.getLogger(__name__)

WORD = re.compile(r"[^\W_]+")  # a run of letters or digits: "t-shirt" -> "t", "shirt"


def tokenize(text: str) -> list[str]:
    """The lowercased words of `text`, punctuation dropped; for candidates and references alike."""
    return WORD.findall(text.lower())


def caption_scores(candidates: Mapping[str, str], references: Mapping[str, Sequence[str]],
                   meteor: bool = True) -> dict[str, float]:
    """BLEU-1..4, CIDEr and (with `meteor` and Java installed) METEOR of one candidate caption
    per id against that id's references. CIDEr's n-gram IDF comes from the references given,
    so, as in COCO's evaluation, scores depend on the whole set scored together."""
    return system_scores({"": candidates}, references, meteor)[""]


def system_scores(systems: Mapping[str, Mapping[str, str]],
                  references: Mapping[str, Sequence[str]],
                  meteor: bool = True) -> dict[str, dict[str, float]]:
    """`caption_scores` of several systems' candidates against the same references, METEOR's
    Java process started once for all of them."""
    if meteor and shutil.which("java") is None:
        log.warning("no `java` on PATH: METEOR left out of the caption scores")
        meteor = False
    scorer = Meteor() if meteor else None
    try:
        return {name: _scores(candidates, references, scorer)
                for name, candidates in systems.items()}
    finally:
        if scorer is not None:  # ended here, not left running until garbage collection
            scorer.meteor_p.kill()
            scorer.meteor_p.communicate()  # reap it and close its pipes


def _scores(candidates: Mapping[str, str], references: Mapping[str, Sequence[str]],
            meteor: Meteor | None) -> dict[str, float]:
    _check_ids(candidates, references)
    res = {key: [" ".join(tokenize(caption))] for key, caption in candidates.items()}
    gts = {key: [" ".join(tokenize(caption)) for caption in references[key]] for key in res}
    bleus, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores = {f"BLEU-{n}": float(bleu) for n, bleu in enumerate(bleus, start=1)}
    scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    if meteor is not None:
        scores["METEOR"] = float(meteor.compute_score(gts, res)[0])
    return scores


def _check_ids(candidates: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> None:
    """ValueError naming the first id with a candidate but no references, or the reverse."""
    if not candidates:
        raise ValueError("no candidate captions to score")
    for key in candidates:
        if not references.get(key):
            raise ValueError(f"candidate caption {key!r} has no reference captions")
    for key in references:
        if key not in candidates:
            raise ValueError(f"reference captions {key!r} have no candidate caption")
