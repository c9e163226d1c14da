"""trainer/store/model_folder.py and registry.py: the model folder (round trip, refusals, opened
once), registration on a real sqlite
MLflow store, download by alias and version, the download command in a subprocess, and ensemble
folders (members verified, registered and downloaded whole)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from defrag.vocab import Vocabulary
from tests import DEFRAG
from trainer.config import Config, ModelConfig
from trainer.model import DeFragModel
from trainer.store.model_folder import (
    CHECKSUMS,
    CONFIG,
    METRICS,
    VOCAB,
    WEIGHTS,
    ModelFolder,
    ModelFolderError,
    save_ensemble,
    save_model_folder,
)
from trainer.store.registry import (
    download_model,
    main,
    pyfunc_folder,
    register_from_run,
    register_model,
)
from trainer.store.tracking import Tracker

REPO = Path(__file__).resolve().parents[1]
VOCAB_WORDS = Vocabulary(words=["a", "brown", "dog", "runs", "grass"], relations=["nsubj", "amod"])


def tiny_model(seed: int) -> tuple[DeFragModel, Config]:
    """A small real DeFragModel (8-d word vectors, 16-d space) and a config that trained it from a
    word-vector file and ImageNet weights: loading must need neither."""
    built = ModelConfig(embed_dim=16, word_dim=8, backbone="efficientnet_lite0", pretrained=False)
    model = DeFragModel.from_config(built, VOCAB_WORDS, seed=seed)
    trained = dataclasses.replace(built, word_dim=200, pretrained=True,
                                  word_vectors="/nowhere/glove.6B.8d.txt")
    return model, Config(model=trained, seed=seed)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert torch.equal(tensor, state_b[name]), name


def rewrite_checksums(folder: Path) -> None:
    """Re-fingerprint every file, as a careless re-export would (checksums alone then pass)."""
    manifest = json.loads((folder / CHECKSUMS).read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / CHECKSUMS).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DeFragModel, Config]:
    model, config = tiny_model(seed=1)
    folder = save_model_folder(tmp_path_factory.mktemp("saved") / "model", model, config,
                               VOCAB_WORDS, metrics={"rsum": 42.0})
    return folder, model, config


@pytest.fixture
def copy_of_saved(saved: tuple[Path, DeFragModel, Config], tmp_path: Path) -> Path:
    """A copy of the saved folder a test may damage."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in saved[0].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


# ---------------------------------------------------------------- the folder


def test_folder_round_trip_without_pickle(saved: tuple[Path, DeFragModel, Config],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder, model, config = saved
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [WEIGHTS, CONFIG, VOCAB, METRICS, CHECKSUMS])
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging left

    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model folder must load without unpickling")

    for module, name in [(torch, "load"), (pickle, "load"), (pickle, "loads")]:
        monkeypatch.setattr(module, name, no_unpickling)
    opened = ModelFolder.open(folder)
    loaded = opened.load_model()
    assert_same_weights(loaded, model)
    assert opened.config == config and opened.vocab == VOCAB_WORDS
    assert not loaded.training
    assert json.loads((folder / METRICS).read_text()) == {"rsum": 42.0}
    fragments = torch.tensor([[0, 2, 3], [1, 2, 1]])
    torch.testing.assert_close(loaded.sentence(fragments), model.sentence(fragments))


def test_save_replaces_an_older_folder(tmp_path: Path) -> None:
    model, config = tiny_model(seed=2)
    folder = tmp_path / "best"
    save_model_folder(folder, torch.nn.Linear(2, 2), config, VOCAB_WORDS, metrics={"rsum": 1.0})
    save_model_folder(folder, model, config, VOCAB_WORDS)
    assert [p.name for p in tmp_path.iterdir()] == ["best"]  # nothing staged or retired left
    assert not (folder / METRICS).exists()
    assert_same_weights(ModelFolder.open(folder).load_model(), model)


def test_shared_and_strided_tensors_are_saved(tmp_path: Path) -> None:
    tied = torch.nn.Module()
    tied.weight = torch.nn.Parameter(torch.randn(3, 4))
    tied.register_buffer("transposed", tied.weight.detach().T)  # a view: shared, not contiguous
    folder = save_model_folder(tmp_path / "tied", tied, Config(), VOCAB_WORDS)
    ModelFolder.open(folder)
    state = load_file(folder / WEIGHTS)
    assert torch.equal(state["weight"], tied.weight) and torch.equal(state["transposed"],
                                                                     tied.weight.T)


