"""Damaged shards, end to end: what training (TrainLoader, a real torchrun run) and evaluation
(load_eval_set + evaluate_model, the `trainer.evaluate` command) do with each kind of damage.

Every test damages a copy of the synthetic set (8 train shards and 2 val shards of 5 images, each
image a `<key>.json` and a `<key>.png` member, in that order):

- a tar header overwritten mid-shard: tarfile takes it for the end of the archive, silently;
- a shard truncated at a member boundary: the same, at the cut;
- bytes flipped inside an image, or a sample's JSON broken: the tar stays readable, one sample
  does not decode;
- a shard deleted.

The expected counts come from the manifest (what the featurizer wrote) and from what Python's
tarfile still reads of the damaged file, and are also written out as numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient

from defrag.urls import ShardError
from defrag.vocab import Vocabulary
from tests import DEFRAG
from tests.test_data import batch_pairs, make_config
from tests.test_train_e2e import tiny_config, torchrun
from trainer.data.eval_set import IncompleteSplit, load_eval_set
from trainer.data.reader import DataProblem
from trainer.data.shardset import training_featurizer
from trainer.data.train_loader import TrainLoader
from trainer.evaluate import evaluate_model
from trainer.model import DeFragModel
from trainer.store.model_folder import save_model_folder

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SHARD = "train/shard-000003.tar"  # images__train_00015_png .. 00019
VAL_SHARD = "val/shard-000000.tar"
SMALL_MODEL = {"embed_dim": 16, "word_dim": 8, "pretrained": False}
GARBAGE = b"garbage!" * 64  # one 512-byte tar block that is no header


# ---------------------------------------------------------------- damaging a copy


def copy_of(shards: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("source"))
    return copy


def members(path: Path) -> list[tarfile.TarInfo]:
    """What Python's tarfile reads of `path` (it stops silently at a bad header or the end)."""
    with tarfile.open(path) as tar:
        return tar.getmembers()


def keys_of(found: list[tarfile.TarInfo]) -> list[str]:
    """The sample keys of tar members, in order, each once."""
    return list(dict.fromkeys(member.name.rsplit(".", 1)[0] for member in found))


def overwrite_header(path: Path) -> None:
    """Garbage over the 4th member's header (the png of the 2nd sample)."""
    offset = members(path)[3].offset
    with path.open("r+b") as stream:
        stream.seek(offset)
        stream.write(GARBAGE)


def truncate(path: Path) -> None:
    """Cut the file where the 5th member's header starts (the json of the 3rd sample)."""
    offset = members(path)[4].offset
    with path.open("r+b") as stream:
        stream.truncate(offset)


def flip_image_bytes(path: Path) -> None:
    """Flip 4 bytes in the middle of the 2nd sample's png (the tar headers stay intact)."""
    member = members(path)[3]
    assert member.name.endswith(".png")
    data = bytearray(path.read_bytes())
    middle = member.offset_data + member.size // 2
    for at in range(middle, middle + 4):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def break_json(path: Path) -> None:
    """The 2nd sample's JSON no longer starts with '{' (same length: the tar stays intact)."""
    member = members(path)[2]
    assert member.name.endswith(".json")
    data = bytearray(path.read_bytes())
    assert data[member.offset_data] == ord("{")
    data[member.offset_data] = ord("X")
    path.write_bytes(bytes(data))


@dataclass(frozen=True)
class Damage:
    """A way to damage a shard and what a reader must make of it (5-sample shards)."""

    name: str
    apply: Callable[[Path], None]
    usable: int  # samples of the shard that still reach training or evaluation
    sample_problem: str | None  # what the "sample" problem of the 2nd sample says, if any
    shard_lost: int | None  # samples the "shard" problem counts as lost, if any


HEADER = Damage("header", overwrite_header, 1,
                "needs a json and a jpg/png/webp entry (entries: ['json'])", 3)
TRUNCATED = Damage("truncated", truncate, 2, None, 3)
IMAGE = Damage("image", flip_image_bytes, 4, "cannot decode the image (", None)
JSON = Damage("json", break_json, 4, "unusable metadata (JSONDecodeError: ", None)
DAMAGES = [HEADER, TRUNCATED, IMAGE, JSON]


