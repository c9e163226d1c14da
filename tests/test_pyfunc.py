"""trainer/search/pyfunc_model.py and the registry's MLflow models on a real sqlite store: a
registered model folder loads with `mlflow.pyfunc.load_model` (nothing unpickled) and answers the
embedder's own vectors, in-process and through `mlflow models serve`; it searches a
`trainer.search.index` index given as params, and refuses one built by another model;
`download_model` still gives the plain model folder, also for a version registered before the pyfunc
(no MLmodel)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow.pyfunc
import pandas as pd
import psutil
import pytest
import requests
import torch
from mlflow.exceptions import MlflowException

from defrag.files import CHECKSUMS
from defrag.vocab import Vocabulary
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from tests.test_images import png_header
from trainer.caption.captioner import CaptionerParts, save_captioner
from trainer.caption.data import Caption
from trainer.caption.scnlm import SCNLM
from trainer.config import Config, DataConfig, ModelConfig
from trainer.data.shardset import training_featurizer
from trainer.model import DeFragModel
from trainer.search.embedder import Embedder, RetrievalError, embed_images, embed_sentences
from trainer.search.fragment_set import FragmentSet
from trainer.store.model_folder import ModelFolder, save_ensemble, save_model_folder
from trainer.store.registry import MLMODEL, download_model, register_model
from trainer.store.tracking import connect, experiment_id

REPO = Path(__file__).resolve().parents[1]
UNKNOWN = "zebras juggle quietly"  # no word of it is in the vocabulary: no fragment


class Store:
    """Generated scenes, two tiny untrained model folders on their shards (seeds 0 and 1), and a
    sqlite store where the first is `defrag` v1 (champion, a pyfunc) and v2 (alias `old`, logged
    as a plain folder, as versions were before the pyfunc)."""

    def __init__(self, root: Path) -> None:
        jsonl = generate(root / "source", num_train=4, num_val=2, seed=0, image_size=64)
        shards = root / "shards"
        featurize(read_jsonl(jsonl, jsonl.parent, "train"),
                  Settings(out=shards, parser="spacy", boxes="fullframe", shard_size=10,
                           workers=1, min_word_count=1))
        vocab = Vocabulary.load(shards / "vocab.json")
        cfg = Config(model=ModelConfig(embed_dim=16, word_dim=8, pretrained=False, image_size=64),
                     data=DataConfig(shards=str(shards), val_split="val"))
        self.model_dir, self.other_dir = (
            save_model_folder(root / name, DeFragModel.from_config(cfg.model, vocab, seed=seed),
                              cfg, vocab, featurizer=training_featurizer(cfg.data))
            for seed, name in enumerate(["model", "other"]))
        self.image_folder = root / "source" / "images"
        self.images = sorted(self.image_folder.glob("val_*.png"))
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        self.captions = [c for r in records if r["split"] == "val" for c in r["captions"]]
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        self.client = connect(self.uri)
        experiment = experiment_id(self.client, "pyfunc", (root / "mlartifacts").as_uri())
        self.run_id = self.client.create_run(experiment).info.run_id
        assert register_model(self.client, self.run_id, self.model_dir) == "1"
        self.client.log_artifacts(self.run_id, str(self.model_dir), "old")
        self.client.create_model_version("defrag", f"runs:/{self.run_id}/old", self.run_id)
        self.client.set_registered_model_alias("defrag", "old", "2")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store(tmp_path_factory.mktemp("pyfunc"))


@pytest.fixture(scope="module")
def embedder(store: Store) -> Embedder:
    return Embedder.from_folder(ModelFolder.open(store.model_dir))


@pytest.fixture
def tracking(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)


def base64_of(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def assert_close(got: list, expected: torch.Tensor) -> None:
    """Equal to float32 rounding, relatively: an untrained CNN's vectors are tiny, and a batch
    of another size sums in another order."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(torch.tensor(got).reshape(expected.shape), expected, rtol=1e-4,
                               atol=1e-6 * scale)


def assert_rows_match(rows: pd.DataFrame, fragments: FragmentSet, boxes: bool) -> None:
    """Each output row holds its item's fragment vectors, their mean and (images) boxes."""
    assert len(rows) == len(fragments.items)
    for item, row in enumerate(rows.to_dict("records")):
        vectors, detail = fragments.of(item)
        assert_close(row["fragments"], vectors)
        assert_close(row["mean"], vectors.mean(0) if len(vectors) else torch.zeros(16))
        if boxes:
            assert torch.equal(torch.tensor(row["boxes"]).reshape(-1, 4), detail)
        else:
            assert row["boxes"] is None


