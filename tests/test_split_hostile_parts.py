"""The split index's front (trainer/search/split.py) against parts that answer badly: the front is
the real `defrag serve --parts` process; its two parts are small HTTP servers in this process that
answer /api/info as parts 0 and 1 of one merge would, part 0 a well-formed search, part 1 what a
misconfigured or compromised part (or a proxy before it) may send: a page that is not JSON, JSON
that is not a search's answer, or a huge body. docs/search-app.md: such a part is named in
"missing_parts", the other parts' results come back, and the front reads at most ANSWER_BYTES of
an answer. Also a part's refusal of fragment bodies that break the JSON parser (a 400 line)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from starlette.exceptions import HTTPException

import trainer.search.serve as serve
from tests import DEFRAG
from tests.cluster import free_port
from tests.test_split_index import wait_for
from trainer.search.split import REPLACED, PartClient
from trainer.search.web import SPLIT_HEADER

MIB = 2**20
HUGE = 128 * MIB  # part 1's answer of a search in test_a_part_s_huge_answer_is_not_held_whole
GOOD = {"query": "q", "exact": True, "gap": 0.0, "scored": 1, "results": [
    {"rank": 1, "image": "a.png", "score": 1.5, "url": "/images/a.png"}]}
ROWS = {"image": None, "fragments": [[0.25, 0.5]]}  # an upload's fragments (POST /api/fragments)


class Part(BaseHTTPRequestHandler):
    """Part `server.number` of a two-part split: its /api/info, and for a search
    `server.search()`: (status, content type, body length, body chunks), for an upload's
    fragments (POST /api/fragments) `server.embed()`; every answer with the split header
    `server.label(path)`. The POSTs' paths and bodies are kept in `server.posted`."""

    def do_GET(self) -> None:
        self.server.seen.append(self.path)
        if self.path == "/api/info":
            self.answer(*answering(200, "application/json", {
                "model": "m", "model_key": "k", "images": 1, "sentences": 1,
                "max_query_chars": 1000, "max_image_pixels": 1,
                "split": {"id": self.server.split_id, "part": self.server.number, "parts": 2}}))
        else:
            self.answer(*self.server.search())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posted.append((self.path, body))
        self.answer(*(self.server.embed() if self.path == "/api/fragments"
                      else self.server.search()))

    def answer(self, status: int, media: str, size: int, chunks: Iterator[bytes]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(size))
        self.send_header(SPLIT_HEADER, self.server.label(self.path))
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)

    def log_message(self, *args: object) -> None:
        pass


def answering(status: int, media: str, body: bytes | dict) -> tuple[int, str, int, list]:
    body = body if isinstance(body, bytes) else json.dumps(body).encode()
    return status, media, len(body), [body]


def huge_answer() -> Iterator[bytes]:
    """A search answer of HUGE bytes: no results, padded."""
    head, tail = b'{"results": [], "exact": true, "gap": 0.0, "scored": 0, "pad": "', b'"}'
    yield head
    left = HUGE - len(head) - len(tail)
    while left:
        chunk = min(left, MIB)
        yield b"x" * chunk
        left -= chunk
    yield tail


def fake_parts(*split_ids: str) -> list[ThreadingHTTPServer]:
    """Parts 0, 1, ... of the splits named (in threads), each answering GOOD until told else."""
    parts = []
    for number, split_id in enumerate(split_ids):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Part)
        server.number, server.split_id, server.seen, server.posted = number, split_id, [], []
        server.search = lambda: answering(200, "application/json", GOOD)
        server.embed = lambda: answering(200, "application/json", ROWS)
        server.label = labelled(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        parts.append(server)
    return parts


def labelled(server: ThreadingHTTPServer) -> Callable[[str], str]:
    """The split header of the part `server` is, whatever the path."""
    return lambda path: f"{server.split_id} {server.number}/2"


def urls_of(parts: list[ThreadingHTTPServer]) -> list[str]:
    return [f"http://127.0.0.1:{server.server_address[1]}" for server in parts]


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, subprocess.Popen, list[ThreadingHTTPServer], Path]]:
    """The two parts (in threads) and the front (a process, its part timeout 20 s, its log)."""
    parts = fake_parts("one", "one")
    urls = ",".join(urls_of(parts))
    port, log = free_port(), Path(tmp_path_factory.mktemp("review")) / "front.log"
    with log.open("w") as stderr:
        process = subprocess.Popen([DEFRAG, "serve", "--parts", urls, "--port", str(port),
                                    "--part-timeout", "20"], stdout=subprocess.DEVNULL,
                                   stderr=stderr)
    try:
        wait_for(f"http://127.0.0.1:{port}/api/info", process, log)
        yield f"http://127.0.0.1:{port}", process, parts, log
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        for server in parts:
            server.shutdown()


