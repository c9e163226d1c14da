"""`defrag index` split across tasks (defrag/tasks.py): each task embeds its share of the units
into INDEX/parts/ and `--merge` writes the index, the same bytes as a one-process build; a
merge with a task missing names it, and a task never removes parts it did not write. Real
engines: a SLURM job array (launch/slurm/index.sbatch, on the real slurmctld of
tests/test_slurm.py) and torchrun's ranks."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.search.index_builder as index_builder
from defrag.tasks import Task, task_from
from defrag.urls import MASK
from defrag.vocab import Vocabulary
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from tests.servers import serve_folder
from tests.test_arithmetic import one_thread
from tests.test_secrets import SECRET, USER, files_holding, signed
from tests.test_slurm import ENDED, ROOT, job_field, jobs, wait_for
from trainer.config import Config, DataConfig, ModelConfig
from trainer.data.shardset import training_featurizer
from trainer.model import DeFragModel
from trainer.search.embedder import embed_images, embed_sentences
from trainer.search.fragment_set import FragmentSet
from trainer.search.index import SearchIndex, load_one_model, memory_map
from trainer.store.model_folder import ModelFolder, save_model_folder

INDEX_FILES = ("index.json", "images.safetensors", "images.faiss", "sentences.safetensors",
               "sentences.faiss")


@dataclass
class Collection:
    """12 generated scenes (64 px): their folder and captions file, their val split as 4
    shards of 2 (4 units of work), and an untrained tiny fragments model."""

    model: Path
    images: Path
    sentences: Path
    shards: Path
    captions: list[str]


@pytest.fixture(scope="module")
def collection(tmp_path_factory: pytest.TempPathFactory) -> Collection:
    root = tmp_path_factory.mktemp("index-build")
    jsonl = generate(root / "source", num_train=4, num_val=8, seed=0, image_size=64)
    shards = root / "shards"
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=shards, parser="spacy", boxes="fullframe", shard_size=2, workers=1,
                       min_word_count=1))
    vocab = Vocabulary.load(shards / "vocab.json")
    cfg = Config(model=ModelConfig(embed_dim=16, word_dim=8, pretrained=False, image_size=64),
                 data=DataConfig(shards=str(shards), val_split="val"))
    model = save_model_folder(root / "model", DeFragModel.from_config(cfg.model, vocab, seed=0),
                              cfg, vocab, featurizer=training_featurizer(cfg.data))
    captions = [c for line in jsonl.read_text().splitlines() for c in json.loads(line)["captions"]]
    sentences = root / "sentences.txt"
    sentences.write_text("".join(f"{c}\n" for c in captions))
    return Collection(model, root / "source" / "images", sentences, shards, captions)


def index(*argv: str | Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """`defrag index ARGV` in this process; its summary line."""
    index_builder.main([str(arg) for arg in argv])
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def assert_same_index(built: Path, reference: Path) -> None:
    """The same bytes, but for where each index keeps the images of shards (its files/)."""
    for name in INDEX_FILES:
        ours, theirs = (folder.joinpath(name).read_bytes() for folder in (built, reference))
        if name == "index.json":
            ours, theirs = (text.replace(str(folder / "files").encode(), b"FILES")
                            for text, folder in ((ours, built), (theirs, reference)))
        assert ours == theirs, name
    files = sorted(path.name for path in (reference / "files").iterdir())
    assert sorted(path.name for path in (built / "files").iterdir()) == files
    for name in files:
        assert (built / "files" / name).read_bytes() == (reference / "files" / name).read_bytes()
    assert not (built / "parts").exists()


@pytest.fixture(scope="module")
def one_process(collection: Collection, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The val shards indexed by one process on one thread, as the engines' tasks embed
    (OMP_NUM_THREADS=1): the reference of their builds. Other threads, other float rounding."""
    out = tmp_path_factory.mktemp("one-process") / "index"
    with one_thread():
        index_builder.main(["--model", str(collection.model), "--shards", str(collection.shards),
                            "--split", "val", "--out", str(out), "--workers", "1"])
    return out


