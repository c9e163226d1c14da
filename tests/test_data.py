"""The shard reader, training loader and eval set on real featurizer shards of the synthetic
dataset: batch contents, fragment modes, exact and resampled epochs over ranks and loader
processes, seeded order, eval sets and bad input."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import webdataset as wds
from PIL import Image

from defrag.urls import ShardError
from defrag.vocab import Vocabulary
from trainer.batch import Batch, batches_on_device
from trainer.config import Config
from trainer.data.eval_set import load_eval_set
from trainer.data.reader import image_key
from trainer.data.shardset import locate_split
from trainer.data.train_loader import MIRROR, TrainLoader, make_train_loader
from trainer.evaluate import retrieval_metrics
from trainer.objectives import score_matrix
from trainer.training.distributed import end_process

SIZE = 64  # model.image_size in these tests; the synthetic images are 128 x 128


@pytest.fixture(scope="session")
def vocab(shards: Path) -> Vocabulary:
    return Vocabulary.load(shards / "vocab.json")


@pytest.fixture(scope="session")
def metadata(shards: Path) -> dict[str, dict]:
    """image id -> the JSON of its sample, read straight from the tars (both splits)."""
    urls = [str(path) for path in sorted(shards.glob("*/shard-*.tar"))]
    return {meta["image_id"]: meta for meta in
            (json.loads(s["json"]) for s in wds.tarfile_samples([{"url": u} for u in urls]))}


def make_config(shards: Path, data: dict | None = None, model: dict | None = None) -> Config:
    return Config.from_dict({"data": {"shards": str(shards), "workers": 0, **(data or {})},
                             "model": {"image_size": SIZE, **(model or {})}})


def split_pairs(metadata: dict[str, dict], split: str) -> Counter:
    return Counter((meta["image_id"], c["text"]) for meta in metadata.values()
                   if meta["split"] == split for c in meta["captions"])


def batch_pairs(batch: Batch) -> list[tuple[str, str]]:
    return [(batch.image_ids[row], text)
            for row, text in zip(batch.sentence_image.tolist(), batch.captions, strict=True)]


def epoch_pairs(cfg: Config, vocab: Vocabulary, batch_size: int, world_size: int,
                epoch: int = 0) -> list[list[tuple[str, str]]]:
    """The pairs every rank sees in `epoch`, in order, checking every batch is full."""
    seen = []
    for rank in range(world_size):
        loader, steps = make_train_loader(cfg, vocab, rank, world_size, epoch, batch_size)
        batches = list(loader)
        assert len(batches) == steps
        assert all(len(b.captions) == batch_size for b in batches)
        seen.append([pair for b in batches for pair in batch_pairs(b)])
    return seen


def rewrite_shard(path: Path, change) -> None:
    """Rewrite a shard with `change(sample)` applied to each of its samples."""
    samples = list(wds.tarfile_samples([{"url": str(path)}]))
    with path.open("wb") as stream:
        writer = wds.TarWriter(stream, encoder=False)
        for sample in samples:
            writer.write({k: v for k, v in change(sample).items() if k != "__url__"})
        writer.close()


def test_batches_hold_deduplicated_images_boxes_and_fragments(
        shards: Path, vocab: Vocabulary, metadata: dict[str, dict]) -> None:
    cfg = make_config(shards, {"max_boxes": 3})
    loader, steps = make_train_loader(cfg, vocab, batch_size=12)
    assert steps == 200 // 12 == len(loader)
    keys: dict[str, int] = {}
    for collated in loader:
        assert collated.images.dtype == torch.uint8  # until .to(device)
        batch = collated.to("cpu")
        n_img, n_pairs = len(batch.image_ids), len(batch.captions)
        assert batch.images.dtype == torch.float32 and batch.images.shape == (n_img, 3, SIZE, SIZE)
        assert batch.images.min() >= 0 and batch.images.max() <= 1
        assert len(set(batch.image_ids)) == n_img  # each image once
        assert sorted(set(batch.sentence_image.tolist())) == list(range(n_img))
        for row, image_id in enumerate(batch.image_ids):
            meta = metadata[image_id]
            source = Image.open(shards / "source" / meta["file"]).convert("RGB")
            expected = np.array(source.resize((SIZE, SIZE), Image.Resampling.BILINEAR))
            assert torch.equal((batch.images[row] * 255).round().byte(),
                               torch.from_numpy(expected).permute(2, 0, 1))
            boxes = batch.boxes[batch.box_image == row]
            scaled = torch.tensor(meta["boxes"][:3]) * SIZE / 128  # 128 x 128 -> SIZE x SIZE
            assert torch.allclose(boxes, scaled)
            assert boxes[0].tolist() == [0, 0, SIZE, SIZE]
        assert torch.equal(batch.box_image, batch.box_image.sort().values)
        assert ((batch.boxes >= 0) & (batch.boxes <= SIZE)).all()
        for pair, (image_id, text) in enumerate(batch_pairs(batch)):
            caption = next(c for c in metadata[image_id]["captions"] if c["text"] == text)
            assert torch.equal(batch.fragments[batch.fragment_sentence == pair],
                               vocab.encode(caption))
            assert batch.image_key[pair] == keys.setdefault(image_id, image_key(image_id))
        assert batch.fragment_sentence.max() < n_pairs
    assert len(set(keys.values())) == len(keys)  # distinct images, distinct keys


@pytest.mark.parametrize("mode", ["bow", "bigram"])
def test_fragment_modes(shards: Path, vocab: Vocabulary, metadata: dict[str, dict],
                        mode: str) -> None:
    loader, _ = make_train_loader(make_config(shards, model={"fragment_mode": mode}), vocab,
                                  batch_size=20)
    batch = next(iter(loader))
    for pair, (image_id, text) in enumerate(batch_pairs(batch)):
        caption = next(c for c in metadata[image_id]["captions"] if c["text"] == text)
        expected = vocab.encode(caption, mode)
        assert torch.equal(batch.fragments[batch.fragment_sentence == pair], expected)
        if mode == "bow":
            assert len(expected) == sum(w in vocab.word_index for w in caption["tokens"])
    assert (batch.fragments[:, 0] == 0).all()  # BoW and bigrams share one relation


def test_fullframe_only_keeps_the_whole_image_box(shards: Path, vocab: Vocabulary) -> None:
    cfg = make_config(shards, model={"fullframe_only": True})
    batch = next(iter(make_train_loader(cfg, vocab, batch_size=20)[0]))
    assert torch.equal(batch.box_image, torch.arange(len(batch.image_ids)))
    assert (batch.boxes == torch.tensor([0.0, 0.0, SIZE, SIZE])).all()


@pytest.mark.parametrize(("world_size", "workers"), [(1, 2), (2, 2), (2, 0)])
def test_exact_epoch_sees_every_pair_once(shards: Path, vocab: Vocabulary,
                                          metadata: dict[str, dict], world_size: int,
                                          workers: int) -> None:
    cfg = make_config(shards, {"workers": workers})
    seen = epoch_pairs(cfg, vocab, batch_size=10, world_size=world_size)
    assert [len(rank) for rank in seen] == [200 // world_size] * world_size
    assert Counter(pair for rank in seen for pair in rank) == split_pairs(metadata, "train")


def test_uneven_ranks_run_the_same_steps(shards: Path, vocab: Vocabulary,
                                         metadata: dict[str, dict]) -> None:
    """8 shards over 3 ranks: 3, 3 and 2 shards (75, 75, 50 pairs) for 200 // 30 = 6 steps."""
    seen = epoch_pairs(make_config(shards, {"workers": 1}), vocab, batch_size=10, world_size=3)
    assert [len(rank) for rank in seen] == [60, 60, 60]
    counts = [Counter(rank) for rank in seen]
    assert max(counts[0].values()) == max(counts[1].values()) == 1  # at most once
    assert len(counts[2]) == 50 and counts[2].total() == 60  # all 50, 10 again (2nd pass)
    assert not (counts[0].keys() & counts[1].keys() or counts[2].keys() & counts[0].keys()
                or counts[2].keys() & counts[1].keys())
    assert set().union(*counts) <= set(split_pairs(metadata, "train"))


