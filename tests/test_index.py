"""trainer/search/index.py: a collection embedded once and searched in two stages. Built from an
image folder and from shards, it scores as the exact scan and the evaluation do; its first stage is
checked against a slow reference written from its definition (the mean rows' inner products);
a build resumes from its finished units and two processes build what one does; bad queries and
another model get one clear line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import trainer.search.index as index
import trainer.search.index_builder as index_builder
import trainer.search.retrieve as retrieve
from tests.test_certified_search import (
    answered,
    bounds_hold,
    definition_scores,
    every_key,
    first_round,
)
from tests.test_model_folders import count_hashes
from tests.test_retrieve import NUM_VAL, World, whole_sentence
from trainer.data.eval_set import load_eval_set
from trainer.evaluate import embed_eval_set
from trainer.objectives import score_matrix
from trainer.search.embedder import Embedder, RetrievalError, embed_images, embed_sentences
from trainer.search.fragment_set import rank
from trainer.store.model_folder import ModelFolder, save_ensemble


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("index"))


def build(*argv: str | Path) -> dict:
    index_builder.main([str(arg) for arg in argv])
    return json.loads(Path(argv[argv.index("--out") + 1], "index.json").read_text())


@pytest.fixture(scope="module")
def folder_index(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("built") / "index"
    build("--model", world.model_dir, "--images", world.images, "--sentences", world.sentences,
          "--out", out, "--workers", "1")
    return out


def exact_scores(world: World, model_dir: Path) -> torch.Tensor:
    """The exact scan the retrieval CLI does: every image against every caption [img, sent]."""
    embedder = Embedder.from_folder(ModelFolder.open(model_dir))
    images, _ = embed_images(sorted(world.images.iterdir()), embedder, skip_bad=False)
    sentences = embed_sentences(world.captions, embedder)
    objective = embedder.cfg.objective
    return rank(images, sentences, objective.smooth, objective.score)


def test_folder_index_ranks_like_the_exact_scan(world: World, folder_index: Path) -> None:
    searched = index.SearchIndex.open(folder_index)
    exact = exact_scores(world, world.model_dir)
    assert searched.image_names == world.names and searched.sentences == world.captions
    for q, text in enumerate(world.captions):
        hits = searched.images_for(text, k=NUM_VAL).hits
        order = torch.argsort(exact[:, q], descending=True, stable=True)
        assert [hit.position for hit in hits] == order.tolist()
        assert [hit.score for hit in hits] == pytest.approx(exact[order, q].tolist(), rel=1e-2)
    for k, name in enumerate(world.names):
        hits = searched.sentences_for_image(name, k=5).hits
        order = torch.argsort(exact[k], descending=True, stable=True)[:5]
        assert [hit.item for hit in hits] == [world.captions[i] for i in order]
    upload = searched.sentences_for_file(world.images / world.names[2], k=5).hits
    assert [hit.item for hit in upload] == [h.item for h in searched.sentences_for_image(
        world.names[2], k=5).hits]


def test_the_first_stage_bounds_every_pair_it_keeps_and_drops(world: World, folder_index: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """With 2 keys per query fragment of the 30 image fragments: each row's 2 best keys are
    among those the first stage returns, and its bounds hold by their definitions
    (`bounds_hold`: each returned pair's bound >= its own product v_i . s_j, each dropped key's
    product <= its row's `unseen`, the items' bounds >= their scores); the certified top 2 is
    the exact scan's. This initialised model's products (~1e-9) are below the bounds' rounding
    term, so a cut bound shows on trained and built rows (tests/test_certified_search.py)."""
    searched = index.SearchIndex.open(folder_index)
    searched.images.key_candidates = 2
    keys, smooth = every_key(searched.images), searched.embedder.cfg.objective.smooth
    exact = exact_scores(world, world.model_dir)
    for q, text in enumerate(world.captions):
        query = searched.query_rows(text)
        found, pair_keys = first_round(searched.images, query, 2, 1, monkeypatch)
        products = definition_scores(searched.images, keys, query, True, smooth)[0]
        dropped = np.where(answered(found, pair_keys, len(keys)), -np.inf, products)
        assert np.all(dropped.max(axis=1) <= np.sort(products, axis=1)[:, -2]), q
        bounds_hold(searched.images, keys, query, True, smooth, (2, 1), monkeypatch)
        order = torch.argsort(exact[:, q], descending=True, stable=True)[:2].tolist()
        ranking = searched.images_for(text, k=2)
        assert ranking.exact and [hit.position for hit in ranking.hits] == order


def test_a_whole_sentence_encoders_first_stage_is_its_score(world: World,
                                                           tmp_path: Path) -> None:
    """Cosine scores: the first stage's keys are the unit mean rows, whose inner products are the
    model's scores (up to the rows' fp16 storage)."""
    folder = world.save_model(tmp_path / "linear", seed=1, cfg=whole_sentence(world.cfg, "linear",
                                                                              "cosine"))
    meta = build("--model", folder, "--images", world.images, "--out", tmp_path / "index",
                 "--workers", "1")
    assert meta["score"] == "cosine" and meta["sentences"] == []
    searched = index.SearchIndex.open(tmp_path / "index")
    exact = exact_scores(world, folder)
    vectors = index.first_stage_keys(searched.images.select(range(NUM_VAL)), "cosine")[0]
    for q, text in enumerate(world.captions[:6]):
        query = index.first_stage_keys(searched.query_rows(text), "cosine")[0][0]
        assert (vectors @ query).tolist() == pytest.approx(exact[:, q].tolist(), abs=2e-4)
    with pytest.raises(RetrievalError, match="no sentences: rebuild it with --sentences"):
        searched.sentences_for_image(world.names[0])


def test_shard_index_matches_the_evaluation(world: World, tmp_path: Path) -> None:
    meta = build("--model", world.model_dir, "--shards", world.shards, "--split", "val",
                 "--out", tmp_path / "index", "--workers", "1")
    opened = ModelFolder.open(world.model_dir)
    cfg = opened.config
    embedded = embed_eval_set(opened.load_model(),
                              load_eval_set(cfg, opened.vocab, "val", rank=0, world_size=1))
    assert meta["sentences"] == embedded.captions
    assert meta["images"] == [f"{name}.png" for name in embedded.image_ids]
    assert meta["sentence_origins"] == [meta["images"][k] for k in embedded.sentence_image]
    scores = score_matrix(embedded.v, embedded.box_image, embedded.s, embedded.fragment_sentence,
                          embedded.num_images, embedded.num_sentences, cfg.objective.smooth)
    searched = index.SearchIndex.open(tmp_path / "index")
    everything = rank(searched.images.select(range(NUM_VAL)),
                      searched.sentence_set.select(range(len(meta["sentences"]))),
                      cfg.objective.smooth)
    assert torch.allclose(everything, scores, rtol=1e-2, atol=0)  # rows kept in fp16
    for name in meta["images"]:  # the image files, with their boxes in the files' pixels
        assert searched.image_file(name).read_bytes()[:4] == b"\x89PNG"
    assert searched.images.select([0]).detail.tolist() == [[0.0, 0.0, 64.0, 64.0]]


def test_a_build_resumes_from_its_finished_units(world: World, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(index_builder, "UNIT_FILES", 1)
    embed_unit = index_builder._embed_unit

    def dies_on_the_third(unit: index_builder.Unit) -> tuple[int, int]:
        if unit.number == 2:
            raise KeyboardInterrupt
        return embed_unit(unit)

    images = Path(shutil.copytree(world.images, tmp_path / "images"))
    argv = ["--model", world.model_dir, "--images", images, "--out", tmp_path / "index",
            "--workers", "1"]
    monkeypatch.setattr(index_builder, "_embed_unit", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        build(*argv)
    assert not (tmp_path / "index" / "index.json").exists()
    monkeypatch.setattr(index_builder, "_embed_unit", embed_unit)
    caplog.set_level(logging.INFO, logger="trainer.search.index_builder")
    os.utime(images / world.names[1], ns=(0, 0))  # changed since: its unit is embedded again
    resumed = build(*argv)
    assert "resuming: 1 of 4 units embedded already" in caplog.text
    assert not (tmp_path / "index" / "parts").exists()
    fresh = build(*argv[:-3], tmp_path / "fresh", "--workers", "1")
    assert resumed["images"] == fresh["images"]
    for name, tensor in load_file(tmp_path / "fresh" / "images.safetensors").items():
        assert torch.equal(load_file(tmp_path / "index" / "images.safetensors")[name], tensor)


@pytest.mark.slow
def test_two_processes_build_what_one_does(world: World, tmp_path: Path,
                                           folder_index: Path) -> None:
    """A process with a pool of two workers (a unit per image: four units) builds the index one
    process does, and its workers end cleanly (the resource tracker reports nothing leaked when
    the process exits)."""
    argv = ["--model", world.model_dir, "--images", world.images, "--sentences",
            world.sentences, "--out", tmp_path / "index", "--workers", "2"]
    code = ("import sys; import trainer.search.index_builder as builder; "
            "builder.UNIT_FILES = 1; builder.main(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
    for stem in ("images", "sentences"):  # the stored rows (not what is derived from them:
        # the first stage's basis of 4 images' keys has directions of no spread, any of many)
        one = load_file(folder_index / f"{stem}.safetensors")
        two = load_file(tmp_path / "index" / f"{stem}.safetensors")
        for name in ("start", "key_item", "detail"):
            assert torch.equal(one[name], two[name]), (stem, name)
        assert torch.allclose(one["rows"].float() * one["scale"][:, None],
                              two["rows"].float() * two["scale"][:, None], atol=1e-3), stem
    built = index.SearchIndex.open(tmp_path / "index")
    searched = index.SearchIndex.open(folder_index)
    for text in built.sentences:
        assert [h.position for h in built.images_for(text, 4).hits] == [
            h.position for h in searched.images_for(text, 4).hits], text


def test_bad_queries_and_another_model_get_one_clear_line(world: World, folder_index: Path,
                                                          capsys) -> None:
    searched = index.SearchIndex.open(folder_index)
    for query, message in (("   ", "the query is empty"), ("red " * 400, "at most 1000"),
                           ("qwerty zork", "no fragment the model knows")):
        with pytest.raises(RetrievalError, match=message):
            searched.images_for(query)
    with pytest.raises(RetrievalError, match="is not an image of this index"):
        searched.image_file("../model/weights.safetensors")
    with pytest.raises(index.IndexMismatch) as refused:
        index.SearchIndex.open(folder_index, model=world.linear_dir)
    own = ModelFolder.open(world.model_dir).checksums_key
    other = ModelFolder.open(world.linear_dir).checksums_key
    assert own[:16] in str(refused.value) and other[:16] in str(refused.value)
    with pytest.raises(SystemExit, match="--images .*nowhere: no such folder"):
        index_builder.main(["--model", str(world.model_dir), "--images",
                            str(world.images / "nowhere"), "--out", str(folder_index.parent / "x")])


def test_links_out_of_the_folder_are_skipped_unless_followed(world: World, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    """A link leading out of the photo folder is named and counted, not indexed (the web app
    would serve its target); a link inside is indexed. With --follow-links both are, and the
    index serves a followed link's file only while it still leads where it did."""
    photos, secret = tmp_path / "photos", tmp_path / "secret.png"
    photos.mkdir()
    first, second = world.names[:2]
    shutil.copy2(world.images / first, photos / first)
    shutil.copy2(world.images / second, secret)
    (photos / "inside.png").symlink_to(first)
    (photos / "outside.png").symlink_to(secret)
    argv = ["--model", world.model_dir, "--images", photos, "--workers", "1", "--out"]
    with caplog.at_level(logging.WARNING, logger="trainer.search.index_builder"):
        meta = build(*argv, tmp_path / "index")
    assert meta["images"] == ["inside.png", first]
    named = [r.getMessage() for r in caplog.records if "outside.png" in r.getMessage()]
    assert len(named) == 1 and "--follow-links" in named[0], named
    assert len(meta["problems"]) == 1 and "outside.png" in meta["problems"][0]

    followed = build(*argv, tmp_path / "followed", "--follow-links")
    assert (followed["images"], followed["problems"]) == (["inside.png", "outside.png", first], [])
    searched = index.SearchIndex.open(tmp_path / "followed")
    assert searched.image_file("outside.png").read_bytes() == secret.read_bytes()
    (photos / "outside.png").unlink()
    (photos / "outside.png").symlink_to(world.images / second)  # re-pointed since
    (photos / "inside.png").unlink()
    (photos / "inside.png").symlink_to(secret)  # now leads out
    (photos / first).unlink()  # gone
    for name in ("outside.png", "inside.png", first):
        with pytest.raises(RetrievalError, match=f"^image {name!r} is not available$"):
            searched.image_file(name)


