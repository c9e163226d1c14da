"""`featurize webdataset` at scale gives what one process gives: img2dataset shards served over
HTTP, featurized by a 2-task SLURM job array (launch/slurm/featurize.sbatch, on the real
slurmctld of tests/test_slurm.py) into moto's S3 and merged by a dependent job, are the same
bytes, manifest counts and vocabulary as one process writing a folder from the same shards on
disk; a rerun task skips its finished shards, and the trainer trains from the bucket."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from featurizer.synthetic import write_img2dataset
from tests.servers import S3, s3_server, serve_folder
from tests.test_slurm import ENDED, ROOT, job_field, jobs, wait_for
from tests.test_train_e2e import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
INPUTS = "{00000..00003}.tar"  # 4 img2dataset shards of 6 images: 3 train, then 1 val
FLAGS = ["--parser", "spacy", "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]
BUCKET, PREFIX = "defrag", "laion"
SCRIPT = str(ROOT / "launch/slurm/featurize.sbatch")


def mark_split(shard: Path, split: str) -> None:
    """Rewrite an img2dataset shard with `split` in every sample's json, as img2dataset keeps
    a column of its input table (`--save_additional_columns '["split"]'`)."""
    with tarfile.open(shard) as tar:
        entries = [(member, tar.extractfile(member).read()) for member in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for member, data in entries:
            if member.name.endswith(".json"):
                data = json.dumps({**json.loads(data), "split": split}).encode()
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 generated scenes (64 px) in 4 img2dataset shards of 6; the last one's are val."""
    folder = tmp_path_factory.mktemp("img2dataset")
    *_, last = write_img2dataset(folder, 24, 6, image_size=64)
    mark_split(last, "val")
    return folder


@pytest.fixture
def s3() -> Iterator[S3]:
    with s3_server() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


def bucket_files(s3: S3) -> dict[str, bytes]:
    """Every object under the prefix, by its path below it."""
    client = s3.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/")
    assert not listed["IsTruncated"]
    return {item["Key"].removeprefix(f"{PREFIX}/"): client.get_object(
        Bucket=BUCKET, Key=item["Key"])["Body"].read() for item in listed["Contents"]}


def folder_files(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes()
            for path in folder.rglob("*") if path.is_file()}


def without_created_by(manifest: bytes) -> dict:
    """A manifest but for the command and settings that wrote it (its --shards and --out)."""
    return {key: value for key, value in json.loads(manifest).items() if key != "created_by"}


def test_a_slurm_array_into_s3_writes_what_one_process_does(slurm, inputs: Path, s3: S3,
                                                            tmp_path: Path) -> None:
    """The array's tasks read 2 input shards each over HTTP, the merge job waits for both
    (afterok), and the jobs reach moto through the environment sbatch exports."""
    env = {**slurm, **s3.env, "OMP_NUM_THREADS": "1"}
    local = tmp_path / "local"
    one_process = subprocess.Popen(  # runs beside the jobs
        [sys.executable, "-m", "featurizer", "webdataset", "--shards", str(inputs / INPUTS),
         "--out", str(local), *FLAGS], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = f"s3://{BUCKET}/{PREFIX}"

    def wait_until_ended(job: str, log: Path) -> None:
        wait_for(lambda: job_field(slurm, job, "JobState") in ENDED, 120, f"job {job}", log)

    try:
        with jobs(env) as sbatch, serve_folder(inputs) as server:
            shards = ["--shards", f"{server.url}/{INPUTS}", "--out", out, *FLAGS]
            array = sbatch("--array=0-1", f"--output={tmp_path}/task-%a.out", SCRIPT, *shards)
            merge = sbatch(f"--dependency=afterok:{array}", f"--output={tmp_path}/merge.out",
                           SCRIPT, "merge", "--out", out)
            wait_until_ended(merge, tmp_path / "merge.out")
            logs = "".join(path.read_text() for path in sorted(tmp_path.glob("*.out")))
            assert job_field(slurm, merge, "JobState") == "COMPLETED", logs[-4000:]
            rerun = sbatch("--array=1", f"--output={tmp_path}/rerun.out", SCRIPT, *shards,
                           "--task", "1", "--tasks", "2")
            wait_until_ended(rerun, tmp_path / "rerun.out")
            served = list(server.log)
    finally:
        output, _ = one_process.communicate(timeout=120)
    assert one_process.returncode == 0, output[-4000:]

    for task in (0, 1):
        assert (f"task {task} of 2: 2 of 4 input shards, 0 finished before, 2 written (12 "
                "images, 0 inputs skipped)") in (tmp_path / f"task-{task}.out").read_text()
    assert sorted(served) == [f"/{i:05d}.tar" for i in range(4)]  # each input read once
    assert ("task 1 of 2: 2 of 4 input shards, 2 finished before, 0 written (0 images, 0 inputs "
            "skipped)") in (tmp_path / "rerun.out").read_text()

    ours, theirs = bucket_files(s3), folder_files(local)
    assert sorted(ours) == sorted(theirs)
    assert {"train/shard-000000.tar", "train/shard-000002.tar", "val/shard-000003.tar",
            "vocab.json", "parts/000003.json"} <= set(theirs)
    for name in theirs.keys() - {"manifest.json", "parts/plan.json"}:
        assert ours[name] == theirs[name], name
    manifest = without_created_by(ours["manifest.json"])
    assert manifest == without_created_by(theirs["manifest.json"])
    assert {split: counts["images"] for split, counts in manifest["splits"].items()} == {
        "train": 18, "val": 6}

    trained = train_from(s3, tmp_path)
    assert len(trained["train/loss"]) == 3 and all(map(math.isfinite, trained["train/loss"]))
    assert len(trained["val/rsum"]) == 1  # 18 pairs in batches of 6, then the val split


def train_from(s3: S3, tmp_path: Path) -> dict[str, list[float]]:
    """One epoch of tiny_config from the bucket (`data.shards=s3://BUCKET/PREFIX`: manifest,
    vocabulary and shards read with boto3) in one process; its MLflow metrics' histories."""
    run_dir = tmp_path / "run"
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    training = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config",
         str(tiny_config(tmp_path, f"s3://{BUCKET}/{PREFIX}")), "data.val_split=val",
         "optim.batch_size=6", "optim.epochs=1",
         "optim.frozen_cnn_epochs=1", "optim.anneal_last_epochs=0", "run.log_every_steps=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert training.returncode == 0, training.stdout[-3000:] + training.stderr[-3000:]
    summary = json.loads(training.stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    return {name: [metric.value for metric in client.get_metric_history(
        summary["mlflow_run_id"], name)] for name in ("train/loss", "val/rsum")}
