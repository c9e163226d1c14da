"""`featurize webdataset` on generated img2dataset shards: every kind of bad sample named, counted
and skipped; images decoded as everywhere (EXIF, 16-bit, WebP); tasks that give the bytes of one
process; reruns that redo only what is missing; a merge that names what is; the pipe: output;
secrets kept out of what is written; an input cut mid-shard read again; the trainer reading it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

import featurizer.img2dataset as img2dataset
import featurizer.ingest as ingest
from defrag.urls import MASK
from defrag.vocab import Vocabulary
from featurizer.boxes import FullFrameSource
from featurizer.command import main
from featurizer.destinations import _turned_around
from featurizer.img2dataset import Sample, read_samples
from featurizer.records import Origin, Problem
from featurizer.synthetic import write_img2dataset
from tests.servers import serve_folder
from trainer.data.reader import SampleDecoder
from trainer.data.shardset import locate_split

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--parser", "spacy", "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]


def featurize(*argv: str | Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`defrag featurize ARGV` in this process; what it printed."""
    assert main([str(arg) for arg in argv]) == 0
    return capsys.readouterr().out


def jpeg(colour: tuple[int, int, int], size: tuple[int, int] = (48, 32),
         orientation: int | None = None) -> bytes:
    image, out = Image.new("RGB", size, colour), io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    image.save(out, "JPEG", exif=exif.tobytes())
    return out.getvalue()


def encoded(image: Image.Image, kind: str) -> bytes:
    out = io.BytesIO()
    image.save(out, kind)
    return out.getvalue()


DEEP_PNG = encoded(Image.frombytes(  # a 16-bit grey ramp
    "I;16", (48, 32), (np.arange(48 * 32, dtype="<u2") * 40).tobytes()), "PNG")


def write_tar(path: Path, samples: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path), encoder=False, mtime=0) as tar:
        for sample in samples:
            tar.write(sample)


def meta(**fields) -> bytes:
    return json.dumps({"status": "success", **fields}).encode()


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """One img2dataset shard holding good samples of several image kinds and every bad kind."""
    samples = [
        {"__key__": "000000000", "jpg": jpeg((200, 30, 30)), "txt": b"A red dog runs .",
         "json": meta(caption="A red dog runs .")},
        {"__key__": "000000001", "jpg": jpeg((30, 200, 30), orientation=6),  # stored sideways
         "txt": b"A green cat sleeps .", "json": meta()},
        {"__key__": "000000002", "webp": encoded(Image.new("RGB", (40, 40), (9, 9, 200)), "WEBP"),
         "json": meta(captions=["A blue ball .", "A ball on the floor ."], split="val")},
        {"__key__": "000000003", "png": DEEP_PNG, "txt": b"A grey ramp ."},
        {"__key__": "000000004", "txt": b"No image here ."},  # missing_image
        {"__key__": "000000005", "jpg": jpeg((1, 2, 3)), "json": meta()},  # no_captions
        {"__key__": "000000006", "jpg": jpeg((1, 2, 3)), "txt": b"caf\xe9 ."},  # not UTF-8
        {"__key__": "000000007", "jpg": jpeg((1, 2, 3)), "txt": b"A dog .",
         "json": b"{broken"},  # malformed
        {"__key__": "000000008", "jpg": b"not an image", "txt": b"A dog ."},  # bad_image
        {"__key__": "000000009", "jpg": jpeg((1, 2, 3)), "txt": b"A dog .",
         "json": meta(split="../../etc")},  # malformed: a split that is no folder name
        {"__key__": "000000000", "jpg": jpeg((1, 2, 3)), "txt": b"A dog ."},  # duplicate_image
    ]
    write_tar(tmp_path / "in" / "00000.tar", samples)
    return tmp_path / "in" / "00000.tar"