def test_too_few_shards_is_a_clear_error(shards: Path, vocab: Vocabulary) -> None:
    cfg = make_config(shards, {"workers": 5})
    with pytest.raises(ValueError, match=r"8 shards.*2 rank\(s\) x 5 data.workers = 10.*"
                                         r"--shard-size 4"):
        make_train_loader(cfg, vocab, 0, 2, batch_size=10)
    resampled = make_config(shards, {"workers": 5, "resampled": True})
    assert make_train_loader(resampled, vocab, 0, 2, batch_size=10)[1] == 10


def test_resampled_epochs_have_the_requested_steps(shards: Path, vocab: Vocabulary) -> None:
    cfg = make_config(shards, {"workers": 2, "resampled": True, "epoch_pairs": 60})
    first, second = (epoch_pairs(cfg, vocab, batch_size=10, world_size=2, epoch=e)
                     for e in (0, 1))
    assert [len(rank) for rank in first] == [30, 30]  # 60 // (10 x 2) = 3 steps per rank
    assert first != second


def test_order_is_seeded_by_epoch(shards: Path, vocab: Vocabulary) -> None:
    cfg = make_config(shards, {"workers": 2})
    loader = TrainLoader(cfg, vocab, batch_size=10)
    orders = []
    for epoch in (0, 0, 1):
        loader.set_epoch(epoch)
        orders.append([pair for batch in loader for pair in batch_pairs(batch)])
    assert orders[0] == orders[1] and orders[0] != orders[2]
    assert Counter(orders[0]) == Counter(orders[2])  # same pairs, another order
    reseeded = TrainLoader(make_config(shards, {"workers": 2, "seed": 7}), vocab, batch_size=10)
    assert [pair for batch in reseeded for pair in batch_pairs(batch)] != orders[0]


