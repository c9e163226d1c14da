"""The Kneser-Ney trigram model (trainer/caption/trigram.py) on a tiny corpus: its scores are
NLTK's own and those of the textbook equations, they are probabilities, they survive JSON, and
unknown words get the documented floor."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from nltk.lm import KneserNeyInterpolated
from nltk.lm.preprocessing import padded_everygram_pipeline

import trainer.caption.trigram
from trainer.caption.trigram import BOS, EOS, OOV_PROB, TrigramLM

CORPUS = [sentence.split() for sentence in (
    "a dog runs on the grass",
    "a dog plays in the snow",
    "the black dog runs in the park",
    "a man rides a bike",
    "a man runs",
)]
WORDS = sorted({word for sentence in CORPUS for word in sentence})
SENTENCES = [  # seen ones, new mixes of seen words, unseen contexts, the empty caption
    "a dog runs on the grass", "a man runs in the snow", "the dog rides a black bike",
    "runs a dog", "park park park", "",
]
DISCOUNT = 0.1  # NLTK's default


@pytest.fixture(scope="module")
def lm() -> TrigramLM:
    return TrigramLM.fit(CORPUS)


def textbook_kneser_ney(sentences: list[list[str]], discount: float = DISCOUNT):
    """P(w | u v) by the interpolated Kneser-Ney equations (Chen & Goodman 1998; Jurafsky &
    Martin ch. 3), counted the slow, obvious way, with NLTK's conventions: padding
    `<s> <s> .. </s> </s>`; raw counts at the trigram order, continuation counts below, and
    the unigram order is the continuation probability alone (no uniform term); the bigram
    order's interpolation weight counts the words seen after v in the (raw) bigrams; a context
    never seen passes its whole mass down one order."""
    padded = [[BOS, BOS, *sentence, EOS, EOS] for sentence in sentences]
    trigrams = Counter(tuple(s[i:i + 3]) for s in padded for i in range(len(s) - 2))
    bigram_types = {tuple(s[i:i + 2]) for s in padded for i in range(len(s) - 1)}

    def unigram(w):  # N1+(. w) / N1+(. .)
        return sum(b == w for _, b in bigram_types) / len(bigram_types)

    def bigram(w, v):
        followers = sum(a == v for a, _ in bigram_types)  # N1+(v .)
        if followers == 0:
            return unigram(w)
        continuations = sum(b == v for _, b, _ in trigrams)  # N1+(. v .)
        with_w = sum((b, c) == (v, w) for _, b, c in trigrams)  # N1+(. v w)
        return (max(with_w - discount, 0) / continuations
                + discount * followers / continuations * unigram(w))

    def trigram(w, u, v):
        count = sum(n for (a, b, _), n in trigrams.items() if (a, b) == (u, v))  # c(u v .)
        if count == 0:
            return bigram(w, v)
        followers = sum((a, b) == (u, v) for a, b, _ in trigrams)  # N1+(u v .)
        return (max(trigrams[u, v, w] - discount, 0) / count
                + discount * followers / count * bigram(w, v))

    return trigram


def padded_trigrams(sentence: str) -> list[tuple[str, str, str]]:
    padded = [BOS, BOS, *sentence.split(), EOS]
    return [tuple(padded[i - 2:i + 1]) for i in range(2, len(padded))]


def test_log_prob_is_the_sum_of_nltks_own_logscores(lm):
    nltk_model = KneserNeyInterpolated(order=3)
    nltk_model.fit(*padded_everygram_pipeline(3, CORPUS))
    for sentence in SENTENCES:
        expected = sum(nltk_model.logscore(w, (u, v)) * math.log(2)  # log2 -> ln
                       for u, v, w in padded_trigrams(sentence))
        assert lm.log_prob(sentence.split()) == pytest.approx(expected, rel=1e-12), sentence


def test_word_probabilities_follow_the_textbook_equations(lm):
    reference = textbook_kneser_ney(CORPUS)
    cases = [
        ("a", "dog", "runs"),  # a seen trigram
        ("a", "dog", "rides"),  # seen context, word seen after a different context
        (BOS, BOS, "a"),  # the first word
        ("the", "grass", EOS),  # the end
        ("park", "park", "dog"),  # unseen trigram context, seen bigram context
        ("runs", "zebra", "a"),  # unseen trigram and bigram contexts: the unigram order
    ]
    for u, v, w in cases:
        assert math.exp(lm.word_log_prob(u, v, w)) == pytest.approx(reference(w, u, v),
                                                                    rel=1e-12), (u, v, w)


@pytest.mark.parametrize("context", [("a", "dog"), (BOS, "a"), ("dog", "runs"), ("runs", "a"),
                                     ("park", "park")])
def test_probabilities_after_a_context_sum_to_one(lm, context):
    # NLTK's padding bigram "<s> <s>" gives <s> itself a sliver of the unigram mass, so it is
    # one of the outcomes.
    outcomes = [*WORDS, EOS, BOS]
    total = sum(math.exp(lm.word_log_prob(*context, word)) for word in outcomes)
    assert total == pytest.approx(1, abs=1e-12)


def test_the_sentence_start_context_sums_slightly_past_one_as_in_nltk(lm):
    # After <s>, NLTK's bigram weight counts the padding word <s> among the k = 2 words seen
    # there ("a", "the"), which the continuation counts do not: the sum is 1 + gamma * d / k,
    # with gamma = d * 2 / 5 the trigram weight of "<s> <s>" (2 first words in 5 sentences).
    total = sum(math.exp(lm.word_log_prob(BOS, BOS, word)) for word in [*WORDS, EOS, BOS])
    assert total == pytest.approx(1 + (DISCOUNT * 2 / 5) * DISCOUNT / 2, abs=1e-12)


def test_json_round_trip_gives_the_same_scores(lm):
    loaded = TrigramLM.from_json(json.loads(json.dumps(lm.to_json())))
    for sentence in [*SENTENCES, "a zebra runs"]:
        assert loaded.log_prob(sentence.split()) == lm.log_prob(sentence.split())


def test_from_json_refuses_other_data():
    with pytest.raises(ValueError, match="not a saved trigram model"):
        TrigramLM.from_json({"sentences": []})


def test_unknown_words_get_the_floor_probability(lm):
    assert lm.word_log_prob("a", "dog", "zebra") == math.log(OOV_PROB)
    # ... and only where NLTK says 0: an unknown word in the context just backs off.
    assert lm.word_log_prob("a", "zebra", "runs") == pytest.approx(
        math.log(textbook_kneser_ney(CORPUS)("runs", "a", "zebra")), rel=1e-12)
    with_zebra = lm.log_prob(["a", "zebra", "runs"])
    assert math.isfinite(with_zebra) and with_zebra < lm.log_prob(["a", "dog", "runs"])
    assert TrigramLM.fit(CORPUS, oov_prob=1e-3).word_log_prob("a", "dog", "zebra") == (
        pytest.approx(math.log(1e-3)))


def test_a_full_memo_starts_afresh_without_changing_scores(lm, monkeypatch):
    monkeypatch.setattr(trainer.caption.trigram, "MEMO_SIZE", 4)
    small = TrigramLM.fit(CORPUS)
    for sentence in SENTENCES:
        assert small.log_prob(sentence.split()) == lm.log_prob(sentence.split())
    assert len(small._memo) <= 4
    small._forget()  # ... and so do the empty contexts NLTK's lookups leave in its counts
    assert all(followers for order in (2, 3) for followers in small._model.counts[order].values())