def test_tasks_then_a_merge_build_what_one_process_does(collection: Collection, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys) -> None:
    """12 images in units of 5: task 0 of 2 embeds units 0 and 2, task 1 unit 1; neither
    writes the index; the merge (given only --out) writes the one-process build's bytes."""
    monkeypatch.setattr(index_builder, "UNIT_FILES", 5)
    source = ["--model", collection.model, "--images", collection.images, "--sentences",
              collection.sentences, "--workers", "1", "--out"]
    whole = index(*source, tmp_path / "whole", capsys=capsys)
    assert whole["images"] == 12 and whole["sentences"] == len(collection.captions)
    split = tmp_path / "split"
    for task in (1, 0):
        summary = index(*source, split, "--task", task, "--tasks", 2, capsys=capsys)
        assert summary == {"index": str(split), "task": task, "tasks": 2,
                           "units": [2, 1][task], "embedded": [2, 1][task]}
        assert not (split / "index.json").exists()
    again = index(*source, split, "--task", 0, "--tasks", 2, capsys=capsys)
    assert again["embedded"] == 0  # a rerun resumes: its units are done
    assert index("--merge", "--out", split, capsys=capsys) == whole | {"index": str(split)}
    assert_same_index(split, tmp_path / "whole")
    holds_each_images_fragments(split, collection)


def holds_each_images_fragments(built: Path, collection: Collection) -> None:
    """Each image's rows in the index are its fragments embedded on their own (to fp16), so a
    merge that lost the units' offsets cannot match a build that lost them the same way."""
    names = json.loads((built / "index.json").read_text())["images"]
    stored = memory_map(built / "images.safetensors")
    embedder = load_one_model(ModelFolder.open(collection.model), None, None, None)
    for k, name in enumerate(names):
        alone, _ = embed_images([collection.images / name], embedder, skip_bad=False,
                                progress=False)
        holds(stored, k, alone, name)


def holds(stored: dict[str, np.ndarray], k: int, alone: FragmentSet, what: str) -> None:
    """Item k's stored rows (fp16 times their scale) and details are `alone`'s."""
    first, end = stored["start"][k], stored["start"][k + 1]
    rows = torch.from_numpy(stored["rows"][first:end].astype(np.float32)
                            * stored["scale"][first:end, None])
    assert rows.shape == alone.embeddings.shape, what
    if len(rows):  # fp16 keeps ~3 digits of a row's largest magnitude
        scale = float(alone.embeddings.abs().max())
        torch.testing.assert_close(rows, alone.embeddings, rtol=0, atol=1e-3 * scale, msg=what)
    assert np.array_equal(stored["detail"][first:end], alone.detail.numpy()), what


def test_a_shard_index_holds_each_captions_fragments(collection: Collection,
                                                     one_process: Path) -> None:
    """The captions of the shards' 4 units, merged: each one's rows and word ids are the
    caption embedded on its own."""
    texts = json.loads((one_process / "index.json").read_text())["sentences"]
    stored = memory_map(one_process / "sentences.safetensors")
    embedder = load_one_model(ModelFolder.open(collection.model), None, None, None)
    assert len(texts) == 8 * 5
    for k, text in enumerate(texts):
        holds(stored, k, embed_sentences([text], embedder), text)  # some have no rows
    assert len(stored["rows"]) > len(texts)  # most captions have several


def test_shards_at_a_url_with_credentials_leave_them_out_of_the_build_and_the_index(
        collection: Collection, tmp_path: Path, capsys) -> None:
    """A password in --shards and signed-URL tokens in --manifest: masked in each part and
    build.json (task 0 of 2 leaves them), in index.json and in what is printed."""
    out = tmp_path / "index"
    with serve_folder(collection.shards, basic_auth=f"{USER}:{SECRET}") as server:
        url = server.url.replace("//", f"//{USER}:{SECRET}@")
        source = ["--model", collection.model, "--shards", url, "--manifest",
                  f"{url}/manifest.json?{signed(SECRET)}", "--workers", "1", "--out", out]
        index(*source, "--task", 0, "--tasks", 2, capsys=capsys)
        build = json.loads((out / "parts" / "build.json").read_text())
        assert build["key"]["source"]["shards"] == url.replace(f":{SECRET}@", f":{MASK}@")
        assert files_holding(out) == []
        index(*source, "--task", 1, "--tasks", 2, capsys=capsys)
    assert index("--merge", "--out", out, capsys=capsys)["images"] == 8
    assert files_holding(out) == []
    assert SECRET not in "".join(capsys.readouterr())