def test_every_bad_sample_is_named_counted_and_skipped(mixed: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    printed = featurize("webdataset", "--shards", mixed, "--out", out, *FLAGS, capsys=capsys)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"]["by_reason"] == {
        "bad_image": 1, "duplicate_image": 1, "malformed": 2, "missing_image": 1,
        "no_captions": 2}
    for item in manifest["skipped"]["items"]:
        assert item["file"] == str(mixed) and item["item"].startswith("00000000"), item
    no_caption = [i for i in manifest["skipped"]["items"] if i["reason"] == "no_captions"]
    assert any("not UTF-8" in item["detail"] for item in no_caption)
    assert manifest["splits"]["train"]["images"] == 3 and manifest["splits"]["val"]["images"] == 1
    assert manifest["splits"]["val"]["captions"] == 2
    assert "train: 3 images" in printed and "7 inputs skipped" in printed

    samples = {s["__key__"]: s for s in wds.WebDataset(str(out / "train/shard-000000.tar"),
                                                       shardshuffle=False)}
    metas = {key: json.loads(s["json"]) for key, s in samples.items()}
    turned = metas["00000-000000001"]  # image ids are <input shard>-<key>
    assert (turned["width"], turned["height"]) == (32, 48)  # EXIF turned
    assert turned["boxes"] == [[0, 0, 32, 48]] and turned["file"] == "00000.tar/000000001"
    assert samples["00000-000000003"]["png"] == DEEP_PNG  # the source's bytes, not re-encoded
    val = next(iter(wds.WebDataset(str(out / "val/shard-000000.tar"), shardshuffle=False)))
    assert set(val) >= {"webp", "json"}
    vocab = Vocabulary.load(out / "vocab.json")
    decoder = SampleDecoder(vocab, image_size=32, max_boxes=1, fragment_mode="triplet")
    image = decoder.decode({**val, "json": val["json"]})  # the trainer reads the WebP sample
    assert image.pixels.shape == (32, 32, 3) and image.pixels[..., 2].mean() > 150