def eval_batches(cfg: Config, vocab: Vocabulary, split: str | None = None,
                 max_images: int | None = None, size: int = 4) -> tuple[Batch, list]:
    """Every batch of an eval set collated into one (owners renumbered), and its problems."""
    eval_set = load_eval_set(cfg, vocab, split, max_images, rank=0, world_size=1)
    batches = list(eval_set.batches(size))
    assert all(len(b.image_ids) <= size for b in batches)
    first_image = np.cumsum([0] + [len(b.image_ids) for b in batches[:-1]])
    first_sentence = np.cumsum([0] + [len(b.captions) for b in batches[:-1]])
    whole = Batch(
        torch.cat([b.images for b in batches]), [d for b in batches for d in b.decoded],
        torch.cat([b.boxes for b in batches]),
        torch.cat([b.box_image + int(k) for b, k in zip(batches, first_image, strict=True)]),
        torch.cat([b.sentence_image + int(k) for b, k in zip(batches, first_image, strict=True)]),
        torch.cat([b.fragments for b in batches]),
        torch.cat([b.fragment_sentence + int(k)
                   for b, k in zip(batches, first_sentence, strict=True)]),
        torch.cat([b.image_key for b in batches]),
        [i for b in batches for i in b.image_ids], [c for b in batches for c in b.captions],
        torch.cat([b.words for b in batches]),
        torch.cat([b.word_sentence + int(k)
                   for b, k in zip(batches, first_sentence, strict=True)]))
    return whole, eval_set.problems


