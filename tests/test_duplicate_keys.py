"""Keys that repeat across img2dataset downloads (each numbers its keys from 0): `featurize
webdataset` keeps every image under its own id `<input shard>-<key>`, also split over tasks;
`defrag index` and `defrag evaluate` given shards that hold one image_id twice (an older version's
or made by hand) name it and its shards instead of showing or scoring the wrong picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import webdataset as wds

import trainer.evaluate
import trainer.search.index_builder as index_builder
from defrag.vocab import Vocabulary
from featurizer.command import main as featurize
from featurizer.pipeline import Settings
from featurizer.pipeline import featurize as featurize_source
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate, write_img2dataset
from trainer.config import Config, DataConfig, ModelConfig
from trainer.data.shardset import training_featurizer
from trainer.model import DeFragModel
from trainer.store.model_folder import save_model_folder

FLAGS = ["--parser", "spacy", "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]


def test_two_downloads_keep_every_image_under_its_own_id(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    for seed, download in enumerate(("dl1", "dl2")):  # both write 00000.tar, keys 000000000...
        write_img2dataset(tmp_path / download, count=3, per_shard=3, seed=seed, image_size=64)
    inputs = f"{tmp_path}/dl1/00000.tar::{tmp_path}/dl2/00000.tar"
    out = tmp_path / "out"
    for task in ("0", "1"):  # a task of its own for each download: no task sees both
        assert featurize(["webdataset", "--shards", inputs, "--out", str(out), "--task", task,
                          "--tasks", "2", *FLAGS]) == 0
    assert featurize(["merge", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"]["count"] == 0 and manifest["splits"]["train"]["images"] == 6
    metas = [json.loads(sample["json"]) for shard in manifest["splits"]["train"]["shards"]
             for sample in wds.WebDataset(str(out / shard["file"]), shardshuffle=False)]
    assert sorted(meta["image_id"] for meta in metas) == [
        f"{download}__00000-00000000{i}" for download in ("dl1", "dl2") for i in range(3)]
    assert {meta["file"] for meta in metas} == {f"00000.tar/00000000{i}" for i in range(3)}
    capsys.readouterr()

    with pytest.raises(SystemExit, match=(
            rf"lists one input shard twice: {tmp_path}/dl1/00000.tar \(input 0\) and "
            rf"{tmp_path}/dl1/00000.tar \(input 2\); its images would be featurized twice")):
        featurize(["webdataset", "--shards", f"{inputs}::{tmp_path}/dl1/00000.tar", "--out",
                   str(tmp_path / "twice"), *FLAGS])


@pytest.fixture
def repeated_id(tmp_path: Path) -> tuple[Path, Path, str]:
    """A featurized val split of 4 shards of one image, the first two under one image_id (as
    an older version wrote two downloads), and an untrained tiny model of its vocabulary."""
    jsonl = generate(tmp_path / "source", num_train=2, num_val=4, seed=0, image_size=64)
    source = read_jsonl(jsonl, jsonl.parent, "train")
    val = sorted((r for r in source.records if r.split == "val"), key=lambda r: r.image_id)
    val[1].image_id = val[0].image_id
    shards = tmp_path / "shards"
    featurize_source(source, Settings(out=shards, parser="spacy", boxes="fullframe",
                                      shard_size=1, workers=1, min_word_count=1))
    vocab = Vocabulary.load(shards / "vocab.json")
    cfg = Config(model=ModelConfig(embed_dim=16, word_dim=8, pretrained=False, image_size=64),
                 data=DataConfig(shards=str(shards), val_split="val"))
    model = save_model_folder(tmp_path / "model", DeFragModel.from_config(cfg.model, vocab, seed=0),
                              cfg, vocab, featurizer=training_featurizer(cfg.data))
    return shards, model, val[0].image_id


def test_index_and_evaluate_name_an_image_id_held_twice(repeated_id: tuple[Path, Path, str],
                                                         tmp_path: Path):
    shards, model, image_id = repeated_id
    first, second = (shards / f"val/shard-00000{i}.tar" for i in range(2))
    out = tmp_path / "index"
    with pytest.raises(SystemExit, match=(
            rf"defrag index: error: 1 image name\(s\) belong to two samples: '{image_id}\.png' "
            rf"\({first} and {second}\): files/ keeps one picture per name")):
        index_builder.main(["--model", str(model), "--shards", str(shards), "--split", "val",
                            "--out", str(out), "--workers", "1"])
    assert not (out / "index.json").exists()
    with pytest.raises(SystemExit, match=(  # its two loader processes read one shard each
            rf"defrag evaluate: error: evaluated 3 of the 4 images .* \(1 data problems\): "
            rf"{second}: image_id '{image_id}' skipped: already read from {first}")):
        trainer.evaluate.main(["--model", str(model), "--shards", str(shards), "--split", "val",
                               "--workers", "2"])
