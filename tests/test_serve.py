"""trainer/search/serve.py, the search web app, as a real uvicorn server on 127.0.0.1 over the
index of a small trained model (tests/search_world.py): a caption finds its image first, an indexed
or uploaded image finds sentences, Figure 4 comes back as a PNG, /openapi.json documents the API;
every bad input of issue #17 gets one clear 4xx line and the server answers afterwards."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import requests
import torch
from PIL import Image
from uvicorn.config import STARTUP_FAILURE

import trainer.search.index_builder
import trainer.search.serve as serve
import trainer.search.web as web
from defrag.files import CHECKSUMS
from tests import DEFRAG
from tests.search_world import SearchWorld, search_world, serving
from tests.test_images import png_header
from trainer.search.fragment_set import FragmentSet
from trainer.search.index import IndexMismatch, SearchIndex

pytestmark = pytest.mark.slow
UPLOAD_LIMIT = 64 * 1024  # the fixture server's --max-upload-mb: small, so a huge upload is cheap
STATIC = Path(serve.__file__).parent / "static"
UPLOADS = ["/api/sentences", "/api/fragments"]  # an image searched with, and (a split front's
# request to a part) only embedded: the same limits and refusals


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> SearchWorld:
    return search_world(tmp_path_factory.getbasetemp() / "search-world")


@pytest.fixture(scope="module")
def index(world: SearchWorld) -> SearchIndex:
    return SearchIndex.open(world.index)


@pytest.fixture(scope="module")
def url(index: SearchIndex) -> Iterator[str]:
    with serving(serve.create_app(index, UPLOAD_LIMIT)) as base:
        yield base


def raw(url: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request with `path` sent exactly as given (requests would normalise `..`)."""
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def encoded(path: Path, kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.open(path).convert("RGB").save(out, format=kind)
    return out.getvalue()


def model_key(folder: Path) -> str:
    return hashlib.sha256((folder / CHECKSUMS).read_bytes()).hexdigest()


# ---------------------------------------------------------------- what the app answers


def test_a_caption_finds_its_image_first(world: SearchWorld, url: str) -> None:
    answer = requests.get(f"{url}/api/search", params={"q": world.query, "k": 3}).json()
    assert answer["query"] == world.query
    assert [hit["rank"] for hit in answer["results"]] == [1, 2, 3]
    best = answer["results"][0]
    assert best["image"] == world.expected
    scores = [hit["score"] for hit in answer["results"]]
    assert scores == sorted(scores, reverse=True) and scores[0] - scores[1] > world.margin / 2
    picture = requests.get(url + best["url"])
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
    assert picture.content == (world.photos / world.expected).read_bytes()
    assert requests.get(f"{url}/api/info").json() == {
        "model": str(world.model_dir.resolve()), "model_key": model_key(world.model_dir),
        "images": 8, "sentences": 40, "max_query_chars": 1000, "max_upload_bytes": UPLOAD_LIMIT,
        "max_k": serve.MAX_K, "max_image_pixels": 40_000_000}


def test_an_indexed_or_uploaded_image_finds_sentences(world: SearchWorld, index: SearchIndex,
                                                      url: str) -> None:
    indexed = requests.get(f"{url}/api/sentences",
                           params={"image": world.expected, "k": 5}).json()
    expected = index.sentences_for_image(world.expected, k=5).hits
    assert [hit["sentence"] for hit in indexed["results"]] == [hit.item for hit in expected]
    assert (indexed["exact"], indexed["gap"]) == (True, 0.0)
    assert [hit["rank"] for hit in indexed["results"]] == [1, 2, 3, 4, 5]
    # The same file uploaded: embedded again (the index keeps fp16 rows), the same sentences.
    upload = requests.post(f"{url}/api/sentences", params={"k": 5},
                           data=(world.photos / world.expected).read_bytes(),
                           headers={"Content-Type": "image/png"}).json()
    assert [hit["sentence"] for hit in upload["results"]] == [hit.item for hit in expected]
    assert [hit["score"] for hit in upload["results"]] == pytest.approx(
        [hit.score for hit in expected], abs=1e-2)
    # A photo the index does not hold, as JPEG (the twin of an indexed scene).
    twin = world.photos.parent / "source" / "images" / "val_00001.png"
    answer = requests.post(f"{url}/api/sentences", data=encoded(twin, "JPEG"),
                           headers={"Content-Type": "image/jpeg"})
    assert answer.status_code == 200
    assert len(answer.json()["results"]) == 10


def test_explain_draws_figure_4(world: SearchWorld, url: str) -> None:
    params = {"q": world.query, "image": world.expected}
    picture = requests.get(f"{url}/api/explain", params=params)
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
    assert min(Image.open(io.BytesIO(picture.content)).size) > 0
    details = requests.get(f"{url}/api/explain", params={**params, "format": "json"}).json()
    assert (details["image"], details["sentence"]) == (world.expected, world.query)
    assert details["fragments"] and all(
        f["box"] == 0 and f["xyxy"] == [0, 0, 64, 64] for f in details["fragments"])


def test_the_api_is_documented_and_nothing_comes_from_the_internet(url: str) -> None:
    schema = requests.get(f"{url}/openapi.json").json()
    endpoints = {(path, method) for path, methods in schema["paths"].items() for method in methods}
    assert endpoints == {("/api/info", "get"), ("/api/search", "get"), ("/api/sentences", "get"),
                         ("/api/sentences", "post"), ("/api/explain", "get"),
                         ("/images/{name}", "get")}
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            assert operation["summary"] and operation["description"], (path, method)
    upload = schema["paths"]["/api/sentences"]["post"]
    assert "image/*" in upload["requestBody"]["content"]
    assert {"400", "413", "415"} <= set(upload["responses"])
    assert requests.get(f"{url}/docs").status_code == 404
    assert requests.get(f"{url}/redoc").status_code == 404
    page = requests.get(url)
    assert page.status_code == 200 and "<title>DeFrag search</title>" in page.text
    for name in ("index.html", "app.js", "style.css"):
        assert requests.get(f"{url}/static/{name}").text == (STATIC / name).read_text()
        assert not re.search(r"https?:|@import|url\(", (STATIC / name).read_text()), name


def test_concurrent_searches_answer_as_one_at_a_time(world: SearchWorld, url: str) -> None:
    """8 clients at once (the thread pool runs the model in parallel) get the serial answers."""
    queries = [text for texts in world.captions.values() for text in texts]

    def search(text: str) -> list[tuple[str, float]]:
        answer = requests.get(f"{url}/api/search", params={"q": text, "k": 4}).json()
        return [(hit["image"], round(hit["score"], 4)) for hit in answer["results"]]

    serial = [search(text) for text in queries]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(search, queries)) == serial