# ---------------------------------------------------------------- embeddings


def test_load_model_answers_the_embedders_vectors(store: Store, embedder: Embedder,
                                                  tracking: None) -> None:
    model = mlflow.pyfunc.load_model("models:/defrag@champion")
    texts = [store.captions[0], UNKNOWN, store.captions[3]]
    sentences = model.predict(pd.DataFrame({"sentence": texts}))
    assert_rows_match(sentences, embed_sentences(texts, embedder), boxes=False)
    assert sentences["fragments"][1] == []  # a sentence the model cannot read: no fragment

    images = model.predict(pd.DataFrame({"image": [base64_of(p) for p in store.images]}))
    assert_rows_match(images, embed_images(store.images, embedder, skip_bad=False)[0],
                      boxes=True)

    mixed = model.predict(pd.DataFrame([{"image": base64_of(store.images[1])},
                                        {"sentence": texts[2]}]))  # rows answered in order
    assert_close(mixed["fragments"][0], torch.tensor(images["fragments"][1]))
    assert_close(mixed["fragments"][1], torch.tensor(sentences["fragments"][2]))


@pytest.mark.parametrize(("rows", "message"), [
    ([{"sentence": "a dog", "image": "aGk="}], r"row 0 holds \['image', 'sentence'\]"),
    ([{"sentence": "a dog"}, {"image": "aGk="}, {}], "row 2 holds neither"),
    ([{"image": "not base64!"}], "row 0: the image is not base64"),
    ([{"image": base64.b64encode(b"plain text").decode()}], "unusable image: .*row-0"),
])
def test_bad_rows_are_named(store: Store, tracking: None, rows: list[dict],
                            message: str) -> None:
    model = mlflow.pyfunc.load_model("models:/defrag@champion")
    with pytest.raises(MlflowException, match=message):
        model.predict(pd.DataFrame(rows))


def test_a_row_failing_otherwise_gets_one_generic_line_naming_it(
        store: Store, tracking: None, caplog: pytest.LogCaptureFixture) -> None:
    """An error that is not the client's to read (here spaCy's, for a text over its length
    limit) is logged on the server; the client gets one line naming the row."""
    model = mlflow.pyfunc.load_model("models:/defrag@champion")
    rows = [{"image": base64_of(store.images[0])}, {"sentence": "a dog " * 200_000}]
    with pytest.raises(MlflowException) as failure:
        model.predict(pd.DataFrame(rows))
    assert failure.value.message == ("row-1: the sentence cannot be embedded (the server's log "
                                     "says why)")
    assert "E088" in caplog.text