def damage_shard(copy: Path, shard: str, damage: Damage) -> tuple[Path, list[str]]:
    """Damage one shard of the copy: its path and its sample keys (from before the damage)."""
    path = copy / shard
    keys = keys_of(members(path))
    assert len(keys) == manifest_samples(copy, shard) == 5
    damage.apply(path)
    return path, keys


def kept(keys: list[str], damage: Damage, verify: str) -> list[str]:
    """The samples of the damaged shard that are still used."""
    if verify == "local":
        return []
    return keys[:damage.usable] if damage.shard_lost else keys[:1] + keys[2:]


def manifest_samples(copy: Path, shard: str) -> int:
    manifest = json.loads((copy / "manifest.json").read_text())
    (entry,) = [e for e in manifest["splits"][shard.split("/")[0]]["shards"] if e["file"] == shard]
    return int(entry["samples"])


def check_problems(problems: list[DataProblem], path: Path, keys: list[str], damage: Damage,
                   verify: str) -> None:
    """The problems a reader reported for one damaged shard, exactly."""
    samples = manifest_samples(path.parents[1], f"{path.parent.name}/{path.name}")
    by_kind = Counter(problem.kind for problem in problems)
    if verify == "local":  # caught by its checksum before it is read: skipped whole
        (problem,) = problems
        assert problem.kind == "shard" and problem.lost == samples == 5
        assert str(path) in problem.message and "sha256" in problem.message
        assert "skipped, 5 samples lost" in problem.message
        return
    expected_kinds = Counter(kind for kind, met in [("sample", damage.sample_problem),
                                                    ("shard", damage.shard_lost)] if met)
    assert by_kind == expected_kinds, [p.message for p in problems]
    if damage.sample_problem is not None:
        (problem,) = [p for p in problems if p.kind == "sample"]
        assert problem.lost == 1
        assert problem.message.startswith(f"{path} sample {keys[1]!r}: {damage.sample_problem}")
    if damage.shard_lost is not None:
        (problem,) = [p for p in problems if p.kind == "shard"]
        read = len(keys_of(members(path)))  # samples tarfile still finds, the partial one too
        assert (read, problem.lost) == (samples - damage.shard_lost, damage.shard_lost)
        assert str(path) in problem.message
        assert (f"{read} samples read, its manifest says {samples}: {damage.shard_lost} lost"
                in problem.message)


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def vocab(shards: Path) -> Vocabulary:
    return Vocabulary.load(shards / "vocab.json")


def train_epoch(cfg, vocab: Vocabulary, rank: int = 0, world_size: int = 1,
                batch_size: int = 10) -> tuple[TrainLoader, Counter, int]:
    """One epoch of a rank's loader: the loader, the pairs it gave and its steps; every batch
    full."""
    loader = TrainLoader(cfg, vocab, batch_size, rank, world_size)
    batches = list(loader)
    assert len(batches) == loader.steps_per_epoch
    assert [len(batch.captions) for batch in batches] == [batch_size] * len(batches)
    return loader, Counter(pair for batch in batches for pair in batch_pairs(batch)), len(batches)


@pytest.mark.parametrize(("damage", "workers"), [
    pytest.param(damage, workers, id=f"{damage.name}-{workers}")
    for damage in DAMAGES for workers in (0, 2)])
def test_training_reports_the_damage_and_keeps_full_batches(
        shards: Path, vocab: Vocabulary, tmp_path: Path, damage: Damage, workers: int) -> None:
    copy = copy_of(shards, tmp_path)
    path, keys = damage_shard(copy, TRAIN_SHARD, damage)
    cfg = make_config(copy, {"verify_shards": "none", "workers": workers})
    loader, pairs, steps = train_epoch(cfg, vocab)
    check_problems(list(loader.problems.values()), path, keys, damage, "none")
    assert steps == 20 and pairs.total() == 200  # 200 pairs // 10: the epoch is not shortened
    lost = set(keys) - set(kept(keys, damage, "none"))
    assert len(lost) == 5 - damage.usable
    seen = {image_id for image_id, _ in pairs}
    assert len(seen) == 40 - len(lost) and seen.isdisjoint(lost)
    assert len(pairs) == 200 - 5 * len(lost)  # every usable pair, the rest from a second pass
    assert max(pairs.values()) == 2


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("damage", [HEADER, TRUNCATED], ids=lambda d: d.name)
def test_a_checksum_catches_the_damaged_shard_first(
        shards: Path, vocab: Vocabulary, tmp_path: Path, damage: Damage, workers: int) -> None:
    """With the default data.verify_shards=local the shard is skipped whole before it is read."""
    copy = copy_of(shards, tmp_path)
    path, keys = damage_shard(copy, TRAIN_SHARD, damage)
    cfg = make_config(copy, {"workers": workers})
    assert cfg.data.verify_shards == "local"
    loader, pairs, steps = train_epoch(cfg, vocab)
    check_problems(list(loader.problems.values()), path, keys, damage, "local")
    assert steps == 20 and pairs.total() == 200
    seen = {image_id for image_id, _ in pairs}
    assert len(seen) == 35 and seen.isdisjoint(keys) and len(pairs) == 175


