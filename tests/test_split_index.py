"""A split index (`defrag index --parts 2`, its units embedded by `--task I --tasks 2`) served by
two `defrag serve --index INDEX/part-P` processes and a `defrag serve --parts` front
(trainer/search/split.py), all real processes on 127.0.0.1, over the small collection of
tests/search_world.py plus twins (the same picture under names that fall in other parts, the
same sentence's fragments as another sentence): the front answers as the one-part index of the
same collection (items, scores, ties across parts, certificates); a part hung (SIGSTOP) or killed
(SIGKILL) mid-query is named in "missing_parts" within the front's timeout, "exact": false, and
the other parts' results still come back."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

import trainer.search.index_builder as index_builder
import trainer.search.serve as serve
from defrag.urls import redact
from tests import DEFRAG
from tests.cluster import free_port
from tests.search_world import SearchWorld, search_world, serving
from tests.test_arithmetic import one_thread
from trainer.search.index import SearchIndex
from trainer.search.split import PartClient

PARTS = 2
TIMEOUT = 3.0  # the front's --part-timeout
SECRET = "hunter2"  # the password in the last part's URL
FIRST, LAST = "0-twin.png", "zz-twin.png"  # copies of the query's image, in parts 0 and 1


@dataclass
class Served:
    """The one-part index (served in this process), the split's part processes and front."""

    world: SearchWorld
    reference: str
    front: str
    front_log: Path
    parts: list[subprocess.Popen]
    urls: list[str]
    images: list[list[str]]  # each part's images
    sentences: list[list[str]]  # each part's sentences


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> SearchWorld:
    return search_world(tmp_path_factory.getbasetemp() / "search-world")


def collection(world: SearchWorld, root: Path) -> list[str]:
    """The world's photos plus two copies of the query's image (named to fall in the first and
    the last part), its sentences plus two twins of one (the same fragments, first and last);
    the flags of `defrag index` for them."""
    photos = root / "photos"
    shutil.copytree(world.photos, photos)
    for twin in (FIRST, LAST):
        shutil.copy2(world.photos / world.expected, photos / twin)
    own = world.captions[world.expected]
    texts = [f"{own[0]} .", *(c for cs in world.captions.values() for c in cs), f"{own[0]} ,"]
    (root / "sentences.txt").write_text("".join(f"{text}\n" for text in texts))
    return ["--model", str(world.model_dir), "--images", str(photos),
            "--sentences", str(root / "sentences.txt"), "--workers", "1"]