@pytest.mark.slow
def test_nothing_is_unpickled_and_no_pickle_is_logged(store: Store) -> None:
    """In a fresh process whose pickle, cloudpickle and torch.load raise: load the logged MLflow
    model (from the store's files: no sqlite start-up) and predict."""
    logged = Path(store.client.get_run(store.run_id).info.artifact_uri.removeprefix("file://"))
    assert (logged / "model" / MLMODEL).is_file()
    assert not [p for p in logged.rglob("*") if p.suffix in (".pkl", ".pickle", ".cloudpickle")]
    script = f"""
import pickle, cloudpickle, torch, mlflow.pyfunc, pandas as pd

def refuse(*args, **kwargs):
    raise AssertionError("unpickling while loading the model")

class Refused(pickle.Unpickler):
    def __init__(self, *args, **kwargs):
        refuse()

pickle.load = pickle.loads = cloudpickle.load = cloudpickle.loads = torch.load = refuse
pickle.Unpickler = Refused
model = mlflow.pyfunc.load_model({str(logged / "model")!r}, suppress_warnings=True)
out = model.predict(pd.DataFrame({{"sentence": [{store.captions[0]!r}]}}))
print(len(out["mean"][0]))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "16"


def tiny_captioner(folder: Path, encoder: Path) -> Path:
    """A captioner folder around `encoder` with a tiny untrained SC-NLM and one caption."""
    scnlm = SCNLM(vocab_size=5, num_tags=3, content_dim=16, word_dim=4, attribute_dim=4,
                  factors=2, context=2, forward_tags=1, seed=0)
    caption = Caption("a red circle", ["a", "red", "circle"], [1, 2, 3], [0, 1, 2])
    return save_captioner(folder, encoder, scnlm, Config(),
                          CaptionerParts.build([caption], torch.zeros(1, 16)))


@pytest.mark.parametrize("kind", ["ensemble", "captioner"])
def test_ensembles_and_captioners_register_download_and_load(store: Store, tracking: None,
                                                             tmp_path: Path, kind: str) -> None:
    """Registered and downloaded whole; their pyfunc loads and says what it does not do."""
    folder = (save_ensemble(tmp_path / kind, [store.model_dir, store.other_dir])
              if kind == "ensemble" else tiny_captioner(tmp_path / kind, store.model_dir))
    assert register_model(store.client, store.run_id, folder, f"defrag-{kind}",
                          artifact_path=kind) == "1"
    dst = download_model(f"models:/defrag-{kind}@champion", tmp_path / "dl", store.uri)
    assert (dst / CHECKSUMS).read_bytes() == (folder / CHECKSUMS).read_bytes()
    ModelFolder.open(dst)
    model = mlflow.pyfunc.load_model(f"models:/defrag-{kind}@champion")
    what = "an ensemble of 2 models" if kind == "ensemble" else "a captioner"
    with pytest.raises(MlflowException, match=f"this model is {what}.*: its pyfunc neither"):
        model.predict(pd.DataFrame({"sentence": ["a red circle"]}))


# ---------------------------------------------------------------- download


@pytest.mark.parametrize("uri", ["models:/defrag@champion", "models:/defrag@old"])
def test_download_gives_the_plain_model_folder(store: Store, tmp_path: Path, uri: str) -> None:
    dst = download_model(uri, tmp_path / "dl", store.uri)
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        p.name for p in store.model_dir.iterdir())
    assert (dst / CHECKSUMS).read_bytes() == (store.model_dir / CHECKSUMS).read_bytes()
    ModelFolder.open(dst).load_model()
    assert [p.name for p in tmp_path.iterdir()] == ["dl"]  # no staging left


def test_old_style_logged_files_registered_again_reuse_their_version(store: Store) -> None:
    """A run that logged its folder before the pyfunc registers the same files again."""
    assert register_model(store.client, store.run_id, store.model_dir, alias="again",
                          artifact_path="old") == "2"
    store.client.delete_registered_model_alias("defrag", "again")  # the store is shared
    with pytest.raises(ValueError, match="already has other files under 'old'"):
        register_model(store.client, store.run_id, store.other_dir, artifact_path="old")


# ---------------------------------------------------------------- search and serving


@pytest.fixture(scope="module")
def index(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index of the val images and captions, built with the model."""
    from trainer.search.index_builder import main as build_index

    root = tmp_path_factory.mktemp("index")
    (root / "images").mkdir()
    for path in store.images:
        (root / "images" / path.name).write_bytes(path.read_bytes())
    (root / "sentences.txt").write_text("\n".join(store.captions) + "\n")
    build_index(["--model", str(store.model_dir), "--images", str(root / "images"),
                 "--sentences", str(root / "sentences.txt"), "--out", str(root / "index"),
                 "--workers", "1"])
    return root / "index"


def test_params_search_an_index(store: Store, index: Path, tracking: None) -> None:
    from trainer.search.index import SearchIndex

    model = mlflow.pyfunc.load_model("models:/defrag@champion",
                                     model_config={"indexes": {"photos": str(index)}})
    opened = SearchIndex.open(index, model=store.model_dir)
    params = {"index": "photos", "k": 2}
    found = model.predict(pd.DataFrame({"sentence": store.captions[:2]}), params=params)
    for text, hits in zip(store.captions[:2], found["hits"], strict=True):
        assert [(h["item"], h["position"]) for h in hits] == [
            (h.item, h.position) for h in opened.images_for(text, 2).hits]
    assert list(found["exact"]) == [True, True] and list(found["gap"]) == [0.0, 0.0]
    found = model.predict(pd.DataFrame({"image": [base64_of(store.images[0])]}), params=params)
    assert [h["item"] for h in found["hits"][0]] == [
        h.item for h in opened.sentences_for_file(store.images[0], 2).hits]
    assert len(found["hits"][0]) == 2 and found["hits"][0][0]["score"] >= found["hits"][0][1][
        "score"]
    with pytest.raises(MlflowException, match="k is 0: ask for 1 or more results"):
        model.predict(pd.DataFrame({"sentence": ["a red circle"]}), params={**params, "k": 0})