def test_the_rank_of_the_damaged_shard_refills_its_epoch(
        shards: Path, vocab: Vocabulary, tmp_path: Path) -> None:
    """Two ranks of 4 shards each: the one holding the damaged shard fills its last batches from
    a second pass over its own shards; both run the same 10 full steps."""
    copy = copy_of(shards, tmp_path)
    path, keys = damage_shard(copy, TRAIN_SHARD, HEADER)
    cfg = make_config(copy, {"verify_shards": "none", "workers": 2})
    ranks = [train_epoch(cfg, vocab, rank, 2) for rank in range(2)]
    assert [steps for _, _, steps in ranks] == [10, 10]
    assert [pairs.total() for _, pairs, _ in ranks] == [100, 100]
    (damaged,) = [r for r in ranks if r[0].problems]
    (clean,) = [r for r in ranks if not r[0].problems]
    check_problems(list(damaged[0].problems.values()), path, keys, HEADER, "none")
    assert len(damaged[1]) == 100 - 20 and max(damaged[1].values()) == 2
    assert len(clean[1]) == 100 and max(clean[1].values()) == 1
    assert not damaged[1].keys() & clean[1].keys()


def test_a_deleted_shard_stops_training_and_evaluation_at_start(
        shards: Path, vocab: Vocabulary, tmp_path: Path) -> None:
    copy = copy_of(shards, tmp_path)
    (copy / TRAIN_SHARD).unlink()
    (copy / VAL_SHARD).unlink()
    cfg = make_config(copy)
    with pytest.raises(ShardError, match=r"1 of the 8 shards of split 'train' are missing") as err:
        TrainLoader(cfg, vocab, 10, 0, 1)
    assert str(copy / TRAIN_SHARD) in str(err.value)
    with pytest.raises(ShardError, match=r"1 of the 2 shards of split 'val' are missing") as err:
        load_eval_set(cfg, vocab, rank=0, world_size=1)
    assert str(copy / VAL_SHARD) in str(err.value)


# ---------------------------------------------------------------- evaluation


@pytest.fixture(scope="module")
def model(shards: Path, vocab: Vocabulary) -> DeFragModel:
    return DeFragModel.from_config(make_config(shards, model=SMALL_MODEL).model, vocab)


def expected_line(images: int, problems: int) -> str:
    return (f"{images} of the 10 images and {5 * images} of the 50 sentences of split 'val' "
            f"({problems} data problems)")


@pytest.mark.parametrize(("damage", "verify", "workers"), [
    (HEADER, "none", 0), (HEADER, "none", 2), (TRUNCATED, "none", 0), (IMAGE, "none", 0),
    (JSON, "none", 2), (HEADER, "local", 0), (TRUNCATED, "local", 2)],
    ids=lambda value: getattr(value, "name", str(value)))
