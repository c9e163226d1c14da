"""trainer/search/retrieve.py and the modules it uses (embedder, embedding_cache, explain,
arithmetic) end to end through `main([...])` on tiny models and generated scenes: scores equal the
evaluation's (for an ensemble folder: the mean of its members', in trainer.evaluate too), the
index cache is reused and invalidated, --explain draws the alignment (fragments) or each word's
contribution (whole-sentence encoders), --minus / --plus compute Kiros et al.'s eq. 15, and bad
inputs give clear messages. tests/test_arithmetic.py measures the arithmetic on a trained
model."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

import defrag.images
import trainer.evaluate as evaluate
import trainer.search.embedder as embedder
import trainer.search.retrieve as retrieve
from defrag.vocab import Vocabulary
from featurizer.boxes import make_box_source, rebuild_box_source
from featurizer.parsing import make_parser
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import COLOURS, generate
from trainer.config import Config, DataConfig, ModelConfig, ObjectiveConfig
from trainer.data.eval_set import load_eval_set
from trainer.data.shardset import training_featurizer
from trainer.evaluate import embed_eval_set, retrieval_metrics
from trainer.model import DeFragModel, ImageEncoder
from trainer.objectives import owner_means, score_matrix
from trainer.pictures import LOWERS, RAISES, best_boxes, fragment_labels
from trainer.search.embedding_cache import CACHE_DIR
from trainer.search.explain import explain_words
from trainer.search.fragment_set import rank
from trainer.store.model_folder import ModelFolder, save_ensemble, save_model_folder

NUM_VAL = 4


class World:
    """Tiny models trained (well, initialised) on shards of generated scenes with whole-image
    boxes: the fragments encoder's and Kiros et al.'s linear encoder's (cosine scores); a folder
    holding the val images and a file holding their captions."""

    def __init__(self, root: Path) -> None:
        jsonl = generate(root / "source", num_train=4, num_val=NUM_VAL, seed=0, image_size=64)
        self.shards = root / "shards"
        featurize(read_jsonl(jsonl, jsonl.parent, "train"),
                  Settings(out=self.shards, parser="spacy", boxes="fullframe", shard_size=10,
                           workers=1, min_word_count=1))
        self.vocab = Vocabulary.load(self.shards / "vocab.json")
        self.cfg = Config(model=ModelConfig(embed_dim=16, word_dim=8, pretrained=False,
                                            image_size=64),
                          data=DataConfig(shards=str(self.shards), val_split="val"))
        self.model_dir = self.save_model(root / "model", seed=0)
        self.linear_dir = self.save_model(root / "linear", seed=0, cfg=whole_sentence(
            self.cfg, "linear", "cosine"))
        self.images = root / "images"
        self.images.mkdir()
        for path in sorted((root / "source" / "images").glob("val_*.png")):
            shutil.copy2(path, self.images / path.name)
        self.names = sorted(p.name for p in self.images.iterdir())
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        self.captions = [c for r in records if r["split"] == "val" for c in r["captions"]]
        self.sentences = root / "sentences.txt"
        self.sentences.write_text("\n".join(self.captions) + "\n")

    def save_model(self, folder: Path, seed: int, cfg: Config | None = None) -> Path:
        cfg = cfg or self.cfg
        model = DeFragModel.from_config(cfg.model, self.vocab, seed=seed)
        return save_model_folder(folder, model, cfg, self.vocab,
                                 featurizer=training_featurizer(cfg.data))


def whole_sentence(cfg: Config, encoder: str, score: str) -> Config:
    """`cfg` with a whole-sentence encoder, trained on C_G alone with `score`."""
    return Config(model=ModelConfig(**{**vars(cfg.model), "sentence_encoder": encoder}),
                  objective=ObjectiveConfig(use_fragment=False, score=score), data=cfg.data)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("retrieve"))


@pytest.fixture
def images(world: World, tmp_path: Path) -> Path:
    """A copy of the images folder a test may change (and index)."""
    return Path(shutil.copytree(world.images, tmp_path / "images"))


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> dict:
    """main([...]) with --json; its report."""
    retrieve.main([str(arg) for arg in argv] + ["--json"])
    return json.loads(capsys.readouterr().out)


def same_report(report: dict, expected: dict) -> bool:
    """The same results in the same order; scores equal to float32 rounding (a query embedded
    anew goes through BLAS kernels whose summation order may differ between runs)."""
    def scores(r: dict) -> list[float]:
        return [hit.pop("score") for query in r["queries"] for hit in query["results"]]

    report, expected = json.loads(json.dumps(report)), json.loads(json.dumps(expected))
    return scores(report) == pytest.approx(scores(expected), rel=1e-5) and report == expected


def messages(caplog: pytest.LogCaptureFixture) -> str:
    text = "\n".join(record.getMessage() for record in caplog.records)
    caplog.clear()
    return text


@pytest.fixture(autouse=True)
def info_logs(caplog: pytest.LogCaptureFixture) -> None:
    for module in ("trainer.search.retrieve", "trainer.search.embedder",
                   "trainer.search.embedding_cache", "trainer.search.explain"):
        caplog.set_level(logging.INFO, logger=module)


# ---------------------------------------------------------------- scores


def test_queries_score_like_the_evaluation(world: World, images: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    opened = ModelFolder.open(world.model_dir)
    cfg = opened.config
    embedded = embed_eval_set(opened.load_model(),
                              load_eval_set(cfg, opened.vocab, "val", rank=0, world_size=1))
    assert embedded.captions == world.captions
    scores = score_matrix(embedded.v, embedded.box_image, embedded.s, embedded.fragment_sentence,
                          embedded.num_images, embedded.num_sentences, cfg.objective.smooth)

    report = run(capsys, "--model", world.model_dir, "--images", images, "--sentences",
                 world.sentences, "--query", world.captions[6], "--query-image",
                 images / world.names[1], "--top-k", str(NUM_VAL))
    assert (report["images"], report["sentences"]) == (NUM_VAL, len(world.captions))
    by_image, by_sentence = report["queries"]
    got = {r["image"]: r["score"] for r in by_image["results"]}
    expected = dict(zip(world.names, scores[:, 6].tolist(), strict=True))
    assert got == pytest.approx(expected, abs=1e-5)
    assert [r["score"] for r in by_image["results"]] == sorted(got.values(), reverse=True)
    assert by_image["fragments"] == int((embedded.fragment_sentence == 6).sum())

    best = torch.argsort(scores[1], descending=True, stable=True)[:NUM_VAL].tolist()
    assert [r["line"] for r in by_sentence["results"]] == [j + 1 for j in best]
    assert [r["sentence"] for r in by_sentence["results"]] == [world.captions[j] for j in best]
    assert [r["score"] for r in by_sentence["results"]] == pytest.approx(
        scores[1, best].tolist(), abs=1e-5)
    assert by_sentence["boxes"] == 1  # the training shards' box source: fullframe


def test_an_ensemble_scores_with_its_members_mean(world: World, images: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.search.retrieve and trainer.evaluate on an ensemble folder: the weighted sum of its
    members' score matrices, as each member's evaluation computes them (here eq. 6 and cosine
    scores, so the weights are explicit)."""
    folder = save_ensemble(tmp_path / "ensemble", [world.model_dir, world.linear_dir],
                           weights=[0.25, 0.75])
    member_scores = []
    for member, _ in ModelFolder.open(folder).members:
        cfg = member.config
        embedded = embed_eval_set(member.load_model(),
                                  load_eval_set(cfg, member.vocab, "val", rank=0, world_size=1))
        member_scores.append(score_matrix(embedded.v, embedded.box_image, embedded.s,
                                          embedded.fragment_sentence, embedded.num_images,
                                          embedded.num_sentences, cfg.objective.smooth,
                                          score=cfg.objective.score))
    want = 0.25 * member_scores[0] + 0.75 * member_scores[1]

    report = run(capsys, "--model", folder, "--images", images, "--sentences", world.sentences,
                 "--query", world.captions[6], "--query-image", images / world.names[1],
                 "--top-k", str(NUM_VAL))
    assert report["ensemble"] == [str(folder / "member-0"), str(folder / "member-1")]
    by_image, by_sentence = report["queries"]
    got = {r["image"]: r["score"] for r in by_image["results"]}
    assert got == pytest.approx(dict(zip(world.names, want[:, 6].tolist(), strict=True)),
                                abs=1e-5)
    best = torch.argsort(want[1], descending=True, stable=True)[:NUM_VAL].tolist()
    assert [r["line"] for r in by_sentence["results"]] == [j + 1 for j in best]
    assert [r["score"] for r in by_sentence["results"]] == pytest.approx(want[1, best].tolist(),
                                                                         abs=1e-5)
    assert sorted(p.name for p in (images / CACHE_DIR).iterdir()) == ["member-0", "member-1"]

    evaluate.main(["--model", str(folder), "--shards", str(world.shards), "--split", "val",
                   "--workers", "0", "--save-scores", str(tmp_path / "scores.safetensors")])
    saved = load_file(tmp_path / "scores.safetensors")
    torch.testing.assert_close(saved["scores"], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(saved["sentence_image"], embedded.sentence_image)
    printed = capsys.readouterr().out
    assert "evaluated an ensemble of 2 models, " in printed
    metrics = json.loads(printed.splitlines()[-1])
    assert metrics["members"] == 2
    assert metrics["rsum"] == pytest.approx(
        retrieval_metrics(want, embedded.sentence_image)["rsum"])
    # Members with one CNN (here the same model twice) run it once: they share its features.
    twice = save_ensemble(tmp_path / "twice", [world.model_dir, world.model_dir])
    passes = []
    region_features = ImageEncoder.region_features
    monkeypatch.setattr(ImageEncoder, "region_features",
                        lambda self, *a: passes.append(1) or region_features(self, *a))
    evaluate.main(["--model", str(twice), "--shards", str(world.shards), "--split", "val",
                   "--workers", "0"])
    assert len(passes) == NUM_VAL  # once per image, for the first member only
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rsum"] == pytest.approx(
        retrieval_metrics(member_scores[0], embedded.sentence_image)["rsum"])
    with pytest.raises(SystemExit, match="is an ensemble of 2 models; --explain and --minus"):
        retrieve.main(["--model", str(folder), "--images", str(images), "--query", "a circle",
                       "--explain", str(tmp_path / "x.png")])


