"""The featurizer end to end on tiny generated data: shard contents, manifest, bad inputs,
resumability, determinism, vocabulary reuse and the CLI."""

import gc
import json
import weakref
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

import featurizer.pipeline as pipeline
import featurizer.shards as shards_module
from defrag.vocab import Vocabulary
from featurizer.boxes import GivenSource
from featurizer.command import main
from featurizer.parsing import ParsedCaption, ParserUnavailable
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl

CAPTIONS = ["A black dog runs in the grass .", "Two girls play on the beach .",
            "A man in a red shirt rides a bike .", "A brown dog jumps over a fence ."]


def write_image(path: Path, index: int, kind: str = "JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40 + index, 30), (index * 37 % 256, 90, 160)).save(path, kind)


def make_dataset(root: Path, good: int = 5, bad: bool = False, split: str = "train") -> Path:
    """`good` images with two captions each; with `bad`, also every kind of broken input."""
    lines = []
    for i in range(good):
        name = f"img{i:02d}.png" if i % 3 == 2 else f"img{i:02d}.jpg"
        write_image(root / "images" / name, i, "PNG" if name.endswith("png") else "JPEG")
        lines.append({"image": f"images/{name}", "split": split,
                      "captions": [CAPTIONS[i % 4], CAPTIONS[(i + 1) % 4]],
                      "boxes": [[2, 3, 20, 25], [0, 0, 10, 10]]})
    if bad:
        write_image(root / "images/truncated.jpg", 7)
        data = (root / "images/truncated.jpg").read_bytes()
        (root / "images/truncated.jpg").write_bytes(data[: len(data) // 2])
        (root / "images/garbage.jpg").write_bytes(b"this is not an image")
        (root / "images/folder.jpg").mkdir()
        write_image(root / "images/anim.gif", 3, "GIF")
        write_image(root / "images/wordless.jpg", 4)
        lines += [{"image": f"images/{name}", "split": split, "captions": ["A dog ."]}
                  for name in ("truncated.jpg", "garbage.jpg", "folder.jpg", "anim.gif",
                               "missing.jpg")]
        lines.append({"image": "images/wordless.jpg", "split": split, "captions": [". . .", ""]})
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(jsonl: Path, out: Path, **overrides) -> dict:
    defaults = {"parser": "spacy", "boxes": "given", "shard_size": 2, "workers": 1,
                "min_word_count": 1}
    settings = Settings(out=out, **{**defaults, **overrides})
    return featurize(read_jsonl(jsonl, jsonl.parent, "train"), settings)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("*/*.tar"))}


def shard_captions(out: Path) -> list[dict]:
    """Every caption of every shard of `out`, in shard and sample order."""
    urls = [str(p) for p in sorted(out.glob("*/*.tar"))]
    return [caption for sample in wds.WebDataset(urls, shardshuffle=False)
            for caption in json.loads(sample["json"])["captions"]]


def test_shards_hold_original_images_captions_and_boxes(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data")
    manifest = run(jsonl, tmp_path / "out")
    train = manifest["splits"]["train"]
    assert (train["images"], train["captions"]) == (5, 10)
    assert [s["file"] for s in train["shards"]] == [f"train/shard-00000{i}.tar" for i in range(3)]
    assert [s["samples"] for s in train["shards"]] == [2, 2, 1]
    assert manifest["parser"]["name"] == "spacy" and manifest["box_source"]["name"] == "given"
    vocab = Vocabulary.load(tmp_path / "out/vocab.json")
    assert manifest["vocabulary"]["relations"] == vocab.relations and "amod" in vocab.relations
    urls = [str(tmp_path / "out" / s["file"]) for s in train["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [
        f"images__img{i:02d}_{'png' if i % 3 == 2 else 'jpg'}" for i in range(5)]
    for index, sample in enumerate(samples):
        meta = json.loads(sample["json"])
        extension = "png" if index % 3 == 2 else "jpg"
        original = tmp_path / "data" / meta["file"]
        assert sample[extension] == original.read_bytes()  # the file as it is, not re-encoded
        assert (meta["image_id"], meta["split"], meta["file"]) == (
            f"images__img{index:02d}_{extension}", "train", f"images/img{index:02d}.{extension}")
        assert (meta["width"], meta["height"]) == (40 + index, 30)
        assert meta["boxes"] == [[0, 0, 40 + index, 30], [2, 3, 20, 25], [0, 0, 10, 10]]
        assert meta["box_scores"][0] == 1.0 and meta["box_source"] == "given"
        first = meta["captions"][0]
        assert first["text"] == CAPTIONS[index % 4]
        assert first["tokens"] == [w.lower() for w in first["text"].split() if w != "."]
        assert all(len(t) == 3 for t in first["triplets"]) and first["triplets"]
        assert vocab.encode(first).shape[1] == 3
        tree = first["tree"]
        assert set(tree) == {"heads", "relations", "pos"}
        assert len(tree["heads"]) == len(tree["relations"]) == len(tree["pos"])
        assert len(tree["heads"]) == len(first["tokens"]) and tree["heads"].count(-1) == 1
    decoded = next(iter(wds.WebDataset(urls[:1], shardshuffle=False).decode("pil")))
    assert decoded["jpg"].size == (40, 30)


def test_bad_inputs_are_reported_counted_and_skipped(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data", good=3, bad=True)
    manifest = run(jsonl, tmp_path / "out")
    assert manifest["splits"]["train"]["images"] == 3
    # one item per skipped image: the wordless image's two captions are named in its no_captions
    # item, not counted again (one found empty by the source, one wordless by the parser)
    expected = {"bad_image": 3, "missing_image": 1, "no_captions": 1, "unsupported_format": 1}
    assert manifest["splits"]["train"]["skipped"] == expected
    assert manifest["skipped"]["by_reason"] == expected
    assert manifest["skipped"]["count"] == 6
    items = {(item["reason"], item["line"]) for item in manifest["skipped"]["items"]}
    lines = {name: n for n, name in enumerate(
        ["truncated", "garbage", "folder", "anim", "missing", "wordless"], start=4)}
    assert {("bad_image", lines["truncated"]), ("bad_image", lines["garbage"]),
            ("bad_image", lines["folder"]), ("unsupported_format", lines["anim"]),
            ("missing_image", lines["missing"]), ("no_captions", lines["wordless"])} == items
    assert all(item["file"] == str(jsonl) for item in manifest["skipped"]["items"])
    truncated = next(i for i in manifest["skipped"]["items"] if i["line"] == lines["truncated"])
    assert "truncated.jpg" in truncated["detail"]
    wordless = next(i for i in manifest["skipped"]["items"] if i["line"] == lines["wordless"])
    assert "'. . .' has no words" in wordless["detail"] and "'' is empty" in wordless["detail"]


def test_a_kept_images_skipped_captions_are_counted_once(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data", good=2)
    write_image(tmp_path / "data/images/extra.jpg", 9)
    with jsonl.open("a") as stream:
        stream.write(json.dumps({"image": "images/extra.jpg", "split": "val",
                                 "captions": [CAPTIONS[0], "", ". . ."]}) + "\n")
    manifest = run(jsonl, tmp_path / "out", splits=["train", "val"])
    assert manifest["splits"]["val"]["skipped"] == {"empty_caption": 1, "no_words": 1}
    assert manifest["skipped"]["count"] == 2


def test_rerun_skips_finished_shards_and_redoes_broken_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jsonl = make_dataset(tmp_path / "data", good=6)
    out = tmp_path / "out"
    run(jsonl, out)
    first = shard_bytes(out)
    written = []
    real_write = pipeline.write_shard
    monkeypatch.setattr(pipeline, "write_shard",
                        lambda spec, *a: written.append(spec.index) or real_write(spec, *a))
    run(jsonl, out)
    assert written == []  # everything finished: nothing redone
    with (out / "train/shard-000000.tar").open("ab") as tar:
        tar.write(b"\0")  # changed after its sidecar was written: sha256 mismatch
    (out / "train/shard-000001.json").unlink()  # killed between tar rename and sidecar
    (out / "train/shard-000002.tar.tmp-123").write_bytes(b"half a shard")
    (out / "train/shard-000007.tar").write_bytes(b"from an older, bigger run")
    manifest = run(jsonl, out)
    assert written == [0, 1]
    assert shard_bytes(out) == first
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        f"shard-00000{i}.{ext}" for i in range(3) for ext in ("json", "tar")]
    assert manifest["splits"]["train"]["images"] == 6


def test_a_format_1_folder_is_rewritten_with_trees(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder written before trees (format 1) is not taken as finished: the re-run rewrites
    every shard with trees, and the tokens, triplets and vocabulary stay the same."""
    jsonl = make_dataset(tmp_path / "data", good=4)
    out = tmp_path / "out"
    with monkeypatch.context() as before_trees:
        before_trees.setattr(shards_module, "FORMAT_VERSION", 1)
        before_trees.setattr(pipeline, "FORMAT_VERSION", 1)
        before_trees.setattr(ParsedCaption, "caption", lambda self, text: {
            "text": text, "tokens": self.tokens, "triplets": self.triplets})
        assert run(jsonl, out)["format"] == 1
    old_captions, old_vocab = shard_captions(out), (out / "vocab.json").read_bytes()
    assert old_captions and all("tree" not in caption for caption in old_captions)
    assert {json.loads(p.read_text())["format"] for p in out.glob("train/*.json")} == {1}
    written = []
    real_write = pipeline.write_shard
    monkeypatch.setattr(pipeline, "write_shard",
                        lambda spec, *a: written.append(spec.index) or real_write(spec, *a))
    assert run(jsonl, out)["format"] == 2
    assert written == [0, 1]  # both shards rewritten, none skipped as complete
    new_captions = shard_captions(out)
    assert all(len(c["tree"]["heads"]) == len(c["tokens"]) for c in new_captions)
    assert [{k: v for k, v in c.items() if k != "tree"} for c in new_captions] == old_captions
    assert (out / "vocab.json").read_bytes() == old_vocab
    assert {json.loads(p.read_text())["format"] for p in out.glob("train/*.json")} == {2}
    run(jsonl, tmp_path / "clean")
    assert shard_bytes(out) == shard_bytes(tmp_path / "clean")
    # the sidecar's own format is compared too (not only through the fingerprint)
    sidecar = out / "train/shard-000001.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "format": 1}))
    written.clear()
    run(jsonl, out)
    assert written == [1]


def test_a_shard_killed_while_writing_is_never_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jsonl = make_dataset(tmp_path / "data", good=4)
    out = tmp_path / "out"
    real_write = wds.TarWriter.write
    calls = []

    def dying_write(self, sample):
        calls.append(sample["__key__"])
        if len(calls) == 3:  # first sample of the second shard
            raise KeyboardInterrupt
        return real_write(self, sample)

    monkeypatch.setattr(wds.TarWriter, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run(jsonl, out)
    names = sorted(p.name for p in (out / "train").iterdir())
    # the interrupted shard: its temporary file removed, no sidecar, no .tar
    assert names == ["shard-000000.json", "shard-000000.tar"]
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(wds.TarWriter, "write", real_write)
    run(jsonl, out)
    run(jsonl, tmp_path / "clean")
    assert shard_bytes(out) == shard_bytes(tmp_path / "clean")


def test_same_input_gives_identical_shards(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data", good=5)
    run(jsonl, tmp_path / "a")
    run(jsonl, tmp_path / "b", parse_batch_size=3)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    assert (tmp_path / "a/vocab.json").read_bytes() == (tmp_path / "b/vocab.json").read_bytes()


def test_settings_change_redoes_shards(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data", good=3)
    run(jsonl, tmp_path / "out")
    manifest = run(jsonl, tmp_path / "out", boxes="fullframe")
    for shard in manifest["splits"]["train"]["shards"]:
        for sample in wds.WebDataset(str(tmp_path / "out" / shard["file"]), shardshuffle=False):
            assert len(json.loads(sample["json"])["boxes"]) == 1


def test_new_split_reuses_an_existing_vocabulary(tmp_path: Path) -> None:
    train = run(make_dataset(tmp_path / "train", good=4), tmp_path / "train_out")
    test_jsonl = make_dataset(tmp_path / "test", good=2, split="test")
    with pytest.raises(ValueError, match="--vocab"):
        run(test_jsonl, tmp_path / "test_out")
    manifest = run(test_jsonl, tmp_path / "test_out", vocab=tmp_path / "train_out")
    assert (tmp_path / "test_out/vocab.json").read_bytes() == (
        tmp_path / "train_out/vocab.json").read_bytes()
    assert manifest["vocabulary"]["source"].startswith("reused from")
    assert manifest["vocabulary"]["relations"] == train["vocabulary"]["relations"]
    assert manifest["splits"]["test"]["images"] == 2


def test_word_vectors_limit_and_split_selection(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data", good=5)
    vectors = tmp_path / "glove.txt"
    vectors.write_text("dog 1 2\ngrass 3 4\nunseen 5 6\n")
    manifest = run(jsonl, tmp_path / "out", word_vectors=vectors, limit=3, splits=["train"])
    assert Vocabulary.load(tmp_path / "out/vocab.json").words == ["dog", "grass", "unseen"]
    assert manifest["vocabulary"]["word_vectors"] == str(vectors)
    assert manifest["splits"]["train"]["images"] == 3
    assert 0 < manifest["splits"]["train"]["dictionary_coverage"] < 0.5
    with pytest.raises(ValueError, match=r"split\(s\) \['dev'\] not in the source"):
        run(jsonl, tmp_path / "out", splits=["dev"])


def test_missing_stanza_models_fail_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANZA_RESOURCES_DIR", str(tmp_path / "no_models"))
    with pytest.raises(ParserUnavailable, match="STANZA_RESOURCES_DIR"):
        run(make_dataset(tmp_path / "data", good=1), tmp_path / "out", parser="stanza")
    assert not (tmp_path / "out").exists()


def test_cli_jsonl_and_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    jsonl = make_dataset(tmp_path / "data", good=3)
    out = tmp_path / "out"
    assert main(["jsonl", "--jsonl", str(jsonl), "--out", str(out), "--parser", "spacy",
                 "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]) == 0
    assert "train: 3 images, 6 captions" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["created_by"]["command"].startswith("defrag featurize jsonl --jsonl")
    (tmp_path / "f8k").mkdir()
    (tmp_path / "f8k/tokens.txt").write_text("a.jpg#0\tA dog .\n")
    (tmp_path / "f8k/train.txt").write_text("a.jpg\n")
    with pytest.raises(SystemExit, match="featurize flickr: error: .*test.txt does not exist"):
        main(["flickr", "--root", str(tmp_path / "f8k"), "--token-file", "tokens.txt",
              "--split-file", "train=train.txt", "--split-file", "test=test.txt",
              "--splits", "train", "test", "--out", str(tmp_path / "f8k_out"), "--parser", "spacy"])


def test_cli_reports_a_line_that_is_not_utf8_once_and_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jsonl = make_dataset(tmp_path / "data", good=3)
    with jsonl.open("ab") as stream:  # the reproduction, and an image without a caption
        stream.write(b'{"image":"images/a.jpg","captions":["caf\xe9"],"split":"train"}\n'
                     b'{"image":"images/img00.png","captions":["", " "],"split":"train"}\n')
    out = tmp_path / "out"
    assert main(["jsonl", "--jsonl", str(jsonl), "--out", str(out), "--parser", "spacy",
                 "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["images"] == 3
    assert manifest["skipped"]["by_reason"] == {"no_captions": 1, "not_utf8": 1}
    assert manifest["skipped"]["count"] == 2
    assert manifest["splits"]["train"]["skipped"] == {"no_captions": 1}  # line 4: split unknown
    reports = [r.getMessage() for r in caplog.records if f"{jsonl}:4:" in r.getMessage()]
    assert len(reports) == 1 and "not_utf8: byte 0xe9" in reports[0] and "UTF-8" in reports[0]


def test_cli_escaped_lone_surrogates_are_reported_and_the_run_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jsonl = make_dataset(tmp_path / "data", good=3)
    write_image(tmp_path / "data/images/extra.jpg", 9)
    with jsonl.open("a") as stream:  # valid JSON escapes of half a surrogate pair: not UTF-8
        stream.write('{"image": "images/a.jpg", "captions": ["caf\\udce9"], "split": "train"}\n'
                     '{"image": "images/extra.jpg", "captions": ["A dog runs .", "\\ud83d"], '
                     '"split": "train"}\n')
    out = tmp_path / "out"
    assert main(["jsonl", "--jsonl", str(jsonl), "--out", str(out), "--parser", "spacy",
                 "--boxes", "fullframe", "--workers", "1", "--min-word-count", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["images"] == 4
    assert manifest["splits"]["train"]["skipped"] == {"no_captions": 1, "not_utf8": 1}
    items = {(i["reason"], i["line"], i["item"]) for i in manifest["skipped"]["items"]}
    assert items == {("no_captions", 4, ""), ("not_utf8", 5, "captions[1]")}
    reports = [r.getMessage() for r in caplog.records if f"{jsonl}:4:" in r.getMessage()]
    assert len(reports) == 1 and "'caf\\xe9' is not UTF-8" in reports[0]


@pytest.mark.parametrize(("split", "reason"), [
    ("../escaped", "a '/'"), ("a/b", "a '/'"), ("..", "an empty, '.' or '..' path part"),
    ("", "an empty, '.' or '..' path part"), ("val\n2014", "a control character"),
    ("pipe:x", "a URL scheme or a pipe: command")])
def test_a_split_name_that_is_no_folder_name_is_refused_before_any_shard(
        tmp_path: Path, split: str, reason: str) -> None:
    jsonl = make_dataset(tmp_path / "data", good=3)
    lines = jsonl.read_text().splitlines()
    jsonl.write_text("\n".join([*lines[:-1], lines[-1].replace('"train"', json.dumps(split))]))
    with pytest.raises(ValueError) as failure:
        run(jsonl, tmp_path / "out")
    assert str(failure.value) == (
        f"split {split!r} cannot name a folder of --out: it holds {reason}; rename it in the "
        f"source (a JSONL \"split\", --split-file NAME=FILE, --split-map) or leave it out with "
        f"--splits")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "out").exists()


def test_cli_karpathy_with_split_map(tmp_path: Path) -> None:
    for i in range(3):
        write_image(tmp_path / f"images/val2014/COCO_{i}.jpg", i)
    data = {"images": [{"filepath": "val2014", "filename": f"COCO_{i}.jpg",
                        "split": ("train", "restval", "val")[i],
                        "sentences": [{"raw": CAPTIONS[i]}]} for i in range(3)]}
    (tmp_path / "dataset_coco.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    assert main(["karpathy", "--json", str(tmp_path / "dataset_coco.json"), "--images",
                 str(tmp_path / "images"), "--out", str(out), "--split-map", "restval=train",
                 "--parser", "spacy", "--boxes", "fullframe", "--workers", "1",
                 "--min-word-count", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert {s: c["images"] for s, c in manifest["splits"].items()} == {"train": 2, "val": 1}
    sample = next(iter(wds.WebDataset(str(out / "val/shard-000000.tar"), shardshuffle=False)))
    assert json.loads(sample["json"])["file"] == "val2014/COCO_2.jpg"


def test_cli_synthetic_dataset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["synthetic", "--out", str(out), "--num-train", "6", "--num-val", "2",
                 "--workers", "1", "--shard-size", "4"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["parser"]["name"] == "spacy" and manifest["box_source"]["name"] == "given"
    assert {s: c["images"] for s, c in manifest["splits"].items()} == {"train": 6, "val": 2}
    assert "amod" in manifest["vocabulary"]["relations"]
    sample = next(iter(wds.WebDataset(str(out / "train/shard-000000.tar"), shardshuffle=False)))
    assert len(json.loads(sample["json"])["boxes"]) > 1  # the scene's shapes, given


@pytest.mark.slow
def test_worker_processes_write_the_same_shards(tmp_path: Path) -> None:
    jsonl = make_dataset(tmp_path / "data", good=6, bad=True)
    serial = run(jsonl, tmp_path / "serial")
    parallel = run(jsonl, tmp_path / "parallel", workers=2)
    assert shard_bytes(tmp_path / "serial") == shard_bytes(tmp_path / "parallel")
    assert serial["skipped"] == parallel["skipped"]
    assert serial["splits"] == parallel["splits"]


def test_cli_refuses_images_outside_the_folder_and_keeps_one_stem_twice(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jsonl = make_dataset(tmp_path / "data", good=2)
    write_image(tmp_path / "data/images/img00.png", 5, "PNG")  # img00.jpg's stem, another file
    write_image(tmp_path / "secret.jpg", 6)
    with jsonl.open("a") as stream:
        for name in ("images/img00.png", "../secret.jpg", "images/img00.jpg"):
            stream.write(json.dumps({"image": name, "captions": [CAPTIONS[0]]}) + "\n")
    flags = ["--out", str(tmp_path / "out"), "--parser", "spacy", "--boxes", "fullframe",
             "--workers", "1", "--min-word-count", "1"]
    assert main(["jsonl", "--jsonl", str(jsonl), *flags]) == 0
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["splits"]["train"]["images"] == 3  # img00.jpg, img01.jpg and img00.png
    assert manifest["splits"]["train"]["skipped"] == {"duplicate_image": 1, "outside_images": 1}
    assert f"skipped: {jsonl}:4: outside_images: image '../secret.jpg' is " in caplog.text
    assert main(["jsonl", "--jsonl", str(jsonl), "--allow-outside-images", *flags]) == 0
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["splits"]["train"]["images"] == 4


def test_each_source_keeps_its_own_defaults() -> None:
    """synthetic's defaults (spaCy, given boxes) and webdataset's (one shard per input shard)
    are theirs alone: argparse shares a parent parser's flags between subcommands."""
    from featurizer.command import build_parser

    parser = build_parser()
    jsonl = parser.parse_args(["jsonl", "--jsonl", "x.jsonl", "--out", "o"])
    assert (jsonl.parser, jsonl.boxes, jsonl.shard_size) == ("stanza", "selective_search", 1000)
    synthetic = parser.parse_args(["synthetic", "--out", "o"])
    assert (synthetic.parser, synthetic.boxes) == ("spacy", "given")
    assert parser.parse_args(["webdataset", "--shards", "x", "--out", "o"]).shard_size is None


def test_an_over_long_caption_is_left_out_and_its_limit_decides_the_shards(
        tmp_path: Path) -> None:
    """A caption over max_caption_chars is left out unparsed (caption_too_long, named by line),
    an image left without captions is one no_captions, and another limit rewrites the shards."""
    for index in (1, 2):
        write_image(tmp_path / f"data/images/{index}.jpg", index)
    long = "A dog runs on the grass ." * 4  # 100 characters
    jsonl = tmp_path / "data/data.jsonl"
    jsonl.write_text(json.dumps({"image": "images/1.jpg", "captions": [long, CAPTIONS[0]]})
                     + "\n" + json.dumps({"image": "images/2.jpg", "captions": [long]}) + "\n")
    manifest = run(jsonl, tmp_path / "out", max_caption_chars=99)
    assert manifest["skipped"]["by_reason"] == {"caption_too_long": 1, "no_captions": 1}
    items = manifest["skipped"]["items"]
    assert [(item["line"], item["reason"]) for item in items] == [
        (1, "caption_too_long"), (2, "no_captions")]
    assert all("has 100 characters, over the limit of 99 (--max-caption-chars)" in
               item["detail"] for item in items)
    manifest = run(jsonl, tmp_path / "out", max_caption_chars=100)
    assert manifest["skipped"]["count"] == 0 and manifest["splits"]["train"]["captions"] == 3


def test_a_box_source_failing_on_one_image_costs_only_that_image(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any error of the box source on one image is that image's problem, named by its line,
    not the run's (the fault injected into the real box source)."""
    jsonl = make_dataset(tmp_path / "data", good=3)
    given = GivenSource.__call__

    def failing(self, image, boxes=None):
        if image.size == (41, 30):  # images/img01.jpg
            raise RuntimeError("no boxes for this one")
        return given(self, image, boxes)

    monkeypatch.setattr(GivenSource, "__call__", failing)
    manifest = run(jsonl, tmp_path / "out")
    assert manifest["splits"]["train"]["images"] == 2
    [item] = manifest["skipped"]["items"]
    assert (item["line"], item["reason"]) == (2, "unexpected_error")
    assert item["detail"] == ("images/img01.jpg: the box source failed (RuntimeError: 'no "
                              "boxes for this one'); image skipped")


def test_a_shard_holds_one_decoded_image_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's images are read, boxed and written one by one: when an image is boxed, the
    shard's earlier images are gone, so a shard of 1,000 large images does not hold them all."""
    jsonl = make_dataset(tmp_path / "data", good=5)
    loaded: list[weakref.ref] = []
    alive: list[int] = []
    real_load, given = shards_module.load_image, GivenSource.__call__

    def load(*args):
        image = real_load(*args)
        loaded.append(weakref.ref(image.image))
        return image

    def counting(self, image, boxes=None):
        gc.collect()
        alive.append(sum(ref() is not None for ref in loaded))
        return given(self, image, boxes)

    monkeypatch.setattr(shards_module, "load_image", load)
    monkeypatch.setattr(GivenSource, "__call__", counting)
    manifest = run(jsonl, tmp_path / "out", shard_size=5)
    assert manifest["splits"]["train"]["images"] == 5 and alive == [1] * 5


def test_a_shard_size_caption_limit_or_image_limit_below_one_is_refused(
        capsys: pytest.CaptureFixture) -> None:
    """--shard-size 0 or below made webdataset write one image per shard, --limit -3 all images
    but the last 3 of each split: refused, as is a --max-caption-chars below 1, naming the
    flag."""
    from featurizer.command import build_parser

    for source in (["webdataset", "--shards", "x"], ["jsonl", "--jsonl", "x.jsonl"]):
        for flag, value in (("--shard-size", "0"), ("--shard-size", "-3"),
                            ("--max-caption-chars", "0"), ("--limit", "-3")):
            with pytest.raises(SystemExit):
                build_parser().parse_args([*source, "--out", "o", flag, value])
            assert f"argument {flag}: a whole number of at least 1, got '{value}'" in \
                capsys.readouterr().err
