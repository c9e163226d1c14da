"""tests/servers.py: the fault-injecting HTTP folder server and moto's S3, via curl and aws."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import webdataset as wds

from tests.servers import s3_server, serve_folder

SHARD = "train/shard-000000.tar"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder with one real 3-sample tar shard (about 150 kB) and two copies of it."""
    (tmp_path / "train").mkdir()
    for i in range(3):
        (tmp_path / f"s{i}.bin").write_bytes(os.urandom(50_000))
    with tarfile.open(tmp_path / SHARD, "w") as tar:
        for i in range(3):
            tar.add(tmp_path / f"s{i}.bin", arcname=f"s{i}.bin")
            (tmp_path / f"s{i}.bin").unlink()
    for copy in ("train/shard-000001.tar", "train/shard-000002.tar"):
        (tmp_path / copy).write_bytes((tmp_path / SHARD).read_bytes())
    return tmp_path


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-fsS", *args], capture_output=True, timeout=30)


def test_http_log_missing_and_drop(folder: Path) -> None:
    data = (folder / SHARD).read_bytes()
    with serve_folder(folder, drop_after={"train/shard-000001.tar": 1000},
                      missing={"train/shard-000002.tar"}) as server:
        assert curl(f"{server.url}/{SHARD}").stdout == data
        samples = wds.tarfile_samples([{"url": f"{server.url}/{SHARD}"}])  # curl inside
        assert [s["__key__"] for s in samples] == ["s0", "s1", "s2"]
        assert curl(f"{server.url}/train/shard-000002.tar").returncode == 22  # 404
        cut = curl(f"{server.url}/train/shard-000001.tar")
        assert (cut.returncode, len(cut.stdout)) == (18, 1000)  # partial file
        assert curl(f"{server.url}/train/shard-000001.tar").stdout == data  # drop_times=1
        assert server.log == [f"/{SHARD}", f"/{SHARD}", "/train/shard-000002.tar",
                              "/train/shard-000001.tar", "/train/shard-000001.tar"]
        assert server.count("shard-000001.tar") == 2


def test_stalled_transfer_times_out_and_server_exits(folder: Path) -> None:
    with serve_folder(folder, stall={SHARD}) as server:
        start = time.monotonic()
        stalled = curl("--max-time", "2", f"{server.url}/{SHARD}")
        assert stalled.returncode == 28  # timed out with half the body
        assert len(stalled.stdout) == (folder / SHARD).stat().st_size // 2
        assert time.monotonic() - start < 10
        hanging = subprocess.Popen(["curl", "-fsS", "-o", os.devnull, f"{server.url}/{SHARD}"],
                                   stderr=subprocess.DEVNULL)
        while server.count(SHARD) < 2:
            time.sleep(0.01)
        start = time.monotonic()
    assert time.monotonic() - start < 2  # exits with a request still stalled
    assert hanging.wait(timeout=10) == 18  # whose connection it closed


@pytest.mark.slow
def test_s3_upload_and_aws_cli(folder: Path) -> None:
    with s3_server() as s3:
        keys = s3.upload_folder(folder / "train", "shards", prefix="train/")
        assert keys == [f"train/shard-00000{i}.tar" for i in range(3)]
        env = {**os.environ, **s3.env}
        run = subprocess.run(["aws", "s3", "cp", f"s3://shards/{SHARD}", "-"], env=env,
                             capture_output=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout == (folder / SHARD).read_bytes()
        missing = subprocess.run(["aws", "s3", "cp", "s3://shards/train/absent.tar", "-"],
                                 env=env, capture_output=True, timeout=60)
        assert missing.returncode != 0
        assert b"404" in missing.stderr
