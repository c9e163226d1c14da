"""Caption scores (trainer/caption/metrics.py): BLEU by hand, CIDEr and METEOR prefer the right
caption, and ids that do not pair up are refused by name."""

from __future__ import annotations

import logging
import math
import shutil

import psutil
import pytest

from trainer.caption import metrics as caption_metrics
from trainer.caption.metrics import caption_scores, system_scores, tokenize

REFERENCES = {
    "beach": ["A dog runs along the sandy beach.", "A brown dog running by the sea."],
    "bike": ["A man rides a red bike down a hill.", "A cyclist races downhill."],
    "kitchen": ["Two women cook dinner in a kitchen.", "Women are cooking food together."],
}
MATCHING = {
    "beach": "A brown dog runs on the beach.",
    "bike": "A man rides a bike down the hill.",
    "kitchen": "Two women cooking in the kitchen.",
}
UNRELATED = {"beach": MATCHING["kitchen"], "bike": MATCHING["beach"], "kitchen": MATCHING["bike"]}


def test_tokenize_keeps_lowercased_words_only():
    assert tokenize("A man's T-shirt, (red)!  Two  dogs.") == [
        "a", "man", "s", "t", "shirt", "red", "two", "dogs"]


def test_a_candidate_equal_to_a_reference_scores_bleu_4_of_one():
    scores = caption_scores({"1": "A man rides a red bike down a hill"}, {"1": REFERENCES["bike"]},
                            meteor=False)
    assert scores["BLEU-4"] == pytest.approx(1, abs=1e-8)


def test_bleu_1_is_clipped_unigram_precision_times_brevity_penalty_over_the_corpus():
    scores = caption_scores(
        {"1": "A dog runs on the beach.", "2": "A cat, a cat!"},
        {"1": ["a dog is running on the sand", "the dog runs"],
         "2": ["a black cat sleeps", "a cat on a mat"]},
        meteor=False)
    # 1: a dog runs on the (beach unmatched): 5 of 6; closest reference length 7 (not 3).
    # 2: "a" twice (the second reference has two), "cat" once: 3 of 4; closest length 4.
    correct, guessed, reference_length = 5 + 3, 6 + 4, 7 + 4
    expected = correct / guessed * math.exp(1 - reference_length / guessed)
    assert scores["BLEU-1"] == pytest.approx(expected, rel=1e-8)


def test_cider_prefers_the_matching_captions():
    matching = caption_scores(MATCHING, REFERENCES, meteor=False)
    unrelated = caption_scores(UNRELATED, REFERENCES, meteor=False)
    assert set(matching) == {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr"}
    assert matching["CIDEr"] > 1 > 0.2 > unrelated["CIDEr"] >= 0  # about 2.0 and 0.14


@pytest.mark.parametrize(("candidates", "references", "named"), [
    ({"a": "a dog", "b": "a cat"}, {"a": ["a dog"]}, "'b'"),
    ({"a": "a dog"}, {"a": ["a dog"], "c": ["a cow"]}, "'c'"),
    ({"a": "a dog"}, {"a": []}, "'a'"),
])
def test_ids_without_a_partner_are_refused_by_name(candidates, references, named):
    with pytest.raises(ValueError, match=named):
        caption_scores(candidates, references, meteor=False)


def test_without_java_meteor_is_left_out_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(caption_metrics.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=caption_metrics.__name__):
        scores = caption_scores(MATCHING, REFERENCES)
    assert "METEOR" not in scores
    assert len(caplog.records) == 1 and "METEOR" in caplog.records[0].getMessage()


@pytest.mark.slow  # METEOR's Java process takes about 10 s to start
@pytest.mark.skipif(shutil.which("java") is None, reason="METEOR needs java")
def test_meteor_prefers_the_matching_captions_and_leaves_no_process():
    scores = system_scores({"matching": MATCHING, "unrelated": UNRELATED}, REFERENCES)
    assert 0 <= scores["unrelated"]["METEOR"] < scores["matching"]["METEOR"] <= 1
    assert scores["matching"]["BLEU-1"] == caption_scores(MATCHING, REFERENCES,
                                                          meteor=False)["BLEU-1"]
    assert psutil.Process().children(recursive=True) == []