def test_eval_set_has_every_image_once_with_all_its_captions(
        shards: Path, vocab: Vocabulary, metadata: dict[str, dict]) -> None:
    cfg = make_config(shards, {"max_boxes": 2})
    whole, problems = eval_batches(cfg, vocab)
    val = sorted(m["image_id"] for m in metadata.values() if m["split"] == "val")
    assert whole.image_ids == val and not problems  # shard order = image id order
    assert (len(whole.image_ids), len(whole.captions)) == (10, 50)
    assert whole.images.dtype == torch.uint8 and whole.images.shape == (10, 3, SIZE, SIZE)
    expected = [c for image_id in val for c in metadata[image_id]["captions"]]
    assert whole.captions == [c["text"] for c in expected]
    assert whole.sentence_image.tolist() == [row for row in range(10) for _ in range(5)]
    for sentence, caption in enumerate(expected):
        assert torch.equal(whole.fragments[whole.fragment_sentence == sentence],
                           vocab.encode(caption))
        assert whole.words[whole.word_sentence == sentence].tolist() == [
            vocab.words.index(w) for w in caption["tokens"] if w in vocab.words]
    assert torch.bincount(whole.box_image).tolist() == [
        min(2, len(metadata[i]["boxes"])) for i in val]
    two_workers, _ = eval_batches(make_config(shards, {"max_boxes": 2, "workers": 2}), vocab)
    assert sorted(two_workers.image_ids) == val  # another order, the same images
    small, _ = eval_batches(cfg, vocab, split="train", max_images=3)
    assert (len(small.image_ids), len(small.captions)) == (3, 15)
    # The owners are what trainer.evaluate takes: image fragments by image, sentence fragments
    # by sentence.
    v = torch.randn(len(whole.boxes), 8)
    s = torch.randn(len(whole.fragments), 8)
    scores = score_matrix(v, whole.box_image, s, whole.fragment_sentence, 10, 50)
    assert scores.shape == (10, 50)
    assert 0 <= retrieval_metrics(scores, whole.sentence_image)["rsum"] <= 600


def test_an_undecodable_image_is_skipped_with_a_warning(
        shards: Path, vocab: Vocabulary, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("source"))
    bad_key = "images__train_00002_png"

    def corrupt(sample: dict) -> dict:
        if sample["__key__"] == bad_key:
            sample["png"] = sample["png"][: len(sample["png"]) // 2]
        return sample

    shard = copy / "train/shard-000000.tar"
    rewrite_shard(shard, corrupt)
    rewrite_shard(copy / "val/shard-000000.tar", lambda s: {**s, "png": b"not an image"})
    cfg = make_config(copy, {"verify_shards": "none"})  # damage that keeps the tar readable
    loader, steps = make_train_loader(cfg, vocab, batch_size=10)
    with caplog.at_level(logging.WARNING, logger="trainer.data.reader"):
        seen = Counter(pair for batch in loader for pair in batch_pairs(batch))
    assert seen.total() == steps * 10 == 200
    assert len(seen) == 195 and all(image_id != bad_key for image_id, _ in seen)
    (skipped,) = loader.problems
    assert str(shard) in skipped and bad_key in skipped and "cannot decode" in skipped
    assert any(str(shard) in r.getMessage() and bad_key in r.getMessage() for r in caplog.records)
    whole, problems = eval_batches(cfg, vocab)
    assert len(whole.image_ids) == 5 and len(problems) == 5


def test_bad_metadata_is_skipped_with_its_key(
        shards: Path, vocab: Vocabulary, tmp_path: Path) -> None:
    """Metadata without boxes, or giving another image size than the image's, is named and
    left out (the size before any image is decoded: the boxes would be scaled wrongly)."""
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("source"))
    no_boxes, wrong_size = "images__train_00001_png", "images__train_00003_png"

    def damage(sample: dict) -> dict:
        meta = json.loads(sample["json"])
        if sample["__key__"] == no_boxes:
            del meta["boxes"]
        if sample["__key__"] == wrong_size:
            meta["width"] += 10
        return {**sample, "json": json.dumps(meta).encode()}

    shard = copy / "train/shard-000000.tar"
    rewrite_shard(shard, damage)
    cfg = make_config(copy, {"verify_shards": "none"})  # damage that keeps the tar readable
    loader, steps = make_train_loader(cfg, vocab, batch_size=10)
    metadata_error = f"{shard} sample {no_boxes!r}: unusable metadata (KeyError: 'boxes')"
    seen = Counter(pair for batch in loader for pair in batch_pairs(batch))
    assert seen.total() == steps * 10
    assert {image_id for image_id, _ in seen}.isdisjoint({no_boxes, wrong_size})
    assert metadata_error in loader.problems and len(loader.problems) == 2
    (size_error,) = set(loader.problems) - {metadata_error}
    assert wrong_size in size_error and "its metadata (and boxes) say 138 x 128" in size_error