def test_a_merge_with_a_task_missing_names_it(collection: Collection, tmp_path: Path,
                                              capsys) -> None:
    out = tmp_path / "index"
    with pytest.raises(SystemExit, match=rf"no task of a build has run in {out} \(no "
                                         "parts/build.json\\): run its tasks first"):
        index_builder.main(["--merge", "--out", str(out)])
    index("--model", collection.model, "--shards", collection.shards, "--split", "val",
          "--workers", "1", "--out", out, "--task", 0, "--tasks", 2, capsys=capsys)
    with pytest.raises(SystemExit) as failed:
        index_builder.main(["--merge", "--out", str(out)])
    assert str(failed.value) == (
        f"defrag index: error: {out}: 2 of 4 units are not embedded yet: units 1, 3 (task 1 of "
        "2): run those tasks again (each skips the units it finished), then the merge "
        "(--debug shows the traceback)")
    assert not (out / "index.json").exists() and len(list((out / "parts").glob("*.st"))) == 2
    with pytest.raises(SystemExit):
        index_builder.main(["--merge", "--out", str(out), "--model", str(collection.model)])
    assert capsys.readouterr().err.endswith(
        "error: --merge reads the build's settings from INDEX/parts/build.json: give it only "
        "--out\n")
    damaged_parts_are_named_and_embedded_again(collection, out, capsys)


def damaged_parts_are_named_and_embedded_again(collection: Collection, out: Path,
                                               capsys) -> None:
    """Parts lost, cut short or altered after their JSON (a value, or the header the merge sizes
    its arrays by): the merge names each file (an altered one by its sha256), and a rerun of
    its task embeds that unit again."""
    def task(number: int) -> dict:
        return index("--model", collection.model, "--shards", collection.shards, "--split",
                     "val", "--workers", "1", "--out", out, "--task", number, "--tasks", 2,
                     capsys=capsys)

    assert task(1)["embedded"] == 2
    parts = out / "parts"
    (parts / "000001.st").unlink()
    size = (parts / "000003.st").stat().st_size
    (parts / "000003.st").write_bytes((parts / "000003.st").read_bytes()[:100])
    altered = bytearray((parts / "000000.st").read_bytes())
    altered[-1] ^= 0xFF  # a value of its last tensor
    (parts / "000000.st").write_bytes(altered)
    with pytest.raises(SystemExit, match=(
            rf"2 of 4 units are not embedded yet: units 1, 3 \(task 1 of 2\); "
            rf"{parts}/000001.st is missing; {parts}/000003.st has 100 bytes, not the {size} "
            r"000003.json records: run those tasks again")):
        index_builder.main(["--merge", "--out", str(out)])
    assert task(1)["embedded"] == 2
    with pytest.raises(SystemExit, match=(
            rf"{parts}/000000.st is not what its unit wrote \(its sha256 is not the one "
            r"000000.json records\): run task 0 of 2 again")):
        index_builder.main(["--merge", "--out", str(out)])
    assert task(0)["embedded"] == 1
    written = (parts / "000002.st").read_bytes()  # its header sizes the merge's arrays:
    for damaged in (written[:9] + bytes([written[9] ^ 0xFF]) + written[10:],  # not JSON
                    written.replace(b'"shape":[2,', b'"shape":[9,', 1),  # JSON that lies
                    bytes([written[0], written[1], written[2] ^ 0x80]) + written[3:]):  # size
        assert damaged != written
        (parts / "000002.st").write_bytes(damaged)
        with pytest.raises(SystemExit, match=(
                rf"{parts}/000002.st is not what its unit wrote \(its sha256 is not the one "
                r"000002.json records\): run task 0 of 2 again")):
            index_builder.main(["--merge", "--out", str(out)])
    assert task(0)["embedded"] == 1
    assert index("--merge", "--out", out, capsys=capsys)["images"] == 8


