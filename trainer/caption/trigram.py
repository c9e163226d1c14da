"""The Kneser-Ney trigram language model that re-ranks generated captions (Kiros et al. 2014,
5.2): a candidate caption's score mixes its translation score with this model's log-probability.

The model is NLTK's `KneserNeyInterpolated(order=3)` (discount 0.1), trained on sentences padded
as NLTK's `padded_everygram_pipeline` pads them: `<s> <s> w1 .. wn </s> </s>`. Scoring returns
NLTK's values, only faster: the counts NLTK recounts on every query (over all n-grams of the next
order, or over all words after a context) are read from tables built once after fitting, and each
word's log-probability in its context is memoized, since an image's ~1000 candidate captions
share most of their trigrams. Measured on 30,000 Flickr8k captions on a busy 2-core machine:
fitting takes 4-7 s; scoring 1000 candidates of 10 words 0.15-0.4 s while none of their trigrams
is memoized, 0.01-0.02 s once all are, where NLTK's own `score` takes about 0.7 s per sentence.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence

from nltk.lm import KneserNeyInterpolated, NgramCounter, Vocabulary
from nltk.lm.preprocessing import padded_everygram_pipeline
from nltk.lm.smoothing import KneserNey

log = logging.getLogger(__name__)

ORDER = 3
BOS, EOS = "<s>", "</s>"
# NLTK gives a word outside the training vocabulary probability 0 (its continuation count is 0 at
# every order). Such a word gets this probability instead: below what the model gives any seen
# word on Flickr8k (down to about 1e-9 for a rare word after an unseen pair of words), so each
# unknown word costs a caption 23 nats rather than making it -inf, and captions stay comparable.
OOV_PROB = 1e-10
MEMO_SIZE = 500_000  # memoized word scores (about 100 MB) before the memo starts afresh
JSON_FORMAT = "kneser-ney-trigram/1"


class _IndexedKneserNey(KneserNey):
    """NLTK's Kneser-Ney smoothing with the counts it recounts on every query read from tables
    built once from the same n-gram counts."""

    def __init__(self, vocabulary: Vocabulary, counter: NgramCounter, order: int,
                 discount: float) -> None:
        super().__init__(vocabulary, counter, order, discount=discount)
        self._followers: Counter[tuple[str, ...]] = Counter()  # N1+(context .)
        self._preceders: Counter[tuple[tuple[str, ...], str]] = Counter()  # N1+(. context word)
        self._preceder_total: Counter[tuple[str, ...]] = Counter()  # N1+(. context .)
        for higher_order in range(2, order + 1):
            for prefix, followers in counter[higher_order].items():
                for word, count in followers.items():
                    if count > 0:
                        self._followers[prefix] += 1
                        self._preceders[prefix[1:], word] += 1
                        self._preceder_total[prefix[1:]] += 1

    def _continuation_counts(self, word: str, context: tuple[str, ...] = ()) -> tuple[int, int]:
        return self._preceders[context, word], self._preceder_total[context]

    def alpha_gamma(self, word: str, context: tuple[str, ...]) -> tuple[float, float]:
        # NLTK's `KneserNey.alpha_gamma` verbatim, except that the number of distinct words seen
        # after the context comes from `_followers` instead of `_count_values_gt_zero`.
        prefix_counts = self.counts[context]
        word_continuation_count, total_count = (
            (prefix_counts[word], prefix_counts.N())
            if len(context) + 1 == self._order
            else self._continuation_counts(word, context)
        )
        alpha = max(word_continuation_count - self.discount, 0.0) / total_count
        gamma = self.discount * self._followers[context] / total_count
        return alpha, gamma


class TrigramLM:
    """An interpolated Kneser-Ney trigram model of token lists (lowercased words): `log_prob`
    gives a sentence's natural-log probability, `</s>` included."""

    def __init__(self, model: KneserNeyInterpolated, sentences: list[list[str]],
                 oov_prob: float) -> None:
        """Use `fit` or `from_json` rather than this."""
        self._model = model
        self.sentences = sentences  # kept for `to_json`
        self.oov_prob = oov_prob
        self._memo: dict[tuple[str, str, str], float] = {}

    @classmethod
    def fit(cls, sentences: Sequence[Sequence[str]], oov_prob: float = OOV_PROB) -> TrigramLM:
        """The model of `sentences`; 4-7 s for 30,000 captions of 11 words."""
        start = time.perf_counter()
        sentences = [list(sentence) for sentence in sentences]
        ngrams, words = padded_everygram_pipeline(ORDER, sentences)
        # What `model.fit(ngrams, words)` does, minus mapping every training n-gram through the
        # vocabulary (the identity here: every training word is in it), most of the time it takes.
        model = KneserNeyInterpolated(ORDER, vocabulary=Vocabulary(words),
                                      counter=NgramCounter(ngrams))
        model.estimator = _IndexedKneserNey(model.vocab, model.counts, ORDER,
                                            model.estimator.discount)
        log.info("fitted a Kneser-Ney trigram model of %d words on %d sentences in %.1f s",
                 len(model.vocab), len(sentences), time.perf_counter() - start)
        return cls(model, sentences, oov_prob)

    def log_prob(self, tokens: Sequence[str]) -> float:
        """ln P(tokens, then </s>); a word outside the vocabulary counts `oov_prob`."""
        padded = [BOS, BOS, *tokens, EOS]
        return sum(self.word_log_prob(padded[i - 2], padded[i - 1], padded[i])
                   for i in range(2, len(padded)))

    def word_log_prob(self, first: str, second: str, word: str) -> float:
        """ln P(word | first second), memoized: ln of NLTK's `score`, or of `oov_prob` where that
        is 0."""
        key = (first, second, word)
        if key not in self._memo:
            if len(self._memo) >= MEMO_SIZE:
                self._forget()
            prob = self._model.score(word, (first, second))
            self._memo[key] = math.log(prob if prob > 0 else self.oov_prob)
        return self._memo[key]

    def _forget(self) -> None:
        """Empty the memo, and drop the empty entries NLTK's lookups add to its counts for each
        unseen context, so that scoring many images does not grow memory without bound."""
        self._memo.clear()
        for order in range(2, ORDER + 1):
            counts = self._model.counts[order]
            for context in [context for context, followers in counts.items() if not followers]:
                del counts[context]

    def to_json(self) -> dict:
        """The training sentences and settings as JSON-ready data (no pickle); loading refits."""
        return {"format": JSON_FORMAT, "oov_prob": self.oov_prob, "sentences": self.sentences}

    @classmethod
    def from_json(cls, data: dict) -> TrigramLM:
        """The model `to_json` saved, refitted: as long as `fit`, 4-7 s for 30,000 captions."""
        if data.get("format") != JSON_FORMAT:
            raise ValueError(f"not a saved trigram model: format {data.get('format')!r}, "
                             f"expected {JSON_FORMAT!r}")
        return cls.fit(data["sentences"], data["oov_prob"])
