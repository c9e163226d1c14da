"""Source readers: Flickr token format (with the release's quirks), Karpathy JSON and JSONL."""

import json
import re
from pathlib import Path

import pytest

from featurizer.records import image_key
from featurizer.sources import read_flickr, read_jsonl, read_karpathy, rename_splits

NOT_UTF8 = b"caf\xe9"  # "café" saved as Latin-1: byte 0xe9 is not UTF-8


def reasons(problems) -> list[tuple[str, int | None]]:
    return [(p.reason, p.origin.line) for p in problems]


@pytest.fixture
def flickr(tmp_path: Path) -> Path:
    """A Flickr8k-style release: token file with an odd key, a duplicate, empty captions."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "tokens.txt").write_text(
        "1_a.jpg#0\tA black dog runs .\n"                  # 1
        "1_a.jpg#1\tA dog in the grass .\n"                # 2
        "2_b.jpg#0\tTwo girls play .\n"                    # 3
        "2_b.jpg.1#0\tpeople waiting for the subway\n"     # 4: the release's odd key
        "1_a.jpg#0\tA repeated key .\n"                    # 5: duplicate key
        "2_b.jpg#1\t   \n"                                 # 6: empty caption
        "no tab on this line\n"                            # 7: malformed
        "\n"                                               # 8: blank, ignored
        "3_c.jpg#0\tA cat sleeps .\n"                      # 9
        "9_z.jpg#0\tAn image in no split .\n"             # 10
        "4_d.jpg#0\t \n")                                  # 11: 4_d's only caption, empty
    (text / "train.txt").write_text("1_a.jpg\n2_b.jpg\n1_a.jpg\n")  # line 3: listed twice
    (text / "dev.txt").write_text("3_c.jpg\n4_d.jpg\n")  # 4_d has no usable caption
    return tmp_path


def split_files(root: Path) -> dict[str, Path]:
    return {"train": root / "text/train.txt", "dev": root / "text/dev.txt",
            "test": root / "text/test.txt"}


def test_flickr_reads_captions_and_reports_every_quirk(flickr: Path) -> None:
    source = read_flickr(flickr / "text/tokens.txt", flickr / "images", split_files(flickr))
    records = {r.image_id: r for r in source.records}
    assert sorted(records) == ["1_a_jpg", "2_b_jpg", "3_c_jpg"]
    assert [c.text for c in records["1_a_jpg"].captions] == ["A black dog runs .",
                                                         "A dog in the grass ."]
    assert [c.origin.line for c in records["1_a_jpg"].captions] == [1, 2]
    assert records["2_b_jpg"].split == "train" and records["3_c_jpg"].split == "dev"
    assert records["3_c_jpg"].path == flickr / "images/3_c.jpg"
    assert records["3_c_jpg"].file == "3_c.jpg"
    assert sorted(reasons(source.problems), key=str) == sorted([
        ("missing_split_file", None),  # test list absent and not asked for: reported, left out
        ("duplicate_image", 3),        # train.txt line 3
        ("no_captions", 2),            # dev.txt line 2 (its empty caption, line 11, not again)
        ("odd_key", 4), ("duplicate_key", 5), ("malformed", 7)], key=str)
    odd = next(p for p in source.problems if p.reason == "odd_key")
    assert odd.origin.file.endswith("tokens.txt") and "2_b.jpg.1#0" in str(odd)
    no_captions = next(p for p in source.problems if p.reason == "no_captions")
    assert "4_d.jpg#0" in no_captions.detail
    # a written image's skipped captions go with it (reported when its shard is written)
    assert reasons(records["2_b_jpg"].dropped) == [("empty_caption", 6)]


def append_line(path: Path, line: bytes) -> None:
    with path.open("ab") as stream:
        stream.write(line + b"\n")


def test_flickr_lines_that_are_not_utf8_are_reported_and_skipped(flickr: Path) -> None:
    append_line(flickr / "text/tokens.txt", b"3_c.jpg#1\t" + NOT_UTF8)  # line 12
    append_line(flickr / "text/dev.txt", b"5_" + NOT_UTF8 + b".jpg")    # line 3
    source = read_flickr(flickr / "text/tokens.txt", flickr / "images", split_files(flickr))
    assert sorted(r.image_id for r in source.records) == ["1_a_jpg", "2_b_jpg", "3_c_jpg"]
    bad = [(Path(p.origin.file).name, p.origin.line, p.split) for p in source.problems
           if p.reason == "not_utf8"]
    assert bad == [("dev.txt", 3, "dev"), ("tokens.txt", 12, None)]


def test_flickr_requested_split_without_list_is_a_clear_error(flickr: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"split 'test'.*test\.txt.*--split-file"):
        read_flickr(flickr / "text/tokens.txt", flickr, split_files(flickr), ["train", "test"])
    with pytest.raises(ValueError, match="no split list"):
        read_flickr(flickr / "text/tokens.txt", flickr, split_files(flickr), ["val"])


def test_flickr_selected_splits_and_missing_token_file(flickr: Path) -> None:
    source = read_flickr(flickr / "text/tokens.txt", flickr, split_files(flickr), ["dev"])
    assert [r.image_id for r in source.records] == ["3_c_jpg"]
    with pytest.raises(FileNotFoundError, match="token file"):
        read_flickr(flickr / "nope.txt", flickr, split_files(flickr), ["dev"])


def test_karpathy_json_flickr_and_coco_styles(tmp_path: Path) -> None:
    data = {"dataset": "coco", "images": [
        {"filepath": "val2014", "filename": "COCO_val2014_000000000042.jpg", "split": "restval",
         "sentences": [{"raw": "A man rides a horse.", "tokens": ["a", "man"]},
                       {"tokens": ["a", "horse"]},  # no raw: tokens joined
                       {"raw": "  ", "tokens": []}]},
        {"filename": "1_a.jpg", "split": "test", "sentences": [{"raw": "A dog."}]},
        {"filename": "1_a.jpg", "split": "train", "sentences": [{"raw": "Again."}]},
        {"split": "train", "sentences": []},
        {"filename": "2_b.jpg", "split": "val", "sentences": [{"raw": ""}]},
    ]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(data))
    source = read_karpathy(path, tmp_path / "images")
    coco, flickr = source.records
    assert coco.image_id == "val2014__COCO_val2014_000000000042_jpg"
    assert coco.path == tmp_path / "images/val2014/COCO_val2014_000000000042.jpg"
    assert [c.text for c in coco.captions] == ["A man rides a horse.", "a horse"]
    assert flickr.image_id == "1_a_jpg" and flickr.split == "test"
    assert [(p.reason, p.origin.item) for p in coco.dropped] == [
        ("empty_caption", "images[0].sentences[2]")]
    assert [(p.reason, p.origin.item) for p in source.problems] == [
        ("duplicate_image", "images[2]"), ("malformed", "images[3]"), ("no_captions", "images[4]")]
    assert rename_splits(source, {"restval": "train"}).records[0].split == "train"


def test_karpathy_bad_bytes_skip_the_sentence_or_image_that_holds_them(tmp_path: Path) -> None:
    data = {"images": [
        {"filename": "0.jpg", "split": "train", "sentences": [{"raw": "A dog."}, {"raw": "@"}]},
        {"filename": "1.jpg", "split": "train", "sentences": [{"raw": "@"}]},
        {"filename": "@.jpg", "split": "train", "sentences": [{"raw": "A cat."}]},
        {"filename": "3.jpg", "split": "@", "sentences": [{"raw": "A cat."}]},
        {"filename": "4.jpg", "split": "val", "sentences": [{"raw": "A cow."}]}]}
    path = tmp_path / "dataset.json"
    path.write_bytes(json.dumps(data).encode().replace(b"@", NOT_UTF8))
    source = read_karpathy(path, tmp_path)
    kept, other = source.records
    assert (kept.file, other.file) == ("0.jpg", "4.jpg")
    assert [c.text for c in kept.captions] == ["A dog."]
    (bad,) = kept.dropped
    assert (bad.reason, bad.origin.item) == ("not_utf8", "images[0].sentences[1]")
    assert "caf\\xe9" in bad.detail and "UTF-8" in bad.detail
    assert [(p.reason, p.origin.item) for p in source.problems] == [
        ("no_captions", "images[1]"), ("not_utf8", "images[2]"), ("not_utf8", "images[3]")]
    assert all(p.origin.file == str(path) for p in source.problems)


def test_karpathy_escaped_lone_surrogates_skip_the_sentence_or_image(tmp_path: Path) -> None:
    # valid JSON, but half a surrogate pair cannot be written as UTF-8 (the shard writer's error)
    text = json.dumps({"images": [
        {"filename": "0.jpg", "split": "train", "sentences": [{"raw": "A dog."},
                                                              {"raw": "smile \ud83d"}]},
        {"filepath": "@", "filename": "1.jpg", "split": "train", "sentences": [{"raw": "A cat."}]},
        {"filename": "2.jpg", "split": "val", "sentences": [{"raw": "\ud83d\ude00 a pair"}]}]})
    path = tmp_path / "dataset.json"
    path.write_text(text.replace("@", "\\ud800"))  # json.dumps escapes the others itself
    source = read_karpathy(path, tmp_path)
    kept, pair = source.records
    assert [c.text for c in kept.captions] == ["A dog."]
    (bad,) = kept.dropped
    assert (bad.reason, bad.origin.item) == ("not_utf8", "images[0].sentences[1]")
    assert "'smile \\ud83d'" in bad.detail
    assert [(p.reason, p.origin.item) for p in source.problems] == [("not_utf8", "images[1]")]
    assert "\\ud800" in source.problems[0].detail
    assert pair.captions[0].text == "\U0001f600 a pair"  # a whole pair is one character
    for problem in (bad, *source.problems):
        str(problem).encode()  # reports can be written as UTF-8


def test_karpathy_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "dataset.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"images": [
        {"filename": "0.jpg", "split": "train", "sentences": [{"raw": "A dog."}]}]}).encode())
    source = read_karpathy(path, tmp_path)
    assert [r.file for r in source.records] == ["0.jpg"] and source.problems == []


def test_karpathy_rejects_other_json(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"annotations": []}')
    with pytest.raises(ValueError, match="no top-level 'images'"):
        read_karpathy(path, tmp_path)
    path.write_text("[" * 100_000)  # nested too deep for the decoder: named, not a RecursionError
    with pytest.raises(ValueError, match="x.json: cannot read the Karpathy-split JSON"):
        read_karpathy(path, tmp_path)


def test_jsonl_records_boxes_and_bad_lines(tmp_path: Path) -> None:
    lines = [
        {"image": "imgs/a.jpg", "captions": ["A dog.", "A black dog."], "split": "val",
         "boxes": [[1, 2, 10, 12]]},
        {"image": "/abs/b.png", "captions": ["A cat."]},  # no split: default
        "{not json",
        {"image": "imgs/c.jpg", "captions": "not a list"},
        {"image": "imgs/d.jpg", "captions": ["ok"], "boxes": [[1, 2, 3]]},
        {"image": "imgs/e.jpg", "captions": ["", 7]},
        {"image": "imgs/a.jpg", "captions": ["again"]},
        "[" * 100_000,  # nested too deep for the decoder: a RecursionError, not a crash
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    source = read_jsonl(path, tmp_path, default_split="test", allow_outside=True)
    a, b = source.records
    assert (a.image_id, a.split, a.file, a.boxes) == ("imgs__a_jpg", "val", "imgs/a.jpg",
                                                      [[1.0, 2.0, 10.0, 12.0]])
    assert a.path == tmp_path / "imgs/a.jpg" and [c.origin.line for c in a.captions] == [1, 1]
    assert (b.split, b.path) == ("test", Path("/abs/b.png"))
    assert reasons(source.problems) == [("malformed", 3), ("malformed", 4), ("bad_boxes", 5),
                               ("no_captions", 6), ("duplicate_image", 7),  # 6: one image
                               ("malformed", 8)]


def test_jsonl_line_that_is_not_utf8_is_reported_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"")
    for name, caption in (("a", b"A dog."), ("b", NOT_UTF8), ("c", b"A cat.")):
        append_line(path, b'{"image": "%s.jpg", "captions": ["%s"]}' % (name.encode(), caption))
    source = read_jsonl(path, tmp_path, "train")
    assert [r.image_id for r in source.records] == ["a_jpg", "c_jpg"]
    (problem,) = source.problems
    assert (problem.reason, problem.origin.line, problem.split) == ("not_utf8", 2, None)
    assert str(problem).startswith(f"{path}:2: not_utf8: byte 0xe9 ")


def test_jsonl_escaped_lone_surrogates_are_reported_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(  # written as JSON escapes: valid JSON, but not writable as UTF-8
        '{"image": "a.jpg", "captions": ["A dog.", "caf\\udce9"], "split": "train"}\n'
        '{"image": "b.jpg", "captions": ["caf\\udce9"], "split": "train"}\n'
        '{"image": "caf\\udce9.jpg", "captions": ["A cat."], "split": "train"}\n'
        '{"image": "d.jpg", "captions": ["A cow."], "split": "\\ud83d"}\n'
        '{"image": "e.jpg", "captions": ["\\ud83d\\ude00 a pair"], "split": "train"}\n')
    source = read_jsonl(path, tmp_path, "train")
    a, e = source.records
    assert [c.text for c in a.captions] == ["A dog."] and e.captions[0].text == "\U0001f600 a pair"
    (bad,) = a.dropped
    assert (bad.reason, bad.origin.line, bad.origin.item) == ("not_utf8", 1, "captions[1]")
    assert str(bad).startswith(f"{path}:1 [captions[1]]: not_utf8: caption 1 'caf\\xe9' is not")
    assert reasons(source.problems) == [("no_captions", 2), ("not_utf8", 3), ("not_utf8", 4)]
    assert "not UTF-8" in source.problems[0].detail and "\\ud83d" in source.problems[2].detail
    for problem in (bad, *source.problems):
        str(problem).encode()  # reports can be written as UTF-8


def test_jsonl_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"image": "a.jpg", "captions": ["A dog."]})
                     .encode() + b"\n")
    source = read_jsonl(path, tmp_path, "train")
    assert [r.image_id for r in source.records] == ["a_jpg"] and source.problems == []


def test_flickr_files_with_a_byte_order_mark(flickr: Path) -> None:
    before = read_flickr(flickr / "text/tokens.txt", flickr / "images", split_files(flickr))
    for name in ("tokens.txt", "train.txt"):
        text = flickr / "text" / name
        text.write_bytes(b"\xef\xbb\xbf" + text.read_bytes())
    after = read_flickr(flickr / "text/tokens.txt", flickr / "images", split_files(flickr))
    assert after.records == before.records and reasons(after.problems) == reasons(before.problems)


def test_jsonl_images_outside_the_image_folder_are_refused_unless_allowed(tmp_path: Path) -> None:
    images, outside = tmp_path / "images", tmp_path / "elsewhere"
    images.mkdir()
    outside.mkdir()
    (images / "in.png").touch()
    (outside / "out.png").touch()
    (images / "link.png").symlink_to(outside / "out.png")
    (images / "sub").symlink_to(outside)
    lines = ["in.png", "../elsewhere/out.png", str(outside / "out.png"), "link.png",
             "sub/out.png", str(images / "in.png")]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"image": name, "captions": ["A dog."]}) + "\n"
                            for name in lines))
    source = read_jsonl(path, images, "train")
    assert [r.file for r in source.records] == ["in.png"]
    assert reasons(source.problems) == [("outside_images", n) for n in (2, 3, 4, 5)] + [
        ("duplicate_image", 6)]  # the same file, spelled as an absolute path inside the folder
    first = str(source.problems[0])
    assert first.startswith(f"{path}:2: outside_images: image '../elsewhere/out.png' is ")
    assert str(outside / "out.png") in first and "--allow-outside-images" in first
    assert "\n" not in first

    allowed = read_jsonl(path, images, "train", allow_outside=True)
    assert [r.file for r in allowed.records] == ["in.png", "../elsewhere/out.png", "link.png",
                                                 "sub/out.png"]
    assert reasons(allowed.problems) == [("duplicate_image", 3), ("duplicate_image", 6)]


def test_flickr_and_karpathy_refuse_images_outside_the_image_folder(tmp_path: Path) -> None:
    (tmp_path / "tokens.txt").write_text("a.jpg#0\tA dog .\n../b.jpg#0\tA cat .\n")
    (tmp_path / "train.txt").write_text("a.jpg\n../b.jpg\n")
    flickr = read_flickr(tmp_path / "tokens.txt", tmp_path / "images",
                         {"train": tmp_path / "train.txt"})
    assert [r.file for r in flickr.records] == ["a.jpg"]
    assert reasons(flickr.problems) == [("outside_images", 2)]
    data = {"images": [{"filepath": "..", "filename": "b.jpg", "split": "train",
                        "sentences": [{"raw": "A cat."}]}]}
    (tmp_path / "k.json").write_text(json.dumps(data))
    karpathy = read_karpathy(tmp_path / "k.json", tmp_path / "images")
    assert [(p.reason, p.origin.item) for p in karpathy.problems] == [
        ("outside_images", "images[0]")]
    assert len(read_karpathy(tmp_path / "k.json", tmp_path / "images",
                             allow_outside=True).records) == 1


def test_files_with_one_stem_are_two_images_and_one_file_twice_is_a_duplicate(
        tmp_path: Path) -> None:
    lines = ["dup.png", "dup.jpg", "dup.png", "./dup.png", "sub/../dup.jpg"]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"image": name, "captions": ["A dog."]}) + "\n"
                            for name in lines))
    source = read_jsonl(path, tmp_path, "train")
    assert [(r.file, r.image_id) for r in source.records] == [("dup.png", "dup_png"),
                                                              ("dup.jpg", "dup_jpg")]
    assert reasons(source.problems) == [("duplicate_image", n) for n in (3, 4, 5)]

    (tmp_path / "tokens.txt").write_text("dup.png#0\tA dog .\ndup.jpg#0\tA cat .\n")
    (tmp_path / "train.txt").write_text("dup.png\ndup.jpg\n")
    flickr = read_flickr(tmp_path / "tokens.txt", tmp_path, {"train": tmp_path / "train.txt"})
    assert sorted(r.image_id for r in flickr.records) == ["dup_jpg", "dup_png"]
    data = {"images": [{"filename": name, "split": "train", "sentences": [{"raw": "A dog."}]}
                       for name in ("dup.png", "dup.jpg")]}
    (tmp_path / "k.json").write_text(json.dumps(data))
    karpathy = read_karpathy(tmp_path / "k.json", tmp_path)
    assert [r.image_id for r in karpathy.records] == ["dup_png", "dup_jpg"]
    assert karpathy.problems == []


def test_image_keys_are_unique_and_readable_webdataset_keys() -> None:
    names = ["dup.png", "dup.jpg", "dup", "dup_png", "a/b.jpg", "a_b.jpg", "a__b.jpg",
             "a/b_jpg", "a b.jpg", "a.b.jpg", "a-b.jpg", "a/b-c.jpg", "my pics/a.b c.PNG"]
    keys = [image_key(name) for name in names]
    assert len(set(keys)) == len(names), keys
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", key) for key in keys), keys
    assert image_key("1000268201_693b08cb0e.jpg") == "1000268201_693b08cb0e_jpg"
    assert image_key("val2014/COCO_val2014_1.jpg") == "val2014__COCO_val2014_1_jpg"
    assert re.fullmatch(r"my_pics_a_b_c_PNG-[0-9a-f]{8}", image_key("my pics/a.b c.PNG"))
    assert image_key("my pics/a.b c.PNG") == image_key("my pics/a.b c.PNG")  # stable