def test_a_task_never_removes_the_parts_of_another_build(collection: Collection, tmp_path: Path,
                                                         capsys) -> None:
    """Another build's parts (here: of the shards, not the folder) may be another task's
    started at the same moment: a task refuses to start, a one-process build replaces them."""
    out = tmp_path / "index"
    index("--model", collection.model, "--shards", collection.shards, "--split", "val",
          "--workers", "1", "--out", out, "--task", 0, "--tasks", 2, capsys=capsys)
    before = sorted(path.name for path in (out / "parts").iterdir())
    folder = ["--model", str(collection.model), "--images", str(collection.images),
              "--workers", "1", "--out", str(out)]
    with pytest.raises(SystemExit, match=rf"{out / 'parts'} holds the parts of another build "
                                         r"\(model, boxes, parser or source\): remove it, or "
                                         "build into another --out"):
        index_builder.main([*folder, "--task", "1", "--tasks", "2"])
    assert sorted(path.name for path in (out / "parts").iterdir()) == before
    assert index(*folder, capsys=capsys)["images"] == 12  # one process: the whole build


def test_a_task_with_other_settings_is_refused(collection: Collection, tmp_path: Path,
                                               capsys) -> None:
    """Tasks of one build must agree on everything the merge reads from build.json: a task
    given another --tasks count is refused instead of rewriting the record."""
    out = tmp_path / "index"
    folder = ["--model", collection.model, "--images", collection.images, "--workers", "1",
              "--out", out]
    index(*folder, "--task", 0, "--tasks", 2, capsys=capsys)
    recorded = (out / "parts" / "build.json").read_text()
    with pytest.raises(SystemExit, match="build.json records other settings of this build"):
        index_builder.main([str(arg) for arg in folder] + ["--task", "1", "--tasks", "3"])
    assert (out / "parts" / "build.json").read_text() == recorded


def test_an_index_of_shards_records_their_boxes(collection: Collection, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture, capsys) -> None:
    """The rows of shards use the shards' boxes (here fullframe): index.json says so, query
    images get them too, and no warning about selective search (a model that does not know its
    training boxes would use it for new images); --boxes is refused with --shards. Shards of
    given boxes: a query image has none, it gets the model's choice."""
    cfg = Config(model=ModelConfig(embed_dim=16, word_dim=8, pretrained=False, image_size=64))
    vocab = Vocabulary.load(collection.shards / "vocab.json")
    model = save_model_folder(tmp_path / "model", DeFragModel.from_config(cfg.model, vocab, seed=0),
                              cfg, vocab)  # the tiny model, without its training featurizer
    caplog.set_level(logging.INFO)
    index("--model", model, "--shards", collection.shards, "--split", "val", "--workers", "1",
          "--out", tmp_path / "index", capsys=capsys)
    shards = json.loads((collection.shards / "manifest.json").read_text())["box_source"]
    assert json.loads((tmp_path / "index/index.json").read_text())["boxes"] == shards
    assert "selective_search" not in caplog.text
    assert SearchIndex.open(tmp_path / "index").embedder.boxes == shards
    meta = tmp_path / "index/index.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "boxes": {"name": "given"}}))
    assert SearchIndex.open(tmp_path / "index").embedder.boxes["name"] == "selective_search"
    with pytest.raises(SystemExit):
        index_builder.main(["--model", str(model), "--shards", str(collection.shards), "--boxes",
                            "detector", "--out", str(tmp_path / "other")])
    assert "--boxes and --detector-weights are for --images" in capsys.readouterr().err


@pytest.mark.parametrize("environ,expected", [
    ({}, Task(0, 1)),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "4"},
     Task(1, 4)),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "3",
      "SLURM_ARRAY_TASK_COUNT": "3"}, Task(2, 3)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, Task(1, 2)),
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1"}, Task(0, 1)),
])
def test_a_task_comes_from_slurm_or_torchrun(environ: dict[str, str], expected: Task) -> None:
    assert task_from(None, None, environ) == expected
    assert task_from(1, 3, environ) == Task(1, 3)  # the flags win
    assert task_from(None, 1, environ) == Task(0, 1)  # one task: the whole build, here