def test_missing_shards_and_splits_are_named(shards: Path, vocab: Vocabulary,
                                             tmp_path: Path) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("source"))
    (copy / "val/shard-000001.tar").unlink()
    with pytest.raises(ShardError, match="1 of the 2 shards of split 'val' are missing"):
        load_eval_set(make_config(copy), vocab)
    with pytest.raises(ValueError, match=r"split 'dev' is not in .* \['train', 'val'\]"):
        locate_split(str(copy), "dev")
    with pytest.raises(ShardError, match="manifest.json"):
        locate_split(str(tmp_path), "train")


def test_rank_comes_from_torchrun_environment(shards: Path, vocab: Vocabulary,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = make_config(shards)
    cfg.optim.batch_size = 40  # global: 20 pairs per rank
    loader = TrainLoader(cfg, vocab)
    assert (loader.rank, loader.world_size, loader.batch_size) == (1, 2, 20)
    assert loader.steps_per_epoch == 200 // 40


def _rank_main(rank: int, shards: str, vocab_file: str, out: str) -> None:
    """One gloo rank: a loader that takes rank and world size from the process group."""
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank,
                            world_size=2)
    cfg = make_config(Path(shards), {"workers": 2})
    loader, steps = make_train_loader(cfg, Vocabulary.load(vocab_file), batch_size=10)
    pairs = []
    for batch in loader:
        dist.barrier()  # a rank with fewer batches would hang here
        pairs += batch_pairs(batch)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "pairs": pairs}))
    end_process(0)  # destroys the group; gloo may abort at interpreter exit otherwise


@pytest.mark.slow
def test_ranks_of_a_process_group_split_the_shards(shards: Path, metadata: dict[str, dict],
                                                   tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(str(shards), str(shards / "vocab.json"), str(tmp_path)),
             nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["steps"] for r in results] == [10, 10]
    seen = Counter(tuple(pair) for r in results for pair in r["pairs"])
    assert seen == split_pairs(metadata, "train")


@pytest.mark.parametrize("workers", [0, 2])
def test_cached_feature_epochs_skip_image_decoding(shards: Path, vocab: Vocabulary,
                                                   metadata: dict[str, dict],
                                                   workers: int) -> None:
    """Images named in skip_pixels are not decoded: the same batches (pairs, boxes, fragments),
    those images marked undecoded with zero pixels, and no images at all in a batch of them."""
    cfg = make_config(shards, {"max_boxes": 3, "workers": workers})
    loader, _ = make_train_loader(cfg, vocab, batch_size=12)
    decoded = list(loader)
    train_ids = {m["image_id"] for m in metadata.values() if m["split"] == "train"}
    some = set(sorted(train_ids)[::2])
    for skip in (train_ids, some):
        loader.set_epoch(0, skip_pixels=frozenset(skip))
        for full, bare in zip(decoded, list(loader), strict=True):
            assert batch_pairs(full) == batch_pairs(bare)
            for name in ("boxes", "box_image", "fragments", "fragment_sentence", "image_key"):
                assert torch.equal(getattr(full, name), getattr(bare, name)), name
            assert bare.decoded == [image_id not in skip for image_id in bare.image_ids]
            assert full.decoded == [True] * len(full.image_ids)
            if not any(bare.decoded):  # always so when every image is skipped
                assert bare.images is None
                continue
            for row, image_id in enumerate(bare.image_ids):
                if image_id in skip:
                    assert not bare.images[row].any()
                else:
                    assert torch.equal(bare.images[row], full.images[row])


