"""Shard format versions on the trainer's side: format 2 (captions with dependency trees) and
format 1 (tokens and triplets only) are both read, anything else is refused in one line; an
encoder that needs trees refuses format 1 through `require_trees`, naming the folder."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import webdataset as wds

from defrag.shard_format import FORMAT_VERSION, READABLE_FORMATS, TREE_FORMAT
from defrag.urls import ShardError
from defrag.vocab import Vocabulary
from trainer.config import Config
from trainer.data.eval_set import load_eval_set
from trainer.data.shardset import locate_split, read_manifest, require_trees

ENCODER = "the sdtrnn sentence encoder"


def test_this_code_reads_what_its_featurizer_writes() -> None:
    assert FORMAT_VERSION in READABLE_FORMATS and FORMAT_VERSION >= TREE_FORMAT
    assert READABLE_FORMATS == (1, 2)


@pytest.mark.parametrize("found", [1, 2])
def test_formats_1_and_2_are_read(tmp_path: Path, found: int) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"format": found, "splits": {}}))
    assert read_manifest(str(path))["format"] == found


@pytest.mark.parametrize("manifest", [{"format": 3}, {"format": 0}, {"format": "2"},
                                      {"format": 1.0}, {"format": True}, {}, [1, 2]])
def test_other_formats_are_refused_in_one_line(tmp_path: Path, manifest: object) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as error:
        read_manifest(str(path))
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    assert "this code reads formats 1 and 2" in message and "re-run" in message


def test_require_trees_refuses_format_1_naming_the_folder() -> None:
    require_trees(2, "data/f8k", ENCODER)
    with pytest.raises(ShardError) as error:
        require_trees(1, "data/f8k", ENCODER)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{ENCODER} needs the captions' dependency trees")
    assert "data/f8k holds format 1 shards" in message
    assert "re-run the featurizer command of its manifest (created_by) with the same --out" \
        in message


def format_1_copy(shards: Path, out: Path) -> Path:
    """`shards` as the featurizer wrote it before trees: captions without "tree", format 1
    in the manifest and the sidecars, the manifest's sha256s updated."""
    shutil.copytree(shards, out, ignore=shutil.ignore_patterns("source"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format"] = 1
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            tar = out / entry["file"]
            samples = list(wds.tarfile_samples([{"url": str(tar)}]))
            with tar.open("wb") as stream:
                writer = wds.TarWriter(stream, encoder=False, mtime=0)
                for sample in samples:
                    meta = json.loads(sample["json"])
                    for caption in meta["captions"]:
                        del caption["tree"]
                    writer.write({**sample, "json": json.dumps(meta).encode()})
                writer.close()
            entry["sha256"] = hashlib.sha256(tar.read_bytes()).hexdigest()
            entry["bytes"] = tar.stat().st_size
            sidecar = tar.with_suffix(".json")
            sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "format": 1,
                                           "sha256": entry["sha256"], "bytes": entry["bytes"]}))
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_format_1_shards_read_as_before_and_are_refused_for_trees(shards: Path,
                                                                  tmp_path: Path) -> None:
    """The fragment encoder's input from format-1 shards equals that from format-2 shards of
    the same images; `SplitShards.require_trees` refuses only the format-1 set."""
    old = format_1_copy(shards, tmp_path / "old")
    assert all("tree" in json.loads(s["json"])["captions"][0]
               for s in wds.tarfile_samples([{"url": str(shards / "val/shard-000000.tar")}]))
    new_split, old_split = locate_split(str(shards), "val"), locate_split(str(old), "val")
    assert (new_split.format, old_split.format) == (FORMAT_VERSION, 1)
    new_split.require_trees(ENCODER)
    with pytest.raises(ShardError, match=f"{old} holds format 1 shards: re-run the featurizer"):
        old_split.require_trees(ENCODER)

    vocab = Vocabulary.load(shards / "vocab.json")
    read = []
    for folder in (shards, old):
        cfg = Config.from_dict({"data": {"shards": str(folder), "workers": 0,
                                         "verify_shards": "all"},
                                "model": {"image_size": 64}})
        eval_set = load_eval_set(cfg, vocab, "val")
        read.append([(b.image_ids, b.captions, b.fragments, b.fragment_sentence)
                     for b in eval_set.batches(4)])
        assert eval_set.problems == [] and eval_set.images_read == old_split.images
    assert len(read[0]) == len(read[1]) > 1
    for new_batch, old_batch in zip(*read, strict=True):
        assert new_batch[:2] == old_batch[:2]
        assert all(torch.equal(a, b) for a, b in zip(new_batch[2:], old_batch[2:], strict=True))
    assert sum(len(b[2]) for b in read[0]) > 0


@pytest.mark.parametrize("encoder", ["dtrnn", "sdtrnn"])
def test_tree_encoders_read_trees_from_format_2_and_refuse_format_1(shards: Path, tmp_path: Path,
                                                                    encoder: str) -> None:
    """The eval set of a tree encoder collates `word_head`/`word_relation` from format-2 shards
    (one root per caption at least, heads inside their own caption) and refuses format-1 shards
    in one line naming the encoder and the folder; the lstm reads format 1 without trees."""
    old = format_1_copy(shards, tmp_path / "old")
    vocab = Vocabulary.load(shards / "vocab.json")

    def config(folder: Path, name: str) -> Config:
        return Config.from_dict({"data": {"shards": str(folder), "workers": 0},
                                 "model": {"image_size": 64, "sentence_encoder": name},
                                 "objective": {"use_fragment": False, "score": "inner"}})

    batch = next(load_eval_set(config(shards, encoder), vocab, "val").batches(4))
    assert batch.word_head is not None and batch.word_relation is not None
    assert len(batch.word_head) == len(batch.word_relation) == len(batch.words) > 0
    roots = batch.word_head < 0
    assert set(batch.word_sentence[roots].tolist()) == set(batch.word_sentence.tolist())
    heads = batch.word_head[~roots]
    assert torch.equal(batch.word_sentence[heads], batch.word_sentence[~roots])
    assert int(batch.word_relation.max()) <= vocab.other_relation
    with pytest.raises(ShardError, match=f"the {encoder} sentence encoder needs .* {old} holds "
                                         f"format 1 shards"):
        load_eval_set(config(old, encoder), vocab, "val")
    lstm = next(load_eval_set(config(old, "lstm"), vocab, "val").batches(4))
    assert lstm.word_head is None and len(lstm.words) > 0