@pytest.mark.parametrize("task,tasks,environ,message", [
    (2, 2, {}, "--task 2 is not one of the 2 tasks: 0 to 1"),
    (0, None, {}, "--task needs --tasks N"),
    (None, 3, {}, "--tasks 3 needs --task I"),
    (None, 0, {}, "--tasks 0: at least 1"),
    (None, None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1",
                  "SLURM_ARRAY_TASK_COUNT": "3"},
     "SLURM array task 5 is not one of 3 evenly spaced ids from 1: submit the array as "
     "--array=0-2, or pass --task I --tasks N"),
    (None, None, {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "0",
                  "WORLD_SIZE": "2"},
     "both a SLURM array task and a torchrun rank: pass --task I --tasks N"),
])
def test_a_bad_task_gets_one_line(task: int | None, tasks: int | None, environ: dict[str, str],
                                  message: str) -> None:
    with pytest.raises(ValueError) as refused:
        task_from(task, tasks, environ)
    assert str(refused.value) == message


def same_searches(built: Path, reference: Path, model: Path, captions: list[str]) -> None:
    """The same items, and the same results for a few sentence and image queries."""
    ours, theirs = SearchIndex.open(built, model=model), SearchIndex.open(reference, model=model)
    assert ours.meta["images"] == theirs.meta["images"]
    assert ours.meta["sentences"] == theirs.meta["sentences"]
    for text in captions[:4]:
        assert ours.images_for(text, k=5) == theirs.images_for(text, k=5)
    for name in ours.meta["images"][:3]:
        assert ours.sentences_for_image(name, k=5) == theirs.sentences_for_image(name, k=5)


@pytest.mark.slow
def test_a_slurm_array_builds_what_one_process_does(slurm, collection: Collection,
                                                    one_process: Path, tmp_path: Path) -> None:
    """`sbatch --array=3-4` (task ids not from 0) of launch/slurm/index.sbatch, then the merge
    job, `--dependency=afterok` on the array; launch/README.md documents the two commands."""
    out, script = tmp_path / "index", str(ROOT / "launch/slurm/index.sbatch")
    env = {**slurm, "OMP_NUM_THREADS": "1"}
    with jobs(env) as sbatch:
        array = sbatch("--array=3-4", f"--output={tmp_path}/task-%a.out", script, "--model",
                       str(collection.model), "--shards", str(collection.shards), "--split",
                       "val", "--workers", "1", "--out", str(out))
        merge = sbatch(f"--dependency=afterok:{array}", f"--output={tmp_path}/merge.out",
                       script, "--merge", "--out", str(out))
        wait_for(lambda: job_field(slurm, merge, "JobState") in ENDED, 300, "the merge job",
                 tmp_path / "merge.out")
    logs = "".join(path.read_text() for path in sorted(tmp_path.glob("*.out")))
    assert job_field(slurm, merge, "JobState") == "COMPLETED", logs[-4000:]
    for task in (3, 4):
        summary = json.loads((tmp_path / f"task-{task}.out").read_text().splitlines()[-1])
        assert (summary["task"], summary["tasks"], summary["units"]) == (task - 3, 2, 2)
    assert_same_index(out, one_process)
    same_searches(out, one_process, collection.model, collection.captions)


@pytest.mark.slow
def test_torchrun_ranks_build_what_one_process_does(collection: Collection, one_process: Path,
                                                    tmp_path: Path) -> None:
    """Two ranks started at the same moment (both create parts/), then the merge."""
    out = tmp_path / "index"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
         "trainer.search.index_builder", "--model", str(collection.model), "--shards",
         str(collection.shards), "--split", "val", "--workers", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0, ranks.stdout[-3000:] + ranks.stderr[-3000:]
    summaries = sorted((summary["task"], summary["tasks"], summary["units"]) for summary in map(
        json.loads, (line for line in ranks.stdout.splitlines() if line.startswith("{"))))
    assert summaries == [(0, 2, 2), (1, 2, 2)] and not (out / "index.json").exists()
    merge = subprocess.run([shutil.which("defrag", path=Path(sys.executable).parent) or "defrag",
                            "index", "--merge", "--out", str(out)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert merge.returncode == 0, merge.stderr[-3000:]
    assert_same_index(out, one_process)
    same_searches(out, one_process, collection.model, collection.captions)