def test_an_index_of_an_earlier_decoder_is_opened_with_a_warning(folder_index: Path,
                                                                tmp_path: Path, caplog) -> None:
    """Its stored embeddings came from other pixels than a new query's: say so, once."""
    with caplog.at_level(logging.WARNING, logger="trainer.search.index"):
        index.SearchIndex.open(folder_index)
    assert "earlier image decoder" not in caplog.text
    old = tmp_path / "old"
    shutil.copytree(folder_index, old)
    meta = json.loads((old / "index.json").read_text())
    del meta["decoder"]
    (old / "index.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="trainer.search.index"):
        index.SearchIndex.open(old)
    assert f"index {old} was built by an earlier image decoder (version 1" in caplog.text


def test_memory_map_reads_what_safetensors_wrote(folder_index: Path) -> None:
    mapped = index.memory_map(folder_index / "images.safetensors")
    for name, tensor in load_file(folder_index / "images.safetensors").items():
        assert np.array_equal(np.asarray(mapped[name]), tensor.numpy()), name


def test_read_ahead_asks_for_the_keys_then_the_rows_while_they_fit(
        folder_index: Path, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a server asks the kernel to read at its start (posix_fadvise WILLNEED, each call
    recorded) is the int8 keys of both sides, then their rows, byte for byte; only what fits
    in half the memory available; a file that cannot be read ahead is a warning."""
    searched = index.SearchIndex.open(folder_index)
    sides = (searched.images, searched.sentence_set)
    for side, stem in zip(sides, ("images", "sentences"), strict=True):
        stored = load_file(folder_index / f"{stem}.safetensors")
        for (path, offset, length), name in ((side.key_extent, "int8_codes"),
                                              (side.row_extent, "rows")):
            with path.open("rb") as stream:
                stream.seek(offset)
                assert stream.read(length) == stored[name].numpy().tobytes(), (stem, name)
    extents = [side.key_extent for side in sides] + [side.row_extent for side in sides]
    asked, advise = [], os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append((Path(os.readlink(f"/proc/self/fd/{fd}")), offset, length, advice))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    with caplog.at_level(logging.INFO, logger="trainer.search.index"):
        assert searched.read_ahead() == sum(length for _, _, length in extents)
    assert asked == [(*extent, os.POSIX_FADV_WILLNEED) for extent in extents]
    assert f"GiB of {folder_index} into the page cache" in caplog.text
    keys = sum(length for _, _, length in extents[:2])
    monkeypatch.setattr(index.psutil, "virtual_memory", lambda: type(
        "Memory", (), {"available": 2 * keys + 1})())  # room for the keys only
    asked.clear()
    assert searched.read_ahead() == keys
    assert asked == [(*extent, os.POSIX_FADV_WILLNEED) for extent in extents[:2]]
    gone = (folder_index / "replaced.safetensors", 0, 1)  # a file removed since: a warning
    empty = (extents[0][0], 0, 0)  # an empty array: no call (0 bytes would mean the whole file)
    asked.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.search.index"):
        assert index.prefetch([extents[0], gone, empty, extents[1]]) == keys
    assert "replaced.safetensors cannot be read ahead" in caplog.text
    assert asked == [(*extent, os.POSIX_FADV_WILLNEED) for extent in extents[:2]]


@pytest.mark.parametrize("sq8_from,kind", [(10**9, "IndexIVFFlat"),
                                            (1000, "IndexIVFScalarQuantizer")])
def test_an_ivf_first_stage_finds_the_flat_scans_keys(monkeypatch: pytest.MonkeyPatch,
                                                      sq8_from: int, kind: str) -> None:
    """Above IVF_FROM keys: IVF, with 8-bit codes above SQ8_FROM. Searching every list finds
    the flat scan's best keys of the projected space (up to the codes' rounding)."""
    monkeypatch.setattr(index, "IVF_FROM", 1000)
    monkeypatch.setattr(index, "SQ8_FROM", sq8_from)
    keys = torch.nn.functional.normalize(torch.randn(4000, 32), dim=1) + 0.2
    center, basis = index.fit_projection(keys, index.FIRST_STAGE_DIMS)
    first = index.build_first_stage(keys, center, basis)
    assert type(first).__name__ == kind and first.ntotal == 4000
    first.nprobe = first.nlist  # every list
    probes = index.project(keys[:5] + 0.1, center, basis, queries=True)
    flat = (keys @ (keys[:5] + 0.1).T).T.argsort(dim=1, descending=True)[:, :10]
    found = first.search(probes, 10)[1]
    shared = [len(set(f) & set(t.tolist())) / 10 for f, t in zip(found, flat, strict=True)]
    assert np.mean(shared) >= 0.9


def test_the_projection_keeps_inner_products() -> None:
    """[(k - c) B, 1] . [q B, q . c] = k . q when B spans the keys' directions."""
    keys = torch.randn(300, 16) + 3.0
    center, basis = index.fit_projection(keys, index.FIRST_STAGE_DIMS)
    queries = torch.randn(7, 16)
    projected = index.project(keys, center, basis, False) @ index.project(queries, center, basis,
                                                                           True).T
    assert np.allclose(projected, (keys @ queries.T).numpy(), atol=1e-3)


def test_the_retrieval_command_searches_an_index(world: World, folder_index: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    retrieve.main(["--model", str(world.model_dir), "--index", str(folder_index), "--query",
                   world.captions[6], "--query-image", str(world.images / world.names[1]),
                   "--explain", str(tmp_path / "why.png"), "--top-k", "3", "--json"])
    report = json.loads(capsys.readouterr().out)
    searched = index.SearchIndex.open(folder_index)
    by_text, by_image = report["queries"]
    assert [r["image"] for r in by_text["results"]] == [
        hit.item for hit in searched.images_for(world.captions[6], k=3).hits]
    assert [r["sentence"] for r in by_image["results"]] == [
        hit.item for hit in searched.sentences_for_image(world.names[1], k=3).hits]
    assert by_image["results"][0]["line"].startswith("sentences.txt:")
    assert report["explain"]["picture"] == str(tmp_path / "why.png")
    assert (tmp_path / "why.png").is_file() and report["explain"]["fragments"]
    assert [(q["exact"], q["gap"]) for q in report["queries"]] == [(True, 0.0)] * 2
    retrieve.main(["--model", str(world.model_dir), "--index", str(folder_index), "--query",
                   world.captions[6], "--top-k", "3", "--json", "--exact-scan"])
    scanned = json.loads(capsys.readouterr().out)["queries"][0]
    assert [r["image"] for r in scanned["results"]] == [r["image"] for r in by_text["results"]]
    assert (scanned["exact"], scanned["scored"]) == (True, NUM_VAL)


def test_an_ensemble_is_refused_naming_its_members(world: World, tmp_path: Path) -> None:
    ensemble = save_ensemble(tmp_path / "ensemble", [world.model_dir, world.linear_dir], [1, 1])
    with pytest.raises(SystemExit, match="is an ensemble; an index holds one model's fragments"):
        index_builder.main(["--model", str(ensemble), "--images", str(world.images), "--out",
                            str(tmp_path / "index")])


def test_opening_an_index_hashes_its_model_folder_once(world: World, folder_index: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = count_hashes(monkeypatch)
    index.SearchIndex.open(folder_index)
    assert sorted(hashed) == sorted(path.name for path in world.model_dir.iterdir())