@pytest.mark.parametrize("name", [WEIGHTS, CONFIG, VOCAB, METRICS])
def test_altered_file_is_refused(copy_of_saved: Path, name: str) -> None:
    data = bytearray((copy_of_saved / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    (copy_of_saved / name).write_bytes(bytes(data))
    with pytest.raises(ModelFolderError, match=f"{name} does not match its checksum"):
        ModelFolder.open(copy_of_saved)


@pytest.mark.parametrize("name", [WEIGHTS, CONFIG, VOCAB, CHECKSUMS])
def test_missing_file_is_refused(copy_of_saved: Path, name: str) -> None:
    (copy_of_saved / name).unlink()
    with pytest.raises(ModelFolderError, match=f"{name} is missing"):
        ModelFolder.open(copy_of_saved)


def test_unlisted_file_is_refused(copy_of_saved: Path) -> None:
    (copy_of_saved / "model.pkl").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(ModelFolderError, match=r"not listed in checksums.json: \['model.pkl'\]"):
        ModelFolder.open(copy_of_saved)


@pytest.mark.parametrize("change", ["drop", "add", "reshape"])
def test_weights_that_do_not_fit_the_model_are_refused(copy_of_saved: Path, change: str) -> None:
    state = load_file(copy_of_saved / WEIGHTS)
    if change == "drop":
        del state["sentence.bias"]
        expected = r"missing tensors \['sentence.bias'\]"
    elif change == "add":
        state["extra.weight"] = torch.zeros(2)
        expected = r"unexpected \['extra.weight'\]"
    else:
        state["image.projection.bias"] = torch.zeros(17)
        expected = r"other shapes \['image.projection.bias'\]"
    save_file(state, copy_of_saved / WEIGHTS)
    rewrite_checksums(copy_of_saved)
    opened = ModelFolder.open(copy_of_saved)  # intact files: the model refuses them
    with pytest.raises(ModelFolderError, match=f"{WEIGHTS} does not fit .*{expected}"):
        opened.load_model()


# ---------------------------------------------------------------- the registry


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory,
          saved: tuple[Path, DeFragModel, Config]) -> tuple[Tracker, DeFragModel]:
    """A run's embedded store with `defrag` v1 (the saved model) and v2 (champion, seed 3)."""
    root = tmp_path_factory.mktemp("store")
    env = pytest.MonkeyPatch()
    env.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.start(saved[2], root / "run", rank=0)
    env.undo()
    assert register_from_run(tracker, saved[0]) == "1"
    second, config = tiny_model(seed=3)
    folder = save_model_folder(root / "second", second, config, VOCAB_WORDS, {"rsum": 50.0})
    assert register_from_run(tracker, folder, artifact_path="model-2") == "2"
    tracker.finish()
    return tracker, second


def test_register_refuses_to_overwrite_a_version(store: tuple[Tracker, DeFragModel],
                                                 saved: tuple[Path, DeFragModel, Config],
                                                 tmp_path: Path) -> None:
    tracker, second = store
    other = save_model_folder(tmp_path / "other", second, saved[2], VOCAB_WORDS, {"rsum": 1.0})
    with pytest.raises(ValueError, match="already has other files under 'model'"):
        register_model(tracker.client, tracker.run_id, other)


def test_registering_the_same_files_again_reuses_their_version(
        store: tuple[Tracker, DeFragModel], saved: tuple[Path, DeFragModel, Config]) -> None:
    """A finished run resumed (or requeued after it registered) registers its best again."""
    tracker, _ = store
    assert register_model(tracker.client, tracker.run_id, saved[0], alias="again") == "1"
    assert str(tracker.client.get_model_version_by_alias("defrag", "again").version) == "1"
    assert len(tracker.client.search_model_versions("name = 'defrag'")) == 2
    tracker.client.delete_registered_model_alias("defrag", "again")  # the store is shared
    # under another name: a version of that name, from the artifacts logged already
    assert register_model(tracker.client, tracker.run_id, saved[0], name="renamed") == "1"
    assert tracker.client.get_model_version("renamed", "1").source.endswith("/model")
    assert len(tracker.client.search_model_versions("name = 'defrag'")) == 2
    tracker.client.delete_registered_model("renamed")


@pytest.mark.parametrize("uri", ["models:/defrag@champion", "models:/defrag/2", "models:/defrag/1"])
def test_download_by_alias_and_version(store: tuple[Tracker, DeFragModel],
                                       saved: tuple[Path, DeFragModel, Config], tmp_path: Path,
                                       uri: str) -> None:
    tracker, second = store
    dst = download_model(uri, tmp_path / "downloads" / "defrag", tracker.tracking_uri)
    assert dst == tmp_path / "downloads" / "defrag"
    assert [p.name for p in dst.parent.iterdir()] == ["defrag"]  # no staging left
    model = ModelFolder.open(dst).load_model()
    assert_same_weights(model, saved[1] if uri.endswith("/1") else second)


def logged_folder(tracker: Tracker, artifact_path: str) -> Path:
    """The model folder a run logged under `artifact_path`, in the store's own files."""
    artifacts = tracker.client.get_run(tracker.run_id).info.artifact_uri.removeprefix("file://")
    return pyfunc_folder(Path(artifacts) / artifact_path)


@pytest.mark.parametrize(("uri", "message"), [
    ("models:/nope@champion", r"no registered model 'nope' .*registered: \['defrag'\]"),
    ("models:/defrag@best", r"model 'defrag' has no alias 'best'; aliases: \['champion'\]"),
    ("models:/defrag/7", r"model 'defrag' has no version 7; versions: \[1, 2\]"),
    ("runs:/abc/model", "expected models:/NAME@ALIAS or models:/NAME/VERSION"),
])
def test_download_names_what_does_not_exist(store: tuple[Tracker, DeFragModel], tmp_path: Path,
                                            uri: str, message: str) -> None:
    with pytest.raises((LookupError, ValueError), match=message):
        download_model(uri, tmp_path / "dst", store[0].tracking_uri)
    assert list(tmp_path.iterdir()) == []


def test_download_refuses_an_altered_store_copy(store: tuple[Tracker, DeFragModel],
                                                tmp_path: Path) -> None:
    tracker, _ = store
    weights = logged_folder(tracker, "model") / VOCAB
    original = weights.read_bytes()
    weights.write_bytes(original.replace(b"dog", b"cat"))
    try:
        with pytest.raises(ModelFolderError, match=f"{VOCAB} does not match its checksum"):
            download_model("models:/defrag/1", tmp_path / "dst", tracker.tracking_uri)
    finally:
        weights.write_bytes(original)
    assert list(tmp_path.iterdir()) == []


def test_download_refuses_an_incomplete_store_copy(store: tuple[Tracker, DeFragModel],
                                                   tmp_path: Path) -> None:
    tracker, _ = store
    weights = logged_folder(tracker, "model-2") / WEIGHTS
    moved = weights.rename(tmp_path / WEIGHTS)
    try:
        with pytest.raises(ModelFolderError, match=f"{WEIGHTS} is missing .incomplete copy"):
            download_model("models:/defrag@champion", tmp_path / "dst", tracker.tracking_uri)
    finally:
        moved.rename(weights)
    assert list(tmp_path.iterdir()) == []  # no dst, no staging left


def test_cli_errors_are_one_clear_line(store: tuple[Tracker, DeFragModel], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit, match="download: error: no tracking store: pass --tracking-uri"):
        main(["download", "models:/defrag@champion", "--dst", str(tmp_path / "a")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit, match="exists and is not an empty folder"):
        main(["download", "models:/defrag@champion", "--dst", str(tmp_path / "full"),
              "--tracking-uri", store[0].tracking_uri])
    with pytest.raises(SystemExit, match="verify: error: .*checksums.json is missing"):
        main(["verify", str(tmp_path / "full")])


def test_download_command_end_to_end(store: tuple[Tracker, DeFragModel], tmp_path: Path) -> None:
    tracker, second = store
    dst = tmp_path / "champion"
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracker.tracking_uri}
    done = subprocess.run(
        [DEFRAG, "registry", "download", "models:/defrag@champion",
         "--dst", str(dst)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(dst)
    opened = ModelFolder.open(dst)
    assert_same_weights(opened.load_model(), second)
    assert opened.config.seed == 3


def test_register_command_registers_a_saved_folder_later(
        saved: tuple[Path, DeFragModel, Config], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """What a run whose registration failed prints to do: register its `best/` from the run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.start(saved[2], tmp_path / "run", rank=0)
    tracker.finish()
    main(["register", str(saved[0]), "--run-id", tracker.run_id,
          "--tracking-uri", tracker.tracking_uri])
    assert capsys.readouterr().out.strip() == "models:/defrag/1"
    dst = download_model("models:/defrag@champion", tmp_path / "dl", tracker.tracking_uri)
    assert_same_weights(ModelFolder.open(dst).load_model(), saved[1])


# ---------------------------------------------------------------- ensembles


@pytest.fixture
def ensemble(saved: tuple[Path, DeFragModel, Config], tmp_path: Path) -> tuple[Path, Path]:
    """An ensemble folder of the saved model and another (seed 5), and that other member."""
    other, config = tiny_model(seed=5)
    second = save_model_folder(tmp_path / "second", other, config, VOCAB_WORDS)
    main(["ensemble", str(saved[0]), str(second), "--out", str(tmp_path / "ensemble")])
    return tmp_path / "ensemble", second


def test_ensemble_folder_holds_verified_copies_of_its_members(
        ensemble: tuple[Path, Path], saved: tuple[Path, DeFragModel, Config]) -> None:
    folder, second = ensemble
    opened = ModelFolder.open(folder)
    members = [member for member, _ in opened.members]
    assert [m.path.name for m in members] == ["member-0", "member-1"]
    assert_same_weights(members[0].load_model(), saved[1])
    assert_same_weights(members[1].load_model(), ModelFolder.open(second).load_model())
    assert [weight for _, weight in opened.members] == [0.5, 0.5]
    one = ModelFolder.open(saved[0])
    assert one.members == [(one, 1.0)]  # one model: itself, weight 1
    with pytest.raises(ModelFolderError, match="is an ensemble of 2 models, not one"):
        opened.load_model()


def test_damaged_ensembles_are_refused(ensemble: tuple[Path, Path],
                                       saved: tuple[Path, DeFragModel, Config]) -> None:
    folder, second = ensemble
    member = folder / "member-1"
    (member / VOCAB).write_bytes((member / VOCAB).read_bytes().replace(b"dog", b"cat"))
    with pytest.raises(ModelFolderError, match=f"member-1/{VOCAB} does not match its checksum"):
        ModelFolder.open(folder)
    rewrite_checksums(member)  # a member swapped for another consistent folder
    with pytest.raises(ModelFolderError, match="member-1 is not the member ensemble.json records"):
        ModelFolder.open(folder)
    member.rename(folder / "member-9")
    with pytest.raises(ModelFolderError, match=r"holds the folders \['member-0', 'member-9'\] "
                                               r"but ensemble.json lists"):
        ModelFolder.open(folder)
    (folder / "member-9").rename(member)
    main(["ensemble", str(saved[0]), str(second), "--out", str(folder)])  # replaced, intact
    with pytest.raises(ModelFolderError, match="is an ensemble itself"):
        save_ensemble(folder.with_name("nested"), [folder, saved[0]])


def test_ensemble_members_share_a_score_or_have_weights(saved: tuple[Path, DeFragModel, Config],
                                             tmp_path: Path) -> None:
    model, config = tiny_model(seed=5)
    config.objective.score = "cosine"
    other = save_model_folder(tmp_path / "cosine", model, config, VOCAB_WORDS)
    with pytest.raises(SystemExit, match="ensemble: error: the members score differently"):
        main(["ensemble", str(saved[0]), str(other), "--out", str(tmp_path / "e")])
    with pytest.raises(SystemExit, match=r"weights \[1.0\]: expected one positive weight per"):
        main(["ensemble", str(saved[0]), str(other), "--out", str(tmp_path / "e"),
              "--weights", "1"])
    with pytest.raises(SystemExit, match="needs 2 or more member model folders: got 1"):
        main(["ensemble", str(saved[0]), "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()


def test_ensemble_is_registered_and_downloaded_whole(ensemble: tuple[Path, Path],
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = ensemble
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    monkeypatch.chdir(tmp_path / "store")  # nothing may land in the working folder
    main(["ensemble", *(str(m.path) for m, _ in ModelFolder.open(folder).members), "--out",
          str(tmp_path / "again"), "--name", "defrag-ensemble", "--tracking-uri", uri])
    assert capsys.readouterr().out.split()[-1] == "models:/defrag-ensemble/1"
    dst = download_model("models:/defrag-ensemble@champion", tmp_path / "dl", uri)
    downloaded = ModelFolder.open(dst).members
    assert [m.path.name for m, _ in downloaded] == ["member-0", "member-1"]
    for (got, _), (want, _) in zip(downloaded, ModelFolder.open(folder).members, strict=True):
        assert got.checksums_key == want.checksums_key
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["mlartifacts", "mlflow.db"]