# ---------------------------------------------------------------- bad inputs


LONG = "redcircles " * 910  # 10,010 characters


@pytest.mark.parametrize("path, params, status, message", [
    ("/api/search", {"q": ""}, 400, "the query is empty: type a sentence"),
    ("/api/search", {"q": "   "}, 400, "the query is empty: type a sentence"),
    ("/api/search", {"q": "xyzzy plugh"}, 400, "the query has no fragment the model knows"),
    ("/api/search", {"q": LONG}, 400, "the query has 10009 characters; at most 1000 are searched"),
    ("/api/search", {}, 422, "q: Field required"),
    ("/api/search", {"q": "a red star", "k": 0}, 422, "k: Input should be greater than or equal"),
    ("/api/search", {"q": "a red star", "k": 10**6}, 422, "k: Input should be less than or equal"),
    ("/api/sentences", {"image": "../index.json"}, 400, "is not an image of this index"),
    ("/api/explain", {"q": "a red star", "image": "nope.png"}, 400, "is not an image of this"),
    ("/api/explain", {"q": "xyzzy", "image": "val_00000.png"}, 400, "no fragment the model"),
    ("/api/explain", {"q": "a red star", "image": "val_00000.png", "format": "gif"}, 422,
     "format: Input should be 'png' or 'json'"),
], ids=["empty", "blank", "unknown-words", "10k-characters", "no-query", "k-0", "k-huge",
        "unknown-image", "explain-unknown-image", "explain-unknown-words", "explain-format"])