def test_tasks_give_one_process_bytes_and_reruns_redo_only_what_is_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    write_img2dataset(tmp_path / "in", count=14, per_shard=4, image_size=64)
    shards = str(tmp_path / "in" / "{00000..00003}.tar")
    featurize("webdataset", "--shards", shards, "--out", tmp_path / "one", *FLAGS, capsys=capsys)
    split = tmp_path / "split"
    with pytest.raises(SystemExit, match="merge.*no parts/plan.json"):
        main(["merge", "--out", str(split)])
    for task in ("1", "0"):
        printed = featurize("webdataset", "--shards", shards, "--out", split, "--task", task,
                            "--tasks", "2", *FLAGS, capsys=capsys)
        assert "featurize merge --out" in printed
        if task == "1":  # the merge names what task 0 has not done yet
            with pytest.raises(SystemExit, match=r"2 of the 4 input shards are not finished.*"
                                                 r"00000.tar \(unit 0\), 00002.tar \(unit 2\)"):
                main(["merge", "--out", str(split)])
    featurize("merge", "--out", split, capsys=capsys)
    names = sorted(p.relative_to(tmp_path / "one").as_posix()
                   for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert [n for n in names if n.endswith(".tar")] == [
        f"train/shard-{u:06d}.tar" for u in range(4)]
    for name in names:
        if name.endswith((".tar", "vocab.json")) or name.startswith("parts/0"):
            assert (split / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    ours, theirs = (json.loads((folder / "manifest.json").read_text())
                    for folder in (split, tmp_path / "one"))
    assert ours["splits"] == theirs["splits"] and ours["vocabulary"] == theirs["vocabulary"]

    damaged_outputs_are_named_and_redone(shards, split, tmp_path / "one", capsys)
    tasks_with_other_settings_are_named(shards, split, capsys)

    pieces = tmp_path / "pieces"  # --shard-size cuts an input shard into pieces
    featurize("webdataset", "--shards", shards, "--out", pieces, "--shard-size", "3", *FLAGS,
              capsys=capsys)
    files = [s["file"] for s in json.loads((pieces / "manifest.json").read_text())
             ["splits"]["train"]["shards"]]
    assert files[:3] == ["train/shard-000000-0000.tar", "train/shard-000000-0001.tar",
                         "train/shard-000001-0000.tar"] and len(files) == 7
    listed = locate_split(str(pieces / "train/shard-000000-{0000..0001}.tar"), "train",
                          str(pieces / "manifest.json"))
    assert [shard.samples for shard in listed.shards] == [3, 1]


def damaged_outputs_are_named_and_redone(shards: str, split: Path, one: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A shard lost and one cut short after their parts: the merge names both and their units,
    writes no manifest, and each owner's rerun redoes that unit alone."""
    (split / "manifest.json").unlink()
    (split / "train/shard-000002.tar").unlink()
    (split / "train/shard-000001.tar").write_bytes(b"cut short")
    size = (one / "train/shard-000001.tar").stat().st_size
    with pytest.raises(SystemExit, match=(
            rf"2 of the 4 input shards are not finished in {split}: 00001.tar \(unit 1: "
            rf"train/shard-000001.tar has 9 bytes, not the {size} its part records\), 00002.tar "
            r"\(unit 2: train/shard-000002.tar is missing\); run the job's tasks again")):
        main(["merge", "--out", str(split)])
    assert not (split / "manifest.json").exists()
    for task in ("0", "1"):
        printed = featurize("webdataset", "--shards", shards, "--out", split, "--task", task,
                            "--tasks", "2", *FLAGS, capsys=capsys)
        assert "2 of 4 input shards, 1 finished before, 1 written (4 images" in printed
    for unit in (1, 2):
        name = f"train/shard-{unit:06d}.tar"
        assert (split / name).read_bytes() == (one / name).read_bytes()
    featurize("merge", "--out", split, capsys=capsys)


def tasks_with_other_settings_are_named(shards: str, split: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Tasks given another vocabulary setting or pixel bound: the merge names the setting; a
    rerun with the same flags keeps the finished units of a vocabulary setting."""
    def task(number: str, *flags: str) -> str:
        return featurize("webdataset", "--shards", shards, "--out", split, "--task", number,
                         "--tasks", "2", *FLAGS, *flags, capsys=capsys)

    assert "2 finished before, 0 written" in task("1", "--min-word-count", "2")
    with pytest.raises(SystemExit, match=(
            r"2 of the 4 input shards were featurized with other settings than the last task "
            r"to start \(parts/plan.json\): 00000.tar \(unit 0: --min-word-count 1 \(plan: 2\)\), "
            r"00002.tar \(unit 2: --min-word-count 1 \(plan: 2\)\); give every task the same")):
        main(["merge", "--out", str(split)])
    assert "2 finished before, 0 written" in task("0", "--min-word-count", "2")
    assert "0 finished before, 2 written" in task("0", "--max-image-pixels", "1000000")
    with pytest.raises(SystemExit, match=r"00001.tar \(unit 1: --max-image-pixels \d+ \(plan: "
                                         r"1000000\), --min-word-count 2 \(plan: 1\)\)"):
        main(["merge", "--out", str(split)])


def test_a_pipe_output_is_read_back_to_skip_and_merge(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]):
    write_img2dataset(tmp_path / "in", count=6, per_shard=3, image_size=64)
    store = tmp_path / "store"
    write = f"pipe:mkdir -p \"$(dirname {store}/{{shard}})\" && cat > {store}/{{shard}}"
    read = f"pipe:cat {store}/{{shard}}"
    argv = ["webdataset", "--shards", str(tmp_path / "in/{00000..00001}.tar"), "--out", write,
            "--out-read", read, *FLAGS]
    featurize(*argv, capsys=capsys)
    assert json.loads((store / "manifest.json").read_text())["splits"]["train"]["images"] == 6
    assert "2 finished before, 0 written" in featurize(*argv, capsys=capsys)
    lost = store / "train/shard-000001.tar"
    kept = (store / "train/shard-000000.tar").stat().st_mtime_ns
    lost.unlink()  # a lost shard is found through the read command: the merge names it ...
    with pytest.raises(SystemExit, match=r"unit 1: train/shard-000001.tar is missing"):
        main(["merge", "--out", write, "--out-read", read])
    assert "1 finished before, 1 written" in featurize(*argv, capsys=capsys)  # ... a rerun too
    assert lost.is_file() and (store / "train/shard-000000.tar").stat().st_mtime_ns == kept
    assert _turned_around("aws s3 cp - s3://b/p/{shard}") == "aws s3 cp s3://b/p/{shard} -"
    assert _turned_around("aws s3 cp - 's3://b/p/{shard}' --endpoint-url $EP | cat") == (
        "aws s3 cp 's3://b/p/{shard}' - --endpoint-url $EP | cat")  # quotes, variables, pipes
    unreadable = (r"parts/plan.json was written to .* but cannot be read back \(reading it "
                  r"back: `false parts/plan.json` exited 1\)")
    with pytest.raises(SystemExit, match=unreadable):
        main([*argv[:3], "--out", write, "--out-read", "pipe:false {shard}", *FLAGS])
    with pytest.raises(SystemExit, match="give the command that reads a file back"):
        main(["webdataset", "--shards", "x.tar", "--out", "pipe:tee {shard}", *FLAGS])
    with pytest.raises(SystemExit, match=r"needs \{shard\}"):
        main(["webdataset", "--shards", "x.tar", "--out", "pipe:cat > here", *FLAGS])


def test_secrets_of_the_output_command_stay_out_of_what_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture):
    write_img2dataset(tmp_path / "in", count=3, per_shard=3, image_size=64)
    store, secret = tmp_path / "store", "s3cr3t-value"
    write = (f"pipe:AWS_SECRET_ACCESS_KEY={secret} sh -c 'mkdir -p \"$(dirname "
             f"{store}/{{shard}})\" && cat > {store}/{{shard}}'")
    printed = featurize("webdataset", "--shards", tmp_path / "in/00000.tar", "--out", write,
                        "--out-read", f"pipe:cat {store}/{{shard}}", *FLAGS, capsys=capsys)
    written = [p.read_bytes() for p in store.rglob("*.json")]
    assert len(written) == 4 and all(secret.encode() not in data for data in written)
    assert MASK.encode() in (store / "manifest.json").read_bytes()
    assert secret not in printed + caplog.text


def test_a_vocabulary_at_a_url_with_a_password_is_given_to_the_merge_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    write_img2dataset(tmp_path / "in", count=6, per_shard=3, image_size=64)
    shards = str(tmp_path / "in/{00000..00001}.tar")
    featurize("webdataset", "--shards", shards, "--out", tmp_path / "first", *FLAGS,
              capsys=capsys)
    leftover = tmp_path / "out/.tmp-unit-000001-killed"  # what a killed task left
    leftover.mkdir(parents=True)
    with serve_folder(tmp_path / "first", basic_auth="alice:pw") as http:
        vocab = http.url.replace("://", "://alice:pw@") + "/vocab.json"
        featurize("webdataset", "--shards", shards, "--out", tmp_path / "out", "--vocab", vocab,
                  *FLAGS, capsys=capsys)  # one task: its merge has the vocabulary's password
        assert not leftover.exists()
        with pytest.raises(SystemExit, match=r"held a credential.*give it to the merge again"):
            main(["merge", "--out", str(tmp_path / "out")])
        featurize("merge", "--out", tmp_path / "out", "--vocab", vocab, capsys=capsys)
    manifest = (tmp_path / "out/manifest.json").read_text()
    assert "alice:***@" in manifest and "pw@" not in manifest


@pytest.mark.slow
def test_an_input_cut_midway_is_read_again_from_its_start(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]):
    write_img2dataset(tmp_path / "in", count=8, per_shard=4, image_size=64)
    featurize("webdataset", "--shards", tmp_path / "in/{00000..00001}.tar", "--out",
              tmp_path / "local", *FLAGS, capsys=capsys)
    with serve_folder(tmp_path / "in", drop_after={"00001.tar": 3000}) as http:
        featurize("webdataset", "--shards", f"{http.url}/{{00000..00001}}.tar", "--out",
                  tmp_path / "remote", *FLAGS, capsys=capsys)
        assert http.count("/00001.tar") == 2
    for name in ("train/shard-000000.tar", "train/shard-000001.tar", "vocab.json"):
        assert (tmp_path / "remote" / name).read_bytes() == (
            tmp_path / "local" / name).read_bytes()
    with serve_folder(tmp_path / "in", missing={"00001.tar"}) as http:
        done = subprocess.run(
            [sys.executable, "-m", "featurizer", "webdataset", "--shards",
             f"{http.url}/{{00000..00001}}.tar", "--out", str(tmp_path / "gone"), *FLAGS],
            capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"defrag featurize webdataset: error: 1 of the task's 2 input shards failed, e.g. cannot "
        f"read {http.url}/00001.tar (curl exit 22, HTTP 404 Not Found); run the task again")
    assert (tmp_path / "gone/parts/000000.json").is_file()  # the other shard was done


@pytest.mark.slow
def test_torchrun_ranks_are_the_tasks(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    write_img2dataset(tmp_path / "in", count=9, per_shard=3, image_size=64)
    shards = str(tmp_path / "in/{00000..00002}.tar")
    featurize("webdataset", "--shards", shards, "--out", tmp_path / "one", *FLAGS, capsys=capsys)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
         "featurizer", "webdataset", "--shards", shards, "--out", str(tmp_path / "ranks"),
         *FLAGS], capture_output=True, text=True, cwd=ROOT, env={**os.environ,
                                                                 "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "task 0 of 2: 2 of 3 input shards" in done.stdout
    assert "task 1 of 2: 1 of 3 input shards" in done.stdout
    featurize("merge", "--out", tmp_path / "ranks", capsys=capsys)
    for name in ("train/shard-000000.tar", "train/shard-000002.tar", "vocab.json"):
        assert (tmp_path / "ranks" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_damaged_tars_and_hostile_names_are_problems_not_losses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write_img2dataset(tmp_path / "in", count=4, per_shard=4, image_size=64)
    data = (tmp_path / "in/00000.tar").read_bytes()
    with tarfile.open(tmp_path / "in/00000.tar") as archive:
        starts = [info.offset for info in archive]  # 3 members (jpg, json, txt) a sample
    flipped = bytearray(data)
    flipped[starts[3] + 5] ^= 0xFF  # sample 1's first header fails its checksum
    damaged = {"flipped": bytes(flipped), "cut": data[:starts[6]]}  # cut between two members
    for name, content in damaged.items():
        (tmp_path / f"{name}.tar").write_bytes(content)
        read = list(read_samples(str(tmp_path / f"{name}.tar"), "train", 10))
        kept = [item.key for item in read if not isinstance(item, Problem)]
        problems = [item for item in read if isinstance(item, Problem)]
        assert kept == ["000000000", "000000001"][:1 if name == "flipped" else 2], name
        assert [p.reason for p in problems] == ["malformed"], (name, problems)
        assert f"the shard ends early or is damaged after {3 * len(kept)} files" in \
            problems[0].detail

    hostile = [{"__key__": f"00{i}", "jpg": jpeg((9, 9, 9)), "txt": b"A dog .",
                "json": meta(split=split)}
               for i, split in enumerate(["..", ".", "vocab.json", "parts", ".hidden"])]
    hostile.append({"__key__": "caf\udce9", "txt": b"no image"})  # a name that is not UTF-8
    hostile.append({"__key__": "big", "jpg": bytes(2000), "txt": b"A dog ."})
    write_tar(tmp_path / "hostile.tar", hostile)
    monkeypatch.setattr(img2dataset, "MAX_SAMPLE_BYTES", 1000)
    read = list(read_samples(str(tmp_path / "hostile.tar"), "train", 10))
    assert all(isinstance(item, Problem) for item in read)
    reasons = sorted((item.origin.item, item.reason) for item in read)
    assert reasons == [("000", "malformed"), ("001", "malformed"), ("002", "malformed"),
                       ("003", "malformed"), ("004", "malformed"), ("big", "missing_image"),
                       ("big.jpg", "malformed"), ("caf\\xe9", "missing_image")], reasons
    assert json.dumps([item.to_json() for item in read]).encode("utf-8")


def test_an_over_long_caption_or_a_failing_sample_costs_only_itself(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """A caption over --max-caption-chars is left out unparsed (caption_too_long); with the
    limit raised, one spaCy refuses (E088: over 1,000,000 characters) costs only itself, as do
    a json nested too deep to decode and a box source's failure (injected) their sample: each
    named by shard and key, the task goes on."""
    fullframe = FullFrameSource.__call__

    def failing(self, image, boxes=None):
        if image.size == (13, 13):
            raise RuntimeError("no boxes for this one")
        return fullframe(self, image, boxes)

    monkeypatch.setattr(FullFrameSource, "__call__", failing)
    shard = tmp_path / "in/00000.tar"
    write_tar(shard, [
        {"__key__": "000000000", "jpg": jpeg((200, 30, 30)),
         "json": meta(captions=["x" * 10_001, "A red dog runs ."])},
        {"__key__": "000000001", "jpg": jpeg((30, 200, 30)), "txt": b"dog " * 250_001},
        {"__key__": "000000002", "jpg": jpeg((9, 9, 200)), "txt": b"A dog .",
         "json": b"[" * 100_000},
        {"__key__": "000000003", "jpg": jpeg((90, 90, 90)), "txt": b"A grey cat sleeps ."},
        {"__key__": "000000004", "jpg": jpeg((90, 90, 90), (13, 13)), "txt": b"A cat ."}])
    printed = featurize("webdataset", "--shards", shard, "--out", tmp_path / "out", *FLAGS,
                        capsys=capsys)
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["skipped"]["by_reason"] == {"caption_too_long": 1, "no_captions": 1,
                                                "unexpected_error": 2}
    items = {item["item"]: item for item in manifest["skipped"]["items"]}
    assert all(item["file"] == str(shard) for item in items.values())
    assert items["000000000"]["reason"] == "caption_too_long"
    assert "has 10001 characters, over the limit of 10000 (--max-caption-chars); left out" in \
        items["000000000"]["detail"]
    assert "caption_too_long" not in items["000000001"]["detail"]  # one no_captions, named:
    assert "has 1000003 characters, over the limit" in items["000000001"]["detail"]
    assert items["000000002"]["reason"] == "unexpected_error"
    assert "RecursionError" in items["000000002"]["detail"]
    assert items["000000004"]["detail"] == ("00000.tar/000000004: the box source failed "
                                            "(RuntimeError: 'no boxes for this one'); image "
                                            "skipped")
    assert manifest["splits"]["train"]["captions"] == 2 and "train: 2 images" in printed

    printed = featurize("webdataset", "--shards", shard, "--out", tmp_path / "raised", *FLAGS,
                        "--max-caption-chars", "2000000", capsys=capsys)
    manifest = json.loads((tmp_path / "raised/manifest.json").read_text())
    assert manifest["skipped"]["by_reason"] == {"no_captions": 1, "unexpected_error": 2}
    refused = next(item for item in manifest["skipped"]["items"]
                   if item["item"] == "000000001")
    assert "could not be parsed (ValueError: '[E088] Text of length 1000003" in \
        refused["detail"]
    assert manifest["splits"]["train"]["captions"] == 3 and "train: 2 images" in printed


def test_a_samples_bytes_are_bounded_and_its_links_counted(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """One sample's files together are bounded in bytes (not each file alone); an entry no
    sample is read for is never read; links, never read, are a problem named by key, so a
    sample of links alone does not vanish uncounted."""
    monkeypatch.setattr(img2dataset, "MAX_SAMPLE_BYTES", 1000)
    with tarfile.open(tmp_path / "in.tar", "w") as archive:
        for name, content in [("two.jpg", bytes(600)), ("two.webp", bytes(600)),
                              ("two.txt", b"A dog ."), ("extra.npy", bytes(5000)),
                              ("extra.jpg", bytes(600)), ("extra.txt", b"A cat ."),
                              ("links.jpg", "/etc/passwd"), ("links.txt", "two.txt"),
                              ("half.jpg", bytes(600)), ("half.json", "../x.json"),
                              ("half.txt", b"A cow .")]:
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                archive.addfile(info)
            else:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
    read = list(read_samples(str(tmp_path / "in.tar"), "train", 10))
    kept = {item.key: item for item in read if not isinstance(item, Problem)}
    assert sorted(kept) == ["extra", "half", "two"] and kept["two"].image == bytes(600)
    problems = {item.origin.item: item for item in read if isinstance(item, Problem)}
    assert {item: problem.reason for item, problem in problems.items()} == {
        "two.webp": "malformed", "links": "malformed", "half": "malformed"}
    assert "600 bytes, which would take its sample's files past the bound of 1000 bytes" in \
        problems["two.webp"].detail
    assert problems["links"].detail == ("links.jpg, links.txt: links or other special files, "
                                        "not files; sample skipped")
    assert problems["half"].detail.endswith("half.json: links or other special files, not "
                                            "files; left out")


def test_a_chunk_of_samples_is_bounded_in_bytes_not_only_in_count(
        monkeypatch: pytest.MonkeyPatch):
    """The samples parsed together hold at most CHUNK_BYTES of images and captions (the one
    that passes it ends its chunk), not CHUNK samples of any size."""
    monkeypatch.setattr(ingest, "CHUNK_BYTES", 2500)
    samples = [Sample(f"{i}", bytes(1000), ["A dog ."], "train", Origin("in.tar"))
               for i in range(7)]
    samples.insert(3, Sample("long", b"", ["dog " * 1000], "train", Origin("in.tar")))
    assert [[item.key for item in chunk] for chunk in ingest._chunks(iter(samples))] == [
        ["0", "1", "2"], ["long"], ["3", "4", "5"], ["6"]]