def test_evaluation_refuses_an_incomplete_split_unless_allowed(
        shards: Path, vocab: Vocabulary, model: DeFragModel, tmp_path: Path, damage: Damage,
        verify: str, workers: int) -> None:
    copy = copy_of(shards, tmp_path)
    path, keys = damage_shard(copy, VAL_SHARD, damage)
    cfg = make_config(copy, {"verify_shards": verify, "workers": workers}, SMALL_MODEL)
    eval_set = load_eval_set(cfg, vocab, rank=0, world_size=1)
    usable = 0 if verify == "local" else damage.usable
    problems = 1 if verify == "local" else (damage.sample_problem is not None) + (
        damage.shard_lost is not None)
    with pytest.raises(IncompleteSplit) as err:
        evaluate_model(model, eval_set, cfg)
    message = str(err.value)
    assert message.startswith(f"evaluated {expected_line(5 + usable, problems)}: ")
    assert str(path) in message and "--allow-incomplete" in message
    check_problems(eval_set.problems, path, keys, damage, verify)

    cfg.eval.allow_incomplete = True
    metrics, line = evaluate_model(model, eval_set, cfg)
    assert line == expected_line(5 + usable, problems)
    assert 0 <= metrics["rsum"] <= 600 and metrics["t2i_r10"] == 100.0  # <= 10 images ranked
    check_problems(eval_set.problems, path, keys, damage, verify)
    images = [image_id for batch in eval_set.batches(4) for image_id in batch.image_ids]
    other = keys_of(members(copy / "val/shard-000001.tar"))
    assert sorted(images) == sorted(kept(keys, damage, verify) + other)
    assert len(images) == 5 + usable


