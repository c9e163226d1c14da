"""launch/region_fragments.py: box places, alignments and region-only scores on embeddings
small enough to check by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from trainer.evaluate import Embedded, retrieval_metrics
from trainer.objectives import score_matrix

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("region_fragments",
                                              ROOT / "launch" / "region_fragments.py")
region_fragments = importlib.util.module_from_spec(spec)
spec.loader.exec_module(region_fragments)

E = torch.eye(4)


def embedded() -> Embedded:
    """Image 0: the whole image e0 and a region e1; image 1: e2 and a region e3; image 2: the
    whole image e0 only. Sentence 0 (image 0) has fragments e1 and e0; sentence 1 (image 1) e3;
    sentence 2 (image 2) e0."""
    return Embedded(v=E[[0, 1, 2, 3, 0]], box_image=torch.tensor([0, 0, 1, 1, 2]),
                    s=E[[1, 0, 3, 0]], fragment_sentence=torch.tensor([0, 0, 1, 2]),
                    sentence_image=torch.tensor([0, 1, 2]), image_ids=["a", "b", "c"],
                    captions=["x", "y", "z"], problems=[])


def test_box_numbers_count_from_the_whole_image_of_each_image() -> None:
    assert region_fragments.box_numbers(torch.tensor([0, 0, 0, 1, 1, 2])).tolist() == [
        0, 1, 2, 0, 1, 0]


def test_whole_image_share_counts_the_best_box_of_each_true_pair_fragment() -> None:
    # e1 -> the region of image 0, e0 -> its whole image, e3 -> the region of image 1,
    # e0 -> the whole image of image 2 (its only fragment): 2 of 4
    assert region_fragments.whole_image_share(embedded()) == 0.5


def test_regions_only_keeps_the_whole_image_of_an_image_without_regions() -> None:
    e = embedded()
    number = region_fragments.box_numbers(e.box_image)
    got = region_fragments.retrieval_with(e, number > 0, smooth=5.0, score="eq6")
    keep = torch.tensor([False, True, False, True, True])  # image 2 keeps its only fragment
    expected = retrieval_metrics(score_matrix(e.v[keep], e.box_image[keep], e.s,
                                              e.fragment_sentence, 3, 3, 5.0),
                                 e.sentence_image)
    assert got == {**expected, "images_without_regions": 1}
    whole = region_fragments.retrieval_with(e, number == 0, smooth=5.0, score="eq6")
    assert whole["images_without_regions"] == 0