def test_a_bad_query_gets_one_clear_line(url: str, path: str, params: dict, status: int,
                                          message: str) -> None:
    answer = requests.get(url + path, params=params)
    assert (answer.status_code, answer.headers["content-type"]) == (status, "application/json")
    assert message in answer.json()["error"] and "\n" not in answer.json()["error"]
    assert requests.get(f"{url}/api/info").status_code == 200


@pytest.mark.parametrize("body, kind, status, message", [
    (b"this is not an image", "image/png", 400,
     "unusable image: the uploaded file is not an image file PIL can identify"),
    (b"GIF89a" + bytes(30), "image/gif", 400, "unusable image: the uploaded file "),
    ("gif", "image/gif", 400, "the uploaded file is GIF, not JPEG, PNG or WebP"),
    (b"", "image/png", 400, "the upload is empty"),
    (b"\x89PNG", "", 415, "with Content-Type image/jpeg, image/png or image/webp (got none)"),
    (b"\x89PNG", "text/plain", 415, "(got 'text/plain')"),
    (b"x" * (UPLOAD_LIMIT + 1), "image/png", 413, "over the limit of 0.0625 MiB"),
], ids=["not-an-image", "truncated-gif", "gif", "empty", "no-type", "text", "over-limit"])
@pytest.mark.parametrize("path", UPLOADS)
def test_a_bad_upload_gets_one_clear_line(world: SearchWorld, url: str, body: bytes | str,
                                          kind: str, status: int, message: str,
                                          path: str) -> None:
    if body == "gif":
        body = encoded(world.photos / world.expected, "GIF")
    headers = {"Content-Type": kind} if kind else {}
    code, answer = raw(url, "POST", path, body, headers)
    assert code == status and message in answer.decode(), answer
    assert requests.get(f"{url}/api/info").status_code == 200


@pytest.mark.parametrize(("width", "height", "megapixels"), [
    (7000, 7000, "49"),
    (14000, 13000, "182"),  # over PIL's own guard too (179 Mpx: DecompressionBombError)
])
@pytest.mark.parametrize("path", UPLOADS)
def test_an_image_over_the_pixel_bound_answers_413(url: str, width: int, height: int,
                                                   megapixels: str, path: str) -> None:
    """A PNG over the 40 Mpx bound (its header alone: it cannot be decoded) is refused from its
    header, before decoding."""
    code, answer = raw(url, "POST", path, png_header(width, height),
                       {"Content-Type": "image/png"})
    assert code == 413 and json.loads(answer) == {"error": (
        f"unusable image: the uploaded file is {width} x {height} pixels ({megapixels} "
        f"megapixels), over the limit of 40000000 (40 megapixels): scale it down, or raise "
        f"the limit (max_image_pixels)")}
    assert requests.get(f"{url}/api/info").status_code == 200