@pytest.fixture(autouse=True)
def good_parts(request: pytest.FixtureRequest) -> None:
    """Every part of the `front` answers GOOD at the start of each test that uses it."""
    if "front" in request.fixturenames:
        for part in request.getfixturevalue("front")[2]:
            part.search = lambda: answering(200, "application/json", GOOD)
            part.embed = lambda: answering(200, "application/json", ROWS)
            part.label = labelled(part)


@pytest.mark.slow
@pytest.mark.parametrize("media, body", [
    ("text/html", b"<html>Sign in</html>"), ("application/json", b'{"detail": "Not Found"}'),
    ("application/json", json.dumps({**GOOD, "results": [{"rank": 1, "score": 9.0}]}).encode()),
], ids=["page", "other-json", "hit-without-image"])
def test_a_part_s_answer_that_is_not_a_search_names_it_missing(front, media: str,
                                                                body: bytes) -> None:
    """A part's 200 that is not a search's answer (a login page, another API's JSON) is a
    missing part: part 0's results, "exact": false."""
    url, _, parts, _ = front
    parts[1].search = lambda: answering(200, media, body)
    answer = requests.get(f"{url}/api/search", params={"q": "q", "k": 5}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"] == GOOD["results"] and answer.json()["exact"] is False
    assert [missing["part"] for missing in answer.json()["missing_parts"]] == [1]


@pytest.mark.slow
def test_an_upload_is_embedded_by_the_first_part_that_answers_its_fragments(front) -> None:
    """An upload at the front: part 0 answers POST /api/fragments with a page (named in one
    WARNING line), part 1 embeds it, and both parts search with part 1's rows."""
    url, _, parts, log = front
    parts[0].embed = lambda: answering(200, "text/html", b"<html>Sign in</html>")
    found = {**GOOD, "results": [{"rank": 1, "sentence": "a dog", "score": 1.5}]}
    for part in parts:
        part.search = lambda: answering(200, "application/json", found)
        part.posted.clear()
    answer = requests.post(f"{url}/api/sentences", params={"k": 5}, data=b"\x89PNG",
                           headers={"Content-Type": "image/png"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["exact"] is True and answer.json()["missing_parts"] == []
    assert [path for path, _ in parts[0].posted] == ["/api/fragments",
                                                      "/api/fragments/sentences?k=5"]
    for part in parts:
        assert json.loads(part.posted[-1][1]) == {"fragments": ROWS["fragments"]}
    assert ("POST /api/fragments answered without part 0 (http://127.0.0.1:"
            in log.read_text())


def peak_memory(process: subprocess.Popen) -> int:
    """The process's peak resident memory (VmHWM), bytes."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]
               ) * 1024


@pytest.mark.slow
def test_a_part_s_huge_answer_is_not_held_whole(front) -> None:
    """A part answering HUGE bytes (8x ANSWER_BYTES) is cut off and named missing: the front
    grows by less than a quarter of it."""
    url, process, parts, _ = front
    requests.get(f"{url}/api/search", params={"q": "q", "k": 5}, timeout=60)  # warm
    before = peak_memory(process)
    parts[1].search = lambda: (200, "application/json", HUGE, huge_answer())
    answer = requests.get(f"{url}/api/search", params={"q": "q", "k": 5}, timeout=60)
    grown = peak_memory(process) - before
    assert grown < HUGE // 4, f"the front grew by {grown / MIB:.0f} MiB"
    assert answer.status_code == 200 and answer.json()["exact"] is False, answer.text
    assert [missing["part"] for missing in answer.json()["missing_parts"]] == [1]


@pytest.mark.parametrize("fragments", [b"[" * 100_000 + b"]" * 100_000, b"[[" + b"9" * 400 + b"]]"])
def test_a_bad_fragments_body_is_a_400(fragments: bytes) -> None:
    """POST /api/fragments/sentences of a part: deep nesting (RecursionError) and an integer
    beyond float range (OverflowError) are a 400 line, as every bad input is."""
    with pytest.raises(HTTPException) as refused:
        serve.fragment_rows(b'{"fragments": ' + fragments + b"}", 1)
    assert refused.value.status_code == 400


@pytest.mark.slow
def test_a_part_s_500_text_is_not_passed_on(front) -> None:
    """A part's 500 may name its disk: the front says "answered HTTP 500", in the answer and the
    log, and never the part's text."""
    url, _, parts, log = front
    parts[1].search = lambda: answering(500, "application/json", {"error": "/srv/secret broke"})
    answer = requests.get(f"{url}/api/search", params={"q": "q", "k": 5}, timeout=60).json()
    assert answer["missing_parts"][0]["error"] == "answered HTTP 500", answer
    assert "secret" not in json.dumps(answer) and "secret" not in log.read_text()


@pytest.mark.slow
def test_an_inexact_part_s_gap_is_the_merged_gap(front) -> None:
    """Part 1 not certified, its k-th at 1.0 with a gap of 0.75 (so it bounds what it left at
    1.75): the merged top k of 1.5 and 1.0 has the gap 1.75 - 1.0, and "exact": false."""
    url, _, parts, _ = front
    parts[1].search = lambda: answering(200, "application/json", {
        **GOOD, "exact": False, "gap": 0.75,
        "results": [{"rank": 1, "image": "b.png", "score": 1.0, "url": "/images/b.png"}]})
    answer = requests.get(f"{url}/api/search", params={"q": "q", "k": 5}, timeout=60).json()
    assert [hit["image"] for hit in answer["results"]] == ["a.png", "b.png"]
    assert (answer["exact"], answer["gap"], answer["missing_parts"]) == (False, 0.75, [])


@pytest.mark.slow
def test_an_image_name_reaches_its_part_quoted(front) -> None:
    """/images/NAME goes to the part that holds it with the name percent-quoted: a '?' or '#'
    in it cannot become the part's query string or fragment."""
    url, _, parts, _ = front
    for part in parts:
        part.search = lambda: answering(200, "application/json", {
            "image": "a?b#c.png", "fragments": [[0.5, 0.25]]})
        part.seen.clear()
    requests.get(f"{url}/images/a%3Fb%23c.png", timeout=60)
    assert "/images/a%3Fb%23c.png" in parts[0].seen + parts[1].seen, parts[0].seen


@pytest.mark.slow
def test_a_part_that_now_serves_another_index_is_missing(front) -> None:
    """Part 1 restarted on another merge since the front checked it (its answers' split header
    differs): a search is part 0's alone, "exact": false, naming part 1; an image file whose
    answer has another split header is not passed on (503)."""
    url, _, parts, _ = front
    parts[1].label = lambda path: "two 1/2"
    answer = requests.get(f"{url}/api/search", params={"q": "q", "k": 5}, timeout=60).json()
    assert [hit["image"] for hit in answer["results"]] == ["a.png"]
    assert answer["exact"] is False
    assert [(m["part"], m["error"]) for m in answer["missing_parts"]] == [(1, REPLACED)]
    for part in parts:  # the fragments of a.png (which finds its part) come well labelled
        part.search = lambda: answering(200, "application/json", {
            "image": "a.png", "fragments": [[0.5, 0.25]]})
        part.label = lambda path, part=part: ("two 0/2" if path.startswith("/images/")
                                              else f"one {part.number}/2")
    image = requests.get(f"{url}/images/a.png", timeout=60)
    assert image.status_code == 503 and REPLACED in image.json()["error"], image.text


def test_parts_of_two_merges_are_refused() -> None:
    """Parts 0 and 1 whose split ids differ (two merges of --parts 2) are not one split."""
    parts = fake_parts("one", "two")
    try:
        with pytest.raises(ValueError, match="the parts come from different merges"):
            PartClient.connect(urls_of(parts), 1.0, wait=0)
    finally:
        for server in parts:
            server.shutdown()