def test_the_pixel_bound_refuses_images_from_their_header_and_is_configurable(
        store: Store, index: Path, tracking: None, monkeypatch: pytest.MonkeyPatch) -> None:
    huge = base64.b64encode(png_header(7000, 7000)).decode()  # 49 Mpx, but a few bytes
    small = base64_of(store.images[0])  # 64 x 64
    photos = {"indexes": {"photos": str(index)}}
    bounds = [(photos, huge, "7000 x 7000 pixels (49 megapixels), over the limit of 40000000 "
                             "(40 megapixels)"),
              ({**photos, "max_image_pixels": 4000}, small,
               "64 x 64 pixels (0.0041 megapixels), over the limit of 4000 (0.004 megapixels)")]
    for config, image, refusal in bounds:
        model = mlflow.pyfunc.load_model("models:/defrag@champion", model_config=config)
        for params in (None, {"index": "photos"}):
            with pytest.raises(MlflowException) as failure:
                model.predict(pd.DataFrame({"image": [image]}), params=params)
            assert failure.value.message == (
                f"unusable image: row-0 is {refusal}: scale it down, or raise the limit "
                f"(max_image_pixels)")
    monkeypatch.setenv("DEFRAG_MAX_IMAGE_PIXELS", "4000")  # the environment wins
    model = mlflow.pyfunc.load_model("models:/defrag@champion", model_config=photos)
    with pytest.raises(MlflowException, match="over the limit of 4000 "):
        model.predict(pd.DataFrame({"image": [small]}))