@pytest.fixture(scope="module")
def served(world: SearchWorld, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Both indexes built, the parts and the front started at once (the front waits for the
    parts), the one-part index served in this process; all stopped at the end."""
    root = tmp_path_factory.mktemp("split")
    flags = collection(world, root)
    with one_thread():  # on more, a batch's twin pictures' rows differ by rounding
        index_builder.main([*flags, "--out", str(root / "whole")])
        for task in range(2):
            index_builder.main([*flags, "--out", str(root / "split"), "--task", str(task),
                                "--tasks", "2"])
        index_builder.main(["--merge", "--out", str(root / "split"), "--parts", str(PARTS)])
    ports = [free_port() for _ in range(PARTS + 1)]
    # the last part's URL with a password (a part behind a proxy's basic auth): never shown
    urls = [f"http://{f'front:{SECRET}@' if p == PARTS - 1 else ''}127.0.0.1:{port}"
            for p, port in enumerate(ports[:PARTS])]
    # part 1 on two threads, whose CNN rounds an upload's rows otherwise than one thread's
    parts = [subprocess.Popen([DEFRAG, "serve", "--index", str(root / "split" / f"part-{p}"),
                               "--port", str(ports[p]), "--workers", "1", "--threads", str(p + 1)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in range(PARTS)]
    front, front_log = f"http://127.0.0.1:{ports[-1]}", root / "front.log"
    with front_log.open("w") as log:
        parts.append(subprocess.Popen(
            [DEFRAG, "serve", "--parts", ",".join(urls), "--port", str(ports[-1]),
             "--part-timeout", str(TIMEOUT)], stdout=subprocess.DEVNULL, stderr=log))
    metas = [json.loads((root / "split" / f"part-{p}" / "index.json").read_text())
             for p in range(PARTS)]
    try:
        wait_for(f"{front}/api/info", parts[-1], front_log)
        with one_thread(), serving(serve.create_app(SearchIndex.open(root / "whole"),
                                                    10 * 2**20)) as whole:  # part 0's threads
            yield Served(world, whole, front, front_log, parts[:PARTS], urls,
                         [meta["images"] for meta in metas], [meta["sentences"] for meta in metas])
    finally:
        for process in parts:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in parts:
            process.wait(timeout=30)


def wait_for(url: str, process: subprocess.Popen, log: Path, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if requests.get(url, timeout=5).ok:
                return
        except requests.ConnectionError:
            pass
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{url} did not answer within {seconds} s"
        time.sleep(0.2)


def ask(url: str, path: str, **request: Any) -> requests.Response:
    method = "POST" if "data" in request else "GET"
    return requests.request(method, url + path, timeout=TIMEOUT + 30, **request)


def both(served: Served, path: str, **request: Any) -> tuple[dict, dict]:
    """The front's and the one-part index's JSON answers; a search's without `scored`, which
    counts each part's scoring, and the front's "missing_parts", which must be empty."""
    front, whole = ask(served.front, path, **request), ask(served.reference, path, **request)
    assert front.status_code == whole.status_code, (front.text, whole.text)
    front_json, whole_json = front.json(), whole.json()
    if "results" in whole_json:
        assert front_json.pop("missing_parts") == []
        assert front_json.pop("scored") >= 1 and whole_json.pop("scored") >= 1
    return front_json, whole_json


def part_of(served: Served, item: str) -> set[int]:
    return {p for p in range(PARTS) if item in served.images[p] + served.sentences[p]}


# ---------------------------------------------------------------- the front is the one-part index


@pytest.mark.slow
def test_the_split_is_two_ordinary_indexes_of_consecutive_slices(served: Served) -> None:
    assert [len(names) for names in served.images] == [5, 5]
    assert [len(texts) for texts in served.sentences] == [21, 21]
    info = ask(served.front, "/api/info").json()
    assert (info["images"], info["sentences"]) == (10, 42)
    assert [part["url"] for part in info["parts"]] == [redact(url) for url in served.urls]
    assert SECRET not in json.dumps(info) and "front:***@" in info["parts"][-1]["url"]
    assert part_of(served, FIRST) == {0} and part_of(served, LAST) == {1}
    own = served.world.captions[served.world.expected][0]
    assert [part_of(served, text) for text in (f"{own} .", own, f"{own} ,")] == [{0}, {1}, {1}]


@pytest.mark.slow
def test_searches_answer_as_the_one_part_index_ties_across_parts_included(
        served: Served) -> None:
    world = served.world
    queries = [world.query, *(cs[1] for cs in list(world.captions.values())[:3])]
    for query in queries:
        for k in (1, 3, 10):
            front, whole = both(served, "/api/search", params={"q": query, "k": k})
            assert front == whole and whole["exact"] is True, query
    _, whole = both(served, "/api/search", params={"q": world.query, "k": 3})
    hits = whole["results"]  # the one picture in parts 0 and 1: one score, index order
    assert [hit["image"] for hit in hits] == [FIRST, world.expected, LAST]
    assert len({hit["score"] for hit in hits}) == 1, hits
    for image in (world.expected, FIRST, LAST, sorted(world.captions)[-1]):
        for k in (2, 5, 42):
            front, whole = both(served, "/api/sentences", params={"image": image, "k": k})
            assert front == whole and whole["exact"] is True, image
    front, whole = both(served, "/api/sentences",
                        data=(world.photos / world.expected).read_bytes(),
                        headers={"Content-Type": "image/png"}, params={"k": 42})
    assert front == whole
    tied = [hit["sentence"] for hit in whole["results"]
            if hit["sentence"].startswith(world.captions[world.expected][0])]
    own = world.captions[world.expected][0]
    assert tied == [f"{own} .", own, f"{own} ,"]  # parts 0, 1 and 1
    assert len({hit["score"] for hit in whole["results"] if hit["sentence"] in tied}) == 1


@pytest.mark.slow
def test_errors_files_and_explanations_are_the_one_part_index_s(served: Served) -> None:
    world = served.world
    for path, params in [("/api/search", {"q": "  "}), ("/api/search", {"q": "a", "k": 0}),
                         ("/api/sentences", {"image": "nowhere.png"}),
                         ("/api/explain", {"q": world.query, "image": "nowhere.png"}),
                         ("/api/explain", {"q": world.query, "image": LAST,
                                           "format": "json"})]:
        front, whole = both(served, path, params=params)
        assert front == whole, path
    front, whole = both(served, "/api/sentences", data=b"not an image",
                        headers={"Content-Type": "image/png"})  # refused by part 0
    assert front == whole and "the uploaded file is not an image" in whole["error"]
    for name in (LAST, "nowhere.png"):
        front, whole = ask(served.front, f"/images/{name}"), ask(served.reference,
                                                                f"/images/{name}")
        assert (front.status_code, front.content) == (whole.status_code, whole.content)


@pytest.mark.slow
def test_the_front_takes_every_part_of_one_split_in_order(served: Served) -> None:
    with pytest.raises(ValueError, match=r"serves part 1 of 2, not part 0 of the 2 given"):
        PartClient.connect(served.urls[::-1], TIMEOUT)
    with pytest.raises(ValueError, match=r"serves part 0 of 2, not part 0 of the 1 given"):
        PartClient.connect(served.urls[:1], TIMEOUT)
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=rf"part {nobody} did not answer within 0 s"):
        PartClient.connect([served.urls[0], nobody + "/"], TIMEOUT, wait=0)


def test_the_flags_of_a_front_and_of_a_split_build_are_checked(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, error in [(["--parts", "http://127.0.0.1:1", "--workers", "2"], "--workers: for "
                         "--index"), (["--parts", "u", "--part-timeout", "0"], "--part-timeout "
                                      "must be > 0"), (["--index", "i", "--parts", "u"],
                                                       "not allowed with argument")]:
        with pytest.raises(SystemExit):
            serve.main(argv)
        assert error in capsys.readouterr().err
    for argv, error in [(["--merge", "--out", "x", "--parts", "0"], "--parts must be >= 1"),
                        (["--model", "m", "--images", "i", "--out", "x", "--task", "0",
                          "--tasks", "2", "--parts", "2"], "--parts is for the merge")]:
        with pytest.raises(SystemExit):
            index_builder.main(argv)
        assert error in capsys.readouterr().err


# ---------------------------------------------------------------- a part that does not answer


def without(served: Served, part: int, path: str, params: dict[str, str],
            k: int, **request: Any) -> list[dict[str, Any]]:
    """The one-part index's results but for the items of `part`, ranked again (an item's twin
    elsewhere, of the same text and score, stands in for it)."""
    everything = ask(served.reference, path, params={**params, "k": 42},
                     **request).json()["results"]
    gone, kept = Counter(served.images[part] + served.sentences[part]), []
    for hit in everything:
        item = hit.get("image") or hit["sentence"]
        if gone[item]:
            gone[item] -= 1
        else:
            kept.append(hit)
    return [{**hit, "rank": rank} for rank, hit in enumerate(kept[:k], 1)]


@pytest.mark.slow
def test_a_hung_part_is_named_after_the_timeout_and_the_others_answer(served: Served) -> None:
    """Part 1 (SIGSTOP) holds LAST: a search and the sentences of FIRST come from part 0 alone;
    LAST's sentences cannot be found (503). Asked at once, each answers after the timeout."""
    world, hung = served.world, served.parts[1]

    def timed(path: str, params: dict[str, Any]) -> tuple[float, requests.Response]:
        started = time.monotonic()
        answer = ask(served.front, path, params=params)
        return time.monotonic() - started, answer

    hung.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(3) as pool:
            (took, search), (took_first, first), (took_last, last) = pool.map(
                lambda request: timed(*request),
                [("/api/search", {"q": world.query, "k": 5}),
                 ("/api/sentences", {"image": FIRST, "k": 5}),
                 ("/api/sentences", {"image": LAST, "k": 5})])
    finally:
        hung.send_signal(signal.SIGCONT)
    assert all(TIMEOUT <= t < TIMEOUT + 2 for t in (took, took_first, took_last))
    shown = redact(served.urls[1])  # its password masked
    missing = [{"part": 1, "url": shown, "error": f"timed out after {TIMEOUT:g} s"}]
    for answer, params in ((search.json(), {"q": world.query}), (first.json(), {"image": FIRST})):
        assert (answer["exact"], answer["missing_parts"]) == (False, missing)
        path = "/api/search" if "q" in params else "/api/sentences"
        assert answer["results"] == without(served, 1, path, params, 5)
    assert (last.status_code, last.json()) == (503, {"error": (
        f"1 of 2 parts of the split index did not answer: part 1 ({shown}) timed out "
        f"after {TIMEOUT:g} s")})
    warnings = [line for line in served.front_log.read_text().splitlines()
                if line.startswith("WARNING ")]
    assert len(warnings) == 3
    assert all(f"part 1 ({shown}): timed out" in line for line in warnings)
    assert SECRET not in served.front_log.read_text()
    front, whole = both(served, "/api/search", params={"q": world.query, "k": 5})
    assert front == whole  # answered again