def test_evaluate_warns_when_the_shards_have_other_boxes(world: World, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    model = DeFragModel.from_config(world.cfg.model, world.vocab, seed=0)
    folder = save_model_folder(tmp_path / "regions", model, world.cfg, world.vocab, featurizer={
        "box_source": {"name": "selective_search", "options": {}}})
    evaluate.main(["--model", str(folder), "--shards", str(world.shards), "--split", "val",
                   "--workers", "0"])
    assert ("was trained on 'selective_search' boxes but these shards have 'fullframe' boxes; "
            "featurize them with --boxes selective_search") in capsys.readouterr().err


def test_a_whole_image_model_reads_only_the_whole_image_of_region_shards(
        world: World, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model trained on fullframe shards, evaluated on shards of the same images with region
    boxes, reads their whole-image box only: the same figures, no warning (so an ensemble of
    whole-image and region models is evaluated on region shards)."""
    jsonl = world.shards.parent / "source" / "synthetic.jsonl"
    regions = tmp_path / "regions"
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=regions, parser="spacy", boxes="given", shard_size=10, workers=1,
                       vocab=str(world.shards / "vocab.json")))
    assert json.loads((regions / "manifest.json").read_text())["box_source"]["name"] == "given"
    figures = []
    for shards in (world.shards, regions):
        evaluate.main(["--model", str(world.linear_dir), "--shards", str(shards), "--split",
                       "val", "--workers", "0"])
        out = capsys.readouterr()
        assert "warning" not in out.err
        figures.append({k: v for k, v in json.loads(out.out.splitlines()[-1]).items()
                        if k != "shards"})
    assert figures[0] == figures[1]


def test_box_source_follows_the_training_shards(caplog: pytest.LogCaptureFixture) -> None:
    given = make_box_source("given", max_boxes=5).describe()
    assert rebuild_box_source(given).max_boxes == 5  # description entries that are no option
    fullframe = make_box_source("fullframe").describe()
    cfg = Config()
    assert embedder._choose_boxes(cfg, {"box_source": fullframe}, None, None) == fullframe
    assert embedder._choose_boxes(cfg, {"box_source": given}, None, None)["name"] == (
        "selective_search")
    assert "trained on 'given' boxes, which new images do not have" in messages(caplog)
    assert embedder._choose_boxes(cfg, {"box_source": fullframe}, "detector", "w.pth") == {
        "name": "detector", "options": {"weights": "w.pth"}}
    only = Config(model=ModelConfig(fullframe_only=True))
    assert embedder._choose_boxes(only, None, "selective_search", None)["name"] == "fullframe"


def test_model_folder_remembers_the_training_parser_and_boxes(world: World,
                                                               tmp_path: Path) -> None:
    """A downloaded model parses and boxes new inputs like its training shards even where the
    shards are not: the folder keeps their parser and box source."""
    manifest = json.loads((world.shards / "manifest.json").read_text())
    saved = json.loads((world.model_dir / "featurizer.json").read_text())
    assert saved == {"parser": manifest["parser"], "box_source": manifest["box_source"]}
    elsewhere = Config(data=DataConfig(shards=str(tmp_path / "not-here")))
    assert embedder._training_featurizer(ModelFolder.open(world.model_dir), elsewhere) == saved
    bare = save_model_folder(tmp_path / "bare", torch.nn.Linear(2, 2), elsewhere, world.vocab)
    assert embedder._training_featurizer(ModelFolder.open(bare), elsewhere) is None


# ---------------------------------------------------------------- the index cache


def test_index_is_reused_then_invalidated(world: World, images: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    query = world.captions[0]
    argv = ["--model", world.model_dir, "--images", images, "--sentences", world.sentences,
            "--query", query, "--top-k", str(NUM_VAL)]
    first = run(capsys, *argv)
    assert f"{NUM_VAL} images written" in messages(caplog)
    index = images / CACHE_DIR
    assert sorted(p.name for p in index.iterdir()) == [
        "images.json", "images.safetensors", "sentences.json", "sentences.safetensors"]
    written = {p.name: p.stat().st_mtime_ns for p in index.iterdir()}

    def no_embedding(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached image was embedded again")

    with monkeypatch.context() as patch:
        patch.setattr(embedder, "read_image", no_embedding)
        assert same_report(run(capsys, *argv), first)
    log = messages(caplog)
    assert f"all {NUM_VAL} images cached, up to date" in log
    assert f"all {len(world.captions)} sentences cached, up to date" in log
    assert {p.name: p.stat().st_mtime_ns for p in index.iterdir()} == written

    # A changed file: only it is embedded again, and it now scores like the image it copies.
    changed = images / world.names[1]
    shutil.copyfile(images / world.names[0], changed)
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    embedded = []
    original = embedder.read_image
    monkeypatch.setattr(embedder, "read_image", lambda path, inputs: embedded.append(path.name)
                        or original(path, inputs))
    scores = {r["image"]: r["score"] for r in run(capsys, *argv)["queries"][0]["results"]}
    assert embedded == [world.names[1]]
    assert f"{NUM_VAL - 1} images cached, 0 new, 1 changed ['{world.names[1]}'], 0 removed" in (
        messages(caplog))
    assert scores[world.names[1]] == pytest.approx(scores[world.names[0]], abs=1e-6)

    # A removed file leaves the index; a changed sentences file and another model rebuild.
    (images / world.names[2]).unlink()
    sentences = tmp_path / "sentences.txt"
    sentences.write_text(world.sentences.read_text() + "A tiny black star.\n")
    other = world.save_model(tmp_path / "other", seed=1)
    report = run(capsys, "--model", other, "--images", images, "--sentences", sentences,
                 "--index-dir", index, "--query", query)
    log = messages(caplog)
    assert "built with another model: rebuilding" in log
    assert "the model, parser or sentences file changed: rebuilding" in log
    assert (report["images"], report["sentences"]) == (NUM_VAL - 1, len(world.captions) + 1)
    assert embedded[1:] == [n for n in world.names if n != world.names[2]]


def test_damaged_cache_is_rebuilt(world: World, images: Path,
                                  capsys: pytest.CaptureFixture[str],
                                  caplog: pytest.LogCaptureFixture) -> None:
    argv = ["--model", world.model_dir, "--images", images, "--query", world.captions[0]]
    first = run(capsys, *argv)
    (images / CACHE_DIR / "images.safetensors").write_bytes(b"garbage")
    messages(caplog)
    assert same_report(run(capsys, *argv), first)
    assert "is unreadable" in messages(caplog)


def test_an_image_cache_of_another_decoder_is_rebuilt(world: World, images: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Embeddings of an older decoder's pixels (defrag.images.DECODER_VERSION) are not reused."""
    argv = ["--model", world.model_dir, "--images", images, "--query", world.captions[0]]
    run(capsys, *argv)
    messages(caplog)
    monkeypatch.setattr(defrag.images, "DECODER_VERSION", defrag.images.DECODER_VERSION + 1)
    run(capsys, *argv)
    assert "built with another decoder: rebuilding" in messages(caplog)


# ---------------------------------------------------------------- explain


def test_explain_draws_each_fragment_with_its_best_box(world: World, images: Path,
                                                       tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    query = world.captions[3]
    out = tmp_path / "explain.png"
    report = run(capsys, "--model", world.model_dir, "--images", images, "--query", query,
                 "--explain", out)
    explained = report["explain"]
    top = report["queries"][0]["results"][0]["image"]
    assert explained["image"] == str(images / top) and explained["sentence"] == query
    assert explained["picture"] == str(out)
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.width > 400

    opened = ModelFolder.open(world.model_dir)
    model, cfg, vocab = opened.load_model(), opened.config, opened.vocab
    caption = make_parser("spacy").parse([query])[0].caption(query)
    fragments = vocab.encode(caption, cfg.model.fragment_mode)
    labels = fragment_labels(fragments, vocab, cfg.model.fragment_mode)
    image, boxes = embedder.read_image(images / top, embedder.Embedder.from_folder(
        opened, "fullframe", None, "spacy"))
    with torch.no_grad():
        v = model.image(torch.tensor(image.pixels).permute(2, 0, 1)[None].float() / 255,
                        torch.from_numpy(image.boxes), torch.zeros(1, dtype=torch.long))
        _, score = best_boxes(v, model.sentence(fragments))
    assert [f["fragment"] for f in explained["fragments"]] == labels
    assert [f["score"] for f in explained["fragments"]] == pytest.approx(score.tolist(),
                                                                        abs=1e-5)
    assert {tuple(f["xyxy"]) for f in explained["fragments"]} == {tuple(boxes[0].tolist())}

    retrieve.main(["--model", str(world.model_dir), "--images", str(images), "--query", query,
                   "--explain", str(out)])
    table = capsys.readouterr().out
    assert f"explain {query!r} on {images / top}" in table
    assert all(label in table for label in labels)


def test_selective_search_boxes_and_an_image_query(world: World, images: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The real box source (selective search scored by the packaged ImageNet CNN)."""
    for name in world.names[2:]:
        (images / name).unlink()
    out = tmp_path / "explain.png"
    report = run(capsys, "--model", world.model_dir, "--images", images, "--sentences",
                 world.sentences, "--query-image", images / world.names[0], "--boxes",
                 "selective_search", "--explain", out, "--top-k", "2")
    query = report["queries"][0]
    assert query["kind"] == "image" and query["boxes"] > 1
    assert report["explain"]["sentence"] == query["results"][0]["sentence"]
    assert report["explain"]["image"] == str(images / world.names[0])
    meta = json.loads((images / CACHE_DIR / "images.json").read_text())
    assert meta["boxes"]["name"] == "selective_search"
    assert out.is_file()


def test_explain_lists_each_words_contribution(world: World, images: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A whole-sentence encoder: each word's contribution is the cosine score minus the score
    without it, here recomputed from the linear encoder's own arithmetic (s = W sum_i W_e w_i);
    a word outside the vocabulary is listed as such."""
    query = world.captions[3].rstrip(".") + " zebras"
    out = tmp_path / "words.png"
    report = run(capsys, "--model", world.linear_dir, "--images", images, "--query", query,
                 "--explain", out)
    explained = report["explain"]
    top = report["queries"][0]["results"][0]
    assert explained["image"] == str(images / top["image"]) and explained["picture"] == str(out)
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.width > 400
        colours = {c for _, c in picture.convert("RGB").getcolors(maxcolors=1 << 20)}
        assert RAISES in colours or LOWERS in colours  # the bars

    linear = ModelFolder.open(world.linear_dir)
    model, vocab = linear.load_model(), linear.vocab
    tokens = make_parser("spacy").parse([query])[0].tokens
    assert [w["word"] for w in explained["words"]] == tokens and tokens[-1] == "zebras"
    assert report["queries"][0]["words"] == sum(w in vocab.word_index for w in tokens)
    inputs = embedder.Embedder.from_folder(linear)
    image, _ = embedder.embed_images([images / top["image"]], inputs, skip_bad=False)
    x = F.normalize(owner_means(image.embeddings, image.owner, 1))[0]
    with torch.no_grad():
        word = {w: model.sentence.projection(model.sentence.word_vectors[vocab.word_index[w]])
                for w in tokens if w in vocab.word_index}
    s = sum(word[w] for w in tokens if w in word)
    assert float(F.cosine_similarity(x, s, dim=0)) == pytest.approx(top["score"], abs=1e-5)
    expected = [float(F.cosine_similarity(x, s, dim=0) - F.cosine_similarity(x, s - word[w],
                                                                              dim=0))
                if w in word else None for w in tokens]
    got = [w["contribution"] for w in explained["words"]]
    assert got[-1] is None and got == pytest.approx(expected, abs=1e-5)

    retrieve.main(["--model", str(world.linear_dir), "--images", str(images), "--query", query,
                   "--explain", str(out)])
    table = capsys.readouterr().out
    assert "zebras" in table and "(not in the vocabulary)" in table
    assert f"{tokens[0]:<20} {got[0]:12.4f}" in table


@pytest.mark.parametrize("encoder,score", [("lstm", "cosine"), ("dtrnn", "inner")])
def test_a_left_out_word_is_read_as_if_deleted(world: World, images: Path, tmp_path: Path,
                                               encoder: str, score: str) -> None:
    """Occlusion for a sequence and a tree encoder: the score without a word is the score of
    the parse with that word deleted (its children hung on its head)."""
    folder = world.save_model(tmp_path / encoder, seed=0, cfg=whole_sentence(world.cfg, encoder,
                                                                             score))
    inputs = embedder.Embedder.from_folder(ModelFolder.open(folder))
    image, _ = embedder.embed_images([images / world.names[0]], inputs, skip_bad=False)
    sentence = world.captions[7]
    picture, words = explain_words(images / world.names[0], image, sentence, inputs)
    caption = embedder.parse_captions([sentence], inputs)[0]
    tokens, tree = caption["tokens"], caption["tree"]

    def deleted(k: int) -> dict:
        heads = [tree["heads"][k] if h == k else h for h in tree["heads"]]
        keep = [i for i in range(len(tokens)) if i != k]
        return {**caption, "tokens": [tokens[i] for i in keep], "tree": {
            "heads": [heads[i] - (heads[i] > k) if heads[i] >= 0 else -1 for i in keep],
            "relations": [tree["relations"][i] for i in keep],
            "pos": [tree["pos"][i] for i in keep]}}

    variants = embedder.embed_captions([caption, *map(deleted, range(len(tokens)))], inputs)
    scores = rank(image, variants, inputs.cfg.objective.smooth, score)[0].tolist()
    assert [w["contribution"] for w in words] == pytest.approx(
        [scores[0] - scores[1 + k] if w in world.vocab.word_index else None
         for k, w in enumerate(tokens)], abs=1e-5)
    assert picture is not None and picture.width > 0


# ---------------------------------------------------------------- vector arithmetic


def test_minus_and_plus_rank_the_images_by_eq_15(world: World, images: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """unit(image) - unit(W e_minus) + unit(W e_plus), cosine with every unit image vector;
    the query image is ranked with the others and its rank reported."""
    minus, plus = [c for c in COLOURS if c in world.vocab.word_index][:2]
    query = images / world.names[1]
    argv = ["--model", world.linear_dir, "--images", images, "--query-image", query,
            "--minus", minus, "--plus", plus, "--top-k", str(NUM_VAL)]
    report = run(capsys, *argv)
    assert report["sentences"] == 0
    (result,) = report["queries"]
    assert result["kind"] == "arithmetic"
    assert result["query"] == f"{query} - {minus!r} + {plus!r}"
    assert (result["minus"], result["plus"], result["image"]) == ([minus], [plus], str(query))

    linear = ModelFolder.open(world.linear_dir)
    model, vocab, inputs = linear.load_model(), linear.vocab, embedder.Embedder.from_folder(linear)
    embedded, _ = embedder.embed_images([images / n for n in world.names], inputs,
                                        skip_bad=False)
    x = F.normalize(owner_means(embedded.embeddings, embedded.owner, NUM_VAL))
    with torch.no_grad():
        word = F.normalize(model.sentence.projection(
            model.sentence.word_vectors[[vocab.word_index[minus], vocab.word_index[plus]]]))
    vector = x[1] - word[0] + word[1]
    expected = dict(zip(world.names, (x @ vector / vector.norm()).tolist(), strict=True))
    got = {r["image"]: r["score"] for r in result["results"]}
    assert got == pytest.approx(expected, abs=1e-5)
    order = [r["image"] for r in result["results"]]
    assert result["query_image_rank"] == order.index(world.names[1]) + 1

    retrieve.main([str(a) for a in argv])
    assert f"the query image itself ranks {result['query_image_rank']} of {NUM_VAL}" in (
        capsys.readouterr().out)
    elsewhere = tmp_path / "query.png"
    shutil.copy2(query, elsewhere)
    retrieve.main([str(a) for a in argv[:4]] + ["--query-image", str(elsewhere), "--plus", plus])
    table = capsys.readouterr().out
    assert f"{elsewhere} + {plus!r} (1 boxes; eq. 15 cosine) -> images" in table
    assert "the query image is not among the --images" in table


# ---------------------------------------------------------------- errors


def test_errors_are_clear(world: World, images: Path, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str],
                          caplog: pytest.LogCaptureFixture) -> None:
    model = ["--model", str(world.model_dir)]
    with pytest.raises(SystemExit, match="nowhere: no such model folder"):
        retrieve.main(["--model", str(tmp_path / "nowhere"), "--images", str(images)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"empty: no \.jpg, \.jpeg, \.png, \.webp image in it"):
        retrieve.main([*model, "--images", str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match="--query ranks images: also pass --images"):
        retrieve.main([*model, "--sentences", str(world.sentences), "--query", "a dog"])
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    with pytest.raises(SystemExit, match="unusable image: .*broken.png is not an image file"):
        retrieve.main([*model, "--sentences", str(world.sentences), "--query-image",
                       str(tmp_path / "broken.png")])

    # An unreadable file in the folder is skipped with its name, also when cached; a sentence
    # with no known word scores 0 with everything.
    (images / "broken.png").write_bytes(b"not a picture")
    argv = [*model, "--images", images, "--query", "zebras quietly yawning", "--query",
            world.captions[0]]
    for _ in range(2):
        report = run(capsys, *argv)
        log = messages(caplog)
        assert "skipped an unusable image" in log and "broken.png is not an image file" in log
        assert report["images"] == NUM_VAL
    assert "'zebras quietly yawning' has no fragment the model knows" in log
    unknown = report["queries"][0]
    assert unknown["fragments"] == 0 and {r["score"] for r in unknown["results"]} == {0.0}
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "broken.png").write_bytes(b"not a picture")
    with pytest.raises(SystemExit, match="none of its 1 images is usable"):
        retrieve.main([*model, "--images", str(tmp_path / "only")])


def test_arithmetic_errors_are_clear(world: World, images: Path) -> None:
    query = ["--images", str(images), "--query-image", str(images / world.names[0])]
    linear = ["--model", str(world.linear_dir)]
    with pytest.raises(SystemExit, match="needs sentence vectors that are sums of word vectors, "
                                         "i.e. a model trained with model.sentence_encoder="
                                         "linear; this model's sentence encoder is fragments"):
        retrieve.main(["--model", str(world.model_dir), *query, "--minus", "red"])
    with pytest.raises(SystemExit, match="--plus 'crimson star': the word 'crimson' is not in "
                                         "the model's vocabulary"):
        retrieve.main([*linear, *query, "--plus", "crimson star"])
    with pytest.raises(SystemExit, match="--minus/--plus change a --query-image"):
        retrieve.main([*linear, "--images", str(images), "--minus", "red"])
    with pytest.raises(SystemExit, match="--explain draws a sentence against an image"):
        retrieve.main([*linear, *query, "--plus", "red", "--explain", "x.png"])