def test_a_shard_problem_found_after_a_chunk_boundary_is_kept(
        shards: Path, vocab: Vocabulary, model: DeFragModel, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """val/shard-000001.tar cut after its 4th sample, read in this process after the 5 images of
    shard 0: its 3rd image fills the first chunk of 8, and the count check comes in the second."""
    copy = copy_of(shards, tmp_path)
    path = copy / "val/shard-000001.tar"
    with path.open("r+b") as stream:
        stream.truncate(members(path)[8].offset)  # the json of the 5th sample
    assert len(keys_of(members(path))) == 4
    cfg = make_config(copy, {"verify_shards": "none"}, SMALL_MODEL)
    cfg.eval.allow_incomplete = True
    eval_set = load_eval_set(cfg, vocab, rank=0, world_size=1)
    with caplog.at_level("WARNING", logger="trainer.data.reader"):
        _, line = evaluate_model(model, eval_set, cfg)
    found = f"shard {path}: 4 samples read, its manifest says 5: 1 lost"
    assert any(record.getMessage().startswith(found) for record in caplog.records)  # detected
    assert line == expected_line(9, 1)  # ... and reported
    (problem,) = eval_set.problems
    assert problem.kind == "shard" and problem.lost == 1 and problem.message.startswith(found)


@pytest.fixture
def model_folder(model: DeFragModel, shards: Path, vocab: Vocabulary, tmp_path: Path) -> Path:
    """The small model as a registered model folder (default data settings: verify local)."""
    cfg = make_config(shards, model=SMALL_MODEL)
    return save_model_folder(tmp_path / "model", model, cfg, vocab,
                             featurizer=training_featurizer(cfg.data))


def evaluate_command(folder: Path, shards: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [DEFRAG, "evaluate", "--model", str(folder), "--shards",
         str(shards), "--split", "val", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_evaluate_command_on_a_damaged_split(shards: Path, model_folder: Path,
                                             tmp_path: Path) -> None:
    """Refused, allowed with --allow-incomplete, and refused with the shard gone: the three
    commands run side by side, on two copies of the shards."""
    copy = copy_of(shards, tmp_path)
    path, _ = damage_shard(copy, VAL_SHARD, HEADER)  # caught by its checksum: 5 images lost
    gone = copy_of(shards, tmp_path / "gone") / VAL_SHARD
    gone.unlink()
    with ThreadPoolExecutor(3) as pool:
        refused, allowed, missing = pool.map(lambda args: evaluate_command(model_folder, *args), [
            [copy], [copy, "--allow-incomplete"], [gone.parent.parent]])
    assert refused.returncode != 0
    assert ("defrag evaluate: error: evaluated 5 of the 10 images and 25 of the 50 sentences "
            "of split 'val' (1 data problems)") in refused.stderr, refused.stderr[-3000:]
    assert str(path) in refused.stderr and "sha256" in refused.stderr
    assert "Traceback" not in refused.stderr

    assert allowed.returncode == 0, allowed.stderr[-3000:]
    lines = allowed.stdout.strip().splitlines()
    assert f"evaluated {expected_line(5, 1)} from 2 shard(s)" in lines
    assert "evaluated 5 of the 10 images and 25 of the 50 sentences" in allowed.stdout
    assert "(chance 20.0)" in allowed.stdout and "(chance 100.0)" in allowed.stdout  # of 5 images
    metrics = json.loads(lines[-1])
    assert metrics["split"] == "val" and 0 <= metrics["rsum"] <= 600

    assert missing.returncode != 0
    assert "defrag evaluate: error: 1 of the 2 shards of split 'val' are missing" in missing.stderr
    assert "Traceback" not in missing.stderr
    assert str(gone) in missing.stderr


# ---------------------------------------------------------------- a real torchrun training


def damaged_run(tmp_path: Path, shards: Path, damage: Damage,
                epochs: int) -> tuple[Path, list[str], dict]:
    """A 2-process torchrun training of `epochs` epochs on shards whose TRAIN_SHARD has
    `damage` (verify_shards none): the damaged shard, its keys, the run's summary."""
    copy = copy_of(shards, tmp_path)
    path, keys = damage_shard(copy, TRAIN_SHARD, damage)
    config = tiny_config(tmp_path, copy)
    settings = json.loads(config.read_text())
    settings["data"]["verify_shards"] = "none"
    settings["optim"].update(epochs=epochs, frozen_cnn_epochs=1, anneal_last_epochs=1)
    config.write_text(json.dumps(settings))
    process = torchrun(config)
    output, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        pytest.fail(f"the training failed:\n{output[-4000:]}")
    return path, keys, json.loads(output.strip().splitlines()[-1])


def run_metric(run_dir: Path, summary: dict, key: str) -> list[float]:
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    return [m.value for m in sorted(client.get_metric_history(summary["mlflow_run_id"], key),
                                    key=lambda m: m.step)]


@pytest.mark.slow
def test_torchrun_training_logs_the_damaged_shard(shards: Path, tmp_path: Path) -> None:
    """Rank 0 reads TRAIN_SHARD across a chunk boundary: the "3 lost" problem still arrives."""
    path, keys, summary = damaged_run(tmp_path, shards, HEADER, epochs=1)
    run_dir = tmp_path / "run"
    lines = (run_dir / "data_problems.txt").read_text().splitlines()
    assert len(lines) == 2, lines
    (shard_line,) = [line for line in lines if line.startswith(f"shard {path}:")]
    assert "2 samples read, its manifest says 5: 3 lost" in shard_line
    (sample_line,) = [line for line in lines if line.startswith(f"{path} sample {keys[1]!r}:")]
    assert "needs a json and a jpg/png/webp entry" in sample_line
    assert run_metric(run_dir, summary, "data/lost_samples") == [3.0]
    assert run_metric(run_dir, summary, "data/skipped_samples") == [1.0]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert "data_problems.txt" in [a.path for a in client.list_artifacts(run.info.run_id)]


@pytest.mark.slow
def test_torchrun_training_counts_a_problem_once_across_ranks(shards: Path,
                                                              tmp_path: Path) -> None:
    """Two epochs: the exact deal of (seed 0, epoch) gives TRAIN_SHARD to rank 0, then rank 1;
    its undecodable image is one skipped sample in both epochs."""
    copy = copy_of(shards, tmp_path / "deal")
    cfg = make_config(copy, {"verify_shards": "none"})
    vocab = Vocabulary.load(copy / "vocab.json")
    damage_shard(copy, TRAIN_SHARD, IMAGE)
    holders = []
    for epoch in (0, 1):
        loaders = [TrainLoader(cfg, vocab, 10, rank, 2, epoch) for rank in range(2)]
        for loader in loaders:
            list(loader)
        holders.append([rank for rank, loader in enumerate(loaders) if loader.problems])
    if holders != [[0], [1]]:
        pytest.fail(f"the premise changed: ranks meeting {TRAIN_SHARD} by epoch: {holders}")

    path, keys, summary = damaged_run(tmp_path, shards, IMAGE, epochs=2)
    run_dir = tmp_path / "run"
    assert run_metric(run_dir, summary, "data/lost_samples") == [0.0, 0.0]
    lines = (run_dir / "data_problems.txt").read_text().splitlines()
    assert lines and all(line.startswith(f"{path} sample {keys[1]!r}:") for line in lines)
    assert run_metric(run_dir, summary, "data/skipped_samples") == [1.0, 1.0]
    assert len(lines) == 1, lines