def test_uploads_are_decoded_at_most_upload_slots_at_a_time(
        world: SearchWorld, index: SearchIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four simultaneous uploads to a server with one slot, two searched with and two only
    embedded (the split front's POST /api/fragments), are embedded one after another (each kept
    busy 0.2 s, so they would overlap without the slot), and all are answered."""
    embed, active, most, lock = index.embed_file, 0, 0, threading.Lock()

    def counted(path: Path) -> FragmentSet:
        nonlocal active, most
        with lock:
            active += 1
            most = max(most, active)
        time.sleep(0.2)
        try:
            return embed(path)
        finally:
            with lock:
                active -= 1

    monkeypatch.setattr(index, "embed_file", counted)
    photo = (world.photos / world.expected).read_bytes()
    with serving(serve.create_app(index, UPLOAD_LIMIT, upload_slots=1)) as base, \
            ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda path: requests.post(
            f"{base}{path}", data=photo, headers={"Content-Type": "image/png"}),
            ["/api/sentences", "/api/fragments"] * 2))
    assert [answer.status_code for answer in answers] == [200] * 4 and most == 1
    own = embed(world.photos / world.expected).embeddings
    assert answers[1].json()["fragments"] == own.tolist()


def test_the_upload_threads_end_when_the_server_stops(world: SearchWorld,
                                                     index: SearchIndex) -> None:
    """The decoding threads of a stopped app are shut down with it, not left behind."""
    before = set(threading.enumerate())
    photo = (world.photos / world.expected).read_bytes()
    with serving(serve.create_app(index, UPLOAD_LIMIT, upload_slots=2)) as base:
        answer = requests.post(f"{base}/api/sentences", data=photo,
                               headers={"Content-Type": "image/png"})
        assert answer.status_code == 200
        assert [t for t in threading.enumerate() if t.name.startswith("upload")
                and t not in before]
    assert [t.name for t in threading.enumerate() if t.name.startswith("upload")
            and t not in before] == []


def test_an_upload_beyond_the_slots_is_not_read(world: SearchWorld, index: SearchIndex) -> None:
    """Two uploads that send 100 bytes of their body, then stall, to a server of one slot: one
    reads in the slot until its 1 s deadline (408, closed); the other is refused in 0.2 s (503,
    Retry-After) with its body unread. The slot is free again for a whole upload."""
    photo = (world.photos / world.expected).read_bytes()
    app = serve.create_app(index, UPLOAD_LIMIT, upload_slots=1, upload_wait=0.2, upload_read=1)

    def stalled(base: str) -> tuple[int, float, dict[str, str]]:
        where = urlsplit(base)
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=5)
        connection.putrequest("POST", "/api/sentences")
        for name, value in (("Content-Type", "image/png"), ("Content-Length", len(photo))):
            connection.putheader(name, str(value))
        connection.endheaders(photo[:100])
        started = time.monotonic()
        with contextlib.closing(connection):
            response = connection.getresponse()
            response.read()
            return response.status, time.monotonic() - started, dict(response.getheaders())

    with serving(app) as base, ThreadPoolExecutor(2) as pool:
        (busy, waited, busy_headers), (slow, read, slow_headers) = sorted(
            pool.map(stalled, [base, base]), key=lambda answer: answer[0], reverse=True)
        whole = requests.post(f"{base}/api/sentences", data=photo,
                              headers={"Content-Type": "image/png"})
    assert (busy, busy_headers["retry-after"]) == (503, str(web.RETRY_AFTER_SECONDS))
    assert waited < 0.9 < read and (slow, slow_headers["connection"]) == (408, "close")
    assert whole.status_code == 200


def test_an_upload_is_read_no_further_than_the_limit(url: str) -> None:
    """A Content-Length over the limit is refused before the body; a chunked body (no length)
    as soon as it passes the limit, though it never ends."""
    where = urlsplit(url)
    for declared in (True, False):
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        connection.putrequest("POST", "/api/sentences")
        connection.putheader("Content-Type", "image/jpeg")
        if declared:
            connection.putheader("Content-Length", str(10**12))
            connection.endheaders()
        else:
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            chunk = b"x" * 8192
            for _ in range(UPLOAD_LIMIT // len(chunk) + 1):
                connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = connection.getresponse()
        assert response.status == 413, declared
        assert "over the limit" in response.read().decode()
        connection.close()
    assert requests.get(f"{url}/api/info").status_code == 200


def test_fragments_sent_to_a_part_are_bounded(url: str) -> None:
    """POST /api/fragments/sentences (what a split index's front sends a part): a body read no
    further than the upload limit, then rows of the model's dimension only, else one line."""
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    connection.putrequest("POST", "/api/fragments/sentences")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    chunk = b"[" * 8192  # never a whole JSON document
    for _ in range(UPLOAD_LIMIT // len(chunk) + 1):
        connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    response = connection.getresponse()
    assert response.status == 413 and "over the limit" in response.read().decode()
    connection.close()
    for body in (b"{}", b'{"fragments": [[1, 2]]}', b'{"fragments": [[NaN]]}', b"not json"):
        status, answer = raw(url, "POST", "/api/fragments/sentences", body,
                             {"Content-Type": "application/json"})
        assert status == 400 and json.loads(answer)["error"].startswith(
            'send {"fragments": [[...], ...]}: 1 to 1000 rows of'), (body, answer)


@pytest.mark.parametrize("path", [
    "/images/..%2F..%2Fetc%2Fpasswd", "/images/../x", "/images/..", "/images/%2e%2e",
    "/images/%2Fetc%2Fpasswd", "/images//etc/passwd", "/images/nope.png", "/images/",
    "/images/val_00000.png%00.txt", "/images/..%2Findex%2Findex.json", "ABSOLUTE",
], ids=lambda path: path.removeprefix("/images/") or "empty")
def test_only_indexed_images_are_served(world: SearchWorld, url: str, path: str) -> None:
    """Traversal, encoded or not, absolute paths (ABSOLUTE: an indexed file's), unknown names."""
    if path == "ABSOLUTE":
        path = "/images/" + str(world.photos / world.expected).replace("/", "%2F")
    status, body = raw(url, "GET", path)
    assert status == 404 and b'"error"' in body and b"root:" not in body
    assert requests.get(f"{url}/api/info").status_code == 200


def test_a_link_is_served_only_while_it_stays_in_the_folder(world: SearchWorld,
                                                             tmp_path: Path) -> None:
    """A link out of the folder is not indexed; a link inside is served until it is re-pointed
    out (to a secret here, /etc/passwd in the issue): then it answers what a file deleted since
    indexing answers, a 404 naming no path."""
    photos, secret = tmp_path / "photos", tmp_path / "secret.png"
    photos.mkdir()
    kept, gone = sorted(world.captions)[:2]
    for name in (kept, gone):
        (photos / name).write_bytes((world.photos / name).read_bytes())
    secret.write_bytes(b"root:x:0:0:" + (world.photos / kept).read_bytes())
    (photos / "linked.png").symlink_to(kept)
    (photos / "out.png").symlink_to(world.photos / gone)
    trainer.search.index_builder.main(["--model", str(world.model_dir), "--images", str(photos),
                                       "--out", str(tmp_path / "index"), "--workers", "1"])
    index = SearchIndex.open(tmp_path / "index")
    assert index.image_names == ["linked.png", kept, gone]
    with serving(serve.create_app(index, UPLOAD_LIMIT)) as url:
        assert requests.get(f"{url}/images/linked.png").content == (photos / kept).read_bytes()
        (photos / "linked.png").unlink()
        (photos / "linked.png").symlink_to(secret)
        (photos / gone).unlink()
        answers = {name: requests.get(f"{url}/images/{name}") for name in ("linked.png", gone)}
    assert [answer.status_code for answer in answers.values()] == [404, 404]
    bodies = {answer.text.replace(name, "NAME") for name, answer in answers.items()}
    assert len(bodies) == 1, bodies
    assert "root:" not in bodies.pop() and str(tmp_path) not in "".join(
        answer.text for answer in answers.values())


def test_a_failure_is_one_line_too(index: SearchIndex, url: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a search answers 500 with its one line; the next search is served."""
    def broken(text: str, k: int) -> None:
        raise TypeError("something is wrong")

    monkeypatch.setattr(index, "images_for", broken)
    answer = requests.get(f"{url}/api/search", params={"q": "a red star"})
    assert answer.status_code == 500
    assert answer.json() == {"error": "internal error: TypeError: something is wrong"}
    monkeypatch.undo()
    assert requests.get(f"{url}/api/search", params={"q": "a red star"}).status_code == 200


def test_another_model_is_refused_naming_both_checksums(world: SearchWorld) -> None:
    built, other = model_key(world.model_dir)[:16], model_key(world.other_model_dir)[:16]
    with pytest.raises(IndexMismatch, match=f"{built}.*{other}"):
        SearchIndex.open(world.index, model=world.other_model_dir)
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--index", str(world.index), "--model", str(world.other_model_dir)])
    line = str(exit_.value.code)
    assert line.startswith("defrag serve: error: index ") and "\n" not in line
    assert built in line and other in line
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--index", str(world.photos)])
    assert "is not a search index" in str(exit_.value.code)


@pytest.mark.parametrize("keep", [20, -100], ids=["in-its-header", "in-its-rows"])
def test_a_truncated_index_file_is_named(world: SearchWorld, tmp_path: Path, keep: int) -> None:
    """An images.safetensors cut short (a copy that did not finish) stops the command in one
    line naming the file and what to do, not numpy's "mmap length is greater than file size"."""
    shutil.copytree(world.index, tmp_path / "index")
    rows = tmp_path / "index" / "images.safetensors"
    rows.write_bytes(rows.read_bytes()[:keep])
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--index", str(tmp_path / "index")])
    line = str(exit_.value.code)
    assert line.startswith(f"defrag serve: error: {rows}") and "\n" not in line
    assert ": the file is truncated or damaged: rebuild the index with defrag index" in line


def test_the_command_serves_on_localhost_by_default(world: SearchWorld,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    started = {}
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, host, port: started.update(
        app=app, host=host, port=port))
    serve.main(["--index", str(world.index), "--workers", "1"])
    assert (started["host"], started["port"]) == ("127.0.0.1", 8000)
    with serving(started["app"]) as base:
        assert requests.get(f"{base}/api/info").json()["max_upload_bytes"] == 10 * 2**20
    serve.main(["--index", str(world.index), "--workers", "1", "--max-image-pixels", "4000"])
    with serving(started["app"]) as base:  # a 64 x 64 photo is over 4000 pixels
        assert requests.get(f"{base}/api/info").json()["max_image_pixels"] == 4000
        answer = requests.post(f"{base}/api/sentences", headers={"Content-Type": "image/png"},
                               data=(world.photos / world.expected).read_bytes())
        assert answer.status_code == 413 and "over the limit of 4000" in answer.json()["error"]
    with pytest.raises(SystemExit):
        serve.main(["--index", str(world.index), "--max-image-pixels", "0"])


def test_one_worker_takes_every_cpu_unless_told(world: SearchWorld,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker runs CPUs / 1 torch threads; --threads sets them (one is faster on a busy
    machine, where a second thread waits for a core at each parallel step)."""
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, host, port: None)
    serve.main(["--index", str(world.index), "--workers", "1"])
    assert torch.get_num_threads() == serve.available_cpus()
    serve.main(["--index", str(world.index), "--workers", "1", "--threads", "1"])
    assert torch.get_num_threads() == 1  # restored after the test (conftest's kept_threads)
    with pytest.raises(SystemExit):
        serve.main(["--index", str(world.index), "--threads", "0"])


# ---------------------------------------------------------------- worker processes


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).ok
    except requests.ConnectionError:
        return False


def test_workers_share_the_port_and_each_holds_the_index(world: SearchWorld) -> None:
    """`defrag serve --workers 2`, the real command: on 127.0.0.1 by default, two worker
    processes each with the index's rows mapped, both taking connections on the one port and
    answering what one process answers, keep-alive requests not held back by Nagle's algorithm
    (a delayed ACK costs each >= 40 ms); the index read ahead once; SIGTERM stops them all."""
    port = free_port()
    server = subprocess.Popen([DEFRAG, "serve", "--index", str(world.index), "--port", str(port),
                               "--workers", "2"], stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while not answers(f"{url}/api/info"):
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not answer within 120 s"
            time.sleep(0.2)
        parent = psutil.Process(server.pid)
        assert [c.laddr for c in parent.net_connections("tcp") if c.status == "LISTEN"] == [
            ("127.0.0.1", port)]
        rows = str((world.index / "images.safetensors").resolve())
        while True:  # until both are up: the first answers while the other may be starting
            workers = [child for child in parent.children()
                       if rows in {m.path for m in child.memory_maps()}]
            held = connections_held(workers, port, url, world)
            if len(workers) == 2 and min(held) > 0:
                break
            assert time.monotonic() < deadline, (
                f"{len(workers)} workers map the index's rows, holding {held} connections")
        with requests.Session() as session:
            latencies = []
            for _ in range(21):
                started = time.perf_counter()
                assert session.get(f"{url}/api/info").ok
                latencies.append(time.perf_counter() - started)
        assert sorted(latencies)[10] < 0.03, latencies
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert server.returncode == 0
    assert not [worker for worker in workers if worker.is_running()]
    read_ahead = f"asked the kernel to read 0.00 GiB of {world.index} into the page cache"
    assert server.stderr.read().count(read_ahead) == 1  # once, for every worker


def test_workers_stop_when_their_supervisor_is_killed(world: SearchWorld) -> None:
    """`defrag serve --workers 2` killed by SIGKILL (kill -9, the OOM killer): its workers stop
    too instead of serving the port on their own (a new server could not bind it)."""
    port = free_port()
    server = subprocess.Popen([DEFRAG, "serve", "--index", str(world.index), "--port", str(port),
                               "--workers", "2"], stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}/api/info", time.monotonic() + 120
    rows = str((world.index / "images.safetensors").resolve())
    workers: list[psutil.Process] = []
    try:
        while len(workers) < 2 or not answers(url):
            assert server.poll() is None and time.monotonic() < deadline, "no 2 workers"
            time.sleep(0.2)
            workers = [child for child in psutil.Process(server.pid).children()
                       if rows in {m.path for m in child.memory_maps()}]
        server.kill()
        server.wait(timeout=60)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"{len(alive)} workers still running after their supervisor was killed"
        assert not answers(url)
    finally:
        for process in [server, *workers]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                process.kill()


def connections_held(workers: list[psutil.Process], port: int, url: str,
                     world: SearchWorld) -> list[int]:
    """16 clients search at once, each on a connection of its own (kept alive, so it stays with
    the worker that accepted it): how many each worker holds; every answer is checked."""
    sessions = [requests.Session() for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        found = list(pool.map(lambda session: session.get(
            f"{url}/api/search", params={"q": world.query, "k": 1}).json(), sessions))
    assert [answer["results"][0]["image"] for answer in found] == [world.expected] * 16
    held = [sum(c.laddr.port == port and c.status == "ESTABLISHED"
                for c in worker.net_connections("tcp")) for worker in workers]
    for session in sessions:
        session.close()
    assert sum(held) == 16, held
    return held


def test_a_bad_index_stops_the_command_in_one_line_before_any_worker(world: SearchWorld) -> None:
    """The parent opens the index once before starting workers: one line, exit status 1, no
    traceback of each worker."""
    result = subprocess.run([DEFRAG, "serve", "--index", str(world.photos), "--port",
                             str(free_port()), "--workers", "2"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith("defrag serve: error: ") and "is not a search index" in (
        result.stderr)


def test_workers_that_cannot_open_the_index_stop_the_command(world: SearchWorld) -> None:
    """Workers that fail at start-up (the index replaced after the command checked it: here the
    command's own check is pointed at the good index) stop the server with exit status 1 and one
    line each (the second may be stopped before it fails), not a loop of restarts."""
    check_good_open_bad = (
        "import sys, trainer.search.serve as serve\n"
        "opened = serve.SearchIndex.open\n"
        "serve.SearchIndex.open = lambda folder, *rest: opened(sys.argv[1], *rest)\n"
        "serve.main(sys.argv[2:])\n")
    result = subprocess.run([sys.executable, "-c", check_good_open_bad, str(world.index),
                             "--index", str(world.photos), "--port", str(free_port()),
                             "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    failures = [line for line in result.stderr.splitlines() if "is not a search index" in line]
    assert 1 <= len(failures) <= 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(r"\ndefrag serve: error: [12] of 2 workers could not start: their lines "
                     r"are above$", result.stderr.strip()), result.stderr


def test_a_worker_opens_its_index_with_its_share_of_threads(world: SearchWorld,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    """A worker's app (what uvicorn's factory builds in each process) serves the index of its
    settings with their torch threads; an index it cannot open is one error line and uvicorn's
    start-up failure status, which stops the server instead of restarting the worker forever."""
    settings = serve.WorkerSettings(index=str(world.index), model=None,
                                    max_upload_bytes=UPLOAD_LIMIT, max_image_pixels=4000,
                                    upload_slots=1, threads=1)
    monkeypatch.setenv(serve.SETTINGS_VARIABLE, settings.to_json())
    monkeypatch.setenv(serve.SUPERVISOR_VARIABLE, str(os.getppid()))
    with serving(serve.app_from_env()) as base:
        info = requests.get(f"{base}/api/info").json()
        assert torch.get_num_threads() == 1
    assert (info["max_upload_bytes"], info["max_image_pixels"]) == (UPLOAD_LIMIT, 4000)
    monkeypatch.setenv(serve.SETTINGS_VARIABLE, dataclasses.replace(
        settings, index=str(world.photos)).to_json())
    with pytest.raises(SystemExit) as exit_:
        serve.app_from_env()
    assert exit_.value.code == STARTUP_FAILURE
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "is not a search index" in errors[0] and "\n" not in errors[0]
