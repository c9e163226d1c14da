"""Fragment embeddings of many images or sentences, grouped by item, and the model's scores
(eq. 6, cosine or inner) between two such sets: what retrieval caches, searches and explains."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.batch import owners
from trainer.objectives import score_matrix


@dataclass
class FragmentSet:
    """Fragment embeddings of several items (images or sentences), grouped by item.

    Item k owns the consecutive rows `owner == k`. `detail` says what each fragment is: for
    images its box, float [N, 4] xyxy in the file's pixels; for sentences its (relation, w1, w2)
    word ids, long [N, 3], or for a whole-sentence encoder's one row per sentence the number of
    its words the model knows, long [N, 1].
    """

    items: list[str]  # image file names or sentences
    embeddings: torch.Tensor  # float [N, d]
    owner: torch.Tensor  # long [N]
    detail: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        """Fragments of each item [len(items)]."""
        return torch.bincount(self.owner, minlength=len(self.items))

    def of(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings and details of item k's fragments."""
        one = self.select([k])
        return one.embeddings, one.detail

    def select(self, keep: Sequence[int]) -> FragmentSet:
        """The items `keep`, in that order."""
        start = [0, *self.counts.cumsum(0).tolist()]
        rows = [torch.arange(start[k], start[k + 1]) for k in keep]
        index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return FragmentSet([self.items[k] for k in keep], self.embeddings[index],
                           owners([len(r) for r in rows]), self.detail[index])

    @staticmethod
    def concat(parts: Sequence[FragmentSet]) -> FragmentSet:
        """The items of all `parts` one after the other (at least one part)."""
        return FragmentSet([item for part in parts for item in part.items],
                           torch.cat([part.embeddings for part in parts]),
                           owners([n for part in parts for n in part.counts.tolist()]),
                           torch.cat([part.detail for part in parts]))


def rank(images: FragmentSet, sentences: FragmentSet, smooth: float,
         score: str = "eq6") -> torch.Tensor:
    """Scores S [images, sentences] (`score`: objective.score), as trainer.evaluate scores a
    test set."""
    return score_matrix(images.embeddings, images.owner, sentences.embeddings, sentences.owner,
                        len(images.items), len(sentences.items), smooth, score=score)


def top_k(scores: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k best (index, score) of a score vector, best first (the first index on ties)."""
    order = torch.argsort(scores, descending=True, stable=True)[:k]
    return [(int(i), float(scores[i])) for i in order]