@pytest.mark.slow
def test_a_part_killed_mid_query_is_named_at_once(served: Served) -> None:
    world, killed = served.world, served.parts[0]
    killed.send_signal(signal.SIGSTOP)  # the query waits on it ...
    answers: list[dict[str, Any]] = []
    asking = threading.Thread(target=lambda: answers.append(ask(
        served.front, "/api/search", params={"q": world.query, "k": 5}).json()))
    started = time.monotonic()
    asking.start()
    time.sleep(TIMEOUT / 3)
    killed.kill()  # ... and its connection is reset
    asking.join()
    took = time.monotonic() - started
    assert took < TIMEOUT, took
    after = ask(served.front, "/api/search", params={"q": world.query, "k": 5}).json()
    for answer in (*answers, after):
        assert answer["exact"] is False and [m["part"] for m in answer["missing_parts"]] == [0]
        assert answer["results"] == without(served, 0, "/api/search", {"q": world.query}, 5)
        assert FIRST not in {hit["image"] for hit in answer["results"]}
    assert "timed out" not in after["missing_parts"][0]["error"]
    # an upload: part 1 embeds it in part 0's stead (on its two threads: the last bits of the
    # scores differ), its rows searched by part 1 alone
    upload = {"data": (world.photos / world.expected).read_bytes(),
              "headers": {"Content-Type": "image/png"}}
    uploaded = ask(served.front, "/api/sentences", params={"k": 5}, **upload).json()
    assert uploaded["exact"] is False and [m["part"] for m in uploaded["missing_parts"]] == [0]
    expected = without(served, 0, "/api/sentences", {}, 5, **upload)
    assert [hit["sentence"] for hit in uploaded["results"]] == [hit["sentence"] for hit in expected]
    assert [hit["score"] for hit in uploaded["results"]] == pytest.approx(
        [hit["score"] for hit in expected], rel=1e-5)
    # a bad upload: part 1's refusal, the one-part index's (not a 503 for part 0)
    front, whole = both(served, "/api/sentences", data=b"not an image",
                        headers={"Content-Type": "image/png"})
    assert front == whole and "the uploaded file is not an image" in whole["error"]