def test_an_index_of_another_model_is_refused(store: Store, index: Path, tracking: None,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Refused in the line any unavailable index gets; the server's log says why."""
    register_model(store.client, store.run_id, store.other_dir, "defrag-other",
                   artifact_path="other")
    model = mlflow.pyfunc.load_model("models:/defrag-other@champion",
                                     model_config={"index_root": str(index.parent)})
    with pytest.raises(MlflowException) as refused:
        model.predict(pd.DataFrame({"sentence": ["a red circle"]}), params={"index": "index"})
    assert str(refused.value) == UNAVAILABLE.format(repr("index"), UNDER_ROOT)
    assert f"index {index} was built with the model whose" in caplog.text


UNAVAILABLE = "params index {} is not available: this server searches {}"
UNDER_ROOT = "an index folder under its index root (give its path relative to the root)"


def test_only_the_operators_indexes_are_opened_once_each(store: Store, index: Path,
                                                         tmp_path: Path) -> None:
    """A name of the configured set or a folder under the root, resolved: 40 spellings of one
    index open it once; `..`, an absolute path out, a link out of the root, a file, a folder
    that is no index and a missing one get one answer; the last 2 used stay open."""
    from trainer.search.served_indexes import ServedIndexes

    root = tmp_path / "root"
    shutil.copytree(index, root / "a")
    shutil.copytree(index, root / "b" / "c")
    shutil.copytree(index, root / "d")
    outside = Path(shutil.copytree(index, tmp_path / "outside"))
    (root / "out").symlink_to(outside)
    (root / "notes.txt").write_text("not an index\n")
    (root / "empty").mkdir()
    served = ServedIndexes.configure({"indexes": {"photos": str(root / "a")}},
                                     {"DEFRAG_INDEX_ROOT": str(root)},
                                     ModelFolder.open(store.model_dir))
    spellings = ["photos", "a", "a/", "./a", "a//", str(root / "a"), f"{root}//a",
                 *(f"{'./' * n}a" for n in range(1, 20)), *(f"b/../a{'/' * n}" for n in range(14))]
    assert len(spellings) == 40
    opened = {id(served.open(asked)) for asked in spellings}
    assert len(opened) == 1 and len(served.cache) == 1
    offer = "the index 'photos' and " + UNDER_ROOT
    hostile = ["/etc/shadow", "/etc/passwd", "../outside", "a/../../outside", str(outside),
               "out", "out/", "notes.txt", "empty", "missing", "/nowhere/at/all", "..",
               "a\0", "b"]
    for asked in hostile:
        with pytest.raises(RetrievalError) as refused:
            served.open(asked)
        assert str(refused.value) == UNAVAILABLE.format(repr(asked), offer)
    first = served.open("a")
    assert list(served.cache) == [(root / "a").resolve()]
    served.open("b/c")
    served.open("d")  # the least recently used, a, is closed
    assert served.open("photos") is not first
    assert list(served.cache) == [(root / "d").resolve(), (root / "a").resolve()]
    nothing = ServedIndexes.configure({}, {}, ModelFolder.open(store.model_dir))
    with pytest.raises(RetrievalError, match="this server searches no index: its operator "
                                             "names them"):
        nothing.open(str(index))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_mlflow_models_serve_answers_rest_requests(store: Store, embedder: Embedder,
                                                   index: Path, tmp_path: Path) -> None:
    """The real `mlflow models serve` of the champion: vectors, and a search by params of an
    index under its DEFRAG_INDEX_ROOT (40 spellings open it once: its files are mapped once);
    paths out of the root, missing or no index get one answer naming nothing on disk."""
    root = index.parent
    outside = Path(shutil.copytree(index, tmp_path / "outside"))
    (root / "escape").symlink_to(outside)
    port, log, bin_dir = free_port(), tmp_path / "serve.log", Path(sys.executable).parent
    env = {**os.environ, "MLFLOW_TRACKING_URI": store.uri,  # it starts `uvicorn` from PATH
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "DEFRAG_INDEX_ROOT": str(root)}
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(bin_dir / "mlflow"), "models", "serve", "-m", "models:/defrag@champion",
             "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], env=env, stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _answers(f"{url}/ping"):
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        answer = requests.post(f"{url}/invocations", timeout=60, json={
            "dataframe_records": [{"sentence": store.captions[0]}]})
        assert answer.status_code == 200, answer.text
        row, = answer.json()["predictions"]
        expected = embed_sentences([store.captions[0]], embedder)
        assert_close(row["fragments"], expected.embeddings)

        def search(asked: str) -> requests.Response:
            return requests.post(f"{url}/invocations", timeout=60, json={
                "dataframe_records": [{"sentence": store.captions[0]}],
                "params": {"index": asked, "k": 1}})

        answer = search("index")
        assert answer.status_code == 200, answer.text
        hits = answer.json()["predictions"][0]["hits"]
        assert len(hits) == 1
        mapped = mapped_files(server.pid, index.resolve() / "images.safetensors")
        assert mapped > 0
        spellings = [str(index), f"{root}//index", f"{root}/./index", "./index", "index/",
                     *(f"images/../{'./' * n}index{'/' * (n % 3)}" for n in range(35))]
        for asked in spellings:
            answer = search(asked)
            assert answer.status_code == 200 and answer.json()["predictions"][0]["hits"] == hits
        assert mapped_files(server.pid, index.resolve() / "images.safetensors") == mapped
        hostile = ["/etc/shadow", "/etc/shadow/index", str(root / "missing"), "images",
                   "sentences.txt", os.path.relpath(outside, root), str(outside), "escape",
                   "../../../../../../etc", "index/../../"]
        answers = {asked: search(asked) for asked in hostile}
        assert {a.status_code for a in answers.values()} == {400}
        said = {json.loads(a.text)["message"].replace(repr(asked), "X")
                for asked, a in answers.items()}
        assert len(said) == 1 and said.pop().endswith(UNAVAILABLE.format("X", UNDER_ROOT)), said
        assert not [a.text for a in answers.values() if "stack_trace" in a.text]
        assert "refused params index '/etc/shadow'" in log.read_text()  # the operator's reason
        answer = requests.post(f"{url}/invocations", timeout=60, json={
            "dataframe_records": [{"image": "not base64!"}]})
        assert answer.status_code == 400 and "the image is not base64" in answer.text
        answer = requests.post(f"{url}/invocations", timeout=60, json={
            "dataframe_records": [{"image": base64.b64encode(b"plain text").decode()}]})
        assert answer.status_code == 400 and "row-0" in answer.text
        assert tempfile.gettempdir() not in answer.text, answer.text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def mapped_files(group: int, path: Path) -> int:
    """How many memory maps of `path` the processes of a server's process group hold."""
    leader = psutil.Process(group)
    return sum(1 for process in [leader, *leader.children(recursive=True)]
               for region in process.memory_maps(grouped=False) if region.path == str(path))


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False