def test_hflip_shows_each_image_or_its_mirror_under_its_own_id(
        shards: Path, vocab: Vocabulary) -> None:
    """data.hflip: per pass, about half the images come mirrored (pixels and boxes flipped left
    to right, id + MIRROR), the same ones whatever the worker count, the pairs unchanged."""
    plain = list(make_train_loader(make_config(shards, {"max_boxes": 3, "workers": 2}), vocab,
                                   batch_size=12)[0])
    views = {workers: list(make_train_loader(
        make_config(shards, {"max_boxes": 3, "hflip": True, "workers": workers}), vocab,
        batch_size=12)[0]) for workers in (0, 2)}
    assert ({i for b in views[0] for i in b.image_ids}
            == {i for b in views[2] for i in b.image_ids})  # other orders, the same views
    mirrors = 0
    for full, view in zip(plain, views[2], strict=True):
        assert batch_pairs(full) == [(i.removesuffix(MIRROR), c) for i, c in batch_pairs(view)]
        assert torch.equal(full.image_key, view.image_key)
        for row, image_id in enumerate(view.image_ids):
            boxes, flipped = full.boxes[full.box_image == row], view.boxes[view.box_image == row]
            if image_id == full.image_ids[row]:
                assert torch.equal(view.images[row], full.images[row])
                assert torch.equal(flipped, boxes)
                continue
            mirrors += 1
            size = full.images.shape[-1]
            assert image_id == full.image_ids[row] + MIRROR
            assert torch.equal(view.images[row], full.images[row].flip(-1))
            assert torch.equal(flipped[:, [1, 3]], boxes[:, [1, 3]])
            torch.testing.assert_close(flipped[:, [0, 2]], size - boxes[:, [2, 0]])
    images = sum(len(b.image_ids) for b in plain)
    assert 0.25 * images < mirrors < 0.75 * images


def test_a_resumed_epoch_skips_its_first_batches_in_the_same_order(
        shards: Path, vocab: Vocabulary) -> None:
    loader = TrainLoader(make_config(shards, {"workers": 1}), vocab, batch_size=12)
    whole, resumed = list(loader), list(loader.batches(skip=5))
    assert len(resumed) == len(whole) - 5 == 11
    assert [batch_pairs(b) for b in resumed] == [batch_pairs(b) for b in whole[5:]]


@pytest.mark.parametrize("prefetch", [False, True])
def test_batches_on_device_keep_the_order_and_stop_the_loader(
        shards: Path, vocab: Vocabulary, prefetch: bool) -> None:
    """The prefetching path (a thread collates the next batch; CUDA pins it too) runs on CPU
    here: same batches, float images, and leaving early stops the loader processes."""
    loader = TrainLoader(make_config(shards, {"workers": 2}), vocab, batch_size=12)
    expected = list(loader)
    moved = list(batches_on_device(loader.batches(), torch.device("cpu"), prefetch))
    assert [batch_pairs(b) for b in moved] == [batch_pairs(b) for b in expected]
    for got, want in zip(moved, expected, strict=True):
        assert got.images.dtype == torch.float32
        assert torch.equal(got.images, want.images.float() / 255)
    early = batches_on_device(loader.batches(), torch.device("cpu"), prefetch)
    next(early)
    assert mp.active_children()  # the loader processes of the epoch
    early.close()
    assert mp.active_children() == []
